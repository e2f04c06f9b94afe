//! Decode throughput and time to first token through the real engine (scheduler, KV blocks,
//! CUDA graphs, device sampling), for `bench/gpu_bench.sh`:
//!
//! `gpu_bench <model> <device> <streams> <prompt len> <gen tokens> <ttft lens> [graphs y|n]`
//! (`AFM_DECODE_OVERLAP=0`: the engine's decode overlap off)
//! e.g. `gpu_bench /tmp/qwen3-0.6b cuda 1,8,32,64 128 256 1024,16384`.
//!
//! For each stream count N, N greedy requests with distinct pseudo-random prompts are
//! submitted at once; aggregate decode tok/s counts the tokens that arrive after the last
//! stream's first token, over the time from then to the last token. TTFT: one request of each
//! prompt length alone, median of three distinct prompts (prefix caching off). Before the
//! engine starts, one 32-token forward checks that the logits are finite (random weights at
//! real widths can overflow bf16). Device memory is read after loading (weights), after the
//! engine starts (+ KV pool) and every 20 ms while it runs (peak). Prints one `RESULT {json}`
//! line.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use afm_engine::{Engine, EngineConfig, GenerateEvent, GenerateRequest, SamplingParams};
use afm_models::random_ids::random_token_ids as prompt;
use afm_models::source::resolve_model;
use afm_models::{load_model_on, ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::compute::{Device, DeviceChoice, StatePool};

fn request(tokens: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: tokens,
        sampling: SamplingParams::default(),
        max_tokens,
        stop_token_ids: Vec::new(),
        top_logprobs: None,
    }
}

/// Token arrival times of one request, until it finishes.
fn collect(mut rx: afm_engine::EventReceiver) -> Result<Vec<Instant>, String> {
    let mut times = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerateEvent::Token { .. } => times.push(Instant::now()),
            GenerateEvent::Finished { .. } => return Ok(times),
            GenerateEvent::Error { message } => return Err(message),
        }
    }
    Err("engine stopped".into())
}

/// One forward of a 32-token prompt outside the engine: (all logits finite, max |logit|).
fn logits_check(m: &LoadedModel) -> (bool, f32) {
    let tokens = prompt(7, 32, m.model.vocab_size());
    let table: Vec<u32> = (0..2).collect();
    let mut kv = m
        .device
        .kv_pool(&m.model.kv_shapes(), 2, 16, m.kv_dtype)
        .expect("KV pool for the logits check");
    let states = m.model.state_shapes();
    if !states.is_empty() {
        kv.attach_states(StatePool::new(&states, 1));
    }
    let seq = [SeqChunk {
        len: tokens.len(),
        pos0: 0,
        block_table: &table,
        logits: true,
        state_slot: (!states.is_empty()).then_some(0),
    }];
    let batch = ForwardBatch {
        tokens: &tokens,
        seqs: &seq,
    };
    let logits = m
        .model
        .forward(&batch, &mut kv)
        .expect("logits check forward");
    let max = logits.iter().fold(0f32, |a, v| a.max(v.abs()));
    (logits.iter().all(|v| v.is_finite()), max)
}

