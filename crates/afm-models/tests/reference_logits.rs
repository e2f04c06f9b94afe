//! Every architecture against transformers: tiny random-weight checkpoints made by
//! `scripts/gen_tiny_fixtures.py`, with the logits transformers computed for a fixed sequence.
//! afm must match them by one prefill, by token-by-token decode and by mixed chunks.
//!
//! `AFM_TEST_DEVICE=cuda` (or `cuda:N`; default `cpu`) runs the same checks on a GPU, in a
//! build with `--features cuda` (scripts/gpu_check.sh).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use afm_models::source::ModelLocation;
use afm_models::{load_model_on, ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::compute::{Device, DeviceChoice};

const BLOCK: usize = 4;

/// The device under test, opened once for all tests.
fn device() -> &'static Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let name = std::env::var("AFM_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
        let choice: DeviceChoice = name.parse().unwrap_or_else(|e| panic!("{e}"));
        Device::open(choice).unwrap_or_else(|e| panic!("AFM_TEST_DEVICE={name}: {e}"))
    })
}

fn load(loc: ModelLocation) -> Result<LoadedModel, afm_models::ModelError> {
    load_model_on(&loc, device())
}

/// `AFM_FIXTURES_DIR` where the test binary runs away from its source tree (a GPU machine).
fn fixtures() -> PathBuf {
    match std::env::var_os("AFM_FIXTURES_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny"),
    }
}

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference json");
    let tokens = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let logits = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    Reference { tokens, logits }
}

/// max |a − b| / max |b| over one row.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Runs the sequence through the model in chunks of the given sizes; returns (position, logits)
/// for the last token of each chunk.
fn run_chunks(m: &LoadedModel, tokens: &[u32], chunks: &[usize]) -> Vec<(usize, Vec<f32>)> {
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), blocks + 2, BLOCK, m.kv_dtype)
        .expect("KV pool");
    // Scattered, reversed block ids: attention must follow the table, not assume contiguity.
    let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b + 2).collect();
    let mut out = Vec::new();
    let mut pos = 0;
    for &len in chunks {
        let seq = [SeqChunk {
            state_slot: None,
            len,
            pos0: pos,
            block_table: &table,
            logits: true,
        }];
        let batch = ForwardBatch {
            tokens: &tokens[pos..pos + len],
            seqs: &seq,
        };
        let logits = m.model.forward(&batch, &mut kv).expect("forward");
        pos += len;
        out.push((pos - 1, logits));
    }
    out
}

fn check_model(m: &LoadedModel, r: &Reference, what: &str) {
    let n = r.tokens.len();
    let schedules: Vec<(&str, Vec<usize>)> = vec![
        ("prefill", vec![n]),
        ("decode", vec![1; n]),
        ("chunks", vec![5, 1, 7, 3, 1, n - 17]),
    ];
    for (name, chunks) in schedules {
        assert_eq!(chunks.iter().sum::<usize>(), n);
        let mut worst = 0f32;
        for (pos, logits) in run_chunks(m, &r.tokens, &chunks) {
            let err = rel_err(&logits, &r.logits[pos]);
            worst = worst.max(err);
            assert!(
                err <= 1e-3,
                "{what} {name}: position {pos} relative error {err:.2e}"
            );
        }
        eprintln!("{what} {name}: max relative error {worst:.2e}");
    }
}

fn check_arch(arch: &str) {
    let dir = fixtures().join(arch);
    if !dir.join("reference.json").exists() {
        panic!(
            "missing fixture {}: run scripts/gen_tiny_fixtures.py",
            dir.display()
        );
    }
    let r = reference(&dir);
    let m = load(ModelLocation::HfDir(dir.clone())).unwrap_or_else(|e| panic!("{arch}: {e}"));
    check_model(&m, &r, &format!("{arch} safetensors"));
    for gguf in ["model-f32.gguf", "model-q8_0.gguf"] {
        let path = dir.join(gguf);
        if !path.exists() {
            continue;
        }
        let m = load(ModelLocation::Gguf(path)).unwrap_or_else(|e| panic!("{arch} {gguf}: {e}"));
        if gguf.contains("f32") {
            check_model(&m, &r, &format!("{arch} {gguf}"));
        } else {
            // 8-bit weights: the greedy choice must still agree with transformers nearly everywhere.
            let got = run_chunks(&m, &r.tokens, &vec![1; r.tokens.len()]);
            let agree = got
                .iter()
                .filter(|(p, l)| argmax(l) == argmax(&r.logits[*p]))
                .count();
            assert!(
                agree * 10 >= got.len() * 9,
                "{arch} {gguf}: argmax agrees at {agree}/{}",
                got.len()
            );
        }
    }
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

#[test]
fn llama_matches_transformers() {
    check_arch("llama");
}

#[test]
fn qwen2_matches_transformers() {
    check_arch("qwen2");
}

#[test]
fn qwen3_matches_transformers() {
    check_arch("qwen3");
}

#[test]
fn gemma3_matches_transformers() {
    check_arch("gemma3");
}

/// Gemma 3 with final-logit soft-capping, a non-default query scale and split RoPE bases.
#[test]
fn gemma3_variant_matches_transformers() {
    check_arch("gemma3_alt");
}

/// Gemma 4 dense through the multimodal wrapper: per-type head dims and KV heads, K reused as V
/// on global layers, proportional RoPE, layer scalars, soft-capping; 72 tokens, window 8.
#[test]
fn gemma4_matches_transformers() {
    check_arch("gemma4");
}

/// Gemma 4 with the parallel dense MLP + mixture-of-experts block (4 experts, top 2).
#[test]
fn gemma4_moe_matches_transformers() {
    check_arch("gemma4_moe");
}

/// Gemma 4 with per-layer input embeddings (the small variants' second embedding table).
#[test]
fn gemma4_per_layer_inputs_match_transformers() {
    check_arch("gemma4_ple");
}
