//! The step before attention in one launch: per-head Q/K RMSNorm, RoPE and the K/V write;
//! and that step with the attention itself ([`CudaContext::attend_prologue`]): one launch of
//! the decode kernel's prologue twin (`attn_dec_pro_*`) where a step is all decode rows. Its
//! inputs are three buffers, or one of rows `[q | k | v]` read in place with that row's stride
//! ([`CudaContext::attend_prologue_joined`]; the kernels take q, k and v strides).

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{
    attention_layer, check, check_attention_rows, check_len, fused_prologue_on, launch, AttnBatch,
    CudaContext, CudaError, DeviceKvCache, KvBuf, Result, RopeTable,
};
use crate::attention::AttnParams;

/// The norms of [`CudaContext::attn_prologue`]: q's and k's one-head weights, and epsilon.
pub type HeadNorms<'a, 'b> = (&'a CudaView<'b, f32>, &'a CudaView<'b, f32>, f32);

/// A checked prologue's arguments and device addresses.
struct Prologue {
    args: PrologueArgs,
    q: u64,
    k: u64,
    v: u64,
    kc: u64,
    vc: u64,
    qw: u64,
    kw: u64,
    pos: u64,
    cs: u64,
}

/// Where the prologue reads its q, k and v rows: three buffers of packed rows, or one buffer
/// of rows `[q | k | v]` (a joined Q/K/V product, [`CudaContext::matmul_joined`]), each part
/// read and written in place with the joined row's stride. Addresses and lengths (elements).
#[derive(Clone, Copy)]
enum Rows {
    Separate {
        q: (u64, usize),
        k: (u64, usize),
        v: (u64, usize),
    },
    Joined((u64, usize)),
}

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
        norms: Option<HeadNorms>,
    ) -> Result<()> {
        let rows = self.separate_rows(q, k, v);
        let pro = self.prologue(cache, layer, batch, table, positions, n_heads, rows, norms)?;
        match pro {
            Some(pro) => self.launch_prologue(cache, layer, batch, n_heads, pro),
            None => Ok(()),
        }
    }

    /// [`attn_prologue`](Self::attn_prologue) (with `p.n_heads` query heads) followed by
    /// [`paged_attention`](Self::paged_attention) of the rotated q into `out`
    /// (`[rows][n_heads · head_dim]`, both strides the row width), with the same results, bit
    /// for bit. When every row is a decode row of a decode kernel (f16 cache, head_dim 64,
    /// 128 or 256: the SIMT one, or the tensor-core one for many sequences) and
    /// `AFM_ATTN_FUSED_PRO` is not `0`, it is one launch of that kernel's prologue twin
    /// (`attn_dec_pro_*`, `attn_dec_mma_pro_*`), which leaves `q` and `k` as they came
    /// (raw); otherwise the two launches, which leave them normed and rotated. So afterwards
    /// q and k hold either: callers must not read them. Returns whether it was one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_prologue(
        &mut self,
        cache: &mut DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        table: &RopeTable,
        positions: &impl DevicePtr<i32>,
        q: &mut (impl DevicePtrMut<f32> + DevicePtr<f32>),
        k: &mut impl DevicePtrMut<f32>,
        v: &impl DevicePtr<f32>,
        norms: Option<HeadNorms>,
        p: &AttnParams,
        out: &mut impl DevicePtrMut<f32>,
        splits: Option<usize>,
    ) -> Result<bool> {
        let rows = self.separate_rows(q, k, v);
        let width = p.n_heads * p.head_dim;
        let step = PrologueStep {
            table,
            positions,
            norms,
        };
        self.attend_prologue_rows(cache, layer, batch, step, rows, &*q, width, p, out, splits)
    }

    /// [`attend_prologue`](Self::attend_prologue) of the rows of one buffer `qkv`, each
    /// `[q | k | v]` (`n_heads · head_dim`, then `n_kv_heads · head_dim` twice: a joined
    /// Q/K/V product, [`matmul_joined`](Self::matmul_joined)), read in place with that row's
    /// stride rather than copied into three buffers first. The same results, bit for bit, as
    /// `attend_prologue` of the three parts; afterwards the q and k parts hold either their
    /// raw or their normed and rotated values, as there.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_prologue_joined(
        &mut self,
        cache: &mut DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        table: &RopeTable,
        positions: &impl DevicePtr<i32>,
        qkv: &mut (impl DevicePtrMut<f32> + DevicePtr<f32>),
        norms: Option<HeadNorms>,
        p: &AttnParams,
        out: &mut impl DevicePtrMut<f32>,
        splits: Option<usize>,
    ) -> Result<bool> {
        let rows = Rows::Joined((self.ptr_mut(qkv), qkv.len()));
        // The row stride: q's width and two key widths (the cache's; checked by `prologue`).
        let nkv = cache.layers.get(layer).map_or(0, |l| l.shape.n_kv_heads);
        let stride = (p.n_heads + 2 * nkv) * p.head_dim;
        let step = PrologueStep {
            table,
            positions,
            norms,
        };
        self.attend_prologue_rows(
            cache, layer, batch, step, rows, &*qkv, stride, p, out, splits,
        )
    }

    fn separate_rows(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        v: &impl DevicePtr<f32>,
    ) -> Rows {
        Rows::Separate {
            q: (self.ptr_mut(q), q.len()),
            k: (self.ptr_mut(k), k.len()),
            v: (self.ptr(v), v.len()),
        }
    }

    /// `attend_prologue` of `rows`; `q` is the buffer of q's first row, `q_stride` its row
    /// stride (for the unfused attention launch).
    #[allow(clippy::too_many_arguments)]
    fn attend_prologue_rows(
        &mut self,
        cache: &mut DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        step: PrologueStep<impl DevicePtr<i32>>,
        rows: Rows,
        q: &impl DevicePtr<f32>,
        q_stride: usize,
        p: &AttnParams,
        out: &mut impl DevicePtrMut<f32>,
        splits: Option<usize>,
    ) -> Result<bool> {
        let nh = p.n_heads;
        let width = nh * p.head_dim;
        let PrologueStep {
            table,
            positions,
            norms,
        } = step;
        // The separate path's checks, all before anything launches.
        attention_layer(cache, layer, batch, p)?;
        let Some(pro) = self.prologue(cache, layer, batch, table, positions, nh, rows, norms)?
        else {
            return Ok(false);
        };
        check_attention_rows(batch, p, q_stride, q.len(), width, out.len())?;
        let kv = &cache.layers[layer];
        let l = self.simt_launch(
            kv,
            cache.block_size,
            batch,
            batch.tiles,
            p,
            q_stride,
            width,
            splits,
        );
        let fused = fused_prologue_on()
            && batch.qb == 1
            && batch.mma_tiles == 0
            && l.decode
            && matches!(kv.k, KvBuf::F16(_));
        if !fused {
            self.launch_prologue(cache, layer, batch, nh, pro)?;
            self.paged_attention(cache, layer, batch, q, q_stride, p, out, width, splits)?;
            return Ok(false);
        }
        let (ws, done) = self.split_scratch(batch, p, &l)?;
        let pr = DecPro {
            k: pro.k,
            v: pro.v,
            qw: pro.qw,
            kw: pro.kw,
            cs: pro.cs,
            pos: pro.pos,
            dims: pro.args.dims,
            neox: pro.args.neox,
            max_pos: pro.args.max_pos,
            k_stride: pro.args.k_stride,
            v_stride: pro.args.v_stride,
            v4: pro.args.v4,
            eps: pro.args.eps,
        };
        let (qp, op, kc, vc) = (pro.q, self.ptr_mut(out), pro.kc, pro.vc);
        if l.mma {
            let (bs, qo) = (cache.block_size, (qp, q_stride));
            let w = (op, width);
            // A bf16 copy for the O product after it, where one may take it (handover.rs).
            let twin = self.half_twin(out.len() / width, out.len())?;
            let tp = twin.unwrap_or(0);
            self.launch_dec_mma(kv, bs, batch, &l, qo, p, w, (ws, done), Some(pr), tp)?;
            if let Some(b) = twin {
                self.set_prepared_half(op, b, out.len());
            }
            return Ok(true);
        }
        let (tab, seqs, _, tiles) = batch.ptrs(self);
        let (d, gh) = (p.head_dim, batch.gh);
        let f = self.kernel(&format!("attn_dec_pro_f16_{d}_{gh}"))?;
        let (args, z, cfg) = self.dec_cluster_launch(f, &l);
        launch!(self, f, cfg, cluster = z; qp, kc, vc, tab, seqs, tiles, op, ws, done, args, pr)?;
        Ok(true)
    }

    /// The prologue kernel's launch, for checked arguments.
    fn launch_prologue(
        &self,
        cache: &DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        n_heads: usize,
        pro: Prologue,
    ) -> Result<()> {
        let (n, nkv) = (batch.n_rows, pro.args.n_kv_heads as usize);
        let groups = (n_heads + nkv).div_ceil(PROLOGUE_WARPS);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, groups as u32, 1),
            block_dim: (32 * PROLOGUE_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match cache.layers[layer].k {
            KvBuf::F32(_) => "attn_prologue_f32",
            KvBuf::F16(_) => "attn_prologue_f16",
        };
        let f = self.kernel(name)?;
        let Prologue {
            args,
            q: qp,
            k: kp,
            v: vp,
            kc,
            vc,
            qw,
            kw,
            pos: pp,
            cs,
        } = pro;
        let (tab, seqs, rows, _) = batch.ptrs(self);
        launch!(self, f, cfg; qp, kp, vp, kc, vc, qw, kw, pp, cs, tab, seqs, rows, args)
    }

    /// The prologue's checks and arguments (`None`: no rows).
    #[allow(clippy::too_many_arguments)]
    fn prologue(
        &self,
        cache: &DeviceKvCache,
        layer: usize,
        batch: &AttnBatch,
        table: &RopeTable,
        positions: &impl DevicePtr<i32>,
        n_heads: usize,
        rows: Rows,
        norms: Option<HeadNorms>,
    ) -> Result<Option<Prologue>> {
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
            return Ok(None);
        }
        let (qw_, kw_) = (n_heads * d, nkv * d);
        // Addresses and row strides of q, k and v.
        let ([qp, kp, vp], [qs, ks, vs]) = match rows {
            Rows::Separate { q, k, v } => {
                check("attention prologue queries", q.1, n * qw_)?;
                check("attention prologue keys", k.1, n * kw_)?;
                check("attention prologue values", v.1, n * kw_)?;
                ([q.0, k.0, v.0], [qw_, kw_, kw_])
            }
            Rows::Joined((p, len)) => {
                let s = qw_ + 2 * kw_;
                check("attention prologue joined q | k | v rows", len, n * s)?;
                ([p, p + 4 * qw_ as u64, p + 4 * (qw_ + kw_) as u64], [s; 3])
            }
        };
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
        // The per-head norms take rms_norm_warp's float4 path where it would (same bits):
        // every head of every row 16-byte aligned.
        let v4 = |x: u64, stride: usize, w: u64| {
            i32::from(
                d.is_multiple_of(4)
                    && stride.is_multiple_of(4)
                    && x.is_multiple_of(16)
                    && w.is_multiple_of(16),
            )
        };
        let args = PrologueArgs {
            n_heads: n_heads as i32,
            n_kv_heads: nkv as i32,
            d: d as i32,
            dims: table.dims() as i32,
            neox: neox as i32,
            max_pos: table.max_pos() as i32,
            block_size: cache.block_size as i32,
            max_blocks: batch.max_blocks as i32,
            q_stride: qs as i32,
            k_stride: ks as i32,
            v_stride: vs as i32,
            eps,
            v4: v4(qp, qs, qw) | (v4(kp, ks, kw) << 1),
        };
        Ok(Some(Prologue {
            args,
            q: qp,
            k: kp,
            v: vp,
            kc: kv.k.ptr(self),
            vc: kv.v.ptr(self),
            qw,
            kw,
            pos: self.ptr(positions),
            cs,
        }))
    }
}

/// The step-level inputs of a prologue: the rotary table, each row's position, the head norms.
struct PrologueStep<'a, 'b, 'c, P> {
    table: &'a RopeTable,
    positions: &'a P,
    norms: Option<HeadNorms<'b, 'c>>,
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

/// Mirror of `DecPro` in common.cuh (the fused kernels' prologue inputs).
#[repr(C)]
#[derive(Clone, Copy)]
pub(in crate::cuda) struct DecPro {
    k: u64,
    v: u64,
    qw: u64,
    kw: u64,
    cs: u64,
    pos: u64,
    dims: i32,
    neox: i32,
    max_pos: i32,
    k_stride: i32,
    v_stride: i32,
    v4: i32,
    eps: f32,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct (six pointers, seven 4-byte
// fields, tail padding to 8 on both sides).
unsafe impl cudarc::driver::DeviceRepr for DecPro {}
