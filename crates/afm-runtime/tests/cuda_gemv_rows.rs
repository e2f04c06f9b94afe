#![cfg(feature = "cuda")]
//! The one-row 16-bit GEMV at every block shape (weight rows per block R = 1, 2, 4 and 8, and
//! two units in flight at R = 2 and 4, forced through `CudaContext::set_gemv_half`, and the
//! table's own pick): each product kind (plain, residual add, Q/K/V with and without the folded
//! RMSNorm, gate+up with SiLU and GELU, with and without the norm) gives the same bits at every
//! shape, and at R = 4 is within 1e-5 of the CPU's exact product
//! (`WeightMatrix::matmul_reference` after `ops::rms_norm_into`: f32 activations, only the
//! rounding order differs). Row counts leave partial blocks at every R > 1, and 3,072 columns
//! (3 units per thread) a partial step at two units in flight. Also: a shape the kernels lack
//! is refused; the one-row kernels do not spill.
//!
//! Needs a CUDA device (`AFM_CUDA_DEVICE`, default 0). Run with `--test-threads=1`. The
//! overrides are process-wide, so they live in this binary only (cuda_fused.rs checks the
//! default fold limits).

mod common;

use afm_runtime::cuda::{Activation, CudaContext, CudaSlice, DeviceWeight, RowNorm};
use afm_runtime::ops;
use afm_runtime::{DType, WeightMatrix};
use common::int8::{gelu_tanh, silu};
use common::weights::random_weight;
use common::{assert_close, ctx, poisoned, Rng};

const EPS: f32 = 1e-6;
/// Block shapes as `AFM_GEMV_R` takes them, R = 4 first (the one checked against the CPU);
/// `None`: the table's pick (`matmul.rs` `half_rows_rule`).
const SHAPES: [Option<&str>; 7] = [
    Some("4"),
    Some("1"),
    Some("2"),
    Some("8"),
    Some("2u2"),
    Some("4u2"),
    None,
];

/// Restores the table (and the default gate+up fold width) when a test ends, even by a panic:
/// declared before the test takes the context, so it drops (and takes it) after.
struct Restore;
impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(e) = ctx().set_gemv_half(None, false) {
            eprintln!("restoring the GEMV overrides: {e}");
        }
    }
}

fn reference(w: &WeightMatrix, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; w.rows()];
    w.matmul_reference(x, 1, &mut y);
    y
}

/// Every product kind at one activation row on `c`, in a fixed order: (description, output).
#[allow(clippy::too_many_arguments)]
fn all_products(
    c: &mut CudaContext,
    qkv: &[DeviceWeight],
    gu: &[DeviceWeight],
    x: &CudaSlice<f32>,
    g: &CudaSlice<f32>,
    before: &[f32],
) -> Vec<(String, Vec<f32>)> {
    let mut res = Vec::new();
    let norm = || RowNorm {
        w: g.slice(..),
        eps: EPS,
    };
    for (i, w) in qkv.iter().enumerate() {
        let mut y = poisoned(c, w.rows());
        c.matmul(w, x, 1, &mut y).expect("matmul");
        res.push((format!("plain {i}"), c.download(&y).expect("download")));
        let mut acc = c.upload(&before[..w.rows()]).expect("upload");
        c.matmul_add(w, x, 1, &mut acc).expect("matmul_add");
        res.push((format!("add {i}"), c.download(&acc).expect("download")));
    }
    for k in [2, 3] {
        for folded in [false, true] {
            let mut outs: Vec<CudaSlice<f32>> =
                qkv[..k].iter().map(|w| poisoned(c, w.rows())).collect();
            let mut o: Vec<&mut CudaSlice<f32>> = outs.iter_mut().collect();
            let ws: Vec<&DeviceWeight> = qkv[..k].iter().collect();
            let done = if folded {
                c.matmul_many_norm(&ws, x, norm(), 1, &mut o)
            } else {
                c.matmul_many(&ws, x, 1, &mut o)
            };
            assert!(
                done.expect("matmul_many"),
                "{k} matrices, norm {folded}: declined"
            );
            for (i, y) in outs.iter().enumerate() {
                let what = format!("{k} matrices norm {folded}, output {i}");
                res.push((what, c.download(y).expect("download")));
            }
        }
    }
    for act in [Activation::Silu, Activation::GeluTanh] {
        for folded in [false, true] {
            let mut y = poisoned(c, gu[0].rows());
            let done = if folded {
                c.matmul_gated_norm(&gu[0], &gu[1], act, x, norm(), 1, &mut y)
            } else {
                c.matmul_gated(&gu[0], &gu[1], act, x, 1, &mut y)
            };
            assert!(
                done.expect("gated"),
                "gate+up {act:?} norm {folded}: declined"
            );
            let what = format!("gate+up {act:?} norm {folded}");
            res.push((what, c.download(&y).expect("download")));
        }
    }
    res
}

