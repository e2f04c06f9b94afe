#![cfg(feature = "cuda")]
//! The RMSNorm and the residual add folded into the decode matmuls (`matmul_many_norm`,
//! `matmul_gated_norm`, `matmul_add`) against the CPU: the normalized products within 1e-5 of
//! `ops::rms_norm` then the exact product for 16-bit weights (f32 activations: only the
//! rounding order differs), 1e-2 for quantized ones (int8 activations, as the CPU's own
//! matmul rounds them; 2e-2 for act(gate) · up, a product of two rounded sums); past the GEMV's
//! rows the 16-bit cuBLAS path bit-equal to normalizing first; the accumulating matmul equal to
//! the plain one plus what the output held, on every path (GEMV, MMQ, cuBLAS, dequantize + cuBLAS). Outputs start poisoned or
//! random, so an unwritten or overwritten element fails.
//!
//! Needs a CUDA device (`AFM_CUDA_DEVICE`, default 0). Run with `--test-threads=1`.

mod common;

use afm_runtime::cuda::{Activation, CudaContext, DeviceWeight, MatmulPath, RowNorm};
use afm_runtime::ops;
use afm_runtime::{DType, WeightMatrix};
use common::int8::silu;
use common::weights::random_weight;
use common::{assert_close, ctx, poisoned, Rng};

const TYPES: [DType; 5] = [DType::BF16, DType::F16, DType::Q8_0, DType::Q4K, DType::Q6K];
const EPS: f32 = 1e-6;

fn is_quant(t: DType) -> bool {
    matches!(t, DType::Q8_0 | DType::Q4K | DType::Q6K)
}

/// Rows of `x` normalized by the CPU, with a norm weight away from 1 (so a missing or doubled
/// weight shows) and activations of mixed scale per row (so a shared 1/rms shows).
fn inputs(rng: &mut Rng, n: usize, cols: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut x = rng.vec(n * cols, 1.0);
    for (i, row) in x.chunks_exact_mut(cols).enumerate() {
        row.iter_mut().for_each(|v| *v *= 0.5 + i as f32);
    }
    let g: Vec<f32> = (0..cols).map(|_| 0.5 + rng.unit()).collect();
    let mut xn = vec![0f32; n * cols];
    for (r, o) in x.chunks_exact(cols).zip(xn.chunks_exact_mut(cols)) {
        ops::rms_norm_into(r, &g, EPS, o);
    }
    (x, g, xn)
}

fn reference(w: &WeightMatrix, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * w.rows()];
    w.matmul_reference(x, n, &mut y);
    y
}

