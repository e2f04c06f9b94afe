//! Quantized KV storage (`--kv-bits 8|4`) for one layer, block by block, KIVI-style:
//! keys per channel across the tokens of a block, values per token in groups along the head
//! dimension. A block still being filled stays in f32 and is quantized once, when its last slot
//! is written, so full blocks — the only ones the prefix cache shares — are immutable.
//!
//! ```text
//! per (block, kv head), B = block_size slots, D = head_dim, G = value group (32 | 16, or D):
//!   keys    codes [B][D]  + per channel c: f16 scale, f16 min     k[s][c] ≈ q·scale[c] + min[c]
//!   values  codes [B][D]  + per slot s, group g: f16 scale, min   v[s][c] ≈ q·scale[s,g] + min[s,g]
//!   codes: u8 (8-bit) or two u4 per byte (4-bit), asymmetric (0..=255 or 0..=15)
//! ```
//! Why per channel for keys: keys carry large per-channel offsets (Qwen2.5's key projection
//! has biases, SmolLM2 outlier channels); a group along the head dimension spans them all,
//! a channel's 16 values within one block do not.
//!
//! Blocks being filled ("staged") live in a side table bounded by [`STAGED_BLOCKS`]; beyond it
//! the least recently written one is quantized over the slots it has, and dequantized back if
//! it is written again. A sequence's first block (its attention sinks) stays staged when full,
//! up to [`SINK_BLOCKS`] of them.

use half::f16;

/// Partially filled blocks held in f32 per layer: enough for one per running sequence at the
/// concurrency levels this engine runs. Beyond it, blocks are quantized before they are full.
pub const STAGED_BLOCKS: usize = 32;

/// First blocks of sequences (positions `0..block_size`) kept in f32 per layer, full or not.
/// The first tokens are attention sinks: most queries put much of their weight there, and
/// their outsized keys would stretch the quantization ranges of their block.
pub const SINK_BLOCKS: usize = 32;

/// Values per value-quantization group: 32 for 8-bit codes, 16 for 4-bit ones (measured:
/// halving the group cut SmolLM2's 4-bit KL by a quarter), or the whole head vector when the
/// head dimension is not a multiple.
pub fn group_size(head_dim: usize, bits: Bits) -> usize {
    let g = match bits {
        Bits::Eight => 32,
        Bits::Four => 16,
    };
    if head_dim.is_multiple_of(g) {
        g
    } else {
        head_dim.max(1)
    }
}

/// Code width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    Eight,
    Four,
}

impl Bits {
    fn levels(self) -> f32 {
        match self {
            Bits::Eight => 255.0,
            Bits::Four => 15.0,
        }
    }

    fn code_bytes(self, n: usize) -> usize {
        match self {
            Bits::Eight => n,
            Bits::Four => n.div_ceil(2),
        }
    }
}

/// Shape of one layer's quantized pool.
#[derive(Debug, Clone, Copy)]
pub struct QuantShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl QuantShape {
    /// Elements of K (or V) in one (block, head).
    fn per_head(&self) -> usize {
        self.block_size * self.head_dim
    }

    fn groups(&self, bits: Bits) -> usize {
        self.head_dim / group_size(self.head_dim, bits)
    }

    /// Bytes one block takes in one layer, K and V, parameters included.
    pub fn bytes_per_block(&self, bits: Bits) -> usize {
        let codes = 2 * bits.code_bytes(self.n_kv_heads * self.per_head());
        let key_params = self.n_kv_heads * self.head_dim * 4;
        let value_params = self.n_kv_heads * self.block_size * self.groups(bits) * 4;
        codes + key_params + value_params
    }
}

/// The f32 copy of a block being filled: `[head][slot][head_dim]` for K and V. Not f16:
/// dequantized values with a large per-channel offset would lose more to f16 than to 8 bits.
struct Staged {
    block: u32,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Slots `0..filled` hold this owner's tokens.
    filled: usize,
    last_write: u64,
    /// A sequence's first block: stays here when full (see [`SINK_BLOCKS`]).
    sink: bool,
}

