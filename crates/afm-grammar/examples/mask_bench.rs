//! Grammar mask cost against a decode step, on a real model:
//!
//! ```text
//! cargo run --release -p afm-grammar --example mask_bench -- \
//!     models/SmolLM2-135M-Instruct.Q4_1.gguf tests/fixtures/schemas [seeds]
//! ```
//!
//! For each schema, generates at temperature 1 under the grammar and times the constraint's
//! calls (mask, and commit, which computes the next mask); then times plain decode steps of
//! the same engine. Prints per-token means and the ratio.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use afm_api::OutputConstraint;
use afm_chat::tool_calls::ToolCallFormat;
use afm_chat::Tokenizer;
use afm_engine::{
    ConstraintError, Engine, EngineConfig, EngineHandle, GenerateEvent, GenerateRequest,
    SamplingParams, TokenConstraint,
};
use afm_grammar::Grammars;
use afm_models::source::ModelLocation;

/// Times the wrapped constraint's calls (nanoseconds, and how many tokens).
struct Timed {
    inner: Box<dyn TokenConstraint>,
    nanos: Arc<AtomicU64>,
    max: Arc<AtomicU64>,
}

impl Timed {
    fn time<T>(&mut self, f: impl FnOnce(&mut Box<dyn TokenConstraint>) -> T) -> T {
        let t0 = Instant::now();
        let r = f(&mut self.inner);
        let ns = t0.elapsed().as_nanos() as u64;
        self.nanos.fetch_add(ns, Ordering::Relaxed);
        self.max.fetch_max(ns, Ordering::Relaxed);
        r
    }
}

impl TokenConstraint for Timed {
    fn allowed(&mut self, allowed: &mut [u32]) -> Result<bool, ConstraintError> {
        self.time(|c| c.allowed(allowed))
    }
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.time(|c| c.commit(token))
    }
    fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }
}

/// Generated tokens and decode seconds (first token to last).
fn run(
    engine: &EngineHandle,
    req: GenerateRequest,
    c: Option<Box<dyn TokenConstraint>>,
) -> (usize, f64) {
    let (_, mut rx) = engine.submit_constrained(req, c).expect("submitted");
    let mut n = 0;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerateEvent::Token { .. } => n += 1,
            GenerateEvent::Finished { stats, .. } => return (n, stats.completion_time),
            GenerateEvent::Error { message } => panic!("{message}"),
        }
    }
    (n, 0.0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model_path = PathBuf::from(
        args.get(1)
            .map_or("models/SmolLM2-135M-Instruct.Q4_1.gguf", String::as_str),
    );
    let dir = PathBuf::from(args.get(2).map_or("tests/fixtures/schemas", String::as_str));
    let seeds: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(2);
    let model = afm_models::load_model(&ModelLocation::Gguf(model_path)).expect("model loads");
    let tok = Tokenizer::from_gguf(model.gguf().expect("a GGUF")).expect("tokenizer");
    let t0 = Instant::now();
    let grammars = Grammars::new(&tok).expect("token trie");
    println!(
        "token trie for {} tokens: {:.0} ms",
        tok.vocab_size(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    let engine = Engine::spawn(model, EngineConfig::default()).expect("engine");
    let prompt = tok.encode(
        "<|im_start|>user\nGive an example as JSON.<|im_end|>\n<|im_start|>assistant\n",
        false,
        true,
    );
    let req = |seed: u64, max_tokens: usize, stop: Vec<u32>| GenerateRequest {
        prompt_tokens: prompt.clone(),
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        max_tokens,
        stop_token_ids: stop,
        top_logprobs: None,
    };
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("schema directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let (mut total_ns, mut total_tokens, mut worst) = (0u64, 0usize, 0u64);
    let mut compile_ms = 0.0;
    for path in &paths {
        let schema: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
        let t0 = Instant::now();
        let compiled = grammars
            .compile(
                &OutputConstraint::JsonSchema {
                    schema,
                    param: "schema".into(),
                },
                ToolCallFormat::Hermes,
            )
            .expect("schema compiles");
        compile_ms += t0.elapsed().as_secs_f64() * 1e3;
        let (nanos, max) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let mut tokens = 0;
        for seed in 0..seeds {
            let timed = Timed {
                inner: compiled.constraint(false, false),
                nanos: nanos.clone(),
                max: max.clone(),
            };
            tokens += run(
                &engine,
                req(seed, 400, tok.eos_ids().to_vec()),
                Some(Box::new(timed)),
            )
            .0;
        }
        let ns = nanos.load(Ordering::Relaxed);
        println!(
            "{:<28} {:>4} tokens  {:>6.1} µs/token  (worst call {:>6.0} µs)",
            path.file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned()),
            tokens,
            ns as f64 / 1e3 / tokens.max(1) as f64,
            max.load(Ordering::Relaxed) as f64 / 1e3
        );
        total_ns += ns;
        total_tokens += tokens;
        worst = worst.max(max.load(Ordering::Relaxed));
    }
    // Plain decode steps: 128 tokens, no stop ids, no constraint.
    let (mut steps, mut secs) = (0usize, 0.0);
    for seed in 0..3 {
        let (n, s) = run(&engine, req(seed, 128, Vec::new()), None);
        steps += n - 1;
        secs += s;
    }
    let mask_us = total_ns as f64 / 1e3 / total_tokens.max(1) as f64;
    let step_us = secs * 1e6 / steps.max(1) as f64;
    println!(
        "schemas {}: compile {:.1} ms each; mask {mask_us:.1} µs/token (worst call {:.0} µs) \
         over {total_tokens} tokens; decode step {:.2} ms; mask = {:.1}% of a step",
        paths.len(),
        compile_ms / paths.len().max(1) as f64,
        worst as f64 / 1e3,
        step_us / 1e3,
        100.0 * mask_us / step_us
    );
}
