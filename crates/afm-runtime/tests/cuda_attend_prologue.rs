#![cfg(feature = "cuda")]
//! `CudaContext::attend_prologue` against `attn_prologue` + `paged_attention`, bit for bit:
//! the attention output and every cache block after the step. On decode steps of the decode
//! kernel's shapes it is one launch (the prologue folded into `attn_dec_pro_*`, which the
//! test asserts it took); elsewhere it must be the two launches. Contexts cross cache blocks
//! and key-range splits (forced and chosen), down to a single key; a CUDA graph's fixed
//! batch adds padding rows. The same rows as one buffer of rows `[q | k | v]` (a joined Q/K/V
//! product, `attend_prologue_joined`), read in place with its stride, give the same bits on
//! both paths. The two-launch path is checked against the CPU by `cuda_ops`' prologue and
//! attention tests. With the bf16 copy of the output on (`AFM_ATTN_HALF`), the output keeps
//! its bits and a 16-bit O product after it gives the bits of one that converts it.
//!
//! Needs a CUDA device (`AFM_CUDA_DEVICE`, default 0). Run with `--test-threads=1`.

mod common;

use afm_runtime::attention::{AttnParams, AttnSeq};
use afm_runtime::cuda::{AttnBatch, CudaContext, DeviceKvCache, DeviceWeight, RopeTable};
use afm_runtime::kv_store::{KvDtype, LayerKvShape};
use afm_runtime::ops::{Rope, RopeStyle};
use afm_runtime::DType;
use common::attention::{prologue_inputs, scattered_tables};
use common::weights::random_weight;
use common::{bits, ctx, poisoned, Rng};

const BS: usize = 16;

struct Case {
    n_heads: usize,
    n_kv: usize,
    d: usize,
    dtype: KvDtype,
    norm: bool,
    window: Option<usize>,
    softcap: Option<f32>,
    /// Cached positions of each sequence before its one new token.
    ctx: Vec<usize>,
    splits: Option<usize>,
    /// A CUDA graph's batch: (bucket, table entries per sequence).
    fixed: Option<(usize, usize)>,
    /// Whether `attend_prologue` should take the one launch.
    one_launch: bool,
}

impl Case {
    fn decode(n_heads: usize, n_kv: usize, d: usize, norm: bool, ctx: &[usize]) -> Self {
        Case {
            n_heads,
            n_kv,
            d,
            dtype: KvDtype::F16,
            norm,
            window: None,
            softcap: None,
            ctx: ctx.to_vec(),
            splits: None,
            fixed: None,
            one_launch: true,
        }
    }
}

/// Random K/V for positions `0..ctx` of every sequence, written into `cache`.
fn fill_history(
    c: &CudaContext,
    cache: &mut DeviceKvCache,
    tables: &[Vec<u32>],
    case: &Case,
    seed: u64,
) {
    let mut seqs = Vec::new();
    let mut row0 = 0;
    for (s, &p) in case.ctx.iter().enumerate() {
        if p > 0 {
            seqs.push(AttnSeq {
                row0,
                len: p,
                pos0: 0,
                block_table: &tables[s],
            });
            row0 += p;
        }
    }
    if row0 == 0 {
        return;
    }
    let width = case.n_kv * case.d;
    let mut rng = Rng(seed);
    let (k, v) = (rng.vec(row0 * width, 1.0), rng.vec(row0 * width, 1.0));
    let batch = AttnBatch::new(c, cache, &seqs, case.n_heads).unwrap();
    let (kd, vd) = (c.upload(&k).unwrap(), c.upload(&v).unwrap());
    c.kv_write(cache, 0, &batch, &kd, width, &vd, width)
        .unwrap();
}

