//! The paged KV cache on the device, the KV write and paged attention.
//!
//! Same storage layout and block ids as `crate::kv_store` (see `kernels/attention.cu`), and the
//! same step description as the CPU: [`AttnSeq`] rows, positions and block tables, packed once
//! per step into an [`AttnBatch`] that every layer reuses:
//! ```text
//! meta (i32): tables [n_seqs][max_blocks] | seqs [n_seqs][row0, len, pos0, 0]
//!             | row_seq [n_rows] | tiles [n_tiles][seq, first query]
//!             | mma tiles [n_mma_tiles][seq, first query]
//! ```
//! Decode steps (one query per sequence) get one tile per sequence; steps with longer chunks get
//! tiles of `16 / GH` queries. When a step has few blocks and long contexts, the key range is
//! split over `n_splits` blocks per tile and the last of them to finish merges them (split-K,
//! one launch). Sequences with long chunks also get tiles of 64 rows for the tensor-core kernel
//! (`attention_mma.rs`, which says when it serves a layer); their SIMT tiles come after all
//! others, so that a step they take launches the SIMT kernel over the first `short_tiles` only.
//!
//! Decode steps over f16 caches of head_dim 64/128/256 take `attn_decode_impl` (attention.cu),
//! built for latency: block tables, and the K/V ring's first fill but for the new key's row,
//! read before the PDL wait (no kernel of a step writes the cache rows before the new key), K/V
//! through a cp.async ring, splits of at least [`DECODE_MIN_KEYS`] applied to each context (so
//! a CUDA graph's split count, baked for its context class, suits shorter contexts too),
//! one-pass merge; on compute capability 9.0 and later a tile of at most [`DEC_CLUSTER_MAX`]
//! splits runs them as one thread block cluster, merged through distributed shared
//! memory instead of global memory and a counter, with the same bits (`AFM_ATTN_CLUSTER=0`
//! keeps the global merge).
//! [`DecodePlan`] says when (GH <= 2 over long contexts at many streams keeps `attn_impl`);
//! `AFM_ATTN_DECODE_OLD=1` sends every decode step to `attn_impl` (A/B). Decode steps whose
//! sequences × KV heads reach the SM count take the tensor-core decode kernel instead
//! (`attn_dec_mma_*`, `attention_mma.rs`; `AFM_ATTN_DEC_MMA=0` keeps them here).
//!
//! [`CudaContext::attn_prologue`] is the step before attention in one launch: per-head Q/K
//! RMSNorm, RoPE and the K/V write. [`CudaContext::attend_prologue`] is both in one call, and
//! in one launch when every row is a decode row the decode kernel takes (`attn_dec_pro_*`:
//! each block normalizes and rotates its own query heads; the blocks whose keys end at the
//! new token normalize and rotate its key too and put K and V into their shared-memory stage,
//! one of them storing both in the cache); `AFM_ATTN_FUSED_PRO=0` keeps two launches.

use crate::switch::{Knob, Switch};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::f16;

use super::attention_mma::{step_tiles, AttnKernel};
use super::context::{scratch, scratch_zeroed};
use super::{check_len, launch, Buf, CudaContext, CudaError, Result, RopeTable};
use crate::attention::{AttnParams, AttnSeq};
use crate::kv_store::{KvDtype, LayerKvShape};

mod batch;
mod prologue;
pub(super) use prologue::DecPro;

/// Device storage of one layer's keys or values.
pub enum KvBuf {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
}

impl KvBuf {
    fn ptr(&self, ctx: &CudaContext) -> u64 {
        match self {
            KvBuf::F32(b) => ctx.ptr(b),
            KvBuf::F16(b) => ctx.ptr(b),
        }
    }
}

pub struct DeviceLayerKv {
    pub shape: LayerKvShape,
    dtype: KvDtype,
    k: KvBuf,
    v: KvBuf,
}

/// One [`DeviceLayerKv`] per layer, all with the same block ids.
pub struct DeviceKvCache {
    pub layers: Vec<DeviceLayerKv>,
    block_size: usize,
    num_blocks: usize,
}

