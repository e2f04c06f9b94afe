#![cfg(feature = "cuda")]
//! Every CUDA kernel against afm-runtime's CPU implementation on random data: relative error
//! ‖gpu − cpu‖ / ‖cpu‖ within 1e-3 on f32 paths (most land near 1e-6), 2e-2 where activations
//! are rounded to bf16, 1e-3 for quantized matmuls against the exact dequantized reference
//! (1e-2 where the quantized GEMV rounds activations to int8).
//! Outputs are poisoned with NaN first, so an unwritten element fails.
//!
//! Needs a CUDA device (`AFM_CUDA_DEVICE`, default 0), except `kernels_compile_with_nvrtc`,
//! which needs only libnvrtc. Run with `--test-threads=1`; the tests share one context.

mod common;

use afm_runtime::attention::AttnSeq;
use afm_runtime::cuda::{
    self, Activation, AttnBatch, AttnKernel, DeviceKvCache, DeviceWeight, MatmulPath, RopeTable,
    SampleParams,
};
use afm_runtime::kv_store::{KvCache, KvDtype, LayerKvShape};
use afm_runtime::ops::{self, Rope, RopeStyle};
use afm_runtime::DType;
use common::attention::{
    prologue_inputs, run_attention, run_attention_fixed, scattered_tables, AttnCase,
};
use common::weights::random_weight;
use common::{assert_close, bits, ctx, poisoned, rel_err, Rng};

#[test]
fn kernels_compile_with_nvrtc() {
    let ptx = cuda::compile_kernels(Some("compute_90")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ptx.len(), cuda::KERNEL_MODULES.len());
}

#[test]
fn copies_round_trip() {
    let c = ctx();
    let x = Rng(1).vec(1000, 1.0);
    let d = c.upload(&x).unwrap();
    let mut e = poisoned(&c, 1000);
    c.copy(&d, &mut e).unwrap();
    assert_eq!(c.download(&e).unwrap(), x);
}

#[test]
fn rms_norm_matches_cpu() {
    let c = ctx();
    let mut rng = Rng(2);
    // (rows, width): wide rows take the block kernel, head-sized rows the warp kernel; widths
    // not a multiple of 4 the scalar path; 20000 is wider than one pass through registers.
    let shapes = [
        (5, 4096),
        (40, 128),
        (3, 33),
        (1, 4096),
        (64, 1024),
        (1, 1024),
        (7, 512),
        (2, 1030),
        (2, 20000),
    ];
    for (rows, d) in shapes {
        let (x, w, r) = (
            rng.vec(rows * d, 2.0),
            rng.vec(d, 1.5),
            rng.vec(rows * d, 1.0),
        );
        let mut want = x.clone();
        ops::rms_norm(&mut want, &w, 1e-6);
        let (xd, wd) = (c.upload(&x).unwrap(), c.upload(&w).unwrap());
        let mut out = poisoned(&c, rows * d);
        c.rms_norm(&xd, &wd, 1e-6, &mut out).unwrap();
        assert_close("rms_norm", &c.download(&out).unwrap(), &want, 1e-5);

        // Fused residual: x += r, out = norm(x).
        let mut sum = x.clone();
        ops::add_assign(&mut sum, &r);
        let mut want = sum.clone();
        ops::rms_norm(&mut want, &w, 1e-6);
        let (mut xd, rd) = (c.upload(&x).unwrap(), c.upload(&r).unwrap());
        let mut out = poisoned(&c, rows * d);
        c.add_rms_norm(&mut xd, &rd, &wd, 1e-6, &mut out).unwrap();
        assert_close("add_rms_norm out", &c.download(&out).unwrap(), &want, 1e-5);
        assert_close(
            "add_rms_norm residual",
            &c.download(&xd).unwrap(),
            &sum,
            1e-7,
        );
        c.rms_norm_in_place(&mut xd, &wd, 1e-6).unwrap();
        assert_close("rms_norm in place", &c.download(&xd).unwrap(), &want, 1e-5);
    }
}

/// Rows that start off 16-byte alignment (a view one float in) take the scalar path and still
/// match the CPU.
#[test]
fn rms_norm_unaligned_views_match_cpu() {
    let c = ctx();
    let mut rng = Rng(3);
    for (rows, d) in [(2, 4096), (3, 128)] {
        let n = rows * d;
        let (x, w, r) = (rng.vec(n + 1, 2.0), rng.vec(d, 1.5), rng.vec(n + 1, 1.0));
        let mut sum: Vec<f32> = x[1..].to_vec();
        ops::add_assign(&mut sum, &r[1..]);
        let mut want = sum.clone();
        ops::rms_norm(&mut want, &w, 1e-6);
        let (mut xd, rd, wd) = (
            c.upload(&x).unwrap(),
            c.upload(&r).unwrap(),
            c.upload(&w).unwrap(),
        );
        let mut out = poisoned(&c, n + 1);
        c.add_rms_norm(
            &mut xd.slice_mut(1..),
            &rd.slice(1..),
            &wd,
            1e-6,
            &mut out.slice_mut(1..),
        )
        .unwrap();
        let got = c.download(&out).unwrap();
        assert_close("add_rms_norm unaligned", &got[1..], &want, 1e-5);
        assert_close(
            "residual unaligned",
            &c.download(&xd).unwrap()[1..],
            &sum,
            1e-7,
        );
    }
}