/// Returns whether an O product after the one-launch step read the step's bf16 copy of its
/// output (`AFM_ATTN_HALF`; tensor-core decode steps of 9..64 rows).
fn check(case: Case) -> bool {
    let mut c = ctx();
    let (d, nh, nkv) = (case.d, case.n_heads, case.n_kv);
    let what = format!(
        "heads {nh}/{nkv} d {d} {:?} norm {} window {:?} softcap {:?} ctx {:?} splits {:?} fixed {:?}",
        case.dtype, case.norm, case.window, case.softcap, case.ctx, case.splits, case.fixed
    );
    let mut rng = Rng(9100 + d as u64 + 7 * nh as u64 + case.ctx.len() as u64);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: d,
    };
    let new: Vec<(usize, usize)> = case.ctx.iter().map(|&p| (p, 1)).collect();
    let (num_blocks, tables) = scattered_tables(&mut rng, &new, BS, 3);
    let mut caches = [(); 5].map(|_| {
        let mut cache = DeviceKvCache::new(&c, &[shape], num_blocks, BS, case.dtype).unwrap();
        fill_history(&c, &mut cache, &tables, &case, 77);
        cache
    });
    let seqs: Vec<AttnSeq> = case
        .ctx
        .iter()
        .enumerate()
        .map(|(s, &p)| AttnSeq {
            row0: s,
            len: 1,
            pos0: p,
            block_table: &tables[s],
        })
        .collect();
    let batch = match case.fixed {
        None => AttnBatch::new(&c, &caches[0], &seqs, nh).unwrap(),
        Some((bucket, max_blocks)) => {
            let meta =
                AttnBatch::pack_fixed_decode(&seqs, bucket, max_blocks, BS, num_blocks).unwrap();
            let md = c.upload(&meta).unwrap();
            AttnBatch::fixed_decode_owned(&c, &caches[0], md, bucket, max_blocks, nh).unwrap()
        }
    };
    // A graph's padding rows get position 0 and random rows: nothing of them may be stored.
    let rows = batch.n_rows();
    let mut positions: Vec<i32> = case.ctx.iter().map(|&p| p as i32).collect();
    positions.resize(rows, 0);
    let qw = nh * d;
    let [q, k, v, qn, kn] = prologue_inputs(&mut rng, rows, nh, nkv, d);
    let max_pos = case.ctx.iter().max().map_or(1, |&p| p + 1);
    let rope = Rope::new(d, 1e6, 1.0, RopeStyle::Neox);
    let table = RopeTable::from_cpu(&c, &rope, d, RopeStyle::Neox, max_pos).unwrap();
    let pd = c.upload(&positions).unwrap();
    let (qnd, knd) = (c.upload(&qn).unwrap(), c.upload(&kn).unwrap());
    let (qnv, knv) = (qnd.slice(0..d), knd.slice(0..d));
    let norms = case.norm.then_some((&qnv, &knv, 1e-6));
    let vd = c.upload(&v).unwrap();
    let p = AttnParams {
        n_heads: nh,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        window: case.window,
        softcap: case.softcap,
    };
    let [sep, fused, joined, joined_two, halved] = &mut caches;

    // Two launches.
    let (mut qs, mut ks) = (c.upload(&q).unwrap(), c.upload(&k).unwrap());
    c.attn_prologue(
        sep, 0, &batch, &table, &pd, &mut qs, nh, &mut ks, &vd, norms,
    )
    .unwrap();
    let mut out_sep = poisoned(&c, rows * qw);
    c.paged_attention(sep, 0, &batch, &qs, qw, &p, &mut out_sep, qw, case.splits)
        .unwrap();

    // One call.
    c.set_attn_fused_prologue(true);
    let (mut qf, mut kf) = (c.upload(&q).unwrap(), c.upload(&k).unwrap());
    let mut out_fused = poisoned(&c, rows * qw);
    let one = c
        .attend_prologue(
            fused,
            0,
            &batch,
            &table,
            &pd,
            &mut qf,
            &mut kf,
            &vd,
            norms,
            &p,
            &mut out_fused,
            case.splits,
        )
        .unwrap();
    assert_eq!(one, case.one_launch, "{what}: one launch");

    // The same step writing a bf16 copy of its output where it can (handover.rs), then an O
    // product (16-bit weights, skinny rows): the product reads the copy, and gives the bits of
    // the one that converts the f32 output itself.
    let wo = random_weight(&mut rng, DType::BF16, 256, qw);
    let wo = DeviceWeight::upload(&c, &wo).unwrap();
    c.set_attn_half(Some(true));
    let copies = c.attn_half_copies();
    let (mut qh, mut kh) = (c.upload(&q).unwrap(), c.upload(&k).unwrap());
    let mut out_half = poisoned(&c, rows * qw);
    c.attend_prologue(
        halved,
        0,
        &batch,
        &table,
        &pd,
        &mut qh,
        &mut kh,
        &vd,
        norms,
        &p,
        &mut out_half,
        case.splits,
    )
    .unwrap();
    let mut o_half = poisoned(&c, rows * 256);
    c.matmul(&wo, &out_half, rows, &mut o_half).unwrap();
    let took = c.attn_half_copies() > copies;
    c.set_attn_half(None);
    let mut o_conv = poisoned(&c, rows * 256);
    c.matmul(&wo, &out_half, rows, &mut o_conv).unwrap();
    assert_eq!(
        bits(&c.download(&out_half).unwrap()),
        bits(&c.download(&out_fused).unwrap()),
        "{what}: the bf16 copy moved the attention output"
    );
    // A graph's padding rows have no attention output (their copy rows hold whatever the
    // workspace held, their f32 rows the poison), and no one reads their products.
    let real = case.ctx.len() * 256;
    assert_eq!(
        bits(&c.download(&o_half).unwrap()[..real]),
        bits(&c.download(&o_conv).unwrap()[..real]),
        "{what}: O from the attention's bf16 copy"
    );

    // The same rows as one buffer of rows [q | k | v] (a joined Q/K/V product), read in
    // place: in one launch where the step allows it, and as two launches (switched off).
    let kw = nkv * d;
    let qkv: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let (qr, kr) = (&q[r * qw..(r + 1) * qw], &k[r * kw..(r + 1) * kw]);
            qr.iter().chain(kr).chain(&v[r * kw..(r + 1) * kw]).copied()
        })
        .collect();
    let mut run_joined = |cache: &mut DeviceKvCache, on: bool| {
        c.set_attn_fused_prologue(on);
        let mut all = c.upload(&qkv).unwrap();
        let mut out = poisoned(&c, rows * qw);
        let one = c
            .attend_prologue_joined(
                cache,
                0,
                &batch,
                &table,
                &pd,
                &mut all,
                norms,
                &p,
                &mut out,
                case.splits,
            )
            .unwrap();
        c.set_attn_fused_prologue(true);
        assert_eq!(one, on && case.one_launch, "{what}: joined, one launch");
        c.download(&out).unwrap()
    };
    let out_joined = [run_joined(joined, true), run_joined(joined_two, false)];

    let real = case.ctx.len() * qw;
    let (a, b) = (
        c.download(&out_fused).unwrap(),
        c.download(&out_sep).unwrap(),
    );
    assert!(
        b[..real].iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    let moved = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits());
    assert_eq!(
        moved.count(),
        0,
        "{what}: outputs moved from prologue + attention"
    );
    // Padding rows' outputs are left alone by both.
    assert_eq!(bits(&a[real..]), bits(&b[real..]), "{what}: padding rows");
    for (i, j) in out_joined.iter().enumerate() {
        assert!(
            bits(j) == bits(&b),
            "{what}: joined q|k|v ({i}) moved the outputs"
        );
    }
    for blk in 0..num_blocks {
        for h in 0..nkv {
            let y = sep.layers[0].read_block(&c, sep, blk, h).unwrap();
            for cache in [&*fused, &*joined, &*joined_two, &*halved] {
                let x = cache.layers[0].read_block(&c, cache, blk, h).unwrap();
                assert_eq!(
                    (bits(&x.0), bits(&x.1)),
                    (bits(&y.0), bits(&y.1)),
                    "{what}: cache block {blk} head {h} moved"
                );
            }
        }
    }
    took
}

