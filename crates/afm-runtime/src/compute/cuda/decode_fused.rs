//! The CUDA arm of `compute::decode_fused`: checks that a model and step fit the persistent
//! kernel (`crate::cuda::decode_fused`), packs the layers' device addresses, and keeps one
//! device state per (shape, addresses) for the device's lifetime.
//!
//! States are never freed: a CUDA graph captured over one bakes its addresses. They are built
//! outside graph capture only (the graphs' uncaptured warm-up builds them); a capture that
//! finds none runs the layer loop into the graph instead.

use cudarc::driver::sys::CUstreamCaptureStatus;

use super::{ptr, ptr_mut, view_mut, CudaDevice, Result};
use crate::compute::decode_fused::{FusedDecoder, FusedLayer};
use crate::compute::{
    Activation, ComputeError, KvData, KvPool, RotaryData, Step, StepData, Tensor, Vector,
    VectorData, Weight, WeightData,
};
use crate::cuda::{CudaContext, DeviceKvCache, FusedShape, FusedState, LAYER_FIELDS};
use crate::kv_store::KvDtype;
use crate::DType;

/// Most states kept (models × KV pools a process decodes with); past it, the layer loop.
const MAX_STATES: usize = 8;

#[derive(Default)]
pub(super) struct FusedStates {
    states: Vec<FusedState>,
    /// Shapes the device cannot run (asked once).
    refused: Vec<FusedShape>,
}

/// A device weight of 16-bit storage, with its shape checked: its address.
fn weight16(ctx: &CudaContext, w: &Weight, rows: usize, cols: usize, bf16: bool) -> Option<u64> {
    let WeightData::Cuda(d) = &w.data else {
        return None;
    };
    let want = if bf16 { DType::BF16 } else { DType::F16 };
    let fits = d.dtype() == want && d.rows() == rows && d.cols() == cols;
    fits.then(|| ctx.weight_ptr(d))
}

fn vector_at(ctx: &CudaContext, v: &Vector, len: usize) -> Option<u64> {
    match &v.data {
        VectorData::Cuda(b) if v.len == len => Some(ptr(ctx, b)),
        _ => None,
    }
}

/// The kernel's shape for `m` over `hidden`-wide activations, when it has one.
fn shape_of(m: &FusedDecoder, hidden: usize) -> Option<FusedShape> {
    let first = m.layers.first()?;
    let bf16 = match first.q.dtype() {
        DType::BF16 => true,
        DType::F16 => false,
        _ => return None,
    };
    let (d, nh, nkv, inter) = (m.head_dim, m.n_heads, m.n_kv_heads, first.gate.rows());
    let eps = first.input_norm.1;
    let qk_eps = first.qk_norm.map_or(0.0, |n| n.eps);
    let uniform = m.layers.iter().all(|l| {
        l.input_norm.1 == eps
            && l.post_norm.1 == eps
            && l.qk_norm.is_some() == first.qk_norm.is_some()
            && l.qk_norm.map_or(0.0, |n| n.eps) == qk_eps
            && l.gate.rows() == inter
    });
    let widths = [hidden, nh * d, nkv * d, inter];
    let fits = matches!(d, 64 | 128)
        && nkv > 0
        && nh.is_multiple_of(nkv)
        && widths.iter().all(|w| *w > 0 && w.is_multiple_of(8));
    (uniform && fits).then_some(FusedShape {
        n_layers: m.layers.len(),
        hidden,
        inter,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: d,
        bf16,
        act: match m.act {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
        },
        eps,
        qk_eps,
        scale: m.scale,
    })
}

