//! Building blocks shared by the architecture files: projections, norms, embeddings, gated MLPs,
//! and the attention step over the engine's paged cache.

use afm_runtime::attention::{paged_attention, AttnParams, AttnSeq};
use afm_runtime::kv_store::LayerKv;
use afm_runtime::ops::{self, Rope};
use afm_runtime::WeightMatrix;

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::forward::ForwardBatch;
use crate::ModelError;

/// `y = x·Wᵀ (+ b)`.
pub struct Linear {
    pub w: WeightMatrix,
    pub b: Option<Vec<f32>>,
}

impl Linear {
    pub fn load(
        ck: &Checkpoint,
        name: &str,
        n: NormNaming,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Self, ModelError> {
        let w = ck.matrix(&format!("{name}.weight"), n, out, inp)?;
        let b = if bias {
            Some(ck.vector(&format!("{name}.bias"), n, out)?)
        } else {
            None
        };
        Ok(Self { w, b })
    }

    /// `x` is `[rows][in]`; returns `[rows][out]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y = vec![0.0; rows * self.w.rows()];
        self.w.matmul(x, rows, &mut y);
        if let Some(b) = &self.b {
            ops::add_bias(&mut y, b);
        }
        y
    }
}

pub struct RmsNorm {
    pub w: Vec<f32>,
    pub eps: f32,
}

impl RmsNorm {
    /// `offset` is added to the stored weight: Gemma's HF checkpoints store `w` and compute
    /// `x·(1 + w)`, while llama.cpp's GGUF conversion already stores `1 + w`.
    pub fn load(
        ck: &Checkpoint,
        name: &str,
        n: NormNaming,
        len: usize,
        eps: f32,
        offset: f32,
    ) -> Result<Self, ModelError> {
        let mut w = ck.vector(&format!("{name}.weight"), n, len)?;
        w.iter_mut().for_each(|v| *v += offset);
        Ok(Self { w, eps })
    }

    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut y = x.to_vec();
        ops::rms_norm(&mut y, &self.w, self.eps);
        y
    }

    pub fn forward_inplace(&self, x: &mut [f32]) {
        ops::rms_norm(x, &self.w, self.eps);
    }
}

/// Token embeddings, optionally scaled (Gemma multiplies by √hidden).
pub struct Embedding {
    pub table: WeightMatrix,
    pub scale: f32,
}

impl Embedding {
    pub fn forward(&self, tokens: &[u32]) -> Vec<f32> {
        let d = self.table.cols();
        let mut x = vec![0.0; tokens.len() * d];
        for (row, &t) in x.chunks_exact_mut(d).zip(tokens) {
            self.table.dequantize_row(t as usize, row);
            if self.scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= self.scale);
            }
        }
        x
    }
}

/// `down(act(gate(x)) · up(x))`.
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub act: fn(f32) -> f32,
}

impl GatedMlp {
    pub fn load(
        ck: &Checkpoint,
        prefix: &str,
        n: NormNaming,
        hidden: usize,
        inter: usize,
        act: fn(f32) -> f32,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            gate: Linear::load(ck, &format!("{prefix}.gate_proj"), n, inter, hidden, false)?,
            up: Linear::load(ck, &format!("{prefix}.up_proj"), n, inter, hidden, false)?,
            down: Linear::load(ck, &format!("{prefix}.down_proj"), n, hidden, inter, false)?,
            act,
        })
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut g = self.gate.forward(x, rows);
        let u = self.up.forward(x, rows);
        ops::gated_act(&mut g, &u, self.act);
        self.down.forward(&g, rows)
    }
}

/// Rotate each token's heads at its position.
pub fn apply_rope(rope: &Rope, x: &mut [f32], head_dim: usize, positions: &[usize]) {
    let width = x.len() / positions.len().max(1);
    for (row, &p) in x.chunks_exact_mut(width).zip(positions) {
        rope.apply(row, head_dim, p);
    }
}

/// Store the new tokens' K/V in the cache, then attend. `q` is `[rows][n_heads·head_dim]`.
pub fn cached_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv: &mut LayerKv,
    batch: &ForwardBatch,
    params: &AttnParams,
) -> Vec<f32> {
    let kv_width = kv.shape.n_kv_heads * kv.shape.head_dim;
    let mut row = 0;
    let mut seqs = Vec::with_capacity(batch.seqs.len());
    for s in batch.seqs {
        for i in 0..s.len {
            let r = row + i;
            kv.write(
                s.block_table,
                s.pos0 + i,
                &k[r * kv_width..(r + 1) * kv_width],
                &v[r * kv_width..(r + 1) * kv_width],
            );
        }
        seqs.push(AttnSeq {
            row0: row,
            len: s.len,
            pos0: s.pos0,
            block_table: s.block_table,
        });
        row += s.len;
    }
    let mut out = vec![0.0; q.len()];
    paged_attention(q, kv, &seqs, params, &mut out);
    out
}

/// The rows of `x` (`[rows][width]`) listed in `rows`.
pub fn gather_rows(x: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| x[r * width..(r + 1) * width].iter().copied())
        .collect()
}
