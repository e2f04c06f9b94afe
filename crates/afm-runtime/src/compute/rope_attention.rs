//! RoPE at the step's positions and paged attention with the KV store in one call (models
//! whose heads need nothing between the two; the split form is `attn_step`).

#[cfg(feature = "cuda")]
use super::wrong;
use super::{check, host, ComputeError, Data, Device, KvPool, Result, Rotary, RotaryData};
use super::{Step, Tensor};
use crate::attention::AttnParams;

impl Device {
    /// Rotates each `head_dim`-wide head of every row of `x` at that row's position.
    pub fn rope(&self, r: &Rotary, x: &mut Tensor, head_dim: usize, step: &Step) -> Result<()> {
        check("rope rows (the step's tokens)", x.rows, step.n_rows())?;
        if head_dim == 0 || !x.cols.is_multiple_of(head_dim) {
            return Err(ComputeError::Shape {
                what: "rope row width (a multiple of head_dim)",
                got: x.cols,
                want: head_dim,
            });
        }
        match (self, &r.data) {
            (Device::Cpu, RotaryData::Host(rope)) => {
                let width = x.cols;
                host::rope(rope, x.host_mut("rope")?, width, head_dim, &step.positions);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Device::Cuda(c), RotaryData::Cuda(t)) => c.rope(t, x, head_dim, step),
            #[cfg(feature = "cuda")]
            _ => Err(wrong("rope", "another device", self.kind())),
        }
    }

    /// Stores the step's new keys and values (`k`, `v`: `[rows][n_kv_heads · head_dim]`) in
    /// layer `layer` of `kv`, then attends every query row (`q`: `[rows][n_heads · head_dim]`)
    /// to its sequence's cached positions. Returns `[rows][n_heads · head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        p: &AttnParams,
    ) -> Result<Tensor> {
        if layer >= kv.layers {
            return Err(ComputeError::Shape {
                what: "KV layer index (below the cache's layers)",
                got: layer,
                want: kv.layers,
            });
        }
        let n = step.n_rows();
        check("attention query rows", q.rows, n)?;
        check("attention key rows", k.rows, n)?;
        check("attention value rows", v.rows, n)?;
        check("attention query width", q.cols, p.n_heads * p.head_dim)?;
        check("attention value width (the key width)", v.cols, k.cols)?;
        let data = match self {
            Device::Cpu => {
                let cache = kv.host_mut("attention")?;
                let layer_kv = &mut cache.layers[layer];
                check(
                    "attention key width (the cache's)",
                    k.cols,
                    layer_kv.shape.n_kv_heads * layer_kv.shape.head_dim,
                )?;
                let (qh, kh, vh) = (
                    q.host("attention")?,
                    k.host("attention")?,
                    v.host("attention")?,
                );
                Data::Host(host::cached_attention(qh, kh, vh, layer_kv, &step.seqs, p))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.attention(kv, layer, step, q, k, v, p)?),
        };
        Ok(Tensor {
            rows: n,
            cols: q.cols,
            data,
        })
    }
}
