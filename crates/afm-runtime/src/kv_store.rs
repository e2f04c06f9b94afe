//! KV storage: one pool of fixed-size blocks per layer, addressed by the engine's block ids.
//!
//! ```text
//! layer.k: [num_blocks][n_kv_heads][block_size][head_dim]   (same for v)
//!           └ block id ┘            └ slot in block ┘
//! token at position p of a sequence → block table[p / block_size], slot p % block_size
//! ```
//! Heads are outside slots so one head's keys in a block are contiguous for attention.
//! The engine owns this storage and its block accounting; models only read and write through it.

/// Shape of one layer's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerKvShape {
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

pub struct LayerKv {
    pub shape: LayerKvShape,
    block_size: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl LayerKv {
    fn new(shape: LayerKvShape, num_blocks: usize, block_size: usize) -> Self {
        let n = num_blocks * block_size * shape.n_kv_heads * shape.head_dim;
        Self { shape, block_size, k: vec![0.0; n], v: vec![0.0; n] }
    }

    fn offset(&self, block: u32, slot: usize, head: usize) -> usize {
        let d = self.shape.head_dim;
        ((block as usize * self.shape.n_kv_heads + head) * self.block_size + slot) * d
    }

    /// Store K and V (`[n_kv_heads * head_dim]` each) of the token at `pos`.
    pub fn write(&mut self, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let d = self.shape.head_dim;
        let (block, slot) = (table[pos / self.block_size], pos % self.block_size);
        for h in 0..self.shape.n_kv_heads {
            let o = self.offset(block, slot, h);
            self.k[o..o + d].copy_from_slice(&k[h * d..(h + 1) * d]);
            self.v[o..o + d].copy_from_slice(&v[h * d..(h + 1) * d]);
        }
    }

    /// Keys of `head` in `block`, slots `0..n`, as `[n][head_dim]`.
    pub fn keys(&self, block: u32, head: usize, n: usize) -> &[f32] {
        let o = self.offset(block, 0, head);
        &self.k[o..o + n * self.shape.head_dim]
    }

    pub fn values(&self, block: u32, head: usize, n: usize) -> &[f32] {
        let o = self.offset(block, 0, head);
        &self.v[o..o + n * self.shape.head_dim]
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
}

/// The whole cache: one [`LayerKv`] per layer, all with the same block ids.
pub struct KvCache {
    pub layers: Vec<LayerKv>,
    block_size: usize,
    num_blocks: usize,
}

impl KvCache {
    pub fn new(shapes: &[LayerKvShape], num_blocks: usize, block_size: usize) -> Self {
        let layers = shapes.iter().map(|s| LayerKv::new(*s, num_blocks, block_size)).collect();
        Self { layers, block_size, num_blocks }
    }

    /// Bytes one block takes across all layers (for sizing the pool from a memory budget).
    pub fn bytes_per_block(shapes: &[LayerKvShape], block_size: usize) -> usize {
        shapes.iter().map(|s| 2 * block_size * s.n_kv_heads * s.head_dim * 4).sum()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}
