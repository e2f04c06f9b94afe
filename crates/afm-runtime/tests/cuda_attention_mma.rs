#![cfg(feature = "cuda")]
//! The tensor-core prefill attention kernel (`cuda/kernels/attention_mma.cu`) against
//! afm-runtime's CPU attention on the same f16 KV cache: relative error ‖gpu − cpu‖ / ‖cpu‖
//! within 2e-3, as for the SIMT kernel's f16 tests in `cuda_ops` (both round queries and
//! attention weights to f16, the CPU as llama.cpp does). Every case forces the mma kernel
//! (`AttnKernel::Mma`, which fails rather than fall back), at head_dim 64, 128 and 256 and
//! query heads per KV head 1, 2 and 4; outputs are poisoned with NaN first, so an unwritten
//! row fails.
//!
//! Needs a CUDA device of compute capability 8.0 or later (`AFM_CUDA_DEVICE`, default 0).
//! Run with `--test-threads=1`; the tests share one context.

mod common;

use afm_runtime::cuda::AttnKernel;
use afm_runtime::kv_store::KvDtype;
use common::attention::{run_attention, AttnCase};
use common::{ctx, rel_err, Rng};

const TOL: f64 = 2e-3;

/// (query heads, KV heads, head_dim): every supported head_dim at groups 1, 2 and 4.
const SHAPES: [(usize, usize, usize); 6] = [
    (4, 4, 64),
    (8, 2, 64),
    (8, 4, 128),
    (16, 4, 128),
    (4, 4, 256),
    (8, 2, 256),
];

fn case(
    (n_heads, n_kv, d): (usize, usize, usize),
    seqs: &[(usize, usize)],
    window: Option<usize>,
    softcap: Option<f32>,
) -> AttnCase {
    AttnCase {
        n_heads,
        n_kv,
        d,
        dtype: KvDtype::F16,
        window,
        softcap,
        seqs: seqs.to_vec(),
        splits: None,
    }
}

/// Runs `case` with each of `kernels` and checks each against the CPU; returns the outputs.
fn check(what: &str, case: &AttnCase, kernels: &[AttnKernel]) -> Vec<Vec<f32>> {
    let mut c = ctx();
    let mut rng = Rng(case.d as u64 * 7919 + case.n_heads as u64 * 31 + case.seqs.len() as u64);
    let (want, got) = run_attention(&mut c, &mut rng, case, kernels);
    kernels
        .iter()
        .zip(got)
        .map(|(k, g)| {
            let g = g.unwrap_or_else(|e| panic!("{what} {k:?}: {e}"));
            let e = rel_err(&g, &want);
            eprintln!(
                "{what}: {k:?} heads {}/{} d {} seqs {:?} window {:?} softcap {:?}: rel err {e:.2e}",
                case.n_heads, case.n_kv, case.d, case.seqs, case.window, case.softcap
            );
            assert!(e <= TOL, "{what} {k:?}: relative error {e:.3e} > {TOL:.0e}");
            g
        })
        .collect()
}

fn check_mma(what: &str, case: &AttnCase) {
    check(what, case, &[AttnKernel::Mma]);
}

/// A fresh prompt of 300 rows: four full tiles of 64 and a last one of 44.
#[test]
fn one_prompt_of_300_rows() {
    for shape in SHAPES {
        check_mma("300 rows", &case(shape, &[(0, 300)], None, None));
    }
}

/// A chunk continuing a prompt whose first 700 positions are already cached (a chunked
/// prefill or a prefix-cache hit): the queries see those keys and their own causally.
#[test]
fn chunk_after_700_cached_positions() {
    for shape in SHAPES {
        check_mma("at 700", &case(shape, &[(700, 200)], None, None));
    }
}

