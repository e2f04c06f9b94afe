//! Norms and elementwise ops on activations: RMSNorm (whole rows or per head, fused with a
//! residual add on a GPU), residual add, the gated activation, softcap and scaling.

use super::{check, host, Activation, ComputeError, Data, Device, Result, Tensor, Vector};

impl Device {
    /// `x / rms(x) · w` over every `w.len()` values of `x`: whole rows, or each head when
    /// `w` holds one head's weights.
    pub fn rms_norm(&self, x: &Tensor, w: &Vector, eps: f32) -> Result<Tensor> {
        check_norm(x, w)?;
        let data = match self {
            Device::Cpu => Data::Host(host::rms_norm(
                x.host("rms_norm")?,
                w.host("rms_norm")?,
                eps,
            )),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.rms_norm(x, w, eps)?),
        };
        Ok(Tensor {
            rows: x.rows,
            cols: x.cols,
            data,
        })
    }

    /// [`rms_norm`](Self::rms_norm) in place.
    pub fn rms_norm_in_place(&self, x: &mut Tensor, w: &Vector, eps: f32) -> Result<()> {
        check_norm(x, w)?;
        match self {
            Device::Cpu => {
                crate::ops::rms_norm(x.host_mut("rms_norm")?, w.host("rms_norm")?, eps);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.rms_norm_in_place(x, w, eps),
        }
    }

    /// `x += y`.
    pub fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        check("add operand rows", y.rows, x.rows)?;
        check("add operand columns", y.cols, x.cols)?;
        match self {
            Device::Cpu => {
                crate::ops::add_assign(x.host_mut("add")?, y.host("add")?);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.add_assign(x, y),
        }
    }

    /// `gate ← act(gate) · up`.
    pub fn gated_act(&self, act: Activation, gate: &mut Tensor, up: &Tensor) -> Result<()> {
        check("gated_act up rows", up.rows, gate.rows)?;
        check("gated_act up columns", up.cols, gate.cols)?;
        match self {
            Device::Cpu => {
                crate::ops::gated_act(gate.host_mut("gated_act")?, up.host("gated_act")?, act);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.gated_act(act, gate, up),
        }
    }

    /// `x ← cap · tanh(x / cap)`.
    pub fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        match self {
            Device::Cpu => {
                crate::ops::softcap(x.host_mut("softcap")?, cap);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.softcap(x, cap),
        }
    }

    /// `x ← s · x`.
    pub fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        match self {
            Device::Cpu => {
                x.host_mut("scale")?.iter_mut().for_each(|v| *v *= s);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.scale_in_place(x, s),
        }
    }

    /// `x += y`, then [`rms_norm`](Self::rms_norm) of the sum: one launch on a GPU.
    pub fn add_rms_norm(&self, x: &mut Tensor, y: &Tensor, w: &Vector, eps: f32) -> Result<Tensor> {
        check("add operand rows", y.rows, x.rows)?;
        check("add operand columns", y.cols, x.cols)?;
        check_norm(x, w)?;
        match self {
            Device::Cpu => {
                self.add_assign(x, y)?;
                self.rms_norm(x, w, eps)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Ok(Tensor {
                rows: x.rows,
                cols: x.cols,
                data: Data::Cuda(c.add_rms_norm(x, y, w, eps)?),
            }),
        }
    }
}

pub(super) fn check_norm(x: &Tensor, w: &Vector) -> Result<()> {
    check_norm_width(x.cols, w)
}

/// Rows `cols` wide normalize in groups of the weight's length.
pub(super) fn check_norm_width(cols: usize, w: &Vector) -> Result<()> {
    if w.len == 0 || !cols.is_multiple_of(w.len) {
        return Err(ComputeError::Shape {
            what: "rms_norm row width (a multiple of the weight length)",
            got: cols,
            want: w.len,
        });
    }
    Ok(())
}
