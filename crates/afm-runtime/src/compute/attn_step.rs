//! Attention split at the KV store, for models whose heads get a norm and RoPE before it
//! (llama, qwen2, qwen3, gemma3):
//!
//! ```text
//! q, k, v ──attn_prologue──▶ q, k normed per head (optional) and rotated; k, v in the cache
//! q ────────attend─────────▶ out (every query against its sequence's cached positions)
//! ```
//!
//! On a GPU the prologue is one launch instead of five (Q norm, K norm, RoPE q, RoPE k, K/V
//! write); on the CPU it is those ops in that order, which define its results. `attend` is
//! [`Device::attention`] without the store. `attend_prologue` is the two in one call: on a GPU
//! one launch when the step is all decode rows (the decode attention kernel normalizes and
//! rotates its own query heads and stores the new K/V), the same bits as the two. It takes the
//! step's [`Qkv`]: three tensors, or the joined product of `norm_linear_qkv`, whose rows
//! `[q | k | v]` the kernels read in place with their stride. Models with other shapes keep
//! calling `attention`.

#[cfg(feature = "cuda")]
use super::RotaryData;
use super::{check, check_norm_width, ComputeError, Data, Device, KvData, KvPool, Qkv};
use super::{Result, Rotary, Step, Tensor, Vector};
use crate::attention::{paged_attention, AttnParams};

/// The per-head RMSNorm of Q and K before RoPE (Qwen 3, Gemma 3): one head's weights each.
#[derive(Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: &'a Vector,
    pub k: &'a Vector,
    pub eps: f32,
}

impl Device {
    /// The step of layer `layer` before attention: each `head_dim` head of `q`
    /// (`[rows][n_heads · head_dim]`) and `k` (`[rows][n_kv_heads · head_dim]`) RMS-normed by
    /// `norm` when given, then rotated by `r` at the step's positions, in place; then the
    /// step's keys and values stored in `kv`. Equal to `rms_norm_in_place` on q and k, `rope`
    /// on q and k, and the store of [`attention`](Self::attention); follow it with
    /// [`attend`](Self::attend).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prologue(
        &self,
        r: &Rotary,
        norm: Option<QkNorm>,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
        head_dim: usize,
    ) -> Result<()> {
        let rows = [q.rows, k.rows, v.rows];
        check_prologue(
            norm,
            rows,
            [q.cols, k.cols, v.cols],
            kv,
            layer,
            step,
            head_dim,
        )?;
        match self {
            Device::Cpu => {
                if let Some(nm) = norm {
                    self.rms_norm_in_place(q, nm.q, nm.eps)?;
                    self.rms_norm_in_place(k, nm.k, nm.eps)?;
                }
                self.rope(r, q, head_dim, step)?;
                self.rope(r, k, head_dim, step)?;
                store_host(kv, layer, step, k, v)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => {
                let RotaryData::Cuda(t) = &r.data else {
                    return Err(super::wrong("attn_prologue", "cpu", "cuda"));
                };
                c.attn_prologue(t, norm, q, k, v, kv, layer, step, head_dim)
            }
        }
    }

    /// Attends every query row (`q`: `[rows][n_heads · head_dim]`) to its sequence's cached
    /// positions in layer `layer` of `kv`, as [`attn_prologue`](Self::attn_prologue) left
    /// them. Returns `[rows][n_heads · head_dim]`.
    pub fn attend(
        &self,
        kv: &KvPool,
        layer: usize,
        step: &Step,
        q: &Tensor,
        p: &AttnParams,
    ) -> Result<Tensor> {
        check_layer(kv, layer)?;
        let n = step.n_rows();
        check("attention query rows", q.rows, n)?;
        check("attention query width", q.cols, p.n_heads * p.head_dim)?;
        let data = match (self, &kv.data) {
            (Device::Cpu, KvData::Host(cache)) => {
                let layer_kv = &cache.layers[layer];
                check(
                    "attention head_dim (the cache's)",
                    p.head_dim,
                    layer_kv.shape.head_dim,
                )?;
                let mut out = vec![0.0; q.rows * q.cols];
                paged_attention(q.host("attend")?, layer_kv, &step.seqs, p, &mut out);
                Data::Host(out)
            }
            #[cfg(feature = "cuda")]
            (Device::Cuda(c), KvData::Cuda(_)) => Data::Cuda(c.attend(kv, layer, step, q, p)?),
            #[cfg(feature = "cuda")]
            _ => return Err(super::wrong("attend", "another device", self.kind())),
        };
        Ok(Tensor {
            rows: n,
            cols: q.cols,
            data,
        })
    }

    /// [`attn_prologue`](Self::attn_prologue) then [`attend`](Self::attend) (`p.head_dim`
    /// wide heads) of `qkv`'s queries, keys and values, the same results bit for bit: on a GPU
    /// one launch where the step is all decode rows of the decode attention kernel
    /// (`CudaContext::attend_prologue`), and a joined `qkv` ([`Device::norm_linear_qkv`]) read
    /// in place. `qkv` is consumed: that launch never writes the normed, rotated q and k back.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_prologue(
        &self,
        r: &Rotary,
        norm: Option<QkNorm>,
        qkv: Qkv,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
        p: &AttnParams,
    ) -> Result<Tensor> {
        let (rows, [qc, kc, vc]) = (qkv.rows, qkv.widths);
        check_prologue(norm, [rows; 3], [qc, kc, vc], kv, layer, step, p.head_dim)?;
        check("attention query width", qc, p.n_heads * p.head_dim)?;
        match self {
            Device::Cpu => {
                let [mut q, mut k, v] = qkv.into_parts("attend_prologue")?;
                self.attn_prologue(r, norm, &mut q, &mut k, &v, kv, layer, step, p.head_dim)?;
                self.attend(kv, layer, step, &q, p)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => {
                let RotaryData::Cuda(t) = &r.data else {
                    return Err(super::wrong("attend_prologue", "cpu", "cuda"));
                };
                let data = c.attend_prologue(t, norm, qkv, kv, layer, step, p)?;
                Ok(Tensor {
                    rows,
                    cols: qc,
                    data: Data::Cuda(data),
                })
            }
        }
    }
}

