//! Row and column ops: the token embedding (a row gather from the table), zeros, gathered
//! rows, column slices and a mixture of experts' weighted row adds.

use super::{check, host, ComputeError, Data, Device, Result, Tensor, Weight};

impl Device {
    /// `table[tokens[t]] · scale` for every token: `[tokens][table.cols]`.
    pub fn embed(&self, table: &Weight, tokens: &[u32], scale: f32) -> Result<Tensor> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(ComputeError::Shape {
                what: "token id (below the vocabulary size)",
                got: t as usize,
                want: table.rows,
            });
        }
        let data = match self {
            Device::Cpu => Data::Host(host::embed(table.host("embed")?, tokens, scale)),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.embed(table, tokens, scale)?),
        };
        Ok(Tensor {
            rows: tokens.len(),
            cols: table.cols,
            data,
        })
    }

    /// A `rows × cols` tensor of zeros (an accumulator, e.g. for mixture-of-experts outputs).
    pub fn zeros(&self, rows: usize, cols: usize) -> Result<Tensor> {
        let data = match self {
            Device::Cpu => Data::Host(vec![0.0; rows * cols]),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.zeros(rows * cols)?),
        };
        Ok(Tensor { rows, cols, data })
    }

    /// `out[rows[i]] += weights[i] · src[i]` for every row `i` of `src` (PyTorch's weighted
    /// `index_add_`): how a mixture of experts adds each expert's rows back to their tokens.
    /// `rows` must be distinct, so the sum does not depend on the order rows are added in.
    pub fn index_add_rows(
        &self,
        out: &mut Tensor,
        src: &Tensor,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        check(
            "index_add_rows row indices (the source's rows)",
            rows.len(),
            src.rows,
        )?;
        check(
            "index_add_rows weights (the source's rows)",
            weights.len(),
            src.rows,
        )?;
        check(
            "index_add_rows source width (the output's)",
            src.cols,
            out.cols,
        )?;
        let mut seen = vec![false; out.rows];
        for &r in rows {
            if r >= out.rows || std::mem::replace(&mut seen[r], true) {
                return Err(ComputeError::Shape {
                    what: "index_add_rows row (distinct, below the output's rows)",
                    got: r,
                    want: out.rows,
                });
            }
        }
        match self {
            Device::Cpu => {
                let cols = out.cols;
                let (o, s) = (out.host_mut("index_add_rows")?, src.host("index_add_rows")?);
                for ((&r, &w), sr) in rows.iter().zip(weights).zip(s.chunks_exact(cols.max(1))) {
                    for (a, b) in o[r * cols..(r + 1) * cols].iter_mut().zip(sr) {
                        *a += w * b;
                    }
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.index_add_rows(out, src, rows, weights),
        }
    }

    /// Columns `start..start + width` of every row of `x`: `[x.rows][width]`.
    pub fn columns(&self, x: &Tensor, start: usize, width: usize) -> Result<Tensor> {
        if start + width > x.cols {
            return Err(ComputeError::Shape {
                what: "column range end (at most the tensor's columns)",
                got: start + width,
                want: x.cols,
            });
        }
        let data = match self {
            Device::Cpu => Data::Host(
                x.host("columns")?
                    .chunks_exact(x.cols.max(1))
                    .flat_map(|r| r[start..start + width].iter().copied())
                    .collect(),
            ),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.columns(x, start, width)?),
        };
        Ok(Tensor {
            rows: x.rows,
            cols: width,
            data,
        })
    }

    /// The listed rows of `x`, in order.
    pub fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(ComputeError::Shape {
                what: "gathered row (below the tensor's rows)",
                got: r,
                want: x.rows,
            });
        }
        let data = match self {
            Device::Cpu => Data::Host(host::gather_rows(x.host("gather_rows")?, x.cols, rows)),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => Data::Cuda(c.gather_rows(x, rows)?),
        };
        Ok(Tensor {
            rows: rows.len(),
            cols: x.cols,
            data,
        })
    }
}
