//! The engine end to end on a real checkpoint (SmolLM2-135M Q4_1, fetched by
//! `scripts/fetch_models.sh`): batching does not change greedy output, the prefix cache is hit
//! and reported, cancellation returns every KV block, a full queue is refused.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use afm_engine::*;
use afm_models::source::ModelLocation;
use common::{collect, request, smollm2_path};

mod common;

fn engine(cfg: EngineConfig) -> EngineHandle {
    let m = afm_models::load_model(&ModelLocation::Gguf(smollm2_path())).expect("load");
    Engine::spawn(
        m,
        EngineConfig {
            max_context: 2048,
            kv_budget_bytes: Some(256 << 20),
            ..cfg
        },
    )
    .expect("spawn")
}

fn prompts() -> Vec<Vec<u32>> {
    // "The capital of France is" and other short English prompts, as SmolLM2 token ids.
    vec![
        vec![504, 3575, 282, 4649, 314],
        vec![1, 4093, 30, 1041, 314, 253],
        vec![504, 2016, 282, 1848, 314, 216],
        vec![20, 3575, 282, 2450, 314, 216, 34, 32],
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_greedy_equals_alone() {
    let alone = engine(EngineConfig {
        concurrent: 1,
        ..Default::default()
    });
    let mut want = Vec::new();
    for p in prompts() {
        let (_, rx) = alone.submit(request(p, 24)).unwrap();
        want.push(collect(rx).await.0);
    }
    let batched = engine(EngineConfig {
        concurrent: 4,
        prefill_step_size: 8,
        ..Default::default()
    });
    let rxs: Vec<_> = prompts()
        .into_iter()
        .map(|p| batched.submit(request(p, 24)).unwrap().1)
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (got, reason, stats) = collect(rx).await;
        assert_eq!(
            got, want[i],
            "prompt {i}: batched output differs from alone"
        );
        assert_eq!(reason, FinishReason::Length);
        assert_eq!(stats.completion_tokens, 24);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_hit_is_reported_and_output_unchanged() {
    let e = engine(EngineConfig::default());
    let long: Vec<u32> = (0..100).map(|i| 300 + (i * 37) % 2000).collect();
    let (first, _, s1) = collect(e.submit(request(long.clone(), 8)).unwrap().1).await;
    assert_eq!(s1.cached_tokens, 0);
    let (second, _, s2) = collect(e.submit(request(long.clone(), 8)).unwrap().1).await;
    assert_eq!(first, second);
    // Full 16-token blocks of the 100-token prompt: 96 cached.
    assert_eq!(s2.cached_tokens, 96);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_frees_every_block() {
    let e = engine(EngineConfig {
        prefix_caching: false,
        ..Default::default()
    });
    let total = EngineMetrics::get(&e.metrics().kv_blocks_total);
    let (id, mut rx) = e.submit(request(prompts()[0].clone(), 1000)).unwrap();
    // Wait for a few tokens, then cancel mid-generation.
    for _ in 0..3 {
        assert!(matches!(rx.recv().await, Some(GenerateEvent::Token { .. })));
    }
    e.cancel(id);
    let (_, reason, _) = collect(rx).await;
    assert_eq!(reason, FinishReason::Cancelled);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(EngineMetrics::get(&e.metrics().kv_blocks_free), total);
    // A dropped receiver cancels too.
    let (_, rx) = e.submit(request(prompts()[1].clone(), 1000)).unwrap();
    drop(rx);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(e.metrics().num_running.load(Ordering::Relaxed), 0);
    assert_eq!(EngineMetrics::get(&e.metrics().kv_blocks_free), total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_refused_and_long_prompt_rejected() {
    let e = engine(EngineConfig {
        max_waiting: 2,
        ..Default::default()
    });
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..6 {
        match e.submit(request(prompts()[0].clone(), 200)) {
            Ok(r) => held.push(r),
            Err(EngineError::QueueFull { limit }) => {
                assert_eq!(limit, 2);
                refused += 1;
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert!(
        refused >= 1,
        "six instant submissions with a queue of 2 must refuse some"
    );
    let err = e.submit(request(vec![1; 4096], 4)).unwrap_err();
    assert_eq!(
        err,
        EngineError::PromptTooLong {
            prompt: 4096,
            limit: 2048
        }
    );
}

/// Gemma 3's sliding-window layers read only the last few positions; a prefix-cache hit must
/// still reproduce exactly what a cold run computes (tiny checkpoint, window 8, 16-token blocks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_is_exact_with_sliding_window_layers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/gemma3");
    let m = afm_models::load_model(&ModelLocation::HfDir(dir)).expect("load tiny gemma3");
    let e = Engine::spawn(
        m,
        EngineConfig {
            max_context: 256,
            kv_budget_bytes: Some(16 << 20),
            ..Default::default()
        },
    )
    .expect("spawn");
    let prompt: Vec<u32> = (0..70).map(|i| (i * 37 % 120) as u32 + 3).collect();
    let run = |p: Vec<u32>| {
        let (_, mut rx) = e
            .submit(GenerateRequest {
                top_logprobs: Some(3),
                ..request(p, 12)
            })
            .unwrap();
        async move {
            let mut out = Vec::new();
            loop {
                match rx.recv().await.expect("event") {
                    GenerateEvent::Token { id, logprob } => {
                        out.push((id, logprob.expect("logprobs").top))
                    }
                    GenerateEvent::Finished { stats, .. } => return (out, stats.cached_tokens),
                    GenerateEvent::Error { message } => panic!("{message}"),
                }
            }
        }
    };
    let (cold, c1) = run(prompt.clone()).await;
    let (warm, c2) = run(prompt.clone()).await;
    assert_eq!(c1, 0);
    assert_eq!(c2, 64, "four full 16-token blocks of the 70-token prompt");
    // Same tokens, and the same top-3 distribution at every step, to f32 rounding.
    for (step, ((t1, top1), (t2, top2))) in cold.iter().zip(&warm).enumerate() {
        assert_eq!(t1, t2, "step {step}: a cache hit changed the greedy token");
        for ((a, la), (b, lb)) in top1.iter().zip(top2) {
            assert_eq!(a, b, "step {step}: top tokens differ");
            assert!((la - lb).abs() < 1e-4, "step {step}: logprob {la} vs {lb}");
        }
    }
}