#[test]
fn rope_matches_cpu_bit_for_bit() {
    let c = ctx();
    let mut rng = Rng(3);
    let (n_tok, n_heads, hd) = (9, 4, 128);
    let stride = n_heads * hd + 64; // rows of a fused projection
    let ropes = [
        (
            Rope::new(128, 1e6, 1.0, RopeStyle::Neox),
            128,
            RopeStyle::Neox,
        ),
        (
            Rope::new(64, 1e4, 1.0, RopeStyle::Interleaved),
            64,
            RopeStyle::Interleaved,
        ),
        (
            Rope::llama3(128, 5e5, 8.0, 1.0, 4.0, 8192.0, RopeStyle::Neox),
            128,
            RopeStyle::Neox,
        ),
    ];
    for (rope, dims, style) in ropes {
        let table = RopeTable::from_cpu(&c, &rope, dims, style, 40_000).unwrap();
        let x = rng.vec(n_tok * stride, 1.0);
        let pos: Vec<i32> = (0..n_tok).map(|_| rng.below(40_000) as i32).collect();
        let mut want = x.clone();
        for (t, &p) in pos.iter().enumerate() {
            rope.apply(
                &mut want[t * stride..t * stride + n_heads * hd],
                hd,
                p as usize,
            );
        }
        let (mut xd, pd) = (c.upload(&x).unwrap(), c.upload(&pos).unwrap());
        c.rope(&table, &mut xd, &pd, n_heads, hd, stride).unwrap();
        let got = c.download(&xd).unwrap();
        let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff, 0,
            "{style:?} dims {dims}: {diff} values differ from the CPU"
        );
    }
}

#[test]
fn activations_add_and_softcap_match_cpu() {
    let c = ctx();
    let mut rng = Rng(4);
    // ff 1000 takes the float4 path, 999 the scalar one.
    for (n, ff, act, host) in [
        (
            7,
            1000,
            Activation::Silu,
            afm_runtime::compute::Activation::Silu,
        ),
        (
            7,
            1000,
            Activation::GeluTanh,
            afm_runtime::compute::Activation::GeluTanh,
        ),
        (
            3,
            999,
            Activation::Silu,
            afm_runtime::compute::Activation::Silu,
        ),
    ] {
        let gu = rng.vec(n * 2 * ff, 6.0);
        let mut want = Vec::new();
        for r in 0..n {
            let mut g = gu[r * 2 * ff..r * 2 * ff + ff].to_vec();
            ops::gated_act(&mut g, &gu[r * 2 * ff + ff..(r + 1) * 2 * ff], host);
            want.extend(g);
        }
        let gd = c.upload(&gu).unwrap();
        let mut out = poisoned(&c, n * ff);
        c.gated_act_fused(act, &gd, n, ff, &mut out).unwrap();
        assert_close("gated_act_fused", &c.download(&out).unwrap(), &want, 1e-6);
        // Separate gate and up buffers.
        let (g, u): (Vec<f32>, Vec<f32>) = (0..n * ff)
            .map(|i| {
                (
                    gu[(i / ff) * 2 * ff + i % ff],
                    gu[(i / ff) * 2 * ff + ff + i % ff],
                )
            })
            .unzip();
        let (g, u) = (c.upload(&g).unwrap(), c.upload(&u).unwrap());
        let mut out = poisoned(&c, n * ff);
        c.gated_act(act, &g, &u, n, ff, ff, &mut out).unwrap();
        assert_close("gated_act", &c.download(&out).unwrap(), &want, 1e-6);
    }
    let (x, y) = (rng.vec(5000, 40.0), rng.vec(5000, 3.0));
    let mut want = x.clone();
    ops::add_assign(&mut want, &y);
    let (mut xd, yd) = (c.upload(&x).unwrap(), c.upload(&y).unwrap());
    c.add_assign(&mut xd, &yd).unwrap();
    assert_close("add", &c.download(&xd).unwrap(), &want, 1e-7);
    ops::softcap(&mut want, 30.0);
    c.softcap(&mut xd, 30.0).unwrap();
    assert_close("softcap", &c.download(&xd).unwrap(), &want, 1e-6);
}

const TYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4K,
    DType::Q6K,
];

