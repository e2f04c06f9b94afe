//! Device dispatch: the ops of a transformer step as methods on [`Device`], so one model file
//! runs on the CPU or a GPU. The CPU arm calls this crate's host code (`ops`, `matmul`,
//! `attention`, `kv_store`) exactly as the models did before; the CUDA arm (feature `cuda`)
//! calls `crate::cuda`. Shapes are checked here, once, for both.
//!
//! ```text
//! Device   ── Cpu | Cuda(Arc<CudaDevice>)            where the work runs
//! Tensor   ── rows × cols f32 activations             host Vec or device buffer
//! Qkv      ── a step's q, k, v: three tensors, or one buffer of rows [q | k | v] (GPU)
//! Weight   ── WeightMatrix | DeviceWeight             in its storage type
//! Vector   ── norm weights, biases (f32)
//! Rotary   ── RoPE: the CPU `Rope` or its cos/sin table on the device
//! KvPool   ── KvCache | DeviceKvCache                 the engine's paged KV blocks
//! Step     ── one forward's sequences, positions and block tables, packed once per step
//! ```
//! Values made for one device must be used with that device; mixing is an error, not a copy.
//! `#[cfg(feature = "cuda")]` lives in this module's files and its `cuda` child only.
//!
//! This file holds the errors, [`DeviceChoice`] and [`Device`]; the rest, by job:
//! ```text
//! tensors         the value types above, host Vec or device buffer, and their host accessors
//! device          opening a device, placing values on it, reading tensors back
//! linear          linear, linear_many, gated_linear (the weight matmuls)
//! elementwise     rms_norm (+ fused add), add, gated_act, softcap, scale
//! rows            embed, zeros, gather_rows, columns, index_add_rows
//! rope_attention  rope, and attention with the KV store in one call
//! attn_step       attention split at the KV store (attn_prologue, attend)
//! decode_graphs   CUDA decode graphs and on-device sampling
//! decode_fused    a llama-family decode step of one sequence as one GPU launch
//! kv_rows, state_pool, host_compute   host access for hybrid and MoE models
//! host, cuda      the CPU and CUDA arms
//! ```

mod attn_step;
#[cfg(feature = "cuda")]
mod cuda;
mod decode_fused;
mod decode_graphs;
mod device;
mod elementwise;
mod host;
mod host_compute;
mod kv_rows;
mod linear;
mod rope_attention;
mod rows;
mod state_pool;
mod tensors;

pub use attn_step::QkNorm;
pub use decode_fused::{FusedDecoder, FusedLayer};
pub use kv_rows::KvPart;
pub use state_pool::{LayerStateShape, StatePool, StateSnapshot};
pub use tensors::{Activation, DecodeForward, DeviceLogits, DeviceSample, KvPool, Rotary};
pub use tensors::{Qkv, Step, Tensor, Vector, Weight};
pub use tensors::{SampledIds, StepTokens};

use elementwise::check_norm_width;
#[cfg(feature = "cuda")]
use tensors::QkvData;
use tensors::{Data, KvData, RotaryData, StepData, VectorData, WeightData};

use std::fmt;
use std::str::FromStr;
#[cfg(feature = "cuda")]
use std::sync::Arc;

// Names the tests in `tests.rs` read through `use super::*`.
#[cfg(test)]
use crate::attention::{AttnParams, AttnSeq};
#[cfg(test)]
use crate::kv_store::{KvDtype, LayerKvShape};
#[cfg(test)]
use crate::ops::{Rope, RopeStyle};
#[cfg(all(test, feature = "cuda"))]
use crate::DType;
#[cfg(test)]
use crate::WeightMatrix;

/// Errors of device dispatch. Messages name the field, the value and the limit.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    #[error("{what}: got {got}, expected {want}")]
    Shape {
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("{what} = {value} is not supported on {device} (supported: {supported})")]
    Unsupported {
        what: &'static str,
        value: String,
        device: String,
        supported: &'static str,
    },
    #[error("{op}: an operand lives on {got}, the op runs on {want}")]
    WrongDevice {
        op: &'static str,
        got: &'static str,
        want: &'static str,
    },
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
}

pub type Result<T> = std::result::Result<T, ComputeError>;

fn check(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(ComputeError::Shape { what, got, want })
    }
}

/// Which device to run on, as a user names it: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("device '{s}': expected cpu, cuda or cuda:N");
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Cpu => write!(f, "cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Where a model's weights, activations and KV cache live. Cheap to clone.
#[derive(Clone, Default)]
pub enum Device {
    #[default]
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(Arc<cuda::CudaDevice>),
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.describe())
    }
}

fn wrong(op: &'static str, got: &'static str, want: &'static str) -> ComputeError {
    ComputeError::WrongDevice { op, got, want }
}

#[cfg(test)]
mod tests;
