//! AVX2 dot kernels for the 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against Q8
//! activation rows. Each weight block is decoded once into 32 bytes and multiplied against up
//! to `MAX_TILE` activation rows with `maddubs` (u8 × i8 → i16 pairs) and `madd` (→ i32).
//!
//! Every output is summed in llama.cpp's order (its x86 `ggml_vec_dot_*` and tinyBLAS kernels):
//! per block, eight i32 lanes each holding the products of four consecutive values, scaled by
//! `d_w·d_x` and added with one FMA into a single chain of eight f32 lanes; the lanes are summed
//! at the end, then the formats with a stored minimum add `Σ m·s_x`, summed block by block.
//! Integer lane sums are exact however they are formed, so equal lanes and an equal chain give
//! bit-identical results — which keeps greedy decoding on llama.cpp's path (docs/DECISIONS.md).
//! The offset formats (Q4_0, Q5_0) and Q8_0 are multiplied signed: `|w|` against `x` carrying
//! `w`'s sign, so `maddubs` sees u8 × i8.
//!
//! Every function here needs AVX2, FMA and F16C; the safe entry points are reached only
//! through `RowKernel::for_type` after runtime detection.

use super::activations::{Q8Row, Q8Rows, Q8_BLOCK};
use super::kernel::with_tile;
use std::arch::x86_64::*;

/// An f16 at `p`, widened.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_load(p: *const u8) -> f32 {
    let bits = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Sixteen bytes of nibbles as 32 bytes: weights 0..15 from the low nibbles, 16..31 from the
/// high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
    let x = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Bit j of the little-endian u32 at `p` as 0x10 in byte j (the fifth bit of weight j).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fifth_bits(p: *const u8) -> __m256i {
    let h = (p as *const u32).read_unaligned() as i32;
    // Byte j of the shuffle result holds source byte j/8; OR-ing all bits but j%8 then
    // comparing with 0xFF tests bit j%8.
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(h), spread);
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// A block format `w = d·(q − OFFSET)` (Q4_0, Q5_0) or `w = d·q + m` (Q4_1, Q5_1).
trait AffineBlock {
    const BYTES: usize;
    /// Subtracted from the unsigned values to make them signed; 0 for the formats with `m`.
    const OFFSET: i8;
    /// The 32 unsigned values of the block at `p`.
    unsafe fn values(p: *const u8) -> __m256i;
    /// `[d, m or d, _, _]`, converted with one F16C instruction.
    unsafe fn scales(p: *const u8) -> __m128;
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q5_1;

/// `[d, d, d, d]` from the f16 at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_d(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned()))
}

/// `[d, m, 0, 0]` from the two f16 at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_dm(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
}

impl AffineBlock for Q4_0 {
    const BYTES: usize = 18;
    const OFFSET: i8 = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        nibbles(p.add(2))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(p: *const u8) -> __m128 {
        scale_d(p)
    }
}

impl AffineBlock for Q4_1 {
    const BYTES: usize = 20;
    const OFFSET: i8 = 0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        nibbles(p.add(4))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(p: *const u8) -> __m128 {
        scale_dm(p)
    }
}