impl DeviceKvCache {
    /// A zeroed cache of `num_blocks` blocks of `block_size` tokens per layer.
    pub fn new(
        ctx: &CudaContext,
        shapes: &[LayerKvShape],
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        if !matches!(dtype, KvDtype::F32 | KvDtype::F16) {
            return Err(CudaError::Unsupported {
                what: "KV cache type on the GPU",
                value: format!("{dtype:?}"),
                supported: "F32, F16",
            });
        }
        let buf = |n: usize| -> Result<KvBuf> {
            Ok(match dtype {
                KvDtype::F32 => KvBuf::F32(ctx.zeros(n)?),
                _ => KvBuf::F16(ctx.zeros(n)?),
            })
        };
        let layers = shapes
            .iter()
            .map(|&shape| {
                let n = num_blocks * block_size * shape.n_kv_heads * shape.head_dim;
                Ok(DeviceLayerKv {
                    shape,
                    dtype,
                    k: buf(n)?,
                    v: buf(n)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            block_size,
            num_blocks,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}

impl DeviceLayerKv {
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Device addresses of the keys and the values (`compute::kv_rows`: rows read and written
    /// by host code, DeepSeek V4's streams).
    pub fn addresses(&self, ctx: &CudaContext) -> (u64, u64) {
        (self.k.ptr(ctx), self.v.ptr(ctx))
    }

    /// Keys and values of `head` in `block` (`block_size × head_dim` each) as f32, for tests.
    pub fn read_block(
        &self,
        ctx: &CudaContext,
        cache: &DeviceKvCache,
        block: usize,
        head: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = cache.block_size * self.shape.head_dim;
        let at = (block * self.shape.n_kv_heads + head) * n;
        let read = |b: &KvBuf| -> Result<Vec<f32>> {
            Ok(match b {
                KvBuf::F32(s) => ctx.download(&s.slice(at..at + n))?,
                KvBuf::F16(s) => ctx
                    .download(&s.slice(at..at + n))?
                    .iter()
                    .map(|h| h.to_f32())
                    .collect(),
            })
        };
        Ok((read(&self.k)?, read(&self.v)?))
    }
}

/// Split-K aims for this many attention blocks per multiprocessor: enough independent key
/// streams in flight to cover memory latency (each block walks its keys serially).
const SPLIT_TARGET_BLOCKS_PER_SM: usize = 6;
/// Fewest keys per split, so the merge stays a small cost (`attn_impl`).
const SPLIT_MIN_KEYS: usize = 64;
/// The same for the decode kernel (`attn_decode_impl`), which also applies it to the context
/// at hand (a graph's split count is baked for its context class): two stages of 16 keys,
/// so a 140-token context in a 1k class uses 5 splits and the others exit at once. Its
/// merge is one pass, and a context of one split skips it.
const DECODE_MIN_KEYS: usize = 32;
/// Blocks per multiprocessor the decode kernel's split count aims for: more than
/// [`SPLIT_TARGET_BLOCKS_PER_SM`], as its blocks hold fewer keys in flight each (measured on
/// the H200 at 64 streams: 4 splits instead of 2 took 16k contexts from 1490 to 1367 us).
const DECODE_TARGET_BLOCKS_PER_SM: usize = 12;
/// Up to this many keys (a graph's context class) the split count aims for
/// [`DECODE_TARGET_BLOCKS_PER_SM_SHORT`] blocks per SM instead: fewer splits, so fewer partials
/// to merge. H200, `gpu_bench`, 128-token prompts + 256 tokens (1k class): session 8, 64
/// streams, Qwen3-0.6B 24,151 tok/s at 4 against 23,480 at 12 and 21,951 at 24, Qwen3-8B 8,642
/// against 8,426; session 9 (after the joined Q/K/V and gate+up GEMMs), 2 against 4: 0.6B 64
/// streams 29,128 / 28,711 against 26,999 / 27,350 (64 streams × 8 KV heads is 512 blocks, one
/// split instead of two), 8B 9,654 against 9,400; 1, 8, 16 and 32 streams unchanged.
const DECODE_SHORT_KEYS: usize = 1024;
const DECODE_TARGET_BLOCKS_PER_SM_SHORT: usize = 2;
/// Above this many keys, with at least one block per multiprocessor before splitting, decode
/// steps with GH <= 2 keep `attn_impl`: there it streams faster (H200, 0.6B heads, 64
/// streams at 16k: 1255 us against 1367; at 1k 96 against 98; below, the decode kernel wins).
const DECODE_MAX_KEYS_GH2_WIDE: usize = 1024;
/// `MAX_SPLITS` in attention.cu.
const MAX_SPLITS: usize = 128;
/// `DEC_CLUSTER_MAX` in attention.cu: most splits of a decode tile merged in one cluster (16
/// blocks, a non-portable cluster size that Hopper allows): every split count of a graph's 1k
/// context class ([`DecodePlan::max_splits`]); longer contexts with more splits keep the
/// global merge.
const DEC_CLUSTER_MAX: usize = 16;

/// One step's sequences, packed for the device (see the module header).
pub struct AttnBatch {
    meta: Buf<i32>,
    /// Key-range splits fixed when the batch was packed (CUDA graphs bake the grid in).
    forced_splits: Option<usize>,
    n_seqs: usize,
    n_rows: usize,
    max_blocks: usize,
    tiles: usize,
    /// SIMT tiles of the sequences the mma kernel does not take (the first ones).
    short_tiles: usize,
    /// Tiles of [`MMA_ROWS`] rows of the sequences of at least [`MMA_MIN_ROWS`] rows.
    mma_tiles: usize,
    /// Queries per tile: 1 for pure decode steps, else `16 / GH`.
    qb: usize,
    /// Heads per attention block, from the head grouping (see [`heads_per_block`]).
    gh: usize,
    /// Most positions any query of the step can see.
    max_context: usize,
    off_seqs: usize,
    off_rows: usize,
    off_tiles: usize,
    off_mma: usize,
}

/// Query heads one attention block serves: the largest of 4, 2, 1 that divides the group
/// (2 at most for head_dim 256 and 1 for 512, to bound registers).
fn heads_per_block(group: usize, head_dim: usize) -> usize {
    let max = match head_dim {
        0..=128 => 4,
        129..=256 => 2,
        _ => 1,
    };
    [4, 2, 1]
        .into_iter()
        .find(|&g| g <= max && group.is_multiple_of(g))
        .unwrap_or(1)
}

fn check(what: &'static str, got: usize, want: usize) -> Result<()> {
    super::check(what, got, want)
}

/// Key-range splits for `blocks` attention blocks: enough blocks in flight to fill the device
/// (`per_sm` each), at most `max_splits` ([`DecodePlan::max_splits`]).
fn split_count(sm_count: usize, blocks: usize, max_splits: usize, per_sm: usize) -> usize {
    let target = per_sm * sm_count;
    target
        .div_ceil(blocks.max(1))
        .clamp(1, max_splits.max(1))
        .min(MAX_SPLITS)
}

/// Decode attention's splits merged in a thread block cluster ([`CudaContext::dec_clusters`]),
/// process-wide: off with `AFM_ATTN_CLUSTER=0`, or
/// [`CudaContext::set_decode_attention_clusters`].
static DEC_CLUSTER: Switch = Switch::new("AFM_ATTN_CLUSTER", true);

/// Decode steps on the kernel before `attn_decode_impl` (`attn_impl`), process-wide: the A/B
/// switch `AFM_ATTN_DECODE_OLD=1`, or [`CudaContext::set_decode_attention_old`].
static DECODE_OLD: Switch = Switch::new("AFM_ATTN_DECODE_OLD", false);

fn decode_old() -> bool {
    DECODE_OLD.on()
}

/// Blocks per SM the decode kernel's splits aim for over contexts of at most `keys` keys:
/// [`DECODE_TARGET_BLOCKS_PER_SM_SHORT`] up to [`DECODE_SHORT_KEYS`], else
/// [`DECODE_TARGET_BLOCKS_PER_SM`]; `AFM_ATTN_DEC_PER_SM` (read once) sets both, for A/B.
fn decode_target_per_sm(keys: usize) -> usize {
    static PER_SM: Knob = Knob::new("AFM_ATTN_DEC_PER_SM");
    PER_SM
        .get()
        .filter(|&v| v > 0)
        .unwrap_or(if keys <= DECODE_SHORT_KEYS {
            DECODE_TARGET_BLOCKS_PER_SM_SHORT
        } else {
            DECODE_TARGET_BLOCKS_PER_SM
        })
}

/// Fewest keys of a decode split: [`DECODE_MIN_KEYS`], or `AFM_ATTN_DEC_MIN_KEYS` (read once;
/// a multiple of the kernel's 16-key stage) for A/B.
fn decode_min_keys() -> usize {
    static MIN: Knob = Knob::new("AFM_ATTN_DEC_MIN_KEYS");
    MIN.get()
        .filter(|&v| v > 0 && v % 16 == 0)
        .unwrap_or(DECODE_MIN_KEYS)
}

/// Whether decode steps fold the attention prologue into the decode kernel
/// ([`CudaContext::attend_prologue`]), process-wide: off with `AFM_ATTN_FUSED_PRO=0`, or
/// [`CudaContext::set_attn_fused_prologue`].
static FUSED_PROLOGUE: Switch = Switch::new("AFM_ATTN_FUSED_PRO", true);

fn fused_prologue_on() -> bool {
    FUSED_PROLOGUE.on()
}

/// Decode steps of many sequences on tensor cores (`attn_dec_mma_*` in attention_mma.cu),
/// process-wide: off with `AFM_ATTN_DEC_MMA=0`, or [`CudaContext::set_decode_attention_mma`].
static DECODE_MMA: Switch = Switch::new("AFM_ATTN_DEC_MMA", true);

/// Fewest CTAs (sequences × KV heads) before splitting for which decode steps take the
/// tensor-core decode kernel: the SM count, or `AFM_ATTN_DEC_MMA_MIN_BLOCKS` (read once) for
/// A/B runs.
fn dec_mma_min_blocks(sm_count: usize) -> usize {
    static MIN: Knob = Knob::new("AFM_ATTN_DEC_MMA_MIN_BLOCKS");
    MIN.get().unwrap_or(sm_count)
}

/// What the kernel choice of a step depends on besides its size: the device and the layer.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepShape {
    pub sm_count: usize,
    /// mma.sync (compute capability 8.0 or later).
    pub tensor_cores: bool,
    /// Query heads per SIMT block ([`heads_per_block`]).
    pub gh: usize,
    /// Query heads per KV head.
    pub group: usize,
    pub head_dim: usize,
    /// Bytes per cached K/V element.
    pub elem: usize,
}

/// Which kernel a step's attention takes, and the split rule that goes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DecodePlan {
    /// `attn_decode_impl` or `attn_dec_mma_impl` (else `attn_impl`).
    decode: bool,
    /// `attn_dec_mma_impl`: one CTA per (sequence, KV head, split).
    mma: bool,
    min_keys: usize,
    target_per_sm: usize,
}

impl DecodePlan {
    /// For a step of `blocks` SIMT attention blocks (before splitting) over at most `keys`
    /// keys: decode steps (`one_query`) with a SIMT block per multiprocessor or more (before
    /// splitting, per KV head) take the tensor-core decode kernel where it has the shape;
    /// otherwise the SIMT decode kernel where it has the shape, is not switched off, and is
    /// the faster (see [`DECODE_MAX_KEYS_GH2_WIDE`]).
    fn new(s: &StepShape, keys: usize, blocks: usize, one_query: bool) -> Self {
        let kv_blocks = blocks * s.gh / s.group.max(1);
        let mma = one_query
            && s.tensor_cores
            && DECODE_MMA.on()
            && has_dec_mma_kernel(s.head_dim, s.elem, s.group)
            && kv_blocks >= dec_mma_min_blocks(s.sm_count);
        let wide_long_gh2 = s.gh <= 2 && keys > DECODE_MAX_KEYS_GH2_WIDE && blocks >= s.sm_count;
        let decode = mma
            || (one_query
                && !decode_old()
                && has_decode_kernel(s.head_dim, s.elem, s.gh)
                && !wide_long_gh2);
        if decode {
            Self {
                decode,
                mma,
                min_keys: decode_min_keys(),
                target_per_sm: decode_target_per_sm(keys),
            }
        } else {
            Self {
                decode,
                mma,
                min_keys: SPLIT_MIN_KEYS,
                target_per_sm: SPLIT_TARGET_BLOCKS_PER_SM,
            }
        }
    }

    /// Most splits over `keys` keys. The decode kernel takes `min_keys` per split up to
    /// 16 · `min_keys` keys and twice that above (attention.cu applies the same floor to the
    /// context at hand): on the H200 a 140-key context was fastest in 5 splits (6.3 us, 3
    /// splits 7.8) and a 1k one in 16 (10.0 us, 32 splits 11.3).
    fn max_splits(&self, keys: usize) -> usize {
        if !self.decode {
            keys / self.min_keys
        } else if keys <= 16 * self.min_keys {
            keys.div_ceil(self.min_keys)
        } else {
            keys / (2 * self.min_keys)
        }
    }

    /// The kernel's limit on splits (its merge's arrays).
    fn most_splits(&self) -> usize {
        if self.mma {
            super::attention_mma::MMA_MAX_SPLITS
        } else {
            MAX_SPLITS
        }
    }

    /// Key-range splits of a step of `blocks` SIMT blocks over at most `keys` keys, unless
    /// forced: the tensor-core decode kernel's rule for its plan
    /// ([`dec_mma_split_count`](super::attention_mma::dec_mma_split_count)), else
    /// [`split_count`].
    fn splits(&self, s: &StepShape, keys: usize, blocks: usize) -> usize {
        if self.mma {
            let ctas = blocks * s.gh / s.group.max(1);
            super::attention_mma::dec_mma_split_count(s.sm_count, ctas, keys, s.head_dim)
        } else {
            split_count(
                s.sm_count,
                blocks,
                self.max_splits(keys),
                self.target_per_sm,
            )
        }
    }
}

/// Whether attention.cu has a decode kernel for `head_dim` over KV elements of `elem` bytes
/// and `gh` heads per block: f16 caches of head_dim 64, 128 and 256 (the kernel takes rows of
/// 32 to 512 bytes; only these are built, to bound compile time).
fn has_decode_kernel(head_dim: usize, elem: usize, gh: usize) -> bool {
    // heads_per_block(gh, d) == gh: gh is within the limit for head_dim.
    elem == 2 && matches!(head_dim, 64 | 128 | 256) && heads_per_block(gh, head_dim) == gh
}

/// Whether attention_mma.cu has a decode kernel for `head_dim` over KV elements of `elem`
/// bytes and `group` query heads per KV head (the rows of one mma tile).
fn has_dec_mma_kernel(head_dim: usize, elem: usize, group: usize) -> bool {
    elem == 2 && matches!(head_dim, 64 | 128 | 256) && (1..=16).contains(&group)
}

/// Entry points of the decode kernel (`attn_dec_f16_{head_dim}_{heads per block}`) and of
/// its twin with the attention prologue folded in (`attn_dec_pro_f16_...`).
pub(super) fn decode_kernel_names() -> Vec<String> {
    let mut v = Vec::new();
    for kind in ["dec", "dec_pro"] {
        for d in [64, 128, 256] {
            for gh in [1, 2, 4] {
                if has_decode_kernel(d, 2, gh) {
                    v.push(format!("attn_{kind}_f16_{d}_{gh}"));
                }
            }
        }
    }
    v
}

/// Mirror of `AttnArgs` in attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AttnArgs {
    n_heads: i32,
    n_kv_heads: i32,
    block_size: i32,
    max_blocks: i32,
    window: i32,
    n_splits: i32,
    qb: i32,
    q_stride: i32,
    out_stride: i32,
    group: i32,
    hchunks: i32,
    min_keys: i32,
    scale: f32,
    softcap: f32,
    /// 1: the decode kernel's splits run as one cluster and merge through distributed
    /// shared memory ([`CudaContext::dec_cluster_launch`]).
    cluster: i32,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct.
unsafe impl cudarc::driver::DeviceRepr for AttnArgs {}

impl CudaContext {
    /// Registers per thread, local (spilled) bytes per thread, static shared bytes and
    /// resident blocks of 128 threads per multiprocessor of kernel `name` (diagnostics).
    pub fn kernel_occupancy(&self, name: &str) -> Result<(i32, i32, i32, u32)> {
        let f = self.kernel(name)?;
        Ok((
            f.num_regs()?,
            f.local_size_bytes()?,
            f.shared_size_bytes()?,
            f.occupancy_max_active_blocks_per_multiprocessor(128, 0, None)?,
        ))
    }

    /// Sends decode steps to the kernel before `attn_decode_impl` (`old`) or to it, for every
    /// context of the process, as `AFM_ATTN_DECODE_OLD=1` does (A/B benchmarks). Batches
    /// packed for CUDA graphs keep the split count of the rule they were packed under.
    pub fn set_decode_attention_old(&self, old: bool) {
        DECODE_OLD.set(old);
    }

    /// Sends decode steps of many sequences to the tensor-core decode kernel (`on`) or keeps
    /// them on the SIMT one, for every context of the process, as `AFM_ATTN_DEC_MMA=0` does
    /// (A/B benchmarks, tests). Batches packed for CUDA graphs keep the split count of the
    /// rule they were packed under.
    pub fn set_decode_attention_mma(&self, on: bool) {
        DECODE_MMA.set(on);
    }

    /// Folds the attention prologue into the decode kernel where it can (`on`) or keeps the
    /// two launches, for every context of the process, as `AFM_ATTN_FUSED_PRO=0` does (A/B).
    pub fn set_attn_fused_prologue(&self, on: bool) {
        FUSED_PROLOGUE.set(on);
    }

    /// Writes the step's new keys and values (row t at `k + t·k_stride`, `n_kv_heads · head_dim`
    /// values) into their slots.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        cache: &mut DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        k: &impl DevicePtr<f32>,
        k_stride: usize,
        v: &impl DevicePtr<f32>,
        v_stride: usize,
    ) -> Result<()> {
        let kv = cache.layers.get(layer).ok_or(CudaError::Shape {
            what: "KV layer index",
            got: layer,
            want: cache.layers.len(),
        })?;
        let width = kv.shape.n_kv_heads * kv.shape.head_dim;
        if batch.n_rows == 0 {
            return Ok(());
        }
        check_len("kv_write k_stride", k_stride, width)?;
        check_len("kv_write v_stride", v_stride, width)?;
        check_len(
            "kv_write keys",
            k.len(),
            (batch.n_rows - 1) * k_stride + width,
        )?;
        check_len(
            "kv_write values",
            v.len(),
            (batch.n_rows - 1) * v_stride + width,
        )?;
        let (kp, vp, kc, vc) = (self.ptr(k), self.ptr(v), kv.k.ptr(self), kv.v.ptr(self));
        let (tab, seqs, rows, _) = batch.ptrs(self);
        let (nkv, d, bs, mb) = (
            kv.shape.n_kv_heads as i32,
            kv.shape.head_dim as i32,
            cache.block_size as i32,
            batch.max_blocks as i32,
        );
        let (ks, vs) = (k_stride as i32, v_stride as i32);
        let cfg = LaunchConfig {
            grid_dim: (batch.n_rows as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match kv.k {
            KvBuf::F32(_) => "kv_write_f32",
            KvBuf::F16(_) => "kv_write_f16",
        };
        let f = self.kernel(name)?;
        launch!(self, f, cfg; kp, vp, kc, vc, tab, seqs, rows, nkv, d, bs, mb, ks, vs)
    }

    /// Attention of the step's queries (`q`: row r, head h at `r·q_stride + h·head_dim`)
    /// against layer `layer` of the cache; `out` rows `out_stride` apart. `splits` forces the
    /// number of key-range splits (1 = off) of both kernels; `None` picks it from the context
    /// length and the number of blocks, as in the module header. Long prefill chunks take the
    /// tensor-core kernel where it applies ([`AttnKernel::Auto`]).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &mut self,
        cache: &DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        q: &impl DevicePtr<f32>,
        q_stride: usize,
        p: &AttnParams,
        out: &mut impl DevicePtrMut<f32>,
        out_stride: usize,
        splits: Option<usize>,
    ) -> Result<()> {
        let kernel = AttnKernel::Auto;
        self.paged_attention_with(
            kernel, cache, layer, batch, q, q_stride, p, out, out_stride, splits,
        )
    }

    /// [`paged_attention`](Self::paged_attention) with the kernel for long prefill chunks
    /// chosen by `kernel`.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_with(
        &mut self,
        kernel: AttnKernel,
        cache: &DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        q: &impl DevicePtr<f32>,
        q_stride: usize,
        p: &AttnParams,
        out: &mut impl DevicePtrMut<f32>,
        out_stride: usize,
        splits: Option<usize>,
    ) -> Result<()> {
        let kv = attention_layer(cache, layer, batch, p)?;
        if batch.n_rows == 0 {
            return Ok(());
        }
        check_attention_rows(batch, p, q_stride, q.len(), out_stride, out.len())?;
        let (qp, op) = (self.ptr(q), self.ptr_mut(out));
        let mma = self.use_attn_mma(kernel, kv, batch)?;
        if mma {
            let bs = cache.block_size;
            self.launch_attn_mma(kv, bs, batch, qp, q_stride, p, op, out_stride, splits)?;
        }
        // The SIMT kernel takes the tiles the mma kernel does not (they come first).
        let simt_tiles = if mma { batch.short_tiles } else { batch.tiles };
        if simt_tiles == 0 {
            return Ok(());
        }
        let l = self.simt_launch(
            kv,
            cache.block_size,
            batch,
            simt_tiles,
            p,
            q_stride,
            out_stride,
            splits,
        );
        let (ws, done) = self.split_scratch(batch, p, &l)?;
        if l.mma {
            let bs = cache.block_size;
            return self.launch_dec_mma(
                kv,
                bs,
                batch,
                &l,
                (qp, q_stride),
                p,
                (op, out_stride),
                (ws, done),
                None,
                0,
            );
        }
        let (kc, vc) = (kv.k.ptr(self), kv.v.ptr(self));
        let (tab, seqs, _, tiles) = batch.ptrs(self);
        let (d, gh, t) = (kv.shape.head_dim, batch.gh, l.elem_name);
        let name = if l.decode {
            format!("attn_dec_{t}_{d}_{gh}")
        } else {
            format!("attn_{t}_{d}_{gh}")
        };
        let f = self.kernel(&name)?;
        let (args, z, cfg) = self.dec_cluster_launch(f, &l);
        launch!(self, f, cfg, cluster = z; qp, kc, vc, tab, seqs, tiles, op, ws, done, args)
    }

    /// The kernel, grid and arguments of the SIMT attention over the first `simt_tiles` tiles
    /// of `batch` (shapes checked by [`attention_layer`] and [`check_attention_rows`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn simt_launch(
        &self,
        kv: &DeviceLayerKv,
        block_size: usize,
        batch: &AttnBatch,
        simt_tiles: usize,
        p: &AttnParams,
        q_stride: usize,
        out_stride: usize,
        splits: Option<usize>,
    ) -> SimtLaunch {
        let (d, nkv, gh) = (kv.shape.head_dim, kv.shape.n_kv_heads, batch.gh);
        let group = p.n_heads / nkv;
        let hchunks = group / gh;
        let blocks = nkv * hchunks * simt_tiles;
        let keys = p
            .window
            .map_or(batch.max_context, |w| w.min(batch.max_context));
        let (elem_name, elem) = match kv.k {
            KvBuf::F32(_) => ("f32", 4),
            KvBuf::F16(_) => ("f16", 2),
        };
        let shape = self.step_shape(gh, group, d, elem);
        let plan = DecodePlan::new(&shape, keys, blocks, batch.qb == 1);
        let n_splits = splits
            .or(batch.forced_splits)
            .unwrap_or_else(|| plan.splits(&shape, keys, blocks))
            .clamp(1, plan.most_splits());
        let cluster = plan.decode
            && !plan.mma
            && (2..=DEC_CLUSTER_MAX).contains(&n_splits)
            && self.dec_clusters();
        let args = AttnArgs {
            n_heads: p.n_heads as i32,
            n_kv_heads: nkv as i32,
            block_size: block_size as i32,
            max_blocks: batch.max_blocks as i32,
            window: p.window.unwrap_or(0) as i32,
            n_splits: n_splits as i32,
            qb: batch.qb as i32,
            q_stride: q_stride as i32,
            out_stride: out_stride as i32,
            group: group as i32,
            hchunks: hchunks as i32,
            min_keys: plan.min_keys as i32,
            scale: p.scale,
            softcap: p.softcap.unwrap_or(0.0),
            cluster: i32::from(cluster),
        };
        // The tensor-core decode kernel serves a KV head's whole group in one CTA.
        let gx = if plan.mma { nkv } else { nkv * hchunks };
        SimtLaunch {
            decode: plan.decode,
            mma: plan.mma,
            elem_name,
            grid: (gx as u32, simt_tiles as u32, n_splits as u32),
            args,
            recv_slot_bytes: (gh * d + 2 * gh) as u32 * 4,
        }
    }

    /// Whether decode attention merges its splits in a thread block cluster: compute
    /// capability 9.0 on (distributed shared memory), unless `AFM_ATTN_CLUSTER=0`.
    fn dec_clusters(&self) -> bool {
        self.info().compute_capability.0 >= 9 && DEC_CLUSTER.on()
    }

    /// Merges decode attention's splits in thread block clusters (`on`, the default on
    /// compute capability 9.0 and later) or through global memory, for every context of the
    /// process, as `AFM_ATTN_CLUSTER=0` does (A/B benchmarks, tests).
    pub fn set_decode_attention_clusters(&self, on: bool) {
        DEC_CLUSTER.set(on);
    }

    /// The arguments, cluster size and launch configuration `f` (a decode kernel) launches
    /// `l` with: its splits as one cluster where `l` asks for it and the device can hold such
    /// a cluster, else none (the kernel then merges through `ws` and `done`). A cluster's
    /// last used split receives the others' partials in dynamic shared memory (attention.cu
    /// `dec_cluster_merge`): a slot for each other split.
    pub(super) fn dec_cluster_launch(
        &self,
        f: &CudaFunction,
        l: &SimtLaunch,
    ) -> (AttnArgs, u32, LaunchConfig) {
        let mut args = l.args;
        if args.cluster == 0 {
            return (args, 0, l.config());
        }
        let z = l.grid.2;
        let cfg = LaunchConfig {
            shared_mem_bytes: (z - 1) * l.recv_slot_bytes,
            ..l.config()
        };
        // The most any launch of `f` asks for (past 48 KB with the static stages needs the
        // opt-in), the same value every time, so graphs captured earlier stay valid.
        let most = (DEC_CLUSTER_MAX as u32 - 1) * l.recv_slot_bytes;
        let opted = self.stream().context().bind_to_thread().is_ok()
            && f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                most as i32,
            )
            .is_ok();
        if opted && super::cluster_fits(self.stream(), f, cfg, z) {
            (args, z, cfg)
        } else {
            args.cluster = 0;
            (args, 0, l.config())
        }
    }

    /// The device and layer facts of a step's kernel choice ([`DecodePlan`]).
    pub(super) fn step_shape(
        &self,
        gh: usize,
        group: usize,
        head_dim: usize,
        elem: usize,
    ) -> StepShape {
        let info = self.info();
        StepShape {
            sm_count: info.sm_count,
            tensor_cores: info.compute_capability.0 >= 8,
            gh,
            group,
            head_dim,
            elem,
        }
    }

    /// The split-K partials and the per-(head chunk, tile) counters of launch `l` (null
    /// pointers without splits).
    pub(super) fn split_scratch(
        &mut self,
        batch: &AttnBatch,
        p: &AttnParams,
        l: &SimtLaunch,
    ) -> Result<(u64, u64)> {
        let n_splits = l.grid.2 as usize;
        if n_splits <= 1 {
            return Ok((0, 0));
        }
        let n = batch.n_rows * p.n_heads * n_splits * (p.head_dim + 2);
        let stream = self.stream().clone();
        let counters = l.grid.0 as usize * l.grid.1 as usize;
        Ok((
            scratch(&stream, &mut self.ws.attn, n)?,
            scratch_zeroed(&stream, &mut self.ws.attn_done, counters)?,
        ))
    }
}

/// How the SIMT attention of a step launches ([`CudaContext::simt_launch`]).
pub(super) struct SimtLaunch {
    /// `attn_decode_impl` or `attn_dec_mma_impl` (else `attn_impl`).
    pub decode: bool,
    /// `attn_dec_mma_impl` (attention_mma.cu; grid x: KV heads).
    pub mma: bool,
    /// The cache's element type in kernel names.
    pub elem_name: &'static str,
    pub grid: (u32, u32, u32),
    pub args: AttnArgs,
    /// Bytes of one split's partial (O, M and L of the block's heads) in a cluster merge.
    pub recv_slot_bytes: u32,
}

impl SimtLaunch {
    pub fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: self.grid,
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// Layer `layer` of `cache`, checked against the attention's shape and the batch's head
/// grouping.
pub(super) fn attention_layer<'a>(
    cache: &'a DeviceKvCache,
    layer: usize,
    batch: &AttnBatch,
    p: &AttnParams,
) -> Result<&'a DeviceLayerKv> {
    let kv = cache.layers.get(layer).ok_or(CudaError::Shape {
        what: "KV layer index",
        got: layer,
        want: cache.layers.len(),
    })?;
    let (d, nkv) = (kv.shape.head_dim, kv.shape.n_kv_heads);
    super::check("attention head_dim (the cache's)", p.head_dim, d)?;
    if ![16, 32, 64, 128, 256, 512].contains(&d) {
        return Err(CudaError::Unsupported {
            what: "attention head_dim",
            value: d.to_string(),
            supported: "16, 32, 64, 128, 256, 512",
        });
    }
    let group = p.n_heads / nkv;
    // The batch's grouping is the smallest over all layers; it must fit this one.
    let gh = batch.gh;
    if !group.is_multiple_of(gh) || gh > heads_per_block(group, d) {
        return Err(CudaError::Shape {
            what: "heads per block (the batch was packed for)",
            got: gh,
            want: heads_per_block(group, d),
        });
    }
    Ok(kv)
}

