//! Activation rows quantized to 8 bits once per matmul call, so the weight kernels can use
//! integer dot products (llama.cpp's approach and accuracy).
//!
//! ```text
//! Q8Rows  (for the 32-weight formats), per 32 values:  [d, s = d·Σq]: [f32; 2] | q: i8[32]
//! Q8kRows (for the K-quants),          per 256 values: d: f32 | q: i8[256] | bsums: i16[16]
//! ```
//! `x ≈ d·q` with `q = round(x · 127/max|x|)`, half to even. The rounding reproduces llama.cpp's
//! x86 build bit for bit (its `quantize_row_q8_0/q8_1/q8_K`), so afm and llama.cpp multiply the
//! same integers and differ only in float summation order:
//! - Q8 blocks store `d = max|x|/127` rounded to f16, as llama.cpp's `block_q8_0/q8_1` do;
//! - the block sum `s` is `d·Σq` rounded to f16 for the formats that meet it through a per-block
//!   minimum (Q4_1, Q5_1: llama.cpp's `block_q8_1`), and the exact `d₁₆·Σq` otherwise (the
//!   offset formats Q4_0/Q5_0, which llama.cpp folds into the integer sum instead);
//! - Q8K blocks keep `d = 1/(127/max|x|)` in f32, as `quantize_row_q8_K` computes it.
//!
//! The sums let kernels fold per-block offsets and minimums in without touching `q` again.

use rayon::prelude::*;

use super::kernel::Isa;

/// Values per Q8 block and per Q8K block.
pub const Q8_BLOCK: usize = 32;
pub const Q8K_BLOCK: usize = 256;

/// `n` activation rows of `cols` values as Q8 blocks of 32 (structure of arrays).
/// How a Q8 block's sum `s` is stored (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSum {
    /// `d₁₆·Σq`, exact in f32.
    Exact,
    /// `d·Σq` rounded to f16, as in llama.cpp's `block_q8_1`.
    Half,
}

impl BlockSum {
    /// The formats with a per-block minimum meet the activation sum as llama.cpp's Q8_1 stores it.
    pub fn for_weight(w: crate::DType) -> Self {
        match w {
            crate::DType::Q4_1 | crate::DType::Q5_1 => BlockSum::Half,
            _ => BlockSum::Exact,
        }
    }
}

pub struct Q8Rows {
    pub(crate) cols: usize,
    pub(crate) qs: Vec<i8>,
    /// `[d, d·Σq]` per block, side by side so a kernel loads both with one instruction.
    pub(crate) ds: Vec<[f32; 2]>,
}

/// `n` activation rows of `cols` values as Q8K blocks of 256.
pub struct Q8kRows {
    pub(crate) cols: usize,
    pub(crate) qs: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) bsums: Vec<i16>,
}

/// One row of `Q8Rows`.
#[derive(Clone, Copy)]
pub(crate) struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub ds: &'a [[f32; 2]],
}

/// One row of `Q8kRows`.
#[derive(Clone, Copy)]
pub(crate) struct Q8kRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub bsums: &'a [i16],
}

impl Q8Rows {
    /// Quantize `x` (`n` rows of `cols`, `cols` a multiple of 32) with exact block sums.
    #[cfg(test)]
    pub fn quantize(x: &[f32], cols: usize, isa: Isa) -> Self {
        Self::quantize_for(x, cols, BlockSum::Exact, isa)
    }

    /// `quantize` with the block sums the weight format `w` expects.
    pub fn quantize_for_weight(x: &[f32], cols: usize, w: crate::DType, isa: Isa) -> Self {
        Self::quantize_for(x, cols, BlockSum::for_weight(w), isa)
    }

