//! GGUF files of the newer families (`qwen35`, `qwen35moe`, `deepseek4`), written by llama.cpp's
//! own converter from the committed tiny HF fixtures (`scripts/gen_tiny_gguf.py`), must give the
//! logits transformers computed for those fixtures: f32 files within the same 1e-3 relative
//! error as the safetensors, by one prefill, token-by-token decode and mixed chunks. Quantized
//! files must agree with transformers' argmax at least as often as llama.cpp's own run of the
//! same file does (`llama_cpp.json`, recorded by the script) and stay within a stated relative
//! error of llama.cpp's logits for that file.
//!
//! `AFM_TEST_DEVICE=cuda` runs the same checks on a GPU (a `--features afm-runtime/cuda`
//! build), where MXFP4 weights are stored as F16 (no MXFP4 kernel there); the Q8_0 bounds
//! against llama.cpp were measured on the CPU.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use afm_models::source::ModelLocation;
use afm_models::{load_model_on, ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::compute::{Device, DeviceChoice, KvPool, StatePool};

const BLOCK: usize = 4;
const TOL: f32 = 1e-3;

fn fixtures() -> PathBuf {
    match std::env::var_os("AFM_FIXTURES_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny"),
    }
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rows(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array()
        .expect("rows")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("logit") as f32)
                .collect()
        })
        .collect()
}

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

/// Transformers' logits for the HF fixture the GGUF was converted from (DeepSeek V4: for the
/// MXFP4-valued variant the script built, kept beside its GGUF).
fn reference(arch: &str) -> Reference {
    let own = fixtures().join(format!("{arch}_gguf/reference.json"));
    let path = match own.exists() {
        true => own,
        false => fixtures().join(arch).join("reference.json"),
    };
    let v = json(&path);
    let tokens = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("token id") as u32)
        .collect();
    Reference {
        tokens,
        logits: rows(&v["logits"]),
    }
}

/// The device under test (`AFM_TEST_DEVICE`, cpu by default), opened once.
fn device() -> &'static Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let name = std::env::var("AFM_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
        let choice: DeviceChoice = name.parse().unwrap_or_else(|e| panic!("{e}"));
        Device::open(choice).unwrap_or_else(|e| panic!("AFM_TEST_DEVICE={name}: {e}"))
    })
}

fn load(arch: &str, file: &str) -> LoadedModel {
    let path = fixtures().join(format!("{arch}_gguf")).join(file);
    load_model_on(&ModelLocation::Gguf(path), device())
        .unwrap_or_else(|e| panic!("{arch} {file}: {e}"))
}

/// max |a − b| / max |b| over one row.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |best, i| if x[i] > x[best] { i } else { best })
}

/// A KV pool as the engine makes it, with recurrent-state slots where the model has any.
fn pool(m: &LoadedModel, blocks: usize) -> KvPool {
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), blocks, BLOCK, m.kv_dtype)
        .expect("KV pool");
    let states = m.model.state_shapes();
    if !states.is_empty() {
        kv.attach_states(StatePool::new(&states, 2));
    }
    kv
}

/// One sequence in chunks of the given sizes; the logits of each chunk's last token.
fn run_chunks(m: &LoadedModel, tokens: &[u32], chunks: &[usize]) -> Vec<Vec<f32>> {
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut kv = pool(m, blocks + 2);
    let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b + 2).collect();
    let slot = (!m.model.state_shapes().is_empty()).then_some(1);
    let vocab = m.model.vocab_size();
    let mut out = Vec::new();
    let mut pos = 0;
    for &len in chunks {
        let seqs: Vec<SeqChunk> = vec![SeqChunk {
            len,
            pos0: pos,
            block_table: &table,
            logits: true,
            state_slot: slot,
        }];
        let batch = ForwardBatch {
            tokens: &tokens[pos..pos + len],
            seqs: &seqs,
        };
        let logits = m.model.forward(&batch, &mut kv).expect("forward");
        out.push(logits[..vocab].to_vec());
        pos += len;
    }
    out
}