#[test]
fn embedding_rows_equal_cpu_dequantization() {
    let c = ctx();
    let mut rng = Rng(5);
    for dtype in TYPES {
        let w = random_weight(&mut rng, dtype, 300, 512);
        let ids: Vec<i32> = vec![0, 299, 17, 17, 123];
        let mut want = vec![0f32; ids.len() * 512];
        for (t, &id) in ids.iter().enumerate() {
            w.dequantize_row(id as usize, &mut want[t * 512..(t + 1) * 512]);
        }
        let table = DeviceWeight::upload(&c, &w).unwrap();
        let idd = c.upload(&ids).unwrap();
        let mut out = poisoned(&c, ids.len() * 512);
        c.embed(&table, &idd, &mut out).unwrap();
        assert_eq!(
            c.download(&out).unwrap(),
            want,
            "{dtype:?} rows differ from the CPU"
        );
    }
}

#[test]
fn matmul_matches_exact_reference() {
    let mut c = ctx();
    let mut rng = Rng(6);
    // (rows, cols): one unit per thread, idle threads, several units per thread; row counts
    // that leave a partial block of 4 rows.
    for (rows, cols) in [(70, 4096), (41, 2816), (23, 12288)] {
        for dtype in TYPES {
            let w = random_weight(&mut rng, dtype, rows, cols);
            let dw = DeviceWeight::upload(&c, &w).unwrap();
            for n in [1, 3, 8, 13, 40] {
                let x = rng.vec(n * cols, 1.0);
                let mut want = vec![0f32; n * rows];
                w.matmul_reference(&x, n, &mut want);
                let xd = c.upload(&x).unwrap();
                for path in [MatmulPath::Auto, MatmulPath::Gemv, MatmulPath::Gemm] {
                    // bf16 GEMM rounds activations to bf16; f16 ones round to f16.
                    let tol = match (dtype, path) {
                        (DType::F32, _) => 1e-5,
                        (DType::BF16, MatmulPath::Gemm) => 2e-2,
                        // Auto hands 16-bit weights to MMH (to 64 rows) or the bf16 GEMM past
                        // GEMV_MAX_BATCH rows: both round activations to bf16.
                        (DType::BF16, MatmulPath::Auto) if n > 8 => 2e-2,
                        // The quantized GEMV rounds activations to int8 blocks (as the CPU
                        // matmul does): ~4e-3 here; tests/cuda_gemv_int8.rs checks it exactly.
                        (DType::Q8_0 | DType::Q4K | DType::Q6K, MatmulPath::Gemv) => 1e-2,
                        // Up to 64 rows (GEMV, then the MMQ kernels) as well; tests/cuda_mmq.rs
                        // checks MMQ against the CPU's own int8 rounding.
                        (DType::Q8_0 | DType::Q4K | DType::Q6K, MatmulPath::Auto) if n <= 64 => {
                            1e-2
                        }
                        _ => 1e-3,
                    };
                    let mut out = poisoned(&c, n * rows);
                    c.matmul_with(path, &dw, &xd, n, &mut out).unwrap();
                    let what = format!("matmul {dtype:?} {rows}x{cols} n={n} {path:?}");
                    assert_close(&what, &c.download(&out).unwrap(), &want, tol);
                }
            }
        }
    }
}

fn check_attention(case: AttnCase) {
    let mut c = ctx();
    let mut rng = Rng(case.seqs.len() as u64 * 1000 + case.d as u64);
    let (want, got) = run_attention(&mut c, &mut rng, &case, &[AttnKernel::Auto]);
    let e = rel_err(got[0].as_ref().unwrap_or_else(|e| panic!("{e}")), &want);
    let tol = if case.dtype == KvDtype::F32 {
        1e-4
    } else {
        2e-3
    };
    eprintln!(
        "attention heads {}/{} d {} {:?} window {:?} softcap {:?} seqs {:?} splits {:?}: {e:.2e}",
        case.n_heads,
        case.n_kv,
        case.d,
        case.dtype,
        case.window,
        case.softcap,
        case.seqs,
        case.splits
    );
    assert!(e <= tol, "relative error {e:.3e} > {tol:.0e}");
}

#[test]
fn decode_attention_contexts_1_17_1000_gqa() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        for splits in [None, Some(1), Some(7)] {
            check_attention(AttnCase {
                n_heads: 8,
                n_kv: 2,
                d: 128,
                dtype,
                window: None,
                softcap: None,
                seqs: vec![(0, 1), (16, 1), (999, 1)],
                splits,
            });
        }
    }
}

#[test]
fn decode_attention_windowed_softcapped_and_other_head_sizes() {
    for (n_heads, n_kv, d) in [
        (8, 8, 64),
        (12, 4, 32),
        (4, 2, 256),
        (6, 2, 16),
        (16, 2, 128),
    ] {
        check_attention(AttnCase {
            n_heads,
            n_kv,
            d,
            dtype: KvDtype::F16,
            window: Some(100),
            softcap: Some(20.0),
            seqs: vec![(0, 1), (40, 1), (700, 1), (2000, 1)],
            splits: None,
        });
    }
}

