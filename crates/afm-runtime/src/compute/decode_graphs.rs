//! CUDA decode graphs and sampling on the device, behind [`Device`] so the engine calls them
//! on any device: on the CPU graphs are a no-op (`None`: run the forward eagerly) and device
//! logits do not exist.

use super::{wrong, DecodeForward, Device, DeviceLogits, DeviceSample, KvPool, Result};
use super::{SampledIds, StepTokens};
use crate::attention::AttnSeq;

impl Device {
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
    /// `tokens` are the rows' inputs: host ids, or the previous step's sampled ids (row i
    /// from row i) while they are still on the device.
    pub fn graph_decode(
        &self,
        tokens: StepTokens,
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
        let ids = self.sample_device_start(l, rows)?;
        self.sampled_ids(&ids)
    }

    /// Queues the sampling of one token per row of `l` and the copy of the ids to the host,
    /// and returns without waiting: the ids can feed the next decode step
    /// ([`StepTokens::Sampled`]) before the host reads them ([`sampled_ids`](Self::sampled_ids)).
    pub fn sample_device_start(
        &self,
        l: &DeviceLogits,
        rows: &[DeviceSample],
    ) -> Result<SampledIds> {
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
                c.sample_start(l, &params, &adjust)
            }
        }
    }

    /// The ids of a [`sample_device_start`](Self::sample_device_start), waiting for them.
    /// Readable until two later samplings have been started.
    pub fn sampled_ids(&self, ids: &SampledIds) -> Result<Vec<u32>> {
        let _ = ids;
        match self {
            Device::Cpu => Err(wrong("sampled_ids", "cpu", "cuda")),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.sampled(ids),
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
}
