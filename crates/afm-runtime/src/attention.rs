//! Scaled dot-product attention of new query tokens against a paged KV cache.
//!
//! Every new token attends to all cached positions of its own sequence up to and including its
//! own position (causal), optionally limited to a sliding window. Prefill, chunked prefill,
//! decode and verification of drafted tokens are all this one call.

use half::f16;
use rayon::prelude::*;

use crate::kv_store::{KvDtype, LayerKv};

/// One sequence's share of a step: `len` new tokens at rows `row0..row0+len` of `q`,
/// at positions `pos0..pos0+len`, reading keys through `block_table`.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    pub row0: usize,
    pub len: usize,
    pub pos0: usize,
    pub block_table: &'a [u32],
}

#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub n_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Attend to at most this many most recent positions (the query's own included).
    pub window: Option<usize>,
    /// `cap · tanh(score / cap)` before softmax (Gemma 2).
    pub softcap: Option<f32>,
}

/// `q`: `[tokens][n_heads * head_dim]`; `out` the same shape.
///
/// One task per (sequence, KV head): its keys and values are read out of the paged cache once
/// (dequantized to f32 in one contiguous run) and serve every query row and every query head
/// of its GQA group, so a prefill chunk does not re-read the cache for each row.
pub fn paged_attention(q: &[f32], kv: &LayerKv, seqs: &[AttnSeq], p: &AttnParams, out: &mut [f32]) {
    let d = p.head_dim;
    let n_kv = kv.shape.n_kv_heads;
    let group = p.n_heads / n_kv;
    let tasks: Vec<(usize, usize)> = (0..seqs.len())
        .flat_map(|s| (0..n_kv).map(move |h| (s, h)))
        .collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(si, kh)| attend_group(q, kv, &seqs[si], kh, group, p))
        .collect();
    // Scatter: each result is `[row][head in group][head_dim]`.
    for (&(si, kh), res) in tasks.iter().zip(&results) {
        let s = &seqs[si];
        for r in 0..s.len {
            for g in 0..group {
                let dst = ((s.row0 + r) * p.n_heads + kh * group + g) * d;
                let src = (r * group + g) * d;
                out[dst..dst + d].copy_from_slice(&res[src..src + d]);
            }
        }
    }
}

/// All query heads of KV head `kh` for every new row of one sequence. With an f16 cache, like
/// llama.cpp's CPU path, queries and attention weights are rounded to f16 where they meet it.
fn attend_group(
    q: &[f32],
    kv: &LayerKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    p: &AttnParams,
) -> Vec<f32> {
    let d = p.head_dim;
    let bs = kv.block_size();
    let ctx = s.pos0 + s.len;
    let lo_of = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let base = lo_of(s.pos0);
    let mut keys = vec![0f32; (ctx - base) * d];
    let mut values = vec![0f32; (ctx - base) * d];
    for_each_span(base, ctx - 1, bs, |b, s0, s1| {
        let at = (b * bs + s0 - base) * d;
        let len = (s1 - s0) * d;
        kv.read_keys(s.block_table[b], kh, s0, &mut keys[at..at + len]);
        kv.read_values(s.block_table[b], kh, s0, &mut values[at..at + len]);
    });
    let half = kv.dtype() == KvDtype::F16;
    let round = |x: f32| if half { f16::from_f32(x).to_f32() } else { x };
    let mut res = vec![0f32; s.len * group * d];
    let mut qh = vec![0f32; d];
    let mut scores = Vec::with_capacity(ctx - base);
    for r in 0..s.len {
        let pos = s.pos0 + r;
        let lo = lo_of(pos) - base;
        let hi = pos + 1 - base;
        for g in 0..group {
            let at = ((s.row0 + r) * p.n_heads + kh * group + g) * d;
            qh.iter_mut()
                .zip(&q[at..at + d])
                .for_each(|(o, &x)| *o = round(x));
            scores.clear();
            scores.extend(
                keys[lo * d..hi * d]
                    .chunks_exact(d)
                    .map(|k| dot(&qh, k) * p.scale),
            );
            if let Some(cap) = p.softcap {
                crate::ops::softcap(&mut scores, cap);
            }
            crate::ops::softmax(&mut scores);
            let o = &mut res[(r * group + g) * d..(r * group + g + 1) * d];
            for (w, v) in scores.iter().zip(values[lo * d..hi * d].chunks_exact(d)) {
                let w = round(*w);
                o.iter_mut().zip(v).for_each(|(y, x)| *y += w * x);
            }
        }
    }
    res
}

