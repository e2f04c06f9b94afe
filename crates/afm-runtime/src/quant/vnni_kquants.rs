//! The Q4_K and Q6_K one-row kernels (1–4 activation rows per call) again, for CPUs with
//! AVX-512 VNNI: two 32-value sub-blocks a 512-bit register, one `vpdpbusd` for what took a
//! `maddubs` and a `madd` per sub-block, each sub-block's (or 16-value group's) scale applied
//! per lane with `vpmulld`. A superblock's integer total is exact however its lanes are summed,
//! and it meets `d·d_x` (then `dmin·d_x` and the mins' total) in `avx2_kquants`' scalar FMAs,
//! so the results are bit-identical to it (and to `vnni_lanes`, docs/DECISIONS.md).

use super::activations::{Q8kRow, Q8kRows, Q8K_BLOCK};
use super::avx2_kquants::{hsum_i128, hsum_i256, mins_dot, rows, scales_mins_k4};
use super::avx2_legacy::f16_load;
use super::kernel::with_tile;
use super::prefetch_ahead;
use std::arch::x86_64::*;

/// 64 activation bytes of row `x` from `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load64(x: &[i8], at: usize) -> __m512i {
    debug_assert!(at + 64 <= x.len());
    _mm512_loadu_si512(x.as_ptr().add(at) as *const __m512i)
}

/// The 32 bytes at `p` in both 256-bit halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn both_halves(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
}

/// Q4_K row against `NB` activation rows: sub-blocks 2c (low nibbles, lanes 0..8) and 2c+1
/// (high nibbles, lanes 8..16) of the same 32 bytes in one register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_q4_k<const NB: usize>(w: &[u8], xs: &[Q8kRow; NB]) -> [f32; NB] {
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [0f32; NB];
    let mut msum = [0i32; NB];
    for k in 0..w.len() / 144 {
        let b = &w[k * 144..(k + 1) * 144];
        prefetch_ahead(b.as_ptr(), 144);
        let (d, dmin) = (f16_load(b.as_ptr()), f16_load(b.as_ptr().add(2)));
        let (sc, mins) = scales_mins_k4(&b[4..16]);
        let mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
        for j in 0..NB {
            msum[j] = hsum_i128(mins_dot(mins16, xs[j].bsums.as_ptr().add(16 * k)));
        }
        let qs = b.as_ptr().add(16);
        let mut sumi = [_mm512_setzero_si512(); NB];
        for c in 0..4 {
            // The high half's bytes shifted down a nibble: weights of sub-block 2c+1.
            let raw = both_halves(qs.add(32 * c));
            let q = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF_0000, raw, 4), m4);
            let scale = _mm512_mask_set1_epi32(
                _mm512_set1_epi32(sc[2 * c] as i32),
                0xFF00,
                sc[2 * c + 1] as i32,
            );
            for j in 0..NB {
                let x = load64(xs[j].qs, k * Q8K_BLOCK + 64 * c);
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
                sumi[j] = _mm512_add_epi32(sumi[j], _mm512_mullo_epi32(dot, scale));
            }
        }
        for j in 0..NB {
            let dx = *xs[j].d.get_unchecked(k);
            let total = _mm512_reduce_add_epi32(sumi[j]);
            acc[j] = (d * dx).mul_add(total as f32, acc[j]);
            acc[j] = (-(dmin * dx)).mul_add(msum[j] as f32, acc[j]);
        }
    }
    acc
}

/// Q6_K row against `NB` activation rows: per half h, weights 128h + 0..64 (from `ql` bytes
/// 0..64, low nibbles) and 128h + 64..128 (the same bytes' high nibbles) in two registers,
/// the fifth and sixth bits from `qh` shifted per 256-bit half; the −32 offset meets `bsums`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_q6_k<const NB: usize>(w: &[u8], xs: &[Q8kRow; NB]) -> [f32; NB] {
    let (m4, m2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x03));
    // Per-16-bit shifts of `qh` for the two halves of each register: bit pairs 0-1 / 2-3
    // top up weights l / l+32, 4-5 / 6-7 weights l+64 / l+96.
    let (shift_a, shift_b) = (
        _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF_0000, 2),
        _mm512_mask_set1_epi16(_mm512_set1_epi16(4), 0xFFFF_0000, 6),
    );
    // Lane i of a dot is 4 values of the run: scale (i / 4) of its 16-value groups.
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let mut acc = [0f32; NB];
    for k in 0..w.len() / 210 {
        let b = w.as_ptr().add(k * 210);
        prefetch_ahead(b, 210);
        let d = f16_load(b.add(208));
        let sc8 = _mm_loadu_si128(b.add(192) as *const __m128i);
        let scales16 = _mm256_cvtepi8_epi16(sc8);
        let scales32 = _mm512_cvtepi8_epi32(sc8);
        let mut offset = [0i32; NB];
        for (j, o) in offset.iter_mut().enumerate() {
            let bs = _mm256_loadu_si256(xs[j].bsums.as_ptr().add(16 * k) as *const __m256i);
            *o = hsum_i256(_mm256_slli_epi32(_mm256_madd_epi16(scales16, bs), 5));
        }
        let mut sumi = [_mm512_setzero_si512(); NB];
        for h in 0..2 {
            let ql = _mm512_loadu_si512(b.add(64 * h) as *const __m512i);
            let qh = both_halves(b.add(128 + 32 * h));
            let top =
                |s: __m512i| _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, s), m2), 4);
            let q = [
                _mm512_or_si512(_mm512_and_si512(ql, m4), top(shift_a)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), top(shift_b)),
            ];
            for (g, qg) in q.iter().enumerate() {
                // Weights 128h + 64g + 0..64: the 16-value groups 8h + 4g .. 8h + 4g + 4.
                let base = _mm512_set1_epi32((8 * h + 4 * g) as i32);
                let scale = _mm512_permutexvar_epi32(_mm512_add_epi32(spread, base), scales32);
                for j in 0..NB {
                    let x = load64(xs[j].qs, k * Q8K_BLOCK + 128 * h + 64 * g);
                    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), *qg, x);
                    sumi[j] = _mm512_add_epi32(sumi[j], _mm512_mullo_epi32(dot, scale));
                }
            }
        }
        for j in 0..NB {
            let dx = *xs[j].d.get_unchecked(k);
            let total = _mm512_reduce_add_epi32(sumi[j]) - offset[j];
            acc[j] = (d * dx).mul_add(total as f32, acc[j]);
        }
    }
    acc
}

pub(super) fn dot_q4_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 144);
        // SAFETY: selected by `RowKernel::for_type` only when AVX-512 VNNI/BW/VL and
        // AVX2/FMA/F16C are present; `rows` checked every activation row covers the weight row.
        out.copy_from_slice(&unsafe { tile_q4_k::<NB>(w, &xs) });
    })
}

pub(super) fn dot_q6_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 210);
        // SAFETY: as in `dot_q4_k`.
        out.copy_from_slice(&unsafe { tile_q6_k::<NB>(w, &xs) });
    })
}
