//! The values device ops take and return — tensors, weights, vectors, RoPE tables, the KV
//! pool, a step's layout, device logits — each a host value or a device buffer, and their
//! host accessors (which refuse a device buffer with `WrongDevice`).

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use super::wrong;
use super::{check, Result, StatePool};
use crate::attention::AttnSeq;
use crate::kv_store::{KvCache, KvDtype, LayerKvShape};
use crate::ops::Rope;
use crate::{DType, WeightMatrix};

#[cfg(feature = "cuda")]
use crate::cuda::{AttnBatch, CudaSlice, DeviceKvCache, DeviceWeight, RopeTable};

/// The gated MLP's activation (`act(gate) · up`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

/// `rows × cols` f32 activations, row-major.
pub struct Tensor {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) data: Data,
}

pub(super) enum Data {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(CudaSlice<f32>),
}

/// A step's queries, keys and values for [`Device::attend_prologue`](super::Device::attend_prologue): three
/// tensors, or on a GPU the joined Q/K/V product ([`Device::norm_linear_qkv`](super::Device::norm_linear_qkv)),
/// one buffer that the attention reads in place with its row stride (no copy into three):
/// ```text
/// row r:  | q (widths[0]) | k (widths[1]) | v (widths[2]) |    stride Σ widths
/// ```
pub struct Qkv {
    pub(super) rows: usize,
    pub(super) widths: [usize; 3],
    pub(super) data: QkvData,
}

pub(super) enum QkvData {
    Parts([Tensor; 3]),
    #[cfg(feature = "cuda")]
    Joined(CudaSlice<f32>),
}

/// A weight matrix on a device, in its storage type. Clones share the storage (tied embeddings).
#[derive(Clone)]
pub struct Weight {
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) data: WeightData,
}

#[derive(Clone)]
pub(super) enum WeightData {
    Host(WeightMatrix),
    #[cfg(feature = "cuda")]
    Cuda(Arc<DeviceWeight>),
}

/// An f32 vector on a device (norm weights, biases).
pub struct Vector {
    pub(super) len: usize,
    pub(super) data: VectorData,
}

pub(super) enum VectorData {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(CudaSlice<f32>),
}

/// Rotary embedding for one frequency base, on a device.
pub struct Rotary {
    pub(super) data: RotaryData,
}

pub(super) enum RotaryData {
    Host(Rope),
    #[cfg(feature = "cuda")]
    Cuda(RopeTable),
}

/// The engine's paged KV cache on a device (layout: `kv_store`).
pub struct KvPool {
    pub(super) block_size: usize,
    pub(super) num_blocks: usize,
    pub(super) layers: usize,
    pub(super) data: KvData,
    /// Recurrent state slots of hybrid models, owned with the cache by the engine.
    pub(super) states: Option<StatePool>,
}

pub(super) enum KvData {
    Host(KvCache),
    #[cfg(feature = "cuda")]
    Cuda(DeviceKvCache),
}

/// A decode step's logits left on the device (CUDA graphs' static output) until the next
/// decode step: `rows` rows of `vocab`, in the step's sequence order.
#[derive(Debug, Clone, Copy)]
pub struct DeviceLogits {
    pub rows: usize,
    pub vocab: usize,
}

/// A device decode step's sampled ids on their way to the host
/// ([`Device::sample_device_start`](super::Device::sample_device_start)): read them with
/// [`Device::sampled_ids`](super::Device::sampled_ids), and before that, feed them to the next
/// decode step ([`StepTokens::Sampled`]) without waiting for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampledIds {
    pub rows: usize,
    /// The read-back slot, and which sampling (counted from 1) it belongs to.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) slot: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) seq: u64,
}

/// The input tokens of a graph decode step: from the host, or row for row the ids the step
/// before sampled, still on the device.
#[derive(Debug, Clone, Copy)]
pub enum StepTokens<'a> {
    Host(&'a [u32]),
    Sampled(&'a SampledIds),
}

/// How one row of a device decode step is sampled (afm-engine's `Sampler` fills it in).
/// `temperature <= 0` is greedy; `top_k = 0`, `top_p = 1`, `min_p = 0` switch filters off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceSample {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// The request's uniform draw in [0, 1) for this token.
    pub u: f32,
    /// `(token, bias, repetition, subtract)`: `l ← rep(l + bias) − subtract`, where `rep`
    /// divides a positive logit and multiplies a negative one (1 = off). Each token once.
    pub adjust: Vec<(u32, f32, f32, f32)>,
}

/// A model's forward as a decode graph calls it: tokens, sequences (one row each) and the KV
/// pool, returning what `CausalLm::forward` returns (ignored under a graph).
pub type DecodeForward<'f> =
    dyn for<'a> FnMut(&[u32], &[AttnSeq<'a>], &mut KvPool) -> Result<Vec<f32>> + 'f;