/// Batch-1 decode (attn_decode_impl) around its stage and split edges: 1, 15, 16, 17 keys (one
/// stage, one split), 140 (a short chat context), 1000; one, two and four query heads per KV
/// head (GH 1/2/4) and four heads per block out of a group of 8 (two head chunks); head_dim
/// 64/128/256; splits automatic, off, and forced to 5 (more than 17 keys can use).
#[test]
fn decode_attention_batch1_stage_and_split_edges() {
    for (n_heads, n_kv, d) in [
        (8, 8, 128),
        (16, 8, 128),
        (32, 8, 128),
        (16, 2, 128),
        (8, 4, 64),
        (8, 2, 64),
        (4, 4, 256),
        (4, 2, 256),
    ] {
        // f16 takes the decode kernel, f32 the general one (attention.rs, has_decode_kernel).
        for dtype in [KvDtype::F16, KvDtype::F32] {
            for keys in [1, 15, 16, 17, 140, 1000] {
                for splits in [None, Some(1), Some(5)] {
                    check_attention(AttnCase {
                        n_heads,
                        n_kv,
                        d,
                        dtype,
                        window: None,
                        softcap: None,
                        seqs: vec![(keys - 1, 1)],
                        splits,
                    });
                }
            }
        }
    }
}

/// Decode splits merged in a thread block cluster (through distributed shared memory, compute
/// capability 9.0 on) give the bits of the merge through global memory: batch 1 and 3, the
/// 0.6B/8B head shapes and head size 64, 2 to 16 splits and the automatic count, and a CUDA
/// graph's fixed batch (a 1k context class). Elsewhere, and past 16 splits, both runs take the
/// global merge.
#[test]
fn decode_attention_cluster_merge_same_bits() {
    let mut c = ctx();
    for (n_heads, n_kv, d) in [(16, 8, 128), (32, 8, 128), (8, 2, 64)] {
        for seqs in [
            vec![(139, 1)],
            vec![(383, 1)],
            vec![(999, 1)],
            vec![(16, 1), (299, 1), (140, 1)],
        ] {
            for splits in [None, Some(2), Some(5), Some(16)] {
                let case = AttnCase {
                    n_heads,
                    n_kv,
                    d,
                    dtype: KvDtype::F16,
                    window: None,
                    softcap: None,
                    seqs: seqs.clone(),
                    splits,
                };
                let what = format!("heads {n_heads}/{n_kv} d {d} seqs {seqs:?} splits {splits:?}");
                let mut runs = Vec::new();
                for on in [true, false] {
                    c.set_decode_attention_clusters(on);
                    let (want, got) =
                        run_attention(&mut c, &mut Rng(9), &case, &[AttnKernel::Auto]);
                    let got = got
                        .into_iter()
                        .next()
                        .unwrap()
                        .unwrap_or_else(|e| panic!("{e}"));
                    assert!(rel_err(&got, &want) <= 2e-3, "{what}: against the CPU");
                    let (_, fixed) = run_attention_fixed(&mut c, &mut Rng(9), &case, 8, 64);
                    runs.push((got, fixed.unwrap_or_else(|e| panic!("{e}"))));
                }
                c.set_decode_attention_clusters(true);
                assert_eq!(
                    bits(&runs[0].0),
                    bits(&runs[1].0),
                    "{what}: cluster against global merge"
                );
                assert_eq!(
                    bits(&runs[0].1),
                    bits(&runs[1].1),
                    "{what}: fixed batch, cluster against global merge"
                );
            }
        }
    }
}

/// Batch 64 at a short context and the 0.6B/8B head shapes, a 16k batch-1 context split many
/// ways and a window that starts inside a cache block.
#[test]
fn decode_attention_many_streams_and_long_splits() {
    for (n_heads, n_kv) in [(16, 8), (32, 8)] {
        let seqs: Vec<(usize, usize)> = (0..64).map(|i| (100 + 7 * i, 1)).collect();
        for splits in [None, Some(3)] {
            check_attention(AttnCase {
                n_heads,
                n_kv,
                d: 128,
                dtype: KvDtype::F16,
                window: None,
                softcap: None,
                seqs: seqs.clone(),
                splits,
            });
        }
    }
    for splits in [Some(128), Some(37)] {
        check_attention(AttnCase {
            n_heads: 16,
            n_kv: 8,
            d: 128,
            dtype: KvDtype::F16,
            window: None,
            softcap: None,
            seqs: vec![(15999, 1)],
            splits,
        });
    }
    check_attention(AttnCase {
        n_heads: 16,
        n_kv: 8,
        d: 128,
        dtype: KvDtype::F16,
        window: Some(333),
        softcap: Some(30.0),
        seqs: vec![(15999, 1), (40, 1), (1000, 1)],
        splits: None,
    });
}

