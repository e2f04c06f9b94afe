//! A weight matrix in its storage type, and `y = x · Wᵀ` against it.
//!
//! Layout: `rows` output features × `cols` input features, row-major, each row a whole number
//! of blocks of `dtype` (checked once in `new`).

use crate::{quant, DType, RuntimeError, WeightBytes};

#[derive(Clone, Debug)]
pub struct WeightMatrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: WeightBytes,
}

impl WeightMatrix {
    pub fn new(dtype: DType, rows: usize, cols: usize, bytes: WeightBytes) -> Result<Self, RuntimeError> {
        let row = dtype.row_bytes(cols).ok_or(RuntimeError::RowNotBlockAligned {
            dtype: dtype.name(),
            cols,
            block: dtype.block_elems(),
        })?;
        let want = row * rows;
        if bytes.len() != want {
            return Err(RuntimeError::SizeMismatch {
                dtype: dtype.name(),
                rows,
                cols,
                want,
                got: bytes.len(),
            });
        }
        Ok(Self { dtype, rows, cols, bytes })
    }

    /// An f32 matrix from values (tests, converted weights).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols, "from_f32: values do not fill the shape");
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self { dtype: DType::F32, rows, cols, bytes: WeightBytes::from_vec(bytes) }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn bytes(&self) -> &WeightBytes {
        &self.bytes
    }

    fn row_slice(&self, r: usize) -> &[u8] {
        let rb = self.dtype.row_bytes(self.cols).expect("checked in new");
        &self.bytes.as_slice()[r * rb..(r + 1) * rb]
    }

    /// Row `r` as f32 (embedding lookups).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        quant::dequantize_row(self.dtype, self.row_slice(r), &mut out[..self.cols]);
    }

    /// `out[i, r] = Σ_c x[i, c] · W[r, c]` for `n` input rows: x is `[n, cols]`, out `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "matmul: input shape");
        assert_eq!(out.len(), n * self.rows, "matmul: output shape");
        let mut w = vec![0f32; self.cols];
        for r in 0..self.rows {
            self.dequantize_row(r, &mut w);
            for i in 0..n {
                let xi = &x[i * self.cols..(i + 1) * self.cols];
                out[i * self.rows + r] = xi.iter().zip(&w).map(|(a, b)| a * b).sum();
            }
        }
    }
}
