//! DeepSeek V4 attention over the engine's KV pool: the sliding window, the CSA/HCA
//! compressors, the lightning indexer and sink attention. Weights only; every piece of state
//! is a per-position stream of the pool, written when its token is computed:
//!
//! ```text
//! stream       shape (heads × dim)   row at position p
//! window       1 × head_dim          K = rope(kv_norm(kv_proj(x_p)), p); V = compressed row w
//!                                    where p = (w+1)·ratio − 1 closes window w (positions
//!                                    w·ratio ..= p), unused elsewhere (sliding layers: K again)
//! comp_raw     2 × head_dim (CSA)    K = compressor kv_proj(x_p) [Ca | Cb], V = gate_proj(x_p)
//!              1 × head_dim (HCA)
//! idx_raw      2 × index_dim (CSA)   the indexer's own kv / gate projections
//! idx_comp     1 × index_dim         the indexer's compressed row w, at p = (w+1)·ratio − 1
//!
//! CSA row w pools Ca of window w−1 and Cb of window w (width 2·ratio, stride ratio); HCA row w
//! pools window w. Query t sees window positions t−W+1 ..= t and compressed rows w < (t+1)/ratio
//! (CSA: only the indexer's top-k of those).
//! ```
//! Every row at position p depends on tokens 0..=p only (a compressed row sits at its window's
//! last position, not its first), so a block shared through the prefix cache holds the same
//! rows for every sequence that shares it.
//! The window stream's values and `idx_comp` use one position in `ratio`; the raw streams are
//! kept whole, though only the last two windows' are read again (a place to save memory later).
//! The pool lives on the model's device; the host code here reads and writes the rows it needs
//! through `Device::kv_read_rows` / `kv_write_rows`, one call per sequence and stream.

use afm_runtime::attention::AttnSeq;
use afm_runtime::compute::{ComputeError, Device, KvPart, KvPool, Tensor};
use afm_runtime::kv_store::LayerKvShape;
use rayon::prelude::*;

use super::{top_k, unweighted_rms_norm, AttnKind, Names, V4Config};
use crate::layers::{Linear, RmsNorm};
use crate::ModelError;

type CResult<T> = Result<T, ComputeError>;

/// Pool indices of one layer's streams.
pub(super) struct Streams {
    window: usize,
    /// comp_raw (the compressed rows are the window stream's values)
    comp: Option<usize>,
    /// (idx_raw, idx_comp)
    idx: Option<(usize, usize)>,
}

pub(super) fn plan_streams(c: &V4Config) -> (Vec<Streams>, Vec<LayerKvShape>) {
    let mut shapes = Vec::new();
    let mut add = |n_kv_heads: usize, head_dim: usize| {
        shapes.push(LayerKvShape {
            n_kv_heads,
            head_dim,
        });
        shapes.len() - 1
    };
    let (hd, id) = (c.head_dim, c.index_dim);
    let streams = c
        .kinds
        .iter()
        .map(|&kind| {
            let window = add(1, hd);
            let comp = match kind {
                AttnKind::Sliding => None,
                AttnKind::Csa => Some(add(2, hd)),
                AttnKind::Hca => Some(add(1, hd)),
            };
            let idx = (kind == AttnKind::Csa).then(|| (add(2, id), add(1, id)));
            Streams { window, comp, idx }
        })
        .collect();
    (streams, shapes)
}

/// Pools `ratio` tokens into one row: softmax over the tokens (per channel) of
/// `gate + position_bias`, weighted sum of `kv`, RMSNorm, RoPE at the window's first position.
struct Compressor {
    kv: Linear,
    gate: Linear,
    /// `[ratio][width]`, width = 2·dim with overlap.
    pos_bias: Vec<f32>,
    norm: Vec<f32>,
    ratio: usize,
    dim: usize,
    /// CSA: rows pool the previous window's Ca with this window's Cb.
    overlap: bool,
    /// The attention's compressor keeps its rows in the window stream's values; the indexer's
    /// in its own stream.
    rows_in_values: bool,
}

struct Indexer {
    comp: Compressor,
    q_b: Linear,
    weights: Linear,
}

pub(super) struct Attention {
    kind: AttnKind,
    q_a: Linear,
    q_a_norm: RmsNorm,
    q_b: Linear,
    kv: Linear,
    kv_norm: RmsNorm,
    /// Row blocks of `wo_a`, one per head group.
    o_a: Vec<Linear>,
    o_b: Linear,
    sinks: Vec<f32>,
    comp: Option<Compressor>,
    idx: Option<Indexer>,
}

