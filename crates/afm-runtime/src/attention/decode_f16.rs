//! One new token against an f16 cache, on AVX2: the decode step's attention, in llama.cpp's
//! order (the same sums as `attend_rows_impl`'s 32-lane path, bit for bit) with every stage
//! vectorized across keys or columns instead of per query–key pair.
//!
//! ```text
//! scores: eight keys at a time; per key and query four 8-lane FMA chains over the head
//!         (ggml_vec_dot_f16), folded to one vector, then the eight keys' horizontal sums
//!         together (two 128-bit folds and two hadds: the `hsum` tree per key)
//! softmax: ggml_v_expf eight at a time; sums of each 8-aligned run of positions in `hsum`
//!         order, added in f64 (ggml_vec_soft_max_f32 over llama.cpp's whole cache row)
//! output: per position lane (position mod 32) one FMA chain over its rows, columns as
//!         vector lanes; the 32 lanes then meet in GGML_F32x8_REDUCE's tree
//! ```
//! `attend_512` runs the score and output passes in 512-bit registers (same chains, same
//! bits): in-process A/B on an 8-row SmolLM2 decode step, 1.5–5% faster (bench/RESULTS.md).
//! At SmolLM2's shape this took a batch-of-8 decode layer from ~185 µs to the figure in
//! bench/RESULTS.md (`cargo bench -p afm-runtime --bench attention`).

use std::arch::x86_64::*;

use half::f16;

use super::{HalfRows, Rows};

/// Head sizes this kernel takes: whole 32-lane chunks (`ggml_vec_dot_f16` has no leftover),
/// which are also whole 32-column passes of the output.
pub(super) fn fits(d: usize) -> bool {
    d > 0 && d.is_multiple_of(32)
}

/// Attention of the `g` query heads in `q` (`[g][d]`, as computed; rounded to f16 here, as
/// llama.cpp stores them) over `keys`/`values` rows `0..n` (positions `base + j`), all live.
/// Returns `[g][d]`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `fits(d)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend(
    q: &[f32],
    g: usize,
    d: usize,
    keys: &HalfRows,
    values: &HalfRows,
    base: usize,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    attend_impl::<false>(q, g, d, keys, values, base, scale, softcap)
}

/// `attend` with the score and output passes in 512-bit registers: two of the four 8-lane
/// chains of `ggml_vec_dot_f16` in each (lanes 0..8 and 8..16 are the chains' own lanes,
/// so every chain sees the same FMAs), and sixteen output columns per register. Same bits,
/// half the FMAs and conversions.
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C and AVX-512 F/BW/VL; `fits(d)`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend_512(
    q: &[f32],
    g: usize,
    d: usize,
    keys: &HalfRows,
    values: &HalfRows,
    base: usize,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    attend_impl::<true>(q, g, d, keys, values, base, scale, softcap)
}

/// `attend`'s body; `WIDE` picks the 512-bit passes (only inside `attend_512`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_impl<const WIDE: bool>(
    q: &[f32],
    g: usize,
    d: usize,
    keys: &HalfRows,
    values: &HalfRows,
    base: usize,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f32> {
    let n = keys.len();
    let mut qh = vec![0f32; g * d];
    for (o, x) in qh.chunks_exact_mut(8).zip(q[..g * d].chunks_exact(8)) {
        _mm256_storeu_ps(o.as_mut_ptr(), round_f16(_mm256_loadu_ps(x.as_ptr())));
    }
    // Each query's scores sit at `off + j`, so that 8-aligned positions are 8-aligned
    // indices; the row is padded with zeros on both sides to whole vectors.
    let off = base % 8;
    let w = (off + n).div_ceil(8) * 8 + 8;
    let mut sc = vec![0f32; g * w];
    // Row addresses once per head, not per query and column pass.
    let (krows, vrows) = (keys.row_ptrs(), values.row_ptrs());
    // The first keys' lines now; `scores` asks for the later ones (keys and values) ahead.
    for &k in krows.iter().take(PREFETCH_AHEAD) {
        prefetch::<_MM_HINT_T0>(k, 2 * d);
    }
    let mut out = vec![0f32; g * d];
    // Queries in tiles of up to three: a converted key or value chunk serves the whole tile
    // (three tiles' accumulators still fit the sixteen vector registers).
    let mut t = 0;
    while t < g {
        let tile = (g - t).min(3);
        let (q, sc) = (&qh[t * d..(t + tile) * d], &mut sc[t * w..(t + tile) * w]);
        // The first tile asks for the values' lines; later tiles find them requested.
        let ahead: &[*const f16] = if t == 0 { &vrows } else { &[] };
        match tile {
            3 => scores::<3, WIDE>(q, d, &krows, ahead, off, w, sc),
            2 => scores::<2, WIDE>(q, d, &krows, ahead, off, w, sc),
            _ => scores::<1, WIDE>(q, d, &krows, ahead, off, w, sc),
        }
        for row in sc.chunks_exact_mut(w) {
            softmax(row, off, n, scale, softcap);
        }
        let o = &mut out[t * d..(t + tile) * d];
        match (tile, WIDE) {
            (3, true) => weighted_values::<__m512, 3, 2>(sc, w, off, &vrows, d, base, o),
            (2, true) => weighted_values::<__m512, 2, 2>(sc, w, off, &vrows, d, base, o),
            (_, true) => weighted_values::<__m512, 1, 2>(sc, w, off, &vrows, d, base, o),
            (3, false) => weighted_values::<__m256, 3, 4>(sc, w, off, &vrows, d, base, o),
            (2, false) => weighted_values::<__m256, 2, 4>(sc, w, off, &vrows, d, base, o),
            _ => weighted_values::<__m256, 1, 4>(sc, w, off, &vrows, d, base, o),
        }
        t += tile;
    }
    out
}

