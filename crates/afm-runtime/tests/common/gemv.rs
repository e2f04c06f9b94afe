//! Shared by the CUDA test files: the device context (one per test binary, behind a mutex),
//! reproducible random data, random valid GGML weight encodings and the relative error.
//! (Same helpers as tests/cuda_ops.rs's, which can move here.)
#![allow(dead_code)] // each test binary uses a different subset

use std::sync::{Mutex, MutexGuard, OnceLock};

use afm_runtime::cuda::{CudaContext, CudaSlice};
use afm_runtime::{DType, WeightBytes, WeightMatrix};
use half::{bf16, f16};

/// The test binary's context on device `AFM_CUDA_DEVICE` (default 0); tests take turns.
pub fn ctx() -> MutexGuard<'static, CudaContext> {
    static CTX: OnceLock<Mutex<CudaContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let ordinal = std::env::var("AFM_CUDA_DEVICE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let c = CudaContext::new(ordinal).unwrap_or_else(|e| panic!("CUDA context: {e}"));
        eprintln!("device: {:?}", c.info());
        Mutex::new(c)
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

/// splitmix64: reproducible data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f32) -> f32 {
        (2.0 * self.unit() - 1.0) * a
    }
    pub fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
}

/// ‖got − want‖ / ‖want‖ in f64; fails on a non-finite output (unwritten or overflow).
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(
            g.is_finite(),
            "non-finite output {g} (unwritten or overflow)"
        );
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_err(got, want);
    eprintln!("{what}: rel err {e:.2e}");
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

/// A device buffer of NaN, so an output element no kernel wrote fails the comparison.
pub fn poisoned(c: &CudaContext, n: usize) -> CudaSlice<f32> {
    c.upload(&vec![f32::NAN; n]).expect("upload")
}

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