/// The key range split over several CTAs and merged by the last (split-K: what a short chunk
/// after a long context gets), forced to 1, 3 and 16 splits (more than some rows have key
/// tiles), with and without a window.
#[test]
fn split_key_range() {
    for shape in SHAPES {
        for splits in [Some(1), Some(3), Some(16)] {
            for window in [None, Some(150)] {
                let c = AttnCase {
                    splits,
                    ..case(shape, &[(700, 100), (3, 5), (0, 64)], window, None)
                };
                check_mma("split-K", &c);
            }
        }
    }
}

/// Sequences of different lengths and starts in one step: one tile plus one row (65), a
/// chunk at 40, a tile exactly (64), and a decode row and a short chunk that stay on the SIMT
/// kernel in the same step.
#[test]
fn mixed_batch_with_short_rows_on_simt() {
    let seqs = [(0, 65), (40, 190), (500, 1), (7, 64), (3, 20)];
    for shape in SHAPES {
        check_mma("mixed batch", &case(shape, &seqs, None, None));
    }
}

/// A sliding window narrower than a key tile, one wider than a query tile, and one longer
/// than every sequence (no effect), across chunks that start past the window.
#[test]
fn sliding_window() {
    let seqs = [(0, 300), (250, 130)];
    for shape in SHAPES {
        for w in [24, 100, 5000] {
            check_mma("window", &case(shape, &seqs, Some(w), None));
        }
    }
}

/// Gemma-style score softcap, with and without a window.
#[test]
fn softcap() {
    for shape in SHAPES {
        for window in [None, Some(70)] {
            check_mma(
                "softcap",
                &case(shape, &[(0, 150), (90, 77)], window, Some(30.0)),
            );
        }
    }
}

/// The mma kernel and the SIMT kernel agree with each other (as well as with the CPU) on the
/// same step, Qwen3-0.6B's heads; `Auto` takes the mma kernel for this step.
#[test]
fn mma_and_simt_agree() {
    let kernels = [AttnKernel::Simt, AttnKernel::Mma, AttnKernel::Auto];
    let case = case((16, 8, 128), &[(0, 1000), (120, 333)], None, None);
    let out = check("agree", &case, &kernels);
    // for the log: spills would show as local bytes
    eprintln!(
        "(head_dim, registers, local bytes): {:?}",
        ctx().attn_mma_resources()
    );
    let e = rel_err(&out[1], &out[0]);
    eprintln!("mma vs simt: rel err {e:.2e}");
    assert!(e <= TOL, "mma vs simt: relative error {e:.3e} > {TOL:.0e}");
    if std::env::var("AFM_ATTN_MMA").map_or(true, |v| v != "0") {
        assert_eq!(out[2], out[1], "Auto should have taken the mma kernel");
    }
}

/// Forcing the mma kernel where it cannot serve is an error that names the reason, not a
/// silent fallback: an f32 cache, head_dim 32, and a step whose chunks are all short.
#[test]
fn mma_refuses_what_it_cannot_serve() {
    let mut c = ctx();
    let mut rng = Rng(9);
    let refusals = [
        (
            AttnCase {
                dtype: KvDtype::F32,
                ..case((8, 2, 128), &[(0, 100)], None, None)
            },
            "KV cache type",
        ),
        (case((8, 2, 32), &[(0, 100)], None, None), "head_dim"),
        (case((8, 2, 128), &[(0, 63), (5, 1)], None, None), "64 rows"),
    ];
    for (case, reason) in refusals {
        let (want, got) = run_attention(
            &mut c,
            &mut rng,
            &case,
            &[AttnKernel::Mma, AttnKernel::Auto],
        );
        let mut got = got.into_iter();
        match got.next() {
            Some(Err(e)) => assert!(e.to_string().contains(reason), "{e}"),
            other => panic!(
                "expected an error naming {reason:?}, got {:?}",
                other.map(|r| r.map(|v| v.len()))
            ),
        }
        // Auto serves the same step on the SIMT kernel.
        let auto = got
            .next()
            .expect("two kernels")
            .unwrap_or_else(|e| panic!("{e}"));
        let tol = if case.dtype == KvDtype::F32 {
            1e-4
        } else {
            TOL
        };
        assert!(rel_err(&auto, &want) <= tol);
    }
}

