//! A prompt chunk's attention tiles (`qk_tile8`, `pv_tile::<_, 8>`: tinyBLAS's 8-lane order)
//! in 512-bit registers, for `attend_rows_avx512`. Same sums, bit for bit (test
//! `prompt_tiles_512_equal_the_8_lane_tiles`):
//! ```text
//! scores: two queries a register (lanes 0..8 query 2p, 8..16 query 2p+1), each an 8-lane
//!         chain over the head, the key's eight values broadcast to both halves; eight keys'
//!         `hsum8`s at once
//! output: sixteen columns a register, one register per (query, position lane), positions
//!         taken eight at a time so each lane's chain runs in position order
//! ```
//! A 1,000-token SmolLM2 prefill spent 58% of its time in these two tiles' AVX2 forms.

use std::arch::x86_64::*;

use super::llama_order::{KEY_TILE, Q_TILE};

/// Whether the 512-bit tiles take head size `d` (whole 16-column output registers).
pub(super) fn fits(d: usize) -> bool {
    d > 0 && d.is_multiple_of(16)
}

/// `qk_tile8` over keys `lo..hi`, eight keys at a time from `lo`: the scores of the `Q_TILE`
/// queries in `qs` (`[t][d]`) into `scores[t·sw + j − lo]` (keys past the end of `keys`, `[j][d]`,
/// score 0). The queries are paired into registers once for all the tiles.
///
/// # Safety
/// The CPU must have AVX-512 F (and AVX2, FMA); `fits(d)`, `qs.len() ≥ Q_TILE·d`, `scores`
/// holds `Q_TILE` rows of `sw ≥ hi − lo` rounded up to a whole tile.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
// The key index addresses the keys and every query's column of `x` at once.
#[allow(clippy::needless_range_loop)]
pub(super) unsafe fn qk_tiles8(
    qs: &[f32],
    d: usize,
    keys: &[f32],
    (lo, hi): (usize, usize),
    scores: &mut [f32],
    sw: usize,
) {
    assert!(fits(d) && qs.len() >= Q_TILE * d);
    assert!(sw >= (hi - lo).div_ceil(KEY_TILE) * KEY_TILE && scores.len() >= Q_TILE * sw);
    let n = keys.len() / d;
    let chunks = d / 8;
    // Queries 2p and 2p+1 side by side, chunk by chunk.
    let mut qp = [_mm512_setzero_ps(); 2 * 32];
    assert!(chunks <= 32, "head size above 256");
    for p in 0..2 {
        for c in 0..chunks {
            let a = _mm256_loadu_ps(qs.as_ptr().add(2 * p * d + 8 * c));
            let b = _mm256_loadu_ps(qs.as_ptr().add((2 * p + 1) * d + 8 * c));
            qp[p * 32 + c] = join(a, b);
        }
    }
    for j0 in (lo..hi).step_by(8) {
        // x[t][k]: the 8-lane chain of query t and key j0 + k.
        let mut x = [[_mm256_setzero_ps(); 8]; Q_TILE];
        for k in 0..8 {
            let j = j0 + k;
            if j >= n {
                break;
            }
            let key = keys.as_ptr().add(j * d);
            let mut acc = [_mm512_setzero_ps(); 2];
            for c in 0..chunks {
                let kc = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
                    key.add(8 * c) as *const f64
                )));
                for (p, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(qp[p * 32 + c], kc, *a);
                }
            }
            for (p, a) in acc.iter().enumerate() {
                x[2 * p][k] = _mm512_castps512_ps256(*a);
                x[2 * p + 1][k] =
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
            }
        }
        for (t, xt) in x.iter().enumerate() {
            let at = scores.as_mut_ptr().add(t * sw + j0 - lo);
            _mm256_storeu_ps(at, hsum8_each(xt));
        }
    }
}

/// `a` in lanes 0..8, `b` in 8..16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn join(a: __m256, b: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(a)),
        _mm256_castps_pd(b),
    ))
}

/// `hsum8` of each of eight vectors, in order: `t = [a0+a4, a1+a5, a2+a6, a3+a7]`, then
/// `(t0 + t2) + (t1 + t3)` (llama.cpp's x86 `hsum`), eight at once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn hsum8_each(x: &[__m256; 8]) -> __m256 {
    // [t of a | t of b] for vectors a, b.
    let half = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    };
    let (t01, t23) = (half(x[0], x[1]), half(x[2], x[3]));
    let (t45, t67) = (half(x[4], x[5]), half(x[6], x[7]));
    // [t0+t2, t1+t3] of each vector: lanes (a a c c | b b d d) from t01, t23.
    let pairs = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    };
    let (s0, s1) = (pairs(t01, t23), pairs(t45, t67));
    // (t0+t2) + (t1+t3): lanes (0 2 4 6 | 1 3 5 7) of the vectors.
    let r = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(s0, s1),
        _mm256_shuffle_ps::<0b11_01_11_01>(s0, s1),
    );
    _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// `pv_tile::<_, 8>`: `out[t][c] = Σ_j w[t][j] · values[lo + j][c]` for the `Q_TILE` weight
/// rows of `w` (row stride `sw`, `span` live columns), position `base + lo + j` in lane
/// `(base + lo + j) % 8`, the lanes summed as `hsum8`.
///
/// # Safety
/// The CPU must have AVX-512 F (and AVX2, FMA); `fits(d)`; `w` holds `Q_TILE` rows of `sw ≥
/// span`, `values` rows `lo..lo + span` of `d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn pv_tile8(
    w: &[f32],
    sw: usize,
    values: &[f32],
    d: usize,
    lo: usize,
    span: usize,
    base: usize,
) -> Vec<f32> {
    assert!(fits(d) && w.len() >= (Q_TILE - 1) * sw + span && values.len() >= (lo + span) * d);
    let mut out = vec![0f32; Q_TILE * d];
    // The first position of lane 0's chain, relative to j: j ≡ (8 − (base + lo) % 8) % 8.
    let first = (8 - (base + lo) % 8) % 8;
    for c0 in (0..d).step_by(16) {
        // Two queries a pass: 16 accumulators (query, lane) stay in registers.
        for t0 in (0..Q_TILE).step_by(2) {
            let mut acc = [[_mm512_setzero_ps(); 8]; 2];
            // Positions in runs of eight, lane `i` at `j = j8 + (first + i) % 8`: each lane's
            // chain still takes its positions in increasing order.
            for j8 in (0..span).step_by(8) {
                for i in 0..8 {
                    let j = j8 + (first + i) % 8;
                    if j >= span {
                        continue;
                    }
                    let v = _mm512_loadu_ps(values.as_ptr().add((lo + j) * d + c0));
                    for (q, a) in acc.iter_mut().enumerate() {
                        let wj = _mm512_set1_ps(*w.get_unchecked((t0 + q) * sw + j));
                        a[i] = _mm512_fmadd_ps(wj, v, a[i]);
                    }
                }
            }
            for (q, a) in acc.iter().enumerate() {
                let t = [
                    _mm512_add_ps(a[0], a[4]),
                    _mm512_add_ps(a[1], a[5]),
                    _mm512_add_ps(a[2], a[6]),
                    _mm512_add_ps(a[3], a[7]),
                ];
                let sum = _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]));
                _mm512_storeu_ps(out.as_mut_ptr().add((t0 + q) * d + c0), sum);
            }
        }
    }
    out
}
