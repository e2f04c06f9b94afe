//! Scaled dot-product attention of new query tokens against a paged KV cache.
//!
//! Every new token attends to all cached positions of its own sequence up to and including its
//! own position (causal), optionally limited to a sliding window. Prefill, chunked prefill,
//! decode and verification of drafted tokens are all this one call.

use half::f16;
use rayon::prelude::*;

use crate::kv_store::{KvDtype, LayerKv};

#[cfg(target_arch = "x86_64")]
mod decode_f16;

/// One sequence's share of a step: `len` new tokens at rows `row0..row0+len` of `q`,
/// at positions `pos0..pos0+len`, reading keys through `block_table`.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    pub row0: usize,
    pub len: usize,
    pub pos0: usize,
    pub block_table: &'a [u32],
}

#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub n_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Attend to at most this many most recent positions (the query's own included).
    pub window: Option<usize>,
    /// `cap · tanh(score / cap)` before softmax (Gemma 2).
    pub softcap: Option<f32>,
}

/// `q`: `[tokens][n_heads * head_dim]`; `out` the same shape.
///
/// Each (sequence, KV head) reads its keys and values out of the paged cache once
/// (dequantized to f32 in one contiguous run, keys transposed); tasks of a few query rows
/// then share them, so one sequence's prefill spreads over every thread even with one KV head.
/// A task's queries (its rows × the GQA group's heads) go through in tiles of four:
/// ```text
/// scores[4][keys] = Q[4][d] · Kᵀ[d][keys]   16 keys at a time, 8 accumulators in registers
/// softmax per query over its own causal/window range (exact, two passes)
/// out[4][d]       = P[4][keys] · V[keys][d]  16 columns at a time
/// ```
pub fn paged_attention(q: &[f32], kv: &LayerKv, seqs: &[AttnSeq], p: &AttnParams, out: &mut [f32]) {
    let d = p.head_dim;
    let n_kv = kv.shape.n_kv_heads;
    let group = p.n_heads / n_kv;
    let heads: Vec<(usize, usize)> = (0..seqs.len())
        .flat_map(|s| (0..n_kv).map(move |h| (s, h)))
        .collect();
    // Query rows per task: enough tasks to balance the threads, few enough to keep the
    // per-task overhead small.
    let total_rows: usize = seqs.iter().map(|s| s.len).sum::<usize>() * n_kv;
    let per_task = (total_rows / (8 * rayon::current_num_threads().max(1))).clamp(1, 64);
    let half = kv.dtype() == KvDtype::F16;
    let tasks: Vec<(usize, usize, usize)>;
    let results: Vec<Vec<f32>>;
    if seqs.iter().all(|s| s.len <= per_task) {
        // One task per (sequence, KV head) (decode): it reads its keys and values into this
        // thread's reused scratch and attends at once, so the f32 copy stays in cache and no
        // per-step buffers are allocated and zero-filled.
        tasks = heads
            .iter()
            .enumerate()
            .map(|(hi, &(si, _))| (hi, 0, seqs[si].len))
            .collect();
        results = heads
            .par_iter()
            .map(|&(si, kh)| {
                let s = &seqs[si];
                if let Some(head) = half_head(kv, s, kh, d, p.window) {
                    return attend_rows(q, &head, s, kh, group, 0..s.len, half, p);
                }
                SCRATCH.with(|sc| {
                    let mut sc = sc.borrow_mut();
                    let head = sc.fill(kv, &seqs[si], kh, d, p.window);
                    attend_rows(q, &head, &seqs[si], kh, group, 0..seqs[si].len, half, p)
                })
            })
            .collect();
    } else {
        let mut loaded: Vec<KvScratch> = heads.iter().map(|_| KvScratch::default()).collect();
        let views: Vec<HeadKv> = loaded
            .par_iter_mut()
            .zip(&heads)
            .map(|(sc, &(si, kh))| sc.fill(kv, &seqs[si], kh, d, p.window))
            .collect();
        tasks = heads
            .iter()
            .enumerate()
            .flat_map(|(hi, &(si, _))| {
                (0..seqs[si].len)
                    .step_by(per_task)
                    .map(move |r0| (hi, r0, (r0 + per_task).min(seqs[si].len)))
            })
            .collect();
        results = tasks
            .par_iter()
            .map(|&(hi, r0, r1)| {
                let (si, kh) = heads[hi];
                attend_rows(q, &views[hi], &seqs[si], kh, group, r0..r1, half, p)
            })
            .collect();
    }
    // Scatter: each result is `[row][head in group][head_dim]`.
    for (&(hi, r0, r1), res) in tasks.iter().zip(&results) {
        let (si, kh) = heads[hi];
        let s = &seqs[si];
        for r in r0..r1 {
            for g in 0..group {
                let dst = ((s.row0 + r) * p.n_heads + kh * group + g) * d;
                let src = ((r - r0) * group + g) * d;
                out[dst..dst + d].copy_from_slice(&res[src..src + d]);
            }
        }
    }
}