#[test]
fn norm_folds_into_the_projections_up_to_the_gemv_batch() {
    let mut c = ctx();
    let mut rng = Rng(91);
    for cols in [1024, 4096] {
        for dtype in TYPES {
            // Q, K and V shapes: rows that leave partial blocks of 4 and of a thread group.
            let ws: Vec<WeightMatrix> = [70, 23, 41]
                .iter()
                .map(|&r| random_weight(&mut rng, dtype, r, cols))
                .collect();
            let dws: Vec<DeviceWeight> = ws
                .iter()
                .map(|w| DeviceWeight::upload(&c, w).unwrap())
                .collect();
            let refs: Vec<&DeviceWeight> = dws.iter().collect();
            for n in [1, 3, 8, 13, 16, 17] {
                let (x, g, xn) = inputs(&mut rng, n, cols);
                let (xd, gd) = (c.upload(&x).unwrap(), c.upload(&g).unwrap());
                let norm = RowNorm {
                    w: gd.slice(..),
                    eps: EPS,
                };
                let mut outs: Vec<_> = ws.iter().map(|w| poisoned(&c, n * w.rows())).collect();
                let mut o: Vec<_> = outs.iter_mut().collect();
                let folded = c.matmul_many_norm(&refs, &xd, norm, n, &mut o).unwrap();
                // The 16-bit GEMV folds it in at one row, the int8 quantization up to 16 rows,
                // the 16-bit cuBLAS path (past the GEMV's 8 rows) into its conversion of x;
                // between them the caller normalizes first.
                let expect = if is_quant(dtype) {
                    n <= 16
                } else {
                    n == 1 || n > 8
                };
                assert_eq!(folded, expect, "{dtype:?} n={n}: folded");
                if !folded {
                    continue;
                }
                let gemm = !is_quant(dtype) && n > 8;
                // cuBLAS takes x rounded to 16 bits: bf16 keeps 8 significant bits (seen on the
                // H200: 1.7e-3), f16 11.
                let tol = match dtype {
                    _ if is_quant(dtype) => 1e-2,
                    DType::BF16 if gemm => 4e-3,
                    _ if gemm => 1e-3,
                    _ => 1e-5,
                };
                let unfolded = gemm.then(|| {
                    let mut xn_d = poisoned(&c, n * cols);
                    c.rms_norm(&xd, &gd, EPS, &mut xn_d).unwrap();
                    let mut plain: Vec<_> = ws.iter().map(|w| poisoned(&c, n * w.rows())).collect();
                    let mut p: Vec<_> = plain.iter_mut().collect();
                    assert!(c.matmul_many(&refs, &xn_d, n, &mut p).unwrap());
                    plain
                });
                for (i, (w, out)) in ws.iter().zip(&outs).enumerate() {
                    let what = format!("norm+matmul {dtype:?} {}x{cols} n={n}", w.rows());
                    let got = c.download(out).unwrap();
                    assert_close(&what, &got, &reference(w, &xn, n), tol);
                    // Normalizing into the conversion changes no bit of the GEMM's input.
                    if let Some(plain) = &unfolded {
                        let want = c.download(&plain[i]).unwrap();
                        assert!(got == want, "{what}: folded differs from norm then matmul");
                    }
                }
            }
        }
    }
}

#[test]
fn norm_folds_into_gate_and_up() {
    let mut c = ctx();
    let mut rng = Rng(92);
    let rows = 45;
    for cols in [2048, 4096, 8192] {
        for dtype in TYPES {
            let (gw, uw) = (
                random_weight(&mut rng, dtype, rows, cols),
                random_weight(&mut rng, dtype, rows, cols),
            );
            let (gd, ud) = (
                DeviceWeight::upload(&c, &gw).unwrap(),
                DeviceWeight::upload(&c, &uw).unwrap(),
            );
            for n in [1, 5, 8, 16, 40] {
                let (x, g, xn) = inputs(&mut rng, n, cols);
                let (xd, nd) = (c.upload(&x).unwrap(), c.upload(&g).unwrap());
                let norm = RowNorm {
                    w: nd.slice(..),
                    eps: EPS,
                };
                let mut out = poisoned(&c, n * rows);
                let folded = c
                    .matmul_gated_norm(&gd, &ud, Activation::Silu, &xd, norm, n, &mut out)
                    .unwrap();
                // 16-bit gate+up folds it in at one row of at most 4,096 columns, and past the
                // GEMV's 8 rows into the conversion for cuBLAS.
                let expect = if is_quant(dtype) {
                    n <= 16
                } else {
                    (n == 1 && cols <= 4096) || n > 8
                };
                assert_eq!(folded, expect, "{dtype:?} {cols} columns n={n}");
                if !folded {
                    continue;
                }
                let (yg, yu) = (reference(&gw, &xn, n), reference(&uw, &xn, n));
                let want: Vec<f32> = yg.iter().zip(&yu).map(|(&a, &b)| silu(a) * b).collect();
                // Quantized: both factors carry the int8 rounding of the activations; cuBLAS
                // the 16-bit rounding of x.
                let gemm = !is_quant(dtype) && n > 8;
                let tol = match dtype {
                    _ if is_quant(dtype) => 2e-2,
                    DType::BF16 if gemm => 6e-3, // seen on the H200: 2.3e-3
                    _ if gemm => 2e-3,
                    _ => 1e-5,
                };
                let what = format!("norm+gate/up {dtype:?} {rows}x{cols} n={n}");
                let got = c.download(&out).unwrap();
                assert_close(&what, &got, &want, tol);
                if gemm {
                    let mut xn_d = poisoned(&c, n * cols);
                    c.rms_norm(&xd, &nd, EPS, &mut xn_d).unwrap();
                    let mut plain = poisoned(&c, n * rows);
                    let act = Activation::Silu;
                    assert!(c.matmul_gated(&gd, &ud, act, &xn_d, n, &mut plain).unwrap());
                    let same = got == c.download(&plain).unwrap();
                    assert!(same, "{what}: folded differs from norm then gate/up");
                }
            }
        }
    }
}

