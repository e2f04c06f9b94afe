//! AVX2 dot kernels for the K-quants against Q8K activation rows. Per superblock the sub-block scales are applied in integers
//! (`madd` of i16 scales with i16 pair sums), and for Q4_K, Q5_K and Q6_K the superblock's
//! exact integer total meets `d·d_x` in one scalar FMA per superblock and activation row (then
//! the mins' total `dmin·d_x`): the order `vnni_lanes` keeps too, so a row's result is the same
//! alone and in a batch. Minimums and the Q3_K/Q6_K offsets (−4, −32) meet the activation
//! sums per 16 (`bsums`), never the weights, so the values stay unsigned for `maddubs`.
//!
//! Every function here needs AVX2, FMA and F16C; the safe entry points are reached only
//! through `RowKernel::for_type` after runtime detection.

use super::activations::{Q8kRow, Q8kRows, Q8K_BLOCK};
use super::avx2_legacy::{f16_load, hsum};
use super::kernel::with_tile;
use super::kquants::q3k_scales;
use std::arch::x86_64::*;

/// Q4_K/Q5_K's twelve scale bytes as eight 6-bit scales then eight 6-bit mins
/// (GGML's `utmp` unpacking of `get_scale_min_k4`).
#[inline]
pub(super) fn scales_mins_k4(p: &[u8]) -> ([u8; 8], [u8; 8]) {
    let u = |i: usize| u32::from_le_bytes([p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]]);
    let (u0, u1, u2) = (u(0), u(1), u(2));
    let (k1, k2, k3) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
    let sc_lo = u0 & k1;
    let sc_hi = (u2 & k2) | (((u0 >> 6) & k3) << 4);
    let m_lo = u1 & k1;
    let m_hi = ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4);
    let join = |a: u32, b: u32| (a as u64 | ((b as u64) << 32)).to_le_bytes();
    (join(sc_lo, sc_hi), join(m_lo, m_hi))
}

/// `Σ_g mins[g]·(bsums[2g] + bsums[2g+1])` as four i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn mins_dot(mins: __m128i, bsums: *const i16) -> __m128i {
    let lo = _mm_loadu_si128(bsums as *const __m128i);
    let hi = _mm_loadu_si128(bsums.add(8) as *const __m128i);
    _mm_madd_epi16(mins, _mm_hadd_epi16(lo, hi))
}

/// Exact sum of four i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_i128(v: __m128i) -> i32 {
    let s = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)))
}

/// Exact sum of eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_i256(v: __m256i) -> i32 {
    hsum_i128(_mm_add_epi32(
        _mm256_castsi256_si128(v),
        _mm256_extracti128_si256(v, 1),
    ))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(x: &[i8], at: usize) -> __m256i {
    _mm256_loadu_si256(x.as_ptr().add(at) as *const __m256i)
}

/// Q4_K (`HIGH = false`) or Q5_K (`HIGH = true`) row against `NB` activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q45_k<const HIGH: bool, const NB: usize>(w: &[u8], xs: &[Q8kRow; NB]) -> [f32; NB] {
    let bytes = if HIGH { 176 } else { 144 };
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = [0f32; NB];
    let mut msum = [0i32; NB];
    for k in 0..w.len() / bytes {
        let b = &w[k * bytes..(k + 1) * bytes];
        // In-process A/B, one-stream Qwen2.5-0.5B step: 0.5–2.4% faster with it.
        super::prefetch_ahead(b.as_ptr(), bytes);
        let (d, dmin) = (f16_load(b.as_ptr()), f16_load(b.as_ptr().add(2)));
        let (sc, mins) = scales_mins_k4(&b[4..16]);
        let mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
        for j in 0..NB {
            msum[j] = hsum_i128(mins_dot(mins16, xs[j].bsums.as_ptr().add(16 * k)));
        }
        let qs = b.as_ptr().add(if HIGH { 48 } else { 16 });
        let mut qh = if HIGH {
            _mm256_loadu_si256(b.as_ptr().add(16) as *const __m256i)
        } else {
            m4
        };
        let mut sumi = [_mm256_setzero_si256(); NB];
        for c in 0..4 {
            let q4 = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
            let mut ql = _mm256_and_si256(q4, m4);
            let mut qhi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            if HIGH {
                // Bits 2c and 2c+1 of qh[l] are the fifth bits of the two 32-weight halves.
                let bl = _mm256_and_si256(qh, one);
                let bh = _mm256_and_si256(_mm256_srli_epi16(qh, 1), one);
                ql = _mm256_or_si256(ql, _mm256_slli_epi16(bl, 4));
                qhi = _mm256_or_si256(qhi, _mm256_slli_epi16(bh, 4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            let sl = _mm256_set1_epi16(sc[2 * c] as i16);
            let sh = _mm256_set1_epi16(sc[2 * c + 1] as i16);
            for j in 0..NB {
                let xl = load(xs[j].qs, k * Q8K_BLOCK + 64 * c);
                let xh = load(xs[j].qs, k * Q8K_BLOCK + 64 * c + 32);
                let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(ql, xl), sl);
                let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(qhi, xh), sh);
                sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(pl, ph));
            }
        }
        for j in 0..NB {
            let dx = *xs[j].d.get_unchecked(k);
            acc[j] = (d * dx).mul_add(hsum_i256(sumi[j]) as f32, acc[j]);
            acc[j] = (-(dmin * dx)).mul_add(msum[j] as f32, acc[j]);
        }
    }
    acc
}

