//! Prefill attention on tensor cores (`kernels/attention_mma.cu`): which steps take it, and
//! its launch. [`CudaContext::paged_attention`](super::CudaContext::paged_attention) calls
//! it; the packing of its query tiles lives with the rest of the step in `attention.rs`.
//!
//! The rule: a sequence whose chunk in the step has at least [`MMA_MIN_ROWS`] rows goes to the
//! mma kernel, in tiles of [`MMA_ROWS`] rows (so its first tile is full and a partial last
//! tile wastes under half of the work), when the layer's cache is f16, its head_dim is 64,
//! 128 or 256 and the device is sm_80 or later. Shorter chunks and decode rows stay on the
//! SIMT kernel, in the same step (two launches over disjoint rows). `AFM_ATTN_MMA=0` turns the
//! mma path off (A/B runs); [`AttnKernel`] picks a path per call (tests and benchmarks).
//!
//! The same module also holds the tensor-core decode kernel (`attn_dec_mma_*`, one query row
//! per sequence): `attention.rs`'s `DecodePlan` sends it decode steps whose sequences × KV
//! heads reach the SM count (below, the SIMT decode kernel is faster), with the split rule
//! [`dec_mma_split_count`]; [`CudaContext::launch_dec_mma`] launches it, or its twin with the
//! attention prologue folded in.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::LaunchConfig;

use super::attention::{AttnBatch, DecPro, DeviceLayerKv, SimtLaunch};
use super::context::{scratch, scratch_zeroed};
use super::{launch, CudaContext, CudaError, Result};
use crate::attention::AttnParams;
use crate::kv_store::KvDtype;
use crate::switch::{Knob, Switch};

/// Query rows per mma tile (`MMA_BM` in attention_mma.cu: 4 warps × 16).
pub(super) const MMA_ROWS: usize = 64;
/// Fewest rows of one sequence's chunk that the mma kernel takes (see the module header).
pub(super) const MMA_MIN_ROWS: usize = 64;

/// The query tiles of a step over sequences of `lens` rows, each `[seq, first query]`.
pub(super) struct StepTiles {
    /// SIMT tiles of `qb` queries: first those of the sequences the mma kernel never takes,
    /// then those of the ones it takes where it serves the layer.
    pub simt: Vec<i32>,
    /// Tiles (pairs of `simt`) in the first group.
    pub short: usize,
    /// Tiles of [`MMA_ROWS`] rows of each sequence of at least [`MMA_MIN_ROWS`] rows, last
    /// tiles first: they see the most keys, so the longest CTAs start early.
    pub mma: Vec<i32>,
}

pub(super) fn step_tiles(lens: impl Iterator<Item = usize>, qb: usize) -> StepTiles {
    let (mut short, mut long, mut mma) = (Vec::new(), Vec::new(), Vec::new());
    for (i, len) in lens.enumerate() {
        let simt = (0..len)
            .step_by(qb.max(1))
            .flat_map(|q| [i as i32, q as i32]);
        if len >= MMA_MIN_ROWS {
            long.extend(simt);
            let starts = (0..len).step_by(MMA_ROWS).rev();
            mma.extend(starts.flat_map(|q| [i as i32, q as i32]));
        } else {
            short.extend(simt);
        }
    }
    let n_short = short.len() / 2;
    short.extend(long);
    StepTiles {
        simt: short,
        short: n_short,
        mma,
    }
}

/// Which kernel serves the prefill tiles of a [`paged_attention_with`] call.
///
/// [`paged_attention_with`]: super::CudaContext::paged_attention_with
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernel {
    /// Tensor cores where they apply (module header) unless `AFM_ATTN_MMA=0`; SIMT elsewhere.
    Auto,
    /// The SIMT kernel for every row.
    Simt,
    /// Tensor cores for every sequence of at least [`MMA_MIN_ROWS`] rows (the rest SIMT);
    /// an error where they cannot serve the layer or no sequence is that long.
    Mma,
}

/// `AFM_ATTN_MMA=0` turns the automatic choice of the mma kernel off.
fn mma_enabled() -> bool {
    static ON: Switch = Switch::new("AFM_ATTN_MMA", true);
    ON.on()
}

