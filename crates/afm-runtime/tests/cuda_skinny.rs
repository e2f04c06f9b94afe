#![cfg(feature = "cuda")]
//! The skinny GEMM (16-bit weights × 9..64 activation rows, cuda/skinny.rs) against the CPU
//! and cuBLAS:
//! - exactly the weights times the activations rounded to bf16/f16 (relative error 5e-5:
//!   summation order only) for every block height (2, 4, 6, 8 warps) and column split (1, 2,
//!   4, 8, 16: clusters merged through distributed shared memory), row counts that are not
//!   multiples of the blocks, widths of Qwen3-0.6B and -8B, and 9..64 rows;
//! - a row's result is the same bits whatever rows run beside it (n = 9, 16, 33, 64: the
//!   n-tile kernels of 16, 32 and 64), and the split merge gives the same bits run twice;
//! - the accumulating product is the output before plus the product, bit for bit;
//! - no less accurate than cuBLAS against the CPU's f32 matmul;
//! - the automatic path takes it from 9 to 64 rows where `skinny_plan` has a shape, and a
//!   forced shape it cannot run (columns not a multiple of 64 × splits) is an error;
//! - the gated MLP through it (gate and up in one launch, the activation in its epilogue)
//!   matches the cuBLAS path within rounding.
//!
//! Outputs are poisoned with NaN first. Needs an sm_90 device (`AFM_CUDA_DEVICE`, default 0);
//! run with `--test-threads=1` (one shared context).

mod common;

use afm_runtime::cuda::{
    skinny_plan, Activation, CudaContext, DeviceWeight, MatmulPath, RowNorm, SkinnyPlan,
};
use afm_runtime::DType;
use common::int8::{activations, gpu_matmul};
use common::matmul::{assert_as_accurate_as_cublas, exact_cases, rounded16};
use common::weights::random_weight;
use common::{assert_close, bits, ctx, poisoned, Rng};

const HALF: [DType; 2] = [DType::BF16, DType::F16];

fn plan(warps: usize, splits: usize) -> MatmulPath {
    MatmulPath::Skinny(SkinnyPlan { warps, splits })
}

#[test]
fn skinny_equals_weights_times_rounded_activations() {
    // 517 rows: two 256-row blocks and 5; 300 × 4096 and 70 × 3072: the 8B's and the 0.6B's
    // down widths; 1024: every split down to 64 columns... (16 splits: 64 columns each).
    let shapes = [(517, 1024), (300, 4096), (70, 3072)];
    exact_cases(
        &mut Rng(71),
        &HALF,
        &shapes,
        |_| vec![9, 16, 33, 64],
        rounded16,
        |case| {
            for warps in [2, 4, 6, 8] {
                for splits in [1, 2, 4, 8, 16] {
                    let per = case.cols / splits;
                    if per % 64 != 0 || (splits > 1 && per < 128) {
                        continue;
                    }
                    let got = case.run(plan(warps, splits));
                    let what = format!("{} {warps} warps {splits} splits", case.what());
                    assert_close(&what, &got, case.want, 5e-5);
                    if splits > 1 {
                        assert_eq!(
                            bits(&got),
                            bits(&case.run(plan(warps, splits))),
                            "{what}: rerun"
                        );
                    }
                }
            }
        },
    );
}

/// Row i of the output depends on row i of x alone: the same bits at 9, 16, 33 and 64 rows.
#[test]
fn skinny_rows_do_not_depend_on_the_batch() {
    let mut rng = Rng(72);
    for dtype in HALF {
        for (rows, cols) in [(4096, 1024), (1024, 3072), (6144, 4096)] {
            let w = random_weight(&mut rng, dtype, rows, cols);
            let dw = DeviceWeight::upload(&ctx(), &w).expect("upload");
            let x = activations(&mut rng, 64, cols);
            let sms = ctx().info().sm_count;
            let path = MatmulPath::Skinny(skinny_plan(rows, cols, sms).expect("a plan"));
            let full = gpu_matmul(path, &dw, &x, 64);
            for n in [9, 16, 33] {
                let part = gpu_matmul(path, &dw, &x[..n * cols], n);
                assert_eq!(
                    bits(&part),
                    bits(&full[..n * rows]),
                    "{dtype:?} {rows}x{cols}: rows of n={n} differ from the same rows at n=64"
                );
            }
        }
    }
}

#[test]
fn skinny_accumulates_bit_for_bit() {
    let mut rng = Rng(73);
    let (rows, cols, n) = (1024, 4096, 24);
    let w = random_weight(&mut rng, DType::BF16, rows, cols);
    let mut c = ctx();
    let dw = DeviceWeight::upload(&c, &w).expect("upload");
    let x = activations(&mut rng, n, cols);
    let before = rng.vec(n * rows, 4.0);
    let xd = c.upload(&x).expect("upload");
    for splits in [1, 8] {
        let path = plan(8, splits);
        let mut plain = poisoned(&c, n * rows);
        c.matmul_with(path, &dw, &xd, n, &mut plain)
            .expect("matmul");
        let plain = c.download(&plain).expect("download");
        let mut out = c.upload(&before).expect("upload");
        c.matmul_into(path, &dw, &xd, n, &mut out, true)
            .expect("matmul_add");
        let got = c.download(&out).expect("download");
        let want: Vec<f32> = before.iter().zip(&plain).map(|(b, p)| b + p).collect();
        assert_eq!(bits(&got), bits(&want), "{splits} splits: out + x·wᵀ");
    }
}

