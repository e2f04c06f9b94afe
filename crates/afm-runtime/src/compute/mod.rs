//! Device dispatch: the ops of a transformer step as methods on [`Device`], so one model file
//! runs on the CPU or a GPU. The CPU arm calls this crate's host code (`ops`, `matmul`,
//! `attention`, `kv_store`) exactly as the models did before; the CUDA arm (feature `cuda`)
//! calls `crate::cuda`. Shapes are checked here, once, for both.
//!
//! ```text
//! Device   ── Cpu | Cuda(Arc<CudaDevice>)            where the work runs
//! Tensor   ── rows × cols f32 activations             host Vec or device buffer
//! Weight   ── WeightMatrix | DeviceWeight             in its storage type
//! Vector   ── norm weights, biases (f32)
//! Rotary   ── RoPE: the CPU `Rope` or its cos/sin table on the device
//! KvPool   ── KvCache | DeviceKvCache                 the engine's paged KV blocks
//! Step     ── one forward's sequences, positions and block tables, packed once per step
//! ```
//! Values made for one device must be used with that device; mixing is an error, not a copy.
//! `#[cfg(feature = "cuda")]` lives in this module and its `cuda` child only.

mod attn_step;
#[cfg(feature = "cuda")]
mod cuda;
mod host;
mod host_compute;
mod kv_rows;
mod state_pool;

pub use attn_step::QkNorm;
pub use kv_rows::KvPart;
pub use state_pool::{LayerStateShape, StatePool, StateSnapshot};

use std::fmt;
use std::str::FromStr;
#[cfg(feature = "cuda")]
use std::sync::Arc;

use crate::attention::{AttnParams, AttnSeq};
use crate::kv_store::{KvCache, KvDtype, LayerKvShape};
use crate::ops::{Rope, RopeStyle};
use crate::{DType, WeightMatrix};

#[cfg(feature = "cuda")]
use crate::cuda::{AttnBatch, CudaSlice, DeviceKvCache, DeviceWeight, RopeTable};

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

/// The gated MLP's activation (`act(gate) · up`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

/// `rows × cols` f32 activations, row-major.
pub struct Tensor {
    rows: usize,
    cols: usize,
    data: Data,
}

enum Data {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(CudaSlice<f32>),
}

/// A weight matrix on a device, in its storage type. Clones share the storage (tied embeddings).
#[derive(Clone)]
pub struct Weight {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: WeightData,
}

#[derive(Clone)]
enum WeightData {
    Host(WeightMatrix),
    #[cfg(feature = "cuda")]
    Cuda(Arc<DeviceWeight>),
}

/// An f32 vector on a device (norm weights, biases).
pub struct Vector {
    len: usize,
    data: VectorData,
}

enum VectorData {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(CudaSlice<f32>),
}

/// Rotary embedding for one frequency base, on a device.
pub struct Rotary {
    data: RotaryData,
}

enum RotaryData {
    Host(Rope),
    #[cfg(feature = "cuda")]
    Cuda(RopeTable),
}

/// The engine's paged KV cache on a device (layout: `kv_store`).
pub struct KvPool {
    block_size: usize,
    num_blocks: usize,
    layers: usize,
    data: KvData,
    /// Recurrent state slots of hybrid models, owned with the cache by the engine.
    states: Option<StatePool>,
}

enum KvData {
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
    seqs: Vec<AttnSeq<'a>>,
    positions: Vec<usize>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the GPU arm
    data: StepData,
}

#[allow(clippy::large_enum_variant)] // one per forward, never moved in a loop
enum StepData {
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
    fn host(&self, op: &'static str) -> Result<&[f32]> {
        match &self.data {
            Data::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Data::Cuda(_) => Err(wrong(op, "cuda", "cpu")),
        }
    }

