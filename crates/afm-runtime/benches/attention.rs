//! Decode attention time per layer call: `batch` sequences of `ctx` cached tokens, one new
//! token each, SmolLM2's shape (9 query heads, 3 KV heads, head size 64), f16 cache, blocks of
//! 16 scattered over a pool far larger than the caches (as a serving engine's are). Plain
//! `std::time`; `cargo bench -p afm-runtime --bench attention [batch ctx layers]`.

use afm_runtime::attention::{paged_attention, AttnParams, AttnSeq};
use afm_runtime::kv_store::{KvCache, KvDtype, LayerKvShape};
use afm_runtime::threads::with_hot_workers;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (batch, ctx, layers) = match args[..] {
        [b, c, l, ..] => (b, c, l),
        _ => (8, 192, 30),
    };
    let (n_heads, n_kv, d, bs) = (9, 3, 64, 16);
    let shape = LayerKvShape {
        n_kv_heads: n_kv,
        head_dim: d,
    };
    let per_seq = ctx.div_ceil(bs);
    // Four times the blocks the batch needs, handed out in a scattered order.
    let num_blocks = 4 * batch * per_seq;
    let mut cache = KvCache::new(&vec![shape; layers], num_blocks, bs, KvDtype::F16);
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in (1..ids.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let tables: Vec<Vec<u32>> = ids
        .chunks(per_seq)
        .take(batch)
        .map(|c| c.to_vec())
        .collect();
    let w = n_kv * d;
    let row: Vec<f32> = (0..w)
        .map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5)
        .collect();
    for layer in &mut cache.layers {
        for t in &tables {
            for pos in 0..ctx {
                layer.write(t, pos, &row, &row);
            }
        }
    }
    let q: Vec<f32> = (0..batch * n_heads * d)
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let seqs: Vec<AttnSeq> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| AttnSeq {
            row0: i,
            len: 1,
            pos0: ctx - 1,
            block_table: t,
        })
        .collect();
    let p = AttnParams {
        n_heads,
        head_dim: d,
        scale: 0.125,
        window: None,
        softcap: None,
    };
    let mut out = vec![0f32; q.len()];
    let steps = 200;
    afm_runtime::threads::install(|| {
        with_hot_workers(|| {
            let t = Instant::now();
            for _ in 0..steps {
                for layer in &cache.layers {
                    paged_attention(&q, layer, &seqs, &p, &mut out);
                }
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / (steps * layers) as f64;
            let bytes = (batch * n_kv * ctx * d * 2 * 2) as f64;
            println!(
                "batch {batch} ctx {ctx} threads {}: {us:.1} µs per layer call, {:.1} GB/s of K/V",
                rayon::current_num_threads(),
                bytes / us / 1e3
            );
        })
    });
}
