//! Matrix products with the weights: `linear`, several projections of one input at once
//! (`linear_many`), and the gated MLP's first half (`gated_linear`), with their shape checks;
//! and the forms a pre-norm block uses so a GPU can fold its neighbours in: the residual add
//! into the projection's store (`linear_add`) and the RMSNorm into the first products
//! (`norm_linear_many`, `norm_gated_linear`), and Q/K/V as one buffer the attention reads in
//! place (`norm_linear_qkv`). On the CPU they are the plain ops in sequence.

#[cfg(feature = "cuda")]
use super::QkvData;
use super::{
    check, host, Activation, ComputeError, Data, Device, Qkv, Result, Tensor, Vector, Weight,
};
use crate::WeightMatrix;

impl Device {
    /// `y = x · Wᵀ (+ b)`: `[x.rows][w.rows]`.
    pub fn linear(&self, x: &Tensor, w: &Weight, bias: Option<&Vector>) -> Result<Tensor> {
        check_linear(x, w, bias)?;
        let data = match self {
            Device::Cpu => {
                let b = bias.map(|b| b.host("linear bias")).transpose()?;
                Data::Host(host::linear(
                    x.host("linear")?,
                    x.rows,
                    w.host("linear")?,
                    b,
                ))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.linear(x, w, bias)?),
        };
        Ok(Tensor {
            rows: x.rows,
            cols: w.rows,
            data,
        })
    }

