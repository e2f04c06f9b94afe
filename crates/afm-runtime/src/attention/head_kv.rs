//! Where one (sequence, KV head)'s keys and values come from for `paged_attention`: the
//! [`Rows`] view the kernels read (f32 rows as read, or an f16 cache's blocks in place),
//! [`HeadKv`] with the layouts each summation order wants, and the per-thread [`KvScratch`]
//! they are copied into. The kernels themselves are in `llama_order`.

use half::f16;

use super::llama_order::KEY_TILE;
use super::AttnSeq;
use crate::kv_store::{KvDtype, LayerKv};

/// One (sequence, KV head)'s keys and values for positions `base..ctx`: values as read
/// (`values[j][d]`), and keys laid out for the order the chunk is summed in
/// (`single_order`): as read, `keys[j][d]`, and for one new token (32 lanes) with a head size
/// that is not a multiple of 8 also transposed, `keys_t[c][j]` (`stride` ≥ positions, a
/// multiple of 16, zero-padded).
pub(super) struct HeadKv<'a> {
    pub(super) base: usize,
    pub(super) stride: usize,
    pub(super) keys_t: &'a [f32],
    pub(super) keys: &'a [f32],
    pub(super) values: &'a [f32],
    /// One new token, a head size that is a multiple of 8 and an f16 cache: keys and values
    /// read straight from the cache's blocks (`keys`, `values` then empty).
    pub(super) half: Option<(HalfRows<'a>, HalfRows<'a>)>,
}

/// Rows `j` (positions `base + j`) of `d` values. A row is looked up once and then read eight
/// columns at a time, so per-row address arithmetic stays out of the column loops.
pub(super) trait Rows {
    type Row<'r>: Row
    where
        Self: 'r;
    fn len(&self) -> usize;
    fn row(&self, j: usize) -> Self::Row<'_>;
}

/// One row's values, read as f32.
pub(super) trait Row: Copy {
    /// Columns `c..c + 8`; `SIMD`: the caller has AVX2 and F16C.
    fn at8<const SIMD: bool>(self, c: usize) -> [f32; 8];
    /// Column `c`.
    fn at(self, c: usize) -> f32;
}

impl Row for &[f32] {
    #[inline(always)]
    fn at8<const SIMD: bool>(self, c: usize) -> [f32; 8] {
        let mut o = [0f32; 8];
        o.copy_from_slice(&self[c..c + 8]);
        o
    }

    fn at(self, c: usize) -> f32 {
        self[c]
    }
}

impl Row for &[f16] {
    #[inline(always)]
    fn at8<const SIMD: bool>(self, c: usize) -> [f32; 8] {
        let src = &self[c..c + 8];
        #[cfg(target_arch = "x86_64")]
        if SIMD {
            use std::arch::x86_64::*;
            // SAFETY: `src` holds 8 f16 (16 bytes); `SIMD` callers run with F16C enabled.
            return unsafe {
                let h = _mm_loadu_si128(src.as_ptr() as *const __m128i);
                std::mem::transmute::<__m256, [f32; 8]>(_mm256_cvtph_ps(h))
            };
        }
        std::array::from_fn(|l| src[l].to_f32())
    }

    fn at(self, c: usize) -> f32 {
        self[c].to_f32()
    }
}

/// f32 rows stored contiguously, `[j][d]`.
pub(super) struct F32Rows<'a> {
    pub(super) data: &'a [f32],
    pub(super) d: usize,
}

impl Rows for F32Rows<'_> {
    type Row<'r>
        = &'r [f32]
    where
        Self: 'r;

    #[inline(always)]
    fn len(&self) -> usize {
        self.data.len() / self.d.max(1)
    }

    #[inline(always)]
    fn row(&self, j: usize) -> &[f32] {
        &self.data[j * self.d..(j + 1) * self.d]
    }
}

/// One KV head's f16 rows across a sequence's blocks: row `j` is slot `(first + j) % bs` of
/// `blocks[(first + j) / bs]`, by a shift and a mask when `bs` is a power of two (a `div` per
/// row was a large share of decode attention). Widening f16 to f32 is exact, so sums over
/// these rows are the same as over a converted copy.
pub(super) struct HalfRows<'a> {
    blocks: Vec<&'a [f16]>,
    bs: usize,
    /// `log2(bs)` when `bs` is a power of two.
    shift: Option<u32>,
    d: usize,
    first: usize,
    n: usize,
}

impl HalfRows<'_> {
    /// The address of every row, walking the blocks (no per-row index arithmetic).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn row_ptrs(&self) -> Vec<*const f16> {
        let mut out = Vec::with_capacity(self.n);
        let mut slot = self.first % self.bs;
        for block in &self.blocks[self.first / self.bs..] {
            let end = self.bs.min(slot + self.n - out.len());
            // One bounds check per block instead of a slice per row (~9% of a cached decode
            // attention call went to the per-row checks).
            assert!(
                block.len() >= end * self.d,
                "KV block shorter than its rows"
            );
            let base = block.as_ptr();
            // SAFETY: `slot·d < end·d ≤ block.len()`, checked above.
            out.extend((slot..end).map(|s| unsafe { base.add(s * self.d) }));
            slot = 0;
            if out.len() == self.n {
                break;
            }
        }
        out
    }
}