thread_local! {
    /// Each worker thread's buffers for decode attention (see `paged_attention`).
    static SCRATCH: std::cell::RefCell<KvScratch> = std::cell::RefCell::new(KvScratch::default());
}

/// One (sequence, KV head)'s keys and values for positions `base..ctx`: values as read
/// (`values[j][d]`), and keys laid out for the order the chunk is summed in
/// (`single_order`): as read, `keys[j][d]`, and for one new token (32 lanes) with a head size
/// that is not a multiple of 8 also transposed, `keys_t[c][j]` (`stride` ≥ positions, a
/// multiple of 16, zero-padded).
struct HeadKv<'a> {
    base: usize,
    stride: usize,
    keys_t: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    /// One new token, a head size that is a multiple of 8 and an f16 cache: keys and values
    /// read straight from the cache's blocks (`keys`, `values` then empty).
    half: Option<(HalfRows<'a>, HalfRows<'a>)>,
}

/// Rows `j` (positions `base + j`) of `d` values. A row is looked up once and then read eight
/// columns at a time, so per-row address arithmetic stays out of the column loops.
trait Rows {
    type Row<'r>: Row
    where
        Self: 'r;
    fn len(&self) -> usize;
    fn row(&self, j: usize) -> Self::Row<'_>;
}

/// One row's values, read as f32.
trait Row: Copy {
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
struct F32Rows<'a> {
    data: &'a [f32],
    d: usize,
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
struct HalfRows<'a> {
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
    fn row_ptrs(&self) -> Vec<*const f16> {
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
struct KvScratch {
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
fn single_order(len: usize, d: usize) -> bool {
    len == 1 || !d.is_multiple_of(8)
}

impl KvScratch {
    fn fill(
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
fn half_head<'a>(
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
fn transpose(rows: &[f32], d: usize, stride: usize) -> Vec<f32> {
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

/// Keys per score tile (two 8-lane vectors).
const KEY_TILE: usize = 16;
/// Queries per tile.
const Q_TILE: usize = 4;

/// Rows `rows` of one sequence, every query head of KV head `kh`: `[row][head][d]`. With an f16
/// cache, like llama.cpp's CPU path, queries and attention weights are rounded to f16 where
/// they meet it.
#[allow(clippy::too_many_arguments)]
fn attend_rows(
    q: &[f32],
    kv: &HeadKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    rows: std::ops::Range<usize>,
    half: bool,
    p: &AttnParams,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Isa::best() != crate::quant::Isa::Scalar {
        let d = p.head_dim;
        if let (Some((keys, values)), true) = (&kv.half, decode_f16::fits(d)) {
            // One new token (`half_head`): its query heads are one run of `q`.
            let at = ((s.row0 + rows.start) * p.n_heads + kh * group) * d;
            let q = &q[at..at + group * d];
            // SAFETY: `Isa::best` detected AVX2, FMA and F16C; `fits(d)`.
            return unsafe {
                decode_f16::attend(q, group, d, keys, values, kv.base, p.scale, p.softcap)
            };
        }
        // SAFETY: `Isa::best` detected AVX2, FMA and F16C.
        return unsafe { attend_rows_avx2(q, kv, s, kh, group, rows, half, p) };
    }
    attend_rows_impl::<false>(q, kv, s, kh, group, rows, half, p)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_rows_avx2(
    q: &[f32],
    kv: &HeadKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    rows: std::ops::Range<usize>,
    half: bool,
    p: &AttnParams,
) -> Vec<f32> {
    attend_rows_impl::<true>(q, kv, s, kh, group, rows, half, p)
}

/// `a·b + c`, fused where the build has FMA (`FMA`), else two roundings.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_rows_impl<const FMA: bool>(
    q: &[f32],
    kv: &HeadKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    rows: std::ops::Range<usize>,
    half: bool,
    p: &AttnParams,
) -> Vec<f32> {
    let d = p.head_dim;
    let round = |x: f32| if half { f16::from_f32(x).to_f32() } else { x };
    let lo_of = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w)) - kv.base;
    let r0 = rows.start;
    let nq = rows.len() * group;
    let mut res = vec![0f32; nq * d];
    // Query m of this task is row r0 + m / group, head kh·group + m % group.
    let mut qs = vec![0f32; Q_TILE * d];
    let mut scores = Vec::new();
    for m0 in (0..nq).step_by(Q_TILE) {
        let mt = (nq - m0).min(Q_TILE);
        // Per query: its key range [lo, hi) (relative to `kv.base`).
        let mut range = [(0usize, 0usize); Q_TILE];
        for (t, rg) in range.iter_mut().enumerate() {
            let m = m0 + t.min(mt - 1);
            let (r, g) = (r0 + m / group, m % group);
            let pos = s.pos0 + r;
            *rg = (lo_of(pos), pos + 1 - kv.base);
            let at = ((s.row0 + r) * p.n_heads + kh * group + g) * d;
            let qt = &mut qs[t * d..(t + 1) * d];
            qt.iter_mut()
                .zip(&q[at..at + d])
                .for_each(|(o, &x)| *o = round(x));
        }
        let lo = range.iter().map(|r| r.0).min().unwrap_or(0) / KEY_TILE * KEY_TILE;
        let hi = range.iter().map(|r| r.1).max().unwrap_or(0);
        let span = hi - lo;
        scores.clear();
        scores.resize(Q_TILE * span.div_ceil(KEY_TILE) * KEY_TILE, 0f32);
        let sw = span.div_ceil(KEY_TILE) * KEY_TILE;
        // One new token: llama.cpp's `ggml_vec_dot_f16` order; a prompt chunk: tinyBLAS's
        // (which takes only head sizes that are a multiple of 8).
        let single = single_order(s.len, d);
        for j0 in (lo..hi).step_by(KEY_TILE) {
            let tile = if let Some((keys, _)) = &kv.half {
                qk_rows32_by::<FMA, _>(&qs, d, keys, j0, mt)
            } else if single && d.is_multiple_of(8) {
                qk_rows32::<FMA>(&qs, d, kv.keys, j0, mt)
            } else if single {
                qk_tile32::<FMA>(&qs, d, kv.keys_t, kv.stride, j0, mt)
            } else {
                qk_tile8::<FMA>(&qs, d, kv.keys, j0)
            };
            for (t, row) in tile.iter().enumerate() {
                scores[t * sw + j0 - lo..][..KEY_TILE].copy_from_slice(row);
            }
        }
        for (t, &(qlo, qhi)) in range.iter().enumerate().take(mt) {
            let row = &mut scores[t * sw..(t + 1) * sw];
            row[..qlo - lo].fill(0.0);
            row[qhi - lo..].fill(0.0);
            let live = &mut row[qlo - lo..qhi - lo];
            live.iter_mut().for_each(|v| *v *= p.scale);
            if let Some(cap) = p.softcap {
                crate::ops::softcap(live, cap);
            }
            softmax_llama(live, kv.base + qlo);
            if half {
                live.iter_mut().for_each(|v| *v = round_f16(*v));
            }
        }
        for t in mt..Q_TILE {
            scores[t * sw..(t + 1) * sw].fill(0.0);
        }
        let o = if let Some((_, values)) = &kv.half {
            pv_tile32_by::<FMA, _>(&scores, sw, values, d, lo, span, kv.base, mt)
        } else if single {
            pv_tile32::<FMA>(&scores, sw, kv.values, d, lo, span, kv.base, mt)
        } else {
            pv_tile::<FMA, 8>(&scores, sw, kv.values, d, lo, span, kv.base)
        };
        for t in 0..mt {
            res[(m0 + t) * d..(m0 + t + 1) * d].copy_from_slice(&o[t * d..(t + 1) * d]);
        }
    }
    res
}

/// `x` rounded to the nearest f16 (ties to even), as f32; for the attention weights
/// (0..=1), where the `half` crate's per-element conversion was a large share of the time.
#[inline(always)]
fn round_f16(x: f32) -> f32 {
    // Below f16's smallest normal (2⁻¹⁴) the step is 2⁻²⁴: adding 0.75 (whose ulp is 2⁻²⁴)
    // rounds to it. Above, keep 10 of f32's 23 mantissa bits, ties to even.
    let sub = (x + 0.75) - 0.75;
    let b = x.to_bits();
    let normal = f32::from_bits((b + 0x0fff + ((b >> 13) & 1)) & !0x1fff);
    if x.abs() < 6.103_515_6e-5 {
        sub
    } else {
        normal
    }
}

/// The eight lanes summed as llama.cpp's x86 `hsum` does: halves, then pairs, then the two.
#[inline(always)]
fn hsum8(a: [f32; 8]) -> f32 {
    let t = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// llama.cpp sums its f16 attention products in one of two orders (docs/DECISIONS.md): a
/// prompt batch goes through tinyBLAS (eight lanes, `NL = 8`), a single new token through
/// `ggml_vec_dot_f16` (four 8-lane accumulators, `NL = 32`). Element `i` of a dot goes to lane
/// `i % NL`; each lane is one FMA chain; `reduce` adds the lanes in that kernel's order.
#[inline(always)]
fn reduce<const NL: usize>(a: [f32; NL]) -> f32 {
    if NL == 8 {
        return hsum8(std::array::from_fn(|l| a[l]));
    }
    // GGML_F32x8_REDUCE: x0 += x2, x1 += x3, x0 += x1, then halves and two `hadd`s.
    let x: [f32; 8] = std::array::from_fn(|l| (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l]));
    let t = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
    (t[0] + t[1]) + (t[2] + t[3])
}

/// Scores of the `Q_TILE` queries in `qs` (`[Q_TILE][d]`) against keys `j0..j0+16`, in
/// llama.cpp's order for `NL` lanes (see `reduce`): the plain statement of the order, which
/// the tests hold `qk_tile32` and `qk_tile8` to.
#[cfg(test)]
fn qk_tile<const FMA: bool, const NL: usize>(
    qs: &[f32],
    d: usize,
    keys_t: &[f32],
    stride: usize,
    j0: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let mut acc = [[[0f32; KEY_TILE]; NL]; Q_TILE];
    for c in 0..d {
        let k: &[f32; KEY_TILE] = keys_t[c * stride + j0..][..KEY_TILE]
            .try_into()
            .expect("stride is a multiple of the key tile");
        for (t, a) in acc.iter_mut().enumerate() {
            let qv = qs[t * d + c];
            let a = &mut a[c % NL];
            for l in 0..KEY_TILE {
                a[l] = madd::<FMA>(qv, k[l], a[l]);
            }
        }
    }
    std::array::from_fn(|t| {
        std::array::from_fn(|l| reduce::<NL>(std::array::from_fn(|i| acc[t][i][l])))
    })
}

/// `qk_tile::<FMA, 32>` for the first `mt` queries, with keys as vector lanes (`keys_t`): lane
/// `i`'s chain (head-dimension elements `i, i + 32, …`) runs eight keys at a time, and the 32
/// chains meet in `reduce::<32>`'s tree as they finish — the same order with a few registers
/// instead of `[4][32][16]` accumulators in memory. (Helpers are `inline(always)` fns, not
/// closures: a closure is not compiled with the caller's FMA feature, and `mul_add` in it
/// became a libm call.)
#[inline(always)]
fn qk_tile32<const FMA: bool>(
    qs: &[f32],
    d: usize,
    keys_t: &[f32],
    stride: usize,
    j0: usize,
    mt: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let mut out = [[0f32; KEY_TILE]; Q_TILE];
    for (t, o) in out.iter_mut().enumerate().take(mt) {
        let q = &qs[t * d..(t + 1) * d];
        for h in (0..KEY_TILE).step_by(8) {
            let k = &keys_t[j0 + h..];
            // reduce::<32>: x_l = (a_l + a_16+l) + (a_8+l + a_24+l), then
            // ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)).
            let mut x = [[0f32; 8]; 8];
            for (l, xl) in x.iter_mut().enumerate() {
                let (a0, a16) = (
                    chain32::<FMA>(q, k, stride, l),
                    chain32::<FMA>(q, k, stride, 16 + l),
                );
                let (a8, a24) = (
                    chain32::<FMA>(q, k, stride, 8 + l),
                    chain32::<FMA>(q, k, stride, 24 + l),
                );
                *xl = add8(add8(a0, a16), add8(a8, a24));
            }
            let lo = add8(add8(x[0], x[4]), add8(x[1], x[5]));
            let hi = add8(add8(x[2], x[6]), add8(x[3], x[7]));
            o[h..h + 8].copy_from_slice(&add8(lo, hi));
        }
    }
    out
}

/// `qk_tile::<FMA, 32>` for the first `mt` queries with keys as read (`keys[j][d]`, `d` a
/// multiple of 8): per query–key pair, four 8-lane accumulators hold the 32 lanes (lane `i` in
/// accumulator `i / 8`), then `reduce::<32>` — no transposed copy of the keys.
#[inline(always)]
fn qk_rows32<const FMA: bool>(
    qs: &[f32],
    d: usize,
    keys: &[f32],
    j0: usize,
    mt: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    qk_rows32_by::<FMA, _>(qs, d, &F32Rows { data: keys, d }, j0, mt)
}

/// `qk_rows32` over any [`Rows`]: each 8 columns of a key are read once for all `mt` queries
/// (each query's chains still run over the columns in order).
#[inline(always)]
fn qk_rows32_by<const FMA: bool, R: Rows>(
    qs: &[f32],
    d: usize,
    keys: &R,
    j0: usize,
    mt: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let n = keys.len();
    let mut out = [[0f32; KEY_TILE]; Q_TILE];
    for j in j0..(j0 + KEY_TILE).min(n) {
        let key = keys.row(j);
        let mut a = [[[0f32; 8]; 4]; Q_TILE];
        for c in (0..d).step_by(32) {
            for m in 0..4 {
                if c + 8 * m < d {
                    let kc = key.at8::<FMA>(c + 8 * m);
                    for (t, at) in a.iter_mut().enumerate().take(mt) {
                        let qc = &qs[t * d + c + 8 * m..][..8];
                        for l in 0..8 {
                            at[m][l] = madd::<FMA>(qc[l], kc[l], at[m][l]);
                        }
                    }
                }
            }
        }
        for (t, o) in out.iter_mut().enumerate().take(mt) {
            let a = &a[t];
            let x = add8(add8(a[0], a[2]), add8(a[1], a[3]));
            o[j - j0] = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
        }
    }
    out
}

/// Lane `lane`'s FMA chain of a 32-lane dot for eight keys: `Σ q[c]·k[c·stride + 0..8]` over
/// `c = lane, lane + 32, …`.
#[inline(always)]
fn chain32<const FMA: bool>(q: &[f32], k: &[f32], stride: usize, lane: usize) -> [f32; 8] {
    let mut a = [0f32; 8];
    let mut c = lane;
    while c < q.len() {
        let kc = &k[c * stride..][..8];
        for l in 0..8 {
            a[l] = madd::<FMA>(q[c], kc[l], a[l]);
        }
        c += 32;
    }
    a
}

#[inline(always)]
fn add8(x: [f32; 8], y: [f32; 8]) -> [f32; 8] {
    std::array::from_fn(|l| x[l] + y[l])
}

/// `pv_tile::<FMA, 32>` for the first `mt` weight rows: lane `i`'s chain (the positions
/// `base + lo + j ≡ i mod 32`, in order) runs over up to 64 value columns at once in registers,
/// its result goes to a small buffer, and the 32 lanes then meet in `reduce::<32>`'s tree
/// column by column — the same order without `[4][32][16]` accumulators updated in memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_tile32<const FMA: bool>(
    w: &[f32],
    sw: usize,
    values: &[f32],
    d: usize,
    lo: usize,
    span: usize,
    base: usize,
    mt: usize,
) -> Vec<f32> {
    pv_tile32_by::<FMA, _>(w, sw, &F32Rows { data: values, d }, d, lo, span, base, mt)
}

/// `pv_tile32` over any [`Rows`]: the same chains and tree.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_tile32_by<const FMA: bool, R: Rows>(
    w: &[f32],
    sw: usize,
    values: &R,
    d: usize,
    lo: usize,
    span: usize,
    base: usize,
    mt: usize,
) -> Vec<f32> {
    const COLS: usize = 64;
    let mut out = vec![0f32; Q_TILE * d];
    let mut lanes = [[0f32; COLS]; 32];
    let first = (32 - (base + lo) % 32) % 32;
    for t in 0..mt {
        let wt = &w[t * sw..t * sw + span];
        for c0 in (0..d).step_by(COLS) {
            let cols = (d - c0).min(COLS);
            for (i, lane) in lanes.iter_mut().enumerate() {
                let j0 = (first + i) % 32;
                *lane = if cols == COLS {
                    pv_chain::<FMA, R, COLS>(wt, values, lo, c0, j0, COLS)
                } else {
                    pv_chain::<FMA, R, COLS>(wt, values, lo, c0, j0, cols)
                };
            }
            let o = &mut out[t * d + c0..t * d + c0 + cols];
            for (c, oc) in o.iter_mut().enumerate() {
                let a = |i: usize| lanes[i][c];
                let x = |l: usize| (a(l) + a(16 + l)) + (a(8 + l) + a(24 + l));
                *oc = ((x(0) + x(4)) + (x(1) + x(5))) + ((x(2) + x(6)) + (x(3) + x(7)));
            }
        }
    }
    out
}

/// One lane's chain of `pv_tile32_by`: `Σ w[j]·values[lo + j][c0..c0 + cols]` over
/// `j = j0, j0 + 32, …` (`cols` ≤ N), eight columns at a time and the rest one by one. (The
/// full-width call passes the constant `N`, so its column loop unrolls.)
#[inline(always)]
fn pv_chain<const FMA: bool, R: Rows, const N: usize>(
    w: &[f32],
    values: &R,
    lo: usize,
    c0: usize,
    j0: usize,
    cols: usize,
) -> [f32; N] {
    let mut a = [0f32; N];
    let whole = cols / 8 * 8;
    let mut j = j0;
    while j < w.len() {
        let row = values.row(lo + j);
        for c in (0..whole).step_by(8) {
            let vj = row.at8::<FMA>(c0 + c);
            for l in 0..8 {
                a[c + l] = madd::<FMA>(w[j], vj[l], a[c + l]);
            }
        }
        for (c, ac) in a.iter_mut().enumerate().take(cols).skip(whole) {
            *ac = madd::<FMA>(w[j], row.at(c0 + c), *ac);
        }
        j += 32;
    }
    a
}

/// `qk_tile::<FMA, 8>` with the lanes as vector lanes: each query–key pair is one 8-lane
/// chain over the head dimension (keys as read, `[j][d]`, `d` a multiple of 8), reduced with
/// `hsum8` — the same order, with four accumulators in registers instead of 512 floats.
#[inline(always)]
fn qk_tile8<const FMA: bool>(
    qs: &[f32],
    d: usize,
    keys: &[f32],
    j0: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let n = keys.len() / d.max(1);
    let mut out = [[0f32; KEY_TILE]; Q_TILE];
    for j in j0..(j0 + KEY_TILE).min(n) {
        let k = &keys[j * d..(j + 1) * d];
        let mut acc = [[0f32; 8]; Q_TILE];
        for (c, kc) in k.chunks_exact(8).enumerate() {
            for (t, a) in acc.iter_mut().enumerate() {
                let q = &qs[t * d + 8 * c..][..8];
                for l in 0..8 {
                    a[l] = madd::<FMA>(q[l], kc[l], a[l]);
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            out[t][j - j0] = hsum8(*a);
        }
    }
    out
}

/// `out[t][c] = Σ_j w[t][j] · values[lo + j][c]` for the `Q_TILE` weight rows of `w`
/// (row stride `sw`, `span` live columns), in llama.cpp's order for `NL` lanes (see `reduce`):
/// position `base + lo + j` (llama.cpp's cache cell) goes to lane `(base + lo + j) % NL`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_tile<const FMA: bool, const NL: usize>(
    w: &[f32],
    sw: usize,
    values: &[f32],
    d: usize,
    lo: usize,
    span: usize,
    base: usize,
) -> Vec<f32> {
    const COLS: usize = 16;
    let mut out = vec![0f32; Q_TILE * d];
    let mut c0 = 0;
    while c0 < d {
        let cols = (d - c0).min(COLS);
        let mut acc = [[[0f32; COLS]; NL]; Q_TILE];
        for j in 0..span {
            let v = &values[(lo + j) * d + c0..][..cols];
            let lane = (base + lo + j) % NL;
            for (t, a) in acc.iter_mut().enumerate() {
                let wv = w[t * sw + j];
                let a = &mut a[lane];
                for l in 0..cols {
                    a[l] = madd::<FMA>(wv, v[l], a[l]);
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            for l in 0..cols {
                out[t * d + c0 + l] = reduce::<NL>(std::array::from_fn(|i| a[i][l]));
            }
        }
        c0 += cols;
    }
    out
}

/// Softmax of one query's scores `x` (position `pos0` first) with llama.cpp's arithmetic: its
/// vectorized `expf`, the values of each 8 consecutive positions (8-aligned, masked ones 0)
/// summed as `hsum` does and added in f64, and the reciprocal of the total rounded to f32.
#[inline(always)]
fn softmax_llama(x: &mut [f32], pos0: usize) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    let mut lanes = [0f32; 8];
    let n = x.len();
    for (i, v) in x.iter_mut().enumerate() {
        *v = crate::ops::expf_llama(*v - max);
        let pos = pos0 + i;
        lanes[pos % 8] = *v;
        if pos % 8 == 7 || i + 1 == n {
            sum += hsum8(lanes) as f64;
            lanes = [0.0; 8];
        }
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
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

#[cfg(test)]
mod tests;
