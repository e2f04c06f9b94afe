//! MXFP4 (OCP microscaling FP4, GGML type 39): decoding, bit-exact with GGML's
//! `dequantize_row_mxfp4`, and the scalar dot product against Q8 activation blocks that
//! llama.cpp's CPU backend pairs it with (`ggml_vec_dot_mxfp4_q8_0`).
//!
//! ```text
//! 17 B per 32 weights: u8 e | u8 qs[16]
//! w[j] = kvalues[q_j] · 2^(e − 128)       kvalues: E2M1 values doubled, so the half is in the
//!                                         exponent (GGML_E8M0_TO_FP32_HALF)
//! q_j = qs[j] & 0xF (j < 16), qs[j − 16] >> 4 (j ≥ 16)
//! ```
//! DeepSeek V4 and gpt-oss GGUFs store their routed experts this way.

use super::activations::Q8Rows;

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

/// Σ over blocks of `d_w · d_x · Σ kvalue·x_q`, the integer part exact as in GGML.
pub(super) fn dot_mxfp4(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        let xr = x.row(i0 + j);
        let mut acc = 0f32;
        for (k, b) in w.chunks_exact(BLOCK_BYTES).enumerate() {
            let xq = &xr.qs[k * QK..(k + 1) * QK];
            let (lo, hi) = xq.split_at(QK / 2);
            let sumi: i32 = b[1..]
                .iter()
                .zip(lo.iter().zip(hi))
                .map(|(&q, (&a, &c))| {
                    KVALUES[(q & 0x0F) as usize] as i32 * a as i32
                        + KVALUES[(q >> 4) as usize] as i32 * c as i32
                })
                .sum();
            acc += e8m0_half(b[0]) * xr.ds[k][0] * sumi as f32;
        }
        *o = acc;
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
    fn dot_equals_dequantized_weights_against_the_same_q8_activations() {
        // Two rows of two blocks each (blocks 0, 3 and 3, 0), against three activation rows.
        let row = |a: usize, b: usize| {
            [&BLOCKS[a * 17..(a + 1) * 17], &BLOCKS[b * 17..(b + 1) * 17]].concat()
        };
        let w = [row(0, 3), row(3, 0)];
        let x: Vec<f32> = (0..3 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let q = Q8Rows::quantize(&x, 64, Isa::Scalar);
        let RowKernel::Q8(kernel) = RowKernel::for_type(DType::Mxfp4, Isa::best()) else {
            panic!("MXFP4 pairs with Q8 activations, as in llama.cpp");
        };
        for wr in &w {
            let mut dense = vec![0f32; 64];
            dequantize_row(DType::Mxfp4, wr, &mut dense);
            let mut got = [0f32; 3];
            kernel(wr, &q, 0, &mut got);
            for (r, g) in got.iter().enumerate() {
                // The same sum taken over the decoded weights and decoded Q8 activations.
                let xr = q.row(r);
                let want: f32 = (0..64)
                    .map(|c| dense[c] * xr.qs[c] as f32 * xr.ds[c / 32][0])
                    .sum();
                assert!(
                    (g - want).abs() <= 1e-4 * want.abs().max(1.0),
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
}
