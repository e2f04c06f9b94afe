//! Counters the engine publishes for `/metrics` and diagnostics. The engine thread writes them;
//! anyone may read. Atomics, not locks: readers never stall a step.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::api::GenerationStats;

#[derive(Default, Debug)]
pub struct EngineMetrics {
    pub requests_finished: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub num_running: AtomicU64,
    pub num_waiting: AtomicU64,
    pub batch_size_peak: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_free: AtomicU64,
    /// Running sequences preempted (blocks released, recomputed later) because KV ran out.
    pub preemptions: AtomicU64,
    /// GPU decode steps (CUDA graphs, device sampling), and of them those launched from the
    /// previous step's ids before the host read them (the decode overlap).
    pub device_decode_steps: AtomicU64,
    pub overlapped_decode_steps: AtomicU64,
    /// Hybrid models: recurrent states restored from a prefix-cache snapshot (admissions with a
    /// hit, including recomputes after preemption).
    pub state_restores: AtomicU64,
    /// Sums in microseconds, for averages.
    pub queue_time_us: AtomicU64,
    pub prompt_time_us: AtomicU64,
    pub completion_time_us: AtomicU64,
}

impl EngineMetrics {
    pub fn record(&self, s: &GenerationStats) {
        let add = |c: &AtomicU64, v: u64| c.fetch_add(v, Ordering::Relaxed);
        add(&self.requests_finished, 1);
        add(&self.prompt_tokens, s.prompt_tokens as u64);
        add(&self.cached_prompt_tokens, s.cached_tokens as u64);
        add(&self.generation_tokens, s.completion_tokens as u64);
        add(&self.queue_time_us, (s.queue_time * 1e6) as u64);
        add(&self.prompt_time_us, (s.prompt_time * 1e6) as u64);
        add(&self.completion_time_us, (s.completion_time * 1e6) as u64);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}
