#![cfg(feature = "cuda")]
//! The quantized GEMV (decode and small batches: int8 activation blocks of 32, dp4a on the
//! GGML blocks) against the CPU, for Q8_0, Q4_K and Q6_K, at 1, 3, 8, 13 and 16 activation
//! rows (13 and 16: two launches), weight row counts that leave partial row groups, and widths
//! 256..12288 (four, two and one thread groups per block; one and several units per thread;
//! one and four weight rows per thread group):
//! - exactly the CPU-dequantized weights times the activations rounded to int8 as documented
//!   in gemv.cu (relative error 5e-5: float summation order only);
//! - no less accurate than the CPU's own quantized matmul (llama.cpp's Q8/Q8_K activations),
//!   both measured against the exact f64 product of the dequantized weights;
//! - Q/K/V (one launch) and gate/up (fused with the activation) sharing one quantization give
//!   the separate launches' results.
//!
//! Outputs are poisoned with NaN first. Needs a CUDA device (`AFM_CUDA_DEVICE`, default 0);
//! run with `--test-threads=1` (one shared context).

mod common;

use afm_runtime::cuda::{Activation, DeviceWeight, MatmulPath};
use afm_runtime::DType;
use common::int8::{assert_as_accurate_as_the_cpu, int8_rounded};
use common::matmul::{exact_cases, gated_cases, shared_launch_cases};
use common::weights::random_weight;
use common::{assert_close, ctx, poisoned, Rng};

const QUANT: [DType; 3] = [DType::Q8_0, DType::Q4K, DType::Q6K];
/// (rows, cols): row counts not multiples of the 4 rows of a thread group (nor of 8 or 16);
/// 256 and 1024 columns take four groups per block, 2048 two, the rest one, 12288 with three
/// units per thread.
const SHAPES: [(usize, usize); 6] = [
    (37, 256),
    (70, 1024),
    (45, 2048),
    (23, 2816),
    (19, 4096),
    (13, 12288),
];
const BATCHES: [usize; 5] = [1, 3, 8, 13, 16];

#[test]
fn int8_gemv_equals_dequantized_weights_times_rounded_activations() {
    let round = |_: DType, x: &[f32]| int8_rounded(x);
    exact_cases(
        &mut Rng(21),
        &QUANT,
        &SHAPES,
        |_| BATCHES.to_vec(),
        round,
        |case| {
            // Auto picks one row per thread group at these sizes; four are forced too.
            for path in [
                MatmulPath::Auto,
                MatmulPath::GemvRows(1),
                MatmulPath::GemvRows(4),
            ] {
                let got = case.run(path);
                let what = format!("{} {path:?}", case.what());
                assert_close(&what, &got, case.want, 5e-5);
            }
        },
    );
}

#[test]
fn int8_gemv_is_as_accurate_as_the_cpu_matmul() {
    let shapes = [(70, 1024), (23, 2816), (13, 12288)];
    assert_as_accurate_as_the_cpu(&mut Rng(22), MatmulPath::Auto, &QUANT, &shapes, &[1, 8, 16]);
}

/// Q/K/V of mixed quantized types (as Q4_K_M files have) in one launch after one quantization
/// give the separate launches' results: bit for bit where both take the one-row kernels, within
/// float rounding where the fused launch is large enough for four rows per thread group.
#[test]
fn shared_quantization_matches_separate_matmuls() {
    let mut rng = Rng(24);
    // (cols, [(type, rows)] of Q, K and V, tolerance against the separate launches)
    type Set = (usize, [(DType, usize); 3], f64);
    let sets: [Set; 2] = [
        (
            1024,
            [(DType::Q4K, 70), (DType::Q4K, 37), (DType::Q6K, 19)],
            0.0,
        ),
        (
            4096,
            [(DType::Q4K, 3201), (DType::Q6K, 1030), (DType::Q8_0, 517)],
            1e-6,
        ),
    ];
    for (cols, mats, tol) in sets {
        let path = MatmulPath::Gemv;
        shared_launch_cases(&mut rng, cols, &mats, &BATCHES, path, |what, got, want| {
            if tol == 0.0 {
                assert_eq!(got, want, "{what}: shared quantization differs");
            } else {
                assert_close(what, got, want, tol);
            }
        });
    }
}

#[test]
fn gated_int8_gemv_equals_activation_of_separate_matmuls() {
    // 3201 rows: enough blocks (> 4 per SM up to 200 SMs) for four rows per thread group.
    let shapes = [(70, 1024), (45, 2048), (19, 4096), (3201, 4096)];
    let separate = MatmulPath::Gemv;
    gated_cases(
        &mut Rng(25),
        &QUANT,
        &shapes,
        &[1, 3, 8, 16],
        separate,
        |c, case, want| {
            let (dtype, n) = (case.dtype, case.n);
            let got = case
                .auto(c)
                .unwrap_or_else(|| panic!("{dtype:?} n={n}: not fused"));
            assert_close(&format!("gated {}", case.what()), &got, want, 1e-6);
        },
    );
}

/// Gate and up of different quantized types are not fused (the caller falls back).
#[test]
fn gated_declines_mixed_types() {
    let mut rng = Rng(26);
    let mut c = ctx();
    let g = DeviceWeight::upload(&c, &random_weight(&mut rng, DType::Q4K, 8, 256)).expect("upload");
    let u = DeviceWeight::upload(&c, &random_weight(&mut rng, DType::Q6K, 8, 256)).expect("upload");
    let xd = c.upload(&rng.vec(256, 1.0)).expect("upload");
    let mut out = poisoned(&c, 8);
    assert!(!c
        .matmul_gated(&g, &u, Activation::Silu, &xd, 1, &mut out)
        .expect("gated"));
}
