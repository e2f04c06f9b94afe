//! AVX2 dot kernels for F32, F16 and BF16 weights against f32 activations: eight weights at a
//! time are widened (F16C for f16, a shift for bf16) and used against up to `MAX_TILE` rows.
//!
//! Every function here needs AVX2, FMA and F16C; the safe entry points are reached only
//! through `RowKernel::for_type` after runtime detection.

use super::avx2_legacy::hsum;
use super::kernel::with_tile;
use std::arch::x86_64::*;

/// How a float format widens eight weights starting at element `c`.
trait Widen {
    const BYTES: usize;
    unsafe fn load8(w: *const u8, c: usize) -> __m256;
    fn scalar(w: &[u8], c: usize) -> f32;
}

struct F32;
struct F16;
struct BF16;

impl Widen for F32 {
    const BYTES: usize = 4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(w: *const u8, c: usize) -> __m256 {
        _mm256_loadu_ps(w.add(4 * c) as *const f32)
    }
    fn scalar(w: &[u8], c: usize) -> f32 {
        f32::from_le_bytes([w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]])
    }
}

impl Widen for F16 {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(w: *const u8, c: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * c) as *const __m128i))
    }
    fn scalar(w: &[u8], c: usize) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([w[2 * c], w[2 * c + 1]])).to_f32()
    }
}

impl Widen for BF16 {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(w: *const u8, c: usize) -> __m256 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(2 * c) as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
    }
    fn scalar(w: &[u8], c: usize) -> f32 {
        f32::from_bits((u16::from_le_bytes([w[2 * c], w[2 * c + 1]]) as u32) << 16)
    }
}

/// One weight row against activation rows `i0..i0+NB`, 16 columns per step (two
/// accumulators per row hide the FMA latency), the remainder scalar.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<W: Widen, const NB: usize>(
    w: &[u8],
    x: &[f32],
    cols: usize,
    i0: usize,
) -> [f32; NB] {
    let xp: [*const f32; NB] = std::array::from_fn(|j| x.as_ptr().add((i0 + j) * cols));
    let mut acc = [[_mm256_setzero_ps(); 2]; NB];
    let wp = w.as_ptr();
    let main = cols / 16 * 16;
    let mut c = 0;
    while c < main {
        let w0 = W::load8(wp, c);
        let w1 = W::load8(wp, c + 8);
        for j in 0..NB {
            acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp[j].add(c)), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp[j].add(c + 8)), acc[j][1]);
        }
        c += 16;
    }
    let mut out = [0f32; NB];
    for j in 0..NB {
        out[j] = hsum(_mm256_add_ps(acc[j][0], acc[j][1]));
        for t in main..cols {
            out[j] += W::scalar(w, t) * *xp[j].add(t);
        }
    }
    out
}

fn entry<W: Widen>(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    assert_eq!(w.len(), cols * W::BYTES, "weight row length");
    assert!(
        x.len() >= (i0 + out.len()) * cols,
        "activation rows out of range"
    );
    with_tile!(out.len(), NB => {
        // SAFETY: selected by `RowKernel::for_type` only when AVX2/FMA/F16C are present; the
        // asserts above keep every load inside `w` and `x`.
        out.copy_from_slice(&unsafe { tile::<W, NB>(w, x, cols, i0) });
    })
}

pub(super) fn dot_f32(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    entry::<F32>(w, x, cols, i0, out)
}

pub(super) fn dot_f16(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    entry::<F16>(w, x, cols, i0, out)
}

pub(super) fn dot_bf16(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    entry::<BF16>(w, x, cols, i0, out)
}