/// One layer's quantized K/V pool.
pub struct QuantLayer {
    shape: QuantShape,
    bits: Bits,
    /// Codes, `[block][head][slot][head_dim]` elements (zero-allocated: untouched blocks cost
    /// no resident memory).
    k_codes: Vec<u8>,
    v_codes: Vec<u8>,
    /// `[block][head][channel]` (scale, min) f16 bit pairs.
    k_params: Vec<u16>,
    /// `[block][head][slot][group]` (scale, min) f16 bit pairs.
    v_params: Vec<u16>,
    /// Per block: index + 1 into `staged`, 0 when the block is not staged.
    staged_at: Vec<u32>,
    staged: Vec<Staged>,
    clock: u64,
}

impl QuantLayer {
    pub fn new(shape: QuantShape, bits: Bits) -> Self {
        let QuantShape {
            num_blocks: nb,
            n_kv_heads: h,
            ..
        } = shape;
        let elems = nb * h * shape.per_head();
        Self {
            shape,
            bits,
            k_codes: vec![0; bits.code_bytes(elems)],
            v_codes: vec![0; bits.code_bytes(elems)],
            k_params: vec![0; nb * h * shape.head_dim * 2],
            v_params: vec![0; nb * h * shape.block_size * shape.groups(bits) * 2],
            staged_at: vec![0; nb],
            staged: Vec::new(),
            clock: 0,
        }
    }

    /// Store one token's K and V (`[n_kv_heads * head_dim]` each) at `slot` of `block`;
    /// `sink`: the block holds the sequence's first positions.
    pub fn write(&mut self, block: u32, slot: usize, sink: bool, k: &[f32], v: &[f32]) {
        let (bs, d) = (self.shape.block_size, self.shape.head_dim);
        let i = self.stage(block, slot);
        self.clock += 1;
        let e = &mut self.staged[i];
        for h in 0..self.shape.n_kv_heads {
            let at = (h * bs + slot) * d;
            e.k[at..at + d].copy_from_slice(&k[h * d..(h + 1) * d]);
            e.v[at..at + d].copy_from_slice(&v[h * d..(h + 1) * d]);
        }
        // A new owner starts at slot 0; anything staged after it belonged to the last one.
        e.filled = if slot == 0 { 1 } else { e.filled.max(slot + 1) };
        e.last_write = self.clock;
        e.sink = sink;
        if slot + 1 == bs && !sink {
            self.unstage(i);
        }
        for (sink, cap) in [(false, STAGED_BLOCKS), (true, SINK_BLOCKS)] {
            if let Some(oldest) = self.oldest_beyond(sink, cap) {
                self.unstage(oldest);
            }
        }
    }

    /// The least recently written staged entry of its kind, when there are more than `cap`.
    fn oldest_beyond(&self, sink: bool, cap: usize) -> Option<usize> {
        let of_kind = (0..self.staged.len()).filter(|&j| self.staged[j].sink == sink);
        if of_kind.clone().count() <= cap {
            return None;
        }
        of_kind.min_by_key(|&j| self.staged[j].last_write)
    }

    /// Index of `block`'s staged copy, creating it: empty for a block that starts at slot 0,
    /// else the dequantized block (it was quantized early, or is being written again).
    fn stage(&mut self, block: u32, slot: usize) -> usize {
        let at = self.staged_at[block as usize];
        if at > 0 {
            return at as usize - 1;
        }
        let n = self.shape.n_kv_heads * self.shape.per_head();
        let mut e = Staged {
            block,
            k: vec![0.0; n],
            v: vec![0.0; n],
            filled: 0,
            last_write: 0,
            sink: false,
        };
        if slot > 0 {
            let per_head = self.shape.per_head();
            for h in 0..self.shape.n_kv_heads {
                let r = h * per_head..(h + 1) * per_head;
                self.read_quant_keys(block, h, 0, &mut e.k[r.clone()]);
                self.read_quant_values(block, h, 0, &mut e.v[r]);
            }
            e.filled = slot;
        }
        self.staged.push(e);
        self.staged_at[block as usize] = self.staged.len() as u32;
        self.staged.len() - 1
    }

