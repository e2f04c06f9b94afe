//! Every op of device dispatch on the GPU against the CPU arm, on random data.
//! Runs when `AFM_TEST_DEVICE=cuda` (needs a CUDA device); otherwise it returns at once.

use super::*;
use crate::ops::Rope;

fn gpu() -> Option<Device> {
    if std::env::var("AFM_TEST_DEVICE").ok().as_deref() != Some("cuda") {
        eprintln!("skipped: set AFM_TEST_DEVICE=cuda to run on the GPU");
        return None;
    }
    Some(Device::open(DeviceChoice::Cuda(0)).expect("CUDA device 0"))
}

fn close(what: &str, gpu: &[f32], cpu: &[f32], tol: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: length");
    let scale = cpu.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let err = gpu
        .iter()
        .zip(cpu)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale;
    assert!(err <= tol, "{what}: relative error {err:.2e} > {tol:.0e}");
}

/// Runs `f` on both devices and compares the host copies of what it returns.
fn both(g: &Device, what: &str, tol: f32, f: impl Fn(&Device) -> Tensor) {
    let (a, b) = (f(g), f(&Device::Cpu));
    let (a, b) = (
        g.to_host(a).expect("download"),
        Device::Cpu.to_host(b).expect("host"),
    );
    close(what, &a, &b, tol);
}

fn tensor(dev: &Device, rows: usize, cols: usize, seed: u64) -> Tensor {
    let table = dev
        .weight(WeightMatrix::from_f32(
            rows,
            cols,
            &splitmix(seed, rows * cols),
        ))
        .expect("weight");
    let ids: Vec<u32> = (0..rows as u32).collect();
    dev.embed(&table, &ids, 1.0).expect("embed")
}

#[test]
fn every_op_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let (n, h, ff) = (5, 64, 96);
    both(&g, "embed", 1e-6, |d| {
        let t = d
            .weight(WeightMatrix::from_f32(7, h, &splitmix(1, 7 * h)))
            .unwrap();
        d.embed(&t, &[3, 0, 6, 3], 8.0).unwrap()
    });
    both(&g, "linear + bias", 1e-5, |d| {
        let w = d
            .weight(WeightMatrix::from_f32(ff, h, &splitmix(2, ff * h)))
            .unwrap();
        let b = d.vector(splitmix(3, ff)).unwrap();
        d.linear(&tensor(d, n, h, 4), &w, Some(&b)).unwrap()
    });
    both(&g, "rms_norm rows and heads", 1e-5, |d| {
        let x = tensor(d, n, h, 5);
        let mut y = d
            .rms_norm(&x, &d.vector(splitmix(6, h)).unwrap(), 1e-6)
            .unwrap();
        d.rms_norm_in_place(&mut y, &d.vector(splitmix(7, 16)).unwrap(), 1e-6)
            .unwrap();
        y
    });
    for act in [Activation::Silu, Activation::GeluTanh] {
        both(&g, "add, gated act, softcap", 1e-5, |d| {
            let mut x = tensor(d, n, ff, 8);
            d.add_assign(&mut x, &tensor(d, n, ff, 9)).unwrap();
            d.gated_act(act, &mut x, &tensor(d, n, ff, 10)).unwrap();
            d.softcap(&mut x, 0.5).unwrap();
            x
        });
    }
    both(&g, "gather rows", 0.0, |d| {
        d.gather_rows(&tensor(d, n, h, 11), &[4, 0, 4]).unwrap()
    });
    both(&g, "gather no rows", 0.0, |d| {
        d.gather_rows(&tensor(d, n, h, 11), &[]).unwrap()
    });
}