    /// `[x·W₀ᵀ, x·W₁ᵀ, …]` (+ each bias): projections of one input (Q, K, V), in one launch on
    /// a GPU where the fused kernel applies; otherwise [`linear`](Self::linear) each.
    pub fn linear_many(
        &self,
        x: &Tensor,
        ws: &[(&Weight, Option<&Vector>)],
    ) -> Result<Vec<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            if ws.iter().all(|(w, b)| b.is_none() && w.cols == x.cols) {
                let plain: Vec<&Weight> = ws.iter().map(|(w, _)| *w).collect();
                if let Some(outs) = c.linear_many(x, &plain)? {
                    return Ok(device_outputs(x.rows, outs, &plain));
                }
            }
        }
        if matches!(self, Device::Cpu) && ws.len() > 1 {
            return self.host_linear_many(x, ws);
        }
        ws.iter().map(|(w, b)| self.linear(x, w, *b)).collect()
    }

    /// `linear_many` on the CPU: one [`WeightMatrix::matmul_many`] (the input quantized once,
    /// one parallel pass), then each bias.
    fn host_linear_many(
        &self,
        x: &Tensor,
        ws: &[(&Weight, Option<&Vector>)],
    ) -> Result<Vec<Tensor>> {
        for (w, b) in ws {
            check_linear(x, w, *b)?;
        }
        let xs = x.host("linear")?;
        let ms = ws
            .iter()
            .map(|(w, _)| w.host("linear"))
            .collect::<Result<Vec<_>>>()?;
        let mut ys: Vec<Vec<f32>> = ms.iter().map(|m| vec![0.0; x.rows * m.rows()]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        WeightMatrix::matmul_many(&ms, xs, x.rows, &mut outs);
        ys.into_iter()
            .zip(ws)
            .map(|(mut y, (w, b))| {
                if let Some(b) = b {
                    crate::ops::add_bias(&mut y, b.host("linear bias")?);
                }
                Ok(Tensor {
                    rows: x.rows,
                    cols: w.rows,
                    data: Data::Host(y),
                })
            })
            .collect()
    }

    /// `act(x·gateᵀ) · (x·upᵀ)`, the first half of a gated MLP: one launch on a GPU where the
    /// fused kernel applies; otherwise [`linear_many`](Self::linear_many) of the two and
    /// [`gated_act`](Self::gated_act).
    pub fn gated_linear(
        &self,
        x: &Tensor,
        gate: &Weight,
        up: &Weight,
        act: Activation,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            if gate.cols == x.cols && up.cols == x.cols && gate.rows == up.rows {
                if let Some(o) = c.gated_linear(x, gate, up, act)? {
                    return Ok(Tensor {
                        rows: x.rows,
                        cols: gate.rows,
                        data: Data::Cuda(o),
                    });
                }
            }
        }
        // One output per weight, so both are there.
        let mut gu = self
            .linear_many(x, &[(gate, None), (up, None)])?
            .into_iter();
        let (Some(mut g), Some(u)) = (gu.next(), gu.next()) else {
            return Err(ComputeError::Shape {
                what: "gated_linear outputs",
                got: 0,
                want: 2,
            });
        };
        self.gated_act(act, &mut g, &u)?;
        Ok(g)
    }
    /// `acc += x · Wᵀ (+ b)`: a residual add folded into the projection (on a GPU the
    /// matmul adds into `acc` in its own store; with a bias, `linear` then an add).
    pub fn linear_add(
        &self,
        x: &Tensor,
        w: &Weight,
        bias: Option<&Vector>,
        acc: &mut Tensor,
    ) -> Result<()> {
        check_linear(x, w, bias)?;
        check("linear_add accumulator rows", acc.rows, x.rows)?;
        check("linear_add accumulator columns", acc.cols, w.rows)?;
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(c), None) = (self, bias) {
            return c.linear_add(x, w, acc);
        }
        let y = self.linear(x, w, bias)?;
        self.add_assign(acc, &y)
    }

    /// [`linear_many`](Self::linear_many) of `rms_norm(x, norm)`: on a GPU the norm is folded
    /// into the product's launches where they are GEMVs (each block sums the squares of x
    /// itself) or quantize x first (one launch for both); otherwise normalized first.
    pub fn norm_linear_many(
        &self,
        x: &Tensor,
        norm: &Vector,
        eps: f32,
        ws: &[(&Weight, Option<&Vector>)],
    ) -> Result<Vec<Tensor>> {
        super::elementwise::check_norm(x, norm)?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            if norm.len == x.cols && ws.iter().all(|(w, b)| b.is_none() && w.cols == x.cols) {
                let plain: Vec<&Weight> = ws.iter().map(|(w, _)| *w).collect();
                if let Some(outs) = c.norm_linear_many(x, (norm, eps), &plain)? {
                    return Ok(device_outputs(x.rows, outs, &plain));
                }
            }
        }
        self.linear_many(&self.rms_norm(x, norm, eps)?, ws)
    }

    /// Q, K and V of `rms_norm(x, norm)` (+ their biases) for
    /// [`attend_prologue`](Self::attend_prologue): [`norm_linear_many`](Self::norm_linear_many)
    /// of the three, except that on a GPU past the GEMV's rows, where the weights lie back to
    /// back ([`weights_joined`]), one GEMM writes one buffer of rows `[q | k | v]` that the
    /// attention reads in place: without biases the same values, without copying them into
    /// three tensors; with them (all three) one bias launch, and the GEMM's sums within
    /// rounding of the three separate GEMMs `norm_linear_many` runs there.
    ///
    /// [`weights_joined`]: Self::weights_joined
    pub fn norm_linear_qkv(
        &self,
        x: &Tensor,
        norm: &Vector,
        eps: f32,
        ws: [(&Weight, Option<&Vector>); 3],
    ) -> Result<Qkv> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            super::elementwise::check_norm(x, norm)?;
            for (w, b) in ws {
                check_linear(x, w, b)?;
            }
            let biases = match ws.map(|(_, b)| b) {
                [Some(bq), Some(bk), Some(bv)] => Some([bq, bk, bv]),
                _ => None,
            };
            // All three biased (Qwen2) or none.
            let unbiased = ws.iter().all(|(_, b)| b.is_none());
            if norm.len == x.cols && (biases.is_some() || unbiased) {
                let plain = ws.map(|(w, _)| w);
                if let Some(buf) = c.linear_qkv_joined(x, Some((norm, eps)), plain, biases)? {
                    return Ok(Qkv {
                        rows: x.rows,
                        widths: plain.map(|w| w.rows),
                        data: QkvData::Joined(buf),
                    });
                }
            }
        }
        let [q, k, v]: [Tensor; 3] = self
            .norm_linear_many(x, norm, eps, &ws)?
            .try_into()
            .map_err(|got: Vec<Tensor>| ComputeError::Shape {
                what: "projections returned by norm_linear_many",
                got: got.len(),
                want: 3,
            })?;
        Qkv::new(q, k, v)
    }

    /// [`gated_linear`](Self::gated_linear) of `rms_norm(x, norm)`, the norm folded in on a
    /// GPU as in [`norm_linear_many`](Self::norm_linear_many).
    pub fn norm_gated_linear(
        &self,
        x: &Tensor,
        norm: &Vector,
        eps: f32,
        gate: &Weight,
        up: &Weight,
        act: Activation,
    ) -> Result<Tensor> {
        super::elementwise::check_norm(x, norm)?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            if norm.len == x.cols
                && gate.cols == x.cols
                && up.cols == x.cols
                && gate.rows == up.rows
            {
                if let Some(o) = c.norm_gated_linear(x, (norm, eps), gate, up, act)? {
                    return Ok(Tensor {
                        rows: x.rows,
                        cols: gate.rows,
                        data: Data::Cuda(o),
                    });
                }
            }
        }
        self.gated_linear(&self.rms_norm(x, norm, eps)?, gate, up, act)
    }

    /// A residual block's gated MLP: `x += down(act(gate(n)) · up(n))`, `n = rms_norm(x,
    /// norm)` ([`norm_gated_linear`](Self::norm_gated_linear) then
    /// [`linear_add`](Self::linear_add)); on a GPU past the GEMV's rows, with 16-bit weights,
    /// one path that hands the GEMMs their inputs in 16 bits directly.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_gated_mlp_add(
        &self,
        x: &mut Tensor,
        norm: &Vector,
        eps: f32,
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        act: Activation,
    ) -> Result<()> {
        super::elementwise::check_norm(x, norm)?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = self {
            let fits = gate.cols == x.cols && up.cols == x.cols && gate.rows == up.rows;
            if fits
                && down.cols == gate.rows
                && down.rows == x.cols
                && c.norm_gated_mlp_add(x, (norm, eps), gate, up, down, act)?
            {
                return Ok(());
            }
        }
        let h = self.norm_gated_linear(x, norm, eps, gate, up, act)?;
        self.linear_add(&h, down, None, x)
    }
}

/// The tensors of one device output per weight (`rows` × that weight's rows each).
#[cfg(feature = "cuda")]
fn device_outputs(
    rows: usize,
    outs: Vec<cudarc::driver::CudaSlice<f32>>,
    ws: &[&Weight],
) -> Vec<Tensor> {
    outs.into_iter()
        .zip(ws)
        .map(|(o, w)| Tensor {
            rows,
            cols: w.rows,
            data: Data::Cuda(o),
        })
        .collect()
}

/// A `linear`'s shapes: the input as wide as the weight's columns, a bias as long as its rows.
fn check_linear(x: &Tensor, w: &Weight, bias: Option<&Vector>) -> Result<()> {
    check("linear input width (the weight's columns)", x.cols, w.cols)?;
    if let Some(b) = bias {
        check("linear bias length (the weight's rows)", b.len, w.rows)?;
    }
    Ok(())
}
