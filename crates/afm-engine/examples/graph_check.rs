//! The GPU decode path (CUDA graphs + device sampling) against the engine's host path on the
//! same device, through the real engine: `graph_check <model> [device]`.
//!
//! Three engines on one model file: decode steps eager with host sampling; as graphs with
//! device sampling; and the same with the decode overlap (each step launched from the last
//! one's sampled ids before the host reads them). The same requests go to each, 8 at a time
//! (8k with `AFM_GRAPH_CHECK_COPIES=k`: k copies on other prompts) and ending at different
//! steps: greedy, seeded draws with top-k/top-p/min-p, penalties and bias, and one asking for
//! log-probabilities (sampled on the host from its downloaded row).
//! Then, on the two graph engines, requests cut short by a stop token or `max_tokens` 1–3.
//! Prints, per request, whether the tokens are identical or where they part; exits 1 if a
//! greedy request parts from the host path within 16 tokens, or if the overlap changes any
//! token or any request's end.

use afm_engine::{Engine, EngineConfig, GenerateEvent, GenerateRequest, SamplingParams};
use afm_models::load_model_on;
use afm_models::random_ids::random_token_ids as prompt;
use afm_models::source::resolve_model;
use afm_runtime::compute::{Device, DeviceChoice};

fn requests(vocab: usize) -> Vec<(String, GenerateRequest)> {
    let base = |i: u64, sampling: SamplingParams, lp: Option<usize>| GenerateRequest {
        prompt_tokens: prompt(i, 20 + 7 * i as usize, vocab),
        sampling,
        max_tokens: 24 + 2 * i as usize,
        stop_token_ids: Vec::new(),
        top_logprobs: lp,
    };
    let drawn = |seed| SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.02,
        seed: Some(seed),
        ..Default::default()
    };
    vec![
        ("greedy a".into(), base(1, SamplingParams::default(), None)),
        ("greedy b".into(), base(2, SamplingParams::default(), None)),
        ("greedy c".into(), base(3, SamplingParams::default(), None)),
        (
            "greedy + logprobs".into(),
            base(4, SamplingParams::default(), Some(3)),
        ),
        ("seeded top-k/top-p/min-p".into(), base(5, drawn(11), None)),
        (
            "seeded, temperature 1, no filters".into(),
            base(
                6,
                SamplingParams {
                    temperature: 1.0,
                    seed: Some(12),
                    ..Default::default()
                },
                None,
            ),
        ),
        (
            "seeded + penalties + bias".into(),
            base(
                7,
                SamplingParams {
                    repetition_penalty: 1.3,
                    presence_penalty: 0.5,
                    frequency_penalty: 0.3,
                    logit_bias: vec![(5, 2.0), (17, -100.0)],
                    ..drawn(13)
                },
                None,
            ),
        ),
        (
            "greedy + repetition penalty".into(),
            base(
                8,
                SamplingParams {
                    repetition_penalty: 1.5,
                    ..Default::default()
                },
                None,
            ),
        ),
    ]
}

fn run(engine: &afm_engine::EngineHandle, reqs: &[(String, GenerateRequest)]) -> Vec<Vec<u32>> {
    let rxs: Vec<_> = reqs
        .iter()
        .map(|(_, r)| engine.submit(r.clone()).expect("submit").1)
        .collect();
    rxs.into_iter()
        .map(|mut rx| {
            let mut toks = Vec::new();
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    GenerateEvent::Token { id, .. } => toks.push(id),
                    GenerateEvent::Finished { .. } => break,
                    GenerateEvent::Error { message } => panic!("request failed: {message}"),
                }
            }
            toks
        })
        .collect()
}

/// Where two token lists part: `None` if identical.
fn parting(a: &[u32], b: &[u32]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        None if a.len() == b.len() => None,
        None => Some(a.len().min(b.len())),
        p => p,
    }
}