impl Compressor {
    fn load(
        nm: &Names,
        c: &V4Config,
        p: &str,
        ratio: usize,
        dim: usize,
        overlap: bool,
    ) -> Result<Self, ModelError> {
        let width = if overlap { 2 * dim } else { dim };
        Ok(Self {
            kv: nm.linear(&format!("{p}.wkv"), width, c.hidden)?,
            gate: nm.linear(&format!("{p}.wgate"), width, c.hidden)?,
            pos_bias: nm.host(&format!("{p}.ape"), &[ratio, width])?,
            norm: nm.host(&format!("{p}.norm.weight"), &[dim])?,
            ratio,
            dim,
            overlap,
            rows_in_values: true,
        })
    }

    /// Stores the new tokens' raw projections, then every compressed row whose window closes
    /// among them.
    fn update(
        &self,
        dev: &Device,
        c: &V4Config,
        x: &Tensor,
        kv: &mut KvPool,
        (raw, out): (usize, usize),
        seqs: &[AttnSeq],
    ) -> CResult<()> {
        let proj = dev.to_host(self.kv.forward(dev, x)?)?;
        let gate = dev.to_host(self.gate.forward(dev, x)?)?;
        let width = proj.len() / x.rows().max(1);
        for s in seqs {
            let rows = s.row0 * width..(s.row0 + s.len) * width;
            let positions: Vec<usize> = (s.pos0..s.pos0 + s.len).collect();
            let (k, v) = (&proj[rows.clone()], &gate[rows]);
            dev.kv_write_rows(kv, raw, s.block_table, &positions, Some(k), Some(v))?;
        }
        let r = self.ratio;
        for s in seqs {
            let closing = s.pos0 / r..(s.pos0 + s.len) / r;
            if closing.is_empty() {
                continue;
            }
            // Raw rows of every window pooled: CSA's reach back one window.
            let first = if self.overlap {
                closing.start.saturating_sub(1)
            } else {
                closing.start
            };
            let lo = first * r;
            let span: Vec<usize> = (lo..closing.end * r).collect();
            let raw_kv = dev.kv_read_rows(kv, raw, s.block_table, &span, KvPart::Keys)?;
            let raw_gate = dev.kv_read_rows(kv, raw, s.block_table, &span, KvPart::Values)?;
            let mut rows = Vec::with_capacity(closing.len() * self.dim);
            for w in closing.clone() {
                rows.extend(self.pool_window(c, &raw_kv, &raw_gate, width, lo, w));
            }
            let at: Vec<usize> = closing.map(|w| (w + 1) * r - 1).collect();
            // The attention's rows share their position with the window key, kept as it is.
            let keys = (!self.rows_in_values).then_some(rows.as_slice());
            dev.kv_write_rows(kv, out, s.block_table, &at, keys, Some(&rows))?;
        }
        Ok(())
    }

    /// Compressed row `w` from the raw rows `kvs` / `gates` (`width` wide, the first at
    /// position `lo`).
    fn pool_window(
        &self,
        c: &V4Config,
        kvs: &[f32],
        gates: &[f32],
        width: usize,
        lo: usize,
        w: usize,
    ) -> Vec<f32> {
        let (d, r) = (self.dim, self.ratio);
        // (offset of the raw row's head in `kvs`, offset into the position bias row)
        let mut slots = Vec::with_capacity(2 * r);
        if self.overlap && w > 0 {
            slots.extend((0..r).map(|j| (((w - 1) * r + j - lo) * width, j * width)));
        }
        let head = if self.overlap { d } else { 0 };
        slots.extend((0..r).map(|j| ((w * r + j - lo) * width + head, j * width + head)));
        let mut row = vec![0f32; d];
        let mut logits = vec![0f32; slots.len()];
        for (ch, o) in row.iter_mut().enumerate() {
            for (l, &(at, bias)) in logits.iter_mut().zip(&slots) {
                *l = gates[at + ch] + self.pos_bias[bias + ch];
            }
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (mut num, mut den) = (0f32, 0f32);
            for (l, &(at, _)) in logits.iter().zip(&slots) {
                let e = (l - max).exp();
                num += e * kvs[at + ch];
                den += e;
            }
            *o = num / den;
        }
        unweighted_rms_norm(&mut row, c.eps);
        row.iter_mut().zip(&self.norm).for_each(|(v, g)| *v *= g);
        rope(&mut row, c.rope_dim, &c.compress_inv_freq, w * r, 1.0);
        row
    }
}