/// `x` rounded to the nearest f16, as f32.
#[inline(always)]
unsafe fn round_f16(x: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// Eight f16 at `p`, as f32.
#[inline(always)]
unsafe fn load_f16(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// `q·k` for the `Q` queries of `qh` (`[Q][d]`) and every key into `sc[t·w + off + j]`;
/// each converted key chunk serves all `Q`. Asks for the cache lines of the keys 32 ahead
/// (each block's rows are a new stream the hardware prefetcher has not seen; 8 ahead was
/// too close to hide the latency), and for those of `vrows` (the values, empty when an earlier
/// tile asked) beside the keys they belong to: with both, an 8-row SmolLM2 decode step was
/// 1.3–2.6% faster (in-process A/B, bench/RESULTS.md).
#[inline(always)]
unsafe fn scores<const Q: usize, const WIDE: bool>(
    qh: &[f32],
    d: usize,
    krows: &[*const f16],
    vrows: &[*const f16],
    off: usize,
    w: usize,
    sc: &mut [f32],
) {
    let n = krows.len();
    let bytes = 2 * d;
    for j0 in (0..n).step_by(8) {
        for j in (j0 + PREFETCH_AHEAD..j0 + PREFETCH_AHEAD + 8).take_while(|&j| j < n) {
            prefetch::<_MM_HINT_T0>(krows[j], bytes);
        }
        // The values of these keys, for `weighted_values` (which walks them 32 apart, a
        // pattern the hardware prefetcher cannot follow): into L2, as L1 holds the keys.
        for &v in vrows.get(j0..(j0 + 8).min(n)).unwrap_or_default() {
            prefetch::<_MM_HINT_T1>(v, bytes);
        }
        let mut x = [[_mm256_setzero_ps(); 8]; Q];
        for k in 0..(n - j0).min(8) {
            let key = krows[j0 + k];
            let dots = if WIDE {
                key_chains_512::<Q>(qh, d, key)
            } else {
                key_chains::<Q>(qh, d, key)
            };
            for (xt, dt) in x.iter_mut().zip(dots) {
                xt[k] = dt;
            }
        }
        for (t, xt) in x.iter().enumerate() {
            _mm256_storeu_ps(sc.as_mut_ptr().add(t * w + off + j0), hsum_each(xt));
        }
    }
}

/// One key's four 8-lane chains against each of the `Q` queries (ggml_vec_dot_f16), folded
/// as GGML_F32x8_REDUCE's first steps: `(a0 + a2) + (a1 + a3)`.
#[inline(always)]
unsafe fn key_chains<const Q: usize>(qh: &[f32], d: usize, key: *const f16) -> [__m256; Q] {
    let mut a = [[_mm256_setzero_ps(); 4]; Q];
    for c in (0..d).step_by(32) {
        for m in 0..4 {
            let kv = load_f16(key.add(c + 8 * m));
            for (t, at) in a.iter_mut().enumerate() {
                let qv = _mm256_loadu_ps(qh.as_ptr().add(t * d + c + 8 * m));
                at[m] = _mm256_fmadd_ps(qv, kv, at[m]);
            }
        }
    }
    a.map(|at| _mm256_add_ps(_mm256_add_ps(at[0], at[2]), _mm256_add_ps(at[1], at[3])))
}

/// `key_chains` in 512-bit registers: `a[t][0]` holds chains 0 and 1 of query t (columns
/// `c..c + 16`), `a[t][1]` chains 2 and 3, so `(a0 + a2) + (a1 + a3)` is the sum of the two
/// registers' halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn key_chains_512<const Q: usize>(qh: &[f32], d: usize, key: *const f16) -> [__m256; Q] {
    let mut a = [[_mm512_setzero_ps(); 2]; Q];
    for c in (0..d).step_by(32) {
        for m in 0..2 {
            let kv = load_f16_16(key.add(c + 16 * m));
            for (t, at) in a.iter_mut().enumerate() {
                let qv = _mm512_loadu_ps(qh.as_ptr().add(t * d + c + 16 * m));
                at[m] = _mm512_fmadd_ps(qv, kv, at[m]);
            }
        }
    }
    a.map(|at| {
        let s = _mm512_add_ps(at[0], at[1]);
        _mm256_add_ps(low_256(s), high_256(s))
    })
}

/// Sixteen f16 at `p`, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn load_f16_16(p: *const f16) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

/// Lanes 0..8 of `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn low_256(x: __m512) -> __m256 {
    _mm512_castps512_ps256(x)
}