#[test]
fn skinny_is_as_accurate_as_cublas() {
    let sms = ctx().info().sm_count;
    let shapes = [(4096, 4096), (1024, 3072)];
    assert_as_accurate_as_cublas(&mut Rng(74), "skinny", &shapes, &[9, 40, 64], |r, c| {
        MatmulPath::Skinny(skinny_plan(r, c, sms).expect("a plan"))
    });
}

/// `Auto` takes the skinny kernel from 9 to 64 rows where a plan exists (bit-equal to the
/// forced plan) unless `AFM_SKINNY=0`, cuBLAS then and at 65; a forced plan it cannot run
/// is refused.
#[test]
fn auto_path_takes_skinny_from_9_to_64_rows() {
    let mut rng = Rng(75);
    let sms = ctx().info().sm_count;
    let on = std::env::var("AFM_SKINNY").map_or(true, |v| v != "0");
    let (rows, cols) = (2048, 4096);
    let p = skinny_plan(rows, cols, sms).expect("a plan");
    let w = random_weight(&mut rng, DType::BF16, rows, cols);
    let dw = DeviceWeight::upload(&ctx(), &w).expect("upload");
    for n in [9, 64, 65] {
        let x = activations(&mut rng, n, cols);
        let auto = gpu_matmul(MatmulPath::Auto, &dw, &x, n);
        let want = if on && n <= 64 {
            gpu_matmul(MatmulPath::Skinny(p), &dw, &x, n)
        } else {
            gpu_matmul(MatmulPath::Gemm, &dw, &x, n)
        };
        assert_eq!(bits(&auto), bits(&want), "n={n}");
    }
    let x = activations(&mut rng, 16, cols);
    let xd = ctx().upload(&x).expect("upload");
    let mut out = poisoned(&ctx(), 16 * rows);
    let bad = plan(8, 16 * 3); // 4096 / 48 columns: not whole stages
    let r = ctx().matmul_with(bad, &dw, &xd, 16, &mut out);
    assert!(r.is_err(), "a plan that cannot run is refused");
}

/// The gated MLP through the skinny kernels (gate and up in one launch whose epilogue writes
/// `act(gate) · up` in 16 bits, then the accumulating down product) against the cuBLAS path
/// (f32 gate and up, the activation launch, cuBLAS's down): the MLP's contribution to x within
/// rounding, for SiLU and GELU, every block height, split columns, and 1,280 outputs, which
/// no gated block of 96 (6 warps) divides.
#[test]
fn skinny_gated_mlp_matches_cublas() {
    let mut c = ctx();
    let mut rng = Rng(76);
    let (d, ff) = (1024, 1280);
    for dtype in HALF {
        let (gw, uw, dw) = (
            random_weight(&mut rng, dtype, ff, d),
            random_weight(&mut rng, dtype, ff, d),
            random_weight(&mut rng, dtype, d, ff),
        );
        let up = |w| DeviceWeight::upload(&c, w).expect("upload");
        let (gd, ud, dd) = (up(&gw), up(&uw), up(&dw));
        let g: Vec<f32> = (0..d).map(|_| 1.0 + rng.sym(0.1)).collect();
        let nd = c.upload(&g).expect("upload");
        for n in [9, 40, 64] {
            let x = activations(&mut rng, n, d);
            for act in [Activation::Silu, Activation::GeluTanh] {
                let mlp = |c: &mut CudaContext, path| {
                    c.set_gemm_path(path);
                    let mut xd = c.upload(&x).expect("upload");
                    let norm = RowNorm {
                        w: nd.slice(..),
                        eps: 1e-6,
                    };
                    let taken = c.matmul_mlp_add(&gd, &ud, &dd, act, &mut xd, norm, n);
                    c.set_gemm_path(MatmulPath::Auto);
                    assert!(taken.expect("mlp"), "the one-path MLP applies");
                    let out = c.download(&xd).expect("download");
                    out.iter().zip(&x).map(|(o, x)| o - x).collect::<Vec<f32>>()
                };
                let want = mlp(&mut c, MatmulPath::Gemm);
                for (warps, splits) in [(2, 1), (4, 2), (6, 1), (6, 4), (8, 1)] {
                    let got = mlp(&mut c, plan(warps, splits));
                    let what = format!("{dtype:?} n={n} {act:?} {warps} warps {splits} splits");
                    assert_close(&what, &got, &want, 2e-3);
                }
            }
        }
    }
}
