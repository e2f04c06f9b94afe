//! The 32-weight kernels again, for CPUs with AVX-512 VNNI (256-bit forms, AVX512VL): one
//! `vpdpbusd` replaces `maddubs`+`madd`, and a byte-masked add replaces the five-instruction
//! expansion of the Q5 high bits. `vpdpbusd` sums into i32 without i16 saturation, so Q8_0
//! joins the unsigned formats as `q + 128` with offset −128·d.
//!
//! The same integer lanes and the same float chain as `avx2_legacy` (llama.cpp's summation
//! order), so the results are bit-identical to it; only entered through `RowKernel::for_type`
//! once `Isa::Avx512Vnni` was detected.

use super::activations::{Q8Row, Q8Rows};
use super::avx2_legacy::{act_ds, act_q, hsum, nibbles, rows};
use super::kernel::with_tile;
use std::arch::x86_64::*;

/// A block with unsigned values: `w = d·q + m`, `m` stored or `OFFSET·d`.
pub(super) trait Block {
    const BYTES: usize;
    /// Multiplies the accumulated `scales()[1]·s_x` lane (see `avx2_legacy::AffineBlock`).
    const OFFSET: f32;
    /// Whether the block stores `m` after `d` (else `m = OFFSET·d`).
    const HAS_MIN: bool;
    unsafe fn values(p: *const u8) -> __m256i;
    unsafe fn scales(p: *const u8) -> __m128;
}

pub(super) struct Q4_0;
pub(super) struct Q4_1;
pub(super) struct Q5_0;
pub(super) struct Q5_1;
pub(super) struct Q8_0;

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

/// One weight row against `NB` activation rows, in `avx2_legacy`'s order: per block, eight
/// exact i32 lanes, one FMA into a single f32 chain per row, and `Σ m·s_x` block by block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<B: Block, const NB: usize>(w: &[u8], xs: &[Q8Row; NB]) -> [f32; NB] {
    let mut acc = [_mm256_setzero_ps(); NB];
    let mut summs = [0f32; NB];
    // `values` are unsigned; the offset formats become signed (Q8_0: `q + 128` back to `q`).
    let to_signed = _mm256_set1_epi8((-B::OFFSET) as i32 as i8);
    for k in 0..w.len() / B::BYTES {
        let p = w.as_ptr().add(k * B::BYTES);
        // In-process A/B, one-stream SmolLM2 step: 2–8% faster with it.
        super::prefetch_ahead(p, 1);
        let (q, sc) = (B::values(p), B::scales(p));
        let signed = _mm256_sub_epi8(q, to_signed);
        let magnitude = _mm256_abs_epi8(signed);
        for j in 0..NB {
            let prod = _mm_mul_ps(sc, act_ds(&xs[j], k));
            let x = act_q(&xs[j], k);
            let lanes = if B::HAS_MIN {
                summs[j] += _mm_cvtss_f32(_mm_movehdup_ps(prod));
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x)
            } else {
                _mm256_dpbusd_epi32(
                    _mm256_setzero_si256(),
                    magnitude,
                    _mm256_sign_epi8(x, signed),
                )
            };
            let dot = _mm256_cvtepi32_ps(lanes);
            acc[j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), dot, acc[j]);
        }
    }
    std::array::from_fn(|j| hsum(acc[j]) + summs[j])
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
