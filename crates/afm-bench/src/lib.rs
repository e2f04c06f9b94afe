//! afm-bench: drives the engine with a declared workload and reports what a user compares:
//! prefill tok/s, time to first token, decode tok/s per request and in aggregate, inter-token
//! latency, wall time and prefix-cache hit rate, separately, with percentiles.
//!
//! Requests are synthetic token ids (no tokenizer in the loop) whose first part can be shared
//! between requests (`shared_prefix`), decoded greedily to exactly `gen_len` tokens (no stop
//! tokens), launched as fast as `concurrency` allows or at a Poisson `rate`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use afm_engine::{EngineHandle, FinishReason, GenerateEvent, GenerateRequest, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use tokio::sync::Semaphore;

#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    pub prompt_len: usize,
    pub gen_len: usize,
    pub requests: usize,
    pub concurrency: usize,
    /// Fraction of each prompt shared by all requests (0 = none, 1 = identical prompts).
    pub shared_prefix: f64,
    /// Requests per second (Poisson arrivals); `None` = start whenever a slot is free.
    pub rate: Option<f64>,
    pub seed: u64,
}

/// One request's measurements, in seconds.
#[derive(Debug, Clone)]
struct Sample {
    ttft: f64,
    gaps: Vec<f64>,
    prompt_tokens: usize,
    cached_tokens: usize,
    gen_tokens: usize,
    decode_time: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub workload: Workload,
    pub completed: usize,
    pub failed: usize,
    pub wall_s: f64,
    /// Uncached prompt tokens per second of prefill, averaged over requests.
    pub prefill_tps: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Median over requests of (tokens after the first) / (time after the first token).
    pub decode_tps_per_request: f64,
    /// All generated tokens / wall time.
    pub aggregate_tps: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// Prompt tokens served from the prefix cache / all prompt tokens.
    pub cache_hit_rate: f64,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

/// Prompts: a shared head, then per-request random ids from the ordinary part of the vocabulary.
fn prompts(w: &Workload, vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
    let lo = 256.min(vocab / 4) as u32;
    let hi = (vocab - vocab / 8).max(lo as usize + 1) as u32;
    let shared = ((w.prompt_len as f64) * w.shared_prefix.clamp(0.0, 1.0)).round() as usize;
    let head: Vec<u32> = (0..shared).map(|_| rng.gen_range(lo..hi)).collect();
    (0..w.requests)
        .map(|_| {
            let mut p = head.clone();
            p.extend((shared..w.prompt_len).map(|_| rng.gen_range(lo..hi)));
            p
        })
        .collect()
}

async fn one(engine: EngineHandle, prompt: Vec<u32>, gen_len: usize) -> Result<Sample, String> {
    let req = GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams::default(),
        max_tokens: gen_len,
        stop_token_ids: vec![],
        top_logprobs: None,
    };
    let t0 = Instant::now();
    let (_, mut rx) = engine.submit(req).map_err(|e| e.to_string())?;
    let mut last = t0;
    let mut first = None;
    let mut gaps = Vec::new();
    while let Some(ev) = rx.recv().await {
        let now = Instant::now();
        match ev {
            GenerateEvent::Token { .. } => {
                match first {
                    None => first = Some(now),
                    Some(_) => gaps.push((now - last).as_secs_f64()),
                }
                last = now;
            }
            GenerateEvent::Finished {
                reason: FinishReason::Cancelled,
                ..
            } => return Err("cancelled".into()),
            GenerateEvent::Finished { stats, .. } => {
                let first = first.unwrap_or(now);
                return Ok(Sample {
                    ttft: (first - t0).as_secs_f64(),
                    gaps,
                    prompt_tokens: stats.prompt_tokens,
                    cached_tokens: stats.cached_tokens,
                    gen_tokens: stats.completion_tokens,
                    decode_time: (last - first).as_secs_f64(),
                });
            }
            GenerateEvent::Error { message } => return Err(message),
        }
    }
    Err("engine stopped".into())
}