/// Decode through the batch CUDA graphs replay: a bucket of 8 (3 sequences, 5 of padding)
/// in a 1k-token class (64 table entries, split count baked for 1k keys) holding contexts of
/// 140, 15 and 1000 keys, and the same in a 16k class; 0.6B's and 8B's heads.
#[test]
fn decode_attention_graph_batch_in_a_larger_context_class() {
    for (n_heads, n_kv) in [(16, 8), (32, 8)] {
        for max_blocks in [64, 1024] {
            let case = AttnCase {
                n_heads,
                n_kv,
                d: 128,
                dtype: KvDtype::F16,
                window: None,
                softcap: None,
                seqs: vec![(139, 1), (14, 1), (999, 1)],
                splits: None,
            };
            let mut c = ctx();
            let mut rng = Rng(77);
            let (want, got) = run_attention_fixed(&mut c, &mut rng, &case, 8, max_blocks);
            let e = rel_err(&got.unwrap_or_else(|e| panic!("{e}")), &want);
            eprintln!("graph batch heads {n_heads}/{n_kv} class {max_blocks} blocks: {e:.2e}");
            assert!(e <= 2e-3, "relative error {e:.3e} > 2e-3");
        }
    }
}

#[test]
fn decode_attention_16k_split_on_and_off() {
    for splits in [None, Some(1)] {
        check_attention(AttnCase {
            n_heads: 32,
            n_kv: 8,
            d: 128,
            dtype: KvDtype::F16,
            window: None,
            softcap: None,
            seqs: vec![(16383, 1)],
            splits,
        });
    }
}

#[test]
fn prefill_attention_causal_windowed_mixed_batch() {
    for (n_heads, n_kv, d, dtype, window) in [
        (8, 2, 128, KvDtype::F32, None),
        (8, 2, 128, KvDtype::F16, Some(24)),
        (4, 4, 64, KvDtype::F32, Some(9)),
        (6, 2, 256, KvDtype::F16, None),
        (4, 1, 32, KvDtype::F32, None),
    ] {
        for splits in [Some(1), None, Some(3)] {
            check_attention(AttnCase {
                n_heads,
                n_kv,
                d,
                dtype,
                window,
                softcap: None,
                // a fresh prompt, a chunk continuing a cached one, a decode row
                seqs: vec![(0, 37), (100, 20), (500, 1)],
                splits,
            });
        }
    }
}

#[test]
fn prefill_attention_1000_tokens() {
    check_attention(AttnCase {
        n_heads: 16,
        n_kv: 4,
        d: 128,
        dtype: KvDtype::F16,
        window: None,
        softcap: Some(50.0),
        seqs: vec![(0, 1000), (3, 61)],
        splits: None,
    });
}

/// One attention-prologue scenario: the step's rows of each sequence (positions
/// `pos0 .. pos0 + len`) get per-head Q/K RMSNorm (when `norm`), RoPE and the K/V write.
struct PrologueCase {
    n_heads: usize,
    n_kv: usize,
    d: usize,
    dtype: KvDtype,
    norm: bool,
    rope: (Rope, usize, RopeStyle),
    /// (first position, new tokens) per sequence.
    seqs: Vec<(usize, usize)>,
}

