//! Hostile chat templates against a live `afm serve`: a GGUF whose template doubles a string
//! in a loop (an exabyte within the fuel budget) costs its request a clear error, the next
//! request is served, and the server's memory stays where it was. Also the sandbox itself
//! through the library, with the real `afm __template-worker`: the same text as an in-process
//! render, the time limit, a fresh worker after a death, and the cost per render.
//!
//! The model is the committed tiny llama fixture with a `tokenizer.chat_template` added.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use afm_chat::template::{RenderLimits, SandboxConfig, TemplateSandbox};
use afm_chat::{ChatError, ChatTemplate};
use serde_json::{json, Map, Value};

/// Doubles a string 60 times when the first message is "boom"; otherwise a plain format.
const HOSTILE: &str = "{% if messages[0]['content'] == 'boom' %}\
{% set ns = namespace(x='a') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}\
{{ ns.x | length }}{% endif %}\
{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama/model-f32.gguf")
}

fn config() -> SandboxConfig {
    SandboxConfig::new(env!("CARGO_BIN_EXE_afm"), &["__template-worker"])
}

fn worker() -> Arc<TemplateSandbox> {
    TemplateSandbox::new(config())
}

// ---- a GGUF with one more string key ---------------------------------------------------

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) {
        let n = self.u64() as usize;
        self.take(n);
    }
    fn value(&mut self, ty: u32) {
        match ty {
            0 | 1 | 7 => drop(self.take(1)),
            2 | 3 => drop(self.take(2)),
            4..=6 => drop(self.take(4)),
            10..=12 => drop(self.take(8)),
            8 => self.string(),
            9 => {
                let (elem, n) = (self.u32(), self.u64());
                for _ in 0..n {
                    self.value(elem);
                }
            }
            other => panic!("GGUF value type {other}"),
        }
    }
}

/// `src` with `key` = `value` appended to its metadata (tensor data realigned to 32 bytes).
fn gguf_with_string(src: &[u8], key: &str, value: &str) -> Vec<u8> {
    let mut c = Cursor { b: src, at: 8 };
    let n_tensors = c.u64();
    let kv_at = c.at;
    let n_kv = c.u64();
    for _ in 0..n_kv {
        c.string();
        let ty = c.u32();
        c.value(ty);
    }
    let kv_end = c.at;
    for _ in 0..n_tensors {
        c.string();
        let dims = c.u32() as usize;
        c.take(dims * 8 + 4 + 8);
    }
    let infos_end = c.at;
    let data_at = infos_end.next_multiple_of(32);
    let mut out = src[..kv_end].to_vec();
    out[kv_at..kv_at + 8].copy_from_slice(&(n_kv + 1).to_le_bytes());
    let string = |out: &mut Vec<u8>, text: &str| {
        out.extend_from_slice(&(text.len() as u64).to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    };
    string(&mut out, key);
    out.extend_from_slice(&8u32.to_le_bytes()); // type: string
    string(&mut out, value);
    out.extend_from_slice(&src[kv_end..infos_end]);
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend_from_slice(&src[data_at..]);
    out
}

// ---- a live server -----------------------------------------------------------------------

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
        .port()
}

/// (status, body) of one HTTP/1.1 request.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

