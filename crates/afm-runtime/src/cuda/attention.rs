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
//! built for latency: block tables read before the PDL wait, K/V through a cp.async ring,
//! splits of at least [`DECODE_MIN_KEYS`] applied to each context (so a CUDA graph's split
//! count, baked for its context class, suits shorter contexts too), one-pass merge.
//! [`DecodePlan`] says when (GH <= 2 over long contexts at many streams keeps `attn_impl`);
//! `AFM_ATTN_DECODE_OLD=1` sends every decode step to `attn_impl` (A/B).
//!
//! [`CudaContext::attn_prologue`] is the step before attention in one launch: per-head Q/K
//! RMSNorm, RoPE and the K/V write.

use std::sync::atomic::{AtomicU8, Ordering};

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig};
use half::f16;

use super::attention_mma::{step_tiles, AttnKernel};
use super::context::{scratch, scratch_zeroed};
use super::{check_len, launch, Buf, CudaContext, CudaError, Result, RopeTable};
use crate::attention::{AttnParams, AttnSeq};
use crate::kv_store::{KvDtype, LayerKvShape};

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
/// Above this many keys, with at least one block per multiprocessor before splitting, decode
/// steps with GH <= 2 keep `attn_impl`: there it streams faster (H200, 0.6B heads, 64
/// streams at 16k: 1255 us against 1367; at 1k 96 against 98; below, the decode kernel wins).
const DECODE_MAX_KEYS_GH2_WIDE: usize = 1024;
/// `MAX_SPLITS` in attention.cu.
const MAX_SPLITS: usize = 128;

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

/// Heads per block for a step over every layer of `cache`: the smallest any layer allows,
/// which divides every layer's group too (layers may differ in KV heads and head_dim, as
/// Gemma 4's sliding and global layers do), so one packing serves them all.
fn batch_heads_per_block(cache: &DeviceKvCache, n_heads: usize) -> Result<usize> {
    if cache.layers.is_empty() {
        return Err(CudaError::Shape {
            what: "KV cache layers",
            got: 0,
            want: 1,
        });
    }
    let mut gh = 4;
    for l in &cache.layers {
        let nkv = l.shape.n_kv_heads;
        if nkv == 0 || !n_heads.is_multiple_of(nkv) {
            return Err(CudaError::Shape {
                what: "query heads (a multiple of the KV heads)",
                got: n_heads,
                want: nkv,
            });
        }
        gh = gh.min(heads_per_block(n_heads / nkv, l.shape.head_dim));
    }
    Ok(gh)
}

impl AttnBatch {
    /// Packs `seqs` for layers shaped like `cache.layers[0]` with `n_heads` query heads.
    /// Checks that the rows are contiguous from 0, that every table covers its positions and
    /// that block ids exist in `cache`.
    pub fn new(
        ctx: &CudaContext,
        cache: &DeviceKvCache,
        seqs: &[AttnSeq],
        n_heads: usize,
    ) -> Result<Self> {
        let gh = batch_heads_per_block(cache, n_heads)?;
        let bs = cache.block_size;
        let decode = seqs.iter().all(|s| s.len <= 1);
        let qb = if decode { 1 } else { 16 / gh };
        let max_blocks = seqs
            .iter()
            .map(|s| (s.pos0 + s.len).div_ceil(bs))
            .max()
            .unwrap_or(0)
            .max(1);
        let mut tables = vec![0i32; seqs.len() * max_blocks];
        let (mut info, mut row_seq) = (Vec::new(), Vec::new());
        let mut max_context = 0;
        for (i, s) in seqs.iter().enumerate() {
            check(
                "sequence row0 (rows follow each other)",
                s.row0,
                row_seq.len(),
            )?;
            let need = (s.pos0 + s.len).div_ceil(bs);
            check_len("block table length", s.block_table.len(), need)?;
            for (slot, &b) in tables[i * max_blocks..]
                .iter_mut()
                .zip(&s.block_table[..need])
            {
                if b as usize >= cache.num_blocks {
                    return Err(CudaError::Shape {
                        what: "block id (below the number of blocks)",
                        got: b as usize,
                        want: cache.num_blocks,
                    });
                }
                *slot = b as i32;
            }
            info.extend([s.row0 as i32, s.len as i32, s.pos0 as i32, 0]);
            row_seq.extend(std::iter::repeat_n(i as i32, s.len));
            max_context = max_context.max(s.pos0 + s.len);
        }
        let n_rows = row_seq.len();
        let (off_seqs, off_rows) = (tables.len(), tables.len() + info.len());
        let off_tiles = off_rows + row_seq.len();
        let t = step_tiles(seqs.iter().map(|s| s.len), qb);
        let (n_tiles, mma_tiles) = (t.simt.len() / 2, t.mma.len() / 2);
        let off_mma = off_tiles + t.simt.len();
        if n_tiles.max(mma_tiles) > 65535 {
            return Err(CudaError::Shape {
                what: "attention query tiles in one step (at most 65535)",
                got: n_tiles.max(mma_tiles),
                want: 65535,
            });
        }
        let mut meta = tables;
        meta.extend(info);
        meta.extend(row_seq);
        meta.extend(t.simt);
        meta.extend(t.mma);
        Ok(Self {
            meta: Buf::Owned(ctx.upload(&meta)?),
            forced_splits: None,
            n_seqs: seqs.len(),
            n_rows,
            max_blocks,
            tiles: n_tiles,
            short_tiles: t.short,
            mma_tiles,
            qb,
            gh,
            max_context,
            off_seqs,
            off_rows,
            off_tiles,
            off_mma,
        })
    }