    // `op` names the operation in the error a GPU build can raise.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn host_mut(&mut self, op: &'static str) -> Result<&mut Vec<f32>> {
        match &mut self.data {
            Data::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Data::Cuda(_) => Err(wrong(op, "cuda", "cpu")),
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
    fn host(&self, op: &'static str) -> Result<&WeightMatrix> {
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
    fn host(&self, op: &'static str) -> Result<&[f32]> {
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
    fn host_mut(&mut self, op: &'static str) -> Result<&mut KvCache> {
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

fn wrong(op: &'static str, got: &'static str, want: &'static str) -> ComputeError {
    ComputeError::WrongDevice { op, got, want }
}

impl Device {
    /// Opens the chosen device (for CUDA: context, stream and kernels, compiled once).
    pub fn open(choice: DeviceChoice) -> Result<Self> {
        match choice {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            #[cfg(feature = "cuda")]
            DeviceChoice::Cuda(n) => Ok(Device::Cuda(Arc::new(cuda::CudaDevice::open(n)?))),
            #[cfg(not(feature = "cuda"))]
            DeviceChoice::Cuda(n) => Err(ComputeError::Unsupported {
                what: "device",
                value: format!("cuda:{n}"),
                device: "this build".into(),
                supported: "cpu; rebuild with `--features cuda` for NVIDIA GPUs",
            }),
        }
    }

    pub fn choice(&self) -> DeviceChoice {
        match self {
            Device::Cpu => DeviceChoice::Cpu,
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => DeviceChoice::Cuda(c.ordinal()),
        }
    }

    /// `cpu`, or `cuda:N (device name)`.
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => format!("cuda:{} ({})", c.ordinal(), c.name()),
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Free and total bytes of device memory; `None` on the CPU (the engine reads /proc).
    pub fn memory(&self) -> Result<Option<(usize, usize)>> {
        match self {
            Device::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Ok(Some(c.memory()?)),
        }
    }

    /// The type a weight stored as `dtype` is kept in on this device: its own, or F16 where
    /// the device has no kernel for it (see `compute::cuda`).
    pub fn stored_type(&self, dtype: DType) -> DType {
        match self {
            Device::Cpu => dtype,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => cuda::stored_type(dtype),
        }
    }

    /// Places a weight matrix on this device, in [`stored_type`](Self::stored_type).
    pub fn weight(&self, w: WeightMatrix) -> Result<Weight> {
        let (dtype, rows, cols) = (w.dtype(), w.rows(), w.cols());
        let data = match self {
            Device::Cpu => WeightData::Host(w),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => WeightData::Cuda(Arc::new(c.weight(&w)?)),
        };
        Ok(Weight {
            dtype,
            rows,
            cols,
            data,
        })
    }

    pub fn vector(&self, v: Vec<f32>) -> Result<Vector> {
        let len = v.len();
        let data = match self {
            Device::Cpu => VectorData::Host(v),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => VectorData::Cuda(c.upload(&v)?),
        };
        Ok(Vector { len, data })
    }

    /// RoPE built by `rope` over `dims` rotated dimensions; on a GPU its cos/sin table covers
    /// positions below `max_pos`.
    pub fn rotary(
        &self,
        rope: Rope,
        dims: usize,
        style: RopeStyle,
        max_pos: usize,
    ) -> Result<Rotary> {
        let data = match self {
            Device::Cpu => RotaryData::Host(rope),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => RotaryData::Cuda(c.rope_table(&rope, dims, style, max_pos)?),
        };
        let _ = (dims, style, max_pos); // used by the GPU arm only
        Ok(Rotary { data })
    }

    /// A zeroed KV pool of `num_blocks` blocks of `block_size` tokens per layer.
    pub fn kv_pool(
        &self,
        shapes: &[LayerKvShape],
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Result<KvPool> {
        let data = match self {
            Device::Cpu => KvData::Host(KvCache::new(shapes, num_blocks, block_size, dtype)),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => KvData::Cuda(c.kv_cache(shapes, num_blocks, block_size, dtype)?),
        };
        Ok(KvPool {
            block_size,
            num_blocks,
            layers: shapes.len(),
            data,
            states: None,
        })
    }

    /// Packs one forward's sequences (`seqs`: rows contiguous from 0, in order) for attention
    /// with `n_heads` query heads. Checks that each block table covers its positions.
    pub fn step<'a>(&self, seqs: &[AttnSeq<'a>], kv: &KvPool, n_heads: usize) -> Result<Step<'a>> {
        let mut positions = Vec::new();
        for s in seqs {
            check(
                "sequence row0 (rows follow each other)",
                s.row0,
                positions.len(),
            )?;
            let need = (s.pos0 + s.len).div_ceil(kv.block_size.max(1));
            if s.block_table.len() < need {
                return Err(ComputeError::Shape {
                    what: "block table length (blocks covering the positions)",
                    got: s.block_table.len(),
                    want: need,
                });
            }
            if let Some(&b) = s.block_table[..need]
                .iter()
                .find(|&&b| b as usize >= kv.num_blocks)
            {
                return Err(ComputeError::Shape {
                    what: "block id (below the number of blocks)",
                    got: b as usize,
                    want: kv.num_blocks,
                });
            }
            positions.extend(s.pos0..s.pos0 + s.len);
        }
        let data = match self {
            Device::Cpu => StepData::Host,
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.step(seqs, &positions, kv, n_heads)?,
        };
        let _ = n_heads; // the GPU arm packs attention tiles by head grouping
        Ok(Step {
            seqs: seqs.to_vec(),
            positions,
            data,
        })
    }

    /// `table[tokens[t]] · scale` for every token: `[tokens][table.cols]`.
    pub fn embed(&self, table: &Weight, tokens: &[u32], scale: f32) -> Result<Tensor> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(ComputeError::Shape {
                what: "token id (below the vocabulary size)",
                got: t as usize,
                want: table.rows,
            });
        }
        let data = match self {
            Device::Cpu => Data::Host(host::embed(table.host("embed")?, tokens, scale)),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.embed(table, tokens, scale)?),
        };
        Ok(Tensor {
            rows: tokens.len(),
            cols: table.cols,
            data,
        })
    }

