//! Quality cost of KV quantization: mean KL divergence of next-token distributions computed with
//! a quantized cache (`--kv-bits 8|4`) against the full-precision (f32) cache, over a fixed text.
//!
//! The matmuls run on f32 activations (`matmul::set_f32_activations`): with the usual 8-bit
//! activations, any small perturbation of the cache moves logits by about as much as the
//! activation rounding does (KL ≈ 4e-3 for f32 vs f16), which would hide the cache's own cost.
//! `--int8-activations` measures with them anyway. The f16 row (the checkpoint-precision cache)
//! is the floor against which the quantized rows are read.
//!
//! `kv_quality <model.gguf> <text file> [max tokens] [--int8-activations]` — prints one line per
//! cache type and the bytes a 4,096-token context needs with each. Logits for every position
//! come from one forward per chunk of tokens: each token is its own one-token span of the same
//! sequence, so every row attends causally to everything before it.

use afm_chat::Tokenizer;
use afm_models::source::resolve_model;
use afm_models::{load_model, ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::kv_store::{KvCache, KvDtype};

const BLOCK: usize = 16;
const CHUNK: usize = 256;

fn all_logits(m: &LoadedModel, tokens: &[u32], dtype: KvDtype) -> Vec<Vec<f64>> {
    let table: Vec<u32> = (0..tokens.len().div_ceil(BLOCK) as u32).collect();
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), table.len(), BLOCK, dtype)
        .expect("KV pool");
    let vocab = m.model.vocab_size();
    let mut rows = Vec::with_capacity(tokens.len());
    for start in (0..tokens.len()).step_by(CHUNK) {
        let end = (start + CHUNK).min(tokens.len());
        let spans: Vec<SeqChunk> = (start..end)
            .map(|p| SeqChunk {
                state_slot: None,
                len: 1,
                pos0: p,
                block_table: &table,
                logits: true,
            })
            .collect();
        let logits = m
            .model
            .forward(
                &ForwardBatch {
                    tokens: &tokens[start..end],
                    seqs: &spans,
                },
                &mut kv,
            )
            .expect("forward");
        rows.extend(logits.chunks_exact(vocab).map(log_softmax));
    }
    rows
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// KL(p ‖ q) with both given as log-probabilities.
fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a.exp() * (a - b)).sum()
}

fn main() {
    let mut args: Vec<String> = std::env::args().collect();
    let int8 = args.iter().any(|a| a == "--int8-activations");
    args.retain(|a| a != "--int8-activations");
    if args.len() < 3 {
        eprintln!("usage: kv_quality <model> <text file> [max tokens] [--int8-activations]");
        std::process::exit(2);
    }
    afm_runtime::matmul::set_f32_activations(!int8);
    let m = load_model(&resolve_model(&args[1]).expect("model")).expect("load");
    let tok = Tokenizer::from_gguf(m.gguf().expect("a GGUF model")).expect("tokenizer");
    let text = std::fs::read_to_string(&args[2]).expect("text");
    let limit: usize = args.get(3).map_or(1200, |s| s.parse().expect("max tokens"));
    let mut tokens = tok.encode(&text, true, false);
    tokens.truncate(limit);
    let reference = KvDtype::F32;
    let base = all_logits(&m, &tokens, reference);
    let shapes = m.model.kv_shapes();
    let bytes = |d| KvCache::bytes_per_block(&shapes, BLOCK, d) * 4096 / BLOCK;
    println!(
        "model {} | {} tokens | {} activations | reference cache F32 ({} MiB per 4k context); savings against the checkpoint's {:?} cache",
        m.name,
        tokens.len(),
        if int8 { "8-bit" } else { "f32" },
        bytes(reference) >> 20,
        m.kv_dtype,
    );
    for dtype in [KvDtype::F16, KvDtype::Q8, KvDtype::Q4] {
        let got = all_logits(&m, &tokens, dtype);
        let kls: Vec<f64> = base.iter().zip(&got).map(|(p, q)| kl(p, q)).collect();
        let mean = kls.iter().sum::<f64>() / kls.len() as f64;
        let max = kls.iter().copied().fold(0.0, f64::max);
        let agree = base
            .iter()
            .zip(&got)
            .filter(|(p, q)| argmax(p) == argmax(q))
            .count();
        println!(
            "{dtype:?}: mean KL {mean:.2e}, max KL {max:.2e}, top-1 agreement {:.2}% | {:.1} MiB per 4k context ({:.0}% saved)",
            100.0 * agree as f64 / got.len() as f64,
            bytes(dtype) as f64 / (1 << 20) as f64,
            100.0 * (1.0 - bytes(dtype) as f64 / bytes(m.kv_dtype) as f64)
        );
    }
}

fn argmax(x: &[f64]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}
