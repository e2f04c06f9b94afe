//! Host computation on device tensors, for ops that have no kernel of their own yet (the
//! recurrent and routing steps of hybrid and MoE models): on the CPU the closure reads the
//! tensors in place; on a GPU the inputs are downloaded and the result uploaded, which is
//! correct but slow, and said so once at first use.

use std::borrow::Cow;

use super::{check, Data, Device, Result, Tensor};

impl Device {
    /// `f(inputs' values)` as a `[rows][cols]` tensor on this device. `f` must return exactly
    /// `rows · cols` values.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] // `op` names the GPU notice
    pub fn host_compute(
        &self,
        op: &'static str,
        inputs: &[&Tensor],
        rows: usize,
        cols: usize,
        f: impl FnOnce(&[&[f32]]) -> Result<Vec<f32>>,
    ) -> Result<Tensor> {
        let mut host: Vec<Cow<[f32]>> = Vec::with_capacity(inputs.len());
        for t in inputs {
            host.push(match &t.data {
                Data::Host(v) => Cow::Borrowed(v.as_slice()),
                #[cfg(feature = "cuda")]
                Data::Cuda(b) => match self {
                    Device::Cuda(c) => {
                        warn_once(op);
                        Cow::Owned(c.download(b, t.rows * t.cols)?)
                    }
                    Device::Cpu => return Err(super::wrong(op, "cuda", "cpu")),
                },
            });
        }
        let views: Vec<&[f32]> = host.iter().map(|c| c.as_ref()).collect();
        let out = f(&views)?;
        check("host_compute result (rows × cols)", out.len(), rows * cols)?;
        let data = match self {
            Device::Cpu => Data::Host(out),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.upload(&out)?),
        };
        Ok(Tensor { rows, cols, data })
    }
}

#[cfg(feature = "cuda")]
fn warn_once(op: &'static str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        eprintln!("[Device] {op} and other recurrent/MoE steps have no CUDA kernel yet: computed on the host (slow)")
    });
}
