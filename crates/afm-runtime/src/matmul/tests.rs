//! `matmul` against the dequantize-then-dot reference, for every type, instruction set and
//! a spread of shapes (odd row counts, tiles that do not divide the batch).

use super::*;
use crate::quant::{Q8Rows, Q8kRows};

/// splitmix64: a small deterministic generator, enough for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Roughly normal, in [-3, 3].
    fn normal(&mut self) -> f32 {
        (0..6)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
            .sum::<f32>()
            - 3.0
    }
}

/// Byte offsets of the f16 scale fields of one block (the rest is free payload).
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::Q4_1 | DType::Q5_1 => {
            if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                &[0, 2]
            } else {
                &[0]
            }
        }
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q6K => &[208],
        DType::F32 | DType::F16 | DType::BF16 | DType::Mxfp4 => &[],
    }
}

/// A random matrix whose every block is valid: random payload, finite scales near 0.01.
fn random_matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> WeightMatrix {
    let n = rows * cols;
    let bytes: Vec<u8> = match dtype {
        DType::F32 => (0..n)
            .flat_map(|_| (rng.normal() * 0.1).to_le_bytes())
            .collect(),
        DType::F16 => (0..n)
            .flat_map(|_| half::f16::from_f32(rng.normal() * 0.1).to_le_bytes())
            .collect(),
        DType::BF16 => (0..n)
            .flat_map(|_| half::bf16::from_f32(rng.normal() * 0.1).to_le_bytes())
            .collect(),
        _ => {
            let bb = dtype.block_bytes();
            let mut b: Vec<u8> = (0..n / dtype.block_elems() * bb)
                .map(|_| rng.next() as u8)
                .collect();
            for block in b.chunks_exact_mut(bb) {
                for &off in f16_fields(dtype) {
                    let v = half::f16::from_f32(rng.normal() * 0.004);
                    block[off..off + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            b
        }
    };
    WeightMatrix::new(dtype, rows, cols, WeightBytes::from_vec(bytes)).expect("valid shape")
}

/// Roughly normal activations; with `outliers`, every 97th is 8× larger, as real ones are.
fn random_x(rng: &mut Rng, n: usize, cols: usize, outliers: bool) -> Vec<f32> {
    let big = if outliers { 8.0 } else { 1.0 };
    (0..n * cols)
        .map(|i| rng.normal() * if i % 97 == 5 { big } else { 1.0 })
        .collect()
}

/// The activations exactly as the kernels see them after 8-bit quantization.
fn as_quantized(dtype: DType, x: &[f32], cols: usize) -> Vec<f32> {
    let (qs, d, block) = match dtype {
        DType::F32 | DType::F16 | DType::BF16 => return x.to_vec(),
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => {
            let a = Q8kRows::quantize(x, cols, Isa::Scalar);
            (a.qs, a.d, 256)
        }
        _ => {
            let a = Q8Rows::quantize(x, cols, Isa::Scalar);
            (a.qs, a.ds.iter().map(|p| p[0]).collect(), 32)
        }
    };
    qs.iter()
        .enumerate()
        .map(|(i, &q)| q as f32 * d[i / block])
        .collect()
}

/// `Σ_c |W[r,c]·x[i,c]|` for each output.
fn abs_products(m: &WeightMatrix, x: &[f32], n: usize) -> Vec<f32> {
    products_of(m, x, n, false)
}

/// The scale float rounding is measured against: `Σ_c (|W[r,c]| + max|W| in c's block)·|x[i,c]|`.
/// Kernels add a block's offset or minimum separately from its values, so terms that large
/// can cancel even where the weights themselves are small.
fn rounding_scale(m: &WeightMatrix, x: &[f32], n: usize) -> Vec<f32> {
    products_of(m, x, n, true)
}

fn products_of(m: &WeightMatrix, x: &[f32], n: usize, with_block_max: bool) -> Vec<f32> {
    let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let block = m.dtype().block_elems();
    let abs_m: Vec<f32> = (0..m.rows())
        .flat_map(|r| {
            let mut w = vec![0f32; m.cols()];
            m.dequantize_row(r, &mut w);
            w.chunks(block)
                .flat_map(|b| {
                    let max = if with_block_max {
                        b.iter().fold(0f32, |a, v| a.max(v.abs()))
                    } else {
                        0.0
                    };
                    b.iter().map(move |v| v.abs() + max).collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    WeightMatrix::from_f32(m.rows(), m.cols(), &abs_m).reference(&abs_x, n)
}

impl WeightMatrix {
    fn reference(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * self.rows];
        self.matmul_reference(x, n, &mut out);
        out
    }
    fn fast(&self, isa: Isa, x: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; n * self.rows];
        self.matmul_with(isa, x, n, &mut out);
        out
    }
}

fn cols_for(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => &[37, 512],
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => &[256, 768],
        _ => &[32, 416],
    }
}

/// Every kernel equals the reference on the activations it was given (after their 8-bit
/// quantization) up to float rounding: this pins the bit layouts and the integer sums.
#[test]
fn kernels_match_reference_on_their_quantized_activations() {
    let mut rng = Rng(7);
    for dtype in DType::ALL {
        for &cols in cols_for(dtype) {
            // 8, 17 and 40 rows exercise the lanes kernels (whole groups of 8, with 1..4
            // weight rows per call) next to the one-row kernels for the rest.
            for (rows, n) in [(7, 1), (13, 3), (5, 17), (64, 4), (6, 8), (9, 40)] {
                let m = random_matrix(&mut rng, dtype, rows, cols);
                let x = random_x(&mut rng, n, cols, true);
                let xq = as_quantized(dtype, &x, cols);
                let want = m.reference(&xq, n);
                let scale = rounding_scale(&m, &xq, n);
                for isa in Isa::available() {
                    let got = m.fast(isa, &x, n);
                    for k in 0..got.len() {
                        // Q4_1/Q5_1 meet the activation block sums rounded to f16, as
                        // llama.cpp's Q8_1 stores them: 2⁻¹¹ of the minimum's term.
                        let min_sum = matches!(dtype, DType::Q4_1 | DType::Q5_1);
                        let tol = (2e-6 + if min_sum { 4.9e-4 } else { 0.0 }) * scale[k] + 1e-30;
                        assert!(
                            (got[k] - want[k]).abs() <= tol,
                            "{} {isa:?} rows {rows} cols {cols} n {n} out {k}: got {}, want {} (tol {tol})",
                            dtype.name(),
                            got[k],
                            want[k]
                        );
                    }
                }
            }
        }
    }
}

/// Against the unquantized activations the error is only what 8-bit activations cost: at
/// most Σ|w|·|x − x̂| per output, and (RMS over outputs) about 0.5% for normal activations,
/// 1–2% when outliers stretch the activation blocks' scales (as in llama.cpp).
#[test]
fn fast_path_matches_naive_float_path() {
    let mut rng = Rng(11);
    for outliers in [false, true] {
        for dtype in DType::ALL {
            let cols = cols_for(dtype)[1];
            let (rows, n) = (33, 5);
            let m = random_matrix(&mut rng, dtype, rows, cols);
            let x = random_x(&mut rng, n, cols, outliers);
            let want = m.reference(&x, n);
            let got = m.fast(Isa::best(), &x, n);
            let scale = rounding_scale(&m, &x, n);
            let xq = as_quantized(dtype, &x, cols);
            let step: Vec<f32> = x.iter().zip(&xq).map(|(a, b)| (a - b).abs()).collect();
            let bound = abs_products(&m, &step, n);
            let (mut err2, mut ref2) = (0f64, 0f64);
            for k in 0..got.len() {
                let diff = (got[k] - want[k]).abs();
                let tol = bound[k] * 1.001 + 2e-6 * scale[k];
                assert!(
                    diff <= tol,
                    "{} out {k}: {} vs {}",
                    dtype.name(),
                    got[k],
                    want[k]
                );
                err2 += (diff as f64).powi(2);
                ref2 += (want[k] as f64).powi(2);
            }
            let rel = (err2 / ref2).sqrt();
            let limit = match (dtype.block_elems(), outliers) {
                (1, _) => 1e-6,
                (_, false) => 8e-3,
                (_, true) => 3e-2,
            };
            assert!(
                rel < limit,
                "{} (outliers {outliers}): relative RMS error {rel:.2e}",
                dtype.name()
            );
        }
    }
}

#[test]
fn scalar_and_simd_quantize_activations_identically() {
    let mut rng = Rng(3);
    let x = random_x(&mut rng, 3, 512, true);
    let a = Q8Rows::quantize(&x, 512, Isa::Scalar);
    let b = Q8Rows::quantize(&x, 512, Isa::best());
    assert_eq!((&a.qs, &a.ds), (&b.qs, &b.ds));
    let a = Q8kRows::quantize(&x, 512, Isa::Scalar);
    let b = Q8kRows::quantize(&x, 512, Isa::best());
    assert_eq!((&a.qs, &a.d, &a.bsums), (&b.qs, &b.d, &b.bsums));
}

#[test]
fn zero_activations_give_zero_and_empty_shapes_are_fine() {
    let mut rng = Rng(5);
    for dtype in DType::ALL {
        let cols = cols_for(dtype)[0];
        let m = random_matrix(&mut rng, dtype, 9, cols);
        assert!(
            m.fast(Isa::best(), &vec![0.0; 2 * cols], 2)
                .iter()
                .all(|&v| v == 0.0),
            "{}",
            dtype.name()
        );
        assert!(m.fast(Isa::best(), &[], 0).is_empty());
    }
}

/// A row's output does not depend on the batch it is in: the lanes kernels (whole groups of
/// 8 rows, the last padded when 5–7 rows remain: n = 5, 7, 13, 63), the quads kernels (n = 3,
/// 4) and the one-row kernels keep one summation order (docs/DECISIONS.md), so a request's
/// logits are the same alone and beside others.
#[test]
fn batched_rows_equal_single_rows_bit_for_bit() {
    let mut rng = Rng(23);
    for dtype in DType::ALL {
        let cols = match dtype.block_elems() {
            1 => continue,
            32 => 416,
            _ => 512,
        };
        let m = random_matrix(&mut rng, dtype, 11, cols);
        for n in [2, 3, 4, 5, 7, 8, 13, 17, 40, 63] {
            let x = random_x(&mut rng, n, cols, true);
            let batch = m.fast(Isa::best(), &x, n);
            for i in 0..n {
                let alone = m.fast(Isa::best(), &x[i * cols..(i + 1) * cols], 1);
                for (r, (a, b)) in alone.iter().zip(&batch[i * 11..(i + 1) * 11]).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{} n {n} row {i} out {r}: alone {a}, in a batch {b}",
                        dtype.name()
                    );
                }
            }
        }
    }
}
