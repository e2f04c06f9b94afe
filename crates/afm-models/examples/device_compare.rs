//! One model on the CPU and on another device (a GPU), compared, then timed there:
//!
//! `device_compare <model> <device> <prompt len> <gen tokens> <decode steps> <batches>`
//! e.g. `device_compare /tmp/qwen3-0.6b cuda 32 32 128 1,8`.
//!
//! 1. Greedy on the CPU from a fixed pseudo-random prompt; the device is fed the CPU's tokens
//!    (teacher forcing), so every step compares logits for the same input: relative error
//!    max |dev − cpu| / max |cpu| and argmax agreement. A free-running greedy on the device
//!    then reports where, if anywhere, it parts from the CPU and the CPU's logit gap there.
//! 2. Decode speed on the device: `batch` sequences prefilled together, then `decode steps`
//!    steps of one token each (logits to the host and argmax there, as the engine does).

use std::time::Instant;

use afm_models::random_ids::random_token_ids as prompt;
use afm_models::source::{resolve_model, ModelLocation};
use afm_models::{load_model_on, ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::compute::{Device, DeviceChoice};

const BLOCK: usize = 16;

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Greedy continuation; with `forced`, step i feeds `forced[i]` instead of its own choice.
/// Returns the chosen tokens and each step's logits.
fn greedy(
    m: &LoadedModel,
    prompt: &[u32],
    gen: usize,
    forced: Option<&[u32]>,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let table: Vec<u32> = (0..(prompt.len() + gen).div_ceil(BLOCK) as u32).collect();
    let shapes = m.model.kv_shapes();
    let mut kv = m
        .device
        .kv_pool(&shapes, table.len(), BLOCK, m.kv_dtype)
        .expect("KV pool");
    let mut fwd = |tokens: &[u32], pos0: usize| {
        let seq = [SeqChunk {
            state_slot: None,
            len: tokens.len(),
            pos0,
            block_table: &table,
            logits: true,
        }];
        let batch = ForwardBatch { tokens, seqs: &seq };
        m.model.forward(&batch, &mut kv).expect("forward")
    };
    let mut logits = fwd(prompt, 0);
    let (mut chosen, mut rows) = (Vec::new(), Vec::new());
    for i in 0..gen {
        let tok = argmax(&logits) as u32;
        chosen.push(tok);
        let next = forced.map_or(tok, |f| f[i]);
        rows.push(std::mem::take(&mut logits));
        if i + 1 < gen {
            logits = fwd(&[next], prompt.len() + i);
        }
    }
    (chosen, rows)
}

fn compare(cpu: &LoadedModel, dev: &LoadedModel, prompt: &[u32], gen: usize) {
    let (cpu_tok, cpu_logits) = greedy(cpu, prompt, gen, None);
    let (forced_tok, dev_logits) = greedy(dev, prompt, gen, Some(&cpu_tok));
    let errs: Vec<f32> = dev_logits
        .iter()
        .zip(&cpu_logits)
        .map(|(a, b)| rel_err(a, b))
        .collect();
    let agree = forced_tok
        .iter()
        .zip(&cpu_tok)
        .filter(|(a, b)| a == b)
        .count();
    let max_err = errs.iter().copied().fold(0f32, f32::max);
    let mean_err = errs.iter().sum::<f32>() / errs.len().max(1) as f32;
    println!(
        "teacher-forced: argmax agrees {agree}/{gen}; logits relative error max {max_err:.2e}, mean {mean_err:.2e} (prefill row {:.2e})",
        errs.first().copied().unwrap_or(0.0)
    );
    let (free, _) = greedy(dev, prompt, gen, None);
    match free.iter().zip(&cpu_tok).position(|(a, b)| a != b) {
        None => println!("free-running greedy: identical for all {gen} tokens"),
        Some(i) => {
            let l = &cpu_logits[i];
            let gap = l[cpu_tok[i] as usize] - l[free[i] as usize];
            println!(
                "free-running greedy: parts at token {i} (cpu {} vs device {}; cpu logit gap {gap:.3})",
                cpu_tok[i], free[i]
            );
        }
    }
    println!("cpu tokens:    {cpu_tok:?}");
    println!("device tokens: {free:?}");
}

/// Seconds: prefill; per decode step, all of it and the host argmax part.
struct Timing {
    prefill: f64,
    step: f64,
    argmax: f64,
}

/// `batch` sequences of `plen` prompt tokens prefilled together, then `steps` decode steps.
fn bench(m: &LoadedModel, batch: usize, plen: usize, steps: usize) -> Timing {
    let per_seq = (plen + steps + 2).div_ceil(BLOCK);
    let shapes = m.model.kv_shapes();
    let mut kv = m
        .device
        .kv_pool(&shapes, batch * per_seq, BLOCK, m.kv_dtype)
        .expect("KV pool");
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect())
        .collect();
    let vocab = m.model.vocab_size();
    // Returns the next tokens and the seconds the host argmax took.
    let mut run = |tokens: &[u32], len: usize, pos0: usize| -> (Vec<u32>, f64) {
        let seqs: Vec<SeqChunk> = tables
            .iter()
            .map(|t| SeqChunk {
                state_slot: None,
                len,
                pos0,
                block_table: t,
                logits: true,
            })
            .collect();
        let batch = ForwardBatch {
            tokens,
            seqs: &seqs,
        };
        let logits = m.model.forward(&batch, &mut kv).expect("forward");
        let t = Instant::now();
        let next = logits
            .chunks_exact(vocab)
            .map(|r| argmax(r) as u32)
            .collect();
        (next, t.elapsed().as_secs_f64())
    };
    let prompts: Vec<u32> = (0..batch)
        .flat_map(|b| prompt(100 + b as u64, plen, vocab))
        .collect();
    let t0 = Instant::now();
    let (mut next, _) = run(&prompts, plen, 0);
    let prefill = t0.elapsed().as_secs_f64();
    let warmup = 2.min(steps);
    for s in 0..warmup {
        next = run(&next, 1, plen + s).0;
    }
    let t1 = Instant::now();
    let mut argmax_s = 0.0;
    for s in warmup..steps {
        let (n, a) = run(&next, 1, plen + s);
        (next, argmax_s) = (n, argmax_s + a);
    }
    let timed = (steps - warmup).max(1) as f64;
    Timing {
        prefill,
        step: t1.elapsed().as_secs_f64() / timed,
        argmax: argmax_s / timed,
    }
}

