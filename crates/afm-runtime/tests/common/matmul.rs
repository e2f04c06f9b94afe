//! The case loops the matmul kernel tests (`cuda_gemv_int8`, `cuda_mmq`, `cuda_mmh`) share:
//! random weights on the device against the exact product of their CPU dequantization
//! ([`exact_cases`]), gate and up run separately as the reference for the gated launches
//! ([`gated_cases`]), shared launches against single ones ([`shared_launch_cases`]), the
//! automatic path against a forced one ([`assert_auto_is`]), the error a path gives for what
//! it cannot serve ([`refusal`]) and a 16-bit tensor-core path against cuBLAS
//! ([`assert_as_accurate_as_cublas`]). What each test asserts, and its bounds, stay in the test.

use afm_runtime::cuda::{Activation, CudaContext, CudaSlice, DeviceWeight, MatmulPath};
use afm_runtime::{DType, WeightMatrix};

use super::int8::{activations, gelu_tanh, gpu_matmul, silu};
use super::weights::{dequantized, dot_rows, random_weight};
use super::{assert_close, ctx, poisoned, rel_err, shared_launch_vs_single, Rng};

/// One random matrix (on the host and on the device) and one batch of activations, with the
/// exact product (f64 sums) of the CPU-dequantized weights and the activations as the kernels
/// round them.
pub struct ExactCase<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub host: &'a WeightMatrix,
    pub w: &'a DeviceWeight,
    pub x: &'a [f32],
    pub want: &'a [f32],
}

impl ExactCase<'_> {
    /// `x · wᵀ` through `path`, into a NaN-poisoned output.
    pub fn run(&self, path: MatmulPath) -> Vec<f32> {
        gpu_matmul(path, self.w, self.x, self.n)
    }

    pub fn what(&self) -> String {
        format!("{:?} {}x{} n={}", self.dtype, self.rows, self.cols, self.n)
    }
}

/// For each of `dtypes` × `shapes` (rows, cols) a random matrix, and for each batch size that
/// `batches(rows)` lists fresh activations with outlier channels: hands `check` the case, whose
/// reference multiplies the activations as `round` gives them (the kernel's own rounding).
/// Takes no context lock while `check` runs (`ExactCase::run` takes it).
pub fn exact_cases(
    rng: &mut Rng,
    dtypes: &[DType],
    shapes: &[(usize, usize)],
    batches: impl Fn(usize) -> Vec<usize>,
    round: impl Fn(DType, &[f32]) -> Vec<f32>,
    mut check: impl FnMut(&ExactCase),
) {
    for &dtype in dtypes {
        for &(rows, cols) in shapes {
            let w = random_weight(rng, dtype, rows, cols);
            let dw = DeviceWeight::upload(&ctx(), &w).expect("upload");
            let wd = dequantized(&w);
            for n in batches(rows) {
                let x = activations(rng, n, cols);
                let want = dot_rows(&wd, rows, cols, &round(dtype, &x), n);
                check(&ExactCase {
                    dtype,
                    rows,
                    cols,
                    n,
                    host: &w,
                    w: &dw,
                    x: &x,
                    want: &want,
                });
            }
        }
    }
}

/// `batches`, then for matrices under 100 rows 1 and 8 (single tiles: sizes the automatic path
/// gives the GEMV, so only a forced path runs them) and 100 (two launches, of 64 and 36 rows).
pub fn with_forced_small(batches: &[usize], rows: usize) -> Vec<usize> {
    let small: &[usize] = if rows < 100 { &[1, 8, 100] } else { &[] };
    batches.iter().chain(small).copied().collect()
}

