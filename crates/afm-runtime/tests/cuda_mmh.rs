#![cfg(feature = "cuda")]
//! The 16-bit tensor-core matmul (MMH: `mma.sync` m16n8k16 bf16/f16 on BF16/F16 weights,
//! cuda/mmh.rs) against the CPU, at 9, 16, 17, 32, 33 and 64 activation rows (and 1, 8 and 100
//! when forced: one tile, two launches), weight row counts that are not multiples of the
//! kernels' 16-row tiles nor of their 128/256-row blocks, and widths 1024, 3072 and 4096:
//! - exactly the weights times the activations rounded to bf16/f16 (half's round to nearest
//!   even, as the kernel and the cuBLAS path's conversion do; relative error 5e-5: float
//!   summation order only), with 4 and 8 warps per block, K split 1, 3 and 16 ways (summed by
//!   the last split in the kernel and by `mmh_reduce`), L2 prefetch on and off, and the
//!   automatic shape; a split-K launch run twice gives the same bits;
//! - no less accurate than the cuBLAS path it replaces (x → bf16/f16, GEMM), both measured
//!   against the CPU's f32 matmul, and within cuda_ops's bounds for that path (2e-2 bf16,
//!   1e-3 f16);
//! - the automatic path takes MMH from 9 to 64 rows (GEMV below, cuBLAS above) unless
//!   MMH is off (no `AFM_MMH=1`) or the width is not a multiple of 64 (then the skinny GEMM
//!   where it runs, else cuBLAS); Q/K/V in one launch give the single
//!   launches' results; gate+up in one launch with SiLU / GELU tanh the activation of the
//!   separate results; the accumulating matmul gives the output before plus the matmul, bit for bit;
//! - quantized weights, widths that are not a multiple of 64 and warp counts other than 4 and
//!   8 are refused with an error naming them;
//! - no kernel spills to local memory as the driver compiles it.
//!
//! Outputs are poisoned with NaN first. Needs a CUDA device of compute capability 8.0 or
//! later (`AFM_CUDA_DEVICE`, default 0); run with `--test-threads=1` (one shared context).

mod common;

use afm_runtime::cuda::{skinny_plan, DeviceWeight, MatmulPath, MMH_GATED_MAX_ROWS};
use afm_runtime::DType;
use common::int8::activations;
use common::matmul::{
    assert_as_accurate_as_cublas, assert_auto_is, exact_cases, gated_cases, refusal, rounded16,
    shared_launch_cases, with_forced_small,
};
use common::weights::random_weight;
use common::{assert_close, ctx, poisoned, Rng};

const HALF: [DType; 2] = [DType::BF16, DType::F16];
/// (rows, cols): rows not multiples of 16; 517 = two 256-row blocks and 5 rows; widths of
/// Qwen3-0.6B (1024, its down projection's 3072) and -8B (4096).
const SHAPES: [(usize, usize); 4] = [(37, 1024), (517, 1024), (70, 3072), (300, 4096)];
/// The automatic path's MMH batches: tile edges (9, 17, 33), whole tiles (16, 32, 64).
const BATCHES: [usize; 6] = [9, 16, 17, 32, 33, 64];
/// (warps, splits, fixup, L2 prefetch chunks) forced: no split, an uneven split of the chunks
/// summed in the kernel and by `mmh_reduce`, the most splits both ways; prefetch off, shorter
/// and longer than a split's chunks.
const FORCED: [(usize, usize, bool, usize); 6] = [
    (4, 1, true, 0),
    (8, 1, true, 4),
    (4, 3, true, 2),
    (8, 3, false, 4),
    (8, 16, true, 8),
    (4, 16, false, 0),
];

fn forced(warps: usize, splits: usize, fixup: bool, prefetch: usize) -> MatmulPath {
    MatmulPath::MmhWith {
        warps,
        splits,
        fixup,
        prefetch,
    }
}

/// Automatic path choice takes MMH only with `AFM_MMH=1` (cuda/mmh.rs `mmh_env_on`).
fn mmh_env_off() -> bool {
    !std::env::var("AFM_MMH").is_ok_and(|v| v == "1")
}