/// Resident CTAs per multiprocessor the split-K choice aims at (shared memory allows 2 at
/// head_dim 128 and 256 on Hopper): one CTA per SM leaves each warp's softmax unhidden.
const MMA_TARGET_CTAS_PER_SM: usize = 2;
/// Fewest key tiles per split, so the merge stays a small share of the work.
const MMA_MIN_TILES_PER_SPLIT: usize = 4;
/// `MMA_MAX_SPLITS` in attention_mma.cu.
pub(super) const MMA_MAX_SPLITS: usize = 16;

/// Key-range splits for `ctas` CTAs over at most `key_tiles` key tiles each: enough CTAs to
/// fill the device (a short chunk after a long context has few), at least
/// [`MMA_MIN_TILES_PER_SPLIT`] tiles per split; 1 when the step fills the device already.
fn mma_split_count(sm_count: usize, ctas: usize, key_tiles: usize) -> usize {
    (MMA_TARGET_CTAS_PER_SM * sm_count / ctas.max(1))
        .min(key_tiles / MMA_MIN_TILES_PER_SPLIT)
        .clamp(1, MMA_MAX_SPLITS)
}

/// Keys per tile of the decode kernel (`DEC_BN` in attention_mma.cu).
const DEC_KEYS: usize = 16;
/// CTAs per multiprocessor the decode kernel's split count aims for (its shared memory lets
/// 2 to 5 reside, by head_dim). A target of 8 (two splits at 64 streams of Qwen3-8B) was 11%
/// slower there (session 23).
const DEC_TARGET_CTAS_PER_SM: usize = 2;

/// Warps per CTA of the decode kernel (`ATTN_DEC_MMA` in attention_mma.cu).
fn dec_warps(head_dim: usize) -> usize {
    if head_dim == 64 {
        4
    } else {
        2
    }
}

/// Ring buffers per warp of the decode kernel (`ATTN_DEC_MMA` in attention_mma.cu).
fn dec_stages(head_dim: usize) -> usize {
    if head_dim > 128 {
        2
    } else {
        3
    }
}

/// Key-range splits of the decode kernel over `ctas` CTAs (sequence × KV head) of contexts of
/// at most `keys` keys: enough CTAs for [`DEC_TARGET_CTAS_PER_SM`], each warp at least two
/// tiles per split, at most `MMA_MAX_SPLITS`.
pub(super) fn dec_mma_split_count(
    sm_count: usize,
    ctas: usize,
    keys: usize,
    head_dim: usize,
) -> usize {
    let most = keys.div_ceil(DEC_KEYS) / (dec_min_tiles() * dec_warps(head_dim));
    (DEC_TARGET_CTAS_PER_SM * sm_count)
        .div_ceil(ctas.max(1))
        .min(most)
        .clamp(1, MMA_MAX_SPLITS)
}

/// Fewest key tiles per warp in a split of the decode kernel: 2, or
/// `AFM_ATTN_DEC_MMA_TILES` (read once) for A/B runs.
fn dec_min_tiles() -> usize {
    static N: Knob = Knob::new("AFM_ATTN_DEC_MMA_TILES");
    N.get().filter(|&v| v > 0).unwrap_or(2)
}

/// Dynamic shared memory of one decode CTA: Q [16] and each warp's ring of buffers each of K
/// and V [DEC_KEYS], rows of `head_dim + 8` f16; the warps' partials reuse the rings.
fn dec_shared_bytes(head_dim: usize) -> usize {
    (16 + dec_warps(head_dim) * dec_stages(head_dim) * 2 * DEC_KEYS) * (head_dim + 8) * 2
}

/// Keys per shared-memory tile for `head_dim` (`ATTN_MMA` in attention_mma.cu).
fn keys_per_tile(head_dim: usize) -> Option<usize> {
    match head_dim {
        64 | 128 => Some(64),
        256 => Some(32),
        _ => None,
    }
}