/// Qwen3-0.6B's heads (16/8, d 128: two query heads per block) with the Q/K norms, contexts
/// of 1 key, a block's last and first slots, and several splits; then at a graph's batch.
#[test]
fn qwen3_0_6b_heads() {
    check(Case::decode(16, 8, 128, true, &[0, 15, 16, 31, 140, 1000]));
    check(Case::decode(16, 8, 128, true, &[200]));
    check(Case {
        fixed: Some((8, 64)),
        ..Case::decode(16, 8, 128, true, &[5, 100, 700])
    });
    check(Case {
        fixed: Some((4, 2)),
        ..Case::decode(16, 8, 128, true, &[31])
    });
}

/// Qwen3-8B / Llama 3's heads (32/8, d 128: four query heads per block), with and without
/// norms, forced splits (the new key in the last of 3, of 1) and the chosen ones.
#[test]
fn qwen3_8b_heads() {
    check(Case::decode(32, 8, 128, true, &[200, 33, 64]));
    for splits in [Some(3), Some(1), Some(7)] {
        check(Case {
            splits,
            ..Case::decode(32, 8, 128, false, &[200, 33, 64, 0])
        });
    }
    // More blocks than the kernel keeps in shared memory (512), in one split: the writer
    // reads its block id from the global table.
    check(Case {
        splits: Some(1),
        ..Case::decode(32, 8, 128, true, &[9000])
    });
}

