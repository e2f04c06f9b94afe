//! `--gpu-profile` and the `X-AFM-Profile: true` header: what the device is and holds, and how
//! close a request's decode came to the memory-bandwidth limit.
//!
//! Facts about the device are read once when the engine starts (name, memory with the weights,
//! memory with the KV pool and decode graphs); a report adds the memory in use now, the peak seen
//! so far, and the request's rates. Bytes read per decode token are every weight on the device
//! (an upper bound: an untied embedding table is only gathered, one row per token) plus the KV
//! cache of the average context; × decode tok/s = the bandwidth the request drew.

use std::sync::atomic::{AtomicUsize, Ordering};

use afm_runtime::compute::Device;
use serde::Serialize;

/// The device side of a profile, fixed at engine start.
pub struct DeviceProfile {
    device: Device,
    name: String,
    total_bytes: usize,
    used_with_weights: usize,
    used_with_kv: usize,
    peak_used: AtomicUsize,
    weight_bytes: usize,
    kv_bytes_per_token: usize,
    peak_bandwidth: f64,
    /// `--gpu-profile`: every response carries a profile, not only those that ask.
    pub always: bool,
}

/// One request's profile, as returned in `afm_profile`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProfileReport {
    pub device: String,
    pub memory_total_bytes: usize,
    pub memory_weights_bytes: usize,
    pub memory_weights_kv_bytes: usize,
    pub memory_used_bytes: usize,
    pub memory_peak_bytes: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    pub bytes_per_decode_token: usize,
    pub bandwidth_bytes_per_second: f64,
    pub peak_bandwidth_bytes_per_second: f64,
    pub bandwidth_fraction_of_peak: f64,
}

fn used(device: &Device) -> usize {
    match device.memory() {
        Ok(Some((free, total))) => total.saturating_sub(free),
        _ => 0,
    }
}

impl DeviceProfile {
    /// Reads the device after the weights are placed (`used_with_weights`, bytes in use then)
    /// and the KV pool made; `None` on the CPU.
    pub fn new(
        device: &Device,
        used_with_weights: usize,
        kv_bytes_per_token: usize,
        always: bool,
    ) -> Option<Self> {
        let (weight_bytes, peak_bandwidth) = device.weight_bytes_and_peak()?;
        let (_, total_bytes) = device.memory().ok().flatten()?;
        let now = used(device);
        Some(Self {
            device: device.clone(),
            name: device.describe(),
            total_bytes,
            used_with_weights,
            used_with_kv: now,
            peak_used: AtomicUsize::new(now),
            weight_bytes,
            kv_bytes_per_token,
            peak_bandwidth,
            always,
        })
    }

    /// One line for the start-up log: device, memory with the weights and with the KV pool.
    pub fn startup_line(&self) -> String {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        format!(
            "[GPU profile] {}: {:.2} GiB in use with the weights ({:.2} GiB of weights), {:.2} GiB with the KV pool and graphs, of {:.2} GiB; peak bandwidth {:.2} TB/s",
            self.name,
            gib(self.used_with_weights),
            gib(self.weight_bytes),
            gib(self.used_with_kv),
            gib(self.total_bytes),
            self.peak_bandwidth / 1e12
        )
    }

    /// A request's profile from its token counts and seconds (prefill over uncached tokens).
    pub fn report(
        &self,
        prompt_tokens: usize,
        completion_tokens: usize,
        prompt_time: f64,
        completion_time: f64,
    ) -> ProfileReport {
        let now = used(&self.device);
        let peak = self.peak_used.fetch_max(now, Ordering::Relaxed).max(now);
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        // Tokens after the first come from decode steps; the first ends the prefill.
        let decode = rate(completion_tokens.saturating_sub(1), completion_time);
        let context = prompt_tokens + completion_tokens / 2;
        let bytes = self.weight_bytes + self.kv_bytes_per_token * context;
        let bw = bytes as f64 * decode;
        ProfileReport {
            device: self.name.clone(),
            memory_total_bytes: self.total_bytes,
            memory_weights_bytes: self.used_with_weights,
            memory_weights_kv_bytes: self.used_with_kv,
            memory_used_bytes: now,
            memory_peak_bytes: peak,
            prompt_tokens,
            completion_tokens,
            prefill_tokens_per_second: rate(prompt_tokens, prompt_time),
            decode_tokens_per_second: decode,
            bytes_per_decode_token: bytes,
            bandwidth_bytes_per_second: bw,
            peak_bandwidth_bytes_per_second: self.peak_bandwidth,
            bandwidth_fraction_of_peak: if self.peak_bandwidth > 0.0 {
                bw / self.peak_bandwidth
            } else {
                0.0
            },
        }
    }
}
