//! `afm bench`: a declared workload against an in-process engine, one row per concurrency
//! level, with everything needed to compare runs recorded beside the numbers (model, weight
//! file hash, sampling, stream mode, concurrency, cache state).

use std::io::Read;

use afm_bench::{Report, Workload};
use afm_engine::{Engine, EngineConfig};
use afm_models::load_model;
use afm_models::source::{resolve_model, ModelLocation};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use serde_json::json;
use sha2::{Digest, Sha256};

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// GGUF file, HF-style directory, or HF id in the local cache.
    #[arg(short = 'm', long = "model")]
    pub model: String,
    /// Concurrency levels to sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub concurrency: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    pub gen_len: usize,
    /// Requests per level (default: 2 × the level, at least 4).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Fraction of each prompt shared by all requests (exercises the prefix cache).
    #[arg(long, default_value_t = 0.0)]
    pub shared_prefix: f64,
    /// Poisson arrival rate in requests/s (default: as fast as slots free up).
    #[arg(long)]
    pub rate: Option<f64>,
    #[arg(long)]
    pub kv_bits: Option<u8>,
    #[arg(long, default_value_t = 1024)]
    pub prefill_step_size: usize,
    #[arg(long)]
    pub disable_prefix_caching: bool,
    /// Write the results here as JSON.
    #[arg(long)]
    pub json: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let location = resolve_model(&args.model).map_err(|e| anyhow!("{e}"))?;
    let sha = weight_hash(&location)?;
    let model = load_model(&location).with_context(|| format!("loading {}", args.model))?;
    let (name, vocab) = (model.name.clone(), model.model.vocab_size());
    let max_conc = args.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let cfg = EngineConfig {
        concurrent: max_conc,
        max_waiting: usize::MAX / 2,
        max_context: (args.prompt_len + args.gen_len + 16).next_multiple_of(16),
        prefill_step_size: args.prefill_step_size,
        prefix_caching: !args.disable_prefix_caching,
        kv_bits: args.kv_bits,
        ..EngineConfig::default()
    };
    let engine = Engine::spawn(model, cfg).map_err(|e| anyhow!("starting the engine: {e}"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut reports: Vec<Report> = Vec::new();
    for (i, &c) in args.concurrency.iter().enumerate() {
        let w = Workload {
            prompt_len: args.prompt_len,
            gen_len: args.gen_len,
            requests: args.requests.unwrap_or((2 * c).max(4)),
            concurrency: c.max(1),
            shared_prefix: args.shared_prefix,
            rate: args.rate,
            seed: args.seed + i as u64,
        };
        eprintln!(
            "concurrency {c}: {} requests of {}+{} tokens",
            w.requests, w.prompt_len, w.gen_len
        );
        reports.push(runtime.block_on(afm_bench::run(&engine, vocab, &w, true)));
    }
    println!(
        "model {name} (sha256 {sha}), greedy, engine events (no HTTP), prefix caching {}, kv {}",
        on_off(!args.disable_prefix_caching),
        args.kv_bits
            .map_or("checkpoint precision".into(), |b| format!("{b}-bit"))
    );
    print!("{}", afm_bench::table(&reports));
    if let Some(path) = &args.json {
        let out = json!({
            "model": name,
            "weights_sha256": sha,
            "sampling": "greedy (temperature 0), no stop tokens",
            "stream": "engine events, no HTTP",
            "prefix_caching": !args.disable_prefix_caching,
            "kv_bits": args.kv_bits,
            "prefill_step_size": args.prefill_step_size,
            "threads": afm_runtime::threads::num_threads(),
            "results": reports,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// sha256 of the weight file (GGUF) or of config.json + safetensors files (directory).
fn weight_hash(loc: &ModelLocation) -> Result<String> {
    let files = match loc {
        ModelLocation::Gguf(p) => vec![p.clone()],
        ModelLocation::HfDir(d) => {
            let mut v: Vec<_> = std::fs::read_dir(d)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension()
                        .is_some_and(|x| x == "safetensors" || x == "json")
                })
                .collect();
            v.sort();
            v
        }
    };
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in files {
        let mut file =
            std::fs::File::open(&f).with_context(|| format!("reading {}", f.display()))?;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
