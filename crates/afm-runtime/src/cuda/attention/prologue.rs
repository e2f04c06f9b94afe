//! The step before attention in one launch: per-head Q/K RMSNorm, RoPE and the K/V write.

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{
    check, check_len, launch, AttnBatch, CudaContext, CudaError, DeviceKvCache, KvBuf, Result,
    RopeTable,
};

impl CudaContext {
    /// The attention prologue of layer `layer` in one launch: each `head_dim` head of `q`
    /// (`[rows][n_heads · head_dim]`) and of `k` (`[rows][n_kv_heads · head_dim]`) RMS-normed
    /// with `norms` (one head's weights for q, one for k, and epsilon) when given, then rotated
    /// by `table` at `positions[row]`, in place; then k's and `v`'s rows stored in the cache
    /// as [`kv_write`](Self::kv_write) stores them. The same values as `rms_norm_in_place`,
    /// `rope` and `kv_write` in turn. Positions at or beyond `table.max_pos()` are left
    /// unrotated: callers check them.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prologue(
        &self,
        cache: &mut DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        table: &RopeTable,
        positions: &impl DevicePtr<i32>,
        q: &mut impl DevicePtrMut<f32>,
        n_heads: usize,
        k: &mut impl DevicePtrMut<f32>,
        v: &impl DevicePtr<f32>,
        norms: Option<(&CudaView<'_, f32>, &CudaView<'_, f32>, f32)>,
    ) -> Result<()> {
        let kv = cache.layers.get(layer).ok_or(CudaError::Shape {
            what: "KV layer index",
            got: layer,
            want: cache.layers.len(),
        })?;
        let (d, nkv, n) = (kv.shape.head_dim, kv.shape.n_kv_heads, batch.n_rows);
        if d == 0 || d > PROLOGUE_MAX_HEAD_DIM {
            return Err(CudaError::Unsupported {
                what: "attention prologue head_dim",
                value: d.to_string(),
                supported: "1 to 512",
            });
        }
        if table.dims() > d {
            return Err(CudaError::Shape {
                what: "rope head_dim (at least the rotated dims)",
                got: d,
                want: table.dims(),
            });
        }
        if n == 0 {
            return Ok(());
        }
        check("attention prologue queries", q.len(), n * n_heads * d)?;
        check("attention prologue keys", k.len(), n * nkv * d)?;
        check("attention prologue values", v.len(), n * nkv * d)?;
        check_len("attention prologue positions", positions.len(), n)?;
        let (qw, kw, eps) = match norms {
            Some((qn, kn, eps)) => {
                check("attention prologue q_norm weights (head_dim)", qn.len(), d)?;
                check("attention prologue k_norm weights (head_dim)", kn.len(), d)?;
                (self.ptr(qn), self.ptr(kn), eps)
            }
            None => (0, 0, 0.0),
        };
        let (cs, neox) = table.kernel_table(self);
        let args = PrologueArgs {
            n_heads: n_heads as i32,
            n_kv_heads: nkv as i32,
            d: d as i32,
            dims: table.dims() as i32,
            neox: neox as i32,
            max_pos: table.max_pos() as i32,
            block_size: cache.block_size as i32,
            max_blocks: batch.max_blocks as i32,
            q_stride: (n_heads * d) as i32,
            k_stride: (nkv * d) as i32,
            v_stride: (nkv * d) as i32,
            eps,
            v4: 0,
        };
        let (qp, kp, vp) = (self.ptr_mut(q), self.ptr_mut(k), self.ptr(v));
        // The per-head norms take rms_norm_warp's float4 path where it would (same bits).
        let v4 = |x: u64, w: u64| {
            i32::from(d.is_multiple_of(4) && x.is_multiple_of(16) && w.is_multiple_of(16))
        };
        let args = PrologueArgs {
            v4: v4(qp, qw) | (v4(kp, kw) << 1),
            ..args
        };
        let (kc, vc, pp) = (kv.k.ptr(self), kv.v.ptr(self), self.ptr(positions));
        let (tab, seqs, rows, _) = batch.ptrs(self);
        let groups = (n_heads + nkv).div_ceil(PROLOGUE_WARPS);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, groups as u32, 1),
            block_dim: (32 * PROLOGUE_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match kv.k {
            KvBuf::F32(_) => "attn_prologue_f32",
            KvBuf::F16(_) => "attn_prologue_f16",
        };
        let f = self.kernel(name)?;
        launch!(self, f, cfg; qp, kp, vp, kc, vc, qw, kw, pp, cs, tab, seqs, rows, args)
    }
}

/// `PRO_WARPS` and `PRO_MAX_D` in attention.cu: heads per prologue block, widest head.
const PROLOGUE_WARPS: usize = 8;
const PROLOGUE_MAX_HEAD_DIM: usize = 512;

/// Mirror of `PrologueArgs` in attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct PrologueArgs {
    n_heads: i32,
    n_kv_heads: i32,
    d: i32,
    dims: i32,
    neox: i32,
    max_pos: i32,
    block_size: i32,
    max_blocks: i32,
    q_stride: i32,
    k_stride: i32,
    v_stride: i32,
    eps: f32,
    v4: i32,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct.
unsafe impl cudarc::driver::DeviceRepr for PrologueArgs {}