#[test]
fn accumulating_matmul_adds_to_the_output_on_every_path() {
    let mut c = ctx();
    let mut rng = Rng(93);
    let (rows, cols) = (70, 4096);
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::Q8_0,
        DType::Q4K,
        DType::Q6K,
    ] {
        let w = random_weight(&mut rng, dtype, rows, cols);
        let dw = DeviceWeight::upload(&c, &w).unwrap();
        // GEMV, int8 GEMV, MMQ / cuBLAS, dequantize + cuBLAS.
        for n in [1, 8, 13, 40, 70] {
            let x = rng.vec(n * cols, 1.0);
            let xd = c.upload(&x).unwrap();
            let mut plain = poisoned(&c, n * rows);
            c.matmul_with(MatmulPath::Auto, &dw, &xd, n, &mut plain)
                .unwrap();
            let y = c.download(&plain).unwrap();
            let r = rng.vec(n * rows, 1.0);
            let mut acc = c.upload(&r).unwrap();
            c.matmul_add(&dw, &xd, n, &mut acc).unwrap();
            let want: Vec<f32> = r.iter().zip(&y).map(|(a, b)| a + b).collect();
            let what = format!("matmul_add {dtype:?} {rows}x{cols} n={n}");
            assert_close(&what, &c.download(&acc).unwrap(), &want, 1e-6);
        }
    }
}

/// The gated MLP of a residual block in one path past the GEMV's rows (`matmul_mlp_add`: the
/// normalized x and the activation written in 16 bits for cuBLAS) is bit-equal to the folded
/// gate+up then the accumulating down projection, for SiLU and GELU, widths whose activation
/// takes the float4 path and one that does not; quantized weights and GEMV rows decline.
#[test]
fn mlp_in_one_path_equals_gate_up_then_down() {
    let mut c = ctx();
    // The cuBLAS one-path MLP; the skinny kernels' gated MLP is checked in cuda_skinny.rs.
    c.set_gemm_path(MatmulPath::Gemm);
    let mut rng = Rng(94);
    for (dtype, d, ff) in [
        (DType::BF16, 1024, 96),
        (DType::F16, 2048, 45),
        (DType::Q8_0, 1024, 64),
    ] {
        let (gw, uw, dw) = (
            random_weight(&mut rng, dtype, ff, d),
            random_weight(&mut rng, dtype, ff, d),
            random_weight(&mut rng, dtype, d, ff),
        );
        let up = |w: &WeightMatrix| DeviceWeight::upload(&c, w).unwrap();
        let (gd, ud, dd) = (up(&gw), up(&uw), up(&dw));
        for n in [8, 9, 40] {
            for act in [Activation::Silu, Activation::GeluTanh] {
                let (x, g, _) = inputs(&mut rng, n, d);
                let nd = c.upload(&g).unwrap();
                let norm = || RowNorm {
                    w: nd.slice(..),
                    eps: EPS,
                };
                let mut one = c.upload(&x).unwrap();
                let taken = c
                    .matmul_mlp_add(&gd, &ud, &dd, act, &mut one, norm(), n)
                    .unwrap();
                let what = format!("mlp {dtype:?} {d}/{ff} n={n} {act:?}");
                assert_eq!(taken, !is_quant(dtype) && n > 8, "{what}: taken");
                if !taken {
                    assert!(c.download(&one).unwrap() == x, "{what}: x changed");
                    continue;
                }
                let xd = c.upload(&x).unwrap();
                let mut h = poisoned(&c, n * ff);
                let gated = c.matmul_gated_norm(&gd, &ud, act, &xd, norm(), n, &mut h);
                assert!(gated.unwrap(), "{what}: gate+up path");
                let mut two = c.upload(&x).unwrap();
                c.matmul_add(&dd, &h, n, &mut two).unwrap();
                let same = c.download(&one).unwrap() == c.download(&two).unwrap();
                assert!(same, "{what}: one path differs from gate+up then down");
            }
        }
    }
    c.set_gemm_path(MatmulPath::Auto);
}