/// The chunk plans every f32 file must match under: (name, chunk sizes).
fn plans(n: usize) -> Vec<(&'static str, Vec<usize>)> {
    let mut mixed = vec![7, 1, 13, 2, 1, 9];
    mixed.push(n - mixed.iter().sum::<usize>());
    vec![("decode", vec![1; n]), ("chunks", mixed)]
}

/// Logits of the last token of each chunk, against the reference row at that position.
fn worst_by_plan(m: &LoadedModel, r: &Reference, chunks: &[usize]) -> (usize, f32) {
    let mut pos = 0;
    let mut worst = (0, 0f32);
    for (len, logits) in chunks.iter().zip(run_chunks(m, &r.tokens, chunks)) {
        pos += len;
        let err = rel_err(&logits, &r.logits[pos - 1]);
        if err > worst.1 {
            worst = (pos - 1, err);
        }
    }
    worst
}

fn check_f32(arch: &str) {
    check_exact(arch, "model-f32.gguf");
}

/// A file whose weights are exactly the reference's, within `TOL` by every chunk plan.
fn check_exact(arch: &str, file: &str) {
    let r = reference(arch);
    let m = load(arch, file);
    let n = r.tokens.len();
    // Prefills of growing length, so early positions are checked too, not only the last.
    let mut worst = (0, 0f32);
    for end in [1, 2, 5, 16, 17, 33, n] {
        let logits = run_chunks(&m, &r.tokens[..end], &[end]);
        let err = rel_err(&logits[0], &r.logits[end - 1]);
        if err > worst.1 {
            worst = (end - 1, err);
        }
    }
    eprintln!("{arch} {file} prefill: max relative error {:.2e}", worst.1);
    assert!(
        worst.1 <= TOL,
        "{arch} prefill: position {} error {:.2e}",
        worst.0,
        worst.1
    );
    for (name, chunks) in plans(n) {
        let (pos, err) = worst_by_plan(&m, &r, &chunks);
        eprintln!("{arch} {file} {name}: max relative error {err:.2e}");
        assert!(err <= TOL, "{arch} {name}: position {pos} error {err:.2e}");
    }
}

/// A quantized file, token by token: how often afm's argmax equals transformers', against how
/// often llama.cpp's does on the same file, and afm's distance from llama.cpp's logits.
fn check_quantized(arch: &str, file: &str, max_rel_to_llama_cpp: f32) {
    let r = reference(arch);
    let m = load(arch, file);
    let n = r.tokens.len();
    let outtype = file.trim_start_matches("model-").trim_end_matches(".gguf");
    let llama = &json(&fixtures().join(format!("{arch}_gguf/llama_cpp.json")))[outtype];
    let llama_logits = rows(&llama["logits"]);
    let llama_agree = llama["argmax_agree"].as_u64().expect("argmax_agree") as usize;
    let got = run_chunks(&m, &r.tokens, &vec![1; n]);
    let agree = (0..n)
        .filter(|&p| argmax(&got[p]) == argmax(&r.logits[p]))
        .count();
    let vs_hf = (0..n).fold(0f32, |w, p| w.max(rel_err(&got[p], &r.logits[p])));
    let vs_llama = (0..n).fold(0f32, |w, p| w.max(rel_err(&got[p], &llama_logits[p])));
    eprintln!(
        "{arch} {file}: argmax agrees with transformers {agree}/{n} (llama.cpp {llama_agree}/{n}); \
         max relative error vs transformers {vs_hf:.2e}, vs llama.cpp {vs_llama:.2e}"
    );
    if !device().is_cpu() {
        // The GPU kernels quantize activations to 16 bits, not to Q8_0's 8, so they cannot
        // follow llama.cpp's rounding; they must be no farther from transformers than llama.cpp
        // is, and find its argmax within one position of llama.cpp's count (this random model's
        // near-ties fall either way).
        let llama_vs_hf = (0..n).fold(0f32, |w, p| w.max(rel_err(&llama_logits[p], &r.logits[p])));
        assert!(
            vs_hf <= llama_vs_hf,
            "{arch} {file}: {vs_hf:.2e} from transformers, llama.cpp {llama_vs_hf:.2e}"
        );
        assert!(
            agree + 1 >= llama_agree,
            "{arch} {file}: argmax agrees at {agree}/{n}, llama.cpp at {llama_agree}/{n}"
        );
        return;
    }
    assert!(
        agree >= llama_agree,
        "{arch} {file}: argmax agrees at {agree}/{n}, llama.cpp at {llama_agree}/{n}"
    );
    assert!(
        vs_llama <= max_rel_to_llama_cpp,
        "{arch} {file}: relative error vs llama.cpp {vs_llama:.2e} > {max_rel_to_llama_cpp:.0e}"
    );
}

