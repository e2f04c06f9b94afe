//! Logits at every position of a token-id sequence, decoded one token at a time, written as raw
//! little-endian f32 rows: `logits_ids <model> <id,id,...> <out.bin>`. A debugging aid for
//! comparing against llama.cpp or transformers.

use std::io::Write;

use afm_models::source::resolve_model;
use afm_models::{load_model, ForwardBatch, SeqChunk};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = load_model(&resolve_model(&args[1]).expect("resolve")).expect("load");
    let tokens: Vec<u32> = args[2].split(',').map(|t| t.parse().expect("id")).collect();
    let table: Vec<u32> = (0..tokens.len().div_ceil(16) as u32).collect();
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), table.len(), 16, m.kv_dtype)
        .expect("KV pool");
    let mut f = std::fs::File::create(&args[3]).expect("create");
    for pos in 0..tokens.len() {
        let seq = [SeqChunk {
            state_slot: None,
            len: 1,
            pos0: pos,
            block_table: &table,
            logits: true,
        }];
        let logits = m
            .model
            .forward(
                &ForwardBatch {
                    tokens: &tokens[pos..pos + 1],
                    seqs: &seq,
                },
                &mut kv,
            )
            .expect("forward");
        for v in logits {
            f.write_all(&v.to_le_bytes()).expect("write");
        }
    }
}