/// The query and output buffers of a step of `batch` (at least one row).
fn check_attention_rows(
    batch: &AttnBatch,
    p: &AttnParams,
    q_stride: usize,
    q_len: usize,
    out_stride: usize,
    out_len: usize,
) -> Result<()> {
    let width = p.n_heads * p.head_dim;
    check_len("attention q_stride", q_stride, width)?;
    check_len("attention out_stride", out_stride, width)?;
    check_len(
        "attention queries",
        q_len,
        (batch.n_rows - 1) * q_stride + width,
    )?;
    check_len(
        "attention output",
        out_len,
        (batch.n_rows - 1) * out_stride + width,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel and split count of the decode shapes issue #9 measured (H200: 132 SMs),
    /// f16 KV, head_dim 128. Assumes AFM_ATTN_DECODE_OLD is not set.
    #[test]
    fn decode_plan_picks_kernel_and_splits() {
        let shape = |gh, group, head_dim, elem, tensor_cores| StepShape {
            sm_count: 132,
            tensor_cores,
            gh,
            group,
            head_dim,
            elem,
        };
        // The SIMT kernels (no tensor cores), group = gh.
        let simt = |gh| shape(gh, gh, 128, 2, false);
        let plan = |gh, keys, blocks| DecodePlan::new(&simt(gh), keys, blocks, true);
        let splits = |p: DecodePlan, keys, blocks| {
            split_count(132, blocks, p.max_splits(keys), p.target_per_sm)
        };
        // Qwen3-8B, batch 1 (8 KV heads, GH 4): the decode kernel, a split per 32 keys.
        let p = plan(4, 1024, 8);
        assert!(p.decode);
        assert_eq!(splits(p, 140, 8), 5);
        assert_eq!(splits(p, 512, 8), 16);
        assert_eq!(splits(p, 1024, 8), 16);
        assert_eq!(splits(plan(4, 16384, 8), 16384, 8), MAX_SPLITS);
        // Qwen3-0.6B (GH 2) at 64 streams: decode kernel up to the 1k class, attn_impl above.
        // Up to the 1k class fewer splits (2 blocks per SM, not 12): 512 blocks need none.
        let p = plan(2, 1024, 512);
        assert!(p.decode);
        assert_eq!(splits(p, 1024, 512), 1);
        assert_eq!(splits(p, 1024, 128), 3);
        assert_eq!(splits(plan(4, 2048, 512), 2048, 512), 4);
        let p = plan(2, 16384, 512);
        assert!(!p.decode);
        assert_eq!(splits(p, 16384, 512), 2);
        // ... but batch 1 keeps the decode kernel at any context.
        assert!(plan(2, 16384, 8).decode);
        // No decode kernel: f32 caches, head_dim 512, prefill tiles.
        let no_tc = |gh, d, elem| shape(gh, gh, d, elem, false);
        assert!(!DecodePlan::new(&no_tc(2, 128, 4), 1024, 8, true).decode);
        assert!(!DecodePlan::new(&no_tc(1, 512, 2), 1024, 8, true).decode);
        assert!(!DecodePlan::new(&no_tc(2, 128, 2), 1024, 8, false).decode);
    }

    /// Decode steps with a SIMT block per SM or more (per KV head) take the tensor-core
    /// decode kernel on an sm_80+ device, one split while they fill the device. Assumes
    /// AFM_ATTN_DEC_MMA is not set to 0.
    #[test]
    fn decode_plan_takes_tensor_cores_for_many_sequences() {
        // Qwen3-0.6B (16 heads over 8 KV heads, GH 2) and Qwen3-8B (32 over 8, GH 4).
        let s06 = StepShape {
            sm_count: 132,
            tensor_cores: true,
            gh: 2,
            group: 2,
            head_dim: 128,
            elem: 2,
        };
        let s8 = StepShape {
            gh: 4,
            group: 4,
            ..s06
        };
        for s in [s06, s8] {
            let p = DecodePlan::new(&s, 1024, 8 * 64, true);
            assert!(p.mma && p.decode);
            assert_eq!(p.splits(&s, 1024, 8 * 64), 1);
            // 17 streams: 136 CTAs; two per SM need two splits where the keys allow.
            let p = DecodePlan::new(&s, 1024, 8 * 17, true);
            assert!(p.mma);
            assert_eq!(p.splits(&s, 1024, 8 * 17), 2);
            assert_eq!(p.splits(&s, 64, 8 * 17), 1);
            // 16 streams (128 blocks) and batch 1: the SIMT decode kernel.
            assert!(!DecodePlan::new(&s, 1024, 8 * 16, true).mma);
            assert!(!DecodePlan::new(&s, 1024, 8, true).mma);
            // Prefill tiles, an f32 cache, no tensor cores: never.
            assert!(!DecodePlan::new(&s, 1024, 8 * 64, false).mma);
            assert!(!DecodePlan::new(&StepShape { elem: 4, ..s }, 1024, 512, true).mma);
            let old = StepShape {
                tensor_cores: false,
                ..s
            };
            assert!(!DecodePlan::new(&old, 1024, 512, true).mma);
        }
        // Gemma-style groups of 8 with GH 4 (two SIMT blocks per KV head) count KV heads.
        let g8 = StepShape {
            gh: 4,
            group: 8,
            head_dim: 256,
            ..s06
        };
        assert!(!DecodePlan::new(&g8, 1024, 2 * 2 * 32, true).mma);
        assert!(DecodePlan::new(&g8, 1024, 2 * 2 * 66, true).mma);
        // Long 16k contexts at 64 streams too (GH 2 would otherwise take attn_impl).
        assert!(DecodePlan::new(&s06, 16384, 512, true).mma);
        // Head dims without an instantiation, groups past one tile's 16 rows.
        assert!(
            !DecodePlan::new(
                &StepShape {
                    head_dim: 512,
                    gh: 1,
                    ..s06
                },
                1024,
                512,
                true
            )
            .mma
        );
        assert!(
            !DecodePlan::new(
                &StepShape {
                    group: 32,
                    gh: 4,
                    ..s06
                },
                1024,
                8 * 512,
                true
            )
            .mma
        );
    }

    #[test]
    fn decode_kernel_names_match_the_instantiations() {
        let names = decode_kernel_names();
        assert_eq!(names.len(), 16);
        assert!(names.contains(&"attn_dec_f16_128_4".to_string()));
        assert!(names.contains(&"attn_dec_pro_f16_64_2".to_string()));
        assert!(!names.contains(&"attn_dec_f16_256_4".to_string()));
        assert!(!names.contains(&"attn_dec_pro_f16_256_4".to_string()));
    }
}
