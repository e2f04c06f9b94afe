//! Next-token choice on the device: greedy argmax and afm-engine's top-k/top-p/min-p draw
//! (see `kernels/sampling.cu`). Only `n` token ids come back; the uniform draws `u` come from
//! the caller's seeded RNG, so a seed reproduces a run.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::context::scratch;
use super::{check_len, launch, CudaContext, Result};

/// One row's sampling settings. `temperature <= 0` is greedy; `top_k = 0`, `top_p = 1` and
/// `min_p = 0` switch those filters off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// The uniform draw in [0, 1) for this row.
    pub u: f32,
}

/// A change to one logit of one row before sampling: `l ← rep(l + bias) − subtract`, where
/// `rep` divides positive logits and multiplies negative ones (1 = off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitAdjust {
    pub row: usize,
    pub token: u32,
    pub bias: f32,
    pub repetition: f32,
    pub subtract: f32,
}

fn rows_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaContext {
    /// `out[i]` = index of the largest logit of row `i` (the lowest index among ties).
    pub fn argmax(
        &self,
        logits: &impl DevicePtr<f32>,
        vocab: usize,
        out: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        let n = logits.len().checked_div(vocab).unwrap_or(0);
        check_len("argmax output", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (lp, op, v) = (self.ptr(logits), self.ptr_mut(out), vocab as i32);
        let f = self.kernel("argmax_rows")?;
        launch!(self, f, rows_cfg(n); lp, op, v)
    }

    /// Applies bias and penalties to rows of `logits` in place (each `(row, token)` once).
    pub fn adjust_logits(
        &mut self,
        logits: &mut impl DevicePtrMut<f32>,
        vocab: usize,
        adjust: &[LogitAdjust],
    ) -> Result<()> {
        if adjust.is_empty() {
            return Ok(());
        }
        let rows = logits.len().checked_div(vocab).unwrap_or(0);
        if let Some(a) = adjust.iter().find(|a| a.row >= rows) {
            return Err(super::CudaError::Shape {
                what: "adjusted logits row",
                got: a.row,
                want: rows,
            });
        }
        let host: Vec<i32> = adjust
            .iter()
            .flat_map(|a| {
                [
                    a.row as i32,
                    a.token as i32,
                    a.bias.to_bits() as i32,
                    a.repetition.to_bits() as i32,
                    a.subtract.to_bits() as i32,
                ]
            })
            .collect();
        let entries = self.upload(&host)?;
        let (lp, ep, n, v) = (
            self.ptr_mut(logits),
            self.ptr(&entries),
            adjust.len() as i32,
            vocab as i32,
        );
        let f = self.kernel("adjust_logits")?;
        launch!(self, f, super::ops::grid_1d(adjust.len(), 128); lp, ep, n, v)
    }

    /// Draws one token per row of `logits` (`params.len()` rows of `vocab`).
    pub fn sample(
        &mut self,
        logits: &impl DevicePtr<f32>,
        vocab: usize,
        params: &[SampleParams],
        out: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        let n = params.len();
        check_len("sample logits", logits.len(), n * vocab)?;
        check_len("sample output", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let host: Vec<f32> = params
            .iter()
            .flat_map(|p| {
                let k = p.top_k.min(1 << 24) as f32; // exact in f32
                [p.temperature, k, p.top_p, p.min_p, p.u]
            })
            .collect();
        let stream = self.stream().clone();
        let pp = scratch(&stream, &mut self.ws.sample, host.len())?;
        let buf = self.ws.sample.as_mut().expect("allocated by scratch");
        stream.memcpy_htod(&host, buf)?;
        let (lp, op, v) = (self.ptr(logits), self.ptr_mut(out), vocab as i32);
        let f = self.kernel("sample_rows")?;
        launch!(self, f, rows_cfg(n); lp, pp, op, v)
    }
}