#[test]
fn qwen3_5_f32_gguf_matches_transformers() {
    check_f32("qwen3_5");
}

#[test]
fn qwen3_5_moe_f32_gguf_matches_transformers() {
    check_f32("qwen3_5_moe");
}

/// `--fuse-gate-up-exps`: gate and up experts in one `ffn_gate_up_exps` `[E, 2I, H]`.
#[test]
fn qwen3_5_moe_fused_gate_up_gguf_matches_transformers() {
    check_exact("qwen3_5_moe", "model-f32-fused.gguf");
}

#[test]
fn qwen3_5_q8_0_gguf_tracks_llama_cpp() {
    // Measured 4e-7: both round activations to Q8_0 blocks before the products.
    check_quantized("qwen3_5", "model-q8_0.gguf", 1e-4);
}

#[test]
fn qwen3_5_moe_q8_0_gguf_tracks_llama_cpp() {
    // Measured 2.9e-2: the converter leaves the experts' down projections F16 (rows of 16 are
    // not whole Q8_0 blocks), and llama.cpp rounds activations to f16 for F16 products.
    check_quantized("qwen3_5_moe", "model-q8_0.gguf", 5e-2);
}

/// The MTP block llama.cpp appends after the model's own (`blk.{n}.nextn.*`) is bound as the
/// MTP head, and not counted as a layer of the model.
#[test]
fn qwen3_5_gguf_mtp_head_is_loaded_from_the_nextn_block() {
    use afm_models::arch::qwen3_5::Qwen35;
    use afm_models::checkpoint::Checkpoint;
    use afm_models::weights::{GgufFile, WeightSource};
    use afm_models::TransformerConfig;
    use afm_runtime::compute::Device;

    let path = fixtures().join("qwen3_5_gguf/model-f32.gguf");
    let g = GgufFile::open(&path).expect("open");
    let mut cfg = TransformerConfig::from_gguf(&g, "qwen35").expect("config");
    afm_models::arch::qwen3_5::adjust_gguf_config(&mut cfg, &g);
    assert_eq!(cfg.num_layers, 4, "block_count 5 less 1 nextn layer");
    let src = WeightSource::Gguf(g);
    let m = Qwen35::load(&Checkpoint::new(&src, ""), &cfg, &Device::Cpu).expect("load");
    let mtp = m.mtp().expect("MTP head");
    assert_eq!(mtp.num_layers, 1);
    assert_eq!((mtp.fc.w.rows(), mtp.fc.w.cols()), (32, 64));
}

/// DeepSeek V4 from llama.cpp's converter: F32 tensors, MXFP4 routed experts holding exactly
/// the weights transformers ran (afm multiplies them against f32 activations), the I32
/// hash-routing table, the real HCA ratio 128 over 144 tokens; so the f32 tolerance holds.
#[test]
fn deepseek4_mxfp4_gguf_matches_transformers() {
    check_exact("deepseek_v4", "model-mxfp4.gguf");
}