/// The fused prologue against the CPU sequence (`ops::rms_norm` per head, `Rope::apply`,
/// `LayerKv::write`) and, bit for bit, against the separate GPU kernels it replaces.
fn check_prologue(case: PrologueCase) {
    let c = ctx();
    let (bs, d, nh, nkv) = (16, case.d, case.n_heads, case.n_kv);
    let mut rng = Rng(7000 + d as u64 + nh as u64 * 10 + case.seqs.len() as u64);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: d,
    };
    let (num_blocks, tables) = scattered_tables(&mut rng, &case.seqs, bs, 3);
    let mut seqs = Vec::new();
    let mut positions = Vec::new();
    for (s, &(p, l)) in case.seqs.iter().enumerate() {
        seqs.push(AttnSeq {
            row0: positions.len(),
            len: l,
            pos0: p,
            block_table: &tables[s],
        });
        positions.extend((p..p + l).map(|x| x as i32));
    }
    let rows = positions.len();
    let (qw, kw) = (nh * d, nkv * d);
    let [q, k, v, qn, kn] = prologue_inputs(&mut rng, rows, nh, nkv, d);
    let eps = 1e-6;
    let (rope, dims, style) = &case.rope;
    let max_pos = positions.iter().max().map_or(1, |&p| p as usize + 1);

    // CPU: the ops the models ran before the fused op, in order.
    let (mut qc, mut kc) = (q.clone(), k.clone());
    if case.norm {
        ops::rms_norm(&mut qc, &qn, eps);
        ops::rms_norm(&mut kc, &kn, eps);
    }
    for (t, &p) in positions.iter().enumerate() {
        rope.apply(&mut qc[t * qw..(t + 1) * qw], d, p as usize);
        rope.apply(&mut kc[t * kw..(t + 1) * kw], d, p as usize);
    }
    let mut cpu = KvCache::new(&[shape], num_blocks, bs, case.dtype);
    for sq in &seqs {
        for i in 0..sq.len {
            let r = sq.row0 + i;
            let (kr, vr) = (&kc[r * kw..(r + 1) * kw], &v[r * kw..(r + 1) * kw]);
            cpu.layers[0].write(sq.block_table, sq.pos0 + i, kr, vr);
        }
    }

    let table = RopeTable::from_cpu(&c, rope, *dims, *style, max_pos).unwrap();
    let pd = c.upload(&positions).unwrap();
    let (qnd, knd) = (c.upload(&qn).unwrap(), c.upload(&kn).unwrap());
    let (qnv, knv) = (qnd.slice(0..d), knd.slice(0..d));
    let vd = c.upload(&v).unwrap();
    // GPU, fused.
    let mut fused = DeviceKvCache::new(&c, &[shape], num_blocks, bs, case.dtype).unwrap();
    let batch = AttnBatch::new(&c, &fused, &seqs, nh).unwrap();
    let (mut qf, mut kf) = (c.upload(&q).unwrap(), c.upload(&k).unwrap());
    let norms = case.norm.then_some((&qnv, &knv, eps));
    c.attn_prologue(
        &mut fused, 0, &batch, &table, &pd, &mut qf, nh, &mut kf, &vd, norms,
    )
    .unwrap();
    // GPU, the separate kernels.
    let mut sep = DeviceKvCache::new(&c, &[shape], num_blocks, bs, case.dtype).unwrap();
    let (mut qs, mut ks) = (c.upload(&q).unwrap(), c.upload(&k).unwrap());
    if case.norm {
        c.rms_norm_in_place(&mut qs, &qnd, eps).unwrap();
        c.rms_norm_in_place(&mut ks, &knd, eps).unwrap();
    }
    c.rope(&table, &mut qs, &pd, nh, d, qw).unwrap();
    c.rope(&table, &mut ks, &pd, nkv, d, kw).unwrap();
    c.kv_write(&mut sep, 0, &batch, &ks, kw, &vd, kw).unwrap();

    let what = format!(
        "prologue heads {nh}/{nkv} d {d} {:?} norm {} {style:?} dims {dims} seqs {:?}",
        case.dtype, case.norm, case.seqs
    );
    let (gq, gk) = (c.download(&qf).unwrap(), c.download(&kf).unwrap());
    // Without norms RoPE alone is bit-exact with the CPU; the norms sum in f32, the CPU in f64.
    let tol = if case.norm { 1e-5 } else { 0.0 };
    assert_close(&format!("{what}: q"), &gq, &qc, tol);
    assert_close(&format!("{what}: k"), &gk, &kc, tol);
    assert_eq!(
        gq,
        c.download(&qs).unwrap(),
        "{what}: q moved from the separate kernels"
    );
    assert_eq!(
        gk,
        c.download(&ks).unwrap(),
        "{what}: k moved from the separate kernels"
    );
    let cache_tol = match (case.dtype, case.norm) {
        (KvDtype::F32, false) => 0.0,
        (KvDtype::F32, true) => 1e-5,
        _ => 1e-3, // an f16 rounding may flip where the norms differ in the last bit
    };
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for t in &tables {
        for &b in t {
            for h in 0..nkv {
                let (kd, vd) = fused.layers[0]
                    .read_block(&c, &fused, b as usize, h)
                    .unwrap();
                let (ks, vs) = sep.layers[0].read_block(&c, &sep, b as usize, h).unwrap();
                assert_eq!((&kd, &vd), (&ks, &vs), "{what}: stored K/V moved");
                let mut kcpu = vec![0f32; bs * d];
                let mut vcpu = vec![0f32; bs * d];
                cpu.layers[0].read_keys(b, h, 0, &mut kcpu);
                cpu.layers[0].read_values(b, h, 0, &mut vcpu);
                got.extend(kd.iter().chain(&vd));
                want.extend(kcpu.iter().chain(&vcpu));
            }
        }
    }
    assert_close(&format!("{what}: cache"), &got, &want, cache_tol);
}