    fn quantize_for(x: &[f32], cols: usize, sum: BlockSum, isa: Isa) -> Self {
        assert!(
            cols.is_multiple_of(Q8_BLOCK) && x.len().is_multiple_of(cols.max(1)),
            "Q8Rows: {} values are not whole rows of {cols}, a multiple of {Q8_BLOCK}",
            x.len()
        );
        let nb = x.len() / Q8_BLOCK;
        let mut r = Self {
            cols,
            qs: vec![0; x.len()],
            ds: vec![[0.0; 2]; nb],
        };
        let per = piece_blocks(nb, Q8_BLOCK);
        x.par_chunks(per * Q8_BLOCK)
            .zip(r.qs.par_chunks_mut(per * Q8_BLOCK))
            .zip(r.ds.par_chunks_mut(per))
            .for_each(|((x, qs), ds)| match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `has_avx2` confirmed AVX2, FMA and F16C at run time (`Isa::best`).
                _ if isa.has_avx2() => unsafe { quantize_q8_avx2(x, qs, ds, sum) },
                _ => quantize_q8(x, qs, ds, sum),
            });
        r
    }

    pub(crate) fn row(&self, i: usize) -> Q8Row<'_> {
        let nb = self.cols / Q8_BLOCK;
        Q8Row {
            qs: &self.qs[i * self.cols..(i + 1) * self.cols],
            ds: &self.ds[i * nb..(i + 1) * nb],
        }
    }
}

impl Q8kRows {
    /// Quantize `x` (`n` rows of `cols`, `cols` a multiple of 256).
    pub fn quantize(x: &[f32], cols: usize, isa: Isa) -> Self {
        assert!(
            cols.is_multiple_of(Q8K_BLOCK) && x.len().is_multiple_of(cols.max(1)),
            "Q8kRows: {} values are not whole rows of {cols}, a multiple of {Q8K_BLOCK}",
            x.len()
        );
        let nb = x.len() / Q8K_BLOCK;
        let mut r = Self {
            cols,
            qs: vec![0; x.len()],
            d: vec![0.0; nb],
            bsums: vec![0; nb * 16],
        };
        let per = piece_blocks(nb, Q8K_BLOCK);
        x.par_chunks(per * Q8K_BLOCK)
            .zip(r.qs.par_chunks_mut(per * Q8K_BLOCK))
            .zip(r.d.par_chunks_mut(per))
            .zip(r.bsums.par_chunks_mut(per * 16))
            .for_each(|(((x, qs), d), bsums)| match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `has_avx2` confirmed AVX2 and FMA at run time.
                _ if isa.has_avx2() => unsafe { quantize_q8k_avx2(x, qs, d, bsums) },
                _ => quantize_q8k(x, qs, d, bsums),
            });
        r
    }

    pub(crate) fn row(&self, i: usize) -> Q8kRow<'_> {
        let nb = self.cols / Q8K_BLOCK;
        Q8kRow {
            qs: &self.qs[i * self.cols..(i + 1) * self.cols],
            d: &self.d[i * nb..(i + 1) * nb],
            bsums: &self.bsums[i * nb * 16..(i + 1) * nb * 16],
        }
    }
}

/// Values below which the quantizer stays on one thread: handing a piece to another costs
/// about a microsecond, as long as quantizing ~2,000 values.
const PAR_MIN_VALUES: usize = 4096;

/// Blocks (of `block` values) per parallel piece of an `nb`-block quantization: one piece per
/// pool thread once there are `PAR_MIN_VALUES` values (a batch's rows: the quantizer was ~3%
/// of an 8-row SmolLM2 decode step on one thread while the others waited), else one piece.
fn piece_blocks(nb: usize, block: usize) -> usize {
    if nb * block < PAR_MIN_VALUES {
        return nb.max(1);
    }
    nb.div_ceil(rayon::current_num_threads().max(1)).max(1)
}

/// Quantizes one block; returns `(max|x|/127, 127/max|x|, Σq)` (zeros for an all-zero block).
#[inline(always)]
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32, i32) {
    // For finite floats, |x| orders like its bit pattern; the integer max vectorizes.
    let amax_bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .fold(0, u32::max);
    let amax = f32::from_bits(amax_bits);
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    // Adding 1.5·2²³ rounds to an integer, half to even (exact for |v| ≤ 127), as
    // `_mm256_round_ps(_MM_ROUND_NEAREST)` and llama.cpp's `nearest_int` do.
    const ROUND: f32 = 12_582_912.0;
    let mut sum = 0i32;
    for (qv, &v) in q.iter_mut().zip(x) {
        let r = ((v * id + ROUND) - ROUND) as i32;
        *qv = r as i8;
        sum += r;
    }
    (amax / 127.0, id, sum)
}