/// The K/V ring's first fill is issued before the PDL wait, all but the new key's row (which
/// `attn_dec` copies after the wait, as `attn_prologue` has just stored it, and
/// `attn_dec_pro` puts from registers): one split, the new key in each stage of the first
/// fill (4 stages of 16 keys at d 128, 2 at d 256), in the first stage after it, and on the
/// stages' edges; several splits whose last one is all first fill.
#[test]
fn new_key_in_and_after_the_first_fill() {
    for ctx in [&[0, 15, 16, 31, 32][..], &[47, 48, 63, 64, 79, 80]] {
        check(Case {
            splits: Some(1),
            ..Case::decode(16, 8, 128, true, ctx)
        });
    }
    check(Case {
        splits: Some(1),
        ..Case::decode(4, 2, 256, true, &[15, 16, 31, 32, 47])
    });
    check(Case {
        splits: Some(2),
        ..Case::decode(32, 8, 128, false, &[63, 64, 127, 128, 191])
    });
}

/// Many splits: the last block to finish combines up to 38 partials per head, several
/// register loads' worth (16 per thread) and more (m, l) pairs than threads at four heads
/// per block.
#[test]
fn many_splits_merge() {
    check(Case {
        splits: Some(20),
        ..Case::decode(16, 8, 128, true, &[1000, 300])
    });
    check(Case {
        splits: Some(40),
        ..Case::decode(32, 8, 128, true, &[3000, 5])
    });
    check(Case {
        splits: Some(40),
        ..Case::decode(8, 8, 64, false, &[2500])
    });
}

/// Head size 64 with one, two and four query heads per block; head size 256 (Gemma 3's).
#[test]
fn other_head_sizes() {
    check(Case::decode(8, 8, 64, true, &[63, 64, 65, 500]));
    check(Case::decode(8, 4, 64, false, &[0, 47, 48, 300]));
    check(Case::decode(8, 2, 64, true, &[0, 31, 32, 33, 47, 48]));
    check(Case::decode(4, 2, 256, true, &[100, 17]));
    check(Case::decode(4, 4, 256, false, &[1, 2000]));
}

/// More query heads per KV head than a block takes: every block of the new key's split puts
/// it into its own stage, one stores it. Gemma 3 (4/1 at d 256: two blocks per KV head),
/// Qwen2.5-0.5B (14/2 at d 64: seven of one head), eight heads per KV head at d 128 (two
/// blocks of four).
#[test]
fn several_blocks_per_kv_head() {
    check(Case::decode(4, 1, 256, true, &[50, 3, 0]));
    check(Case::decode(14, 2, 64, false, &[31, 32, 700]));
    check(Case {
        splits: Some(4),
        ..Case::decode(16, 2, 128, true, &[150, 16])
    });
    check(Case {
        fixed: Some((4, 16)),
        ..Case::decode(8, 1, 256, true, &[200, 1])
    });
}

/// Gemma's sliding window and logit soft-capping go through the fused kernel too.
#[test]
fn window_and_softcap() {
    check(Case {
        window: Some(64),
        softcap: Some(50.0),
        ..Case::decode(8, 4, 128, true, &[300, 10, 64])
    });
}