/// Q/K/V and gate+up uploaded back to back in one allocation (`DeviceWeight::upload_joined`,
/// what the models do) give the results of separate uploads: bit for bit on the GEMV (views are
/// only addresses), and within rounding past it, where the joined matrices run as one GEMM
/// (Q/K/V then split into their outputs) and cuBLAS may sum in another order. That GEMM's
/// output left as one buffer of rows `[q | k | v]` (`matmul_joined`, 9 to 64 rows here) holds
/// the split outputs' bits. Quantized weights are not joined and take their usual paths.
#[test]
fn joined_weights_equal_separate_uploads() {
    let mut c = ctx();
    let mut rng = Rng(95);
    // (type, width, Q rows, K/V rows, ff): float4 widths, and odd ones (scalar split and act).
    for (dtype, d, qr, kr, ff) in [
        (DType::BF16, 1024, 2048, 512, 96),
        (DType::F16, 512, 1000, 250, 45),
        (DType::Q8_0, 1024, 256, 128, 64),
    ] {
        let mats = [qr, kr, kr, ff, ff].map(|r| random_weight(&mut rng, dtype, r, d));
        let dw = random_weight(&mut rng, dtype, d, ff);
        let sep: Vec<DeviceWeight> = mats
            .iter()
            .map(|w| DeviceWeight::upload(&c, w).unwrap())
            .collect();
        let qkv = DeviceWeight::upload_joined(&c, &[&mats[0], &mats[1], &mats[2]]).unwrap();
        let gu = DeviceWeight::upload_joined(&c, &[&mats[3], &mats[4]]).unwrap();
        let down = DeviceWeight::upload(&c, &dw).unwrap();
        // One allocation, back to back (separate uploads may also happen to lie back to back:
        // the allocator's choice, so adjacency alone proves nothing).
        let adjacent = c.weight_ptr(&qkv[1]) == c.weight_ptr(&qkv[0]) + qkv[0].byte_len() as u64
            && c.weight_ptr(&gu[1]) == c.weight_ptr(&gu[0]) + gu[0].byte_len() as u64;
        let shared = qkv[0].shares_allocation(&qkv[2]) && gu[0].shares_allocation(&gu[1]);
        assert_eq!(
            shared,
            !is_quant(dtype),
            "{dtype:?}: joined in one allocation"
        );
        assert!(
            !shared || adjacent,
            "{dtype:?}: joined views not back to back"
        );
        assert!(!sep[0].shares_allocation(&sep[1]));
        for n in [1, 8, 9, 16, 40, 64] {
            let what = format!("{dtype:?} d={d} n={n}");
            let (x, g, _) = inputs(&mut rng, n, d);
            let (xd, nd) = (c.upload(&x).unwrap(), c.upload(&g).unwrap());
            let norm = || RowNorm {
                w: nd.slice(..),
                eps: EPS,
            };
            // Bit-equal on the GEMV; past it, one GEMM against three.
            let tol = if n <= 8 { 0.0 } else { 1e-5 };
            let close = |what: &str, a: &[f32], b: &[f32]| {
                if tol == 0.0 {
                    assert!(a == b, "{what}: differs from separate uploads");
                } else {
                    assert_close(what, a, b, tol);
                }
            };
            let run_qkv = |c: &mut CudaContext, ws: [&DeviceWeight; 3]| {
                let mut outs: Vec<_> = [qr, kr, kr].map(|r| poisoned(c, n * r)).into();
                let mut refs: Vec<_> = outs.iter_mut().collect();
                let ok = c.matmul_many_norm(&ws, &xd, norm(), n, &mut refs).unwrap();
                ok.then(|| {
                    outs.iter()
                        .map(|o| c.download(o).unwrap())
                        .collect::<Vec<_>>()
                })
            };
            let one = run_qkv(&mut c, [&qkv[0], &qkv[1], &qkv[2]]);
            let three = run_qkv(&mut c, [&sep[0], &sep[1], &sep[2]]);
            assert_eq!(one.is_some(), three.is_some(), "{what}: same paths taken");
            for (i, (a, b)) in one.iter().flatten().zip(three.iter().flatten()).enumerate() {
                close(&format!("{what} qkv {i}"), a, b);
            }
            // Past the GEMV's rows, the joined weights' one GEMM also as one buffer of rows
            // [q | k | v] (`matmul_joined`, no copy into three): each part the bits of the
            // three outputs above; with and without the norm.
            let joined_ws = [&qkv[0], &qkv[1], &qkv[2]];
            let mmh = std::env::var("AFM_MMH").is_ok_and(|v| v == "1");
            for with_norm in [true, false] {
                let rn = with_norm.then(norm);
                let j = c.matmul_joined(&joined_ws, &xd, rn, n).unwrap();
                let expect = n > 8 && !is_quant(dtype) && (with_norm || !mmh);
                let w = format!("{what} norm {with_norm}");
                assert_eq!(j.is_some(), expect, "{w}: matmul_joined taken");
                let Some(j) = j else { continue };
                let parts = if with_norm {
                    one.clone().expect("the three-output path ran")
                } else {
                    let mut outs: Vec<_> = [qr, kr, kr].map(|r| poisoned(&c, n * r)).into();
                    let mut refs: Vec<_> = outs.iter_mut().collect();
                    assert!(c.matmul_many(&joined_ws, &xd, n, &mut refs).unwrap());
                    outs.iter().map(|o| c.download(o).unwrap()).collect()
                };
                let j = c.download(&j).unwrap();
                let stride = qr + 2 * kr;
                assert_eq!(j.len(), n * stride, "{w}: joined length");
                for (i, (off, width)) in [(0, qr), (qr, kr), (qr + kr, kr)].into_iter().enumerate()
                {
                    let part: Vec<u32> = j
                        .chunks_exact(stride)
                        .flat_map(|row| &row[off..off + width])
                        .map(|v| v.to_bits())
                        .collect();
                    let want: Vec<u32> = parts[i].iter().map(|v| v.to_bits()).collect();
                    assert!(
                        part == want,
                        "{w}: joined part {i} differs from matmul_many's"
                    );
                }
            }
            // Separately uploaded weights are not one GEMM's rows.
            let sep_ws = [&sep[0], &sep[1], &sep[2]];
            let none = c.matmul_joined(&sep_ws, &xd, Some(norm()), n).unwrap();
            assert!(none.is_none(), "{what}: matmul_joined of separate uploads");
            for act in [Activation::Silu, Activation::GeluTanh] {
                let gated = |c: &mut CudaContext, g: &DeviceWeight, u| {
                    let mut h = poisoned(c, n * ff);
                    let ok = c.matmul_gated_norm(g, u, act, &xd, norm(), n, &mut h);
                    ok.unwrap().then(|| c.download(&h).unwrap())
                };
                let (a, b) = (
                    gated(&mut c, &gu[0], &gu[1]),
                    gated(&mut c, &sep[3], &sep[4]),
                );
                assert_eq!(a.is_some(), b.is_some(), "{what}: same gated paths");
                if let (Some(a), Some(b)) = (a, b) {
                    close(&format!("{what} gate+up {act:?}"), &a, &b);
                }
                let mlp = |c: &mut CudaContext, g: &DeviceWeight, u| {
                    let mut xm = c.upload(&x).unwrap();
                    let ok = c.matmul_mlp_add(g, u, &down, act, &mut xm, norm(), n);
                    ok.unwrap().then(|| c.download(&xm).unwrap())
                };
                let (a, b) = (mlp(&mut c, &gu[0], &gu[1]), mlp(&mut c, &sep[3], &sep[4]));
                assert_eq!(a.is_some(), b.is_some(), "{what}: same MLP paths");
                if let (Some(a), Some(b)) = (a, b) {
                    close(&format!("{what} mlp {act:?}"), &a, &b);
                }
            }
        }
    }
}