/// Requests that end early, built from greedy outputs of `reqs` (as `base` saw them): a stop
/// token (the 6th generated, so the output ends at its first occurrence), and `max_tokens` of
/// 1, 2 and 3. Each with the tokens it must produce.
fn short_requests(
    reqs: &[(String, GenerateRequest)],
    base: &[Vec<u32>],
) -> Vec<(String, GenerateRequest, Vec<u32>)> {
    let mut out = Vec::new();
    for (i, (name, r)) in reqs.iter().enumerate().take(3) {
        let toks = &base[i];
        if toks.len() > 6 {
            let stop = toks[5];
            let end = toks.iter().position(|&t| t == stop).expect("present") + 1;
            let mut q = r.clone();
            q.stop_token_ids = vec![stop];
            out.push((format!("{name}, stop token"), q, toks[..end].to_vec()));
        }
        let n = i + 1;
        let mut q = r.clone();
        q.max_tokens = n;
        out.push((
            format!("{name}, max_tokens {n}"),
            q,
            toks[..n.min(toks.len())].to_vec(),
        ));
    }
    out
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let loc = resolve_model(a.get(1).expect("usage: graph_check <model> [device]")).expect("model");
    let choice: DeviceChoice = a.get(2).map_or("cuda", |s| s).parse().expect("device");
    let dev = Device::open(choice).expect("open device");
    // AFM_GRAPH_CHECK_COPIES=k: k copies of the requests (other prompts), 8k at a time, so
    // decode steps also pass the one-row kernels' 8 rows (cuBLAS GEMMs, the tensor-core decode
    // attention) in graphs of the larger buckets.
    let copies: usize = std::env::var("AFM_GRAPH_CHECK_COPIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    let mut results = Vec::new();
    let mut short_results = Vec::new();
    let mut reqs = Vec::new();
    let mut short = Vec::new();
    for (graphs, overlap) in [(false, false), (true, false), (true, true)] {
        let model = load_model_on(&loc, &dev).expect("load");
        reqs = requests(model.model.vocab_size());
        let first = reqs.clone();
        for c in 1..copies {
            for (k, (name, r)) in first.iter().enumerate() {
                let mut r = r.clone();
                let seed = (100 * c + k) as u64;
                r.prompt_tokens = prompt(seed, r.prompt_tokens.len(), model.model.vocab_size());
                reqs.push((format!("{name} #{c}"), r));
            }
        }
        let cfg = EngineConfig {
            max_context: 2048,
            concurrent: 8 * copies,
            prefix_caching: false,
            device_decode: graphs,
            decode_overlap: overlap,
            prewarm: true,
            kv_budget_bytes: Some(1 << 30),
            ..EngineConfig::default()
        };
        let engine = Engine::spawn(model, cfg).expect("engine");
        results.push(run(&engine, &reqs));
        if graphs {
            if short.is_empty() {
                short = short_requests(&reqs, &results[1]);
            }
            let plain: Vec<(String, GenerateRequest)> = short
                .iter()
                .map(|(n, r, _)| (n.clone(), r.clone()))
                .collect();
            short_results.push(run(&engine, &plain));
        }
        engine.shutdown(); // frees this engine's device state before the next one loads
    }
    let mut greedy_ok = true;
    let mut overlap_ok = true;
    for (i, (name, _)) in reqs.iter().enumerate() {
        let (h, d, o) = (&results[0][i], &results[1][i], &results[2][i]);
        match parting(h, d) {
            None => println!("{name}: identical ({} tokens)", h.len()),
            Some(p) if p >= h.len().min(d.len()) => {
                println!("{name}: lengths differ ({} vs {})", h.len(), d.len())
            }
            Some(p) => {
                println!(
                    "{name}: parts at token {p} (host {} vs device {})",
                    h[p], d[p]
                );
                if name.starts_with("greedy") && p < 16 {
                    greedy_ok = false;
                }
            }
        }
        if let Some(p) = parting(d, o) {
            println!(
                "{name}: the overlap parts at token {p} ({} vs {} tokens)",
                d.len(),
                o.len()
            );
            overlap_ok = false;
        }
    }
    for (k, (name, _, want)) in short.iter().enumerate() {
        for (label, got) in ["graphs", "overlap"].iter().zip(&short_results) {
            if got[k] == *want {
                println!("{name} ({label}): {} tokens as expected", want.len());
            } else {
                println!("{name} ({label}): got {:?}, want {:?}", got[k], want);
                overlap_ok = false;
            }
        }
    }
    println!("host:    {:?}", results[0][0]);
    println!("device:  {:?}", results[1][0]);
    println!("overlap: {:?}", results[2][0]);
    if !greedy_ok {
        println!("FAIL: greedy requests part within 16 tokens");
    }
    if !overlap_ok {
        println!("FAIL: the decode overlap changed tokens or where requests end");
    }
    if !greedy_ok || !overlap_ok {
        std::process::exit(1);
    }
    println!("PASS");
}
