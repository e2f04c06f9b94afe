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
//! match transformers to f32 precision. `--kv-bits 8|4` stores blocks quantized instead, in
//! `kv_quant`'s per-block layout (same block ids, same reads).
//! The engine owns this storage and its block accounting; models only read and write through it.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::kv_quant::{Bits, QuantLayer, QuantShape};

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
    /// `--kv-bits 8`: keys 8-bit per channel within a block, values per token (`kv_quant`).
    Q8,
    /// `--kv-bits 4`: the same layout with 4-bit codes.
    Q4,
}

impl KvDtype {
    /// The quantized code width, for the `--kv-bits` types.
    fn bits(self) -> Option<Bits> {
        match self {
            KvDtype::Q8 => Some(Bits::Eight),
            KvDtype::Q4 => Some(Bits::Four),
            KvDtype::F32 | KvDtype::F16 => None,
        }
    }
}

/// One layer's K and V in one of the [`KvDtype`]s.
enum Store {
    F32 {
        k: Vec<f32>,
        v: Vec<f32>,
    },
    /// f16 bits: a `Vec<u16>` of zeros is allocated zeroed by the OS, so untouched blocks
    /// cost no resident memory and start-up does not write the whole pool.
    F16 {
        k: Vec<u16>,
        v: Vec<u16>,
    },
    /// `--kv-bits`: quantized per block (see `kv_quant`).
    Quant(QuantLayer),
}

pub struct LayerKv {
    pub shape: LayerKvShape,
    block_size: usize,
    dtype: KvDtype,
    store: Store,
}

impl LayerKv {
    fn new(shape: LayerKvShape, num_blocks: usize, block_size: usize, dtype: KvDtype) -> Self {
        let n = num_blocks * block_size * shape.n_kv_heads * shape.head_dim;
        let store = match dtype.bits() {
            Some(bits) => Store::Quant(QuantLayer::new(
                quant_shape(shape, num_blocks, block_size),
                bits,
            )),
            None if dtype == KvDtype::F32 => Store::F32 {
                k: vec![0.0; n],
                v: vec![0.0; n],
            },
            None => Store::F16 {
                k: vec![0; n],
                v: vec![0; n],
            },
        };
        Self {
            shape,
            block_size,
            dtype,
            store,
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
        let (n_kv, bs) = (self.shape.n_kv_heads, self.block_size);
        let offsets = (0..n_kv).map(|h| ((block as usize * n_kv + h) * bs + slot) * d);
        match &mut self.store {
            Store::Quant(q) => q.write(block, slot, pos < bs, k, v),
            Store::F32 { k: ks, v: vs } => {
                for (h, o) in offsets.enumerate() {
                    ks[o..o + d].copy_from_slice(&k[h * d..(h + 1) * d]);
                    vs[o..o + d].copy_from_slice(&v[h * d..(h + 1) * d]);
                }
            }
            Store::F16 { k: ks, v: vs } => {
                for (h, o) in offsets.enumerate() {
                    to_f16(&mut ks[o..o + d], &k[h * d..(h + 1) * d]);
                    to_f16(&mut vs[o..o + d], &v[h * d..(h + 1) * d]);
                }
            }
        }
    }

    /// Keys of `head` in `block`, slots `s0..s0 + out.len() / head_dim`, into `out` as f32.
    pub fn read_keys(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        let o = self.offset(block, s0, head);
        match &self.store {
            Store::Quant(q) => q.read_keys(block, head, s0, out),
            Store::F32 { k, .. } => out.copy_from_slice(&k[o..o + out.len()]),
            Store::F16 { k, .. } => {
                crate::ops::f16_to_f32(k[o..o + out.len()].reinterpret_cast::<f16>(), out)
            }
        }
    }

    pub fn read_values(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        let o = self.offset(block, s0, head);
        match &self.store {
            Store::Quant(q) => q.read_values(block, head, s0, out),
            Store::F32 { v, .. } => out.copy_from_slice(&v[o..o + out.len()]),
            Store::F16 { v, .. } => {
                crate::ops::f16_to_f32(v[o..o + out.len()].reinterpret_cast::<f16>(), out)
            }
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// With an f16 cache, `head`'s keys and values in `block` as stored (`[slot][head_dim]`
    /// each, every slot of the block), for attention to read without a converted copy.
    pub fn f16_head(&self, block: u32, head: usize) -> Option<(&[f16], &[f16])> {
        let o = self.offset(block, 0, head);
        let len = self.block_size * self.shape.head_dim;
        match &self.store {
            Store::F16 { k, v } => Some((
                k[o..o + len].reinterpret_cast::<f16>(),
                v[o..o + len].reinterpret_cast::<f16>(),
            )),
            Store::F32 { .. } | Store::Quant(_) => None,
        }
    }
}

fn quant_shape(shape: LayerKvShape, num_blocks: usize, block_size: usize) -> QuantShape {
    QuantShape {
        num_blocks,
        block_size,
        n_kv_heads: shape.n_kv_heads,
        head_dim: shape.head_dim,
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
            .map(|&s| {
                let elems = 2 * block_size * s.n_kv_heads * s.head_dim;
                match dtype {
                    KvDtype::F32 => 4 * elems,
                    KvDtype::F16 => 2 * elems,
                    KvDtype::Q8 | KvDtype::Q4 => quant_shape(s, 1, block_size)
                        .bytes_per_block(dtype.bits().expect("a quantized type")),
                }
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

/// `src` rounded to f16 (to nearest, ties to even) into `dst` (f16 bits): eight at a time with
/// F16C where the CPU has it. `half`'s slice conversion, called per 64-value head row, cost
/// ~1.8 ns per value here (its dispatch and chunking per call), the KV store of an 8-row
/// decode step ~2% of it; the rounding is the same.
fn to_f16(dst: &mut [u16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "f16 store: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Isa::best() != crate::quant::Isa::Scalar {
        // SAFETY: `Isa::best` detected AVX2 and F16C; `to_f16_x86` reads and writes within the
        // equal lengths checked above.
        unsafe { to_f16_x86(dst, src) };
        return;
    }
    dst.reinterpret_cast_mut::<f16>()
        .convert_from_f32_slice(src);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn to_f16_x86(dst: &mut [u16], src: &[f32]) {
    use std::arch::x86_64::*;
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
        _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
    }
    for i in n8..src.len() {
        dst[i] = f16::from_f32(src[i]).to_bits();
    }
}

#[cfg(test)]
mod tests {
    /// The F16C store rounds as `half` does: normals, subnormals, ties, overflow to infinity,
    /// zeros and infinities, at lengths that leave a tail past the eight-value chunks; NaN
    /// stays NaN.
    #[test]
    fn f16_store_rounds_as_half() {
        let mut src: Vec<f32> = Vec::new();
        let mut bits = 0u32;
        while bits < 0x7f80_0000 {
            src.push(f32::from_bits(bits));
            src.push(-f32::from_bits(bits));
            bits += 0x0000_0fff;
        }
        src.extend([
            65504.0,
            65520.0,
            1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ]);
        for len in [src.len(), 61, 8, 3] {
            let s = &src[..len];
            let mut got = vec![0u16; len];
            super::to_f16(&mut got, s);
            for (g, v) in got.iter().zip(s) {
                assert_eq!(*g, half::f16::from_f32(*v).to_bits(), "{v:e}");
            }
        }
        let mut nan = [0u16; 9];
        super::to_f16(&mut nan, &[f32::NAN; 9]);
        assert!(nan.iter().all(|&b| half::f16::from_bits(b).is_nan()));
    }
}