/// Q6_K row against `NB` activation rows. Values stay unsigned (0..63); the −32 offset is
/// applied once per superblock as `32·Σ_g scale_g·bsum_g`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q6_k<const NB: usize>(w: &[u8], xs: &[Q8kRow; NB]) -> [f32; NB] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(0x03);
    let mut acc = [0f32; NB];
    for k in 0..w.len() / 210 {
        let b = w.as_ptr().add(k * 210);
        super::prefetch_ahead(b, 210);
        let d = f16_load(b.add(208));
        let sc8 = _mm_loadu_si128(b.add(192) as *const __m128i);
        let scales = _mm256_cvtepi8_epi16(sc8);
        let mut sumi = [_mm256_setzero_si256(); NB];
        for j in 0..NB {
            let bs = _mm256_loadu_si256(xs[j].bsums.as_ptr().add(16 * k) as *const __m256i);
            let offset = _mm256_slli_epi32(_mm256_madd_epi16(scales, bs), 5);
            sumi[j] = _mm256_sub_epi32(sumi[j], offset);
        }
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(b.add(64 * h) as *const __m256i);
            let ql1 = _mm256_loadu_si256(b.add(64 * h + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
            // Bit pairs 0-1, 2-3, 4-5, 6-7 of qh[l] top up weights l, l+32, l+64, l+96.
            let h0 = _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4);
            let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4);
            let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4);
            let h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4);
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), h0),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), h1),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), h2),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), h3),
            ];
            for (g, qg) in q.iter().enumerate() {
                // Scales 2g and 2g+1 of this half cover the low and high 16 weights.
                let s = 8 * h + 2 * g;
                let sg = _mm256_set_m128i(
                    _mm_set1_epi16(*(b.add(192 + s + 1) as *const i8) as i16),
                    _mm_set1_epi16(*(b.add(192 + s) as *const i8) as i16),
                );
                for j in 0..NB {
                    let xq = load(xs[j].qs, k * Q8K_BLOCK + 128 * h + 32 * g);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qg, xq), sg);
                    sumi[j] = _mm256_add_epi32(sumi[j], p);
                }
            }
        }
        for j in 0..NB {
            let dx = *xs[j].d.get_unchecked(k);
            acc[j] = (d * dx).mul_add(hsum_i256(sumi[j]) as f32, acc[j]);
        }
    }
    acc
}

/// `[s_lo ×8 | s_hi ×8]` as i16: the scales of two 16-weight groups, one per 128-bit half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair_scales(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// Q2_K row against `NB` activation rows: 2-bit values, 4-bit scales and mins per 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q2_k<const NB: usize>(w: &[u8], xs: &[Q8kRow; NB]) -> [f32; NB] {
    let m2 = _mm256_set1_epi8(3);
    let mut acc = [_mm256_setzero_ps(); NB];
    let mut accm = [_mm256_setzero_ps(); NB];
    for k in 0..w.len() / 84 {
        let b = w.as_ptr().add(k * 84);
        let (d, dmin) = (f16_load(b.add(80)), f16_load(b.add(82)));
        let sc8 = _mm_loadu_si128(b as *const __m128i);
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(0x0F)));
        let mut sc = [0u8; 16];
        _mm_storeu_si128(
            sc.as_mut_ptr() as *mut __m128i,
            _mm_and_si128(sc8, _mm_set1_epi8(0x0F)),
        );
        let mut sumi = [_mm256_setzero_si256(); NB];
        for j in 0..NB {
            let bs = _mm256_loadu_si256(xs[j].bsums.as_ptr().add(16 * k) as *const __m256i);
            let dm = _mm256_set1_ps(dmin * *xs[j].d.get_unchecked(k));
            accm[j] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bs)), accm[j]);
        }
        for h in 0..2 {
            let mut q2 = _mm256_loadu_si256(b.add(16 + 32 * h) as *const __m256i);
            for s in 0..4 {
                // Bits 2s..2s+1 of qs[32h + l] are weight 128h + 32s + l.
                let q = _mm256_and_si256(q2, m2);
                q2 = _mm256_srli_epi16(q2, 2);
                let g = 8 * h + 2 * s;
                let sg = pair_scales(sc[g] as i16, sc[g + 1] as i16);
                for j in 0..NB {
                    let xq = load(xs[j].qs, k * Q8K_BLOCK + 128 * h + 32 * s);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), sg);
                    sumi[j] = _mm256_add_epi32(sumi[j], p);
                }
            }
        }
        for j in 0..NB {
            let dd = _mm256_set1_ps(d * *xs[j].d.get_unchecked(k));
            acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi[j]), acc[j]);
        }
    }
    let mut out = [0f32; NB];
    for j in 0..NB {
        out[j] = hsum(acc[j]) - hsum(accm[j]);
    }
    out
}