/// `quantize_block`'s `(max|x|/127, Σq)` and codes in AVX2 instructions: with the compiler's
/// vectorization of the scalar loop (Rust's saturating float-to-int casts) a 576-wide row took
/// 1.29 ns per value, this 0.40 (the quantizer had been ~4.5% of an 8-row SmolLM2 step). The same codes: `v·id` rounds to the nearest
/// integer, ties to even, either way (`cvtps2dq` in the default rounding mode), and lanes that
/// are not numbers give 0 as the scalar cast does.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    assert!(x.len() == Q8_BLOCK && q.len() == Q8_BLOCK);
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
    // |x| as bits, an unsigned max (as the scalar code's).
    let abs = _mm256_set1_epi32(0x7fff_ffff);
    let bits = |i: usize| _mm256_and_si256(_mm256_castps_si256(v[i]), abs);
    let m = _mm256_max_epu32(
        _mm256_max_epu32(bits(0), bits(1)),
        _mm256_max_epu32(bits(2), bits(3)),
    );
    let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    let amax = f32::from_bits(_mm_cvtsi128_si32(m) as u32);
    let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
    let qi: [__m256i; 4] = std::array::from_fn(|i| {
        let p = _mm256_mul_ps(v[i], id);
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(p, p));
        _mm256_andnot_si256(nan, _mm256_cvtps_epi32(p))
    });
    let s = _mm256_add_epi32(
        _mm256_add_epi32(qi[0], qi[1]),
        _mm256_add_epi32(qi[2], qi[3]),
    );
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    // i32 → i16 → i8 (|q| ≤ 127: no saturation), then the 128-bit lanes back in order.
    let b = _mm256_packs_epi16(
        _mm256_packs_epi32(qi[0], qi[1]),
        _mm256_packs_epi32(qi[2], qi[3]),
    );
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b);
    (amax / 127.0, _mm_cvtsi128_si32(s))
}

/// `v` rounded to the nearest f16 (ties to even), as f32. `F16C`: the caller has F16C, and
/// the conversion is two instructions inline — the `half` crate's call per value was most of
/// the quantizer's time (two per 32-value block).
#[inline(always)]
fn round_f16<const F16C: bool>(v: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if F16C {
        use std::arch::x86_64::*;
        // SAFETY: `F16C` callers run with the feature enabled.
        return unsafe {
            let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v));
            _mm_cvtss_f32(_mm_cvtph_ps(h))
        };
    }
    half::f16::from_f32(v).to_f32()
}