/// Decode steps (one new token per sequence) of enough sequences to fill the device: one CTA
/// per KV head and sequence reaches the SM count, so `Auto` takes the tensor-core decode kernel
/// (`attn_dec_mma_*`). Contexts from one key to several tiles per warp.
fn decode_seqs(n_kv: usize, sm_count: usize) -> Vec<(usize, usize)> {
    let n = sm_count.div_ceil(n_kv) + 3;
    (0..n).map(|i| ((i * 37) % 700, 1)).collect()
}

/// Query heads per KV head 1, 2, 4, 8 and 16 (one mma tile's rows), every head_dim.
const DECODE_SHAPES: [(usize, usize, usize); 6] = [
    (4, 4, 64),
    (16, 8, 128),
    (32, 8, 128),
    (16, 2, 128),
    (16, 1, 128),
    (8, 2, 256),
];

/// The decode step with the tensor-core decode kernel on and off (the SIMT decode kernel),
/// each against the CPU; they must be different kernels (outputs not bit-equal: the mma
/// kernel rounds the attention weights to f16, the SIMT one does not).
fn check_decode(what: &str, case: &AttnCase) {
    let c = ctx();
    c.set_decode_attention_mma(true);
    drop(c);
    let on = check(what, case, &[AttnKernel::Auto]).remove(0);
    let c = ctx();
    c.set_decode_attention_mma(false);
    drop(c);
    let off = check(what, case, &[AttnKernel::Auto]).remove(0);
    ctx().set_decode_attention_mma(true);
    assert_ne!(on, off, "{what}: the tensor-core decode kernel did not run");
    let e = rel_err(&on, &off);
    assert!(
        e <= TOL,
        "{what}: mma vs simt decode: relative error {e:.3e}"
    );
}

#[test]
fn decode_on_tensor_cores() {
    let sm = ctx().info().sm_count;
    for shape in DECODE_SHAPES {
        let seqs = decode_seqs(shape.1, sm);
        check_decode("decode", &case(shape, &seqs, None, None));
    }
}

#[test]
fn decode_on_tensor_cores_window_and_softcap() {
    let sm = ctx().info().sm_count;
    for shape in DECODE_SHAPES {
        let seqs = decode_seqs(shape.1, sm);
        check_decode("decode window", &case(shape, &seqs, Some(40), Some(30.0)));
        check_decode("decode wide window", &case(shape, &seqs, Some(300), None));
    }
}

/// Forced splits of the key range: 1, 3 and 16 (more than the short contexts have tiles).
#[test]
fn decode_on_tensor_cores_split() {
    let sm = ctx().info().sm_count;
    for shape in DECODE_SHAPES {
        for splits in [1, 3, 16] {
            let c = AttnCase {
                splits: Some(splits),
                ..case(shape, &decode_seqs(shape.1, sm), None, None)
            };
            check_decode("decode split", &c);
        }
    }
}

/// The batch a CUDA graph replays (a bucket with padding rows, tables of the context class)
/// takes the same kernel, with the split count packed into it.
#[test]
fn decode_on_tensor_cores_graph_batch() {
    let sm = ctx().info().sm_count;
    for shape in [(16, 8, 128), (32, 8, 128), (8, 2, 256)] {
        let seqs = decode_seqs(shape.1, sm);
        let bucket = seqs.len() + 5;
        let case = case(shape, &seqs, None, None);
        let mut c = ctx();
        let mut rng = Rng(77);
        let (want, got) =
            common::attention::run_attention_fixed(&mut c, &mut rng, &case, bucket, 64);
        let got = got.unwrap_or_else(|e| panic!("graph batch: {e}"));
        let e = rel_err(&got, &want);
        eprintln!("graph batch {shape:?}: rel err {e:.2e}");
        assert!(e <= TOL, "graph batch {shape:?}: relative error {e:.3e}");
    }
}
