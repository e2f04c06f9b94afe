//! The engine on a hybrid model (tiny random Qwen3.5 from `scripts/gen_tiny_qwen3_5.py`):
//! each running sequence gets its own recurrent-state slot, sequences batched together
//! reproduce transformers' greedy tokens and their solo runs, and cancellation and preemption
//! give slots back (a leaked slot would fail the next admission). Prefix caching is on (the
//! default) throughout, so a preempted sequence resumes from its own state snapshot; the
//! prefix cache's own checks are in `qwen3_5_prefix_cache.rs`.

use std::path::{Path, PathBuf};

use afm_engine::*;
use afm_models::source::ModelLocation;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3_5")
}

/// (reference tokens, greedy prompt length, transformers' greedy continuation)
fn reference() -> (Vec<u32>, usize, Vec<u32>) {
    let text = std::fs::read_to_string(fixture().join("reference.json")).expect("reference");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .expect(k)
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    let n = v["greedy_prompt_len"].as_u64().expect("prompt len") as usize;
    (ids("tokens"), n, ids("greedy"))
}

fn engine(cfg: EngineConfig) -> EngineHandle {
    let m = afm_models::load_model(&ModelLocation::HfDir(fixture())).expect("load");
    Engine::spawn(m, cfg).expect("spawn")
}

fn request(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        sampling: SamplingParams::default(),
        max_tokens,
        stop_token_ids: vec![],
        top_logprobs: None,
    }
}

async fn collect(mut rx: EventReceiver) -> (Vec<u32>, FinishReason) {
    let mut toks = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, .. } => toks.push(id),
            GenerateEvent::Finished { reason, .. } => return (toks, reason),
            GenerateEvent::Error { message } => panic!("engine error: {message}"),
        }
    }
    panic!("event stream ended without Finished");
}

/// Prompts of different lengths, cut from the reference sequence.
fn prompts(tokens: &[u32]) -> Vec<Vec<u32>> {
    vec![
        tokens[..8].to_vec(),
        tokens[10..31].to_vec(),
        tokens[5..9].to_vec(),
        tokens[20..57].to_vec(),
    ]
}

async fn alone(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let e = engine(EngineConfig {
        concurrent: 1,
        max_context: 128,
        kv_budget_bytes: Some(4 << 20),
        ..Default::default()
    });
    let mut out = Vec::new();
    for p in prompts {
        let (_, rx) = e.submit(request(p, max_tokens)).expect("submit");
        out.push(collect(rx).await.0);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_sequences_keep_their_own_state_and_cancel_frees_the_slot() {
    let (tokens, n, greedy) = reference();
    let ps = prompts(&tokens);
    let want = alone(&ps, 16).await;
    assert_eq!(want[0], greedy, "alone: transformers' greedy tokens");
    let e = engine(EngineConfig {
        concurrent: 2,
        max_context: 128,
        kv_budget_bytes: Some(4 << 20),
        prefill_step_size: 16, // chunked prefill beside decode
        ..Default::default()
    });
    // Two slots: A and a request cancelled mid-generation, then B beside A in the freed slot.
    let (_, ra) = e.submit(request(&tokens[..n], 16)).expect("A");
    let (cid, mut rc) = e.submit(request(&ps[3], 64)).expect("C");
    for _ in 0..3 {
        assert!(matches!(rc.recv().await, Some(GenerateEvent::Token { .. })));
    }
    e.cancel(cid);
    let (_, rb) = e.submit(request(&ps[1], 16)).expect("B");
    let (a, b) = (collect(ra).await, collect(rb).await);
    assert_eq!(a.0, greedy, "A beside C, then beside B");
    assert_eq!(b.0, want[1], "B in the slot C gave back");
    // Every slot is back: two more requests run side by side.
    let (_, r2) = e.submit(request(&ps[2], 16)).expect("D");
    let (_, r3) = e.submit(request(&ps[3], 16)).expect("E");
    assert_eq!(collect(r2).await.0, want[2]);
    assert_eq!(collect(r3).await.0, want[3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempted_sequences_recompute_their_state() {
    let (tokens, _, _) = reference();
    let ps = prompts(&tokens);
    let want = alone(&ps, 40).await;
    // Six blocks of 16 tokens for sequences needing 3 + 4 + 3 + 5 blocks at the end: those
    // running must preempt each other to grow.
    let per_block = 2 * 2 * 16 * 4 * 16; // K and V, 2 KV heads × 16 dims, f32, 16 tokens
    let e = engine(EngineConfig {
        concurrent: 4,
        max_context: 80,
        kv_budget_bytes: Some(6 * per_block),
        ..Default::default()
    });
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| e.submit(request(p, 40)).expect("submit").1)
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        assert_eq!(collect(rx).await.0, want[i], "request {i}");
    }
}
