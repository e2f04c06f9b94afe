//! `afm bench --url` against a live `afm serve` on SmolLM2-135M Q4_1: every request completes,
//! the metrics are real numbers, the prefix cache's hits come back through `usage`, and the
//! JSON records what was run.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch_models.sh smollm2",
        p.display()
    );
    p
}

/// The server process, killed when the test ends however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
        .port()
}

fn healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    resp.starts_with("HTTP/1.1 200")
}

#[test]
fn bench_over_http_reports_a_live_servers_metrics() {
    let port = free_port();
    let server = Server(
        Command::new(env!("CARGO_BIN_EXE_afm"))
            .args(["serve", "-m"])
            .arg(model())
            .args(["-p", &port.to_string(), "--concurrent", "2"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start afm serve"),
    );
    let t0 = Instant::now();
    while !healthy(port) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "server did not come up"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let json = std::env::temp_dir().join(format!("afm_bench_http_{port}.json"));
    let out = Command::new(env!("CARGO_BIN_EXE_afm"))
        .args(["bench", "--url", &format!("http://127.0.0.1:{port}"), "-m"])
        .arg(model())
        .args([
            "--concurrency",
            "1,2",
            "--prompt-len",
            "64",
            "--gen-len",
            "8",
            "--requests",
            "4",
            "--shared-prefix",
            "0.5",
            "--vocab",
            "49152",
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("run afm bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "afm bench failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("ttft p50"), "no table:\n{stdout}");
    assert!(
        stderr.contains("4/4 requests"),
        "no progress bar:\n{stderr}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("JSON written"))
            .expect("valid JSON");
    drop(server);
    let _ = std::fs::remove_file(&json);
    assert_eq!(
        v["weights_sha256"].as_str().map(str::len),
        Some(64),
        "weights hash recorded: {v}"
    );
    assert!(v["model"].as_str().is_some_and(|m| !m.is_empty()));
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    for (r, conc) in results.iter().zip([1, 2]) {
        assert_eq!(r["workload"]["concurrency"], conc);
        assert_eq!(
            (r["completed"].as_u64(), r["failed"].as_u64()),
            (Some(4), Some(0)),
            "{r}"
        );
        for key in ["ttft_p50_ms", "prefill_tps", "aggregate_tps", "wall_s"] {
            let x = r[key].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{key} = {x}: {r}");
        }
        // 32 shared tokens = two full 16-token blocks: the requests that start after the
        // first one finished hit them (3 of 4 one at a time, 2 of 4 two at a time).
        let hit = r["cache_hit_rate"].as_f64().unwrap_or(0.0);
        let want = if conc == 1 { 3.0 } else { 2.0 } * 32.0 / 256.0;
        assert!(hit >= want - 1e-9, "cache hit rate {hit} < {want}: {r}");
    }
}
