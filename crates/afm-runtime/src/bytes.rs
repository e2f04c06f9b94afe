//! A cheap, cloneable view of immutable bytes: a slice of a memory-mapped file or an owned buffer.
//! Weights stay where the loader put them (for GGUF: in the mapping), so nothing is copied twice.

use std::sync::Arc;

#[derive(Clone)]
pub struct WeightBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    offset: usize,
    len: usize,
}

impl WeightBytes {
    /// Bytes owned by this value (converted or generated weights).
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        Self {
            owner: Arc::new(v),
            offset: 0,
            len,
        }
    }

    /// `len` bytes at `offset` inside `owner`; `None` when the range does not fit.
    pub fn slice_of(
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        offset: usize,
        len: usize,
    ) -> Option<Self> {
        let end = offset.checked_add(len)?;
        if end > (*owner).as_ref().len() {
            return None;
        }
        Some(Self { owner, offset, len })
    }

    /// `len` bytes at `offset` within these bytes, sharing the owner (one expert of a stacked
    /// expert tensor); `None` when the range does not fit.
    pub fn sub(&self, offset: usize, len: usize) -> Option<Self> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        Some(Self {
            owner: self.owner.clone(),
            offset: self.offset + offset,
            len,
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.offset..self.offset + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes at {})", self.len, self.offset)
    }
}