/// Random matrices `mats` (type, rows) of `cols` columns on the device; for each of `batches`
/// fresh activations, [`shared_launch_vs_single`] over them on `path` with `check`.
pub fn shared_launch_cases(
    rng: &mut Rng,
    cols: usize,
    mats: &[(DType, usize)],
    batches: &[usize],
    path: MatmulPath,
    check: impl Fn(&str, &[f32], &[f32]),
) {
    let ws: Vec<WeightMatrix> = mats
        .iter()
        .map(|&(t, rows)| random_weight(rng, t, rows, cols))
        .collect();
    let mut c = ctx();
    let dws: Vec<DeviceWeight> = ws
        .iter()
        .map(|w| DeviceWeight::upload(&c, w).expect("upload"))
        .collect();
    for &n in batches {
        let x = activations(rng, n, cols);
        let xd = c.upload(&x).expect("upload");
        shared_launch_vs_single(&mut c, &dws, &xd, n, path, &check);
    }
}

/// Gate and up matrices of one type on the device, one batch of activations on the device and
/// one activation, for a gated launch to be compared with `act(gate) · up`.
pub struct GatedCase<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub act: Activation,
    pub gate: &'a DeviceWeight,
    pub up: &'a DeviceWeight,
    pub x: &'a CudaSlice<f32>,
}

impl GatedCase<'_> {
    pub fn what(&self) -> String {
        let (act, dtype) = (self.act, self.dtype);
        format!("{act:?} {dtype:?} {}x{} n={}", self.rows, self.cols, self.n)
    }

    /// `matmul_gated` (the automatic choice) into a NaN-poisoned output: the output when it
    /// ran the gated launch, `None` when it declined.
    pub fn auto(&self, c: &mut CudaContext) -> Option<Vec<f32>> {
        let mut out = poisoned(c, self.n * self.rows);
        let fused = c
            .matmul_gated(self.gate, self.up, self.act, self.x, self.n, &mut out)
            .expect("gated");
        fused.then(|| c.download(&out).expect("download"))
    }

    /// `matmul_gated_with(path)` into a NaN-poisoned output.
    pub fn forced(&self, c: &mut CudaContext, path: MatmulPath) -> Vec<f32> {
        let mut out = poisoned(c, self.n * self.rows);
        c.matmul_gated_with(path, self.gate, self.up, self.act, self.x, self.n, &mut out)
            .expect("gated");
        c.download(&out).expect("download")
    }
}

/// For each of `dtypes` × `shapes` (rows, cols) random gate and up matrices, for each of
/// `batches` fresh activations, gate and up each through `separate`, then for SiLU and GELU
/// tanh: hands `check` the context, the case and `act(gate) · up` from the separate results.
/// Holds the context lock throughout (`check` must not call `gpu_matmul`).
pub fn gated_cases(
    rng: &mut Rng,
    dtypes: &[DType],
    shapes: &[(usize, usize)],
    batches: &[usize],
    separate: MatmulPath,
    mut check: impl FnMut(&mut CudaContext, &GatedCase, &[f32]),
) {
    for &dtype in dtypes {
        for &(rows, cols) in shapes {
            let (g, u) = (
                random_weight(rng, dtype, rows, cols),
                random_weight(rng, dtype, rows, cols),
            );
            let mut c = ctx();
            let (dg, du) = (
                DeviceWeight::upload(&c, &g).expect("upload"),
                DeviceWeight::upload(&c, &u).expect("upload"),
            );
            for &n in batches {
                let x = activations(rng, n, cols);
                let xd = c.upload(&x).expect("upload");
                let mut gs = poisoned(&c, n * rows);
                let mut us = poisoned(&c, n * rows);
                c.matmul_with(separate, &dg, &xd, n, &mut gs).expect("gate");
                c.matmul_with(separate, &du, &xd, n, &mut us).expect("up");
                let (gs, us) = (
                    c.download(&gs).expect("download"),
                    c.download(&us).expect("download"),
                );
                for (act, f) in [
                    (Activation::Silu, silu as fn(f32) -> f32),
                    (Activation::GeluTanh, gelu_tanh),
                ] {
                    let want: Vec<f32> = gs.iter().zip(&us).map(|(&a, &b)| f(a) * b).collect();
                    let case = GatedCase {
                        dtype,
                        rows,
                        cols,
                        n,
                        act,
                        gate: &dg,
                        up: &du,
                        x: &xd,
                    };
                    check(&mut c, &case, &want);
                }
            }
        }
    }
}