/// Two sequences over scattered blocks: a prefill of both, then a decode step of both.
fn attention_steps(d: &Device, dtype: KvDtype) -> Tensor {
    let (nh, nkv, hd, bs) = (4, 2, 16, 2);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: hd,
    };
    let mut kv = d.kv_pool(&[shape, shape], 8, bs, dtype).unwrap();
    let rope = Rope::new(hd, 10_000.0, 1.0, RopeStyle::Neox);
    let rot = d.rotary(rope, hd, RopeStyle::Neox, 64).unwrap();
    let (ta, tb) = ([5u32, 1, 7], [2u32, 0, 6]);
    let p = AttnParams {
        n_heads: nh,
        head_dim: hd,
        scale: 0.25,
        window: Some(3),
        softcap: Some(20.0),
    };
    let mut outs = Vec::new();
    for (i, (la, pa, lb, pb)) in [(3, 0, 4, 0), (1, 3, 1, 4)].into_iter().enumerate() {
        let seqs = [
            AttnSeq {
                row0: 0,
                len: la,
                pos0: pa,
                block_table: &ta,
            },
            AttnSeq {
                row0: la,
                len: lb,
                pos0: pb,
                block_table: &tb,
            },
        ];
        let step = d.step(&seqs, &kv, nh).unwrap();
        let rows = la + lb;
        let mut q = tensor(d, rows, nh * hd, 20 + i as u64);
        let mut k = tensor(d, rows, nkv * hd, 30 + i as u64);
        let v = tensor(d, rows, nkv * hd, 40 + i as u64);
        d.rope(&rot, &mut q, hd, &step).unwrap();
        d.rope(&rot, &mut k, hd, &step).unwrap();
        outs.push(d.attention(&mut kv, 1, &step, &q, &k, &v, &p).unwrap());
    }
    let a = d.to_host(outs.remove(0)).unwrap();
    let b = d.to_host(outs.remove(0)).unwrap();
    let cols = a.len() / 7;
    Tensor::from_host(9, cols, [a, b].concat()).unwrap()
}

#[test]
fn cached_attention_with_rope_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    for (dtype, tol) in [(KvDtype::F32, 1e-5), (KvDtype::F16, 2e-3)] {
        let a = g.to_host(attention_steps(&g, dtype)).unwrap();
        let b = Device::Cpu
            .to_host(attention_steps(&Device::Cpu, dtype))
            .unwrap();
        close(&format!("attention {dtype:?}"), &a, &b, tol);
    }
}

/// Rows written and read from the host (`kv_read_rows` / `kv_write_rows`), and rows the
/// attention op stored, read back the same way: `[keys | values]` of every read.
fn kv_rows_steps(d: &Device, dtype: KvDtype) -> Vec<f32> {
    let (nkv, hd, bs) = (2, 16, 4);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: hd,
    };
    let mut kv = d.kv_pool(&[shape, shape], 8, bs, dtype).unwrap();
    let table = [5u32, 1, 7];
    let w = nkv * hd;
    let at: Vec<usize> = (0..10).collect();
    let (k, v) = (splitmix(1, 10 * w), splitmix(2, 10 * w));
    d.kv_write_rows(&mut kv, 0, &table, &at, Some(&k), Some(&v))
        .unwrap();
    // Values only at two positions: the keys stay.
    d.kv_write_rows(&mut kv, 0, &table, &[3, 8], None, Some(&splitmix(3, 2 * w)))
        .unwrap();
    let seqs = [AttnSeq {
        row0: 0,
        len: 5,
        pos0: 0,
        block_table: &table,
    }];
    let step = d.step(&seqs, &kv, 4).unwrap();
    let p = AttnParams {
        n_heads: 4,
        head_dim: hd,
        scale: 0.25,
        window: None,
        softcap: None,
    };
    let (q, ka, va) = (
        tensor(d, 5, 4 * hd, 4),
        tensor(d, 5, w, 5),
        tensor(d, 5, w, 6),
    );
    d.attention(&mut kv, 1, &step, &q, &ka, &va, &p).unwrap();
    let mut out = Vec::new();
    for (layer, pos) in [(0, vec![9, 0, 3, 8, 4]), (1, vec![4, 2, 0])] {
        for part in [KvPart::Keys, KvPart::Values] {
            out.extend(d.kv_read_rows(&kv, layer, &table, &pos, part).unwrap());
        }
    }
    out
}

#[test]
fn kv_rows_match_the_cpu() {
    let Some(g) = gpu() else { return };
    for (dtype, tol) in [(KvDtype::F32, 0.0), (KvDtype::F16, 1e-3)] {
        let a = kv_rows_steps(&g, dtype);
        let b = kv_rows_steps(&Device::Cpu, dtype);
        close(&format!("kv rows {dtype:?}"), &a, &b, tol);
    }
    let mut kv = g
        .kv_pool(
            &[LayerKvShape {
                n_kv_heads: 1,
                head_dim: 16,
            }],
            2,
            4,
            KvDtype::F32,
        )
        .unwrap();
    let err = g
        .kv_write_rows(&mut kv, 0, &[1], &[4], Some(&[0.0; 16]), None)
        .expect_err("position past the table")
        .to_string();
    assert!(err.contains("block table length"), "{err}");
}