impl Attention {
    pub(super) fn load(
        nm: &Names,
        c: &V4Config,
        p: &str,
        kind: AttnKind,
    ) -> Result<Self, ModelError> {
        let (h, hd, heads) = (c.hidden, c.head_dim, c.n_heads);
        let group_in = heads * hd / c.o_groups;
        let o_name = format!("{p}.wo_a.weight");
        let o_a = (0..c.o_groups)
            .map(|g| {
                nm.row_block(
                    &o_name,
                    c.o_groups * c.o_lora_rank,
                    group_in,
                    g * c.o_lora_rank,
                    c.o_lora_rank,
                )
            })
            .collect::<Result<_, _>>()?;
        let ratio = c.ratio(kind);
        let comp = match kind {
            AttnKind::Sliding => None,
            k => Some(Compressor::load(
                nm,
                c,
                &format!("{p}.compressor"),
                ratio,
                hd,
                k == AttnKind::Csa,
            )?),
        };
        let idx = if kind == AttnKind::Csa {
            Some(Indexer {
                comp: Compressor {
                    rows_in_values: false,
                    ..Compressor::load(
                        nm,
                        c,
                        &format!("{p}.indexer.compressor"),
                        ratio,
                        c.index_dim,
                        true,
                    )?
                },
                q_b: nm.linear(
                    &format!("{p}.indexer.wq_b"),
                    c.index_heads * c.index_dim,
                    c.q_lora_rank,
                )?,
                weights: nm.linear(&format!("{p}.indexer.weights_proj"), c.index_heads, h)?,
            })
        } else {
            None
        };
        // The released checkpoints (llama.cpp's converter) say `kv_norm`; transformers' save `norm`.
        let kv_norm = nm.first(&[&format!("{p}.kv_norm.weight"), &format!("{p}.norm.weight")])?;
        let kv_norm = kv_norm.trim_end_matches(".weight");
        Ok(Self {
            kind,
            q_a: nm.linear(&format!("{p}.wq_a"), c.q_lora_rank, h)?,
            q_a_norm: nm.norm(&format!("{p}.q_norm"), c.q_lora_rank)?,
            q_b: nm.linear(&format!("{p}.wq_b"), heads * hd, c.q_lora_rank)?,
            kv: nm.linear(&format!("{p}.wkv"), hd, h)?,
            kv_norm: nm.norm(kv_norm, hd)?,
            o_a,
            o_b: nm.linear(&format!("{p}.wo_b"), h, c.o_groups * c.o_lora_rank)?,
            sinks: nm.host(&format!("{p}.attn_sink"), &[heads])?,
            comp,
            idx,
        })
    }

