//! The CUDA arm of `compute::attn_step`: the attention prologue in one launch
//! (`CudaContext::attn_prologue`), attention against the cache without a store, and the two
//! in one call (`CudaContext::attend_prologue`: one launch for decode steps; of a joined Q/K/V
//! buffer, `CudaContext::attend_prologue_joined`).

use super::{alloc, check, vector, view, view_mut, wrong, CudaDevice, Result};
use crate::attention::AttnParams;
use crate::compute::{ComputeError, KvData, KvPool, QkNorm, Qkv, QkvData, Step, StepData, Tensor};
use crate::cuda::{AttnBatch, Buf, CudaSlice, CudaView, DeviceKvCache, RopeTable};

impl CudaDevice {
    /// Shapes were checked by `Device::attn_prologue`, except against the cache and table.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::compute) fn attn_prologue(
        &self,
        t: &RopeTable,
        norm: Option<QkNorm>,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
        head_dim: usize,
    ) -> Result<()> {
        let (cache, positions, attn) =
            prologue_target("attn_prologue", kv, step, t, k.cols, layer, head_dim)?;
        if q.rows == 0 {
            return Ok(());
        }
        let ctx = self.lock();
        let n_heads = q.cols / head_dim;
        let vv = view(v, "attn_prologue")?;
        let norms = head_norms(norm, "attn_prologue")?;
        let mut qv = view_mut(q, "attn_prologue")?;
        let mut kv_ = view_mut(k, "attn_prologue")?;
        let pos = positions.slice(0..step.n_rows());
        ctx.attn_prologue(
            cache,
            layer,
            attn,
            t,
            &pos,
            &mut qv,
            n_heads,
            &mut kv_,
            &vv,
            norms.as_ref().map(|(a, b, e)| (a, b, *e)),
        )?;
        Ok(())
    }

    /// `attn_prologue` then `attend` (see `Device::attend_prologue`) of three tensors or of
    /// the joined buffer; shapes were checked by it, except against the cache and table.
    /// Leaves q and k normed and rotated, or raw.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::compute) fn attend_prologue(
        &self,
        t: &RopeTable,
        norm: Option<QkNorm>,
        qkv: Qkv,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
        p: &AttnParams,
    ) -> Result<CudaSlice<f32>> {
        let (rows, [qc, kc, vc]) = (qkv.rows, qkv.widths);
        let (cache, positions, attn) =
            prologue_target("attend_prologue", kv, step, t, kc, layer, p.head_dim)?;
        let mut ctx = self.lock();
        let n = rows * qc;
        let mut out = alloc(&ctx, n)?;
        if n == 0 {
            return Ok(out);
        }
        let norms = head_norms(norm, "attend_prologue")?;
        let norms = norms.as_ref().map(|(a, b, e)| (a, b, *e));
        let pos = positions.slice(0..step.n_rows());
        let mut ov = out.slice_mut(0..n);
        match qkv.data {
            QkvData::Parts([mut q, mut k, v]) => {
                let vv = view(&v, "attend_prologue")?;
                let mut qv = view_mut(&mut q, "attend_prologue")?;
                let mut kv_ = view_mut(&mut k, "attend_prologue")?;
                ctx.attend_prologue(
                    cache, layer, attn, t, &pos, &mut qv, &mut kv_, &vv, norms, p, &mut ov, None,
                )?;
            }
            QkvData::Joined(mut buf) => {
                let mut all = buf.slice_mut(0..rows * (qc + kc + vc));
                ctx.attend_prologue_joined(
                    cache, layer, attn, t, &pos, &mut all, norms, p, &mut ov, None,
                )?;
            }
        }
        Ok(out)
    }

    pub(in crate::compute) fn attend(
        &self,
        kv: &KvPool,
        layer: usize,
        step: &Step,
        q: &Tensor,
        p: &AttnParams,
    ) -> Result<CudaSlice<f32>> {
        let KvData::Cuda(cache) = &kv.data else {
            return Err(wrong("attend", "cpu", "cuda"));
        };
        let StepData::Cuda { attn, .. } = &step.data else {
            return Err(wrong("attend", "cpu", "cuda"));
        };
        let mut ctx = self.lock();
        let n = q.rows * q.cols;
        let mut out = alloc(&ctx, n)?;
        if n == 0 {
            return Ok(out);
        }
        let qv = view(q, "attend")?;
        let mut ov = out.slice_mut(0..n);
        ctx.paged_attention(cache, layer, attn, &qv, q.cols, p, &mut ov, q.cols, None)?;
        Ok(out)
    }
}

/// The device cache, positions and attention batch a prologue op (`op`) works on, after its
/// checks against layer `layer` of the cache and the rotary table.
fn prologue_target<'a>(
    op: &'static str,
    kv: &'a mut KvPool,
    step: &'a Step,
    t: &RopeTable,
    k_width: usize,
    layer: usize,
    head_dim: usize,
) -> Result<(&'a mut DeviceKvCache, &'a Buf<i32>, &'a AttnBatch)> {
    let KvData::Cuda(cache) = &mut kv.data else {
        return Err(wrong(op, "cpu", "cuda"));
    };
    let StepData::Cuda { positions, attn } = &step.data else {
        return Err(wrong(op, "cpu", "cuda"));
    };
    let shape = cache.layers[layer].shape;
    check(
        "attention prologue head_dim (the cache's)",
        head_dim,
        shape.head_dim,
    )?;
    check(
        "attention key width (the cache's)",
        k_width,
        shape.n_kv_heads * shape.head_dim,
    )?;
    if let Some(&p) = step.positions.iter().find(|&&p| p >= t.max_pos()) {
        return Err(ComputeError::Shape {
            what: "position (below the rotary table's length, the model's context)",
            got: p,
            want: t.max_pos(),
        });
    }
    Ok((cache, positions, attn))
}

/// The Q/K head norms' device weights and epsilon, as the prologue kernels take them.
type HeadNormViews<'a> = (CudaView<'a, f32>, CudaView<'a, f32>, f32);

fn head_norms<'a>(norm: Option<QkNorm<'a>>, op: &'static str) -> Result<Option<HeadNormViews<'a>>> {
    norm.map(|nm| Ok((vector(nm.q, op)?, vector(nm.k, op)?, nm.eps)))
        .transpose()
}