#[test]
fn weights_without_a_kernel_are_stored_as_f16() {
    let Some(g) = gpu() else { return };
    assert_eq!(g.stored_type(DType::Q5_0), DType::F16);
    assert_eq!(g.stored_type(DType::Q4K), DType::Q4K);
    // Q4_1 blocks: f16 scale 0.01, f16 minimum −0.07, nibbles 0..15 cycling.
    let (rows, cols) = (3, 64);
    let block: Vec<u8> = [0x1e, 0x21, 0x2b, 0xac]
        .into_iter()
        .chain((0..16u8).map(|i| i | ((15 - i) << 4)))
        .collect();
    let bytes: Vec<u8> = block
        .iter()
        .copied()
        .cycle()
        .take(20 * rows * cols / 32)
        .collect();
    let w =
        WeightMatrix::new(DType::Q4_1, rows, cols, crate::WeightBytes::from_vec(bytes)).unwrap();
    let x = splitmix(50, 2 * cols);
    let mut want = vec![0f32; 2 * rows];
    w.matmul_reference(&x, 2, &mut want);
    let gw = g.weight(w).unwrap();
    let y = g.linear(&Tensor::from_host(2, cols, x).unwrap(), &gw, None);
    assert!(y.is_err(), "a host tensor on the GPU is refused");
    let xt = {
        let t = g
            .weight(WeightMatrix::from_f32(2, cols, &splitmix(50, 2 * cols)))
            .unwrap();
        g.embed(&t, &[0, 1], 1.0).unwrap()
    };
    let got = g.to_host(g.linear(&xt, &gw, None).unwrap()).unwrap();
    close("Q4_1 as F16", &got, &want, 1e-3);
}

/// A bf16 weight of seeded values (the fused GEMV kernels serve 16-bit weights only).
fn bf16_weight(dev: &Device, rows: usize, cols: usize, seed: u64) -> Weight {
    let bytes: Vec<u8> = splitmix(seed, rows * cols)
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect();
    let w = WeightMatrix::new(DType::BF16, rows, cols, crate::WeightBytes::from_vec(bytes))
        .expect("bf16 matrix");
    dev.weight(w).expect("weight")
}

#[test]
fn fused_decode_ops_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let (h, nq, nkv, ff) = (64, 128, 32, 96);
    // 9 rows: past the fused kernels' 8, so the unfused fallback is checked too; it runs
    // through cuBLAS with bf16 activations (relative error ~1e-3, as `linear` there).
    for n in [1, 3, 8, 9] {
        let tol = if n <= 8 { 1e-5 } else { 5e-3 };
        for i in 0..3 {
            both(
                &g,
                &format!("linear_many, {n} rows, output {i}"),
                tol,
                |d| {
                    let (wq, wk, wv) = (
                        bf16_weight(d, nq, h, 11),
                        bf16_weight(d, nkv, h, 12),
                        bf16_weight(d, nkv, h, 13),
                    );
                    let x = tensor(d, n, h, 14);
                    let mut out = d
                        .linear_many(&x, &[(&wq, None), (&wk, None), (&wv, None)])
                        .unwrap();
                    out.swap_remove(i)
                },
            );
        }
        for act in [Activation::Silu, Activation::GeluTanh] {
            both(&g, &format!("gated_linear {act:?}, {n} rows"), tol, |d| {
                let (wg, wu) = (bf16_weight(d, ff, h, 15), bf16_weight(d, ff, h, 16));
                d.gated_linear(&tensor(d, n, h, 17), &wg, &wu, act).unwrap()
            });
        }
        // The norm folded into the projections (up to 8 rows; past them normalized first).
        for i in 0..3 {
            both(
                &g,
                &format!("norm_linear_many, {n} rows, output {i}"),
                tol,
                |d| {
                    let (wq, wk, wv) = (
                        bf16_weight(d, nq, h, 21),
                        bf16_weight(d, nkv, h, 22),
                        bf16_weight(d, nkv, h, 23),
                    );
                    let norm = d.vector(splitmix(24, h)).unwrap();
                    let x = tensor(d, n, h, 25);
                    let mut out = d
                        .norm_linear_many(&x, &norm, 1e-6, &[(&wq, None), (&wk, None), (&wv, None)])
                        .unwrap();
                    out.swap_remove(i)
                },
            );
        }
        both(&g, &format!("norm_gated_linear, {n} rows"), tol, |d| {
            let (wg, wu) = (bf16_weight(d, ff, h, 26), bf16_weight(d, ff, h, 27));
            let norm = d.vector(splitmix(28, h)).unwrap();
            let x = tensor(d, n, h, 29);
            d.norm_gated_linear(&x, &norm, 1e-6, &wg, &wu, Activation::Silu)
                .unwrap()
        });
        both(&g, &format!("linear_add, {n} rows"), tol, |d| {
            let w = bf16_weight(d, h, ff, 30);
            let mut acc = tensor(d, n, h, 31);
            d.linear_add(&tensor(d, n, ff, 32), &w, None, &mut acc)
                .unwrap();
            acc
        });
        both(&g, &format!("add_rms_norm, {n} rows"), 1e-5, |d| {
            let w = d.vector(splitmix(18, h)).unwrap();
            let mut x = tensor(d, n, h, 19);
            let y = tensor(d, n, h, 20);
            let normed = d.add_rms_norm(&mut x, &y, &w, 1e-6).unwrap();
            // Both the sum (left in x) and its norm.
            let mut v = d.to_host(x).unwrap();
            v.extend(d.to_host(normed).unwrap());
            Tensor::from_host(2 * n, h, v).unwrap()
        });
    }
}

