//! Attention scenarios for the GPU tests: the same K/V written to the CPU cache and the device
//! cache, then the CPU attention (the reference) and the device kernels over them.

use afm_runtime::attention::{paged_attention, AttnParams, AttnSeq};
use afm_runtime::cuda::{self, AttnBatch, AttnKernel, CudaContext, DeviceKvCache};
use afm_runtime::kv_store::{KvCache, KvDtype, LayerKvShape};

use super::{poisoned, Rng};

/// One attention scenario: the CPU cache and the device cache get the same K/V (history
/// through one batch, the step's new tokens through another), then both attend
/// ([`run_attention`]).
pub struct AttnCase {
    pub n_heads: usize,
    pub n_kv: usize,
    pub d: usize,
    pub dtype: KvDtype,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    /// (cached positions before the step, new tokens in the step) per sequence.
    pub seqs: Vec<(usize, usize)>,
    pub splits: Option<usize>,
}

/// Runs `case` on the CPU (the reference) and on the device once per kernel choice in
/// `kernels`, all on the same caches and queries: the CPU output and each device output (or
/// the device's error).
pub fn run_attention(
    c: &mut CudaContext,
    rng: &mut Rng,
    case: &AttnCase,
    kernels: &[AttnKernel],
) -> (Vec<f32>, Vec<cuda::Result<Vec<f32>>>) {
    run_attention_over(c, rng, case, kernels, None)
}

/// [`run_attention`] of a decode case through the batch a CUDA graph replays:
/// `AttnBatch::fixed_decode_owned` over `bucket` sequences (the case's, then padding) with
/// tables of `max_blocks` entries (the context class). One output (the Auto kernel).
pub fn run_attention_fixed(
    c: &mut CudaContext,
    rng: &mut Rng,
    case: &AttnCase,
    bucket: usize,
    max_blocks: usize,
) -> (Vec<f32>, cuda::Result<Vec<f32>>) {
    let (want, mut got) = run_attention_over(
        c,
        rng,
        case,
        &[AttnKernel::Auto],
        Some((bucket, max_blocks)),
    );
    (want, got.remove(0))
}