/// Polls the device's used memory until `stop`, keeping the largest value seen.
fn watch_peak(dev: Device, stop: Arc<AtomicBool>, peak: Arc<AtomicUsize>) {
    while !stop.load(Ordering::Relaxed) {
        if let Ok(Some((free, total))) = dev.memory() {
            peak.fetch_max(total - free, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 7 {
        eprintln!("usage: gpu_bench <model> <device> <streams> <prompt len> <gen tokens> <ttft lens> [graphs y|n]");
        std::process::exit(2);
    }
    let list = |s: &str| -> Vec<usize> {
        s.split(',')
            .filter(|x| !x.is_empty())
            .map(|x| x.parse().expect("a number"))
            .collect()
    };
    let streams = list(&a[3]);
    let (plen, gen): (usize, usize) = (
        a[4].parse().expect("prompt len"),
        a[5].parse().expect("gen"),
    );
    let ttft_lens = list(&a[6]);
    let graphs = a.get(7).is_none_or(|g| g == "y");
    // AFM_DECODE_OVERLAP=0: each decode step waits for the last one's tokens (for A/B runs).
    let overlap = std::env::var("AFM_DECODE_OVERLAP").map_or(true, |v| v != "0");
    let loc = resolve_model(&a[1]).expect("model location");
    let choice: DeviceChoice = a[2].parse().expect("device");
    let dev = Device::open(choice).expect("open device");
    let mem0 = dev.memory().ok().flatten();
    let t = Instant::now();
    let model = load_model_on(&loc, &dev).expect("load");
    let load_s = t.elapsed().as_secs_f64();
    let mem_weights = dev.memory().ok().flatten();
    let (finite, logit_max) = logits_check(&model);
    eprintln!(
        "logits check (32-token prefill outside the engine): {}, max |logit| {logit_max:.3}",
        if finite { "all finite" } else { "NOT FINITE" }
    );
    let (stop, peak) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let watcher = {
        let (d, s, p) = (dev.clone(), stop.clone(), peak.clone());
        std::thread::spawn(move || watch_peak(d, s, p))
    };
    let vocab = model.model.vocab_size();
    let max_streams = streams.iter().copied().max().unwrap_or(1);
    let max_ttft = ttft_lens.iter().copied().max().unwrap_or(0);
    let cfg = EngineConfig {
        max_context: (max_ttft.max(plen) + gen + 64).next_multiple_of(1024),
        concurrent: max_streams,
        prefill_step_size: 16384,
        prefix_caching: false,
        device_decode: graphs,
        decode_overlap: overlap,
        prewarm: true,
        kv_budget_fraction: Some(0.5),
        ..EngineConfig::default()
    };
    let t = Instant::now();
    let engine = Engine::spawn(model, cfg).expect("engine");
    let spawn_s = t.elapsed().as_secs_f64();
    let mem_kv = dev.memory().ok().flatten();
    let mut seed = 1000u64;
    let mut decode = Vec::new();
    for &n in &streams {
        // Warm-up: one short round at this width.
        let mut run = |max_tokens: usize| -> Vec<Vec<Instant>> {
            let rxs: Vec<_> = (0..n)
                .map(|_| {
                    seed += 1;
                    let (_, rx) = engine
                        .submit(request(prompt(seed, plen, vocab), max_tokens))
                        .expect("submit");
                    rx
                })
                .collect();
            let handles: Vec<_> = rxs
                .into_iter()
                .map(|rx| std::thread::spawn(move || collect(rx)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("collector").expect("request"))
                .collect()
        };
        run(8);
        let times = run(gen);
        let start = times.iter().filter_map(|t| t.first()).max().copied();
        let end = times.iter().filter_map(|t| t.last()).max().copied();
        let (Some(start), Some(end)) = (start, end) else {
            continue;
        };
        let after = times.iter().flatten().filter(|&&t| t > start).count();
        let secs = end.duration_since(start).as_secs_f64().max(1e-9);
        let tps = after as f64 / secs;
        eprintln!("streams {n}: {after} tokens in {secs:.3} s after all first tokens: {tps:.1} tok/s aggregate");
        decode.push(format!(
            "{{\"streams\":{n},\"tok_s\":{tps:.2},\"tokens\":{after},\"seconds\":{secs:.4}}}"
        ));
    }
    let mut ttft = Vec::new();
    for &len in &ttft_lens {
        let mut v = Vec::new();
        for _ in 0..3 {
            seed += 1;
            let t = Instant::now();
            let (_, rx) = engine
                .submit(request(prompt(seed, len, vocab), 1))
                .expect("submit");
            let times = collect(rx).expect("request");
            let first = times.first().copied().unwrap_or_else(Instant::now);
            v.push(first.duration_since(t).as_secs_f64());
        }
        let m = median(v);
        eprintln!(
            "TTFT {len} tokens: {:.1} ms ({:.0} tok/s prefill)",
            m * 1e3,
            len as f64 / m
        );
        ttft.push(format!(
            "{{\"prompt\":{len},\"ttft_ms\":{:.2},\"prefill_tok_s\":{:.1}}}",
            m * 1e3,
            len as f64 / m
        ));
    }
    stop.store(true, Ordering::Relaxed);
    watcher.join().expect("memory watcher");
    engine.shutdown();
    let mem =
        |m: Option<(usize, usize)>| m.map_or("null".to_string(), |(f, t)| format!("{}", t - f));
    let logit_max = if logit_max.is_finite() {
        format!("{logit_max:.4}")
    } else {
        "null".to_string()
    };
    let peak = match peak.load(Ordering::Relaxed) {
        0 => "null".to_string(),
        p => p.to_string(),
    };
    println!(
        "RESULT {{\"model\":\"{}\",\"device\":\"{}\",\"graphs\":{graphs},\"decode_overlap\":{overlap},\"load_s\":{load_s:.2},\"engine_start_s\":{spawn_s:.2},\"logits_finite\":{finite},\"logit_abs_max\":{logit_max},\"mem_used_start\":{},\"mem_used_weights\":{},\"mem_used_kv\":{},\"mem_used_peak\":{peak},\"prompt\":{plen},\"gen\":{gen},\"decode\":[{}],\"ttft\":[{}]}}",
        a[1],
        dev.describe(),
        mem(mem0),
        mem(mem_weights),
        mem(mem_kv),
        decode.join(","),
        ttft.join(",")
    );
}
