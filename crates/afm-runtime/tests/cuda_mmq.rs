#![cfg(feature = "cuda")]
//! The int8 tensor-core matmul (MMQ: `mma.sync` m16n8k32 s8 on the GGML blocks, cuda/mmq.rs)
//! against the CPU, for Q8_0, Q4_K and Q6_K at 17, 32, 33 and 64 activation rows (and 1, 8
//! and 100 when forced: one tile, and two launches), weight row counts that are not multiples
//! of the kernels' 32-row tile, and widths 256 (fewer super-blocks than warps) to 12288:
//! - exactly the CPU-dequantized weights times the activations rounded to int8 as gemv.cu
//!   documents (relative error 5e-5: float summation order only), with the columns split over
//!   4 and over 8 warps, and the int8 GEMV's result on the same inputs;
//! - no less accurate than the CPU's own quantized matmul (llama.cpp's Q8/Q8_K activations),
//!   both measured against the exact f64 product of the dequantized weights;
//! - the automatic path takes MMQ from 17 to 64 rows (GEMV below, cuBLAS above) unless
//!   `AFM_MMQ=0`; Q/K/V sharing one quantization give the separate launches' results, and
//!   gate+up in one launch with SiLU / GELU tanh (up to `MMQ_GATED_MAX_ROWS` rows) the
//!   activation of the separate results;
//! - unquantized weights and warp counts other than 4 and 8 are refused with an error.
//!
//! Outputs are poisoned with NaN first. Needs a CUDA device of compute capability 8.0 or
//! later (`AFM_CUDA_DEVICE`, default 0); run with `--test-threads=1` (one shared context).

mod common;

use afm_runtime::cuda::{Activation, DeviceWeight, MatmulPath, MMQ_GATED_MAX_ROWS};
use afm_runtime::{DType, WeightMatrix};
use common::int8::{
    activations, assert_as_accurate_as_the_cpu, gelu_tanh, gpu_matmul, int8_rounded, silu,
};
use common::weights::{dequantized, dot_rows, random_weight};
use common::{assert_close, ctx, poisoned, shared_launch_vs_single, Rng};

const QUANT: [DType; 3] = [DType::Q8_0, DType::Q4K, DType::Q6K];
/// (rows, cols): rows not multiples of 32 (nor 16 or 8); 256 columns is one super-block (three
/// of the four warps idle), 2816 eleven (an uneven share), 4096 and 12288 Qwen3-8B's widths;
/// 517 rows: 17 blocks.
const SHAPES: [(usize, usize); 5] = [(37, 256), (70, 2816), (45, 4096), (517, 4096), (19, 12288)];
/// The automatic path's MMQ batches: tile edges (17, 33), whole tiles (32, 64).
const BATCHES: [usize; 4] = [17, 32, 33, 64];

fn mmq_env_off() -> bool {
    std::env::var("AFM_MMQ").is_ok_and(|v| v == "0")
}

#[test]
fn mmq_equals_dequantized_weights_times_rounded_activations() {
    let mut rng = Rng(31);
    for dtype in QUANT {
        for (rows, cols) in SHAPES {
            let w = random_weight(&mut rng, dtype, rows, cols);
            let dw = DeviceWeight::upload(&ctx(), &w).expect("upload");
            let wd = dequantized(&w);
            // 1 and 8: single tiles (the GEMV's sizes, forced); 100: launches of 64 and 36.
            let forced_only = if rows < 100 {
                &[1, 8, 100][..]
            } else {
                &[][..]
            };
            for &n in BATCHES.iter().chain(forced_only) {
                let x = activations(&mut rng, n, cols);
                let want = dot_rows(&wd, rows, cols, &int8_rounded(&x), n);
                // Both kernel sets (columns split over 4 or 8 warps); `Mmq` picks one by width.
                for warps in [4, 8] {
                    let got = gpu_matmul(MatmulPath::MmqWarps(warps), &dw, &x, n);
                    let what = format!("{dtype:?} {rows}x{cols} n={n} MMQ {warps} warps");
                    assert_close(&what, &got, &want, 5e-5);
                }
                let got = gpu_matmul(MatmulPath::Mmq, &dw, &x, n);
                if BATCHES.contains(&n) {
                    // The int8 GEMV on the same inputs (its own launches of 8 rows).
                    let gemv = gpu_matmul(MatmulPath::Gemv, &dw, &x, n);
                    let what = format!("{dtype:?} {rows}x{cols} n={n} MMQ vs int8 GEMV");
                    assert_close(&what, &got, &gemv, 5e-5);
                }
            }
        }
    }
}

#[test]
fn mmq_is_as_accurate_as_the_cpu_matmul() {
    let shapes = [(70, 2816), (45, 4096), (19, 12288)];
    assert_as_accurate_as_the_cpu(
        &mut Rng(32),
        MatmulPath::Mmq,
        &QUANT,
        &shapes,
        &[17, 32, 64],
    );
}

/// `Auto` runs the int8 GEMV up to 16 rows, MMQ from 17 to 64 and dequantize + cuBLAS above
/// (each compared bit for bit with the forced path); with `AFM_MMQ=0`, cuBLAS from 17 rows.
#[test]
fn auto_path_takes_mmq_from_17_to_64_rows() {
    let mut rng = Rng(33);
    let (rows, cols) = (300, 4096);
    let w = random_weight(&mut rng, DType::Q4K, rows, cols);
    let dw = DeviceWeight::upload(&ctx(), &w).expect("upload");
    let off = mmq_env_off();
    for (n, expected) in [
        (16, MatmulPath::Gemv),
        (
            17,
            if off {
                MatmulPath::Gemm
            } else {
                MatmulPath::Mmq
            },
        ),
        (
            64,
            if off {
                MatmulPath::Gemm
            } else {
                MatmulPath::Mmq
            },
        ),
        (65, MatmulPath::Gemm),
    ] {
        let x = activations(&mut rng, n, cols);
        let auto = gpu_matmul(MatmulPath::Auto, &dw, &x, n);
        let forced = gpu_matmul(expected, &dw, &x, n);
        assert_eq!(
            auto, forced,
            "n={n}: Auto is not {expected:?} (AFM_MMQ=0: {off})"
        );
    }
}