fn run_attention_over(
    c: &mut CudaContext,
    rng: &mut Rng,
    case: &AttnCase,
    kernels: &[AttnKernel],
    fixed: Option<(usize, usize)>,
) -> (Vec<f32>, Vec<cuda::Result<Vec<f32>>>) {
    let (bs, d, nkv) = (16, case.d, case.n_kv);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: d,
    };
    let (num_blocks, tables) = scattered_tables(rng, &case.seqs, bs, 7);
    let mut cpu = KvCache::new(&[shape], num_blocks, bs, case.dtype);
    let mut dev = DeviceKvCache::new(c, &[shape], num_blocks, bs, case.dtype).unwrap();
    let width = nkv * d;
    let mut write = |c: &mut CudaContext, rows: Vec<(usize, usize, usize)>| {
        // rows: (sequence, first position, count)
        let mut seqs = Vec::new();
        let mut row0 = 0;
        for &(s, p0, n) in &rows {
            seqs.push(AttnSeq {
                row0,
                len: n,
                pos0: p0,
                block_table: &tables[s],
            });
            row0 += n;
        }
        if row0 == 0 {
            return;
        }
        let (k, v) = (rng.vec(row0 * width, 1.0), rng.vec(row0 * width, 1.0));
        for sq in &seqs {
            for i in 0..sq.len {
                let r = (sq.row0 + i) * width;
                let (kr, vr) = (&k[r..r + width], &v[r..r + width]);
                cpu.layers[0].write(sq.block_table, sq.pos0 + i, kr, vr);
            }
        }
        let batch = AttnBatch::new(c, &dev, &seqs, case.n_heads).unwrap();
        let (kd, vd) = (c.upload(&k).unwrap(), c.upload(&v).unwrap());
        c.kv_write(&mut dev, 0, &batch, &kd, width, &vd, width)
            .unwrap();
    };
    let hist = case
        .seqs
        .iter()
        .enumerate()
        .map(|(s, &(p, _))| (s, 0, p))
        .collect();
    write(c, hist);
    let step = case
        .seqs
        .iter()
        .enumerate()
        .map(|(s, &(p, l))| (s, p, l))
        .collect();
    write(c, step);

    // The device cache holds exactly what the CPU cache holds.
    for (s, t) in tables.iter().enumerate().take(2) {
        let (kd, vd) = dev.layers[0]
            .read_block(c, &dev, t[0] as usize, nkv - 1)
            .unwrap();
        let mut kc = vec![0f32; bs * d];
        let mut vc = vec![0f32; bs * d];
        cpu.layers[0].read_keys(t[0], nkv - 1, 0, &mut kc);
        cpu.layers[0].read_values(t[0], nkv - 1, 0, &mut vc);
        let n = (case.seqs[s].0 + case.seqs[s].1).min(bs) * d;
        assert_eq!(
            (&kd[..n], &vd[..n]),
            (&kc[..n], &vc[..n]),
            "stored K/V differ"
        );
    }

    let mut seqs = Vec::new();
    let mut row0 = 0;
    for (s, &(p, l)) in case.seqs.iter().enumerate() {
        seqs.push(AttnSeq {
            row0,
            len: l,
            pos0: p,
            block_table: &tables[s],
        });
        row0 += l;
    }
    let qw = case.n_heads * d;
    let q = rng.vec(row0 * qw, 1.0);
    let params = AttnParams {
        n_heads: case.n_heads,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        window: case.window,
        softcap: case.softcap,
    };
    let mut want = vec![0f32; row0 * qw];
    paged_attention(&q, &cpu.layers[0], &seqs, &params, &mut want);
    let batch = match fixed {
        None => AttnBatch::new(c, &dev, &seqs, case.n_heads).unwrap(),
        Some((bucket, max_blocks)) => {
            let meta =
                AttnBatch::pack_fixed_decode(&seqs, bucket, max_blocks, bs, num_blocks).unwrap();
            let md = c.upload(&meta).unwrap();
            AttnBatch::fixed_decode_owned(c, &dev, md, bucket, max_blocks, case.n_heads).unwrap()
        }
    };
    // A fixed batch has `bucket` rows; the padding rows' queries are zeros, their outputs unread.
    let dev_rows = fixed.map_or(row0, |(bucket, _)| bucket.max(row0));
    let mut qp = q.clone();
    qp.resize(dev_rows * qw, 0.0);
    let qd = c.upload(&qp).unwrap();
    let got = kernels
        .iter()
        .map(|&k| {
            let mut out = poisoned(c, dev_rows * qw);
            c.paged_attention_with(
                k,
                &dev,
                0,
                &batch,
                &qd,
                qw,
                &params,
                &mut out,
                qw,
                case.splits,
            )?;
            let mut o = c.download(&out)?;
            o.truncate(row0 * qw);
            Ok(o)
        })
        .collect();
    (want, got)
}

/// Block tables for sequences of `(first position, new tokens)` over a pool with `spare` blocks
/// more than they need, the block ids shuffled so that tables are scattered, as a serving
/// engine's are. Returns the pool size and the tables.
pub fn scattered_tables(
    rng: &mut Rng,
    seqs: &[(usize, usize)],
    bs: usize,
    spare: usize,
) -> (usize, Vec<Vec<u32>>) {
    let need: Vec<usize> = seqs.iter().map(|&(p, l)| (p + l).div_ceil(bs)).collect();
    let num_blocks = need.iter().sum::<usize>() + spare;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut ids);
    let mut tables = Vec::new();
    let mut at = 0;
    for &n in &need {
        tables.push(ids[at..at + n].to_vec());
        at += n;
    }
    (num_blocks, tables)
}

/// A prologue's random inputs for `rows` rows: q (`n_heads` heads), k and v (`n_kv` heads) of
/// `d` values, and per-head norm weights for q and k near 1, drawn in that order.
pub fn prologue_inputs(
    rng: &mut Rng,
    rows: usize,
    n_heads: usize,
    n_kv: usize,
    d: usize,
) -> [Vec<f32>; 5] {
    let (qw, kw) = (n_heads * d, n_kv * d);
    let (q, k, v) = (
        rng.vec(rows * qw, 2.0),
        rng.vec(rows * kw, 2.0),
        rng.vec(rows * kw, 1.0),
    );
    let (qn, kn): (Vec<f32>, Vec<f32>) = (
        (0..d).map(|_| 1.0 + rng.sym(0.5)).collect(),
        (0..d).map(|_| 1.0 + rng.sym(0.5)).collect(),
    );
    [q, k, v, qn, kn]
}
