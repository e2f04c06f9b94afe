//! The CPU arm of device dispatch: the host code the models called before there was a GPU
//! (same calls, same order, so results are bit-for-bit those of the CPU path). Shapes were
//! checked by the caller in `compute`.

use crate::attention::{paged_attention, AttnParams, AttnSeq};
use crate::kv_store::LayerKv;
use crate::ops::{self, Rope};
use crate::WeightMatrix;

pub(super) fn embed(table: &WeightMatrix, tokens: &[u32], scale: f32) -> Vec<f32> {
    let d = table.cols();
    let mut x = vec![0.0; tokens.len() * d];
    for (row, &t) in x.chunks_exact_mut(d.max(1)).zip(tokens) {
        table.dequantize_row(t as usize, row);
        if scale != 1.0 {
            row.iter_mut().for_each(|v| *v *= scale);
        }
    }
    x
}

pub(super) fn linear(x: &[f32], rows: usize, w: &WeightMatrix, bias: Option<&[f32]>) -> Vec<f32> {
    let mut y = vec![0.0; rows * w.rows()];
    w.matmul(x, rows, &mut y);
    if let Some(b) = bias {
        ops::add_bias(&mut y, b);
    }
    y
}

pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    ops::rms_norm(&mut y, w, eps);
    y
}

/// Rotates each row (`width` values) at its position.
pub(super) fn rope(rope: &Rope, x: &mut [f32], width: usize, head_dim: usize, positions: &[usize]) {
    for (row, &p) in x.chunks_exact_mut(width.max(1)).zip(positions) {
        rope.apply(row, head_dim, p);
    }
}

/// Stores the new tokens' K/V in the cache, then attends.
pub(super) fn cached_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv: &mut LayerKv,
    seqs: &[AttnSeq],
    params: &AttnParams,
) -> Vec<f32> {
    let w = kv.shape.n_kv_heads * kv.shape.head_dim;
    for s in seqs {
        for i in 0..s.len {
            let r = s.row0 + i;
            let (kr, vr) = (&k[r * w..(r + 1) * w], &v[r * w..(r + 1) * w]);
            kv.write(s.block_table, s.pos0 + i, kr, vr);
        }
    }
    let mut out = vec![0.0; q.len()];
    paged_attention(q, kv, seqs, params, &mut out);
    out
}

pub(super) fn gather_rows(x: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| x[r * width..(r + 1) * width].iter().copied())
        .collect()
}