    /// `x`: the normed sublayer input `[rows][hidden]`; returns `[rows][hidden]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        dev: &Device,
        c: &V4Config,
        st: &Streams,
        x: Tensor,
        pool: &mut KvPool,
        seqs: &[AttnSeq],
        positions: &[usize],
    ) -> CResult<Vec<f32>> {
        let (hd, heads, rd) = (c.head_dim, c.n_heads, c.rope_dim);
        let inv = match self.kind {
            AttnKind::Sliding => &c.main_inv_freq,
            _ => &c.compress_inv_freq,
        };
        let mut q_res = self.q_a.forward(dev, &x)?;
        self.q_a_norm.forward_inplace(dev, &mut q_res)?;
        let mut q = dev.to_host(self.q_b.forward(dev, &q_res)?)?;
        q.par_chunks_exact_mut(heads * hd)
            .zip(positions)
            .for_each(|(row, &pos)| {
                for head in row.chunks_exact_mut(hd) {
                    unweighted_rms_norm(head, c.eps);
                    rope(head, rd, inv, pos, 1.0);
                }
            });
        let mut kv = self.kv.forward(dev, &x)?;
        self.kv_norm.forward_inplace(dev, &mut kv)?;
        let mut kv = dev.to_host(kv)?;
        for (row, &pos) in kv.chunks_exact_mut(hd).zip(positions) {
            rope(row, rd, inv, pos, 1.0);
        }
        for s in seqs {
            let rows = &kv[s.row0 * hd..(s.row0 + s.len) * hd];
            let at: Vec<usize> = (s.pos0..s.pos0 + s.len).collect();
            dev.kv_write_rows(pool, st.window, s.block_table, &at, Some(rows), Some(rows))?;
        }
        if let (Some(comp), Some(raw)) = (&self.comp, st.comp) {
            comp.update(dev, c, &x, pool, (raw, st.window), seqs)?;
        }
        let picks = match (&self.idx, st.idx) {
            (Some(idx), Some(ids)) => {
                idx.comp.update(dev, c, &x, pool, ids, seqs)?;
                Some(idx.select(dev, c, &x, &q_res, (pool, ids.1), seqs, positions)?)
            }
            _ => None,
        };
        let mut out = vec![0f32; q.len()];
        for s in seqs {
            self.attend_seq(dev, c, (pool, st), s, &q, picks.as_deref(), &mut out)?;
        }
        out.par_chunks_exact_mut(heads * hd)
            .zip(positions)
            .for_each(|(row, &pos)| {
                for head in row.chunks_exact_mut(hd) {
                    rope(head, rd, inv, pos, -1.0);
                }
            });
        self.project_out(dev, c, out, positions.len())
    }

    /// Sink attention of one sequence's new rows over its window and compressed rows.
    #[allow(clippy::too_many_arguments)]
    fn attend_seq(
        &self,
        dev: &Device,
        c: &V4Config,
        (pool, st): (&KvPool, &Streams),
        s: &AttnSeq,
        q: &[f32],
        picks: Option<&[Vec<usize>]>,
        out: &mut [f32],
    ) -> CResult<()> {
        let (hd, heads) = (c.head_dim, c.n_heads);
        let end = s.pos0 + s.len;
        let lo = (s.pos0 + 1).saturating_sub(c.window);
        let span: Vec<usize> = (lo..end).collect();
        let window = dev.kv_read_rows(pool, st.window, s.block_table, &span, KvPart::Keys)?;
        let ratio = c.ratio(self.kind).max(1);
        // CSA reads only the rows the indexer picked for some row of this chunk; `slot[e]` is
        // row e's place in `comp`.
        let needed: Vec<usize> = match (self.kind, picks) {
            (AttnKind::Sliding, _) => Vec::new(),
            (AttnKind::Csa, Some(p)) => {
                let mut v: Vec<usize> = p[s.row0..s.row0 + s.len]
                    .iter()
                    .flatten()
                    .copied()
                    .collect();
                v.sort_unstable();
                v.dedup();
                v
            }
            _ => (0..end / ratio).collect(),
        };
        let mut slot = vec![0usize; end / ratio];
        needed.iter().enumerate().for_each(|(k, &e)| slot[e] = k);
        let at: Vec<usize> = needed.iter().map(|&e| (e + 1) * ratio - 1).collect();
        let comp = dev.kv_read_rows(pool, st.window, s.block_table, &at, KvPart::Values)?;
        let row = |e: usize| &comp[slot[e] * hd..(slot[e] + 1) * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        let width = heads * hd;
        // Rows are independent: one task per new token.
        out[s.row0 * width..(s.row0 + s.len) * width]
            .par_chunks_exact_mut(width)
            .enumerate()
            .for_each(|(i, o_row)| {
                let (r, t) = (s.row0 + i, s.pos0 + i);
                let w0 = (t + 1).saturating_sub(c.window);
                let mut keys: Vec<&[f32]> = (w0..=t)
                    .map(|p| &window[(p - lo) * hd..(p - lo + 1) * hd])
                    .collect();
                let visible = (t + 1) / ratio;
                match (self.kind, picks) {
                    (AttnKind::Sliding, _) => {}
                    (AttnKind::Csa, Some(p)) => keys.extend(p[r].iter().map(|&e| row(e))),
                    _ => keys.extend((0..visible).map(row)),
                }
                for (h, o) in o_row.chunks_exact_mut(hd).enumerate() {
                    let qh = &q[(r * heads + h) * hd..(r * heads + h + 1) * hd];
                    let scores: Vec<f32> = keys.iter().map(|k| dot(qh, k) * scale).collect();
                    let sink = self.sinks[h];
                    let max = scores.iter().copied().fold(sink, f32::max);
                    let den =
                        scores.iter().map(|v| (v - max).exp()).sum::<f32>() + (sink - max).exp();
                    for (k, sc) in keys.iter().zip(&scores) {
                        let p = (sc - max).exp() / den;
                        o.iter_mut().zip(k.iter()).for_each(|(a, b)| *a += p * b);
                    }
                }
            });
        Ok(())
    }

    /// Grouped low-rank output projection: each head group through its `wo_a` rows, then `wo_b`.
    fn project_out(
        &self,
        dev: &Device,
        c: &V4Config,
        out: Vec<f32>,
        rows: usize,
    ) -> CResult<Vec<f32>> {
        let width = c.n_heads * c.head_dim;
        let gw = width / c.o_groups;
        let lr = c.o_lora_rank;
        let mut mid = vec![0f32; rows * c.o_groups * lr];
        for (g, w) in self.o_a.iter().enumerate() {
            let xg: Vec<f32> = out
                .chunks_exact(width)
                .flat_map(|row| row[g * gw..(g + 1) * gw].iter().copied())
                .collect();
            let yg = dev.to_host(w.forward(dev, &dev.tensor(rows, gw, xg)?)?)?;
            for (r, y) in yg.chunks_exact(lr).enumerate() {
                let dst = (r * c.o_groups + g) * lr;
                mid[dst..dst + lr].copy_from_slice(y);
            }
        }
        let mid = dev.tensor(rows, c.o_groups * lr, mid)?;
        dev.to_host(self.o_b.forward(dev, &mid)?)
    }
}

