//! MXFP4 (OCP microscaling FP4, GGML type 39): decoding, bit-exact with GGML's
//! `dequantize_row_mxfp4`, and the dot product against f32 activations, portable and AVX2
//! (llama.cpp's CPU backend uses Q8_0 activation blocks instead; [`dot_mxfp4`] says why this
//! does not).
//!
//! ```text
//! 17 B per 32 weights: u8 e | u8 qs[16]
//! w[j] = kvalues[q_j] · 2^(e − 128)       kvalues: E2M1 values doubled, so the half is in the
//!                                         exponent (GGML_E8M0_TO_FP32_HALF)
//! q_j = qs[j] & 0xF (j < 16), qs[j − 16] >> 4 (j ≥ 16)
//! ```
//! DeepSeek V4 and gpt-oss GGUFs store their routed experts this way.

/// Weights per block and bytes per block.
const QK: usize = 32;
const BLOCK_BYTES: usize = 17;

/// E2M1 code → value × 2 (`kvalues_mxfp4` in ggml-common.h).
const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^(e − 128)` as GGML computes it: by placing bits, so e = 0 and 1 give the subnormals
/// 2^-128 and 2^-127 exactly.
#[inline(always)]
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

pub(super) fn dequantize_mxfp4(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(QK)) {
        let d = e8m0_half(b[0]);
        let (lo, hi) = y.split_at_mut(QK / 2);
        for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[1..]) {
            *l = KVALUES[(q & 0x0F) as usize] as f32 * d;
            *h = KVALUES[(q >> 4) as usize] as f32 * d;
        }
    }
}

/// `out[j] = w · x[(i0+j)·cols ..][..cols]` with f32 activations: each block is decoded once
/// (exact: every MXFP4 value is an f32) and used against every row of the tile.
///
/// llama.cpp rounds the activations to Q8_0 blocks first. Measured on the tiny DeepSeek V4
/// GGUF, whose experts are MXFP4: with f32 activations afm matches transformers to 1.5e-6 by
/// prefill and decode; with Q8 blocks decode drifts to 0.47 relative error and 4 of 144
/// argmaxes flip (a routing or top-k choice changes), so the exact product is used here.
pub(super) fn dot_mxfp4(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    // Eight partial sums per row, so the products vectorize; `out` holds at most MAX_TILE rows.
    let mut acc = [[0f32; 8]; super::MAX_TILE];
    let mut block = [0f32; QK];
    for (k, b) in w.chunks_exact(BLOCK_BYTES).enumerate() {
        dequantize_mxfp4(b, &mut block);
        for (j, a) in acc.iter_mut().enumerate().take(out.len()) {
            let start = (i0 + j) * cols + k * QK;
            let xr = &x[start..start + QK];
            for (wc, xc) in block.chunks_exact(8).zip(xr.chunks_exact(8)) {
                for l in 0..8 {
                    a[l] += wc[l] * xc[l];
                }
            }
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = a.iter().sum();
    }
}

/// The same product with AVX2: a block's 32 codes go through `pshufb` on [`KVALUES`], are
/// widened to f32 and scaled (exactly, by a power of two), then meet up to `MAX_TILE` rows.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::{e8m0_half, BLOCK_BYTES, KVALUES, QK};
    use crate::quant::avx2_legacy::hsum;
    use crate::quant::kernel::with_tile;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen8(codes: __m128i, d: __m256) -> __m256 {
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), d)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const NB: usize>(w: &[u8], x: &[f32], cols: usize, i0: usize) -> [f32; NB] {
        let table = _mm_loadu_si128(KVALUES.as_ptr() as *const __m128i);
        let low = _mm_set1_epi8(0x0f);
        let xp: [*const f32; NB] = std::array::from_fn(|j| x.as_ptr().add((i0 + j) * cols));
        let mut acc = [[_mm256_setzero_ps(); 2]; NB];
        for (k, b) in w.chunks_exact(BLOCK_BYTES).enumerate() {
            let d = _mm256_set1_ps(e8m0_half(b[0]));
            let qs = _mm_loadu_si128(b.as_ptr().add(1) as *const __m128i);
            let lo = _mm_shuffle_epi8(table, _mm_and_si128(qs, low));
            let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), low));
            let wv = [
                widen8(lo, d),
                widen8(_mm_srli_si128(lo, 8), d),
                widen8(hi, d),
                widen8(_mm_srli_si128(hi, 8), d),
            ];
            let c = k * QK;
            for j in 0..NB {
                for (q, wq) in wv.iter().enumerate() {
                    let xq = _mm256_loadu_ps(xp[j].add(c + 8 * q));
                    acc[j][q & 1] = _mm256_fmadd_ps(*wq, xq, acc[j][q & 1]);
                }
            }
        }
        std::array::from_fn(|j| hsum(_mm256_add_ps(acc[j][0], acc[j][1])))
    }

    pub(in crate::quant) fn dot_mxfp4(
        w: &[u8],
        x: &[f32],
        cols: usize,
        i0: usize,
        out: &mut [f32],
    ) {
        assert!(
            cols.is_multiple_of(QK),
            "MXFP4 rows are whole blocks of {QK}"
        );
        assert_eq!(w.len(), cols / QK * BLOCK_BYTES, "weight row length");
        assert!(
            x.len() >= (i0 + out.len()) * cols,
            "activation rows out of range"
        );
        with_tile!(out.len(), NB => {
            // SAFETY: selected by `RowKernel::for_type` only when AVX2/FMA/F16C are present; the
            // asserts above keep every load inside `w` and `x`.
            out.copy_from_slice(&unsafe { tile::<NB>(w, x, cols, i0) });
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, Isa, RowKernel};
    use crate::DType;

    /// Blocks and their decoding by gguf-py 0.19 (llama.cpp b-0.3.36)'s `gguf.quants.dequantize(.., MXFP4)` (numpy,
    /// llama.cpp's own Python reference), printed by:
    ///
    /// ```text
    /// b = np.array(BLOCKS, np.uint8).reshape(-1, 17)
    /// print(gguf.quants.dequantize(b, gguf.GGMLQuantizationType.MXFP4).tolist())
    /// ```
    /// Block 0: e = 127 (scale 1/2), codes 0..15 twice; block 1: e = 0 (2^-128, subnormal),
    /// block 2: e = 1 (2^-127), block 3: e = 130 (scale 4), block 4: e = 255 (2^127).
    #[rustfmt::skip]
    const BLOCKS: [u8; 5 * 17] = [
        127, 0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
        0, 0x17, 0x17, 0x71, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff,
        1, 0x17, 0x17, 0x71, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff,
        130, 0x9e, 0x2c, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x35, 0x4b,
        255, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80,
    ];

    fn gguf_py_reference() -> Vec<f32> {
        let text = include_str!("mxfp4_reference.txt");
        text.split_whitespace()
            .map(|v| v.parse::<f32>().expect("reference value"))
            .collect()
    }

    #[test]
    fn dequantize_matches_gguf_py_bit_for_bit() {
        let want = gguf_py_reference();
        let mut got = vec![0f32; 5 * QK];
        dequantize_row(DType::Mxfp4, &BLOCKS, &mut got);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "value {i}: {g:e} vs gguf-py {w:e}"
            );
        }
    }

    #[test]
    fn dot_equals_the_dequantized_weights_times_f32_activations() {
        // Two rows of two blocks each (blocks 0, 3 and 3, 0), against three activation rows.
        let row = |a: usize, b: usize| {
            [&BLOCKS[a * 17..(a + 1) * 17], &BLOCKS[b * 17..(b + 1) * 17]].concat()
        };
        let x: Vec<f32> = (0..3 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let RowKernel::Float(kernel) = RowKernel::for_type(DType::Mxfp4, Isa::best()) else {
            panic!("MXFP4 dots f32 activations");
        };
        for wr in [row(0, 3), row(3, 0)] {
            let mut dense = vec![0f32; 64];
            dequantize_row(DType::Mxfp4, &wr, &mut dense);
            let mut got = [0f32; 3];
            kernel(&wr, &x, 64, 0, &mut got);
            for (r, g) in got.iter().enumerate() {
                let want: f32 = (0..64).map(|c| dense[c] * x[r * 64 + c]).sum();
                assert!(
                    (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "row {r}: {g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_row_that_is_not_whole_blocks_has_no_size() {
        assert_eq!(DType::Mxfp4.row_bytes(64), Some(34));
        assert_eq!(DType::Mxfp4.row_bytes(16), None);
        assert_eq!(DType::from_ggml_id(39), Some(DType::Mxfp4));
    }

    /// The AVX2 kernel (where this CPU has it) equals the portable one on every tile size, over
    /// blocks of every code and a spread of exponents.
    #[test]
    fn every_kernel_agrees_with_the_portable_one() {
        let cols = 128;
        let rows: Vec<Vec<u8>> = (0..3)
            .map(|r| {
                (0..cols / QK)
                    .flat_map(|k| {
                        let mut b = vec![(110 + 5 * k + r) as u8];
                        b.extend((0..16).map(|i| ((i * 37 + k * 11 + r * 5) % 256) as u8));
                        b
                    })
                    .collect()
            })
            .collect();
        let x: Vec<f32> = (0..4 * cols)
            .map(|i| ((i * 29 % 97) as f32 - 48.0) / 5.0)
            .collect();
        let RowKernel::Float(best) = RowKernel::for_type(DType::Mxfp4, Isa::best()) else {
            panic!("MXFP4 dots f32 activations");
        };
        for w in &rows {
            for n in 1..=4 {
                let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
                dot_mxfp4(w, &x, cols, 0, &mut want);
                best(w, &x, cols, 0, &mut got);
                for (g, v) in got.iter().zip(&want) {
                    assert!(
                        (g - v).abs() <= 1e-5 * v.abs().max(1.0),
                        "tile {n}: {g} vs {v}"
                    );
                }
            }
        }
    }
}
