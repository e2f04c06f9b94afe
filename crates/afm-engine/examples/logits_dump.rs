//! Dumps afm's next-token logits for every position of a token sequence, to compare the numerics
//! with another engine (scripts/compare_llamacpp_logits.py feeds llama.cpp the same ids).
//!
//! `logits_dump <model> <ids, comma-separated> <out.f32>` — writes `[len][vocab]` little-endian
//! f32. The whole sequence is one forward in which every token is a one-token span of the same
//! sequence, so each row attends causally to everything before it.

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
    let spans: Vec<SeqChunk> = (0..tokens.len())
        .map(|p| SeqChunk {
            len: 1,
            pos0: p,
            block_table: &table,
            logits: true,
            state_slot: None,
        })
        .collect();
    let logits = m
        .model
        .forward(
            &ForwardBatch {
                tokens: &tokens,
                seqs: &spans,
            },
            &mut kv,
        )
        .expect("forward");
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&args[3], bytes).expect("write");
}