/// The attention step through `attn_prologue` + `attend` (one prologue launch) and through
/// `attend_prologue` (one launch for the decode steps, where the decode kernel takes the
/// shape) on the GPU, against the separate ops on the CPU, and bit for bit against the
/// separate ops on the GPU: outputs, rotated q and k, and the cache after every step.
#[test]
fn fused_attention_step_matches_the_cpu_and_the_separate_kernels() {
    let Some(g) = gpu() else { return };
    for shape in [
        (16, 8, 128),
        (8, 2, 64),
        (8, 4, 256),
        (4, 4, 32),
        (32, 8, 128),
    ] {
        for norm in [true, false] {
            for (dtype, tol) in [(KvDtype::F32, 1e-5), (KvDtype::F16, 2e-3)] {
                let what = format!("heads/kv/head_dim {shape:?} norm {norm} {dtype:?}");
                let run = |d: &Device, path| attention_layer_steps(d, path, norm, dtype, shape);
                let (sep, qk_sep) = run(&g, AttnPath::Separate);
                let (cpu, qk_cpu) = run(&Device::Cpu, AttnPath::Separate);
                close(&what, &sep, &cpu, tol);
                close(&format!("{what}: q, k"), &qk_sep, &qk_cpu, 1e-5);
                for path in [AttnPath::Prologue, AttnPath::Fused] {
                    let (got, qk) = run(&g, path);
                    let moved = got.iter().zip(&sep).filter(|(a, b)| a != b).count();
                    assert_eq!(got.len(), sep.len(), "{what} {path:?}: length");
                    assert_eq!(
                        moved, 0,
                        "{what} {path:?}: {moved} values moved from the separate kernels"
                    );
                    if path == AttnPath::Prologue {
                        assert_eq!(qk, qk_sep, "{what}: rotated q, k moved");
                    }
                }
            }
        }
    }
}

/// A seeded bf16 matrix (placed joined with its neighbours by the caller).
fn bf16_matrix(rows: usize, cols: usize, seed: u64) -> WeightMatrix {
    let bytes: Vec<u8> = splitmix(seed, rows * cols)
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect();
    WeightMatrix::new(DType::BF16, rows, cols, crate::WeightBytes::from_vec(bytes))
        .expect("bf16 matrix")
}

