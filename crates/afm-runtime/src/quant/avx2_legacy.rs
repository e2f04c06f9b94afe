//! AVX2 dot kernels for the 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against Q8
//! activation rows. Each weight block is decoded once into 32 bytes and multiplied against up
//! to `MAX_TILE` activation rows with `maddubs` (u8 × i8 → i16 pairs) and `madd` (→ i32).
//!
//! The 4- and 5-bit formats keep their values unsigned (0..15, 0..31: no i16 saturation) and
//! fold the block offset in through the activation block sum `s = d_x·Σq_x`:
//! `Σ (scale·q + offset)·d_x·q_x = scale·d_x·Σ q·q_x + offset·s`.
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
unsafe fn nibbles(p: *const u8) -> __m256i {
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

/// A block format with unsigned values: `w = scale·q + offset`.
trait AffineBlock {
    const BYTES: usize;
    /// The 32 values, `scale` and `offset` of the block at `p`.
    unsafe fn decode(p: *const u8) -> (__m256i, f32, f32);
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q5_1;

impl AffineBlock for Q4_0 {
    const BYTES: usize = 18;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(p: *const u8) -> (__m256i, f32, f32) {
        let d = f16_load(p);
        (nibbles(p.add(2)), d, -8.0 * d)
    }
}

impl AffineBlock for Q4_1 {
    const BYTES: usize = 20;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(p: *const u8) -> (__m256i, f32, f32) {
        (nibbles(p.add(4)), f16_load(p), f16_load(p.add(2)))
    }
}

impl AffineBlock for Q5_0 {
    const BYTES: usize = 22;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(p: *const u8) -> (__m256i, f32, f32) {
        let d = f16_load(p);
        (
            _mm256_or_si256(nibbles(p.add(6)), fifth_bits(p.add(2))),
            d,
            -16.0 * d,
        )
    }
}

impl AffineBlock for Q5_1 {
    const BYTES: usize = 24;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(p: *const u8) -> (__m256i, f32, f32) {
        let q = _mm256_or_si256(nibbles(p.add(8)), fifth_bits(p.add(4)));
        (q, f16_load(p), f16_load(p.add(2)))
    }
}

/// One weight row of an affine format against `NB` activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_affine<B: AffineBlock, const NB: usize>(w: &[u8], xs: &[Q8Row; NB]) -> [f32; NB] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); NB];
    let mut corr = [0f32; NB];
    for k in 0..w.len() / B::BYTES {
        let (q, scale, offset) = B::decode(w.as_ptr().add(k * B::BYTES));
        for j in 0..NB {
            let xq = _mm256_loadu_si256(xs[j].qs.as_ptr().add(k * Q8_BLOCK) as *const __m256i);
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), ones);
            let dd = _mm256_set1_ps(scale * *xs[j].d.get_unchecked(k));
            acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p), acc[j]);
            corr[j] += offset * *xs[j].s.get_unchecked(k);
        }
    }
    let mut out = [0f32; NB];
    for j in 0..NB {
        out[j] = hsum(acc[j]) + corr[j];
    }
    out
}

/// Q8_0 weights are signed: multiply |w| by x carrying w's sign, so `maddubs` sees u8 × i8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q8_0<const NB: usize>(w: &[u8], xs: &[Q8Row; NB]) -> [f32; NB] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); NB];
    for k in 0..w.len() / 34 {
        let p = w.as_ptr().add(k * 34);
        let d = f16_load(p);
        let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
        let aq = _mm256_sign_epi8(q, q);
        for j in 0..NB {
            let xq = _mm256_loadu_si256(xs[j].qs.as_ptr().add(k * Q8_BLOCK) as *const __m256i);
            let sx = _mm256_sign_epi8(xq, q);
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones);
            let dd = _mm256_set1_ps(d * *xs[j].d.get_unchecked(k));
            acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p), acc[j]);
        }
    }
    let mut out = [0f32; NB];
    for j in 0..NB {
        out[j] = hsum(acc[j]);
    }
    out
}

/// The activation rows `i0..i0+NB`, after checking they are as long as the weight row.
fn rows<const NB: usize>(x: &Q8Rows, i0: usize, w_blocks: usize) -> [Q8Row<'_>; NB] {
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
