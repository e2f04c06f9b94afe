//! `afm bench`: a declared workload against an in-process engine, or with `--url` against a
//! running OpenAI-compatible server (afm, llama-server, …) over streamed HTTP; one row per
//! concurrency level, with everything needed to compare runs recorded beside the numbers
//! (model, weight file hash, sampling, stream mode, concurrency, cache state).

use std::io::Read;

use afm_bench::{HttpTarget, Report, Target, Workload};
use afm_engine::{Engine, EngineConfig};
use afm_models::load_model;
use afm_models::source::{resolve_model, ModelLocation};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use serde_json::json;
use sha2::{Digest, Sha256};

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// GGUF file, HF-style directory, or HF id in the local cache. With --url it is optional
    /// and only hashed, to record which weights the server runs.
    #[arg(short = 'm', long = "model", required_unless_present = "url")]
    pub model: Option<String>,
    /// Drive a running server instead of an in-process engine: http://HOST:PORT.
    #[arg(long)]
    pub url: Option<String>,
    /// Bearer token for --url.
    #[arg(long = "api-key", env = "AFM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The `model` field sent with --url (default: the first of the server's /v1/models).
    #[arg(long = "served-model")]
    pub served_model: Option<String>,
    /// Vocabulary size the random prompt ids are drawn from with --url (ids 256..7/8 of it).
    #[arg(long, default_value_t = 32000)]
    pub vocab: usize,
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
    if let Some(url) = &args.url {
        return run_http(args, url);
    }
    let model_arg = args.model.as_deref().expect("clap: --model unless --url");
    let location = resolve_model(model_arg).map_err(|e| anyhow!("{e}"))?;
    let sha = weight_hash(&location)?;
    let model = load_model(&location).with_context(|| format!("loading {model_arg}"))?;
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
    let reports = sweep(args, &runtime, &Target::Engine(engine.clone()), vocab);
    drop(runtime);
    engine.shutdown();
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

/// One report per concurrency level.
fn sweep(
    args: &BenchArgs,
    runtime: &tokio::runtime::Runtime,
    target: &Target,
    vocab: usize,
) -> Vec<Report> {
    let mut reports = Vec::new();
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
        reports.push(runtime.block_on(afm_bench::run(target, vocab, &w, true)));
    }
    reports
}

/// `--url`: the same workload over streamed HTTP. Engine-side options (KV bits, prefix
/// caching, step size) are the server's; the hit rate comes from its `usage`.
fn run_http(args: &BenchArgs, url: &str) -> Result<()> {
    let server_side = [
        ("--kv-bits", args.kv_bits.is_some()),
        ("--disable-prefix-caching", args.disable_prefix_caching),
        ("--prefill-step-size", args.prefill_step_size != 1024),
    ];
    if let Some((flag, _)) = server_side.iter().find(|(_, set)| *set) {
        anyhow::bail!("{flag} is a server setting; with --url, start the server with it instead");
    }
    let sha = match &args.model {
        Some(m) => Some(weight_hash(&resolve_model(m).map_err(|e| anyhow!("{e}"))?)?),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut target = HttpTarget::new(url, args.served_model.clone(), args.api_key.clone())
        .map_err(|e| anyhow!("{e}"))?;
    let served = runtime
        .block_on(target.served_model())
        .map_err(|e| anyhow!("{e}"))?;
    if target.model.is_empty() {
        target.model = served.clone();
    }
    let base = target.base().to_string();
    let model = target.model.clone();
    let reports = sweep(args, &runtime, &Target::Http(target), args.vocab);
    println!(
        "model {model} at {base} (sha256 {}), greedy, HTTP SSE /v1/completions, server-side cache",
        sha.as_deref()
            .unwrap_or("unknown: pass -m FILE to record it")
    );
    print!("{}", afm_bench::table(&reports));
    if let Some(path) = &args.json {
        let out = json!({
            "model": model,
            "server": base,
            "weights_sha256": sha,
            "sampling": "greedy (temperature 0), ignore_eos requested",
            "stream": "HTTP SSE, POST /v1/completions with token-id prompts, stream_options.include_usage",
            "prefix_caching": "server setting; hit rate from usage.prompt_tokens_details.cached_tokens",
            "vocab_for_prompts": args.vocab,
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
