//! Preemption under a KV budget far smaller than the load (SmolLM2-135M Q4_1): many concurrent
//! long requests never crash the engine, none is cut short, and each one's greedy output equals
//! what it produces alone with room to spare.

use afm_engine::*;
use afm_models::source::ModelLocation;
use common::{collect, request, smollm2_path};

mod common;

fn engine(cfg: EngineConfig) -> EngineHandle {
    let m = afm_models::load_model(&ModelLocation::Gguf(smollm2_path())).expect("load");
    Engine::spawn(m, cfg).expect("spawn")
}

/// Six different 90-token prompts of ordinary vocabulary ids.
fn prompts() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|r| {
            (0..90u32)
                .map(|i| 300 + (i * 37 + r * 101) % 2000)
                .collect()
        })
        .collect()
}

const GEN: usize = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_kv_budget_preempts_and_every_answer_is_whole_and_unchanged() {
    let roomy = engine(EngineConfig {
        max_context: 256,
        kv_budget_bytes: Some(64 << 20),
        ..Default::default()
    });
    let mut alone = Vec::new();
    for p in prompts() {
        alone.push(collect(roomy.submit(request(p, GEN)).unwrap().1).await.0);
    }
    drop(roomy);

    // 6 × (90 + 60) tokens = 60 blocks of 16 wanted at once; 18 fit (one whole 256-token
    // context, as the engine requires, plus two blocks).
    let per_block = afm_runtime::kv_store::KvCache::bytes_per_block(
        &[afm_runtime::kv_store::LayerKvShape {
            n_kv_heads: 3,
            head_dim: 64,
        }; 30],
        16,
        afm_runtime::kv_store::KvDtype::F16,
    );
    let tight = engine(EngineConfig {
        max_context: 256,
        concurrent: 6,
        prefill_step_size: 64,
        kv_budget_bytes: Some(18 * per_block),
        ..Default::default()
    });
    assert_eq!(EngineMetrics::get(&tight.metrics().kv_blocks_total), 18);
    let rxs: Vec<_> = prompts()
        .into_iter()
        .map(|p| tight.submit(request(p, GEN)).unwrap().1)
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (got, reason, stats) = collect(rx).await;
        assert_eq!(reason, FinishReason::Length, "request {i}");
        assert_eq!(stats.completion_tokens, GEN, "request {i} was cut short");
        assert_eq!(
            got, alone[i],
            "request {i}: output differs from its solo run"
        );
    }
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let preemptions = EngineMetrics::get(&tight.metrics().preemptions);
    assert!(
        preemptions > 0,
        "18 blocks cannot hold six 150-token requests without preempting"
    );
    assert_eq!(
        EngineMetrics::get(&tight.metrics().kv_blocks_free),
        18,
        "every block comes back"
    );
}