impl AffineBlock for Q5_0 {
    const BYTES: usize = 22;
    const OFFSET: i8 = 16;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        _mm256_or_si256(nibbles(p.add(6)), fifth_bits(p.add(2)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(p: *const u8) -> __m128 {
        scale_d(p)
    }
}

impl AffineBlock for Q5_1 {
    const BYTES: usize = 24;
    const OFFSET: i8 = 0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        _mm256_or_si256(nibbles(p.add(8)), fifth_bits(p.add(4)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(p: *const u8) -> __m128 {
        scale_dm(p)
    }
}

/// `[d_x, s_x, 0, 0]` of activation block `k`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn act_ds(x: &Q8Row, k: usize) -> __m128 {
    _mm_castpd_ps(_mm_load_sd(x.ds.as_ptr().add(k) as *const f64))
}

/// Σ of u8 × i8 products of 32 bytes, as eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_u8i8(q: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn act_q(x: &Q8Row, k: usize) -> __m256i {
    _mm256_loadu_si256(x.qs.as_ptr().add(k * Q8_BLOCK) as *const __m256i)
}

/// Σ of i8 × i8 products of 32 bytes, as eight i32 lanes (four consecutive values each).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_i8i8(w: __m256i, x: __m256i) -> __m256i {
    dot_u8i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
}

/// Accumulate weight block `k`: `acc += d·d_x·lanes` (one FMA chain per row) and, for the
/// formats with a minimum, `summs += m·s_x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn affine_step<B: AffineBlock, const NB: usize>(
    w: &[u8],
    k: usize,
    xs: &[Q8Row; NB],
    acc: &mut [__m256; NB],
    summs: &mut [f32; NB],
) {
    let p = w.as_ptr().add(k * B::BYTES);
    let (q, sc) = (B::values(p), B::scales(p));
    let signed = _mm256_sub_epi8(q, _mm256_set1_epi8(B::OFFSET));
    for j in 0..NB {
        let prod = _mm_mul_ps(sc, act_ds(&xs[j], k));
        let lanes = if B::OFFSET == 0 {
            summs[j] += _mm_cvtss_f32(_mm_movehdup_ps(prod));
            dot_u8i8(q, act_q(&xs[j], k))
        } else {
            dot_i8i8(signed, act_q(&xs[j], k))
        };
        let dot = _mm256_cvtepi32_ps(lanes);
        acc[j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), dot, acc[j]);
    }
}

/// One weight row of an affine format against `NB` activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_affine<B: AffineBlock, const NB: usize>(w: &[u8], xs: &[Q8Row; NB]) -> [f32; NB] {
    let mut acc = [_mm256_setzero_ps(); NB];
    let mut summs = [0f32; NB];
    for k in 0..w.len() / B::BYTES {
        affine_step::<B, NB>(w, k, xs, &mut acc, &mut summs);
    }
    std::array::from_fn(|j| hsum(acc[j]) + summs[j])
}

/// Q8_0 weights are signed already.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q8_0<const NB: usize>(w: &[u8], xs: &[Q8Row; NB]) -> [f32; NB] {
    let mut acc = [_mm256_setzero_ps(); NB];
    for k in 0..w.len() / 34 {
        let p = w.as_ptr().add(k * 34);
        let sc = scale_d(p);
        let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
        for j in 0..NB {
            let prod = _mm_mul_ps(sc, act_ds(&xs[j], k));
            let dot = _mm256_cvtepi32_ps(dot_i8i8(q, act_q(&xs[j], k)));
            acc[j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), dot, acc[j]);
        }
    }
    std::array::from_fn(|j| hsum(acc[j]))
}

/// The activation rows `i0..i0+NB`, after checking they are as long as the weight row.
pub(super) fn rows<const NB: usize>(x: &Q8Rows, i0: usize, w_blocks: usize) -> [Q8Row<'_>; NB] {
    assert_eq!(
        w_blocks * Q8_BLOCK,
        x.cols,
        "weight row and activation row lengths differ"
    );
    std::array::from_fn(|j| x.row(i0 + j))
}

macro_rules! affine_entry {
    ($name:ident, $block:ty) => {
        pub(super) fn $name(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
            let blocks = w.len() / <$block as AffineBlock>::BYTES;
            with_tile!(out.len(), NB => {
                let xs = rows::<NB>(x, i0, blocks);
                // SAFETY: selected by `RowKernel::for_type` only when AVX2/FMA/F16C are
                // present; `rows` checked every activation row covers the weight row.
                out.copy_from_slice(&unsafe { tile_affine::<$block, NB>(w, &xs) });
            })
        }
    };
}

affine_entry!(dot_q4_0, Q4_0);
affine_entry!(dot_q4_1, Q4_1);
affine_entry!(dot_q5_0, Q5_0);
affine_entry!(dot_q5_1, Q5_1);

pub(super) fn dot_q8_0(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
    with_tile!(out.len(), NB => {
        let xs = rows::<NB>(x, i0, w.len() / 34);
        // SAFETY: as in `affine_entry`.
        out.copy_from_slice(&unsafe { tile_q8_0::<NB>(w, &xs) });
    })
}