/// Q/K/V of mixed quantized types (as Q4_K_M files have) after one quantization give the
/// separate MMQ launches' results, bit for bit.
#[test]
fn shared_quantization_matches_separate_mmq() {
    if mmq_env_off() {
        eprintln!("skipped: AFM_MMQ=0 keeps matmul_many off the MMQ path");
        return;
    }
    let mut rng = Rng(34);
    let cols = 4096;
    let mats = [(DType::Q4K, 3201), (DType::Q6K, 1030), (DType::Q8_0, 517)];
    let ws: Vec<WeightMatrix> = mats
        .iter()
        .map(|&(t, rows)| random_weight(&mut rng, t, rows, cols))
        .collect();
    let mut c = ctx();
    let dws: Vec<DeviceWeight> = ws
        .iter()
        .map(|w| DeviceWeight::upload(&c, w).expect("upload"))
        .collect();
    for n in BATCHES {
        let x = activations(&mut rng, n, cols);
        let xd = c.upload(&x).expect("upload");
        shared_launch_vs_single(&mut c, &dws, &xd, n, MatmulPath::Mmq, |what, got, want| {
            assert_eq!(got, want, "{what}: shared quantization differs")
        });
    }
}

/// Gate and up in one MMQ launch (16 rows of each per block) with the activation applied give
/// the activation of the separate MMQ results.
#[test]
fn gated_mmq_equals_activation_of_separate_mmq() {
    if mmq_env_off() {
        eprintln!("skipped: AFM_MMQ=0 keeps matmul_gated off the MMQ path");
        return;
    }
    let mut rng = Rng(37);
    for dtype in QUANT {
        // 3201 rows: 201 blocks of 16 rows of each; 4096 columns: the 8-warp kernels.
        for (rows, cols) in [(45, 2048), (19, 4096), (3201, 4096)] {
            let (g, u) = (
                random_weight(&mut rng, dtype, rows, cols),
                random_weight(&mut rng, dtype, rows, cols),
            );
            let mut c = ctx();
            let (dg, du) = (
                DeviceWeight::upload(&c, &g).expect("upload"),
                DeviceWeight::upload(&c, &u).expect("upload"),
            );
            for n in BATCHES {
                let x = activations(&mut rng, n, cols);
                let xd = c.upload(&x).expect("upload");
                let mut gs = poisoned(&c, n * rows);
                let mut us = poisoned(&c, n * rows);
                c.matmul_with(MatmulPath::Mmq, &dg, &xd, n, &mut gs)
                    .expect("gate");
                c.matmul_with(MatmulPath::Mmq, &du, &xd, n, &mut us)
                    .expect("up");
                let (gs, us) = (
                    c.download(&gs).expect("download"),
                    c.download(&us).expect("download"),
                );
                for (act, f) in [
                    (Activation::Silu, silu as fn(f32) -> f32),
                    (Activation::GeluTanh, gelu_tanh),
                ] {
                    let want: Vec<f32> = gs.iter().zip(&us).map(|(&a, &b)| f(a) * b).collect();
                    let mut out = poisoned(&c, n * rows);
                    let fused = c
                        .matmul_gated(&dg, &du, act, &xd, n, &mut out)
                        .expect("gated");
                    if n > MMQ_GATED_MAX_ROWS {
                        // Past it the caller runs gate and up as one two-matrix launch.
                        assert!(!fused, "{dtype:?} n={n}: fused past MMQ_GATED_MAX_ROWS");
                        continue;
                    }
                    assert!(fused, "{dtype:?} n={n}: not fused");
                    let what = format!("gated MMQ {act:?} {dtype:?} {rows}x{cols} n={n}");
                    assert_close(&what, &c.download(&out).expect("download"), &want, 1e-6);
                }
            }
        }
    }
}

#[test]
fn mmq_refuses_other_warp_counts() {
    let mut rng = Rng(36);
    let mut c = ctx();
    let w = DeviceWeight::upload(&c, &random_weight(&mut rng, DType::Q4K, 8, 256)).expect("upload");
    let xd = c.upload(&rng.vec(32 * 256, 1.0)).expect("upload");
    let mut out = poisoned(&c, 32 * 8);
    let err = c
        .matmul_with(MatmulPath::MmqWarps(5), &w, &xd, 32, &mut out)
        .expect_err("5 warps");
    assert!(err.to_string().contains("MMQ warps per block"), "{err}");
}

#[test]
fn mmq_refuses_unquantized_weights() {
    let mut rng = Rng(35);
    let mut c = ctx();
    let w = DeviceWeight::upload(&c, &random_weight(&mut rng, DType::F16, 8, 256)).expect("upload");
    let xd = c.upload(&rng.vec(32 * 256, 1.0)).expect("upload");
    let mut out = poisoned(&c, 32 * 8);
    let err = c
        .matmul_with(MatmulPath::Mmq, &w, &xd, 32, &mut out)
        .expect_err("F16 weights through MMQ");
    let msg = err.to_string();
    assert!(
        msg.contains("MMQ weight type") && msg.contains("F16"),
        "{msg}"
    );
}