fn start(model: &Path) -> Server {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_afm"))
        .args(["serve", "-m"])
        .arg(model)
        .args(["-p", &port.to_string(), "--kv-memory", "64M"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("afm starts");
    let server = Server { child, port };
    let start = Instant::now();
    while http(port, "GET", "/health", "").0 != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "afm did not come up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// Resident memory of a process, in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb / 1024
}

fn chat(port: u16, content: &str) -> (u16, Value) {
    let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 4});
    let (status, text) = http(port, "POST", "/v1/chat/completions", &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[test]
fn a_string_doubling_template_costs_one_request_not_the_server() {
    let dir = std::env::temp_dir().join(format!("afm-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("hostile.gguf");
    let src = std::fs::read(fixture()).unwrap();
    std::fs::write(
        &model,
        gguf_with_string(&src, "tokenizer.chat_template", HOSTILE),
    )
    .unwrap();
    // `-s` one-shot goes through the same sandbox: one error line, exit 1.
    let one_shot = Command::new(env!("CARGO_BIN_EXE_afm"))
        .args(["serve", "-m"])
        .arg(&model)
        .args(["-s", "boom", "--max-tokens", "2", "--kv-memory", "64M"])
        .output()
        .expect("afm runs");
    let stderr = String::from_utf8_lossy(&one_shot.stderr);
    assert_eq!(one_shot.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("afm: error: ") && last.contains("exceeded its memory limit"),
        "{stderr}"
    );

    let server = start(&model);
    let pid = server.child.id();

    let (status, body) = chat(server.port, "hi");
    assert_eq!(status, 200, "{body}");
    let rss_before = rss_mib(pid);
    for round in 0..3 {
        let t0 = Instant::now();
        let (status, body) = chat(server.port, "boom");
        let took = t0.elapsed();
        assert_eq!(status, 400, "round {round}: {body}");
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("exceeded its memory limit"),
            "round {round}: {msg}"
        );
        assert!(
            took < Duration::from_secs(15),
            "round {round} took {took:?}"
        );
        eprintln!(
            "hostile render {round}: {status} in {:.0} ms: {msg}",
            took.as_secs_f64() * 1e3
        );
        // The next, normal request is served.
        let (status, body) = chat(server.port, "hi");
        assert_eq!(status, 200, "round {round}: {body}");
        assert!(body["choices"][0]["message"].is_object(), "{body}");
    }
    // Hostile renders hold no runtime thread: two at once (the runtime has two threads), and
    // /health still answers meanwhile.
    let port = server.port;
    let hostile: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(move || chat(port, "boom")))
        .collect();
    std::thread::sleep(Duration::from_millis(150));
    let t0 = Instant::now();
    let (status, _) = http(port, "GET", "/health", "");
    let health = t0.elapsed();
    assert_eq!(status, 200);
    for h in hostile {
        let (status, body) = h.join().unwrap();
        assert_eq!(status, 400, "{body}");
    }
    eprintln!(
        "/health answered in {:.1} ms during two hostile renders",
        health.as_secs_f64() * 1e3
    );
    assert!(
        health < Duration::from_millis(500),
        "/health took {health:?}"
    );
    let rss_after = rss_mib(pid);
    eprintln!("server RSS {rss_before} MiB before the hostile requests, {rss_after} MiB after");
    assert!(
        rss_after < rss_before + 64,
        "server RSS grew from {rss_before} to {rss_after} MiB"
    );
    let (status, _) = http(server.port, "GET", "/health", "");
    assert_eq!(status, 200);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- the sandbox through the library --------------------------------------------------------

fn conversation() -> (Vec<Value>, Vec<Value>) {
    let messages = vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "What is the weather in Paris? \u{e9}\u{1f600}"}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
        ]}),
        json!({"role": "tool", "content": "{\"temp\": 21}"}),
    ];
    let tools = vec![json!({"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})];
    (messages, tools)
}

fn qwen_template() -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/hf/qwen25/chat_template.jinja");
    std::fs::read_to_string(&p).unwrap_or_else(|_| {
        // Without the downloaded file, a ChatML template with tools is close enough.
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}\
         {% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\
         {% endif %}<|im_end|>\n{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            .to_string()
    })
}

#[test]
fn sandboxed_renders_equal_in_process_renders_and_cost_little() {
    let src = qwen_template();
    let here = ChatTemplate::from_source(&src, "", "<|im_end|>").unwrap();
    let there = ChatTemplate::from_source(&src, "", "<|im_end|>")
        .unwrap()
        .sandboxed(&worker())
        .unwrap();
    let (messages, tools) = conversation();
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let expected = here.render(&messages, Some(&tools), true, &kwargs).unwrap();
    assert_eq!(
        there
            .render(&messages, Some(&tools), true, &kwargs)
            .unwrap(),
        expected
    );
    // Two templates sharing one worker: it reloads whichever is asked for.
    let one = TemplateSandbox::new(SandboxConfig {
        max_workers: 1,
        ..config()
    });
    let qwen = ChatTemplate::from_source(&src, "", "<|im_end|>")
        .unwrap()
        .sandboxed(&one)
        .unwrap();
    let plain = ChatTemplate::fallback().sandboxed(&one).unwrap();
    let plain_expected = ChatTemplate::fallback()
        .render(&messages, None, true, &Map::new())
        .unwrap();
    for _ in 0..3 {
        assert_eq!(
            qwen.render(&messages, Some(&tools), true, &kwargs).unwrap(),
            expected
        );
        assert_eq!(
            plain.render(&messages, None, true, &Map::new()).unwrap(),
            plain_expected
        );
    }
    // The template's own errors come back as they are.
    let bad = ChatTemplate::from_source("{{ raise_exception('no system role') }}", "", "")
        .unwrap()
        .sandboxed(&worker())
        .unwrap();
    let err = bad.render(&messages, None, true, &Map::new()).unwrap_err();
    assert!(
        matches!(&err, ChatError::TemplateRaised(m) if m == "no system role"),
        "{err}"
    );

    // Cost per request: in-process vs. through the worker.
    let time = |t: &ChatTemplate| {
        let mut samples: Vec<f64> = (0..300)
            .map(|_| {
                let t0 = Instant::now();
                t.render(&messages, Some(&tools), true, &kwargs).unwrap();
                t0.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        samples.sort_by(f64::total_cmp);
        (samples[150], samples[285])
    };
    let (here_p50, here_p95) = time(&here);
    let (there_p50, there_p95) = time(&there);
    eprintln!(
        "render of a 4-message tool conversation: in-process p50 {here_p50:.0} us p95 {here_p95:.0} us; \
         sandboxed p50 {there_p50:.0} us p95 {there_p95:.0} us (added p50 {:.0} us)",
        there_p50 - here_p50
    );
    // Well under a millisecond on an idle machine; generous here for a shared, busy one.
    assert!(
        there_p50 - here_p50 < 2000.0,
        "the sandbox adds {:.0} us",
        there_p50 - here_p50
    );
}

#[test]
fn a_worker_past_its_limits_is_replaced_and_the_next_render_works() {
    let memory = ChatTemplate::from_source(HOSTILE, "", "")
        .unwrap()
        .sandboxed(&TemplateSandbox::new(SandboxConfig {
            memory_bytes: 256 << 20,
            ..config()
        }))
        .unwrap();
    let boom = [json!({"role": "user", "content": "boom"})];
    let hi = [json!({"role": "user", "content": "hi"})];
    for _ in 0..2 {
        let err = memory.render(&boom, None, true, &Map::new()).unwrap_err();
        assert!(
            matches!(err, ChatError::TemplateMemoryLimit { limit_mib: 256 }),
            "{err}"
        );
        let text = memory.render(&hi, None, true, &Map::new()).unwrap();
        assert_eq!(text, "user: hi\nassistant:");
    }

    // A loop with unlimited fuel: the wall-clock deadline ends it.
    let spin = "{% if messages[0]['content'] == 'spin' %}{% for i in range(100000) %}\
                {% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}ok";
    let slow = ChatTemplate::with_limits(
        spin,
        "",
        "",
        RenderLimits {
            fuel: 1 << 40,
            ..RenderLimits::default()
        },
    )
    .unwrap()
    .sandboxed(&TemplateSandbox::new(SandboxConfig {
        timeout: Duration::from_millis(500),
        ..config()
    }))
    .unwrap();
    let t0 = Instant::now();
    let err = slow
        .render(
            &[json!({"role": "user", "content": "spin"})],
            None,
            true,
            &Map::new(),
        )
        .unwrap_err();
    assert!(matches!(err, ChatError::TemplateTimeLimit { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(slow.render(&hi, None, true, &Map::new()).unwrap(), "ok");

    // Renders from many threads share the workers.
    let (messages, _) = conversation();
    let fallback = ChatTemplate::fallback().sandboxed(&worker()).unwrap();
    let expected = ChatTemplate::fallback()
        .render(&messages, None, true, &Map::new())
        .unwrap();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..20 {
                    let got = fallback.render(&messages, None, true, &Map::new()).unwrap();
                    assert_eq!(got, expected);
                }
            });
        }
    });

    // A worker program that is not one fails at load, naming it.
    let err = ChatTemplate::fallback()
        .sandboxed(&TemplateSandbox::new(SandboxConfig::new(
            "/nonexistent/afm",
            &[],
        )))
        .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/afm"), "{err}");
}