#[test]
fn mmh_equals_weights_times_rounded_activations() {
    let batches = |rows| with_forced_small(&BATCHES, rows);
    exact_cases(&mut Rng(41), &HALF, &SHAPES, batches, rounded16, |case| {
        for (warps, splits, fixup, prefetch) in FORCED {
            let path = forced(warps, splits, fixup, prefetch);
            let got = case.run(path);
            let what = format!(
                "{} {warps} warps {splits} splits fixup {fixup}",
                case.what()
            );
            assert_close(&what, &got, case.want, 5e-5);
            if splits > 1 {
                // The split-K sum runs in a fixed order, whichever block arrives last.
                let again = case.run(path);
                assert_eq!(got, again, "{what}: a second run differs");
            }
        }
        let got = case.run(MatmulPath::Mmh);
        let what = format!("{} automatic shape", case.what());
        assert_close(&what, &got, case.want, 5e-5);
    });
}

/// MMH gives the cuBLAS path's result to summation order and is no less accurate.
#[test]
fn mmh_is_as_accurate_as_the_cublas_path() {
    let shapes = [(70, 3072), (300, 4096)];
    assert_as_accurate_as_cublas(&mut Rng(42), "MMH", &shapes, &[9, 32, 64], |_, _| {
        MatmulPath::Mmh
    });
}

/// The path `Auto` takes from 9 to 64 rows where MMH does not: the skinny GEMM where it runs
/// (compute capability 9.0, a plan for the shape, `AFM_SKINNY` not `0`), else cuBLAS.
fn gemm_auto(rows: usize, cols: usize) -> MatmulPath {
    let c = ctx();
    let on = std::env::var("AFM_SKINNY").map_or(true, |v| v != "0");
    match skinny_plan(rows, cols, c.info().sm_count) {
        Some(p) if on && c.info().compute_capability == (9, 0) => MatmulPath::Skinny(p),
        _ => MatmulPath::Gemm,
    }
}

/// `Auto` runs the GEMV up to 8 rows, MMH from 9 to 64 and cuBLAS above (each compared bit for
/// bit with the forced path); without `AFM_MMH=1`, or a width MMH does not take, the skinny
/// GEMM or cuBLAS from 9 ([`gemm_auto`]).
#[test]
fn auto_path_takes_mmh_from_9_to_64_rows() {
    let mut rng = Rng(43);
    let off = mmh_env_off();
    // 1040 columns: a multiple of 16 (the GEMV takes it), not of 64.
    for (rows, cols) in [(300, 4096), (45, 1040)] {
        let w = random_weight(&mut rng, DType::BF16, rows, cols);
        let dw = DeviceWeight::upload(&ctx(), &w).expect("upload");
        let mmh = !off && cols.is_multiple_of(64);
        for n in [8, 9, 64, 65] {
            let expected = match n {
                8 => MatmulPath::Gemv,
                65 => MatmulPath::Gemm,
                _ if mmh => MatmulPath::Mmh,
                _ => gemm_auto(rows, cols),
            };
            let what = format!("{rows}x{cols} (MMH off: {off})");
            assert_auto_is(&mut rng, &dw, n, expected, &what);
        }
    }
}

/// Q/K/V (2048, 1024, 517 rows) in one launch give the single launches' results (to float
/// summation order: the shapes, so the K splits, differ).
#[test]
fn shared_launch_matches_single_mmh() {
    if mmh_env_off() {
        eprintln!("skipped: without AFM_MMH=1 matmul_many stays off the MMH path");
        return;
    }
    let mut rng = Rng(44);
    for (dtype, cols) in [(DType::BF16, 1024), (DType::F16, 4096)] {
        let mats = [(dtype, 2048), (dtype, 1024), (dtype, 517)];
        let path = MatmulPath::Mmh;
        shared_launch_cases(
            &mut rng,
            cols,
            &mats,
            &[9, 33, 64],
            path,
            |what, got, want| {
                // Different K splits sum in a different order: the H200 showed 1.01e-6.
                assert_close(&format!("{what} in one launch"), got, want, 1e-5)
            },
        );
    }
}

