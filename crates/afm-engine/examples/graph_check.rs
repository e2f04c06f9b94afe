//! The GPU decode path (CUDA graphs + device sampling) against the engine's host path on the
//! same device, through the real engine: `graph_check <model> [device]`.
//!
//! Two engines on one model file: decode steps eager with host sampling, and as graphs with
//! device sampling. The same requests go to both, 8 at a time: greedy, seeded draws with
//! top-k/top-p/min-p, penalties and bias, and one asking for log-probabilities (sampled on the
//! host from its downloaded row). Prints, per request, whether the tokens are identical or
//! where they part; exits 1 if fewer than all greedy requests agree for their first 16 tokens.

use afm_engine::{Engine, EngineConfig, GenerateEvent, GenerateRequest, SamplingParams};
use afm_models::load_model_on;
use afm_models::random_ids::random_token_ids as prompt;
use afm_models::source::resolve_model;
use afm_runtime::compute::{Device, DeviceChoice};

fn requests(vocab: usize) -> Vec<(String, GenerateRequest)> {
    let base = |i: u64, sampling: SamplingParams, lp: Option<usize>| GenerateRequest {
        prompt_tokens: prompt(i, 20 + 7 * i as usize, vocab),
        sampling,
        max_tokens: 32,
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

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let loc = resolve_model(a.get(1).expect("usage: graph_check <model> [device]")).expect("model");
    let choice: DeviceChoice = a.get(2).map_or("cuda", |s| s).parse().expect("device");
    let dev = Device::open(choice).expect("open device");
    let mut results = Vec::new();
    let mut reqs = Vec::new();
    for graphs in [false, true] {
        let model = load_model_on(&loc, &dev).expect("load");
        reqs = requests(model.model.vocab_size());
        let cfg = EngineConfig {
            max_context: 2048,
            concurrent: 8,
            prefix_caching: false,
            device_decode: graphs,
            prewarm: true,
            kv_budget_bytes: Some(1 << 30),
            ..EngineConfig::default()
        };
        let engine = Engine::spawn(model, cfg).expect("engine");
        results.push(run(&engine, &reqs));
        engine.shutdown(); // frees this engine's device state before the next one loads
    }
    let mut greedy_ok = true;
    for (i, (name, _)) in reqs.iter().enumerate() {
        let (h, d) = (&results[0][i], &results[1][i]);
        match h.iter().zip(d).position(|(x, y)| x != y) {
            None if h.len() == d.len() => println!("{name}: identical ({} tokens)", h.len()),
            None => println!("{name}: lengths differ ({} vs {})", h.len(), d.len()),
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
    }
    println!("host:   {:?}", results[0][0]);
    println!("device: {:?}", results[1][0]);
    if !greedy_ok {
        println!("FAIL: greedy requests part within 16 tokens");
        std::process::exit(1);
    }
    println!("PASS");
}