#[test]
fn one_row_gemv_gives_the_same_bits_at_every_block_size() {
    let _restore = Restore;
    let mut c = ctx();
    let mut rng = Rng(101);
    // Q/K/V-like row counts: partial blocks of 2, 4 and 8, and grids on both sides of the
    // table's switch (a few blocks, and > 4 per SM at R = 8 for 5000 rows on 132 SMs).
    for (dtype, cols, qkv_rows, gu_rows) in [
        (DType::BF16, 1024, [70, 23, 41], 45),
        (DType::F16, 4096, [70, 23, 41], 45),
        (DType::BF16, 3072, [3000, 1000, 1000], 4500),
        (DType::F16, 2048, [2056, 520, 520], 3080),
    ] {
        let qh: Vec<WeightMatrix> = qkv_rows
            .iter()
            .map(|&r| random_weight(&mut rng, dtype, r, cols))
            .collect();
        let gh: Vec<WeightMatrix> = (0..2)
            .map(|_| random_weight(&mut rng, dtype, gu_rows, cols))
            .collect();
        let up = |w: &WeightMatrix| DeviceWeight::upload(&c, w).expect("upload");
        let qkv: Vec<DeviceWeight> = qh.iter().map(up).collect();
        let gu: Vec<DeviceWeight> = gh.iter().map(up).collect();
        let x = rng.vec(cols, 1.0);
        let g: Vec<f32> = (0..cols).map(|_| 0.5 + rng.unit()).collect();
        let before = rng.vec(qkv_rows[0], 1.0);
        let (xd, gd) = (c.upload(&x).expect("upload"), c.upload(&g).expect("upload"));
        let mut first: Option<Vec<(String, Vec<f32>)>> = None;
        for shape in SHAPES {
            // The norm folded into gate+up at 4,096 columns too, to cover gemvgn there.
            c.set_gemv_half(shape, true).expect("set the shape");
            let got = all_products(&mut c, &qkv, &gu, &xd, &gd, &before);
            match &first {
                None => first = Some(got),
                Some(want) => {
                    for ((what, a), (_, b)) in got.iter().zip(want) {
                        let moved = a
                            .iter()
                            .zip(b)
                            .filter(|(p, q)| p.to_bits() != q.to_bits())
                            .count();
                        assert_eq!(
                            moved, 0,
                            "{dtype:?} {cols} columns, shape {shape:?}, {what}: {moved} values differ from R = 4"
                        );
                    }
                }
            }
        }
        // R = 4 against the CPU.
        let got = first.expect("R = 4 ran");
        let mut xn = vec![0f32; cols];
        ops::rms_norm_into(&x, &g, EPS, &mut xn);
        let mut want: Vec<Vec<f32>> = Vec::new();
        for w in &qh {
            let y = reference(w, &x);
            want.push(y.clone());
            want.push(y.iter().zip(&before).map(|(a, b)| a + b).collect());
        }
        for k in [2, 3] {
            for inp in [&x, &xn] {
                for w in &qh[..k] {
                    want.push(reference(w, inp));
                }
            }
        }
        for act in [silu, gelu_tanh] {
            for inp in [&x, &xn] {
                let (yg, yu) = (reference(&gh[0], inp), reference(&gh[1], inp));
                want.push(yg.iter().zip(&yu).map(|(&a, &b)| act(a) * b).collect());
            }
        }
        assert_eq!(got.len(), want.len(), "products");
        for ((what, a), b) in got.iter().zip(&want) {
            assert_close(&format!("{dtype:?} {cols} columns R=4 {what}"), a, b, 1e-5);
        }
    }
}

/// Without the override the norm folds into 16-bit gate+up only up to 4,096 columns (the
/// widest measured a gain); with `gated_norm_any_width` at 8,192 too.
#[test]
fn gated_norm_fold_width_follows_the_override() {
    let _restore = Restore;
    let c = ctx();
    let mut rng = Rng(102);
    for cols in [4096, 8192] {
        let ws: Vec<DeviceWeight> = (0..2)
            .map(|_| {
                DeviceWeight::upload(&c, &random_weight(&mut rng, DType::BF16, 40, cols))
                    .expect("upload")
            })
            .collect();
        let x = c.upload(&rng.vec(cols, 1.0)).expect("upload");
        let refs: Vec<&DeviceWeight> = ws.iter().collect();
        for any in [false, true] {
            c.set_gemv_half(None, any).expect("set");
            let folds = c.folds_norm(&refs, true, 1, &x);
            assert_eq!(
                folds,
                any || cols <= 4096,
                "{cols} columns, any width {any}"
            );
        }
    }
}

#[test]
fn block_shapes_the_kernels_lack_are_refused() {
    let _restore = Restore;
    let c = ctx();
    for bad in ["0", "3", "5", "12", "16", "32", "8u2", "1u2", "4u3", "x"] {
        let e = c
            .set_gemv_half(Some(bad), false)
            .expect_err("a shape without kernels");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("= {bad} ")) && msg.contains("1, 2, 4, 8, 2u2 or 4u2"),
            "{bad}: {msg}"
        );
    }
    for good in ["1", "2", "4", "8", "2u2", "4u2"] {
        c.set_gemv_half(Some(good), false)
            .expect("a shape with kernels");
    }
}

/// As the driver compiled them for this device, no one-row 16-bit GEMV kernel spills to local
/// memory (R = 8 holds 8 rows' loads in flight per thread, R = 4 with two units 8 too);
/// registers are logged.
#[test]
fn one_row_gemv_kernels_do_not_spill() {
    let res = ctx().gemv_half_resources().expect("kernel attributes");
    eprintln!("(kernel, registers, local bytes): {res:?}");
    // 6 families x 2 types at R = 1, 2, 4, 8, their 6 preloading twins at R = 4, and plain and
    // residual add with two units in flight at R = 2 and 4.
    assert_eq!(
        res.len(),
        6 * 2 * 4 + 6 * 2 + 2 * 2 * 2,
        "one-row 16-bit kernels listed"
    );
    let spilled: Vec<_> = res.iter().filter(|r| r.2 > 0).collect();
    assert!(spilled.is_empty(), "local memory in {spilled:?}");
}