/// Dynamic shared memory of one CTA: Q [64] and two buffers each of K and V [BN], rows of
/// `head_dim + 8` f16 (the padding spreads ldmatrix rows over the banks).
fn shared_bytes(head_dim: usize, keys: usize) -> usize {
    (MMA_ROWS + 4 * keys) * (head_dim + 8) * 2
}

/// Mirror of `MmaArgs` in attention_mma.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct MmaArgs {
    n_heads: i32,
    n_kv_heads: i32,
    block_size: i32,
    max_blocks: i32,
    window: i32,
    q_stride: i32,
    out_stride: i32,
    group: i32,
    bs_shift: i32,
    n_splits: i32,
    scale: f32,
    softcap: f32,
    /// The decode kernel's bf16 copy of its output (0: none; `handover.rs`, `AFM_ATTN_HALF`).
    out16: u64,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct (the pointer at offset 48 in both;
// attention_mma.cu asserts the same size).
unsafe impl cudarc::driver::DeviceRepr for MmaArgs {}
const _: () =
    assert!(std::mem::size_of::<MmaArgs>() == 56 && std::mem::offset_of!(MmaArgs, out16) == 48);

impl MmaArgs {
    fn new(
        p: &AttnParams,
        nkv: usize,
        block_size: usize,
        batch: &AttnBatch,
        (q_stride, out_stride): (usize, usize),
        n_splits: u32,
    ) -> Self {
        Self {
            n_heads: p.n_heads as i32,
            n_kv_heads: nkv as i32,
            block_size: block_size as i32,
            max_blocks: batch.max_blocks() as i32,
            window: p.window.unwrap_or(0) as i32,
            q_stride: q_stride as i32,
            out_stride: out_stride as i32,
            group: (p.n_heads / nkv) as i32,
            bs_shift: if block_size.is_power_of_two() {
                block_size.trailing_zeros() as i32
            } else {
                -1
            },
            n_splits: n_splits as i32,
            scale: p.scale,
            softcap: p.softcap.unwrap_or(0.0),
            out16: 0,
        }
    }
}

/// Where an [`AttnKernel::Mma`] request cannot be met, or `None` where it can.
fn mma_refusal(ctx: &CudaContext, kv: &DeviceLayerKv, batch: &AttnBatch) -> Option<CudaError> {
    let d = kv.shape.head_dim;
    let unsupported = |what, value: String, supported| {
        Some(CudaError::Unsupported {
            what,
            value,
            supported,
        })
    };
    if kv.dtype() != KvDtype::F16 {
        return unsupported(
            "KV cache type of the mma attention kernel",
            format!("{:?}", kv.dtype()),
            "F16",
        );
    }
    if keys_per_tile(d).is_none() {
        return unsupported("mma attention head_dim", d.to_string(), "64, 128, 256");
    }
    let (major, minor) = ctx.info().compute_capability;
    if major < 8 {
        return unsupported(
            "compute capability for the mma attention kernel",
            format!("{major}.{minor}"),
            "8.0 or later",
        );
    }
    if batch.mma_tiles() == 0 {
        return unsupported(
            "longest sequence chunk of the step for the mma attention kernel",
            "below the minimum".into(),
            "at least 64 rows (MMA_MIN_ROWS)",
        );
    }
    None
}

impl CudaContext {
    /// Whether this call's prefill tiles take the mma kernel (see [`AttnKernel`]); for
    /// `Mma`, an error where they cannot. Sets the kernel's shared-memory limit when it does.
    pub(super) fn use_attn_mma(
        &self,
        kernel: AttnKernel,
        kv: &DeviceLayerKv,
        batch: &AttnBatch,
    ) -> Result<bool> {
        let refusal = match kernel {
            AttnKernel::Simt => return Ok(false),
            AttnKernel::Auto if !mma_enabled() => return Ok(false),
            _ => mma_refusal(self, kv, batch),
        };
        match (refusal, kernel) {
            (Some(e), AttnKernel::Mma) => return Err(e),
            (Some(_), _) => return Ok(false),
            (None, _) => {}
        }
        let d = kv.shape.head_dim;
        let bytes = shared_bytes(d, keys_per_tile(d).unwrap_or(64));
        let f = self.kernel(&format!("attn_mma_f16_{d}"))?;
        self.stream().context().bind_to_thread()?;
        let set = f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        );
        match (set, kernel) {
            (Ok(()), _) => Ok(true),
            (Err(e), AttnKernel::Mma) => Err(e.into()),
            // A device with less shared memory per block: the SIMT kernel serves it.
            (Err(_), _) => Ok(false),
        }
    }

    /// Registers per thread and local (spilled) bytes per thread of the mma kernel at each
    /// head_dim, as the driver compiled it for this device: (head_dim, registers, local bytes).
    pub fn attn_mma_resources(&self) -> Result<Vec<(usize, i32, i32)>> {
        [64, 128, 256]
            .into_iter()
            .map(|d| {
                let f = self.kernel(&format!("attn_mma_f16_{d}"))?;
                Ok((d, f.num_regs()?, f.local_size_bytes()?))
            })
            .collect()
    }

    /// The mma kernel over the batch's mma tiles (shapes and strides checked by the caller,
    /// [`use_attn_mma`](Self::use_attn_mma) true), the key range split `splits` ways, or as
    /// [`mma_split_count`] picks.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_attn_mma(
        &mut self,
        kv: &DeviceLayerKv,
        block_size: usize,
        batch: &AttnBatch,
        q: u64,
        q_stride: usize,
        p: &AttnParams,
        out: u64,
        out_stride: usize,
        splits: Option<usize>,
    ) -> Result<()> {
        let (d, nkv) = (kv.shape.head_dim, kv.shape.n_kv_heads);
        let keys = keys_per_tile(d).ok_or(CudaError::Unsupported {
            what: "mma attention head_dim",
            value: d.to_string(),
            supported: "64, 128, 256",
        })?;
        let ctas = p.n_heads * batch.mma_tiles();
        let context = batch.max_context();
        let span = p.window.map_or(context, |w| (w + MMA_ROWS).min(context));
        let n_splits = splits
            .unwrap_or_else(|| mma_split_count(self.info().sm_count, ctas, span.div_ceil(keys)))
            .clamp(1, MMA_MAX_SPLITS);
        let (ws, done) = if n_splits > 1 {
            let n = ctas * n_splits * MMA_ROWS * (d + 2);
            let stream = self.stream().clone();
            (
                scratch(&stream, &mut self.ws.attn, n)?,
                scratch_zeroed(&stream, &mut self.ws.attn_done, ctas)?,
            )
        } else {
            (0, 0)
        };
        let args = MmaArgs::new(
            p,
            nkv,
            block_size,
            batch,
            (q_stride, out_stride),
            n_splits as u32,
        );
        let (kc, vc) = kv.addresses(self);
        let (tab, seqs, _, _) = batch.ptrs(self);
        let tiles = batch.mma_tiles_ptr(self);
        let cfg = LaunchConfig {
            grid_dim: (p.n_heads as u32, batch.mma_tiles() as u32, n_splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: shared_bytes(d, keys) as u32,
        };
        let f = self.kernel(&format!("attn_mma_f16_{d}"))?;
        launch!(self, f, cfg; q, kc, vc, tab, seqs, tiles, out, ws, done, args)
    }
}

