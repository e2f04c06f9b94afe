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
pub fn paged_attention(q: &[f32], kv: &LayerKv, seqs: &[AttnSeq], p: &AttnParams, out: &mut [f32]) {
    let d = p.head_dim;
    let group = p.n_heads / kv.shape.n_kv_heads;
    // Which sequence each row belongs to, so (row, head) pairs can run in parallel.
    let mut row_seq = vec![0usize; q.len() / (p.n_heads * d)];
    for (si, s) in seqs.iter().enumerate() {
        row_seq[s.row0..s.row0 + s.len].fill(si);
    }
    out.par_chunks_mut(d).enumerate().for_each(|(idx, o)| {
        let (row, head) = (idx / p.n_heads, idx % p.n_heads);
        let s = &seqs[row_seq[row]];
        let pos = s.pos0 + (row - s.row0);
        let qh = &q[idx * d..(idx + 1) * d];
        attend_one(qh, kv, s.block_table, pos, head / group, p, o);
    });
}

/// One query head against its cached keys. With an f16 cache, like llama.cpp's CPU path, the
/// query and the attention weights are rounded to f16 where they meet the cache.
fn attend_one(
    q: &[f32],
    kv: &LayerKv,
    table: &[u32],
    pos: usize,
    kv_head: usize,
    p: &AttnParams,
    out: &mut [f32],
) {
    let d = p.head_dim;
    let bs = kv.block_size();
    let first = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let n = pos + 1 - first;
    let half = kv.dtype() == KvDtype::F16;
    let round = |x: f32| if half { f16::from_f32(x).to_f32() } else { x };
    let q: Vec<f32> = q.iter().map(|&x| round(x)).collect();
    let mut scores = Vec::with_capacity(n);
    let mut buf = vec![0f32; bs * d];
    for_each_span(first, pos, bs, |b, s0, s1| {
        let buf = &mut buf[..(s1 - s0) * d];
        kv.read_keys(table[b], kv_head, s0, buf);
        for k in buf.chunks_exact(d) {
            let mut dot = 0.0f32;
            for (a, c) in q.iter().zip(k) {
                dot += a * c;
            }
            scores.push(dot * p.scale);
        }
    });
    if let Some(cap) = p.softcap {
        crate::ops::softcap(&mut scores, cap);
    }
    crate::ops::softmax(&mut scores);
    scores.iter_mut().for_each(|w| *w = round(*w));
    out.fill(0.0);
    let mut i = 0;
    for_each_span(first, pos, bs, |b, s0, s1| {
        let buf = &mut buf[..(s1 - s0) * d];
        kv.read_values(table[b], kv_head, s0, buf);
        for v in buf.chunks_exact(d) {
            let w = scores[i];
            i += 1;
            for (o, x) in out.iter_mut().zip(v) {
                *o += w * x;
            }
        }
    });
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