    /// Quantize staged entry `i` into its block and drop it.
    fn unstage(&mut self, i: usize) {
        let e = self.staged.swap_remove(i);
        self.staged_at[e.block as usize] = 0;
        if let Some(moved) = self.staged.get(i) {
            self.staged_at[moved.block as usize] = i as u32 + 1;
        }
        let per_head = self.shape.per_head();
        for h in 0..self.shape.n_kv_heads {
            let r = h * per_head..(h + 1) * per_head;
            self.quantize_keys(e.block, h, &e.k[r.clone()], e.filled);
            self.quantize_values(e.block, h, &e.v[r], e.filled);
        }
    }

    /// Element offset of (block, head, slot 0).
    fn base(&self, block: u32, head: usize) -> usize {
        (block as usize * self.shape.n_kv_heads + head) * self.shape.per_head()
    }

    /// Keys `[slot][channel]` of slots `0..filled`, one (scale, min) per channel.
    fn quantize_keys(&mut self, block: u32, head: usize, k: &[f32], filled: usize) {
        let d = self.shape.head_dim;
        let base = self.base(block, head);
        let p0 = (block as usize * self.shape.n_kv_heads + head) * d * 2;
        for c in 0..d {
            let column = (0..filled).map(|s| k[s * d + c]);
            let (lo, hi) = column.fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), x| {
                (l.min(x), h.max(x))
            });
            let g = Grid::new(lo, hi, self.bits);
            self.k_params[p0 + 2 * c] = g.scale.to_bits();
            self.k_params[p0 + 2 * c + 1] = g.min.to_bits();
            for s in 0..filled {
                put(
                    &mut self.k_codes,
                    self.bits,
                    base + s * d + c,
                    g.code(k[s * d + c]),
                );
            }
        }
    }

    /// Values `[slot][channel]` of slots `0..filled`, one (scale, min) per slot and group.
    fn quantize_values(&mut self, block: u32, head: usize, v: &[f32], filled: usize) {
        let (d, g) = (
            self.shape.head_dim,
            group_size(self.shape.head_dim, self.bits),
        );
        let base = self.base(block, head);
        for s in 0..filled {
            for (gi, x) in v[s * d..(s + 1) * d].chunks_exact(g).enumerate() {
                let (lo, hi) = x
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &x| {
                        (l.min(x), h.max(x))
                    });
                let grid = Grid::new(lo, hi, self.bits);
                let p = ((base + s * d) / g + gi) * 2;
                self.v_params[p] = grid.scale.to_bits();
                self.v_params[p + 1] = grid.min.to_bits();
                for (j, &x) in x.iter().enumerate() {
                    put(
                        &mut self.v_codes,
                        self.bits,
                        base + s * d + gi * g + j,
                        grid.code(x),
                    );
                }
            }
        }
    }

    /// Keys of `head` in `block`, slots `s0..s0 + out.len() / head_dim`, as f32.
    pub fn read_keys(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        match self.staged_at[block as usize] {
            0 => self.read_quant_keys(block, head, s0, out),
            at => {
                let at0 = (head * self.shape.block_size + s0) * self.shape.head_dim;
                out.copy_from_slice(&self.staged[at as usize - 1].k[at0..at0 + out.len()]);
            }
        }
    }

    pub fn read_values(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        match self.staged_at[block as usize] {
            0 => self.read_quant_values(block, head, s0, out),
            at => {
                let at0 = (head * self.shape.block_size + s0) * self.shape.head_dim;
                out.copy_from_slice(&self.staged[at as usize - 1].v[at0..at0 + out.len()]);
            }
        }
    }

    fn read_quant_keys(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        let d = self.shape.head_dim;
        let p0 = (block as usize * self.shape.n_kv_heads + head) * d * 2;
        let (scale, min): (Vec<f32>, Vec<f32>) = self.k_params[p0..p0 + 2 * d]
            .chunks_exact(2)
            .map(|p| (f16::from_bits(p[0]).to_f32(), f16::from_bits(p[1]).to_f32()))
            .unzip();
        let base = self.base(block, head) + s0 * d;
        let mut q = vec![0u8; d];
        for (s, row) in out.chunks_exact_mut(d).enumerate() {
            unpack(&self.k_codes, self.bits, base + s * d, &mut q);
            for (((y, &q), &scale), &min) in row.iter_mut().zip(&q).zip(&scale).zip(&min) {
                *y = q as f32 * scale + min;
            }
        }
    }

    fn read_quant_values(&self, block: u32, head: usize, s0: usize, out: &mut [f32]) {
        let (d, g) = (
            self.shape.head_dim,
            group_size(self.shape.head_dim, self.bits),
        );
        let base = self.base(block, head) + s0 * d;
        let mut q = vec![0u8; d];
        for (s, row) in out.chunks_exact_mut(d).enumerate() {
            let at = base + s * d;
            unpack(&self.v_codes, self.bits, at, &mut q);
            for (gi, (y, q)) in row.chunks_exact_mut(g).zip(q.chunks_exact(g)).enumerate() {
                let p = (at / g + gi) * 2;
                let scale = f16::from_bits(self.v_params[p]).to_f32();
                let min = f16::from_bits(self.v_params[p + 1]).to_f32();
                for (y, &q) in y.iter_mut().zip(q) {
                    *y = q as f32 * scale + min;
                }
            }
        }
    }
}