/// Gate and up in one launch with the activation applied give the activation of the single
/// MMH results, with the automatic shape (via `matmul_gated`) and forced ones.
#[test]
fn gated_mmh_equals_activation_of_single_mmh() {
    let off = mmh_env_off();
    // 45 rows: one block of 64 or 128; 3201: 26 blocks of 128 (8 warps).
    let shapes = [(45, 1024), (3201, 4096)];
    let separate = MatmulPath::Mmh;
    gated_cases(
        &mut Rng(45),
        &HALF,
        &shapes,
        &[9, 17, 33, 64],
        separate,
        |c, case, want| {
            let what = format!("gated MMH {}", case.what());
            // MMH's gated launch when it is on; when off, 16-bit gate+up past the GEMV's rows
            // still runs fused (one conversion, the cuBLAS GEMMs, the activation: gate_up_half).
            let auto = case.auto(c);
            assert!(
                auto.is_some(),
                "{what}: matmul_gated declined (AFM_MMH=0: {off}, MMH_GATED_MAX_ROWS {MMH_GATED_MAX_ROWS})"
            );
            if let Some(got) = auto {
                assert_close(&format!("{what} auto"), &got, want, 1e-5);
            }
            for (warps, splits, fixup) in [(4, 1, true), (8, 5, true), (4, 6, false)] {
                let got = case.forced(c, forced(warps, splits, fixup, 4));
                let what = format!("{what} {warps} warps {splits} splits");
                assert_close(&what, &got, want, 1e-5);
            }
        },
    );
}

/// The accumulating matmul adds the product to what the output held: bit for bit the output
/// before plus the plain MMH result of the same shape (tests/cuda_fused.rs covers the other
/// paths).
#[test]
fn matmul_add_accumulates_into_the_output() {
    let mut rng = Rng(46);
    let mut c = ctx();
    for (dtype, rows, cols) in [(DType::BF16, 517, 1024), (DType::F16, 300, 4096)] {
        let w =
            DeviceWeight::upload(&c, &random_weight(&mut rng, dtype, rows, cols)).expect("upload");
        for n in [9, 33, 64] {
            let x = activations(&mut rng, n, cols);
            let xd = c.upload(&x).expect("upload");
            let before = rng.vec(n * rows, 4.0);
            for path in [
                forced(4, 1, true, 0),
                forced(8, 7, true, 4),
                forced(4, 7, false, 4),
                MatmulPath::Mmh,
            ] {
                let mut plain = poisoned(&c, n * rows);
                c.matmul_with(path, &w, &xd, n, &mut plain).expect("matmul");
                let plain = c.download(&plain).expect("download");
                let want: Vec<f32> = before.iter().zip(&plain).map(|(a, b)| a + b).collect();
                let mut out = c.upload(&before).expect("upload");
                c.matmul_into(path, &w, &xd, n, &mut out, true)
                    .expect("add");
                let got = c.download(&out).expect("download");
                assert_eq!(
                    got, want,
                    "{dtype:?} {rows}x{cols} n={n} {path:?}: out + x·Wᵀ"
                );
            }
        }
    }
}

/// As the driver compiled them for this device, no MMH kernel spills to local memory (a spill
/// in the ring's loop would cost more than the tensor cores save); the registers are logged.
#[test]
fn mmh_kernels_do_not_spill() {
    let res = ctx().mmh_resources().expect("kernel attributes");
    eprintln!("(kernel, registers, local bytes): {res:?}");
    let spilled: Vec<_> = res.iter().filter(|r| r.2 > 0).collect();
    assert!(spilled.is_empty(), "local memory in {spilled:?}");
}

#[test]
fn mmh_refuses_what_it_cannot_serve() {
    let mut rng = Rng(47);
    let mut c = ctx();
    for (dtype, cols) in [(DType::Q4K, 1024), (DType::BF16, 1040)] {
        let msg = refusal(&mut c, &mut rng, dtype, cols, MatmulPath::Mmh);
        assert!(
            msg.contains("MMH weights") && msg.contains(&format!("{cols}")),
            "{msg}"
        );
    }
    let msg = refusal(&mut c, &mut rng, DType::BF16, 1024, forced(5, 1, true, 0));
    assert!(msg.contains("MMH warps per block"), "{msg}");
}
