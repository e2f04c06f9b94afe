//! Wall time of one decode step of the raw model at several batch sizes, without the engine:
//! `step_time <model> <prompt len> <steps> <batch,batch,...>`, e.g.
//! `step_time models/SmolLM2-135M-Instruct.Q4_1.gguf 128 64 1,8`.
//!
//! For each batch size B: B sequences of distinct pseudo-random prompts are prefilled, then
//! `steps` greedy decode steps run with all B sequences in each forward. Prints the minimum
//! and median step time and B / min-step as tokens per second. On a shared machine the
//! minimum is the stable figure (other work only ever adds time); `afm bench` measures the
//! same steps through the engine and server path.

use afm_models::random_ids::random_token_ids as prompt;
use afm_models::source::resolve_model;
use afm_models::{load_model, ForwardBatch, SeqChunk};
use std::time::Instant;

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: step_time <model> <prompt len> <steps> <batch,batch,...>");
        std::process::exit(2);
    }
    let parse = |s: &str, what: &str| -> usize {
        s.parse().unwrap_or_else(|_| {
            eprintln!("step_time: {what} must be a number, got {s:?}");
            std::process::exit(2)
        })
    };
    let (plen, steps) = (parse(&args[2], "prompt len"), parse(&args[3], "steps"));
    if steps == 0 {
        eprintln!("step_time: steps must be at least 1");
        std::process::exit(2);
    }
    let batches: Vec<usize> = args[4].split(',').map(|b| parse(b, "batch")).collect();
    let path = resolve_model(&args[1]).unwrap_or_else(|e| {
        eprintln!("step_time: {e}");
        std::process::exit(1)
    });
    let m = load_model(&path).unwrap_or_else(|e| {
        eprintln!("step_time: {e}");
        std::process::exit(1)
    });
    let vocab = m.model.vocab_size();
    let block = 16;
    let per_seq = (plen + steps + 1).div_ceil(block);
    for &b in &batches {
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let mut kv = m
            .device
            .kv_pool(&m.model.kv_shapes(), b * per_seq, block, m.kv_dtype)
            .unwrap_or_else(|e| {
                eprintln!("step_time: KV pool: {e}");
                std::process::exit(1)
            });
        // Prefill every sequence in one batch; its logits give each one's first token.
        let prompts: Vec<Vec<u32>> = (0..b).map(|s| prompt(s as u64 + 1, plen, vocab)).collect();
        let tokens: Vec<u32> = prompts.concat();
        let seqs: Vec<SeqChunk> = tables
            .iter()
            .map(|t| SeqChunk {
                state_slot: None,
                len: plen,
                pos0: 0,
                block_table: t,
                logits: true,
            })
            .collect();
        // On the worker pool with the other workers polling, as the engine runs a step.
        let forward = |tokens: &[u32], seqs: &[SeqChunk], kv: &mut _| {
            afm_runtime::threads::install(|| m.model.forward(&ForwardBatch { tokens, seqs }, kv))
                .unwrap_or_else(|e| {
                    eprintln!("step_time: forward: {e}");
                    std::process::exit(1)
                })
        };
        let logits = forward(&tokens, &seqs, &mut kv);
        let mut next: Vec<u32> = logits.chunks(vocab).map(argmax).collect();
        let mut times = Vec::with_capacity(steps);
        for step in 0..steps {
            let seqs: Vec<SeqChunk> = tables
                .iter()
                .map(|t| SeqChunk {
                    state_slot: None,
                    len: 1,
                    pos0: plen + step,
                    block_table: t,
                    logits: true,
                })
                .collect();
            let t0 = Instant::now();
            let logits = forward(&next, &seqs, &mut kv);
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            next = logits.chunks(vocab).map(argmax).collect();
        }
        times.sort_by(f64::total_cmp);
        let (min, med) = (times[0], times[times.len() / 2]);
        println!(
            "batch {b:3}: step min {min:7.2} ms  median {med:7.2} ms  {:8.1} tok/s at the min",
            b as f64 * 1e3 / min
        );
    }
}
