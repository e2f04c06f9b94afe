//! Prefix caching on hybrid models (tiny random Qwen3.5, dense and MoE, from
//! `scripts/gen_tiny_qwen3_5.py`): a request sharing a cached prefix resumes from a recurrent-
//! state snapshot, reports the cached tokens, and its log-probabilities still match the logits
//! transformers computed for the whole sequence; greedy output is the same with the cache as
//! without it, alone, in a batch beside a cancelled request, and in pools small enough that
//! blocks and snapshots are evicted.

use std::path::{Path, PathBuf};

use afm_engine::*;
use afm_models::source::ModelLocation;

const ARCHS: [&str; 2] = ["qwen3_5", "qwen3_5_moe"];
/// The reference tests' tolerance: error relative to the row's largest logit.
const TOL: f32 = 1e-3;

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(arch)
}

struct Reference {
    tokens: Vec<u32>,
    /// `logits[p]`: transformers' next-token logits after `tokens[..=p]`.
    logits: Vec<Vec<f32>>,
    greedy_prompt_len: usize,
    greedy: Vec<u32>,
}

fn reference(arch: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(arch).join("reference.json")).expect("reference");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .expect(k)
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    let logits = v["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("logit") as f32)
                .collect()
        })
        .collect();
    Reference {
        tokens: ids("tokens"),
        logits,
        greedy_prompt_len: v["greedy_prompt_len"].as_u64().expect("len") as usize,
        greedy: ids("greedy"),
    }
}

fn engine(arch: &str, cfg: EngineConfig) -> EngineHandle {
    let m = afm_models::load_model(&ModelLocation::HfDir(fixture(arch))).expect("load");
    Engine::spawn(m, cfg).expect("spawn")
}

fn cfg(prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        max_context: 128,
        kv_budget_bytes: Some(4 << 20),
        prefix_caching,
        ..Default::default()
    }
}

/// Greedy tokens, each with its top-5 log-probabilities, and the prompt tokens served from the
/// prefix cache.
#[derive(Debug, Clone)]
struct Run {
    tokens: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
    cached: usize,
}

fn submit(e: &EngineHandle, prompt: &[u32], n: usize) -> (RequestId, EventReceiver) {
    e.submit(GenerateRequest {
        prompt_tokens: prompt.to_vec(),
        sampling: SamplingParams::default(),
        max_tokens: n,
        stop_token_ids: vec![],
        top_logprobs: Some(5),
    })
    .expect("submit")
}

async fn collect(mut rx: EventReceiver) -> (Run, FinishReason) {
    let (mut tokens, mut top) = (Vec::new(), Vec::new());
    loop {
        match rx.recv().await.expect("event") {
            GenerateEvent::Token { id, logprob } => {
                tokens.push(id);
                top.push(logprob.expect("logprobs").top);
            }
            GenerateEvent::Finished { stats, reason } => {
                let cached = stats.cached_tokens;
                return (
                    Run {
                        tokens,
                        top,
                        cached,
                    },
                    reason,
                );
            }
            GenerateEvent::Error { message } => panic!("engine error: {message}"),
        }
    }
}

async fn run(e: &EngineHandle, prompt: &[u32], n: usize) -> Run {
    collect(submit(e, prompt, n).1).await.0
}

/// The first token's log-probabilities against transformers' logits for the same prompt.
fn matches_reference(what: &str, top: &[(u32, f32)], row: &[f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
    let scale = row.iter().fold(0f32, |m, &x| m.max(x.abs()));
    let argmax = row
        .iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > row[b] { i } else { b });
    assert!(
        top.iter().any(|&(t, _)| t as usize == argmax),
        "{what}: transformers' top token {argmax} not in afm's top 5 {top:?}"
    );
    for &(t, lp) in top {
        let want = row[t as usize] - lse;
        assert!(
            (lp - want).abs() <= TOL * scale,
            "{what}: token {t} logprob {lp} vs transformers {want} (tolerance {})",
            TOL * scale
        );
    }
}

