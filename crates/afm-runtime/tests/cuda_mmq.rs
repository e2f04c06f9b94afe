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

use afm_runtime::cuda::{DeviceWeight, MatmulPath, MMQ_GATED_MAX_ROWS};
use afm_runtime::DType;
use common::int8::{assert_as_accurate_as_the_cpu, int8_rounded};
use common::matmul::{
    assert_auto_is, exact_cases, gated_cases, refusal, shared_launch_cases, with_forced_small,
};
use common::weights::random_weight;
use common::{assert_close, ctx, Rng};

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
    // 1 and 8: single tiles (the GEMV's sizes, forced); 100: launches of 64 and 36.
    let batches = |rows| with_forced_small(&BATCHES, rows);
    let round = |_: DType, x: &[f32]| int8_rounded(x);
    exact_cases(&mut Rng(31), &QUANT, &SHAPES, batches, round, |case| {
        // Both kernel sets (columns split over 4 or 8 warps); `Mmq` picks one by width.
        for warps in [4, 8] {
            let got = case.run(MatmulPath::MmqWarps(warps));
            let what = format!("{} MMQ {warps} warps", case.what());
            assert_close(&what, &got, case.want, 5e-5);
        }
        let got = case.run(MatmulPath::Mmq);
        if BATCHES.contains(&case.n) {
            // The int8 GEMV on the same inputs (its own launches of 8 rows).
            let gemv = case.run(MatmulPath::Gemv);
            let what = format!("{} MMQ vs int8 GEMV", case.what());
            assert_close(&what, &got, &gemv, 5e-5);
        }
    });
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
    let mmq = if off {
        MatmulPath::Gemm
    } else {
        MatmulPath::Mmq
    };
    let what = format!("{rows}x{cols} (AFM_MMQ=0: {off})");
    for (n, expected) in [
        (16, MatmulPath::Gemv),
        (17, mmq),
        (64, mmq),
        (65, MatmulPath::Gemm),
    ] {
        assert_auto_is(&mut rng, &dw, n, expected, &what);
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
    let mats = [(DType::Q4K, 3201), (DType::Q6K, 1030), (DType::Q8_0, 517)];
    let path = MatmulPath::Mmq;
    shared_launch_cases(
        &mut Rng(34),
        4096,
        &mats,
        &BATCHES,
        path,
        |what, got, want| assert_eq!(got, want, "{what}: shared quantization differs"),
    );
}

/// Gate and up in one MMQ launch (16 rows of each per block) with the activation applied give
/// the activation of the separate MMQ results.
#[test]
fn gated_mmq_equals_activation_of_separate_mmq() {
    if mmq_env_off() {
        eprintln!("skipped: AFM_MMQ=0 keeps matmul_gated off the MMQ path");
        return;
    }
    // 3201 rows: 201 blocks of 16 rows of each; 4096 columns: the 8-warp kernels.
    let shapes = [(45, 2048), (19, 4096), (3201, 4096)];
    gated_cases(
        &mut Rng(37),
        &QUANT,
        &shapes,
        &BATCHES,
        MatmulPath::Mmq,
        |c, case, want| {
            let (dtype, n) = (case.dtype, case.n);
            let fused = case.auto(c);
            if n > MMQ_GATED_MAX_ROWS {
                // Past it the caller runs gate and up as one two-matrix launch.
                assert!(
                    fused.is_none(),
                    "{dtype:?} n={n}: fused past MMQ_GATED_MAX_ROWS"
                );
                return;
            }
            let got = fused.unwrap_or_else(|| panic!("{dtype:?} n={n}: not fused"));
            assert_close(&format!("gated MMQ {}", case.what()), &got, want, 1e-6);
        },
    );
}

#[test]
fn mmq_refuses_other_warp_counts() {
    let msg = refusal(
        &mut ctx(),
        &mut Rng(36),
        DType::Q4K,
        256,
        MatmulPath::MmqWarps(5),
    );
    assert!(msg.contains("MMQ warps per block"), "{msg}");
}

#[test]
fn mmq_refuses_unquantized_weights() {
    let msg = refusal(&mut ctx(), &mut Rng(35), DType::F16, 256, MatmulPath::Mmq);
    assert!(
        msg.contains("MMQ weight type") && msg.contains("F16"),
        "{msg}"
    );
}