impl Rows for HalfRows<'_> {
    type Row<'r>
        = &'r [f16]
    where
        Self: 'r;

    #[inline(always)]
    fn len(&self) -> usize {
        self.n
    }

    #[inline(always)]
    fn row(&self, j: usize) -> &[f16] {
        let p = self.first + j;
        let (b, slot) = match self.shift {
            Some(shift) => (p >> shift, p & (self.bs - 1)),
            None => (p / self.bs, p % self.bs),
        };
        &self.blocks[b][slot * self.d..(slot + 1) * self.d]
    }
}

/// Buffers a [`HeadKv`] is read into; they only grow, so a thread reuses them step after step
/// (freeing them let the allocator hand pages back and fault them in again, and zero-filling
/// fresh ones was ~5% of a decode step).
#[derive(Default)]
pub(super) struct KvScratch {
    keys_t: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// `v[..n]`, growing `v` first if it is shorter (old contents are left to be overwritten).
fn grown(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Whether a chunk of `len` new tokens is summed in `ggml_vec_dot_f16`'s 32-lane order (one
/// new token, or a head size tinyBLAS does not take) rather than tinyBLAS's 8 lanes.
pub(super) fn single_order(len: usize, d: usize) -> bool {
    len == 1 || !d.is_multiple_of(8)
}

impl KvScratch {
    pub(super) fn fill(
        &mut self,
        kv: &LayerKv,
        s: &AttnSeq,
        kh: usize,
        d: usize,
        window: Option<usize>,
    ) -> HeadKv<'_> {
        let bs = kv.block_size();
        let ctx = s.pos0 + s.len;
        let base = window.map_or(0, |w| (s.pos0 + 1).saturating_sub(w));
        let n = ctx - base;
        let keys = grown(&mut self.keys, n * d);
        let values = grown(&mut self.values, n * d);
        for_each_span(base, ctx - 1, bs, |b, s0, s1| {
            let at = (b * bs + s0 - base) * d;
            let len = (s1 - s0) * d;
            kv.read_keys(s.block_table[b], kh, s0, &mut keys[at..at + len]);
            kv.read_values(s.block_table[b], kh, s0, &mut values[at..at + len]);
        });
        if !single_order(s.len, d) || d.is_multiple_of(8) {
            return HeadKv {
                base,
                stride: 0,
                keys_t: &[],
                keys: &self.keys[..n * d],
                values: &self.values[..n * d],
                half: None,
            };
        }
        let stride = n.div_ceil(KEY_TILE) * KEY_TILE;
        let keys_t = grown(&mut self.keys_t, d * stride);
        // The padding past `n` must be zero.
        keys_t.fill(0.0);
        transpose_into(&self.keys[..n * d], d, stride, keys_t);
        HeadKv {
            base,
            stride,
            keys_t: &self.keys_t[..d * stride],
            keys: &self.keys[..n * d],
            values: &self.values[..n * d],
            half: None,
        }
    }
}

/// `HeadKv` reading one new token's keys and values straight from an f16 cache, when that is
/// the order it is summed in (32 lanes, head size a multiple of 8); `None` otherwise.
pub(super) fn half_head<'a>(
    kv: &'a LayerKv,
    s: &AttnSeq,
    kh: usize,
    d: usize,
    window: Option<usize>,
) -> Option<HeadKv<'a>> {
    let bs = kv.block_size();
    if s.len != 1 || !d.is_multiple_of(8) || kv.dtype() != KvDtype::F16 {
        return None;
    }
    let ctx = s.pos0 + 1;
    let base = window.map_or(0, |w| (s.pos0 + 1).saturating_sub(w));
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for &b in &s.block_table[base / bs..=(ctx - 1) / bs] {
        let (k, v) = kv.f16_head(b, kh)?;
        keys.push(k);
        values.push(v);
    }
    let rows = |blocks| HalfRows {
        blocks,
        bs,
        shift: bs.is_power_of_two().then(|| bs.trailing_zeros()),
        d,
        first: base % bs,
        n: ctx - base,
    };
    Some(HeadKv {
        base,
        stride: 0,
        keys_t: &[],
        keys: &[],
        values: &[],
        half: Some((rows(keys), rows(values))),
    })
}

/// `rows[j][c]` (`d` columns) as `out[c][j]`, rows of `stride`, zero-padded.
#[cfg(test)]
pub(super) fn transpose(rows: &[f32], d: usize, stride: usize) -> Vec<f32> {
    let mut out = vec![0f32; d * stride];
    transpose_into(rows, d, stride, &mut out);
    out
}

/// `rows[j][c]` (`d` columns) into `out[c][j]` (rows of `stride`); the rest of `out` is left.
fn transpose_into(rows: &[f32], d: usize, stride: usize, out: &mut [f32]) {
    for (j, r) in rows.chunks_exact(d.max(1)).enumerate() {
        for (c, &v) in r.iter().enumerate() {
            out[c * stride + j] = v;
        }
    }
}

/// Calls `f(block_index, first_slot, end_slot)` for the blocks covering positions `first..=last`.
fn for_each_span(first: usize, last: usize, bs: usize, mut f: impl FnMut(usize, usize, usize)) {
    let mut p = first;
    while p <= last {
        let b = p / bs;
        let s0 = p % bs;
        let s1 = ((b + 1) * bs).min(last + 1) - b * bs;
        f(b, s0, s1);
        p = b * bs + s1;
    }
}
