//! The RMSNorm folded across two skinny products (`AFM_NORM_FOLD=1`; off by default: not yet
//! measured on a GPU).
//!
//! At 9..64 rows a residual block's products are skinny GEMMs (`skinny.rs`), and between the
//! residual product (O, or down, adding into the stream x) and the normed product after it
//! (gate+up, or the next layer's Q/K/V) runs an RMSNorm launch: 4.6 µs each, twice a layer, at
//! 64 streams of Qwen3-8B (bench/RESULTS.md, session 22), where a layer is ~163 µs. With the
//! fold the residual product's epilogue, which holds the new x, also writes the next norm's
//! 16-bit input `half(x ⊙ w)` and each tile's row sums of squares ("prep"), and the normed
//! product scales each row of its result by `1 / sqrt(mean(x²) + eps)`, summed from those
//! partials in tile order ("scale"). No launch between them; the result moves by rounding
//! only: `half(x · s · w) · W` becomes `half(x · w) · W · s`.
//!
//! The hand-over is a [`PreparedNorm`] in the context, taken by the next normed product only if
//! it reads the same x with the same norm and nothing was launched in between ([`launched`]
//! counts every launch and cuBLAS call, and every copy into device memory); anything else
//! leaves it unused and the normed product normalizes as usual.
//!
//! `AFM_ATTN_HALF=1` (off by default, not yet measured) hands over the same way a bf16 copy
//! of the decode attention's output ([`PreparedHalf`], written by the tensor-core decode
//! kernel beside its f32 output) to the O product after it, whose input conversion launch
//! (3.1 µs a layer in the same profile) then goes; the copy is the conversion's bits.

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::CudaSlice;

use super::context::CudaContext;
use super::matmul::NormArg;
use super::skinny::{skinny_on, skinny_plan, SkinnyArgs, SkinnyFold, SkinnyPlan, SKINNY_ROWS};
use super::Result;
use crate::switch::Switch;

/// Whether residual products prepare the next norm's input (`AFM_NORM_FOLD=1`).
pub(crate) fn norm_fold_on() -> bool {
    static ON: Switch = Switch::new("AFM_NORM_FOLD", false);
    ON.on()
}

/// Launches so far (process-wide: a launch on another context only makes a hand-over be
/// refused, never wrongly taken).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Counts one launch, cuBLAS call or device write ([`PreparedNorm`]'s staleness check).
pub(crate) fn launched() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// A residual product's output prepared for `rms_norm(x, norm)`: `x16 = half(x ⊙ norm)` and
/// `pss[t][c]`, row c's sum of squares over tile t's columns (64 rows a tile).
pub(crate) struct PreparedNorm {
    x: u64,
    n: usize,
    cols: usize,
    norm: u64,
    eps: f32,
    bf16: bool,
    x16: CudaSlice<u16>,
    pss: CudaSlice<f32>,
    tiles: usize,
    /// [`launches`] right after the residual product.
    at: u64,
}

/// Whether the tensor-core decode attention writes a bf16 copy of its output for the O
/// product (`AFM_ATTN_HALF=1`).
fn attn_half_on() -> bool {
    static ON: Switch = Switch::new("AFM_ATTN_HALF", true);
    ON.on()
}

/// A bf16 copy of the f32 values at `x` (as many as `buf` holds), made by the launch that
/// wrote them.
pub(crate) struct PreparedHalf {
    x: u64,
    buf: CudaSlice<u16>,
    at: u64,
}

impl CudaContext {
    /// Whether residual products prepare the next norm, over `AFM_NORM_FOLD` (`None`: the
    /// switch decides); tests and benchmarks.
    pub fn set_norm_fold(&mut self, on: Option<bool>) {
        self.norm_fold = on;
    }

    /// Drops the hand-overs no product took, and the one the last product read (their
    /// buffers freed in stream order).
    pub fn clear_prepared(&mut self) {
        self.prepared = None;
        self.prepared_half = None;
        self.half_held = None;
    }

    /// Whether the decode attention writes a bf16 copy of its output, over `AFM_ATTN_HALF`
    /// (`None`: the switch decides); tests and benchmarks.
    pub fn set_attn_half(&mut self, on: Option<bool>) {
        self.attn_half = on;
    }

    /// A buffer for the bf16 copy of a decode attention output of `rows` rows, `len` values,
    /// where a 16-bit product may read it next (the copy on, the skinny GEMM's rows); `None`.
    pub(super) fn half_twin(&self, rows: usize, len: usize) -> Result<Option<CudaSlice<u16>>> {
        let on = self.attn_half.unwrap_or_else(attn_half_on);
        if !(on && skinny_on() && SKINNY_ROWS.contains(&rows)) {
            return Ok(None);
        }
        Ok(Some(self.alloc::<u16>(len)?))
    }