/// Lanes 8..16 of `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn high_256(x: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)))
}

/// Keys `scores` asks for ahead of the one it reads.
const PREFETCH_AHEAD: usize = 32;

/// Asks for the cache lines of `bytes` bytes at `p`.
#[inline(always)]
unsafe fn prefetch<const HINT: i32>(p: *const f16, bytes: usize) {
    for at in (0..bytes).step_by(64) {
        _mm_prefetch::<HINT>((p as *const i8).add(at));
    }
}

/// `hsum` of each of eight vectors (`((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7))`, the
/// `_mm256_extractf128` + two `hadd` tree), as one vector in order: the 128-bit halves of
/// each pair are added, and two `hadd`s then finish four vectors each.
#[inline(always)]
unsafe fn hsum_each(x: &[__m256; 8]) -> __m256 {
    let half = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    };
    let (t01, t23) = (half(x[0], x[1]), half(x[2], x[3]));
    let (t45, t67) = (half(x[4], x[5]), half(x[6], x[7]));
    // Lanes now hold vectors 0, 2, 4, 6, 1, 3, 5, 7.
    let r = _mm256_hadd_ps(_mm256_hadd_ps(t01, t23), _mm256_hadd_ps(t45, t67));
    _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// One query's scores (`row[off..off + n]`, zero padding around them) into attention
/// weights: scaled, soft-capped, `ggml_vec_soft_max_f32` over 8-aligned runs, normalized and
/// rounded to f16 — `softmax_llama` and the f16 rounding of `attend_rows_impl`.
#[inline(always)]
unsafe fn softmax(row: &mut [f32], off: usize, n: usize, scale: f32, softcap: Option<f32>) {
    let s = _mm256_set1_ps(scale);
    for v in row.chunks_exact_mut(8) {
        _mm256_storeu_ps(
            v.as_mut_ptr(),
            _mm256_mul_ps(_mm256_loadu_ps(v.as_ptr()), s),
        );
    }
    if let Some(cap) = softcap {
        crate::ops::softcap(&mut row[off..off + n], cap);
    }
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let live = |i: usize| i >= off && i < off + n;
    for (c, v) in row.chunks_exact(8).enumerate() {
        let x = _mm256_loadu_ps(v.as_ptr());
        let x = if live(8 * c) && live(8 * c + 7) {
            x
        } else {
            _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), x, mask(c, off, n))
        };
        m = _mm256_max_ps(m, x);
    }
    let mut mx = [0f32; 8];
    _mm256_storeu_ps(mx.as_mut_ptr(), m);
    let max = _mm256_set1_ps(mx.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let mut sum = 0f64;
    for (c, v) in row.chunks_exact_mut(8).enumerate() {
        let mut e = crate::ops::x86::expf(_mm256_sub_ps(_mm256_loadu_ps(v.as_ptr()), max));
        if !(live(8 * c) && live(8 * c + 7)) {
            e = _mm256_and_ps(e, mask(c, off, n));
        }
        _mm256_storeu_ps(v.as_mut_ptr(), e);
        let h = _mm_add_ps(_mm256_extractf128_ps::<1>(e), _mm256_castps256_ps128(e));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        sum += _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))) as f64;
    }
    let inv = _mm256_set1_ps((1.0 / sum) as f32);
    for v in row.chunks_exact_mut(8) {
        let x = _mm256_mul_ps(_mm256_loadu_ps(v.as_ptr()), inv);
        _mm256_storeu_ps(v.as_mut_ptr(), round_f16(x));
    }
}

