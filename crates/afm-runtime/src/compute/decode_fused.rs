//! A whole llama-family decode step (Llama, Qwen 2, Qwen 3: pre-norm, GQA attention with RoPE
//! and optional Q/K/V biases or per-head Q/K norms, gated MLP) as one persistent GPU launch,
//! for a step of exactly one sequence and one new token:
//!
//! ```text
//! x (embedding, f32 [1][hidden]) ──fused_decode──▶ x after the last layer's residual add
//!                                                  (the model applies its final norm + lm_head)
//! ```
//!
//! The model describes its layers once per call ([`FusedDecoder`]: handles to weights it
//! holds); the device keeps whatever state the launch needs (`compute::cuda::decode_fused`).
//! `fused_decode` returns `false` whenever it does not apply — the CPU, a device below compute
//! capability 9.0, weights other than bf16/f16, a non-f16 KV pool, head_dim other than 64/128,
//! a step of several rows — and the model runs its layer loop instead, with the same results
//! (to float rounding). Off unless `AFM_FUSED_DECODE=1` (or [`Device::set_fused_decode`]): on the
//! H200 it measured slower than the layer loop (session 7: Qwen3-0.6B batch 1 988 vs 1,107
//! tok/s, Qwen3-8B 190 vs 214; bench/RESULTS.md).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::switch::Switch;

use super::{Activation, Device, KvPool, QkNorm, Result, Rotary, Step, Tensor, Vector, Weight};

/// One decoder layer, as the fused step reads it: handles to the model's own weights.
pub struct FusedLayer<'a> {
    /// RMSNorm before attention, and its epsilon.
    pub input_norm: (&'a Vector, f32),
    pub q: &'a Weight,
    pub k: &'a Weight,
    pub v: &'a Weight,
    /// Biases of Q, K and V (Qwen 2); all or none.
    pub qkv_bias: Option<[&'a Vector; 3]>,
    /// Per-head RMSNorm of Q and K before RoPE (Qwen 3).
    pub qk_norm: Option<QkNorm<'a>>,
    pub o: &'a Weight,
    /// RMSNorm before the MLP, and its epsilon.
    pub post_norm: (&'a Vector, f32),
    pub gate: &'a Weight,
    pub up: &'a Weight,
    pub down: &'a Weight,
}

/// A llama-family layer stack: its layers, attention shape, RoPE and MLP activation.
pub struct FusedDecoder<'a> {
    pub layers: Vec<FusedLayer<'a>>,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Attention score scale (`1/sqrt(head_dim)` for these models).
    pub scale: f32,
    pub act: Activation,
    pub rope: &'a Rotary,
}

/// Process-wide switch: on with `AFM_FUSED_DECODE=1`, or [`Device::set_fused_decode`].
static SWITCH: Switch = Switch::new("AFM_FUSED_DECODE", false);

/// Fused steps launched (or captured into a graph) by this process, for tests that must know
/// the fused path ran.
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

#[cfg(feature = "cuda")]
fn fused_decode_on() -> bool {
    SWITCH.on()
}

impl Device {
    /// Turns the fused decode step on or off for the whole process, as `AFM_FUSED_DECODE`
    /// does (in-process A/B tests and benchmarks). CUDA graphs captured before keep the path
    /// they were captured with.
    pub fn set_fused_decode(on: bool) {
        SWITCH.set(on);
    }

    /// Fused steps this process has launched or captured so far.
    pub fn fused_decode_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// Runs every layer of the model `model()` describes on `x` (the step's embedding, one
    /// row) in one launch, in place, storing the step's keys and values in `kv` as the layer
    /// loop does. `false`: not applicable here (see the module header); `x` and `kv` are
    /// untouched. `model` is called only when the fused step is on, so a decode step that
    /// takes the layer loop (the CPU, the default) does not describe the layers.
    pub fn fused_decode<'a>(
        &self,
        model: impl FnOnce() -> FusedDecoder<'a>,
        x: &mut Tensor,
        kv: &mut KvPool,
        step: &Step,
    ) -> Result<bool> {
        match self {
            Device::Cpu => {
                let _ = (model, x, kv, step);
                Ok(false)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => {
                if !fused_decode_on() {
                    return Ok(false);
                }
                let ran = c.fused_decode(&model(), x, kv, step)?;
                if ran {
                    LAUNCHES.fetch_add(1, Ordering::Relaxed);
                }
                Ok(ran)
            }
        }
    }
}