/// A llama-family layer's attention as `llama.rs` runs it, over `seqs` sequences: a prefill of
/// 5 tokens each, then a decode step of all of them. Q/K/V are placed back to back
/// (`weights_joined`); `joined` takes `norm_linear_qkv` (one buffer of rows [q | k | v] on a
/// GPU past the GEMV's rows), else `norm_linear_many` into three tensors. Returns every step's
/// output, then each sequence's cached keys and values, and how many steps were joined. With
/// `bias`, Q, K and V have biases (Qwen2).
fn qkv_layer(
    d: &Device,
    joined: bool,
    bias: bool,
    seqs: usize,
    dtype: KvDtype,
) -> (Vec<f32>, usize) {
    let (h, nh, nkv, hd) = (256, 8, 2, 64);
    let ws = d
        .weights_joined(vec![
            bf16_matrix(nh * hd, h, 70),
            bf16_matrix(nkv * hd, h, 71),
            bf16_matrix(nkv * hd, h, 72),
        ])
        .expect("joined weights");
    let b = |len, seed| d.vector(splitmix(seed, len)).expect("bias");
    let bs = [b(nh * hd, 76), b(nkv * hd, 77), b(nkv * hd, 78)];
    let on = |i: usize| bias.then_some(&bs[i]);
    let proj = [(&ws[0], on(0)), (&ws[1], on(1)), (&ws[2], on(2))];
    let norm = d
        .vector(splitmix(73, h).iter().map(|v| 1.0 + 0.5 * v).collect())
        .expect("input norm");
    let head_w = |seed| splitmix(seed, hd).iter().map(|v| 1.0 + 0.5 * v).collect();
    let (qn, kn) = (d.vector(head_w(74)).unwrap(), d.vector(head_w(75)).unwrap());
    let nm = QkNorm {
        q: &qn,
        k: &kn,
        eps: 1e-6,
    };
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: hd,
    };
    let mut kv = d.kv_pool(&[shape], 2 * seqs, 4, dtype).expect("pool");
    let rot = d
        .rotary(
            Rope::new(hd, 1e6, 1.0, RopeStyle::Neox),
            hd,
            RopeStyle::Neox,
            64,
        )
        .expect("rotary");
    let p = AttnParams::scaled(nh, hd);
    // Sequence s on blocks 2s + 1 then 2s.
    let tables: Vec<[u32; 2]> = (0..seqs as u32).map(|s| [2 * s + 1, 2 * s]).collect();
    let (mut out, mut n_joined) = (Vec::new(), 0);
    for (i, (len, pos0)) in [(5, 0), (1, 5)].into_iter().enumerate() {
        let attn: Vec<AttnSeq> = tables
            .iter()
            .enumerate()
            .map(|(s, t)| AttnSeq {
                row0: s * len,
                len,
                pos0,
                block_table: t,
            })
            .collect();
        let step = d.step(&attn, &kv, nh).expect("step");
        let x = placed_tensor(d, seqs * len, h, 80 + i as u64);
        let qkv = if joined {
            d.norm_linear_qkv(&x, &norm, 1e-6, proj)
                .expect("norm_linear_qkv")
        } else {
            let parts = d.norm_linear_many(&x, &norm, 1e-6, &proj);
            let Ok([q, k, v]) = <[Tensor; 3]>::try_from(parts.expect("norm_linear_many")) else {
                panic!("{seqs} sequences: not three projections");
            };
            Qkv::new(q, k, v).expect("qkv")
        };
        n_joined += usize::from(qkv.is_joined());
        let o = d
            .attend_prologue(&rot, Some(nm), qkv, &mut kv, 0, &step, &p)
            .expect("attend_prologue");
        out.extend(d.to_host(o).expect("output"));
    }
    let positions: Vec<usize> = (0..6).collect();
    for t in &tables {
        for part in [KvPart::Keys, KvPart::Values] {
            out.extend(d.kv_read_rows(&kv, 0, t, &positions, part).expect("cache"));
        }
    }
    (out, n_joined)
}

/// Q/K/V past the GEMV's rows as one buffer of rows [q | k | v] that the attention prologue
/// and the decode kernel read in place (`norm_linear_qkv`, no copy into three tensors): the
/// bits of the three-tensor path (one GEMM split by a copy), outputs and cache, at 9 and 64
/// decode rows (prefill steps of 45 and 320 rows before them), on the fused decode launch (f16
/// cache) and the two-launch path (f32); and the CPU's values within bf16 rounding of the
/// GEMM's input. Up to 8 rows both are the GEMV's three tensors. With Q/K/V biases (Qwen2)
/// the three-tensor path runs three GEMMs, so there the two agree within rounding only.
#[test]
fn joined_qkv_attention_matches_the_three_tensors() {
    let Some(g) = gpu() else { return };
    let join_on = std::env::var("AFM_JOIN_WEIGHTS").as_deref() != Ok("0");
    for seqs in [1, 8, 9, 64] {
        for (dtype, bias) in [
            (KvDtype::F16, false),
            (KvDtype::F32, false),
            (KvDtype::F16, true),
        ] {
            let what = format!("{seqs} sequences, {dtype:?} cache, bias {bias}");
            let (one, joined) = qkv_layer(&g, true, bias, seqs, dtype);
            let (three, split) = qkv_layer(&g, false, bias, seqs, dtype);
            let (cpu, _) = qkv_layer(&Device::Cpu, true, bias, seqs, dtype);
            // Prefill steps of 5 · seqs rows and decode steps of seqs rows past 8.
            let want = if join_on {
                usize::from(5 * seqs > 8) + usize::from(seqs > 8)
            } else {
                0
            };
            assert_eq!((joined, split), (want, 0), "{what}: steps joined");
            assert!(one.iter().all(|x| x.is_finite()), "{what}: non-finite");
            if bias {
                close(
                    &format!("{what}: against three tensors"),
                    &one,
                    &three,
                    1e-2,
                );
            } else {
                let moved = one
                    .iter()
                    .zip(&three)
                    .filter(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(moved.count(), 0, "{what}: joined q|k|v moved values");
            }
            close(&format!("{what}: against the CPU"), &one, &cpu, 3e-2);
        }
    }
}