#[inline(always)]
fn quantize_q8_body<const F16C: bool>(
    x: &[f32],
    qs: &mut [i8],
    ds: &mut [[f32; 2]],
    sum_kind: BlockSum,
) {
    let blocks = x.chunks_exact(Q8_BLOCK).zip(qs.chunks_exact_mut(Q8_BLOCK));
    for ((xb, qb), dsb) in blocks.zip(ds.iter_mut()) {
        // `F16C` is only set in the AVX2 copy (`quantize_q8_avx2`).
        #[cfg(target_arch = "x86_64")]
        let (d, sum) = if F16C {
            // SAFETY: the AVX2 copy runs only where AVX2 was detected.
            unsafe { quantize_block_avx2(xb, qb) }
        } else {
            let (d, _, sum) = quantize_block(xb, qb);
            (d, sum)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (d, _, sum) = quantize_block(xb, qb);
        let d16 = round_f16::<F16C>(d);
        let s = match sum_kind {
            BlockSum::Exact => d16 * sum as f32,
            BlockSum::Half => round_f16::<F16C>(d * sum as f32),
        };
        *dsb = [d16, s];
    }
}

#[inline(always)]
fn quantize_q8k_body(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    let blocks = x
        .chunks_exact(Q8K_BLOCK)
        .zip(qs.chunks_exact_mut(Q8K_BLOCK));
    for ((xb, qb), (db, bs)) in blocks.zip(d.iter_mut().zip(bsums.chunks_exact_mut(16))) {
        let (_, id, _) = quantize_block(xb, qb);
        *db = if id > 0.0 { 1.0 / id } else { 0.0 };
        for (b, q16) in bs.iter_mut().zip(qb.chunks_exact(16)) {
            *b = q16.iter().map(|&v| v as i16).sum();
        }
    }
}

fn quantize_q8(x: &[f32], qs: &mut [i8], ds: &mut [[f32; 2]], sum: BlockSum) {
    quantize_q8_body::<false>(x, qs, ds, sum)
}

fn quantize_q8k(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    quantize_q8k_body(x, qs, d, bsums)
}

/// The same body compiled for AVX2 and F16C, with each block in `quantize_block_avx2` and the
/// scales rounded inline; results are identical because every step is the same IEEE operation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8_avx2(x: &[f32], qs: &mut [i8], ds: &mut [[f32; 2]], sum: BlockSum) {
    quantize_q8_body::<true>(x, qs, ds, sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_q8k_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    quantize_q8k_body(x, qs, d, bsums)
}

#[cfg(test)]
mod tests {
    /// The inline F16C rounding is the `half` crate's, through normals, subnormals, ties,
    /// overflow and zero (the quantizer stores its scales this way, as llama.cpp does).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn inline_f16_rounding_equals_half() {
        if crate::quant::Isa::best() == crate::quant::Isa::Scalar {
            return;
        }
        #[target_feature(enable = "f16c")]
        unsafe fn hw(v: f32) -> f32 {
            super::round_f16::<true>(v)
        }
        let mut bits = 0x0000_0000u32;
        while bits < 0x7f80_0000 {
            for v in [f32::from_bits(bits), -f32::from_bits(bits)] {
                // SAFETY: `Isa::best` detected F16C.
                let got = unsafe { hw(v) };
                assert_eq!(
                    got.to_bits(),
                    super::round_f16::<false>(v).to_bits(),
                    "{v:e}"
                );
            }
            bits += 0x0000_1001;
        }
    }

    /// The AVX2 block quantizer gives the scalar one's codes, scale and sum bit for bit:
    /// random blocks at many magnitudes, exact ties (`v·id` at k + ½), zeros, and
    /// blocks holding infinities or NaN (codes 0 wherever `v·id` is not a number).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_block_quantizer_equals_scalar() {
        if crate::quant::Isa::best() == crate::quant::Isa::Scalar {
            return;
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) as u32
        };
        let mut blocks: Vec<[f32; 32]> = Vec::new();
        for scale in [1e-30f32, 1e-6, 0.01, 1.0, 37.0, 1e5, 3e38] {
            for _ in 0..200 {
                blocks.push(std::array::from_fn(|_| {
                    (next() as f32 / u32::MAX as f32 * 2.0 - 1.0) * scale
                }));
            }
        }
        // Ties: amax 127 makes id 1, so k + 0.5 must round to even.
        blocks.push(std::array::from_fn(|i| {
            if i == 0 {
                127.0
            } else {
                (i as f32 - 16.0) + 0.5
            }
        }));
        blocks.push([0.0; 32]);
        // Blocks whose max is below ~3.7e-37 (subnormals among them) are left out: `127/max`
        // overflows and the codes are meaningless on both paths (as in llama.cpp's AVX2
        // quantizer), but their f16 scale is 0, so every product with them is 0 either way.
        let mut special: [f32; 32] = std::array::from_fn(|i| i as f32 - 10.0);
        special[3] = f32::INFINITY;
        blocks.push(special);
        special[3] = f32::NAN;
        blocks.push(special);
        special[3] = 2.0;
        special[7] = -f32::NAN;
        blocks.push(special);
        for (n, x) in blocks.iter().enumerate() {
            let (mut qa, mut qb) = ([0i8; 32], [0i8; 32]);
            let (d, _, sum) = super::quantize_block(x, &mut qa);
            // SAFETY: `Isa::best` detected AVX2.
            let (d2, sum2) = unsafe { avx2(x, &mut qb) };
            assert_eq!(
                (qa, d.to_bits(), sum),
                (qb, d2.to_bits(), sum2),
                "block {n}: {x:?}"
            );
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn avx2(x: &[f32], q: &mut [i8]) -> (f32, i32) {
            super::quantize_block_avx2(x, q)
        }
    }
}
