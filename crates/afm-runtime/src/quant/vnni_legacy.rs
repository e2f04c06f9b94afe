//! The 32-weight kernels again, for CPUs with AVX-512 VNNI (256-bit forms, AVX512VL): one
//! `vpdpbusd` replaces `maddubs`+`madd`, and a byte-masked add replaces the five-instruction
//! expansion of the Q5 high bits. `vpdpbusd` sums into i32 without i16 saturation, so Q8_0
//! joins the unsigned formats as `q + 128` with offset −128·d.
//!
//! Same math and results (up to float rounding) as `avx2_legacy`; only entered through
//! `RowKernel::for_type` once `Isa::Avx512Vnni` was detected.

use super::activations::{Q8Row, Q8Rows};
use super::avx2_legacy::{act_ds, act_q, hsum, nibbles, rows};
use super::kernel::with_tile;
use std::arch::x86_64::*;

/// A block with unsigned values: `w = d·q + m`, `m` stored or `OFFSET·d`.
trait Block {
    const BYTES: usize;
    /// Multiplies the accumulated `scales()[1]·s_x` lane (see `avx2_legacy::AffineBlock`).
    const OFFSET: f32;
    /// Whether the block stores `m` after `d` (else `m = OFFSET·d`).
    const HAS_MIN: bool;
    unsafe fn values(p: *const u8) -> __m256i;
    unsafe fn scales(p: *const u8) -> __m128;
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q5_1;
struct Q8_0;

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn scale_d(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned()))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn scale_dm(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
}

/// Nibbles at `qs` plus 16 wherever the matching bit of the u32 at `qh` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn five_bit(qh: *const u8, qs: *const u8) -> __m256i {
    let high: __mmask32 = (qh as *const u32).read_unaligned();
    let low = nibbles(qs);
    _mm256_mask_add_epi8(low, high, low, _mm256_set1_epi8(16))
}

macro_rules! block {
    ($t:ty, $bytes:expr, $offset:expr, |$p:ident| $values:expr, $scales:ident) => {
        impl Block for $t {
            const BYTES: usize = $bytes;
            const OFFSET: f32 = $offset;
            const HAS_MIN: bool = $offset == 1.0;
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn values($p: *const u8) -> __m256i {
                $values
            }
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn scales(p: *const u8) -> __m128 {
                $scales(p)
            }
        }
    };
}

block!(Q4_0, 18, -8.0, |p| nibbles(p.add(2)), scale_d);
block!(Q4_1, 20, 1.0, |p| nibbles(p.add(4)), scale_dm);
block!(Q5_0, 22, -16.0, |p| five_bit(p.add(2), p.add(6)), scale_d);
block!(Q5_1, 24, 1.0, |p| five_bit(p.add(4), p.add(8)), scale_dm);
block!(
    Q8_0,
    34,
    -128.0,
    |p| _mm256_xor_si256(
        _mm256_loadu_si256(p.add(2) as *const __m256i),
        _mm256_set1_epi8(-128)
    ),
    scale_d
);

/// Weight block `k` into `acc` (`d·d_x·Σq·q_x`) and `corr` (lane 1: `m·s_x`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn step<B: Block, const NB: usize>(
    w: &[u8],
    k: usize,
    xs: &[Q8Row; NB],
    acc: &mut [__m256; NB],
    corr: &mut [__m128; NB],
) {
    let p = w.as_ptr().add(k * B::BYTES);
    let (q, sc) = (B::values(p), B::scales(p));
    for j in 0..NB {
        let prod = _mm_mul_ps(sc, act_ds(&xs[j], k));
        let dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, act_q(&xs[j], k));
        acc[j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), _mm256_cvtepi32_ps(dot), acc[j]);
        corr[j] = _mm_add_ps(corr[j], prod);
    }
}

/// `d` and `m` of the eight blocks from `p` on, in block order (`m = d` when not stored).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn scales8<B: Block>(p: *const u8) -> (__m256, __m256) {
    if B::HAS_MIN {
        let u = |b: usize| (p.add(b * B::BYTES) as *const i32).read_unaligned();
        let v = _mm256_setr_epi32(u(0), u(1), u(2), u(3), u(4), u(5), u(6), u(7));
        let lo = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
        let hi = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
        deinterleave(lo, hi)
    } else {
        let h = |b: usize| (p.add(b * B::BYTES) as *const i16).read_unaligned();
        let d = _mm256_cvtph_ps(_mm_setr_epi16(
            h(0),
            h(1),
            h(2),
            h(3),
            h(4),
            h(5),
            h(6),
            h(7),
        ));
        (d, d)
    }
}

