//! Weight matrices on the device, in their storage type: one allocation each, or 16-bit
//! matrices of one width back to back in one allocation, so that products sharing an input
//! run as one GEMM over all their rows (`matmul.rs`).

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::{CudaContext, Result};
use crate::switch::Switch;
use crate::{DType, WeightMatrix};

/// A weight matrix copied to the device in its storage type (rows × cols, row-major): its own
/// allocation, or a view of one shared with the matrices uploaded beside it
/// ([`upload_joined`](Self::upload_joined)).
#[derive(Clone)]
pub struct DeviceWeight {
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    bytes: Arc<CudaSlice<u8>>,
    /// Where this matrix starts in `bytes`, and its length, in bytes.
    offset: usize,
    len: usize,
}

impl DeviceWeight {
    /// Whether `self` and `other` are views of one device allocation
    /// ([`upload_joined`](Self::upload_joined)); separate uploads may still lie back to back.
    pub fn shares_allocation(&self, other: &DeviceWeight) -> bool {
        Arc::ptr_eq(&self.bytes, &other.bytes)
    }

    pub fn upload(ctx: &CudaContext, w: &WeightMatrix) -> Result<Self> {
        let len = w.bytes().as_slice().len();
        Ok(Self {
            dtype: w.dtype(),
            rows: w.rows(),
            cols: w.cols(),
            bytes: Arc::new(ctx.upload(w.bytes().as_slice())?),
            offset: 0,
            len,
        })
    }

    /// Matrices of one 16-bit type and width placed back to back in one allocation, so that
    /// products sharing an input (Q/K/V, gate and up) can run as one GEMM over the rows of all
    /// of them ([`joined`]); each result is a view. Other matrices (quantized blocks, whose
    /// kernels want their own alignment) are uploaded one by one.
    pub fn upload_joined(ctx: &CudaContext, ws: &[&WeightMatrix]) -> Result<Vec<Self>> {
        let Some(first) = ws.first() else {
            return Ok(Vec::new());
        };
        let joinable = matches!(first.dtype(), DType::BF16 | DType::F16)
            && ws
                .iter()
                .all(|w| w.dtype() == first.dtype() && w.cols() == first.cols())
            && (2 * first.cols()).is_multiple_of(16);
        static JOIN: Switch = Switch::new("AFM_JOIN_WEIGHTS", true);
        // `AFM_JOIN_WEIGHTS=0`: one allocation each (A/B of the joined GEMMs).
        let on = JOIN.on();
        if !joinable || ws.len() < 2 || !on {
            return ws.iter().map(|w| Self::upload(ctx, w)).collect();
        }
        let mut all = Vec::with_capacity(ws.iter().map(|w| w.bytes().as_slice().len()).sum());
        for w in ws {
            all.extend_from_slice(w.bytes().as_slice());
        }
        let bytes = Arc::new(ctx.upload(&all)?);
        let mut offset = 0;
        Ok(ws
            .iter()
            .map(|w| {
                let len = w.bytes().as_slice().len();
                offset += len;
                Self {
                    dtype: w.dtype(),
                    rows: w.rows(),
                    cols: w.cols(),
                    bytes: bytes.clone(),
                    offset: offset - len,
                    len,
                }
            })
            .collect())
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
    /// Bytes of this matrix on the device (not of the allocation it may share).
    pub fn byte_len(&self) -> usize {
        self.len
    }
    pub fn row_bytes(&self) -> usize {
        self.dtype
            .row_bytes(self.cols)
            .expect("checked by WeightMatrix::new")
    }
}

/// One view over `ws` where they lie back to back in one allocation, in order, with one type
/// and width ([`DeviceWeight::upload_joined`]): their products are then one GEMM's rows.
pub(super) fn joined(ws: &[&DeviceWeight]) -> Option<DeviceWeight> {
    let first = ws.first()?;
    let mut end = first.offset;
    for w in ws {
        let adjacent = Arc::ptr_eq(&w.bytes, &first.bytes) && w.offset == end;
        if !adjacent || w.dtype != first.dtype || w.cols != first.cols {
            return None;
        }
        end += w.len;
    }
    Some(DeviceWeight {
        rows: ws.iter().map(|w| w.rows).sum(),
        len: end - first.offset,
        ..(*first).clone()
    })
}

impl CudaContext {
    /// The device address of a weight matrix's first byte.
    pub fn weight_ptr(&self, w: &DeviceWeight) -> u64 {
        self.ptr(&*w.bytes) + w.offset as u64
    }
}