impl Indexer {
    /// Per row, the compressed rows (at most `index_topk`, all visible) with the highest
    /// `Σ_h w_h · relu(q_h · k)`.
    #[allow(clippy::too_many_arguments)]
    fn select(
        &self,
        dev: &Device,
        c: &V4Config,
        x: &Tensor,
        q_res: &Tensor,
        (pool, comp): (&KvPool, usize),
        seqs: &[AttnSeq],
        positions: &[usize],
    ) -> CResult<Vec<Vec<usize>>> {
        let (ih, id) = (c.index_heads, c.index_dim);
        let mut q = dev.to_host(self.q_b.forward(dev, q_res)?)?;
        for (row, &pos) in q.chunks_exact_mut(ih * id).zip(positions) {
            for head in row.chunks_exact_mut(id) {
                rope(head, c.rope_dim, &c.compress_inv_freq, pos, 1.0);
            }
        }
        let weights = dev.to_host(self.weights.forward(dev, x)?)?;
        let (w_scale, q_scale) = (1.0 / (ih as f32).sqrt(), 1.0 / (id as f32).sqrt());
        let ratio = self.comp.ratio;
        let mut picks = vec![Vec::new(); positions.len()];
        for s in seqs {
            let end = s.pos0 + s.len;
            let at: Vec<usize> = (0..end / ratio).map(|e| (e + 1) * ratio - 1).collect();
            let keys = dev.kv_read_rows(pool, comp, s.block_table, &at, KvPart::Keys)?;
            picks[s.row0..s.row0 + s.len]
                .par_iter_mut()
                .enumerate()
                .for_each(|(i, pick)| {
                    let (r, t) = (s.row0 + i, s.pos0 + i);
                    let visible = (t + 1) / ratio;
                    let scores: Vec<f32> = (0..visible)
                        .map(|e| {
                            let k = &keys[e * id..(e + 1) * id];
                            (0..ih)
                                .map(|h| {
                                    let qh = &q[(r * ih + h) * id..(r * ih + h + 1) * id];
                                    dot(qh, k).max(0.0) * q_scale * weights[r * ih + h] * w_scale
                                })
                                .sum()
                        })
                        .collect();
                    *pick = top_k(&scores, c.index_topk.min(visible));
                });
        }
        Ok(picks)
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Interleaved RoPE on the trailing `rope_dim` values of `head` at `pos`; `sign` −1 rotates
/// back (the attention output's conjugate rotation).
fn rope(head: &mut [f32], rope_dim: usize, inv_freq: &[f32], pos: usize, sign: f32) {
    let off = head.len() - rope_dim;
    for (i, f) in inv_freq.iter().enumerate().take(rope_dim / 2) {
        let (s, co) = (pos as f32 * f).sin_cos();
        let s = s * sign;
        let (a, b) = (head[off + 2 * i], head[off + 2 * i + 1]);
        head[off + 2 * i] = a * co - b * s;
        head[off + 2 * i + 1] = b * co + a * s;
    }
}
