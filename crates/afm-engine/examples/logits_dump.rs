//! Dumps afm's next-token logits for every position of a token sequence, to compare the numerics
//! with another engine (scripts/compare_llamacpp_logits.py feeds llama.cpp the same ids).
//!
//! `logits_dump <model> <ids, comma-separated> <out.f32>` — writes `[len][vocab]` little-endian
//! f32. Row p comes from a prefill of the first p + 1 tokens as one chunk, so every row is computed
//! in the batched (prompt) order, as llama.cpp's batched replay computes its rows; one forward of
//! one-token spans would take the single-token decode order instead (a different float
//! summation, see docs/DECISIONS.md). The quadratic cost is nothing at these lengths.

use afm_models::source::resolve_model;
use afm_models::{load_model, ForwardBatch, SeqChunk};

const BLOCK: usize = 16;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: logits_dump <model> <ids,comma,separated> <out.f32>");
        std::process::exit(2);
    }
    let m = load_model(&resolve_model(&args[1]).expect("model")).expect("load");
    let tokens: Vec<u32> = args[2]
        .split(',')
        .map(|s| s.trim().parse().expect("token id"))
        .collect();
    let table: Vec<u32> = (0..tokens.len().div_ceil(BLOCK) as u32).collect();
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), table.len(), BLOCK, m.kv_dtype)
        .expect("KV pool");
    let mut logits = Vec::new();
    for p in 0..tokens.len() {
        let span = [SeqChunk {
            len: p + 1,
            pos0: 0,
            block_table: &table,
            logits: true,
            state_slot: None,
        }];
        let row = m
            .model
            .forward(
                &ForwardBatch {
                    tokens: &tokens[..=p],
                    seqs: &span,
                },
                &mut kv,
            )
            .expect("forward");
        logits.extend(row);
    }
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&args[3], bytes).expect("write");
}