impl CudaContext {
    /// The tensor-core decode kernel over the first `l.grid.1` tiles (one per decode row) of
    /// `batch` ([`SimtLaunch::mma`]: shapes and strides checked by the caller, `ws` and `done`
    /// sized for `l`'s splits); with `pro`, its twin that does the attention prologue too
    /// (`attn_dec_mma_pro_*`, see attention/prologue.rs). `out16` (0: none): a bf16 copy of
    /// the output, same layout.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_dec_mma(
        &mut self,
        kv: &DeviceLayerKv,
        block_size: usize,
        batch: &AttnBatch,
        l: &SimtLaunch,
        (q, q_stride): (u64, usize),
        p: &AttnParams,
        (out, out_stride): (u64, usize),
        (ws, done): (u64, u64),
        pro: Option<DecPro>,
        out16: u64,
    ) -> Result<()> {
        let (d, nkv) = (kv.shape.head_dim, kv.shape.n_kv_heads);
        let bytes = dec_shared_bytes(d);
        let kind = if pro.is_some() {
            "dec_mma_pro"
        } else {
            "dec_mma"
        };
        let f = self.kernel(&format!("attn_{kind}_f16_{d}"))?;
        self.stream().context().bind_to_thread()?;
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )?;
        let args = MmaArgs {
            out16,
            ..MmaArgs::new(p, nkv, block_size, batch, (q_stride, out_stride), l.grid.2)
        };
        let (kc, vc) = kv.addresses(self);
        let (tab, seqs, _, tiles) = batch.ptrs(self);
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: (32 * dec_warps(d) as u32, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        match pro {
            None => launch!(self, f, cfg; q, kc, vc, tab, seqs, tiles, out, ws, done, args),
            Some(pr) => launch!(self, f, cfg; q, kc, vc, tab, seqs, tiles, out, ws, done, args, pr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared memory each kernel asks for fits the smallest opt-in limit of the devices
    /// it runs on (99 KB on sm_86/sm_89; 163 KB and 227 KB on sm_80/sm_90).
    /// Every row of every sequence is in exactly one SIMT tile; the mma tiles cover exactly
    /// the rows of the sequences of at least 64 rows, once each, and their SIMT tiles are last.
    #[test]
    fn step_tiles_cover_each_row_once() {
        let lens = [1, 300, 63, 64, 0, 129, 5];
        let qb = 4;
        let t = step_tiles(lens.iter().copied(), qb);
        let rows = |tiles: &[i32], size: usize| {
            let mut seen: Vec<(usize, usize)> = Vec::new();
            for p in tiles.chunks(2) {
                let (s, q0) = (p[0] as usize, p[1] as usize);
                assert!(q0 < lens[s], "tile past sequence {s}");
                seen.extend((q0..(q0 + size).min(lens[s])).map(|r| (s, r)));
            }
            seen.sort();
            seen
        };
        let all: Vec<(usize, usize)> = lens
            .iter()
            .enumerate()
            .flat_map(|(s, &l)| (0..l).map(move |r| (s, r)))
            .collect();
        assert_eq!(rows(&t.simt, qb), all);
        let long: Vec<(usize, usize)> = all
            .iter()
            .copied()
            .filter(|&(s, _)| lens[s] >= 64)
            .collect();
        assert_eq!(rows(&t.mma, MMA_ROWS), long);
        let first_long = t.simt.chunks(2).position(|p| lens[p[0] as usize] >= 64);
        assert_eq!(first_long, Some(t.short));
        assert!(t.simt[2 * t.short..]
            .chunks(2)
            .all(|p| lens[p[0] as usize] >= 64));
        // 300 rows: tiles at 256, 192, 128, 64, 0 (the partial last one first).
        let starts: Vec<i32> = t
            .mma
            .chunks(2)
            .filter(|p| p[0] == 1)
            .map(|p| p[1])
            .collect();
        assert_eq!(starts, [256, 192, 128, 64, 0]);
    }

    /// Split-K only where the step has too few CTAs for the device, never below 4 key tiles
    /// per split: Qwen3-0.6B (16 heads) on 132 SMs.
    #[test]
    fn splits_only_for_small_steps_over_long_contexts() {
        // a 16k prompt in one chunk: 256 tiles x 16 heads
        assert_eq!(mma_split_count(132, 16 * 256, 256), 1);
        // the last 512-row chunk of a 16k prompt: 8 tiles x 16 heads
        assert_eq!(mma_split_count(132, 16 * 8, 256), 2);
        // one 64-row chunk at 16k: 16 CTAs
        assert_eq!(mma_split_count(132, 16, 256), 16);
        // the same at 300 positions: 5 key tiles, no split
        assert_eq!(mma_split_count(132, 16, 5), 1);
    }

    #[test]
    fn shared_memory_fits_every_sm80_class_device() {
        for d in [64, 128, 256] {
            let bytes = shared_bytes(d, keys_per_tile(d).expect("supported head_dim"));
            assert!(bytes <= 99 * 1024, "head_dim {d}: {bytes} bytes");
        }
        assert_eq!(keys_per_tile(512), None);
    }
}