#[test]
fn attn_prologue_matches_cpu_and_separate_kernels() {
    let neox = |d: usize, theta: f32| {
        (
            Rope::new(d, theta, 1.0, RopeStyle::Neox),
            d,
            RopeStyle::Neox,
        )
    };
    // Qwen3-0.6B's attention: GQA 16/8, head_dim 128, Q/K norms; a decode batch of three
    // (one at a block's first slot, one in its last) and a prefill chunk over three blocks.
    for dtype in [KvDtype::F16, KvDtype::F32] {
        check_prologue(PrologueCase {
            n_heads: 16,
            n_kv: 8,
            d: 128,
            dtype,
            norm: true,
            rope: neox(128, 1e6),
            seqs: vec![(16, 1), (31, 1), (999, 1), (5, 40)],
        });
    }
    // Llama/Qwen 2 (no norms), head_dim 64, GQA 4:1; GGUF llama's interleaved pairs.
    for (norm, rope) in [
        (false, neox(64, 1e4)),
        (
            false,
            (
                Rope::new(64, 1e4, 1.0, RopeStyle::Interleaved),
                64,
                RopeStyle::Interleaved,
            ),
        ),
        (true, neox(64, 1e4)),
    ] {
        check_prologue(PrologueCase {
            n_heads: 8,
            n_kv: 2,
            d: 64,
            dtype: KvDtype::F32,
            norm,
            rope,
            seqs: vec![(0, 37), (100, 20), (500, 1)],
        });
    }
    // Gemma 3's head_dim 256; partial rotary (dims < head_dim); more heads than one block's
    // warps take; Llama 3 scaling.
    check_prologue(PrologueCase {
        n_heads: 8,
        n_kv: 4,
        d: 256,
        dtype: KvDtype::F16,
        norm: true,
        rope: neox(256, 1e4),
        seqs: vec![(0, 3), (17, 1)],
    });
    check_prologue(PrologueCase {
        n_heads: 12,
        n_kv: 4,
        d: 128,
        dtype: KvDtype::F32,
        norm: true,
        rope: neox(64, 1e6),
        seqs: vec![(7, 9), (63, 2)],
    });
    check_prologue(PrologueCase {
        n_heads: 32,
        n_kv: 8,
        d: 128,
        dtype: KvDtype::F16,
        norm: false,
        rope: (
            Rope::llama3(128, 5e5, 8.0, 1.0, 4.0, 8192.0, RopeStyle::Neox),
            128,
            RopeStyle::Neox,
        ),
        seqs: vec![(8190, 4), (0, 1)],
    });
}

#[test]
fn argmax_picks_the_first_maximum() {
    let c = ctx();
    let mut rng = Rng(7);
    let vocab = 151_936;
    let mut logits = rng.vec(4 * vocab, 10.0);
    logits[vocab + 5] = 50.0;
    logits[vocab + 90_000] = 50.0; // tie: the lower index wins
    logits[3 * vocab..].fill(f32::NEG_INFINITY);
    let want: Vec<i32> = logits
        .chunks(vocab)
        .map(|r| {
            let mut best = 0;
            for (i, &l) in r.iter().enumerate() {
                if l > r[best] {
                    best = i;
                }
            }
            best as i32
        })
        .collect();
    let ld = c.upload(&logits).unwrap();
    let mut out = c.upload(&[-1i32; 4]).unwrap();
    c.argmax(&ld, vocab, &mut out).unwrap();
    assert_eq!(c.download(&out).unwrap(), want);
}

/// afm-engine's `Sampler::draw` (crates/afm-engine/src/sampling.rs) with the uniform draw
/// given: the token, how close its decisions came to a boundary (relative), and the kept ids.
fn engine_draw(logits: &[f32], p: &SampleParams) -> (i32, f32, Vec<u32>) {
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let k = if p.top_k > 0 {
        p.top_k.min(cand.len())
    } else {
        cand.len()
    };
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    cand.truncate(k);
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand
        .iter()
        .map(|c| ((c.1 - max) / p.temperature).exp())
        .collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
    let mut margin = f32::INFINITY;
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, &x) in probs.iter().enumerate() {
            let before = acc;
            acc += x;
            if acc >= p.top_p {
                keep = i + 1;
                margin = margin.min(acc - p.top_p).min(p.top_p - before);
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = probs[0] * p.min_p;
        let cnt = probs.iter().take_while(|&&x| x >= floor).count();
        for &x in &probs[cnt.saturating_sub(1)..(cnt + 1).min(probs.len())] {
            margin = margin.min((x - floor).abs() / floor.max(1e-30));
        }
        keep = keep.min(cnt.max(1));
    }
    let kept = cand[..keep].iter().map(|c| c.0).collect();
    let total: f32 = probs[..keep].iter().sum();
    let r = p.u * total;
    let mut acc = 0.0;
    for (i, &x) in probs[..keep].iter().enumerate() {
        let before = acc;
        acc += x;
        if acc >= r {
            let m = margin.min((acc - r).min(r - before) / total);
            return (cand[i].0 as i32, m, kept);
        }
    }
    (cand[keep - 1].0 as i32, margin, kept)
}

