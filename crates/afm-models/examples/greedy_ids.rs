//! Greedy continuation of a prompt given as token ids: `greedy_ids <model> <n> <id,id,...>`.
//! A debugging aid for comparing the raw model against llama.cpp without a tokenizer.

use afm_models::source::resolve_model;
use afm_models::{load_model, ForwardBatch, SeqChunk};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = load_model(&resolve_model(&args[1]).expect("resolve")).expect("load");
    let n: usize = args[2].parse().expect("n");
    let mut tokens: Vec<u32> = args[3].split(',').map(|t| t.parse().expect("id")).collect();
    let total = tokens.len() + n;
    let table: Vec<u32> = (0..total.div_ceil(16) as u32).collect();
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), table.len(), 16, m.kv_dtype)
        .expect("KV pool");
    let t0 = std::time::Instant::now();
    let mut pos = 0;
    let mut out = Vec::new();
    for step in 0..n {
        let chunk = &tokens[pos..];
        let seq = [SeqChunk {
            state_slot: None,
            len: chunk.len(),
            pos0: pos,
            block_table: &table,
            logits: true,
        }];
        let logits = m
            .model
            .forward(
                &ForwardBatch {
                    tokens: chunk,
                    seqs: &seq,
                },
                &mut kv,
            )
            .expect("forward");
        pos = tokens.len();
        let next =
            (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b }) as u32;
        if step == 0 {
            eprintln!("prefill {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
        }
        tokens.push(next);
        out.push(next);
    }
    eprintln!("{n} tokens in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    println!("{out:?}");
}
