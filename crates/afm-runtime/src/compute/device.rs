//! Opening a device and placing values on it: weights, vectors, RoPE tables, the KV pool and
//! a step's packed layout, and reading tensors back to the host. A value made here belongs to
//! this device; the ops in the sibling files refuse operands from another.

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use super::cuda;
#[cfg(feature = "cuda")]
use super::wrong;
use super::{check, ComputeError, Data, Device, DeviceChoice, KvData, KvPool, Result, Rotary};
use super::{RotaryData, Step, StepData, Tensor, Vector, VectorData, Weight, WeightData};
use crate::attention::AttnSeq;
use crate::kv_store::{KvCache, KvDtype, LayerKvShape};
use crate::ops::{Rope, RopeStyle};
use crate::{DType, WeightMatrix};

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
        self.weights_joined(vec![w])?
            .pop()
            .ok_or(ComputeError::Shape {
                what: "weights placed",
                got: 0,
                want: 1,
            })
    }

    /// Places matrices that multiply the same input (Q/K/V, gate and up): on a GPU back to back
    /// in one allocation where their type allows, so the products can run as one GEMM; the
    /// same as [`weight`](Self::weight) on each otherwise.
    pub fn weights_joined(&self, ws: Vec<WeightMatrix>) -> Result<Vec<Weight>> {
        let shapes: Vec<(DType, usize, usize)> =
            ws.iter().map(|w| (w.dtype(), w.rows(), w.cols())).collect();
        let data: Vec<WeightData> = match self {
            Device::Cpu => ws.into_iter().map(WeightData::Host).collect(),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c
                .weights_joined(&ws)?
                .into_iter()
                .map(|d| WeightData::Cuda(Arc::new(d)))
                .collect(),
        };
        Ok(shapes
            .into_iter()
            .zip(data)
            .map(|((dtype, rows, cols), data)| Weight {
                dtype,
                rows,
                cols,
                data,
            })
            .collect())
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

    #[cfg(feature = "cuda")]
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
        }
    }
}
