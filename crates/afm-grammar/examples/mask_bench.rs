//! Grammar mask cost against a decode step, on a real model:
//!
//! ```text
//! cargo run --release -p afm-grammar --example mask_bench -- \
//!     models/SmolLM2-135M-Instruct.Q4_1.gguf tests/fixtures/schemas [seeds] [dialect]
//! ```
//!
//! For each schema, generates at temperature 1 under the grammar and times the constraint's
//! calls (mask, and commit, which computes the next mask); then times plain decode steps of
//! the same engine. Prints per-token means and the ratio. With a dialect (a
//! `--tool-call-parser` name), each schema is instead the parameters of one strict tool, called
//! with `tool_choice: required` in that dialect (schemas the dialect cannot honour are skipped).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use afm_api::{OutputConstraint, ToolDef};
use afm_chat::tool_calls::ToolCallFormat;
use afm_chat::Tokenizer;
use afm_engine::{
    ConstraintError, Engine, EngineConfig, EngineHandle, GenerateEvent, GenerateRequest,
    SamplingParams, TokenConstraint,
};
use afm_grammar::{GrammarError, Grammars};
use afm_models::source::ModelLocation;

/// Times the wrapped constraint: per token, its mask plus its commit (which computes the next
/// mask), in nanoseconds.
struct Timed {
    inner: Box<dyn TokenConstraint>,
    pending: u64,
    per_token: Arc<Mutex<Vec<u64>>>,
}

impl TokenConstraint for Timed {
    fn allowed(&mut self, allowed: &mut [u32]) -> Result<bool, ConstraintError> {
        let t0 = Instant::now();
        let r = self.inner.allowed(allowed);
        self.pending = t0.elapsed().as_nanos() as u64;
        r
    }
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        let t0 = Instant::now();
        let r = self.inner.commit(token);
        let ns = self.pending + t0.elapsed().as_nanos() as u64;
        self.per_token.lock().expect("not poisoned").push(ns);
        r
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
    let dialect = args
        .get(4)
        .map(|d| ToolCallFormat::from_name(d).expect("a dialect name"));
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
    let mut all: Vec<u64> = Vec::new();
    let mut compile_ms = 0.0;
    let mut compiled_count = 0usize;
    for path in &paths {
        let schema: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
        let t0 = Instant::now();
        let constraint = match dialect {
            None => OutputConstraint::JsonSchema {
                schema,
                param: "schema".into(),
            },
            Some(_) => OutputConstraint::ToolCalls {
                tools: vec![ToolDef {
                    name: "record".into(),
                    parameters: schema,
                }],
                required: true,
                parallel: false,
            },
        };
        let compiled =
            match grammars.compile(&constraint, dialect.unwrap_or(ToolCallFormat::Hermes)) {
                Ok(c) => c,
                Err(e @ GrammarError::Inexpressible { .. }) => {
                    println!("{:<28} skipped: {e}", path.display());
                    continue;
                }
                Err(e) => panic!("{}: {e}", path.display()),
            };
        compile_ms += t0.elapsed().as_secs_f64() * 1e3;
        compiled_count += 1;
        let per_token = Arc::new(Mutex::new(Vec::new()));
        let mut tokens = 0;
        for seed in 0..seeds {
            let timed = Timed {
                inner: compiled.constraint(false, false),
                pending: 0,
                per_token: per_token.clone(),
            };
            tokens += run(
                &engine,
                req(seed, 400, tok.eos_ids().to_vec()),
                Some(Box::new(timed)),
            )
            .0;
        }
        let mut times = per_token.lock().expect("not poisoned").clone();
        let (mean, p50, _, max) = stats(&mut times);
        println!(
            "{:<28} {:>4} tokens  mean {:>6.1} µs  p50 {:>6.1} µs  max {:>7.0} µs",
            path.file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned()),
            tokens,
            mean,
            p50,
            max
        );
        all.extend(times);
    }
    // Plain decode steps: 128 tokens, no stop ids, no constraint.
    let (mut steps, mut secs) = (0usize, 0.0);
    for seed in 0..3 {
        let (n, s) = run(&engine, req(seed, 128, Vec::new()), None);
        steps += n - 1;
        secs += s;
    }
    let step_us = secs * 1e6 / steps.max(1) as f64;
    let (mean, p50, p90, max) = stats(&mut all);
    println!(
        "schemas {}: compile {:.1} ms each; per token over {} tokens: mask mean {mean:.1} µs, \
         p50 {p50:.1} µs, p90 {p90:.1} µs, max {max:.0} µs; decode step {:.2} ms; \
         mean mask = {:.1}% of a step",
        compiled_count,
        compile_ms / compiled_count.max(1) as f64,
        all.len(),
        step_us / 1e3,
        100.0 * mean / step_us
    );
}

/// Mean, median, 90th percentile and maximum, in microseconds.
fn stats(ns: &mut [u64]) -> (f64, f64, f64, f64) {
    if ns.is_empty() {
        return (0.0, 0.0, 0.0, 0.0);
    }
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1e3;
    let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64 / 1e3;
    (mean, at(0.5), at(0.9), at(1.0))
}
