//! Element-wise and per-row ops on device activations: RMSNorm (optionally fused with the
//! residual add), RoPE from a cos/sin table, gated activations, residual add, softcap and
//! embedding lookups. Same formulas as `crate::ops`; shapes are checked before each launch.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{check, check_len, launch, CudaContext, CudaError, DeviceWeight, Result};
use crate::ops::{Rope, RopeStyle};
use crate::DType;

/// The activation of a gated MLP (`act(gate) · up`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    /// The kernels' `act` argument (elementwise.cu, gemv.cu, mmq.cu, mmh.cu): 0 SiLU, 1 GELU.
    pub(super) fn code(self) -> i32 {
        match self {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
        }
    }
}

/// `n` threads in blocks of `threads`.
pub(super) fn grid_1d(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u64).div_ceil(threads as u64).max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows of this width or less get a warp each (16 floats per lane); wider rows a block each.
const WARP_ROW_MAX: usize = 512;

/// float4 units when every row starts 16-byte aligned (the kernels hold 16 floats per thread in
/// registers either way; see elementwise.cu).
fn norm_v4(d: usize, ptrs: &[u64]) -> i32 {
    i32::from(d.is_multiple_of(4) && ptrs.iter().all(|p| p.is_multiple_of(16)))
}

/// One block per row of `d`, sized to the row.
fn norm_block_cfg(rows: i32, d: usize, v4: i32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (norm_block_threads(d, v4 != 0), 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads of the block that normalizes one row of `d` floats: two units (float4s, or floats
/// when `v4` is off) per thread, so all of the row's loads are in flight at once from
/// registers (64 threads at least, 1024 at most; wider rows go through registers in chunks).
fn norm_block_threads(d: usize, v4: bool) -> u32 {
    let units = if v4 { d / 4 } else { d };
    units.div_ceil(2).next_multiple_of(32).clamp(64, 1024) as u32
}

/// cos/sin of every rotated pair at every position below `max_pos`, taken from the CPU
/// [`Rope`] itself (so scaling variants and rounding match it bit for bit):
/// `[max_pos][dims / 2][cos, sin]`, `mscale` folded in.
pub struct RopeTable {
    cs: CudaSlice<f32>,
    dims: usize,
    style: RopeStyle,
    max_pos: usize,
}

impl RopeTable {
    /// `dims` and `style` must be the ones `rope` was built with.
    pub fn from_cpu(
        ctx: &CudaContext,
        rope: &Rope,
        dims: usize,
        style: RopeStyle,
        max_pos: usize,
    ) -> Result<Self> {
        if dims == 0 || !dims.is_multiple_of(2) {
            return Err(CudaError::Unsupported {
                what: "rotary dims",
                value: dims.to_string(),
                supported: "a positive even number",
            });
        }
        let half = dims / 2;
        let pair = |i: usize| match style {
            RopeStyle::Neox => (i, i + half),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        };
        let mut cs = Vec::with_capacity(max_pos * dims);
        let mut v = vec![0f32; dims];
        for pos in 0..max_pos {
            v.fill(0.0);
            (0..half).for_each(|i| v[pair(i).0] = 1.0);
            // Rotating (1, 0) yields (cos, sin) exactly: x0·c − 0·s = c and x0·s + 0·c = s.
            rope.apply(&mut v, dims, pos);
            for i in 0..half {
                let (a, b) = pair(i);
                cs.push(v[a]);
                cs.push(v[b]);
            }
        }
        Ok(Self {
            cs: ctx.upload(&cs)?,
            dims,
            style,
            max_pos,
        })
    }

    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Rotated dimensions per head.
    pub fn dims(&self) -> usize {
        self.dims
    }

    /// The table's device address and whether pairs are NeoX halves (else interleaved).
    pub(super) fn kernel_table(&self, ctx: &CudaContext) -> (u64, bool) {
        (ctx.ptr(&self.cs), self.style == RopeStyle::Neox)
    }
}

impl CudaContext {
    /// `out = x / rms(x) · w` for each row of `w.len()` values (per-head norms: `w` is one
    /// head's weights and the rows are heads).
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        eps: f32,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check_len("rms_norm output", out.len(), x.len())?;
        let (xp, op) = (self.ptr(x), self.ptr_mut(out));
        self.norm(xp, 0, w, eps, op, x.len())
    }

    /// [`rms_norm`](Self::rms_norm) with `x` as the output.
    pub fn rms_norm_in_place(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        w: &impl DevicePtr<f32>,
        eps: f32,
    ) -> Result<()> {
        let xp = self.ptr_mut(x);
        self.norm(xp, 0, w, eps, xp, x.len())
    }

    /// The residual step of a block: `x += res`, then `out = rms_norm(x)`.
    pub fn add_rms_norm(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        res: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        eps: f32,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check_len("add_rms_norm residual", res.len(), x.len())?;
        check_len("add_rms_norm output", out.len(), x.len())?;
        let (xp, rp, op) = (self.ptr_mut(x), self.ptr(res), self.ptr_mut(out));
        self.norm(xp, rp, w, eps, op, x.len())
    }

    fn norm(
        &self,
        x: u64,
        res: u64,
        w: &impl DevicePtr<f32>,
        eps: f32,
        out: u64,
        len: usize,
    ) -> Result<()> {
        let d = w.len();
        check_norm_rows(len, d)?;
        let (rows, wp) = ((len / d) as i32, self.ptr(w));
        let di = d as i32;
        let v4 = norm_v4(d, &[x, res, wp, out]);
        if d <= WARP_ROW_MAX {
            let f = self.kernel("rms_norm_warp")?;
            launch!(self, f, grid_1d(len / d * 32, 256); x, res, wp, out, rows, di, eps, v4)
        } else {
            let f = self.kernel("rms_norm_block")?;
            launch!(self, f, norm_block_cfg(rows, d, v4); x, res, wp, out, rows, di, eps, v4)
        }
    }

    /// `out = rms_norm(x)` rounded to 16 bits (bf16 when `bf16`, else f16) for `len / d` rows of
    /// `d` (the weight at `w`): a 16-bit GEMM's input in one launch, bit-equal to
    /// [`rms_norm`](Self::rms_norm) then `f32_to_bf16` / `f32_to_f16`. Device addresses; the
    /// callers checked the lengths.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_half(
        &self,
        x: u64,
        w: u64,
        d: usize,
        eps: f32,
        out: u64,
        len: usize,
        bf16: bool,
    ) -> Result<()> {
        check_norm_rows(len, d)?;
        let (rows, di, ty) = ((len / d) as i32, d as i32, if bf16 { 1i32 } else { 2 });
        // 8-byte stores of four 16-bit values need the same alignment as the f32 side's float4s.
        let v4 = norm_v4(d, &[x, w, out]);
        if d <= WARP_ROW_MAX {
            let f = self.kernel("rms_norm_warp_h")?;
            launch!(self, f, grid_1d(len / d * 32, 256); x, w, out, rows, di, eps, v4, ty)
        } else {
            let f = self.kernel("rms_norm_block_h")?;
            launch!(self, f, norm_block_cfg(rows, d, v4); x, w, out, rows, di, eps, v4, ty)
        }
    }

    /// Rotates the first `table` dims of each of `n_heads` heads (`head_dim` apart, starting at
    /// the start of each token's row of `row_stride` floats) at `positions[t]`, in place.
    /// Positions at or beyond `table.max_pos()` are left unrotated: callers check them.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        table: &RopeTable,
        x: &mut impl DevicePtrMut<f32>,
        positions: &impl DevicePtr<i32>,
        n_heads: usize,
        head_dim: usize,
        row_stride: usize,
    ) -> Result<()> {
        let n_tokens = positions.len();
        if table.dims > head_dim {
            return Err(CudaError::Shape {
                what: "rope head_dim (at least the rotated dims)",
                got: head_dim,
                want: table.dims,
            });
        }
        check_len("rope row_stride", row_stride, n_heads * head_dim)?;
        if n_tokens > 0 {
            check_len(
                "rope input",
                x.len(),
                (n_tokens - 1) * row_stride + n_heads * head_dim,
            )?;
        }
        let (xp, pp, cp) = (self.ptr_mut(x), self.ptr(positions), self.ptr(&table.cs));
        let neox = (table.style == RopeStyle::Neox) as i32;
        let (nt, nh, hd, rs) = (
            n_tokens as i32,
            n_heads as i32,
            head_dim as i32,
            row_stride as i32,
        );
        let (dims, maxp) = (table.dims as i32, table.max_pos as i32);
        let f = self.kernel("rope")?;
        let cfg = grid_1d(n_tokens * n_heads * table.dims / 2, 256);
        launch!(self, f, cfg; xp, pp, cp, nt, nh, hd, rs, dims, neox, maxp)
    }

    /// `out[r][c] = act(gate[r·stride + c]) · up[r·stride + c]` for `n` rows of `ff`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_act(
        &self,
        act: Activation,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        n: usize,
        ff: usize,
        stride: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (gp, upp) = (self.ptr(gate), self.ptr(up));
        self.gated(act, gp, gate.len(), upp, up.len(), n, ff, stride, out)
    }

    /// The same on one `[n][2·ff]` buffer holding gate then up (a fused gate_up projection).
    pub fn gated_act_fused(
        &self,
        act: Activation,
        gate_up: &impl DevicePtr<f32>,
        n: usize,
        ff: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check_len("gated_act_fused input", gate_up.len(), n * 2 * ff)?;
        let gp = self.ptr(gate_up);
        let len = gate_up.len() - ff;
        self.gated(act, gp, len, gp + 4 * ff as u64, len, n, ff, 2 * ff, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn gated(
        &self,
        act: Activation,
        gp: u64,
        g_len: usize,
        upp: u64,
        u_len: usize,
        n: usize,
        ff: usize,
        stride: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_len("gated_act stride", stride, ff)?;
        let need = (n - 1) * stride + ff;
        check_len("gated_act gate", g_len, need)?;
        check_len("gated_act up", u_len, need)?;
        check_len("gated_act output", out.len(), n * ff)?;
        let op = self.ptr_mut(out);
        let (ni, ffi, si) = (n as i32, ff as i32, stride as i32);
        let a = act.code();
        // float4 columns where rows stay 16-byte aligned (see elementwise.cu).
        let v4 = ff.is_multiple_of(4)
            && stride.is_multiple_of(4)
            && [gp, upp, op].iter().all(|p| p.is_multiple_of(16))
            && n * ff / 4 < i32::MAX as usize;
        let threads = if v4 { n * ff / 4 } else { n * ff };
        let f = self.kernel("gated_act")?;
        let v4 = i32::from(v4);
        launch!(self, f, grid_1d(threads, 256); gp, upp, op, ni, ffi, si, a, v4)
    }

    /// `out[r][c] = act(gate[r·stride + c]) · up[r·stride + c]` for `n` rows of `ff`, rounded
    /// to bf16 (`bf16`) or f16 into `out`: bit-equal to [`gated_act`](Self::gated_act) then
    /// `f32_to_bf16` / `f32_to_f16`. Device addresses; the caller checked the lengths.
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_act_half(
        &self,
        act: Activation,
        gate: u64,
        up: u64,
        n: usize,
        ff: usize,
        stride: usize,
        out: u64,
        bf16: bool,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_len("gated_act stride", stride, ff)?;
        let v4 = ff.is_multiple_of(4)
            && stride.is_multiple_of(4)
            && [gate, up, out].iter().all(|p| p.is_multiple_of(16))
            && n * ff / 4 < i32::MAX as usize;
        let threads = if v4 { n * ff / 4 } else { n * ff };
        let (ni, ffi, si, a) = (n as i32, ff as i32, stride as i32, act.code());
        let (v4, ty) = (i32::from(v4), if bf16 { 1i32 } else { 2 });
        let f = self.kernel("gated_act_h")?;
        launch!(self, f, grid_1d(threads, 256); gate, up, out, ni, ffi, si, a, v4, ty)
    }

    /// `x += y`.
    pub fn add_assign(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
    ) -> Result<()> {
        check("add_assign operand length", y.len(), x.len())?;
        let (n, xp, yp) = (x.len() as i64, self.ptr_mut(x), self.ptr(y));
        let f = self.kernel("add_f32")?;
        launch!(self, f, grid_1d(n as usize, 256); xp, yp, n)
    }

    /// `x ← cap · tanh(x / cap)`.
    pub fn softcap(&self, x: &mut impl DevicePtrMut<f32>, cap: f32) -> Result<()> {
        let (n, xp) = (x.len() as i64, self.ptr_mut(x));
        let f = self.kernel("softcap_f32")?;
        launch!(self, f, grid_1d(n as usize, 256); xp, n, cap)
    }

    /// `out[t] = table[ids[t]]` as f32, for f32/f16/bf16/Q8_0/Q4_K/Q6_K tables.
    pub fn embed(
        &self,
        table: &DeviceWeight,
        ids: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let name = match table.dtype() {
            DType::F32 => "embed_f32",
            DType::F16 => "embed_f16",
            DType::BF16 => "embed_bf16",
            DType::Q8_0 => "embed_q8_0",
            DType::Q4K => "embed_q4_k",
            DType::Q6K => "embed_q6_k",
            other => {
                return Err(CudaError::Unsupported {
                    what: "embedding table type",
                    value: other.name().into(),
                    supported: "F32, F16, BF16, Q8_0, Q4_K, Q6_K",
                })
            }
        };
        let (n, dim) = (ids.len(), table.cols());
        check_len("embed output", out.len(), n * dim)?;
        if n == 0 {
            return Ok(());
        }
        let (tp, ip, op) = (self.weight_ptr(table), self.ptr(ids), self.ptr_mut(out));
        let (ni, di, rb, vocab) = (
            n as i32,
            dim as i32,
            table.row_bytes() as i64,
            table.rows() as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.kernel(name)?;
        launch!(self, f, cfg; tp, ip, op, ni, di, rb, vocab)
    }
}

/// RMSNorm's input is whole rows of the weight's length `d`.
fn check_norm_rows(len: usize, d: usize) -> Result<()> {
    if d == 0 || !len.is_multiple_of(d) {
        return Err(CudaError::Shape {
            what: "rms_norm input length (a multiple of the weight length)",
            got: len,
            want: d,
        });
    }
    Ok(())
}