    /// `y = x · Wᵀ (+ b)`: `[x.rows][w.rows]`.
    pub fn linear(&self, x: &Tensor, w: &Weight, bias: Option<&Vector>) -> Result<Tensor> {
        check_linear(x, w, bias)?;
        let data = match self {
            Device::Cpu => {
                let b = bias.map(|b| b.host("linear bias")).transpose()?;
                Data::Host(host::linear(
                    x.host("linear")?,
                    x.rows,
                    w.host("linear")?,
                    b,
                ))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.linear(x, w, bias)?),
        };
        Ok(Tensor {
            rows: x.rows,
            cols: w.rows,
            data,
        })
    }

    /// `x / rms(x) · w` over every `w.len()` values of `x`: whole rows, or each head when
    /// `w` holds one head's weights.
    pub fn rms_norm(&self, x: &Tensor, w: &Vector, eps: f32) -> Result<Tensor> {
        check_norm(x, w)?;
        let data = match self {
            Device::Cpu => Data::Host(host::rms_norm(
                x.host("rms_norm")?,
                w.host("rms_norm")?,
                eps,
            )),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.rms_norm(x, w, eps)?),
        };
        Ok(Tensor {
            rows: x.rows,
            cols: x.cols,
            data,
        })
    }

    /// [`rms_norm`](Self::rms_norm) in place.
    pub fn rms_norm_in_place(&self, x: &mut Tensor, w: &Vector, eps: f32) -> Result<()> {
        check_norm(x, w)?;
        match self {
            Device::Cpu => {
                crate::ops::rms_norm(x.host_mut("rms_norm")?, w.host("rms_norm")?, eps);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.rms_norm_in_place(x, w, eps),
        }
    }

    /// `x += y`.
    pub fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        check("add operand rows", y.rows, x.rows)?;
        check("add operand columns", y.cols, x.cols)?;
        match self {
            Device::Cpu => {
                crate::ops::add_assign(x.host_mut("add")?, y.host("add")?);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.add_assign(x, y),
        }
    }

    /// `gate ← act(gate) · up`.
    pub fn gated_act(&self, act: Activation, gate: &mut Tensor, up: &Tensor) -> Result<()> {
        check("gated_act up rows", up.rows, gate.rows)?;
        check("gated_act up columns", up.cols, gate.cols)?;
        match self {
            Device::Cpu => {
                crate::ops::gated_act(gate.host_mut("gated_act")?, up.host("gated_act")?, act);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.gated_act(act, gate, up),
        }
    }

    /// `x ← cap · tanh(x / cap)`.
    pub fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        match self {
            Device::Cpu => {
                crate::ops::softcap(x.host_mut("softcap")?, cap);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.softcap(x, cap),
        }
    }

    /// A `rows × cols` tensor of zeros (an accumulator, e.g. for mixture-of-experts outputs).
    pub fn zeros(&self, rows: usize, cols: usize) -> Result<Tensor> {
        let data = match self {
            Device::Cpu => Data::Host(vec![0.0; rows * cols]),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.zeros(rows * cols)?),
        };
        Ok(Tensor { rows, cols, data })
    }

    /// `x ← s · x`.
    pub fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        match self {
            Device::Cpu => {
                x.host_mut("scale")?.iter_mut().for_each(|v| *v *= s);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.scale_in_place(x, s),
        }
    }

    /// `out[rows[i]] += weights[i] · src[i]` for every row `i` of `src` (PyTorch's weighted
    /// `index_add_`): how a mixture of experts adds each expert's rows back to their tokens.
    /// `rows` must be distinct, so the sum does not depend on the order rows are added in.
    pub fn index_add_rows(
        &self,
        out: &mut Tensor,
        src: &Tensor,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        check(
            "index_add_rows row indices (the source's rows)",
            rows.len(),
            src.rows,
        )?;
        check(
            "index_add_rows weights (the source's rows)",
            weights.len(),
            src.rows,
        )?;
        check(
            "index_add_rows source width (the output's)",
            src.cols,
            out.cols,
        )?;
        let mut seen = vec![false; out.rows];
        for &r in rows {
            if r >= out.rows || std::mem::replace(&mut seen[r], true) {
                return Err(ComputeError::Shape {
                    what: "index_add_rows row (distinct, below the output's rows)",
                    got: r,
                    want: out.rows,
                });
            }
        }
        match self {
            Device::Cpu => {
                let cols = out.cols;
                let (o, s) = (out.host_mut("index_add_rows")?, src.host("index_add_rows")?);
                for ((&r, &w), sr) in rows.iter().zip(weights).zip(s.chunks_exact(cols.max(1))) {
                    for (a, b) in o[r * cols..(r + 1) * cols].iter_mut().zip(sr) {
                        *a += w * b;
                    }
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.index_add_rows(out, src, rows, weights),
        }
    }

    /// Columns `start..start + width` of every row of `x`: `[x.rows][width]`.
    pub fn columns(&self, x: &Tensor, start: usize, width: usize) -> Result<Tensor> {
        if start + width > x.cols {
            return Err(ComputeError::Shape {
                what: "column range end (at most the tensor's columns)",
                got: start + width,
                want: x.cols,
            });
        }
        let data = match self {
            Device::Cpu => Data::Host(
                x.host("columns")?
                    .chunks_exact(x.cols.max(1))
                    .flat_map(|r| r[start..start + width].iter().copied())
                    .collect(),
            ),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.columns(x, start, width)?),
        };
        Ok(Tensor {
            rows: x.rows,
            cols: width,
            data,
        })
    }

    /// Rotates each `head_dim`-wide head of every row of `x` at that row's position.
    pub fn rope(&self, r: &Rotary, x: &mut Tensor, head_dim: usize, step: &Step) -> Result<()> {
        check("rope rows (the step's tokens)", x.rows, step.n_rows())?;
        if head_dim == 0 || !x.cols.is_multiple_of(head_dim) {
            return Err(ComputeError::Shape {
                what: "rope row width (a multiple of head_dim)",
                got: x.cols,
                want: head_dim,
            });
        }
        match (self, &r.data) {
            (Device::Cpu, RotaryData::Host(rope)) => {
                let width = x.cols;
                host::rope(rope, x.host_mut("rope")?, width, head_dim, &step.positions);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Device::Cuda(c), RotaryData::Cuda(t)) => c.rope(t, x, head_dim, step),
            #[cfg(feature = "cuda")]
            _ => Err(wrong("rope", "another device", self.kind())),
        }
    }

    /// Stores the step's new keys and values (`k`, `v`: `[rows][n_kv_heads · head_dim]`) in
    /// layer `layer` of `kv`, then attends every query row (`q`: `[rows][n_heads · head_dim]`)
    /// to its sequence's cached positions. Returns `[rows][n_heads · head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        p: &AttnParams,
    ) -> Result<Tensor> {
        if layer >= kv.layers {
            return Err(ComputeError::Shape {
                what: "KV layer index (below the cache's layers)",
                got: layer,
                want: kv.layers,
            });
        }
        let n = step.n_rows();
        check("attention query rows", q.rows, n)?;
        check("attention key rows", k.rows, n)?;
        check("attention value rows", v.rows, n)?;
        check("attention query width", q.cols, p.n_heads * p.head_dim)?;
        check("attention value width (the key width)", v.cols, k.cols)?;
        let data = match self {
            Device::Cpu => {
                let cache = kv.host_mut("attention")?;
                let layer_kv = &mut cache.layers[layer];
                check(
                    "attention key width (the cache's)",
                    k.cols,
                    layer_kv.shape.n_kv_heads * layer_kv.shape.head_dim,
                )?;
                let (qh, kh, vh) = (
                    q.host("attention")?,
                    k.host("attention")?,
                    v.host("attention")?,
                );
                Data::Host(host::cached_attention(qh, kh, vh, layer_kv, &step.seqs, p))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.attention(kv, layer, step, q, k, v, p)?),
        };
        Ok(Tensor {
            rows: n,
            cols: q.cols,
            data,
        })
    }

    /// `[x·W₀ᵀ, x·W₁ᵀ, …]` (+ each bias): projections of one input (Q, K, V), in one launch on
    /// a GPU where the fused kernel applies; otherwise [`linear`](Self::linear) each.
    pub fn linear_many(
        &self,
        x: &Tensor,
        ws: &[(&Weight, Option<&Vector>)],
    ) -> Result<Vec<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            if ws.iter().all(|(w, b)| b.is_none() && w.cols == x.cols) {
                let plain: Vec<&Weight> = ws.iter().map(|(w, _)| *w).collect();
                if let Some(outs) = c.linear_many(x, &plain)? {
                    return Ok(outs
                        .into_iter()
                        .zip(&plain)
                        .map(|(o, w)| Tensor {
                            rows: x.rows,
                            cols: w.rows,
                            data: Data::Cuda(o),
                        })
                        .collect());
                }
            }
        }
        if matches!(self, Device::Cpu) && ws.len() > 1 {
            return self.host_linear_many(x, ws);
        }
        ws.iter().map(|(w, b)| self.linear(x, w, *b)).collect()
    }

    /// `linear_many` on the CPU: one [`WeightMatrix::matmul_many`] (the input quantized once,
    /// one parallel pass), then each bias.
    fn host_linear_many(
        &self,
        x: &Tensor,
        ws: &[(&Weight, Option<&Vector>)],
    ) -> Result<Vec<Tensor>> {
        for (w, b) in ws {
            check_linear(x, w, *b)?;
        }
        let xs = x.host("linear")?;
        let ms = ws
            .iter()
            .map(|(w, _)| w.host("linear"))
            .collect::<Result<Vec<_>>>()?;
        let mut ys: Vec<Vec<f32>> = ms.iter().map(|m| vec![0.0; x.rows * m.rows()]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        WeightMatrix::matmul_many(&ms, xs, x.rows, &mut outs);
        ys.into_iter()
            .zip(ws)
            .map(|(mut y, (w, b))| {
                if let Some(b) = b {
                    crate::ops::add_bias(&mut y, b.host("linear bias")?);
                }
                Ok(Tensor {
                    rows: x.rows,
                    cols: w.rows,
                    data: Data::Host(y),
                })
            })
            .collect()
    }

    /// `act(x·gateᵀ) · (x·upᵀ)`, the first half of a gated MLP: one launch on a GPU where the
    /// fused kernel applies; otherwise [`linear_many`](Self::linear_many) of the two and
    /// [`gated_act`](Self::gated_act).
    pub fn gated_linear(
        &self,
        x: &Tensor,
        gate: &Weight,
        up: &Weight,
        act: Activation,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            if gate.cols == x.cols && up.cols == x.cols && gate.rows == up.rows {
                if let Some(o) = c.gated_linear(x, gate, up, act)? {
                    return Ok(Tensor {
                        rows: x.rows,
                        cols: gate.rows,
                        data: Data::Cuda(o),
                    });
                }
            }
        }
        // One output per weight, so both are there.
        let mut gu = self
            .linear_many(x, &[(gate, None), (up, None)])?
            .into_iter();
        let (Some(mut g), Some(u)) = (gu.next(), gu.next()) else {
            return Err(ComputeError::Shape {
                what: "gated_linear outputs",
                got: 0,
                want: 2,
            });
        };
        self.gated_act(act, &mut g, &u)?;
        Ok(g)
    }

    /// `x += y`, then [`rms_norm`](Self::rms_norm) of the sum: one launch on a GPU.
    pub fn add_rms_norm(&self, x: &mut Tensor, y: &Tensor, w: &Vector, eps: f32) -> Result<Tensor> {
        check("add operand rows", y.rows, x.rows)?;
        check("add operand columns", y.cols, x.cols)?;
        check_norm(x, w)?;
        match self {
            Device::Cpu => {
                self.add_assign(x, y)?;
                self.rms_norm(x, w, eps)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Ok(Tensor {
                rows: x.rows,
                cols: x.cols,
                data: Data::Cuda(c.add_rms_norm(x, y, w, eps)?),
            }),
        }
    }

    /// The listed rows of `x`, in order.
    pub fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(ComputeError::Shape {
                what: "gathered row (below the tensor's rows)",
                got: r,
                want: x.rows,
            });
        }
        let data = match self {
            Device::Cpu => Data::Host(host::gather_rows(x.host("gather_rows")?, x.cols, rows)),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.gather_rows(x, rows)?),
        };
        Ok(Tensor {
            rows: rows.len(),
            cols: x.cols,
            data,
        })
    }

    /// The values of `x` on the host in the middle of a forward (a MoE router's logits),
    /// leaving `x` in place. A CUDA decode graph cannot wait for the host, so this fails while
    /// one is built or replayed, and the engine runs such a model's decode steps without graphs
    /// (rather than baking one step's routing into the graph).
    pub fn read_back(&self, x: &Tensor) -> Result<Vec<f32>> {
        match &x.data {
            Data::Host(v) => Ok(v.clone()),
            #[cfg(feature = "cuda")]
            Data::Cuda(b) => match self {
                Device::Cuda(c) => c.read_back(b, x.rows * x.cols),
                Device::Cpu => Err(wrong("read_back", "cuda", "cpu")),
            },
        }
    }

    /// The values of `x` in host memory (waits for the device).
    pub fn to_host(&self, x: Tensor) -> Result<Vec<f32>> {
        match x.data {
            Data::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Data::Cuda(ref b) => match self {
                Device::Cuda(c) => c.download(b, x.rows * x.cols),
                Device::Cpu => Err(wrong("to_host", "cuda", "cpu")),
            },
        }
    }

    /// Bytes of the weights placed on this device and its memory bandwidth's peak in bytes/s
    /// (`--gpu-profile`); `None` on the CPU.
    pub fn weight_bytes_and_peak(&self) -> Option<(usize, f64)> {
        match self {
            Device::Cpu => None,
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Some(c.weight_bytes_and_peak()),
        }
    }

    /// Whether decode steps can run as CUDA graphs here (a GPU device).
    pub fn supports_graphs(&self) -> bool {
        !self.is_cpu()
    }

    /// Prepares decode graphs for up to `max_batch` sequences of up to `max_context` tokens,
    /// `vocab` logits per row, KV blocks of `block_size`. A no-op on the CPU.
    pub fn enable_graphs(
        &self,
        max_batch: usize,
        max_context: usize,
        vocab: usize,
        block_size: usize,
    ) -> Result<()> {
        let _ = (max_batch, max_context, vocab, block_size);
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.enable_graphs(max_batch, max_context, vocab, block_size),
        }
    }

    /// Captures every decode graph now (`--prewarm y`): returns how many and the
    /// milliseconds it took. `forward` is the model's forward; `kv` is only written with
    /// padding (no rows), so the pool's contents are unchanged.
    pub fn prewarm_graphs(
        &self,
        kv: &mut KvPool,
        forward: &mut DecodeForward,
    ) -> Result<(usize, f64)> {
        let _ = (&kv, &forward);
        match self {
            Device::Cpu => Ok((0, 0.0)),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.prewarm_graphs(kv, forward),
        }
    }

    /// Runs a decode step (`seqs`: one new token each, rows in order) through a CUDA graph,
    /// capturing it on first use, and leaves the logits on the device. `None`: no graph
    /// serves this step (CPU, graphs off, too many sequences); run `forward` eagerly instead.
    pub fn graph_decode(
        &self,
        tokens: &[u32],
        seqs: &[AttnSeq],
        kv: &mut KvPool,
        forward: &mut DecodeForward,
    ) -> Result<Option<DeviceLogits>> {
        let _ = (tokens, seqs, &kv, &forward);
        match self {
            Device::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.graph_decode(tokens, seqs, kv, forward),
        }
    }

    /// Samples one token per row of `l` on the device; only the ids cross to the host.
    pub fn sample_device(&self, l: &DeviceLogits, rows: &[DeviceSample]) -> Result<Vec<u32>> {
        let _ = (l, rows);
        match self {
            Device::Cpu => Err(wrong("sample_device", "cpu", "cuda")),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => {
                let params: Vec<crate::cuda::SampleParams> = rows
                    .iter()
                    .map(|r| crate::cuda::SampleParams {
                        temperature: r.temperature,
                        top_k: r.top_k,
                        top_p: r.top_p,
                        min_p: r.min_p,
                        u: r.u,
                    })
                    .collect();
                let adjust: Vec<crate::cuda::LogitAdjust> = rows
                    .iter()
                    .enumerate()
                    .flat_map(|(row, r)| {
                        r.adjust
                            .iter()
                            .map(move |&(token, bias, repetition, subtract)| {
                                crate::cuda::LogitAdjust {
                                    row,
                                    token,
                                    bias,
                                    repetition,
                                    subtract,
                                }
                            })
                    })
                    .collect();
                c.sample(l, &params, &adjust)
            }
        }
    }

    /// Row `row` of device logits in host memory (requests sampled on the host).
    pub fn device_logits_row(&self, l: &DeviceLogits, row: usize) -> Result<Vec<f32>> {
        let _ = (l, row);
        match self {
            Device::Cpu => Err(wrong("device_logits_row", "cpu", "cuda")),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.logits_row(l, row),
        }
    }

    #[cfg(feature = "cuda")]
    fn kind(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
        }
    }
}

/// A `linear`'s shapes: the input as wide as the weight's columns, a bias as long as its rows.
fn check_linear(x: &Tensor, w: &Weight, bias: Option<&Vector>) -> Result<()> {
    check("linear input width (the weight's columns)", x.cols, w.cols)?;
    if let Some(b) = bias {
        check("linear bias length (the weight's rows)", b.len, w.rows)?;
    }
    Ok(())
}

fn check_norm(x: &Tensor, w: &Vector) -> Result<()> {
    if w.len == 0 || !x.cols.is_multiple_of(w.len) {
        return Err(ComputeError::Shape {
            what: "rms_norm row width (a multiple of the weight length)",
            got: x.cols,
            want: w.len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