/// Runs one workload to completion; `progress` draws a bar on stderr.
pub async fn run(engine: &EngineHandle, vocab: usize, w: &Workload, progress: bool) -> Report {
    let slots = Arc::new(Semaphore::new(w.concurrency.max(1)));
    let mut rng = ChaCha8Rng::seed_from_u64(w.seed ^ 0x5eed);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(w.requests);
    for p in prompts(w, vocab) {
        if let Some(rate) = w.rate {
            let wait = -(1.0 - rng.gen::<f64>()).ln() / rate;
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore is never closed");
        let (e, gen) = (engine.clone(), w.gen_len);
        tasks.push(tokio::spawn(async move {
            let r = one(e, p, gen).await;
            drop(permit);
            r
        }));
    }
    let mut samples = Vec::new();
    let mut failed = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(Ok(s)) => samples.push(s),
            _ => failed += 1,
        }
        if progress {
            draw_progress(i + 1, w.requests, start.elapsed().as_secs_f64());
        }
    }
    if progress {
        eprintln!();
    }
    summarize(w, samples, failed, start.elapsed().as_secs_f64())
}

fn draw_progress(done: usize, total: usize, secs: f64) {
    let width = 30;
    let filled = done * width / total.max(1);
    eprint!(
        "\r[{}{}] {done}/{total} requests, {secs:.1} s",
        "#".repeat(filled),
        ".".repeat(width - filled)
    );
}

fn summarize(w: &Workload, samples: Vec<Sample>, failed: usize, wall: f64) -> Report {
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
    let mut gaps: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.gaps.iter().copied())
        .collect();
    let mut per_req: Vec<f64> = samples
        .iter()
        .filter(|s| s.gen_tokens > 1 && s.decode_time > 0.0)
        .map(|s| (s.gen_tokens - 1) as f64 / s.decode_time)
        .collect();
    let prefill: Vec<f64> = samples
        .iter()
        .filter(|s| s.ttft > 0.0)
        .map(|s| (s.prompt_tokens - s.cached_tokens) as f64 / s.ttft)
        .collect();
    let prompt_total: usize = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached_total: usize = samples.iter().map(|s| s.cached_tokens).sum();
    let generated: usize = samples.iter().map(|s| s.gen_tokens).sum();
    Report {
        workload: w.clone(),
        completed: samples.len(),
        failed,
        wall_s: wall,
        prefill_tps: prefill.iter().sum::<f64>() / prefill.len().max(1) as f64,
        ttft_p50_ms: percentile(&mut ttft, 0.5) * 1e3,
        ttft_p99_ms: percentile(&mut ttft, 0.99) * 1e3,
        decode_tps_per_request: percentile(&mut per_req, 0.5),
        aggregate_tps: generated as f64 / wall,
        itl_p50_ms: percentile(&mut gaps, 0.5) * 1e3,
        itl_p99_ms: percentile(&mut gaps, 0.99) * 1e3,
        cache_hit_rate: cached_total as f64 / prompt_total.max(1) as f64,
    }
}

/// The results as a fixed-width table, one row per workload.
pub fn table(reports: &[Report]) -> String {
    let mut s = format!(
        "{:>5} {:>7} {:>6} {:>10} {:>9} {:>9} {:>10} {:>10} {:>8} {:>8} {:>7} {:>6}\n",
        "conc",
        "prompt",
        "gen",
        "prefill/s",
        "ttft p50",
        "ttft p99",
        "dec/s req",
        "dec/s agg",
        "itl p50",
        "itl p99",
        "wall s",
        "hit"
    );
    for r in reports {
        s += &format!(
            "{:>5} {:>7} {:>6} {:>10.1} {:>8.1}m {:>8.1}m {:>10.1} {:>10.1} {:>7.1}m {:>7.1}m {:>7.2} {:>5.0}%\n",
            r.workload.concurrency,
            r.workload.prompt_len,
            r.workload.gen_len,
            r.prefill_tps,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.decode_tps_per_request,
            r.aggregate_tps,
            r.itl_p50_ms,
            r.itl_p99_ms,
            r.wall_s,
            r.cache_hit_rate * 100.0
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_is_shared_and_the_rest_differs() {
        let w = Workload {
            prompt_len: 100,
            gen_len: 1,
            requests: 3,
            concurrency: 1,
            shared_prefix: 0.9,
            rate: None,
            seed: 1,
        };
        let p = prompts(&w, 49152);
        assert!(p.iter().all(|x| x.len() == 100 && x[..90] == p[0][..90]));
        assert_ne!(p[0][90..], p[1][90..]);
    }

    #[test]
    fn percentiles_pick_ranked_values() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&mut v, 0.5), 3.0);
        assert_eq!(percentile(&mut v, 0.99), 5.0);
    }
}
