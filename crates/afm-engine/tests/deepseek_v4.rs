//! DeepSeek V4 through the engine (tiny checkpoint of `scripts/gen_tiny_deepseek_v4.py`): greedy
//! output equals transformers' `generate`, and prefix-cache hits, which reuse blocks holding the
//! compressor and indexer streams, reproduce a cold run exactly, even where another sequence
//! that shared the first blocks diverged in the middle of a compression window.

use std::path::PathBuf;

use afm_engine::*;
use afm_models::source::ModelLocation;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/deepseek_v4")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

fn engine(cfg: EngineConfig) -> EngineHandle {
    let m =
        afm_models::load_model(&ModelLocation::HfDir(fixture())).expect("load tiny deepseek_v4");
    Engine::spawn(
        m,
        EngineConfig {
            max_context: 256,
            kv_budget_bytes: Some(16 << 20),
            ..cfg
        },
    )
    .expect("spawn")
}

/// Greedy tokens with their top-3 logprobs, and the prompt tokens served from the cache.
async fn run(e: &EngineHandle, prompt: Vec<u32>, n: usize) -> (Vec<(u32, Vec<(u32, f32)>)>, usize) {
    collect(submit(e, prompt, n)).await
}

fn submit(e: &EngineHandle, prompt: Vec<u32>, n: usize) -> EventReceiver {
    e.submit(GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams::default(),
        max_tokens: n,
        stop_token_ids: vec![],
        top_logprobs: Some(3),
    })
    .expect("submit")
    .1
}

async fn collect(mut rx: EventReceiver) -> (Vec<(u32, Vec<(u32, f32)>)>, usize) {
    let mut out = Vec::new();
    loop {
        match rx.recv().await.expect("event") {
            GenerateEvent::Token { id, logprob } => out.push((id, logprob.expect("logprobs").top)),
            GenerateEvent::Finished { stats, .. } => return (out, stats.cached_tokens),
            GenerateEvent::Error { message } => panic!("engine error: {message}"),
        }
    }
}

fn same(what: &str, a: &[(u32, Vec<(u32, f32)>)], b: &[(u32, Vec<(u32, f32)>)]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (step, ((t1, top1), (t2, top2))) in a.iter().zip(b).enumerate() {
        assert_eq!(t1, t2, "{what}: step {step} token");
        for ((x, lx), (y, ly)) in top1.iter().zip(top2) {
            assert_eq!(x, y, "{what}: step {step} top tokens");
            assert!(
                (lx - ly).abs() < 1e-4,
                "{what}: step {step} logprob {lx} vs {ly}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_equals_transformers() {
    let r = reference();
    let prompt_len = r["greedy_prompt_len"].as_u64().expect("len") as usize;
    let prompt = ids(&r["tokens"])[..prompt_len].to_vec();
    let want = ids(&r["greedy"]);
    // One prefill, and prefill in chunks of 3 (windows close inside chunks).
    for step in [1024, 3] {
        let e = engine(EngineConfig {
            prefill_step_size: step,
            ..Default::default()
        });
        let (got, _) = run(&e, prompt.clone(), want.len()).await;
        let got: Vec<u32> = got.iter().map(|(t, _)| *t).collect();
        assert_eq!(
            got, want,
            "prefill step {step}: greedy differs from transformers"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_is_exact_across_compression_windows() {
    let tokens = ids(&reference()["tokens"]);
    let a = tokens[..48].to_vec();
    // Shares a's first 9 blocks of 4 tokens, then leaves it in the middle of the HCA window
    // 32..40 (ratio 8) and of no CSA window (ratio 4).
    let mut b = tokens[..36].to_vec();
    b.extend(tokens[50..62].iter().copied());
    let cfg = || EngineConfig {
        block_size: 4,
        ..Default::default()
    };
    let (cold, c0) = run(&engine(cfg()), a.clone(), 8).await;
    assert_eq!(c0, 0);
    let e = engine(cfg());
    let (first, _) = run(&e, a.clone(), 8).await;
    same("second engine, cold", &cold, &first);
    let (_, cb) = run(&e, b, 8).await;
    assert!(
        cb >= 36,
        "b reuses a's first 9 blocks, got {cb} cached tokens"
    );
    let (warm, ca) = run(&e, a, 8).await;
    assert!(
        ca >= 40,
        "a again is served from the cache past the window, got {ca}"
    );
    same("a after b, from the prefix cache", &cold, &warm);
}

/// Three requests decoded together, prefilled in 8-token slices beside each other's decode
/// steps, give what each gives alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_equals_alone() {
    let tokens = ids(&reference()["tokens"]);
    let prompts = [
        tokens[..21].to_vec(),
        tokens[5..43].to_vec(),
        tokens[30..39].to_vec(),
    ];
    let alone = engine(EngineConfig::default());
    let mut want = Vec::new();
    for p in &prompts {
        want.push(run(&alone, p.clone(), 10).await.0);
    }
    let batched = engine(EngineConfig {
        concurrent: 3,
        prefill_step_size: 8,
        prefix_caching: false,
        ..Default::default()
    });
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| submit(&batched, p.clone(), 10))
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        same(
            &format!("prompt {i} batched"),
            &want[i],
            &collect(rx).await.0,
        );
    }
}
