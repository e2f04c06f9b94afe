//! Random weight matrices in every storage type (valid GGML encodings) and their references
//! computed from the CPU's dequantization.

use afm_runtime::{DType, WeightBytes, WeightMatrix};
use half::{bf16, f16};

use super::Rng;

/// A matrix of `dtype` with random contents: float values in ±0.1, quantized blocks with
/// random quants and scales and small positive f16 super-scales (valid GGML encodings).
pub fn random_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> WeightMatrix {
    let n_bytes = dtype.row_bytes(cols).expect("aligned") * rows;
    let mut b: Vec<u8> = (0..n_bytes).map(|_| rng.next() as u8).collect();
    let scale = |rng: &mut Rng| f16::from_f32(0.002 + 0.01 * rng.unit()).to_le_bytes();
    match dtype {
        DType::F32 => {
            b = (0..rows * cols)
                .flat_map(|_| rng.sym(0.1).to_le_bytes())
                .collect();
        }
        DType::F16 => {
            b = (0..rows * cols)
                .flat_map(|_| f16::from_f32(rng.sym(0.1)).to_le_bytes())
                .collect();
        }
        DType::BF16 => {
            b = (0..rows * cols)
                .flat_map(|_| bf16::from_f32(rng.sym(0.1)).to_le_bytes())
                .collect();
        }
        DType::Q8_0 => b
            .chunks_exact_mut(34)
            .for_each(|k| k[..2].copy_from_slice(&scale(rng))),
        DType::Q4K => b.chunks_exact_mut(144).for_each(|k| {
            k[..2].copy_from_slice(&scale(rng));
            k[2..4].copy_from_slice(&scale(rng));
        }),
        DType::Q6K => b
            .chunks_exact_mut(210)
            .for_each(|k| k[208..].copy_from_slice(&scale(rng))),
        other => panic!("no generator for {other:?}"),
    }
    WeightMatrix::new(dtype, rows, cols, WeightBytes::from_vec(b)).expect("valid encoding")
}

/// All rows of `w` dequantized by the CPU (bit-exact with GGML's dequantization).
pub fn dequantized(w: &WeightMatrix) -> Vec<f32> {
    let mut out = vec![0f32; w.rows() * w.cols()];
    for (r, row) in out.chunks_exact_mut(w.cols()).enumerate() {
        w.dequantize_row(r, row);
    }
    out
}

/// `out[i][r] = Σ_c x[i][c] · w[r][c]` in f64, for `w` given dequantized (`rows × cols`).
pub fn dot_rows(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * rows];
    for (r, wr) in w.chunks_exact(cols).enumerate().take(rows) {
        for i in 0..n {
            let xi = &x[i * cols..(i + 1) * cols];
            let dot: f64 = xi.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
            out[i * rows + r] = dot as f32;
        }
    }
    out
}