/// [`Device::attn_prologue`]'s shape checks on q, k and v's rows and widths (the device arms
/// add the cache's and table's).
#[allow(clippy::too_many_arguments)]
fn check_prologue(
    norm: Option<QkNorm>,
    [qr, kr, vr]: [usize; 3],
    [qc, kc, vc]: [usize; 3],
    kv: &KvPool,
    layer: usize,
    step: &Step,
    head_dim: usize,
) -> Result<()> {
    check_layer(kv, layer)?;
    let n = step.n_rows();
    check("attention prologue query rows", qr, n)?;
    check("attention prologue key rows", kr, n)?;
    check("attention prologue value rows", vr, n)?;
    check("attention prologue value width (the key width)", vc, kc)?;
    if head_dim == 0 || !qc.is_multiple_of(head_dim) || !kc.is_multiple_of(head_dim) {
        return Err(ComputeError::Shape {
            what: "attention prologue q and k widths (multiples of head_dim)",
            got: if head_dim == 0 { 0 } else { qc.max(kc) },
            want: head_dim,
        });
    }
    if let Some(nm) = norm {
        check_norm_width(qc, nm.q)?;
        check_norm_width(kc, nm.k)?;
        check(
            "attention prologue q_norm length (head_dim)",
            nm.q.len,
            head_dim,
        )?;
        check(
            "attention prologue k_norm length (head_dim)",
            nm.k.len,
            head_dim,
        )?;
    }
    Ok(())
}

fn check_layer(kv: &KvPool, layer: usize) -> Result<()> {
    if layer >= kv.layers {
        return Err(ComputeError::Shape {
            what: "KV layer index (below the cache's layers)",
            got: layer,
            want: kv.layers,
        });
    }
    Ok(())
}

/// The CPU store: each row's keys and values at its position, as `host::cached_attention`.
fn store_host(kv: &mut KvPool, layer: usize, step: &Step, k: &Tensor, v: &Tensor) -> Result<()> {
    let cache = kv.host_mut("attn_prologue")?;
    let layer_kv = &mut cache.layers[layer];
    let w = layer_kv.shape.n_kv_heads * layer_kv.shape.head_dim;
    check("attention key width (the cache's)", k.cols, w)?;
    let (kh, vh) = (k.host("attn_prologue")?, v.host("attn_prologue")?);
    for s in &step.seqs {
        for i in 0..s.len {
            let r = s.row0 + i;
            let (kr, vr) = (&kh[r * w..(r + 1) * w], &vh[r * w..(r + 1) * w]);
            layer_kv.write(s.block_table, s.pos0 + i, kr, vr);
        }
    }
    Ok(())
}