/// `[a0 b0 a1 b1 a2 b2 a3 b3]`, `[a4 b4 … a7 b7]` → `[a0..a7]`, `[b0..b7]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn deinterleave(lo: __m256, hi: __m256) -> (__m256, __m256) {
    // The in-lane shuffle leaves 64-bit pairs in order 0,2,1,3; the permute restores 0,1,2,3.
    let a = _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8);
    let b = _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8);
    (_mm256_castpd_ps(a), _mm256_castpd_ps(b))
}

/// Lane b = the sum of the eight lanes of `v[b]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn reduce8(v: &[__m256i; 8]) -> __m256i {
    let a0 = _mm256_hadd_epi32(v[0], v[1]);
    let a1 = _mm256_hadd_epi32(v[2], v[3]);
    let a2 = _mm256_hadd_epi32(v[4], v[5]);
    let a3 = _mm256_hadd_epi32(v[6], v[7]);
    // Each 128-bit half now holds one half-sum per block, blocks 0..3 and 4..7.
    let b0 = _mm256_hadd_epi32(a0, a1);
    let b1 = _mm256_hadd_epi32(a2, a3);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(b0, b1, 0x20),
        _mm256_permute2x128_si256(b0, b1, 0x31),
    )
}

/// Weight blocks `k0..k0+8` against `NB` rows, the float work done once per eight blocks:
/// `acc += d_w·d_x·Σq·q_x` and `corr += m·s_x`, one lane per block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group8<B: Block, const NB: usize>(
    w: &[u8],
    k0: usize,
    xs: &[Q8Row; NB],
    acc: &mut [__m256; NB],
    corr: &mut [__m256; NB],
) {
    let p = w.as_ptr().add(k0 * B::BYTES);
    let (dw, mw) = scales8::<B>(p);
    let mut q = [_mm256_setzero_si256(); 8];
    for (b, qb) in q.iter_mut().enumerate() {
        *qb = B::values(p.add(b * B::BYTES));
    }
    for j in 0..NB {
        let mut v = [_mm256_setzero_si256(); 8];
        for b in 0..8 {
            v[b] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q[b], act_q(&xs[j], k0 + b));
        }
        let ds = xs[j].ds.as_ptr().add(k0) as *const f32;
        let (dx, sx) = deinterleave(_mm256_loadu_ps(ds), _mm256_loadu_ps(ds.add(8)));
        let dots = _mm256_cvtepi32_ps(reduce8(&v));
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), dots, acc[j]);
        corr[j] = _mm256_fmadd_ps(mw, sx, corr[j]);
    }
}

/// One weight row against `NB` activation rows: groups of eight blocks, then the remaining
/// blocks one at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<B: Block, const NB: usize>(w: &[u8], xs: &[Q8Row; NB]) -> [f32; NB] {
    let blocks = w.len() / B::BYTES;
    let mut acc8 = [_mm256_setzero_ps(); NB];
    let mut corr8 = [_mm256_setzero_ps(); NB];
    let mut k = 0;
    while k + 8 <= blocks {
        group8::<B, NB>(w, k, xs, &mut acc8, &mut corr8);
        k += 8;
    }
    let mut acc = [_mm256_setzero_ps(); NB];
    let mut corr = [_mm_setzero_ps(); NB];
    while k < blocks {
        step::<B, NB>(w, k, xs, &mut acc, &mut corr);
        k += 1;
    }
    let mut out = [0f32; NB];
    for j in 0..NB {
        let offset = _mm_cvtss_f32(_mm_movehdup_ps(corr[j])) + hsum(corr8[j]);
        out[j] = hsum(_mm256_add_ps(acc[j], acc8[j])) + B::OFFSET * offset;
    }
    out
}

macro_rules! entry {
    ($name:ident, $block:ty) => {
        pub(super) fn $name(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
            let blocks = w.len() / <$block as Block>::BYTES;
            with_tile!(out.len(), NB => {
                let xs = rows::<NB>(x, i0, blocks);
                // SAFETY: selected by `RowKernel::for_type` only when AVX-512 VNNI/BW/VL and
                // AVX2/FMA/F16C are present; `rows` checked the activation rows' lengths.
                out.copy_from_slice(&unsafe { tile::<$block, NB>(w, &xs) });
            })
        }
    };
}

entry!(dot_q4_0, Q4_0);
entry!(dot_q4_1, Q4_1);
entry!(dot_q5_0, Q5_0);
entry!(dot_q5_1, Q5_1);
entry!(dot_q8_0, Q8_0);
