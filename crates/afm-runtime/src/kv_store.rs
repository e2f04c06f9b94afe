//! KV storage: one pool of fixed-size blocks per layer, addressed by the engine's block ids.
//!
//! ```text
//! layer.k: [num_blocks][n_kv_heads][block_size][head_dim]   (same for v)
//!           └ block id ┘            └ slot in block ┘
//! token at position p of a sequence → block table[p / block_size], slot p % block_size
//! ```
//! Heads are outside slots so one head's keys in a block are contiguous for attention.
//! Entries are f16 for reduced-precision checkpoints, as llama.cpp stores them (half the memory,
//! and the same rounding, so greedy output agrees with it), and f32 for f32 checkpoints, so those
//! match transformers to f32 precision.
//! The engine owns this storage and its block accounting; models only read and write through it.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::kv_quant::{group_size, Q4Store, Q8Store};

/// Shape of one layer's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerKvShape {
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Element type of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    /// `--kv-bits 8`: group-wise 8-bit (see `kv_quant`).
    Q8,
    /// `--kv-bits 4`: group-wise 4-bit with minimum.
    Q4,
}

impl KvDtype {
    /// Bytes per stored element, scales included.
    fn bytes_per_elem(self, head_dim: usize) -> f64 {
        let g = group_size(head_dim) as f64;
        match self {
            KvDtype::F32 => 4.0,
            KvDtype::F16 => 2.0,
            KvDtype::Q8 => 1.0 + 2.0 / g,
            KvDtype::Q4 => 0.5 + 4.0 / g,
        }
    }
}

enum Store {
    F32(Vec<f32>),
    /// f16 bits: a `Vec<u16>` of zeros is allocated zeroed by the OS, so untouched blocks
    /// cost no resident memory and start-up does not write the whole pool.
    F16(Vec<u16>),
    Q8(Q8Store),
    Q4(Q4Store),
}

impl Store {
    fn new(dtype: KvDtype, n: usize, head_dim: usize) -> Self {
        match dtype {
            KvDtype::F32 => Store::F32(vec![0.0; n]),
            KvDtype::F16 => Store::F16(vec![0u16; n]),
            KvDtype::Q8 => Store::Q8(Q8Store::new(n, group_size(head_dim))),
            KvDtype::Q4 => Store::Q4(Q4Store::new(n, group_size(head_dim))),
        }
    }

    fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            Store::F32(s) => s[at..at + x.len()].copy_from_slice(x),
            Store::F16(s) => s[at..at + x.len()]
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(x),
            Store::Q8(s) => s.write(at, x),
            Store::Q4(s) => s.write(at, x),
        }
    }

    fn read(&self, at: usize, out: &mut [f32]) {
        match self {
            Store::F32(s) => out.copy_from_slice(&s[at..at + out.len()]),
            Store::F16(s) => s[at..at + out.len()]
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(out),
            Store::Q8(s) => s.read(at, out),
            Store::Q4(s) => s.read(at, out),
        }
    }
}

pub struct LayerKv {
    pub shape: LayerKvShape,
    block_size: usize,
    dtype: KvDtype,
    k: Store,
    v: Store,
}

impl LayerKv {
    fn new(shape: LayerKvShape, num_blocks: usize, block_size: usize, dtype: KvDtype) -> Self {
        let n = num_blocks * block_size * shape.n_kv_heads * shape.head_dim;
        Self {
            shape,
            block_size,
            dtype,
            k: Store::new(dtype, n, shape.head_dim),
            v: Store::new(dtype, n, shape.head_dim),
        }
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
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
            self.k.write(o, &k[h * d..(h + 1) * d]);
            self.v.write(o, &v[h * d..(h + 1) * d]);
        }
    }

    /// Keys of `head` in `block`, slots `s0..s0 + out.len() / head_dim`, into `out` as f32.
    pub fn read_keys(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        self.k.read(self.offset(block, s0, head), out);
    }

    pub fn read_values(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        self.v.read(self.offset(block, s0, head), out);
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
    pub fn new(
        shapes: &[LayerKvShape],
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Self {
        let layers = shapes
            .iter()
            .map(|s| LayerKv::new(*s, num_blocks, block_size, dtype))
            .collect();
        Self {
            layers,
            block_size,
            num_blocks,
        }
    }

    /// Bytes one block takes across all layers (for sizing the pool from a memory budget).
    pub fn bytes_per_block(shapes: &[LayerKvShape], block_size: usize, dtype: KvDtype) -> usize {
        shapes
            .iter()
            .map(|s| {
                let elems = 2 * block_size * s.n_kv_heads * s.head_dim;
                (elems as f64 * dtype.bytes_per_elem(s.head_dim)).ceil() as usize
            })
            .sum()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}