    /// Records `buf`, just written by the last launch, as the bf16 copy of the f32 values at `x`.
    pub(super) fn set_prepared_half(&mut self, x: u64, buf: CudaSlice<u16>) {
        self.prepared_half = Some(PreparedHalf {
            x,
            buf,
            at: launches(),
        });
    }

    /// The bf16 copy of the `len` f32 values at `x` if the last launch made it (kept in the
    /// context until the next hand-over, so it outlives the launch that reads it).
    pub(super) fn take_prepared_half(&mut self, x: u64, len: usize) -> Option<u64> {
        let p = self.prepared_half.take()?;
        if p.x != x || p.buf.len() != len || p.at != launches() {
            return None;
        }
        let at = self.ptr(&p.buf);
        self.half_held = Some(p);
        self.half_copies += 1;
        Some(at)
    }

    /// 16-bit products so far that read the decode attention's bf16 copy of their input.
    pub fn attn_half_copies(&self) -> u64 {
        self.half_copies
    }

    /// Normed products so far that took a residual product's preparation.
    pub fn norm_folds(&self) -> u64 {
        self.norm_folds
    }

    /// The skinny plan of a residual product that can prepare the next norm: the fold on, the
    /// skinny GEMM on and chosen automatically, 9..64 rows, a plan for the shape.
    pub(super) fn prep_plan(&self, rows: usize, cols: usize, n: usize) -> Option<SkinnyPlan> {
        let auto = matches!(self.gemm_choice, super::skinny::GemmChoice::Auto);
        let on = self.norm_fold.unwrap_or_else(norm_fold_on);
        if !(on && skinny_on() && auto && SKINNY_ROWS.contains(&n)) {
            return None;
        }
        skinny_plan(rows, cols, self.info().sm_count)
    }

    /// `out += hx · Wᵀ` (out: `n` × `rows` f32, the residual stream; hx: 16-bit, `n` × `cols`)
    /// through the skinny GEMM with `plan`, preparing `next`'s input; `false` (nothing
    /// launched) if the kernel cannot run the plan.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn residual_prep(
        &mut self,
        (w, hx, out): (u64, u64, u64),
        rows: usize,
        cols: usize,
        n: usize,
        bf16: bool,
        plan: SkinnyPlan,
        next: NormArg,
    ) -> Result<bool> {
        let tiles = rows.div_ceil(32 * plan.warps);
        let mut x16 = self.alloc::<u16>(n * rows)?;
        let mut pss = self.alloc::<f32>(tiles * 64)?;
        let fold = SkinnyFold {
            nw: next.w,
            x16: self.ptr_mut(&mut x16),
            pss: self.ptr_mut(&mut pss),
            ..SkinnyFold::default()
        };
        let args = SkinnyArgs {
            w,
            x: hx,
            out,
            rows,
            cols,
            n,
            ldc: rows,
            accumulate: true,
            bf16,
            gated: None,
            fold,
        };
        if !self.skinny_with(args, plan)? {
            return Ok(false);
        }
        self.prepared = Some(PreparedNorm {
            x: out,
            n,
            cols: rows,
            norm: next.w,
            eps: next.eps,
            bf16,
            x16,
            pss,
            tiles,
            at: launches(),
        });
        Ok(true)
    }

    /// The prepared input of `rms_norm(x, norm)` for `n` rows of `cols` at `x`, if the last
    /// launch prepared exactly that; any earlier preparation is dropped either way.
    pub(super) fn take_prepared(
        &mut self,
        x: u64,
        n: usize,
        cols: usize,
        norm: NormArg,
        bf16: bool,
    ) -> Option<PreparedNorm> {
        let p = self.prepared.take()?;
        let same = p.x == x
            && p.n == n
            && p.cols == cols
            && p.norm == norm.w
            && p.eps.to_bits() == norm.eps.to_bits()
            && p.bf16 == bf16
            && p.at == launches();
        self.norm_folds += u64::from(same);
        same.then_some(p)
    }
}

impl PreparedNorm {
    /// The normed product's input: `half(x ⊙ norm)`.
    pub(super) fn x16(&self, ctx: &CudaContext) -> u64 {
        ctx.ptr(&self.x16)
    }

    /// The "scale" arguments of the normed product reading [`x16`](Self::x16).
    pub(super) fn scale(&self, ctx: &CudaContext) -> SkinnyFold {
        SkinnyFold {
            rss: ctx.ptr(&self.pss),
            rtiles: self.tiles as i32,
            k: self.cols as i32,
            eps: self.eps,
            ..SkinnyFold::default()
        }
    }
}