/// Q3_K row against `NB` activation rows. Values are kept as `q + 4` (0..7, the high bit
/// adds 4) and the offset is applied once per superblock as `4·Σ_g scale_g·bsum_g`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q3_k<const NB: usize>(w: &[u8], xs: &[Q8kRow; NB]) -> [f32; NB] {
    let (m2, one) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let mut acc = [_mm256_setzero_ps(); NB];
    for k in 0..w.len() / 110 {
        let blk = &w[k * 110..(k + 1) * 110];
        let b = blk.as_ptr();
        let d = f16_load(b.add(108));
        let sc = q3k_scales(&blk[96..108]);
        let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr() as *const __m128i));
        let mut sumi = [_mm256_setzero_si256(); NB];
        for j in 0..NB {
            let bs = _mm256_loadu_si256(xs[j].bsums.as_ptr().add(16 * k) as *const __m256i);
            let offset = _mm256_slli_epi32(_mm256_madd_epi16(scales, bs), 2);
            sumi[j] = _mm256_sub_epi32(sumi[j], offset);
        }
        // Bit 4h+s of hmask[l] is the high bit of weight 128h + 32s + l.
        let mut hm = _mm256_loadu_si256(b as *const __m256i);
        for h in 0..2 {
            let mut q2 = _mm256_loadu_si256(b.add(32 + 32 * h) as *const __m256i);
            for s in 0..4 {
                let high = _mm256_slli_epi16(_mm256_and_si256(hm, one), 2);
                let q = _mm256_or_si256(_mm256_and_si256(q2, m2), high);
                q2 = _mm256_srli_epi16(q2, 2);
                hm = _mm256_srli_epi16(hm, 1);
                let g = 8 * h + 2 * s;
                let sg = pair_scales(sc[g] as i16, sc[g + 1] as i16);
                for j in 0..NB {
                    let xq = load(xs[j].qs, k * Q8K_BLOCK + 128 * h + 32 * s);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), sg);
                    sumi[j] = _mm256_add_epi32(sumi[j], p);
                }
            }
        }
        for j in 0..NB {
            let dd = _mm256_set1_ps(d * *xs[j].d.get_unchecked(k));
            acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi[j]), acc[j]);
        }
    }
    let mut out = [0f32; NB];
    for j in 0..NB {
        out[j] = hsum(acc[j]);
    }
    out
}

/// The activation rows `i0..i0+NB`, after checking they are as long as the weight row.
pub(super) fn rows<const NB: usize>(x: &Q8kRows, i0: usize, w_blocks: usize) -> [Q8kRow<'_>; NB] {
    assert_eq!(
        w_blocks * Q8K_BLOCK,
        x.cols,
        "weight row and activation row lengths differ"
    );
    std::array::from_fn(|j| x.row(i0 + j))
}

pub(super) fn dot_q2_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 84);
        // SAFETY: as in `dot_q4_k`.
        out.copy_from_slice(&unsafe { tile_q2_k::<NB>(w, &xs) });
    })
}

pub(super) fn dot_q3_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 110);
        // SAFETY: as in `dot_q4_k`.
        out.copy_from_slice(&unsafe { tile_q3_k::<NB>(w, &xs) });
    })
}

pub(super) fn dot_q4_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 144);
        // SAFETY: selected by `RowKernel::for_type` only when AVX2/FMA/F16C are present;
        // `rows` checked every activation row covers the weight row.
        out.copy_from_slice(&unsafe { tile_q45_k::<false, NB>(w, &xs) });
    })
}

pub(super) fn dot_q5_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 176);
        // SAFETY: as in `dot_q4_k`.
        out.copy_from_slice(&unsafe { tile_q45_k::<true, NB>(w, &xs) });
    })
}

pub(super) fn dot_q6_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 210);
        // SAFETY: as in `dot_q4_k`.
        out.copy_from_slice(&unsafe { tile_q6_k::<NB>(w, &xs) });
    })
}