/// All-ones lanes for the live indices `off..off + n` of chunk `c`.
#[inline(always)]
unsafe fn mask(c: usize, off: usize, n: usize) -> __m256 {
    let i = _mm256_add_epi32(
        _mm256_set1_epi32((8 * c) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    );
    let lo = _mm256_cmpgt_epi32(i, _mm256_set1_epi32(off as i32 - 1));
    let hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((off + n) as i32), i);
    _mm256_castsi256_ps(_mm256_and_si256(lo, hi))
}

/// `out[t][c] = Σ_j w[t][j]·values[j][c]` for the `Q` weight rows in `sc` (`w[t][j]` at
/// `sc[t·w + off + j]`), in `ggml_vec_dot_f16`'s order over llama.cpp's cache row: position
/// `base + j` in lane `(base + j) % 32`, each lane one FMA chain per query (32 columns at a
/// time in registers, each converted value chunk serving all `Q`), the 32 lanes then summed
/// in GGML_F32x8_REDUCE + `hsum` order.
#[inline(always)]
// Lane, query and column indices each address two or three arrays at once.
#[allow(clippy::needless_range_loop)]
unsafe fn weighted_values<V: Columns, const Q: usize, const VECS: usize>(
    sc: &[f32],
    w: usize,
    off: usize,
    vrows: &[*const f16],
    d: usize,
    base: usize,
    out: &mut [f32],
) {
    debug_assert_eq!(V::WIDTH * VECS, 32);
    let n = vrows.len();
    let first = (32 - base % 32) % 32;
    let mut lanes = [[[V::zero(); VECS]; 32]; Q];
    for c0 in (0..d).step_by(V::WIDTH * VECS) {
        for i in 0..32 {
            let mut a = [[V::zero(); VECS]; Q];
            let mut j = (first + i) % 32;
            while j < n {
                let row = vrows.get_unchecked(j).add(c0);
                let wj: [V; Q] =
                    std::array::from_fn(|t| V::splat(*sc.get_unchecked(t * w + off + j)));
                for v in 0..VECS {
                    let x = V::load_f16(row.add(V::WIDTH * v));
                    for t in 0..Q {
                        a[t][v] = V::fma(wj[t], x, a[t][v]);
                    }
                }
                j += 32;
            }
            for t in 0..Q {
                lanes[t][i] = a[t];
            }
        }
        for (t, l) in lanes.iter().enumerate() {
            for v in 0..VECS {
                let x = |i: usize| {
                    V::add(
                        V::add(l[i][v], l[16 + i][v]),
                        V::add(l[8 + i][v], l[24 + i][v]),
                    )
                };
                let lo = V::add(V::add(x(0), x(4)), V::add(x(1), x(5)));
                let hi = V::add(V::add(x(2), x(6)), V::add(x(3), x(7)));
                V::store(
                    out.as_mut_ptr().add(t * d + c0 + V::WIDTH * v),
                    V::add(lo, hi),
                );
            }
        }
    }
}

/// The f32 vector of the output pass: eight columns (AVX2) or sixteen (AVX-512, only inside
/// `attend_512`). Each column's chain and the 32-lane tree are the same at either width.
trait Columns: Copy {
    const WIDTH: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load_f16(p: *const f16) -> Self;
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn store(p: *mut f32, v: Self);
}

impl Columns for __m256 {
    const WIDTH: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> Self {
        load_f16(p)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self) {
        _mm256_storeu_ps(p, v)
    }
}

impl Columns for __m512 {
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> Self {
        load_f16_16(p)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self) {
        _mm512_storeu_ps(p, v)
    }
}
