//! Qwen3.5 (Gated DeltaNet hybrid, dense and MoE) against transformers: tiny random-weight
//! checkpoints made by `scripts/gen_tiny_qwen3_5.py`, with the logits transformers computed for
//! a fixed 64-token sequence. afm must match them by one prefill, token-by-token decode and
//! mixed chunks, with the recurrent state in an engine-style [`StatePool`] slot, and two
//! sequences sharing a batch must not see each other's state.
//!
//! `AFM_TEST_DEVICE=cuda` runs the same checks on a GPU (a `--features afm-runtime/cuda` build),
//! `AFM_FIXTURES_DIR` where the binary runs away from its source tree.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use afm_models::source::ModelLocation;
use afm_models::{load_model_on, ForwardBatch, LoadedModel, ModelError, SeqChunk};
use afm_runtime::compute::{Device, DeviceChoice, KvPool, StatePool};

const BLOCK: usize = 4;
const TOL: f32 = 1e-3;

fn fixture(arch: &str) -> PathBuf {
    match std::env::var_os("AFM_FIXTURES_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny"),
    }
    .join(arch)
}

/// The device under test, opened once for all tests.
fn device() -> &'static Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let name = std::env::var("AFM_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
        let choice: DeviceChoice = name.parse().unwrap_or_else(|e| panic!("{e}"));
        Device::open(choice).unwrap_or_else(|e| panic!("AFM_TEST_DEVICE={name}: {e}"))
    })
}

fn load_model(loc: &ModelLocation) -> Result<LoadedModel, ModelError> {
    load_model_on(loc, device())
}

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy_prompt_len: usize,
    greedy: Vec<u32>,
}

fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference json");
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .expect(k)
            .iter()
            .map(|t| t.as_u64().expect("token id") as u32)
            .collect()
    };
    let logits = v["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("logit row")
                .iter()
                .map(|x| x.as_f64().expect("logit") as f32)
                .collect()
        })
        .collect();
    Reference {
        tokens: ids("tokens"),
        logits,
        greedy_prompt_len: v["greedy_prompt_len"].as_u64().expect("greedy_prompt_len") as usize,
        greedy: ids("greedy"),
    }
}

/// max |a − b| / max |b| over one row.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// A KV pool of `blocks` blocks with `slots` recurrent-state slots, as the engine makes it.
fn pool(m: &LoadedModel, blocks: usize, slots: usize) -> KvPool {
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), blocks, BLOCK, m.kv_dtype)
        .expect("KV pool");
    kv.attach_states(StatePool::new(&m.model.state_shapes(), slots));
    kv
}