    pub fn n_rows(&self) -> usize {
        self.n_rows
    }

    pub fn n_seqs(&self) -> usize {
        self.n_seqs
    }

    /// `i32`s a fixed decode batch of `bucket` sequences and `max_blocks` table entries each
    /// takes (see [`pack_fixed_decode`](Self::pack_fixed_decode)).
    pub fn fixed_decode_len(bucket: usize, max_blocks: usize) -> usize {
        bucket * max_blocks + 7 * bucket
    }

    /// The metadata of a decode step (one query per sequence) in the fixed layout CUDA graphs
    /// replay: `bucket` sequences, each table `max_blocks` long; sequences past `seqs.len()`
    /// are padding (length 0: no KV write, no attention).
    pub fn pack_fixed_decode(
        seqs: &[AttnSeq],
        bucket: usize,
        max_blocks: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Vec<i32>> {
        check_len("graph bucket (sequences it holds)", bucket, seqs.len())?;
        let mut meta = vec![0i32; Self::fixed_decode_len(bucket, max_blocks)];
        let (tables, rest) = meta.split_at_mut(bucket * max_blocks);
        let (info, rest) = rest.split_at_mut(4 * bucket);
        let (row_seq, tiles) = rest.split_at_mut(bucket);
        for i in 0..bucket {
            row_seq[i] = i as i32;
            tiles[2 * i] = i as i32;
            info[4 * i] = i as i32;
        }
        for (i, s) in seqs.iter().enumerate() {
            check("decode sequence length", s.len, 1)?;
            let need = (s.pos0 + 1).div_ceil(block_size);
            if need > max_blocks {
                return Err(CudaError::Shape {
                    what: "blocks of a graph-decoded sequence (its context class)",
                    got: need,
                    want: max_blocks,
                });
            }
            check_len("block table length", s.block_table.len(), need)?;
            for (slot, &b) in tables[i * max_blocks..]
                .iter_mut()
                .zip(&s.block_table[..need])
            {
                if b as usize >= num_blocks {
                    return Err(CudaError::Shape {
                        what: "block id (below the number of blocks)",
                        got: b as usize,
                        want: num_blocks,
                    });
                }
                *slot = b as i32;
            }
            info[4 * i + 1] = 1;
            info[4 * i + 2] = s.pos0 as i32;
        }
        Ok(meta)
    }

    /// A decode batch over metadata at device address `meta` (filled by
    /// [`pack_fixed_decode`](Self::pack_fixed_decode) before each replay), with the split
    /// count fixed for contexts up to `max_context`.
    ///
    /// # Safety
    /// `meta` must hold [`fixed_decode_len`](Self::fixed_decode_len) `i32`s that outlive the
    /// batch.
    pub unsafe fn fixed_decode(
        ctx: &CudaContext,
        cache: &DeviceKvCache,
        meta: u64,
        bucket: usize,
        max_blocks: usize,
        n_heads: usize,
    ) -> Result<Self> {
        let len = Self::fixed_decode_len(bucket, max_blocks);
        // SAFETY: the caller's promise about `meta`.
        let meta = unsafe { Buf::borrowed(ctx, meta, len) };
        Self::fixed_decode_over(ctx, cache, meta, bucket, max_blocks, n_heads)
    }

    /// [`fixed_decode`](Self::fixed_decode) over metadata it owns (`meta`, packed by
    /// [`pack_fixed_decode`](Self::pack_fixed_decode) and uploaded): the same batch a CUDA
    /// graph replays, for tests and benchmarks.
    pub fn fixed_decode_owned(
        ctx: &CudaContext,
        cache: &DeviceKvCache,
        meta: CudaSlice<i32>,
        bucket: usize,
        max_blocks: usize,
        n_heads: usize,
    ) -> Result<Self> {
        check(
            "fixed decode metadata length",
            meta.len(),
            Self::fixed_decode_len(bucket, max_blocks),
        )?;
        Self::fixed_decode_over(ctx, cache, Buf::Owned(meta), bucket, max_blocks, n_heads)
    }

    fn fixed_decode_over(
        ctx: &CudaContext,
        cache: &DeviceKvCache,
        meta: Buf<i32>,
        bucket: usize,
        max_blocks: usize,
        n_heads: usize,
    ) -> Result<Self> {
        let shape = cache
            .layers
            .first()
            .map(|l| l.shape)
            .ok_or(CudaError::Shape {
                what: "KV cache layers",
                got: 0,
                want: 1,
            })?;
        if shape.n_kv_heads == 0 || !n_heads.is_multiple_of(shape.n_kv_heads) {
            return Err(CudaError::Shape {
                what: "query heads (a multiple of the KV heads)",
                got: n_heads,
                want: shape.n_kv_heads,
            });
        }
        let group = n_heads / shape.n_kv_heads;
        let gh = batch_heads_per_block(cache, n_heads)?;
        let max_context = max_blocks * cache.block_size;
        let blocks = shape.n_kv_heads * (group / gh) * bucket;
        let f16 = cache.layers.iter().all(|l| matches!(l.dtype, KvDtype::F16));
        let elem = if f16 { 2 } else { 4 };
        let sm = ctx.info().sm_count;
        let plan = DecodePlan::new(sm, gh, shape.head_dim, elem, max_context, blocks, true);
        let splits = split_count(sm, blocks, plan.max_splits(max_context), plan.target_per_sm);
        let off_seqs = bucket * max_blocks;
        Ok(Self {
            meta,
            forced_splits: Some(splits),
            n_seqs: bucket,
            n_rows: bucket,
            max_blocks,
            tiles: bucket,
            short_tiles: bucket,
            mma_tiles: 0,
            qb: 1,
            gh,
            max_context,
            off_seqs,
            off_rows: off_seqs + 4 * bucket,
            off_tiles: off_seqs + 5 * bucket,
            off_mma: off_seqs + 7 * bucket,
        })
    }

    /// Table entries per sequence in the packed tables.
    pub(super) fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    pub(super) fn max_context(&self) -> usize {
        self.max_context
    }

    /// Tiles the mma kernel would take (0 when no sequence is long enough).
    pub fn mma_tiles(&self) -> usize {
        self.mma_tiles
    }

    pub(super) fn mma_tiles_ptr(&self, ctx: &CudaContext) -> u64 {
        ctx.ptr(&*self.meta) + 4 * self.off_mma as u64
    }

    pub(super) fn ptrs(&self, ctx: &CudaContext) -> (u64, u64, u64, u64) {
        let base = ctx.ptr(&*self.meta);
        let at = |o: usize| base + 4 * o as u64;
        (
            base,
            at(self.off_seqs),
            at(self.off_rows),
            at(self.off_tiles),
        )
    }
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

/// Which kernel decode steps take, process-wide: 0 not read yet, 1 the decode kernel, 2
/// `attn_impl` (the A/B switch: `AFM_ATTN_DECODE_OLD=1`, or
/// [`CudaContext::set_decode_attention_old`]).
static DECODE_KERNEL: AtomicU8 = AtomicU8::new(0);

fn decode_old() -> bool {
    match DECODE_KERNEL.load(Ordering::Relaxed) {
        0 => {
            let old = std::env::var("AFM_ATTN_DECODE_OLD").is_ok_and(|v| v == "1");
            DECODE_KERNEL.store(if old { 2 } else { 1 }, Ordering::Relaxed);
            old
        }
        k => k == 2,
    }
}

/// Which kernel a step's attention takes, and the split rule that goes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DecodePlan {
    /// `attn_decode_impl` (else `attn_impl`).
    decode: bool,
    min_keys: usize,
    target_per_sm: usize,
}

impl DecodePlan {
    /// For a step of `blocks` attention blocks (before splitting) over at most `keys` keys:
    /// decode steps (`one_query`) take the decode kernel where it has the shape, is not
    /// switched off, and is the faster (see [`DECODE_MAX_KEYS_GH2_WIDE`]).
    fn new(
        sm_count: usize,
        gh: usize,
        head_dim: usize,
        elem: usize,
        keys: usize,
        blocks: usize,
        one_query: bool,
    ) -> Self {
        let wide_long_gh2 = gh <= 2 && keys > DECODE_MAX_KEYS_GH2_WIDE && blocks >= sm_count;
        let decode =
            one_query && !decode_old() && has_decode_kernel(head_dim, elem, gh) && !wide_long_gh2;
        if decode {
            Self {
                decode,
                min_keys: DECODE_MIN_KEYS,
                target_per_sm: DECODE_TARGET_BLOCKS_PER_SM,
            }
        } else {
            Self {
                decode,
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
}

/// Whether attention.cu has a decode kernel for `head_dim` over KV elements of `elem` bytes
/// and `gh` heads per block: f16 caches of head_dim 64, 128 and 256 (the kernel takes rows of
/// 32 to 512 bytes; only these are built, to bound compile time).
fn has_decode_kernel(head_dim: usize, elem: usize, gh: usize) -> bool {
    // heads_per_block(gh, d) == gh: gh is within the limit for head_dim.
    elem == 2 && matches!(head_dim, 64 | 128 | 256) && heads_per_block(gh, head_dim) == gh
}

/// Entry points of the decode kernel (`attn_dec_f16_{head_dim}_{heads per block}`).
pub(super) fn decode_kernel_names() -> Vec<String> {
    let mut v = Vec::new();

    for d in [64, 128, 256] {
        for gh in [1, 2, 4] {
            if has_decode_kernel(d, 2, gh) {
                v.push(format!("attn_dec_f16_{d}_{gh}"));
            }
        }
    }
    v
}

/// Mirror of `AttnArgs` in attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnArgs {
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
        DECODE_KERNEL.store(if old { 2 } else { 1 }, Ordering::Relaxed);
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
        if batch.n_rows == 0 {
            return Ok(());
        }
        check_len("attention q_stride", q_stride, p.n_heads * d)?;
        check_len("attention out_stride", out_stride, p.n_heads * d)?;
        check_len(
            "attention queries",
            q.len(),
            (batch.n_rows - 1) * q_stride + p.n_heads * d,
        )?;
        check_len(
            "attention output",
            out.len(),
            (batch.n_rows - 1) * out_stride + p.n_heads * d,
        )?;

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
        let hchunks = group / gh;
        let blocks = nkv * hchunks * simt_tiles;
        let keys = p
            .window
            .map_or(batch.max_context, |w| w.min(batch.max_context));
        let (t, elem) = match kv.k {
            KvBuf::F32(_) => ("f32", 4),
            KvBuf::F16(_) => ("f16", 2),
        };
        let sm = self.info().sm_count;
        let plan = DecodePlan::new(sm, gh, d, elem, keys, blocks, batch.qb == 1);
        let (decode, min_keys) = (plan.decode, plan.min_keys);
        let n_splits = splits
            .or(batch.forced_splits)
            .unwrap_or_else(|| split_count(sm, blocks, plan.max_splits(keys), plan.target_per_sm))
            .clamp(1, MAX_SPLITS);
        let args = AttnArgs {
            n_heads: p.n_heads as i32,
            n_kv_heads: nkv as i32,
            block_size: cache.block_size as i32,
            max_blocks: batch.max_blocks as i32,
            window: p.window.unwrap_or(0) as i32,
            n_splits: n_splits as i32,
            qb: batch.qb as i32,
            q_stride: q_stride as i32,
            out_stride: out_stride as i32,
            group: group as i32,
            hchunks: hchunks as i32,
            min_keys: min_keys as i32,
            scale: p.scale,
            softcap: p.softcap.unwrap_or(0.0),
        };
        let grid = ((nkv * hchunks) as u32, simt_tiles as u32, n_splits as u32);
        let (ws, done) = if n_splits > 1 {
            let n = batch.n_rows * p.n_heads * n_splits * (d + 2);
            let stream = self.stream().clone();
            let counters = grid.0 as usize * grid.1 as usize;
            (
                scratch(&stream, &mut self.ws.attn, n)?,
                scratch_zeroed(&stream, &mut self.ws.attn_done, counters)?,
            )
        } else {
            (0, 0)
        };
        let (kc, vc) = (kv.k.ptr(self), kv.v.ptr(self));
        let (tab, seqs, _, tiles) = batch.ptrs(self);
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = if decode {
            format!("attn_dec_{t}_{d}_{gh}")
        } else {
            format!("attn_{t}_{d}_{gh}")
        };
        let f = self.kernel(&name)?;
        launch!(self, f, cfg; qp, kc, vc, tab, seqs, tiles, op, ws, done, args)
    }

    /// The attention prologue of layer `layer` in one launch: each `head_dim` head of `q`
    /// (`[rows][n_heads · head_dim]`) and of `k` (`[rows][n_kv_heads · head_dim]`) RMS-normed
    /// with `norms` (one head's weights for q, one for k, and epsilon) when given, then rotated
    /// by `table` at `positions[row]`, in place; then k's and `v`'s rows stored in the cache
    /// as [`kv_write`](Self::kv_write) stores them. The same values as `rms_norm_in_place`,
    /// `rope` and `kv_write` in turn. Positions at or beyond `table.max_pos()` are left
    /// unrotated: callers check them.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prologue(
        &self,
        cache: &mut DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        table: &RopeTable,
        positions: &impl DevicePtr<i32>,
        q: &mut impl DevicePtrMut<f32>,
        n_heads: usize,
        k: &mut impl DevicePtrMut<f32>,
        v: &impl DevicePtr<f32>,
        norms: Option<(&CudaView<'_, f32>, &CudaView<'_, f32>, f32)>,
    ) -> Result<()> {
        let kv = cache.layers.get(layer).ok_or(CudaError::Shape {
            what: "KV layer index",
            got: layer,
            want: cache.layers.len(),
        })?;
        let (d, nkv, n) = (kv.shape.head_dim, kv.shape.n_kv_heads, batch.n_rows);
        if d == 0 || d > PROLOGUE_MAX_HEAD_DIM {
            return Err(CudaError::Unsupported {
                what: "attention prologue head_dim",
                value: d.to_string(),
                supported: "1 to 512",
            });
        }
        if table.dims() > d {
            return Err(CudaError::Shape {
                what: "rope head_dim (at least the rotated dims)",
                got: d,
                want: table.dims(),
            });
        }
        if n == 0 {
            return Ok(());
        }
        check("attention prologue queries", q.len(), n * n_heads * d)?;
        check("attention prologue keys", k.len(), n * nkv * d)?;
        check("attention prologue values", v.len(), n * nkv * d)?;
        check_len("attention prologue positions", positions.len(), n)?;
        let (qw, kw, eps) = match norms {
            Some((qn, kn, eps)) => {
                check("attention prologue q_norm weights (head_dim)", qn.len(), d)?;
                check("attention prologue k_norm weights (head_dim)", kn.len(), d)?;
                (self.ptr(qn), self.ptr(kn), eps)
            }
            None => (0, 0, 0.0),
        };
        let (cs, neox) = table.kernel_table(self);
        let args = PrologueArgs {
            n_heads: n_heads as i32,
            n_kv_heads: nkv as i32,
            d: d as i32,
            dims: table.dims() as i32,
            neox: neox as i32,
            max_pos: table.max_pos() as i32,
            block_size: cache.block_size as i32,
            max_blocks: batch.max_blocks as i32,
            q_stride: (n_heads * d) as i32,
            k_stride: (nkv * d) as i32,
            v_stride: (nkv * d) as i32,
            eps,
            v4: 0,
        };
        let (qp, kp, vp) = (self.ptr_mut(q), self.ptr_mut(k), self.ptr(v));
        // The per-head norms take rms_norm_warp's float4 path where it would (same bits).
        let v4 = |x: u64, w: u64| {
            i32::from(d.is_multiple_of(4) && x.is_multiple_of(16) && w.is_multiple_of(16))
        };
        let args = PrologueArgs {
            v4: v4(qp, qw) | (v4(kp, kw) << 1),
            ..args
        };
        let (kc, vc, pp) = (kv.k.ptr(self), kv.v.ptr(self), self.ptr(positions));
        let (tab, seqs, rows, _) = batch.ptrs(self);
        let groups = (n_heads + nkv).div_ceil(PROLOGUE_WARPS);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, groups as u32, 1),
            block_dim: (32 * PROLOGUE_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match kv.k {
            KvBuf::F32(_) => "attn_prologue_f32",
            KvBuf::F16(_) => "attn_prologue_f16",
        };
        let f = self.kernel(name)?;
        launch!(self, f, cfg; qp, kp, vp, kc, vc, qw, kw, pp, cs, tab, seqs, rows, args)
    }
}

/// `PRO_WARPS` and `PRO_MAX_D` in attention.cu: heads per prologue block, widest head.
const PROLOGUE_WARPS: usize = 8;
const PROLOGUE_MAX_HEAD_DIM: usize = 512;

/// Mirror of `PrologueArgs` in attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct PrologueArgs {
    n_heads: i32,
    n_kv_heads: i32,
    d: i32,
    dims: i32,
    neox: i32,
    max_pos: i32,
    block_size: i32,
    max_blocks: i32,
    q_stride: i32,
    k_stride: i32,
    v_stride: i32,
    eps: f32,
    v4: i32,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct.
unsafe impl cudarc::driver::DeviceRepr for PrologueArgs {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel and split count of the decode shapes issue #9 measured (H200: 132 SMs),
    /// f16 KV, head_dim 128. Assumes AFM_ATTN_DECODE_OLD is not set.
    #[test]
    fn decode_plan_picks_kernel_and_splits() {
        let plan = |gh, keys, blocks| DecodePlan::new(132, gh, 128, 2, keys, blocks, true);
        let splits = |p: DecodePlan, keys, blocks| {
            split_count(132, blocks, p.max_splits(keys), p.target_per_sm)
        };
        // Qwen3-8B, batch 1 (8 KV heads, GH 4): the decode kernel, a split per 32 keys.
        let p = plan(4, 1024, 8);
        assert!(p.decode);
        assert_eq!(splits(p, 140, 8), 5);
        assert_eq!(splits(p, 512, 8), 16);
        assert_eq!(splits(p, 1024, 8), 16);
        assert_eq!(splits(p, 16384, 8), MAX_SPLITS);
        // Qwen3-0.6B (GH 2) at 64 streams: decode kernel up to the 1k class, attn_impl above.
        let p = plan(2, 1024, 512);
        assert!(p.decode);
        assert_eq!(splits(p, 1024, 512), 4);
        let p = plan(2, 16384, 512);
        assert!(!p.decode);
        assert_eq!(splits(p, 16384, 512), 2);
        // ... but batch 1 keeps the decode kernel at any context.
        assert!(plan(2, 16384, 8).decode);
        // No decode kernel: f32 caches, head_dim 512, prefill tiles.
        assert!(!DecodePlan::new(132, 2, 128, 4, 1024, 8, true).decode);
        assert!(!DecodePlan::new(132, 1, 512, 2, 1024, 8, true).decode);
        assert!(!DecodePlan::new(132, 2, 128, 2, 1024, 8, false).decode);
    }

    #[test]
    fn decode_kernel_names_match_the_instantiations() {
        let names = decode_kernel_names();
        assert_eq!(names.len(), 8);
        assert!(names.contains(&"attn_dec_f16_128_4".to_string()));
        assert!(!names.contains(&"attn_dec_f16_256_4".to_string()));
    }
}