/// Codes `e0..e0 + out.len()` into `out`, one per byte; the width is matched once per run,
/// not per element, so the loops below it vectorize.
fn unpack(codes: &[u8], bits: Bits, e0: usize, out: &mut [u8]) {
    match bits {
        Bits::Eight => out.copy_from_slice(&codes[e0..e0 + out.len()]),
        Bits::Four if e0.is_multiple_of(2) && out.len().is_multiple_of(2) => {
            for (pair, &b) in out.chunks_exact_mut(2).zip(&codes[e0 / 2..]) {
                pair[0] = b & 0x0f;
                pair[1] = b >> 4;
            }
        }
        Bits::Four => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = get(codes, bits, e0 + i);
            }
        }
    }
}

/// An asymmetric grid `min + q·scale`, `q = 0..=levels`, with `min` and `scale` in f16 rounded
/// outward so the grid still covers `[lo, hi]`: an f16-rounded minimum above a large per-channel
/// offset would otherwise clip the channel's smallest values.
struct Grid {
    scale: f16,
    min: f16,
    levels: f32,
}

impl Grid {
    fn new(lo: f32, hi: f32, bits: Bits) -> Self {
        let levels = bits.levels();
        if !(lo.is_finite() && hi.is_finite()) || hi < lo {
            return Grid {
                scale: f16::ZERO,
                min: f16::from_f32(if lo.is_finite() { lo } else { 0.0 }),
                levels,
            };
        }
        let min = f16_down(lo);
        let scale = f16_up((hi - min.to_f32()) / levels);
        Grid { scale, min, levels }
    }

    fn code(&self, x: f32) -> u8 {
        let s = self.scale.to_f32();
        if s == 0.0 {
            return 0;
        }
        ((x - self.min.to_f32()) / s)
            .round()
            .clamp(0.0, self.levels) as u8
    }
}

/// The largest f16 not above `x` (finite `x` within f16 range).
fn f16_down(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() <= x {
        return h;
    }
    let b = h.to_bits();
    f16::from_bits(match b {
        0x0000 => 0x8001,
        b if b & 0x8000 == 0 => b - 1,
        b => b + 1,
    })
}

/// The smallest f16 not below `x` (`x >= 0`).
fn f16_up(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() >= x {
        h
    } else {
        f16::from_bits(h.to_bits() + 1)
    }
}

fn put(codes: &mut [u8], bits: Bits, e: usize, q: u8) {
    match bits {
        Bits::Eight => codes[e] = q,
        Bits::Four => {
            let shift = (e & 1) * 4;
            let b = &mut codes[e >> 1];
            *b = (*b & !(0x0f << shift)) | (q << shift);
        }
    }
}

#[inline]
fn get(codes: &[u8], bits: Bits, e: usize) -> u8 {
    match bits {
        Bits::Eight => codes[e],
        Bits::Four => (codes[e >> 1] >> ((e & 1) * 4)) & 0x0f,
    }
}

#[cfg(test)]
mod tests;
