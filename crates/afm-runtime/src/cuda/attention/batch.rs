//! Packing a step's sequences for the device: [`AttnBatch`] (see the parent module header).

use cudarc::driver::CudaSlice;

use super::{
    check, check_len, heads_per_block, step_tiles, AttnBatch, AttnSeq, Buf, CudaContext, CudaError,
    DecodePlan, DeviceKvCache, KvDtype, Result,
};

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
        let step = ctx.step_shape(gh, group, shape.head_dim, elem);
        let plan = DecodePlan::new(&step, max_context, blocks, true);
        let splits = plan.splits(&step, max_context, blocks);
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
    pub(in crate::cuda) fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    pub(in crate::cuda) fn max_context(&self) -> usize {
        self.max_context
    }

    /// Tiles the mma kernel would take (0 when no sequence is long enough).
    pub fn mma_tiles(&self) -> usize {
        self.mma_tiles
    }

    pub(in crate::cuda) fn mma_tiles_ptr(&self, ctx: &CudaContext) -> u64 {
        ctx.ptr(&*self.meta) + 4 * self.off_mma as u64
    }

    pub(in crate::cuda) fn ptrs(&self, ctx: &CudaContext) -> (u64, u64, u64, u64) {
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
