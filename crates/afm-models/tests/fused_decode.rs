//! The fused decode step (`Device::fused_decode`: every layer of a batch-1 decode step in one
//! GPU launch) against the layer loop it replaces, on the same GPU and the same model:
//! greedy decode in lockstep over two KV pools, one step fused and one not, each step fed the
//! layer loop's own greedy token. Logits must agree to 1e-3 relative (max |a - b| / max |b|;
//! the f32 bound of the GPU reference tests; the H200 showed 1.7e-4 on the random Qwen3-0.6B,
//! summation order and f16 K/V rounding) at every step. The greedy picks are counted, not
//! asserted: two picks can differ only where the layer loop's top two logits lie within twice
//! that bound (a near-tie, which random weights meet: session 22, Qwen3-0.6B, step 41 of the
//! 20-token prompt), and elsewhere the logits bound already makes them equal.
//!
//! `AFM_TEST_DEVICE=cuda` (else the tests print why they skip) and, for the real-shape checks,
//! `AFM_FUSED_MODELS=dir[,dir...]` (bf16 checkpoints, e.g. `scripts/gpu_random_models.py`'s
//! qwen3-0.6b, qwen2.5-0.5b, smollm2-135m): prompts of 20 tokens (contexts crossing several
//! 16-token KV blocks) and 1,030 tokens (over 1,024 keys, several attention splits), then 45
//! decode steps each. The tiny fixtures (f32, head_dim 32: outside the kernel's scope) check
//! that no fused step runs and the switch changes nothing where the fused step does not apply.

use std::path::{Path, PathBuf};

use afm_models::random_ids::random_token_ids;
use afm_models::source::ModelLocation;
use afm_models::{load_model_on, ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::compute::{Device, DeviceChoice, KvPool};

const BLOCK: usize = 16;
const STEPS: usize = 45;
const MAX_REL_ERR: f32 = 1e-3;

/// The GPU under test, or `None` (with a note) when the tests run on the CPU.
fn gpu() -> Option<Device> {
    let name = std::env::var("AFM_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    let choice: DeviceChoice = name.parse().unwrap_or_else(|e| panic!("{e}"));
    if choice == DeviceChoice::Cpu {
        eprintln!("skipped: AFM_TEST_DEVICE is not a GPU");
        return None;
    }
    Some(Device::open(choice).unwrap_or_else(|e| panic!("AFM_TEST_DEVICE={name}: {e}")))
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit rows differ in length");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// One sequence's forward over `tokens` at `pos0` with the fused step `fused` or not.
fn forward(
    m: &LoadedModel,
    kv: &mut KvPool,
    table: &[u32],
    tokens: &[u32],
    pos0: usize,
    fused: bool,
) -> Vec<f32> {
    Device::set_fused_decode(fused);
    let seq = [SeqChunk {
        state_slot: None,
        len: tokens.len(),
        pos0,
        block_table: table,
        logits: true,
    }];
    let batch = ForwardBatch { tokens, seqs: &seq };
    let out = m.model.forward(&batch, kv).expect("forward");
    Device::set_fused_decode(true);
    out
}

struct Run {
    max_err: f32,
    /// Steps whose greedy picks differ (near-ties: see the header).
    near_ties: usize,
    fused_steps: u64,
}

/// Prefill `plen` tokens into two pools, then `STEPS` greedy steps in lockstep: pool `a`
/// decoded with the fused step on, pool `b` with it off; both fed `b`'s greedy token.
fn lockstep(m: &LoadedModel, plen: usize, seed: u64) -> Run {
    let prompt = random_token_ids(seed, plen, m.model.vocab_size());
    let blocks = (plen + STEPS + 1).div_ceil(BLOCK);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let shapes = m.model.kv_shapes();
    let pool = || {
        m.device
            .kv_pool(&shapes, blocks, BLOCK, m.kv_dtype)
            .expect("KV pool")
    };
    let (mut a, mut b) = (pool(), pool());
    let la = forward(m, &mut a, &table, &prompt, 0, true);
    let mut lb = forward(m, &mut b, &table, &prompt, 0, false);
    let mut max_err = rel_err(&la, &lb);
    let launches = Device::fused_decode_launches();
    let mut near_ties = 0;
    for i in 0..STEPS {
        let tok = argmax(&lb) as u32;
        let pos = plen + i;
        let la = forward(m, &mut a, &table, &[tok], pos, true);
        lb = forward(m, &mut b, &table, &[tok], pos, false);
        let err = rel_err(&la, &lb);
        max_err = max_err.max(err);
        assert!(
            err <= MAX_REL_ERR,
            "{}: step {i} (position {pos}): logits relative error {err:.2e} > {MAX_REL_ERR:.0e}",
            m.name
        );
        if argmax(&la) != argmax(&lb) {
            near_ties += 1;
        }
    }
    Run {
        max_err,
        near_ties,
        fused_steps: Device::fused_decode_launches() - launches,
    }
}

fn load(dev: &Device, dir: &Path) -> LoadedModel {
    load_model_on(&ModelLocation::HfDir(dir.to_path_buf()), dev)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// bf16 models of real shape: every decode step fused, and equal to the layer loop.
#[test]
fn fused_step_matches_the_layer_loop_on_real_shapes() {
    let Some(dev) = gpu() else { return };
    let Ok(dirs) = std::env::var("AFM_FUSED_MODELS") else {
        eprintln!("skipped: AFM_FUSED_MODELS names no model directories");
        return;
    };
    for dir in dirs.split(',').filter(|d| !d.is_empty()) {
        let m = load(&dev, Path::new(dir));
        for (plen, seed) in [(20, 1), (1030, 2)] {
            let r = lockstep(&m, plen, seed);
            println!(
                "{}: prompt {plen}, {STEPS} steps: {} fused, logits relative error max {:.2e}, \
                 {} near-tie greedy picks differ",
                m.name, r.fused_steps, r.max_err, r.near_ties
            );
            assert_eq!(
                r.fused_steps, STEPS as u64,
                "{}: the fused step did not run for every decode step",
                m.name
            );
        }
    }
}

/// `AFM_FIXTURES_DIR` where the test binary runs away from its source tree (a GPU machine).
fn fixtures() -> PathBuf {
    match std::env::var_os("AFM_FIXTURES_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny"),
    }
}

/// The tiny llama and qwen3 fixtures are outside the kernel's scope (f32 weights and cache,
/// head_dim 32): no fused step runs, and the switch changes nothing.
#[test]
fn models_outside_the_scope_take_the_layer_loop() {
    let Some(dev) = gpu() else { return };
    for name in ["llama", "qwen3"] {
        let m = load(&dev, &fixtures().join(name));
        let r = lockstep(&m, 20, 3);
        assert_eq!(r.fused_steps, 0, "{name}: a fused step ran out of scope");
        // Two runs of the same kernels: equal unless one of them is not deterministic.
        assert!(
            r.max_err <= 1e-6,
            "{name}: the switch changed the layer loop's logits ({:.2e})",
            r.max_err
        );
    }
}
