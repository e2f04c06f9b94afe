//! A launch's by-product handed to the launch after it through the context: the tensor-core
//! decode attention's bf16 copy of its output, read by the 16-bit O product after it instead
//! of converting the f32 output in a launch of its own (3.1 µs a layer at 64 streams of
//! Qwen3-8B, bench/RESULTS.md session 22; on by default, `AFM_ATTN_HALF=0` turns it off:
//! +1.3% at 64 streams of Qwen3-8B, session 23). The copy is that conversion's bits.
//!
//! A [`PreparedHalf`] is taken only by a product that reads the same values right after the
//! launch that made it: [`launched`] counts every launch and cuBLAS call and every copy into
//! device memory, and a count that moved leaves the copy unused (the product converts as
//! usual).
//!
//! Tried with this hand-over and not kept (sessions 22–23): the RMSNorm between a residual
//! product and the normed product after it folded into their skinny epilogues
//! (`AFM_NORM_FOLD`, the producer writing `half(x ⊙ w)` and per-tile row sums of squares, the
//! consumer scaling its rows): 3% slower at 32 and 64 streams of Qwen3-8B than the two norm
//! launches it saved (bench/RESULTS.md session 23).

use std::sync::atomic::{AtomicU64, Ordering};

use super::context::{scratch, CudaContext};
use super::skinny::{skinny_on, SKINNY_ROWS};
use super::Result;
use crate::switch::Switch;

/// Launches so far (process-wide: a launch on another context only makes a hand-over be
/// refused, never wrongly taken).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Counts one launch, cuBLAS call or device write ([`PreparedHalf`]'s staleness check).
pub(crate) fn launched() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Whether the tensor-core decode attention writes a bf16 copy of its output for the O
/// product (`AFM_ATTN_HALF`, on).
fn attn_half_on() -> bool {
    static ON: Switch = Switch::new("AFM_ATTN_HALF", true);
    ON.on()
}

/// A bf16 copy at `buf` (the workspace's `half_x`) of the `len` f32 values at `x`, made by
/// the launch that wrote them.
pub(crate) struct PreparedHalf {
    x: u64,
    buf: u64,
    len: usize,
    at: u64,
}

impl CudaContext {
    /// Forgets a copy no product took.
    pub fn clear_prepared(&mut self) {
        self.prepared_half = None;
    }

    /// Whether the decode attention writes a bf16 copy of its output, over `AFM_ATTN_HALF`
    /// (`None`: the switch decides); tests and benchmarks.
    pub fn set_attn_half(&mut self, on: Option<bool>) {
        self.attn_half = on;
    }

    /// Where the bf16 copy of a decode attention output of `rows` rows, `len` values, goes
    /// when a 16-bit product may read it next (the copy on, the skinny GEMM's rows): the
    /// workspace's `half_x`, which that product would otherwise convert its input into, so the
    /// copy costs no buffer of its own; else `None`. The Q/K/V product before the attention
    /// read its input from `half_x` too; the attention writes the copy after its PDL wait,
    /// which returns once that product has completed.
    pub(super) fn half_twin(&mut self, rows: usize, len: usize) -> Result<Option<u64>> {
        let on = self.attn_half.unwrap_or_else(attn_half_on);
        if !(on && skinny_on() && SKINNY_ROWS.contains(&rows)) {
            return Ok(None);
        }
        let stream = self.stream().clone();
        Ok(Some(scratch(&stream, &mut self.ws.half_x, len)?))
    }

    /// Records `buf`, just written by the last launch, as the bf16 copy of the `len` f32
    /// values at `x`.
    pub(super) fn set_prepared_half(&mut self, x: u64, buf: u64, len: usize) {
        self.prepared_half = Some(PreparedHalf {
            x,
            buf,
            len,
            at: launches(),
        });
    }

    /// The bf16 copy of the `len` f32 values at `x` if the last launch made it. Nothing ran
    /// in between (the launch count), so nothing else wrote or regrew `half_x` either.
    pub(super) fn take_prepared_half(&mut self, x: u64, len: usize) -> Option<u64> {
        let p = self.prepared_half.take()?;
        if p.x != x || p.len != len || p.at != launches() {
            return None;
        }
        self.half_copies += 1;
        Some(p.buf)
    }

    /// 16-bit products so far that read the decode attention's bf16 copy of their input.
    pub fn attn_half_copies(&self) -> u64 {
        self.half_copies
    }
}