/// `Auto` on `n` rows of fresh activations gives bit for bit what the forced `expected` path
/// gives on them.
pub fn assert_auto_is(rng: &mut Rng, w: &DeviceWeight, n: usize, expected: MatmulPath, what: &str) {
    let x = activations(rng, n, w.cols());
    let auto = gpu_matmul(MatmulPath::Auto, w, &x, n);
    let forced = gpu_matmul(expected, w, &x, n);
    assert_eq!(auto, forced, "{what} n={n}: Auto is not {expected:?}");
}

/// The error `path` gives for 32 activation rows times a random 8-row `dtype` matrix of `cols`
/// columns, into a NaN-poisoned output; the test fails if the matmul runs.
pub fn refusal(
    c: &mut CudaContext,
    rng: &mut Rng,
    dtype: DType,
    cols: usize,
    path: MatmulPath,
) -> String {
    let w = DeviceWeight::upload(c, &random_weight(rng, dtype, 8, cols)).expect("upload");
    let xd = c.upload(&rng.vec(32 * cols, 1.0)).expect("upload");
    let mut out = poisoned(c, 32 * 8);
    let err = c.matmul_with(path, &w, &xd, 32, &mut out);
    match err {
        Err(e) => e.to_string(),
        Ok(()) => panic!("{path:?} ran {dtype:?} weights of {cols} columns"),
    }
}

/// `path(rows, cols)` (`name` in messages) gives the cuBLAS path's result to summation order on
/// BF16 and F16 weights of `shapes` at `batches` rows (relative 5e-5: both round x with
/// common.cuh's f2bf / f2h, so the products are the same), and against the CPU's f32 matmul
/// (activations not rounded) it errs no more than cuBLAS, within tests/cuda_ops.rs's bounds for
/// that path (2e-2 bf16, 1e-3 f16).
pub fn assert_as_accurate_as_cublas(
    rng: &mut Rng,
    name: &str,
    shapes: &[(usize, usize)],
    batches: &[usize],
    path: impl Fn(usize, usize) -> MatmulPath,
) {
    for dtype in [DType::BF16, DType::F16] {
        for &(rows, cols) in shapes {
            let w = random_weight(rng, dtype, rows, cols);
            let dw = DeviceWeight::upload(&ctx(), &w).expect("upload");
            for &n in batches {
                let x = activations(rng, n, cols);
                let mut cpu = vec![0f32; n * rows];
                w.matmul_reference(&x, n, &mut cpu);
                let got = gpu_matmul(path(rows, cols), &dw, &x, n);
                let blas = gpu_matmul(MatmulPath::Gemm, &dw, &x, n);
                let what = format!("{dtype:?} {rows}x{cols} n={n} {name}");
                assert_close(&format!("{what} vs cuBLAS"), &got, &blas, 5e-5);
                let (e_got, e_blas) = (rel_err(&got, &cpu), rel_err(&blas, &cpu));
                let bound = if dtype == DType::BF16 { 2e-2 } else { 1e-3 };
                eprintln!("{what}: vs CPU {e_got:.2e}, cuBLAS {e_blas:.2e}");
                assert!(
                    e_got <= 1.05 * e_blas + 1e-6 && e_got <= bound,
                    "{what}: error {e_got:.3e} (cuBLAS {e_blas:.3e}, bound {bound:.0e})"
                );
            }
        }
    }
}

/// `x` as the 16-bit kernels see it: each value rounded to the weights' type (half's round to
/// nearest even, as common.cuh's f2bf / f2h).
pub fn rounded16(dtype: DType, x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| match dtype {
            DType::BF16 => half::bf16::from_f32(v).to_f32(),
            _ => half::f16::from_f32(v).to_f32(),
        })
        .collect()
}