fn weight_bytes(loc: &ModelLocation) -> u64 {
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    match loc {
        ModelLocation::Gguf(p) => size(p),
        ModelLocation::HfDir(d) => std::fs::read_dir(d)
            .map(|it| {
                it.filter_map(|e| e.ok())
                    .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                    .map(|e| size(&e.path()))
                    .sum()
            })
            .unwrap_or(0),
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 7 {
        eprintln!("usage: device_compare <model> <device> <prompt len> <gen tokens> <decode steps> <batches>");
        std::process::exit(2);
    }
    let num = |i: usize| -> usize {
        a[i].parse()
            .unwrap_or_else(|_| panic!("argument {i}: a number"))
    };
    let (plen, gen, steps) = (num(3), num(4), num(5));
    let batches: Vec<usize> = a[6]
        .split(',')
        .map(|b| b.parse().expect("batch size"))
        .collect();
    let loc = resolve_model(&a[1]).expect("model location");
    let choice: DeviceChoice = a[2].parse().expect("device");
    let dev = Device::open(choice).expect("open device");
    let t = Instant::now();
    let cpu = load_model_on(&loc, &Device::Cpu).expect("load on cpu");
    println!(
        "model {} ({}), cpu load {:.2} s",
        cpu.name,
        cpu.arch,
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let on_dev = load_model_on(&loc, &dev).expect("load on device");
    println!(
        "{}: load {:.2} s",
        dev.describe(),
        t.elapsed().as_secs_f64()
    );
    let p = prompt(7, plen, cpu.model.vocab_size());
    compare(&cpu, &on_dev, &p, gen);
    let gb = weight_bytes(&loc) as f64 / 1e9;
    for &b in &batches {
        let t = bench(&on_dev, b, plen, steps);
        println!(
            "{} batch {b}: prefill {} tokens {:.1} ms ({:.0} tok/s); decode {:.3} ms/step (host argmax {:.3}), {:.1} tok/s aggregate; weights {gb:.3} GB → {:.0} GB/s effective",
            dev.describe(),
            b * plen,
            t.prefill * 1e3,
            (b * plen) as f64 / t.prefill,
            t.step * 1e3,
            t.argmax * 1e3,
            b as f64 / t.step,
            gb / t.step
        );
    }
    let cpu_step = bench(&cpu, 1, plen, 8.min(steps)).step;
    println!(
        "cpu batch 1 ({} threads): decode {:.1} ms/step, {:.1} tok/s",
        afm_runtime::threads::num_threads(),
        cpu_step * 1e3,
        1.0 / cpu_step
    );
}