/// One sequence in chunks of the given sizes (state slot 1 of 2); (position, logits) per chunk.
fn run_chunks(m: &LoadedModel, tokens: &[u32], chunks: &[usize]) -> Vec<(usize, Vec<f32>)> {
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut kv = pool(m, blocks + 2, 2);
    let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b + 2).collect();
    let mut out = Vec::new();
    let mut pos = 0;
    for &len in chunks {
        let seq = [SeqChunk {
            len,
            pos0: pos,
            block_table: &table,
            logits: true,
            state_slot: Some(1),
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

fn check(arch: &str) {
    let dir = fixture(arch);
    let r = reference(&dir);
    let m = load_model(&ModelLocation::HfDir(dir)).unwrap_or_else(|e| panic!("{arch}: {e}"));
    assert!(
        !m.model.state_shapes().is_empty(),
        "{arch} has recurrent layers"
    );
    let n = r.tokens.len();
    let mut mixed = vec![7, 1, 13, 2, 1, 9];
    mixed.push(n - mixed.iter().sum::<usize>());
    for (name, chunks) in [
        ("prefill", vec![n]),
        ("decode", vec![1; n]),
        ("chunks", mixed),
    ] {
        let mut worst = 0f32;
        for (pos, logits) in run_chunks(&m, &r.tokens, &chunks) {
            let err = rel_err(&logits, &r.logits[pos]);
            worst = worst.max(err);
            assert!(
                err <= TOL,
                "{arch} {name}: position {pos} relative error {err:.2e}"
            );
        }
        eprintln!("{arch} {name}: max relative error {worst:.2e}");
    }
}

#[test]
fn qwen3_5_dense_matches_transformers() {
    check("qwen3_5");
}

#[test]
fn qwen3_5_moe_matches_transformers() {
    check("qwen3_5_moe");
}

/// The Hub's MoE layout: wrapper config, `model.language_model.`, one tensor per expert.
#[test]
fn qwen3_5_moe_hub_layout_matches_transformers() {
    check("qwen3_5_moe_hub");
}

/// Two sequences decoded in one batch, each with its own slot and block table, reproduce
/// transformers' greedy tokens and per-position logits as if each ran alone.
#[test]
fn two_sequences_in_one_batch_keep_their_own_state() {
    let dir = fixture("qwen3_5");
    let r = reference(&dir);
    let m = load_model(&ModelLocation::HfDir(dir)).expect("load");
    let a: Vec<u32> = r.tokens[..r.greedy_prompt_len].to_vec();
    let b: Vec<u32> = r.tokens.clone();
    let per = (b.len() + r.greedy.len()).div_ceil(BLOCK);
    let mut kv = pool(&m, 2 * per, 3);
    let tables: [Vec<u32>; 2] = [
        (0..per as u32).collect(),
        (per as u32..2 * per as u32).collect(),
    ];
    let slots = [2u32, 0u32];
    // Step 1: A's prompt and B's first 20 tokens; later steps: A decodes greedily, B prefills
    // in chunks of 11 then decodes its own tokens.
    let (mut a_pos, mut b_pos) = (0usize, 0usize);
    let mut a_seq = a.clone();
    let mut worst = 0f32;
    while a_seq.len() < a.len() + r.greedy.len() || b_pos < b.len() {
        let a_len = a_seq.len() - a_pos;
        let b_len = (b.len() - b_pos).min(if b_pos == 0 { 20 } else { 11 });
        let mut tokens = a_seq[a_pos..].to_vec();
        let mut seqs = vec![SeqChunk {
            len: a_len,
            pos0: a_pos,
            block_table: &tables[0],
            logits: true,
            state_slot: Some(slots[0]),
        }];
        if b_len > 0 {
            tokens.extend_from_slice(&b[b_pos..b_pos + b_len]);
            seqs.push(SeqChunk {
                len: b_len,
                pos0: b_pos,
                block_table: &tables[1],
                logits: true,
                state_slot: Some(slots[1]),
            });
        }
        let logits = m
            .model
            .forward(
                &ForwardBatch {
                    tokens: &tokens,
                    seqs: &seqs,
                },
                &mut kv,
            )
            .expect("forward");
        let vocab = m.model.vocab_size();
        a_seq.push(argmax(&logits[..vocab]));
        a_pos += a_len;
        if b_len > 0 {
            b_pos += b_len;
            worst = worst.max(rel_err(&logits[vocab..2 * vocab], &r.logits[b_pos - 1]));
        }
    }
    let generated = &a_seq[a.len()..a.len() + r.greedy.len()];
    assert_eq!(generated, r.greedy.as_slice(), "A's greedy tokens");
    assert!(
        worst <= TOL,
        "B's logits beside A: relative error {worst:.2e}"
    );
}

/// A slot that does not hold exactly the tokens before the chunk is refused, not silently used.
#[test]
fn a_slot_out_of_step_with_its_sequence_is_an_error() {
    let dir = fixture("qwen3_5");
    let r = reference(&dir);
    let m = load_model(&ModelLocation::HfDir(dir)).expect("load");
    let mut kv = pool(&m, 8, 1);
    let table: Vec<u32> = (0..8).collect();
    let chunk = |len, pos0, slot| SeqChunk {
        len,
        pos0,
        block_table: &table,
        logits: true,
        state_slot: slot,
    };
    let run = |kv: &mut KvPool, seq: SeqChunk| {
        let batch = ForwardBatch {
            tokens: &r.tokens[seq.pos0..seq.pos0 + seq.len],
            seqs: &[seq],
        };
        m.model.forward(&batch, kv)
    };
    run(&mut kv, chunk(4, 0, Some(0))).expect("prefill");
    let err =
        run(&mut kv, chunk(1, 6, Some(0))).expect_err("slot holds 4 tokens, chunk starts at 6");
    assert!(err.to_string().contains("state slot"), "{err}");
    assert!(run(&mut kv, chunk(1, 4, None)).is_err(), "no slot");
    assert!(
        run(&mut kv, chunk(1, 4, Some(1))).is_err(),
        "slot beyond the pool"
    );
    run(&mut kv, chunk(1, 4, Some(0))).expect("in step again");
}

/// The MTP head is bound, from its own `mtp.safetensors` shard (dense fixture, wrapper layout)
/// and from the main file (MoE fixture, text-only layout), with the shapes vLLM's loader uses.
#[test]
fn mtp_heads_are_loaded_from_either_layout() {
    use afm_models::arch::qwen3_5::Qwen35;
    use afm_models::checkpoint::Checkpoint;
    use afm_models::weights::{SafetensorsSet, WeightSource};
    use afm_models::TransformerConfig;
    use afm_runtime::compute::Device;

    for (arch, prefix) in [
        ("qwen3_5", "model.language_model."),
        ("qwen3_5_moe", "model."),
        ("qwen3_5_moe_hub", "model.language_model."),
    ] {
        let dir = fixture(arch);
        let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        let cfg =
            TransformerConfig::from_hf(json.get("text_config").unwrap_or(&json)).expect("config");
        let src = WeightSource::Safetensors(SafetensorsSet::open_dir(&dir).expect("weights"));
        let m = Qwen35::load(&Checkpoint::new(&src, prefix), &cfg, &Device::Cpu).expect("load");
        let mtp = m.mtp().unwrap_or_else(|| panic!("{arch}: no MTP head"));
        assert_eq!(mtp.num_layers, 1, "{arch}");
        assert_eq!(
            (mtp.fc.w.rows(), mtp.fc.w.cols()),
            (cfg.hidden_size, 2 * cfg.hidden_size),
            "{arch}: fc maps cat(embedding, hidden) to hidden"
        );
    }
}