/// One forward's token layout, packed once and read by every layer: each sequence's rows,
/// first position and block table (see [`AttnSeq`]), and every row's position.
pub struct Step<'a> {
    pub(super) seqs: Vec<AttnSeq<'a>>,
    pub(super) positions: Vec<usize>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the GPU arm
    pub(super) data: StepData,
}

#[allow(clippy::large_enum_variant)] // one per forward, never moved in a loop
pub(super) enum StepData {
    Host,
    #[cfg(feature = "cuda")]
    Cuda {
        positions: crate::cuda::Buf<i32>,
        attn: AttnBatch,
    },
}

impl Tensor {
    /// A host tensor from values (tests, CPU callers).
    pub fn from_host(rows: usize, cols: usize, values: Vec<f32>) -> Result<Self> {
        check("tensor values (rows × cols)", values.len(), rows * cols)?;
        Ok(Self {
            rows,
            cols,
            data: Data::Host(values),
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    // `op` names the operation in the error a GPU build can raise.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn host(&self, op: &'static str) -> Result<&[f32]> {
        match &self.data {
            Data::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Data::Cuda(_) => Err(wrong(op, "cuda", "cpu")),
        }
    }

    // `op` names the operation in the error a GPU build can raise.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn host_mut(&mut self, op: &'static str) -> Result<&mut Vec<f32>> {
        match &mut self.data {
            Data::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Data::Cuda(_) => Err(wrong(op, "cuda", "cpu")),
        }
    }
}

impl Qkv {
    /// Q, K and V as three tensors of the same rows.
    pub fn new(q: Tensor, k: Tensor, v: Tensor) -> Result<Self> {
        check("key rows (the query rows)", k.rows, q.rows)?;
        check("value rows (the query rows)", v.rows, q.rows)?;
        Ok(Self {
            rows: q.rows,
            widths: [q.cols, k.cols, v.cols],
            data: QkvData::Parts([q, k, v]),
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The widths of q, k and v.
    pub fn widths(&self) -> [usize; 3] {
        self.widths
    }

    /// Whether the three lie in one buffer of rows `[q | k | v]`.
    pub fn is_joined(&self) -> bool {
        !matches!(self.data, QkvData::Parts(_))
    }

    /// The three tensors, for the CPU (which never joins them).
    // `op` names the operation in the error a GPU build can raise.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn into_parts(self, op: &'static str) -> Result<[Tensor; 3]> {
        match self.data {
            QkvData::Parts(p) => Ok(p),
            #[cfg(feature = "cuda")]
            QkvData::Joined(_) => Err(wrong(op, "cuda", "cpu")),
        }
    }
}

impl Weight {
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }

    // `op` names the operation in the error a GPU build can raise.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn host(&self, op: &'static str) -> Result<&WeightMatrix> {
        match &self.data {
            WeightData::Host(w) => Ok(w),
            #[cfg(feature = "cuda")]
            WeightData::Cuda(_) => Err(wrong(op, "cuda", "cpu")),
        }
    }
}

impl Vector {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    // `op` names the operation in the error a GPU build can raise.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn host(&self, op: &'static str) -> Result<&[f32]> {
        match &self.data {
            VectorData::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            VectorData::Cuda(_) => Err(wrong(op, "cuda", "cpu")),
        }
    }
}

impl KvPool {
    /// Bytes one block takes across all layers (for sizing the pool from a memory budget).
    pub fn bytes_per_block(shapes: &[LayerKvShape], block_size: usize, dtype: KvDtype) -> usize {
        KvCache::bytes_per_block(shapes, block_size, dtype)
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn num_layers(&self) -> usize {
        self.layers
    }

    /// Gives the pool recurrent state slots (models whose `state_shapes` is not empty).
    pub fn attach_states(&mut self, states: StatePool) {
        self.states = Some(states);
    }

    pub fn states(&self) -> Option<&StatePool> {
        self.states.as_ref()
    }

    pub fn states_mut(&mut self) -> Option<&mut StatePool> {
        self.states.as_mut()
    }

    // `op` names the operation in the error a GPU build can raise.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn host_mut(&mut self, op: &'static str) -> Result<&mut KvCache> {
        match &mut self.data {
            KvData::Host(c) => Ok(c),
            #[cfg(feature = "cuda")]
            KvData::Cuda(_) => Err(wrong(op, "cuda", "cpu")),
        }
    }
}

/// The host cache as a pool on the CPU device.
impl From<KvCache> for KvPool {
    fn from(c: KvCache) -> Self {
        Self {
            block_size: c.block_size(),
            num_blocks: c.num_blocks(),
            layers: c.layers.len(),
            data: KvData::Host(c),
            states: None,
        }
    }
}

impl Step<'_> {
    pub fn n_rows(&self) -> usize {
        self.positions.len()
    }
}
