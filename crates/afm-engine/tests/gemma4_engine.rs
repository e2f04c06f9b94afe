//! Gemma 4 through the engine (scheduler, paged KV with per-layer shapes, prefix cache,
//! batching) on the tiny checkpoints of `scripts/gen_tiny_gemma4.py`: greedy tokens and top-3
//! log-probabilities after a 66-token prompt (past the sliding window of 8) must be those
//! transformers computed, alone, beside other requests, and on a prefix-cache hit.
//!
//! `AFM_TEST_DEVICE=cuda` runs them on a GPU (where decode steps go through CUDA graphs).

use std::path::PathBuf;

use afm_engine::*;
use afm_models::source::ModelLocation;
use afm_runtime::compute::{Device, DeviceChoice};

struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    /// Per step: (token, logprob) of the three likeliest tokens.
    top3: Vec<Vec<(u32, f32)>>,
    tokens: Vec<u32>,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).expect("reference");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    let tokens = ids(&v["tokens"]);
    let n = v["greedy_prompt_len"].as_u64().expect("prompt len") as usize;
    let top3 = v["greedy_top3_logprobs"]
        .as_array()
        .expect("top3")
        .iter()
        .map(|step| {
            step.as_array()
                .expect("step")
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                .collect()
        })
        .collect();
    Reference {
        prompt: tokens[..n].to_vec(),
        greedy: ids(&v["greedy"]),
        top3,
        tokens,
    }
}

fn engine(name: &str) -> EngineHandle {
    let choice: DeviceChoice = std::env::var("AFM_TEST_DEVICE")
        .unwrap_or_else(|_| "cpu".into())
        .parse()
        .expect("AFM_TEST_DEVICE");
    let dev = Device::open(choice).expect("device");
    let m = afm_models::load_model_on(&ModelLocation::HfDir(fixture(name)), &dev).expect("load");
    Engine::spawn(
        m,
        EngineConfig {
            max_context: 256,
            kv_budget_bytes: Some(16 << 20),
            ..Default::default()
        },
    )
    .expect("spawn")
}

type Steps = Vec<(u32, Vec<(u32, f32)>)>;

async fn run(e: &EngineHandle, prompt: Vec<u32>, max_tokens: usize) -> (Steps, usize) {
    let (_, mut rx) = e
        .submit(GenerateRequest {
            prompt_tokens: prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop_token_ids: vec![],
            top_logprobs: Some(3),
        })
        .expect("submit");
    let mut out = Vec::new();
    loop {
        match rx.recv().await.expect("event") {
            GenerateEvent::Token { id, logprob } => out.push((id, logprob.expect("logprobs").top)),
            GenerateEvent::Finished { stats, .. } => return (out, stats.cached_tokens),
            GenerateEvent::Error { message } => panic!("{message}"),
        }
    }
}

/// Greedy tokens equal, and each step's top-3 log-probabilities within 1e-3 of transformers'.
fn assert_matches(what: &str, got: &Steps, r: &Reference) {
    let tokens: Vec<u32> = got.iter().map(|(t, _)| *t).collect();
    assert_eq!(tokens, r.greedy, "{what}: greedy tokens");
    let mut worst = 0f32;
    for (step, ((_, top), want)) in got.iter().zip(&r.top3).enumerate() {
        for ((a, la), (b, lb)) in top.iter().zip(want) {
            assert_eq!(a, b, "{what} step {step}: top tokens");
            worst = worst.max((la - lb).abs());
        }
    }
    eprintln!("{what}: top-3 logprobs within {worst:.1e} of transformers");
    assert!(worst < 1e-3, "{what}: logprob error {worst}");
}

async fn check(name: &str) {
    let r = reference(name);
    let e = engine(name);
    let (cold, cached) = run(&e, r.prompt.clone(), r.greedy.len()).await;
    assert_eq!(cached, 0);
    assert_matches(&format!("{name} alone"), &cold, &r);
    // A prefix-cache hit: four full 16-token blocks of the 66-token prompt are reused, and
    // the sliding-window layers must still see exactly what a cold run saw.
    let (warm, cached) = run(&e, r.prompt.clone(), r.greedy.len()).await;
    assert_eq!(cached, 64, "{name}: cached prompt tokens");
    assert_matches(&format!("{name} prefix-cache hit"), &warm, &r);
    // Beside two other requests (different lengths, a shared prefix), in one batch.
    let others = [r.tokens[3..50].to_vec(), r.tokens[..70].to_vec()];
    let (a, b, c) = tokio::join!(
        run(&e, others[0].clone(), 5),
        run(&e, r.prompt.clone(), r.greedy.len()),
        run(&e, others[1].clone(), 5),
    );
    assert_matches(&format!("{name} batched"), &b.0, &r);
    assert_eq!(a.0.len(), 5);
    assert_eq!(c.0.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma4_dense_matches_transformers_through_the_engine() {
    check("gemma4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma4_moe_matches_transformers_through_the_engine() {
    check("gemma4_moe").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma4_per_layer_inputs_match_transformers_through_the_engine() {
    check("gemma4_ple").await;
}