/// Same tokens, and log-probabilities equal to well within the reference tolerance.
fn same(what: &str, a: &Run, b: &Run) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    for (step, (x, y)) in a.top.iter().zip(&b.top).enumerate() {
        for ((tx, lx), (ty, ly)) in x.iter().zip(y) {
            assert_eq!(tx, ty, "{what}: step {step} top tokens");
            assert!((lx - ly).abs() < 1e-4, "{what}: step {step}: {lx} vs {ly}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_resumes_from_a_snapshot_and_matches_transformers() {
    for arch in ARCHS {
        let r = reference(arch);
        let e = engine(arch, cfg(true));
        // (prompt length, prompt tokens expected from the cache): the 40-token prompt leaves a
        // snapshot at 32, its last block boundary; the 57-token one at 48.
        for (len, cached) in [(40, 0), (57, 32), (64, 48), (40, 32)] {
            let got = run(&e, &r.tokens[..len], 1).await;
            let what = format!("{arch}, prompt of {len}");
            assert_eq!(got.cached, cached, "{what}: cached tokens");
            matches_reference(&what, &got.top[0], &r.logits[len - 1]);
        }
    }
}

/// Where a cached chain has no snapshot yet, the request that parts from it recomputes and
/// leaves one at the parting block, so the next request resumes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_equals_transformers_when_resumed_from_a_snapshot() {
    for arch in ARCHS {
        let r = reference(arch);
        let prompt = &r.tokens[..r.greedy_prompt_len];
        let e = engine(
            arch,
            EngineConfig {
                block_size: 4,
                ..cfg(true)
            },
        );
        let mut cached = Vec::new();
        for _ in 0..3 {
            let got = run(&e, prompt, r.greedy.len()).await;
            assert_eq!(got.tokens, r.greedy, "{arch}: transformers' greedy tokens");
            cached.push(got.cached);
        }
        // Run 1 snapshots at 8 (its prompt's end), which an 8-token prompt cannot hit (one
        // token is always computed); run 2 finds the chain to 4 and snapshots there.
        assert_eq!(cached, [0, 0, 4], "{arch}: cached tokens per run");
    }
}

/// A mixed workload (resent prompts, extensions, a conversation's next turn, prompts parting
/// mid-block) with and without the prefix cache.
async fn workload(e: &EngineHandle, r: &Reference) -> Vec<Run> {
    let t = &r.tokens;
    let mut out = Vec::new();
    for p in [&t[..40], &t[..57], &t[..40]] {
        out.push(run(e, p, 12).await);
    }
    // The next turn of the first conversation: prompt, answer, new message.
    let mut turn = t[..40].to_vec();
    turn.extend(&out[0].tokens);
    turn.extend(&t[40..50]);
    out.push(run(e, &turn, 12).await);
    // Part from the cached chain at 20, then again at 20 (a snapshot at 16 by now).
    for tail in [&t[45..64], &t[50..60]] {
        let mut p = t[..20].to_vec();
        p.extend(tail);
        out.push(run(e, &p, 12).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_is_the_same_with_and_without_the_cache() {
    for arch in ARCHS {
        let r = reference(arch);
        let cold = workload(&engine(arch, cfg(false)), &r).await;
        let warm = workload(&engine(arch, cfg(true)), &r).await;
        for (i, (c, w)) in cold.iter().zip(&warm).enumerate() {
            same(&format!("{arch}, request {i}"), c, w);
        }
        let cached: Vec<usize> = warm.iter().map(|w| w.cached).collect();
        assert_eq!(cached, [0, 32, 32, 32, 0, 16], "{arch}: cached tokens");
        assert!(cold.iter().all(|c| c.cached == 0));
    }
}

/// Requests sharing prefixes decoded together in 8-token prefill slices, one cancelled
/// mid-way, in a pool of 9 blocks with 2 snapshots (blocks and snapshots evicted and reused,
/// sequences preempted and resumed): each gives what it gives alone without the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_cancelled_and_evicted_requests_keep_their_output() {
    // Three running sequences of 76 to 97 tokens need 14 blocks with their shared ones.
    const GEN: usize = 40;
    let per_block = 2 * 2 * 16 * 4 * 16; // K and V, 2 KV heads × 16 dims, f32, 16 tokens
    for arch in ARCHS {
        let r = reference(arch);
        let t = &r.tokens;
        let mut tail = t[..20].to_vec();
        tail.extend(&t[44..60]);
        let prompts = [t[..40].to_vec(), t[..57].to_vec(), tail, t[..40].to_vec()];
        let alone = engine(arch, cfg(false));
        let mut want = Vec::new();
        for p in &prompts {
            want.push(run(&alone, p, GEN).await);
        }
        let e = engine(
            arch,
            EngineConfig {
                concurrent: 3,
                prefill_step_size: 16,
                kv_budget_bytes: Some(9 * per_block),
                state_snapshots: Some(2),
                ..cfg(true)
            },
        );
        let mut cached = 0;
        for round in 0..2 {
            let (_, first) = submit(&e, &prompts[0], GEN);
            let (got0, _) = collect(first).await;
            same(&format!("{arch} round {round}: request 0"), &want[0], &got0);
            cached += got0.cached;
            let (cid, mut rc) = submit(&e, &t[..45], 40);
            let rxs: Vec<_> = prompts[1..].iter().map(|p| submit(&e, p, GEN).1).collect();
            for _ in 0..2 {
                assert!(matches!(rc.recv().await, Some(GenerateEvent::Token { .. })));
            }
            e.cancel(cid);
            for (i, rx) in rxs.into_iter().enumerate() {
                let (got, _) = collect(rx).await;
                same(
                    &format!("{arch} round {round}: request {}", i + 1),
                    &want[i + 1],
                    &got,
                );
                cached += got.cached;
            }
            let (_, reason) = collect(rc).await;
            assert_eq!(reason, FinishReason::Cancelled);
        }
        assert!(cached > 0, "{arch}: some request was served from the cache");
        let m = e.metrics();
        let (preempted, restored) = (
            EngineMetrics::get(&m.preemptions),
            EngineMetrics::get(&m.state_restores),
        );
        eprintln!("{arch}: {preempted} preemptions, {restored} states restored");
        assert!(preempted > 0, "{arch}: 9 blocks force preemptions");
        assert!(restored > 0, "{arch}: states restored from snapshots");
    }
}