/// Whether the kernel takes its sorted path for this row (mirrors sample_rows).
fn sorted_path(row: &[f32], p: &SampleParams) -> bool {
    let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut floor = best - 30.0 * p.temperature;
    if p.min_p > 0.0 && p.top_p >= 1.0 {
        floor = floor.max(best + p.temperature * p.min_p.ln() - 1e-3 * p.temperature);
    }
    let count = |f: f32| row.iter().filter(|&&x| x >= f).count();
    let mut n = count(floor);
    if n > 4096 && p.top_k > 0 && p.top_k <= 4096 {
        let mut s = row.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        n = count(floor.max(s[p.top_k - 1]));
    }
    n <= 4096 || p.top_k == 1
}

#[test]
fn sampling_follows_the_engine_pipeline() {
    let mut c = ctx();
    let mut rng = Rng(8);
    let vocab = 32_000;
    let settings = [
        (0.7, 40, 1.0, 0.0),
        (0.8, 100, 0.95, 0.02),
        (0.03, 0, 0.9, 0.0),
        (0.02, 0, 1.0, 0.1),
        (1.0, 1, 1.0, 0.0),
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.5, 0, 1.0, 0.05),
        (1.0, 0, 1.0, 0.0),
    ];
    let (mut exact, mut kept_only, mut skipped) = (0, 0, 0);
    for round in 0..20 {
        let n = settings.len();
        let logits: Vec<f32> = (0..n * vocab)
            .map(|_| 3.0 * rng.sym(1.0) + rng.sym(1.0))
            .collect();
        let params: Vec<SampleParams> = settings
            .iter()
            .map(|&(temperature, top_k, top_p, min_p)| SampleParams {
                temperature,
                top_k,
                top_p,
                min_p,
                u: rng.unit(),
            })
            .collect();
        let ld = c.upload(&logits).unwrap();
        let mut out = c.upload(&vec![-1i32; n]).unwrap();
        c.sample(&ld, vocab, &params, &mut out).unwrap();
        let got = c.download(&out).unwrap();
        for (i, p) in params.iter().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            if p.temperature <= 0.0 {
                let best = row
                    .iter()
                    .enumerate()
                    .fold(0, |b, (j, &l)| if l > row[b] { j } else { b });
                assert_eq!(got[i], best as i32, "greedy row {i}");
                exact += 1;
                continue;
            }
            let (want, margin, kept) = engine_draw(row, p);
            if !sorted_path(row, p) {
                assert!(
                    kept.contains(&(got[i] as u32)),
                    "round {round} row {i} {p:?}: not kept"
                );
                kept_only += 1;
            } else if margin < 2e-5 {
                skipped += 1;
            } else {
                assert_eq!(got[i], want, "round {round} row {i} {p:?}");
                exact += 1;
            }
        }
    }
    eprintln!("sampling: {exact} equal the engine's draw, {kept_only} in its kept set, {skipped} too close to call");
    assert!(exact >= 100, "only {exact} draws could be compared");

    // The unsorted path's distribution: stratified u over many copies of one flat row.
    let rows = 512;
    let row: Vec<f32> = (0..vocab).map(|_| 2.0 * rng.sym(1.0)).collect();
    let p = SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.8,
        min_p: 0.0,
        u: 0.0,
    };
    let params: Vec<SampleParams> = (0..rows)
        .map(|i| SampleParams {
            u: (i as f32 + 0.5) / rows as f32,
            ..p
        })
        .collect();
    let ld = c.upload(&row.repeat(rows)).unwrap();
    let mut out = c.upload(&vec![-1i32; rows]).unwrap();
    c.sample(&ld, vocab, &params, &mut out).unwrap();
    let got = c.download(&out).unwrap();
    let (_, _, kept) = engine_draw(&row, &p);
    let kept: std::collections::HashSet<u32> = kept.into_iter().collect();
    assert!(
        got.iter().all(|&t| kept.contains(&(t as u32))),
        "a draw outside the kept set"
    );
    // Mass of the kept set's better half (by logit) against its share of the draws.
    let total: f64 = kept.iter().map(|&t| (row[t as usize] as f64).exp()).sum();
    let mut sorted: Vec<u32> = kept.iter().copied().collect();
    sorted.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    let top: std::collections::HashSet<u32> = sorted[..sorted.len() / 2].iter().copied().collect();
    let want = top
        .iter()
        .map(|&t| (row[t as usize] as f64).exp())
        .sum::<f64>()
        / total;
    let share = got.iter().filter(|&&t| top.contains(&(t as u32))).count() as f64 / rows as f64;
    eprintln!("unsorted path: better half drawn {share:.3}, mass {want:.3}");
    assert!(
        (share - want).abs() < 0.08,
        "draw share {share:.3} vs mass {want:.3}"
    );
}