/// One layer's addresses in the kernel's order (`L_*` in decode_fused.cu).
fn layer_row(
    ctx: &CudaContext,
    s: &FusedShape,
    l: &FusedLayer,
    kv: (u64, u64),
) -> Option<[u64; LAYER_FIELDS]> {
    let (h, d, f) = (s.hidden, s.head_dim, s.inter);
    let (nq, nk) = (s.n_heads * d, s.n_kv_heads * d);
    let w = |w: &Weight, rows, cols| weight16(ctx, w, rows, cols, s.bf16);
    let (qn, kn) = match l.qk_norm {
        Some(n) => (vector_at(ctx, n.q, d)?, vector_at(ctx, n.k, d)?),
        None => (0, 0),
    };
    let (bq, bk, bv) = match l.qkv_bias {
        Some([q, k, v]) => (
            vector_at(ctx, q, nq)?,
            vector_at(ctx, k, nk)?,
            vector_at(ctx, v, nk)?,
        ),
        None => (0, 0, 0),
    };
    Some([
        w(l.q, nq, h)?,
        w(l.k, nk, h)?,
        w(l.v, nk, h)?,
        w(l.o, h, nq)?,
        w(l.gate, f, h)?,
        w(l.up, f, h)?,
        w(l.down, h, f)?,
        vector_at(ctx, l.input_norm.0, h)?,
        vector_at(ctx, l.post_norm.0, h)?,
        qn,
        kn,
        bq,
        bk,
        bv,
        kv.0,
        kv.1,
    ])
}

/// Every layer's addresses, when the cache has the model's layers in f16.
fn layer_table(
    ctx: &CudaContext,
    s: &FusedShape,
    m: &FusedDecoder,
    cache: &DeviceKvCache,
) -> Option<Vec<u64>> {
    if cache.layers.len() != m.layers.len() {
        return None;
    }
    let mut table = Vec::with_capacity(m.layers.len() * LAYER_FIELDS);
    for (l, c) in m.layers.iter().zip(&cache.layers) {
        let fits = c.dtype() == KvDtype::F16
            && c.shape.head_dim == s.head_dim
            && c.shape.n_kv_heads == s.n_kv_heads;
        if !fits {
            return None;
        }
        table.extend(layer_row(ctx, s, l, c.addresses(ctx))?);
    }
    Some(table)
}

impl CudaDevice {
    pub(in crate::compute) fn fused_decode(
        &self,
        m: &FusedDecoder,
        x: &mut Tensor,
        kv: &mut KvPool,
        step: &Step,
    ) -> Result<bool> {
        let one_token = step.seqs.len() == 1 && step.n_rows() == 1 && x.rows == 1;
        let (KvData::Cuda(cache), StepData::Cuda { attn, .. }, RotaryData::Cuda(rope)) =
            (&kv.data, &step.data, &m.rope.data)
        else {
            return Ok(false);
        };
        let Some(shape) = shape_of(m, x.cols).filter(|_| one_token) else {
            return Ok(false);
        };
        if rope.dims() > shape.head_dim {
            return Ok(false);
        }
        if let Some(&p) = step.positions.iter().find(|&&p| p >= rope.max_pos()) {
            return Err(ComputeError::Shape {
                what: "position (below the rotary table's length, the model's context)",
                got: p,
                want: rope.max_pos(),
            });
        }
        let ctx = self.lock();
        let Some(table) = layer_table(&ctx, &shape, m, cache) else {
            return Ok(false);
        };
        let mut fused = self.fused.lock().unwrap_or_else(|e| e.into_inner());
        if fused.refused.contains(&shape) {
            return Ok(false);
        }
        let at = match fused.states.iter().position(|s| s.serves(&shape, &table)) {
            Some(i) => i,
            None => {
                let capturing = ctx
                    .stream()
                    .capture_status()
                    .map_err(crate::cuda::CudaError::from)?
                    != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                if capturing || fused.states.len() >= MAX_STATES {
                    return Ok(false);
                }
                match ctx.fused_decode_state(shape, &table) {
                    Ok(Some(s)) => {
                        fused.states.push(s);
                        fused.states.len() - 1
                    }
                    Ok(None) => {
                        fused.refused.push(shape);
                        return Ok(false);
                    }
                    Err(e) => {
                        eprintln!("[CUDA] no fused decode step ({e}); using the layer loop");
                        fused.refused.push(shape);
                        return Ok(false);
                    }
                }
            }
        };
        let xp = ptr_mut(&ctx, &mut view_mut(x, "fused_decode")?);
        // A launch the driver refuses (resources) leaves the device usable: take the layer
        // loop from now on. Faults inside the kernel surface later, as any kernel's would.
        if let Err(e) = ctx.fused_decode(&fused.states[at], xp, attn, rope, cache.block_size()) {
            eprintln!("[CUDA] the fused decode step did not launch ({e}); using the layer loop");
            fused.refused.push(shape);
            return Ok(false);
        }
        Ok(true)
    }
}