/// Where the decode kernel does not take the step (an f32 cache; head_dim 32), and when
/// switched off, `attend_prologue` is the two launches. (Steps with prefill chunks:
/// compute::tests' `fused_attention_step_matches_the_cpu_and_the_separate_kernels`.)
#[test]
fn falls_back_to_two_launches() {
    // f32 cache.
    check(Case {
        dtype: KvDtype::F32,
        one_launch: false,
        ..Case::decode(16, 8, 128, true, &[20, 300])
    });
    // No decode kernel for head_dim 32.
    check(Case {
        one_launch: false,
        ..Case::decode(8, 4, 32, true, &[50, 3])
    });
    // Switched off (AFM_ATTN_FUSED_PRO=0's switch): two launches.
    let mut c = ctx();
    let shape = LayerKvShape {
        n_kv_heads: 8,
        head_dim: 128,
    };
    let mut cache = DeviceKvCache::new(&c, &[shape], 8, BS, KvDtype::F16).unwrap();
    let table: Vec<u32> = (0..8).collect();
    let seqs = [AttnSeq {
        row0: 0,
        len: 1,
        pos0: 40,
        block_table: &table,
    }];
    let batch = AttnBatch::new(&c, &cache, &seqs, 16).unwrap();
    let rope = Rope::new(128, 1e6, 1.0, RopeStyle::Neox);
    let rt = RopeTable::from_cpu(&c, &rope, 128, RopeStyle::Neox, 64).unwrap();
    let pd = c.upload(&[40i32]).unwrap();
    let mut rng = Rng(5);
    let mut q = c.upload(&rng.vec(16 * 128, 1.0)).unwrap();
    let mut k = c.upload(&rng.vec(8 * 128, 1.0)).unwrap();
    let v = c.upload(&rng.vec(8 * 128, 1.0)).unwrap();
    let p = AttnParams {
        n_heads: 16,
        head_dim: 128,
        scale: 0.1,
        window: None,
        softcap: None,
    };
    let mut out = poisoned(&c, 16 * 128);
    c.set_attn_fused_prologue(false);
    let one = c
        .attend_prologue(
            &mut cache, 0, &batch, &rt, &pd, &mut q, &mut k, &v, None, &p, &mut out, None,
        )
        .unwrap();
    c.set_attn_fused_prologue(true);
    assert!(!one, "switched off, attend_prologue still took one launch");
}

/// Steps of enough sequences that a KV head's blocks fill the device take the tensor-core
/// decode kernel (`attn_dec_mma_*`), whose prologue twin (`attn_dec_mma_pro_*`) must give the
/// bits of the prologue launch followed by it: every head size, groups 1 to 4, norms on and
/// off, forced splits (the new key in the last of 3), a window with softcap, a graph's batch.
/// At Qwen3's heads (20 rows) an O product after it reads its bf16 copy (`AFM_ATTN_HALF`).
#[test]
fn many_sequences_on_tensor_cores() {
    let sm = common::ctx().info().sm_count;
    let ctx = |n_kv: usize| -> Vec<usize> {
        (0..sm.div_ceil(n_kv) + 3).map(|i| (i * 41) % 600).collect()
    };
    for case in [
        Case::decode(16, 8, 128, true, &ctx(8)),
        Case::decode(32, 8, 128, false, &ctx(8)),
    ] {
        assert!(check(case), "the O product reads the attention's bf16 copy");
    }
    check(Case::decode(8, 2, 256, true, &ctx(2)));
    check(Case::decode(4, 4, 64, true, &ctx(4)));
    for splits in [Some(3), Some(1)] {
        check(Case {
            splits,
            ..Case::decode(32, 8, 128, true, &ctx(8))
        });
    }
    check(Case {
        window: Some(50),
        softcap: Some(30.0),
        ..Case::decode(16, 8, 128, true, &ctx(8))
    });
    let c = ctx(8);
    check(Case {
        fixed: Some((c.len() + 4, 64)),
        ..Case::decode(16, 8, 128, true, &c)
    });
}