/// Dot product with eight independent partial sums, so the compiler can vectorize it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Calls `f(block_index, first_slot, end_slot)` for the blocks covering positions `first..=last`.
fn for_each_span(first: usize, last: usize, bs: usize, mut f: impl FnMut(usize, usize, usize)) {
    let mut p = first;
    while p <= last {
        let b = p / bs;
        let s0 = p % bs;
        let s1 = ((b + 1) * bs).min(last + 1) - b * bs;
        f(b, s0, s1);
        p = b * bs + s1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_store::{KvCache, KvDtype, LayerKvShape};

    /// Dense causal attention over contiguous K/V, the textbook formula.
    fn dense(
        q: &[f32],
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        pos: usize,
        scale: f32,
        window: Option<usize>,
    ) -> Vec<f32> {
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let mut s: Vec<f32> = (first..=pos)
            .map(|j| q.iter().zip(&k[j]).map(|(a, b)| a * b).sum::<f32>() * scale)
            .collect();
        crate::ops::softmax(&mut s);
        let mut o = vec![0.0; q.len()];
        for (w, j) in s.iter().zip(first..=pos) {
            for (x, y) in o.iter_mut().zip(&v[j]) {
                *x += w * y;
            }
        }
        o
    }

    #[test]
    fn paged_equals_dense_across_blocks_and_windows() {
        let d = 4;
        let shape = LayerKvShape {
            n_kv_heads: 1,
            head_dim: d,
        };
        let cases = [
            (KvDtype::F32, 1e-5),
            (KvDtype::F16, 2e-3),
            (KvDtype::Q8, 2e-2),
            (KvDtype::Q4, 0.2),
        ];
        for (dtype, tol) in cases {
            check_against_dense(KvCache::new(&[shape], 8, 3, dtype), tol);
        }
    }

    fn check_against_dense(mut cache: KvCache, tol: f32) {
        let d = 4;
        let table = [5u32, 2, 7, 0]; // scattered blocks
        let val = |i: usize, j: usize| ((i * 7 + j * 3) % 11) as f32 / 5.0 - 1.0;
        let ks: Vec<Vec<f32>> = (0..10)
            .map(|i| (0..d).map(|j| val(i, j)).collect())
            .collect();
        let vs: Vec<Vec<f32>> = (0..10)
            .map(|i| (0..d).map(|j| val(i + 3, j)).collect())
            .collect();
        for p in 0..10 {
            cache.layers[0].write(&table, p, &ks[p], &vs[p]);
        }
        for window in [None, Some(4)] {
            let q: Vec<f32> = (0..2 * d).map(|j| val(j, 1)).collect(); // 2 heads share the kv head
            let params = AttnParams {
                n_heads: 2,
                head_dim: d,
                scale: 0.5,
                window,
                softcap: None,
            };
            let seqs = [AttnSeq {
                row0: 0,
                len: 1,
                pos0: 9,
                block_table: &table,
            }];
            let mut out = vec![0.0; 2 * d];
            paged_attention(&q, &cache.layers[0], &seqs, &params, &mut out);
            for h in 0..2 {
                let want = dense(&q[h * d..(h + 1) * d], &ks, &vs, 9, 0.5, window);
                for (a, b) in out[h * d..(h + 1) * d].iter().zip(&want) {
                    assert!((a - b).abs() < tol, "{a} vs {b}");
                }
            }
        }
    }
}
