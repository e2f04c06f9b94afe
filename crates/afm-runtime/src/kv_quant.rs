//! Quantized KV storage (`--kv-bits 8|4`): group-wise along the head dimension, so every
//! (slot, head) vector is quantized on its own when written and dequantized inside attention.
//!
//! ```text
//! 8-bit: per group of G values   i8 q[G]        + f16 scale         x ≈ q·scale
//! 4-bit: per group of G values   u4 q[G] packed + f16 scale, f16 min x ≈ q·scale + min
//! ```
//! G is 32 (a GGML block) when the head dimension allows, else the whole head vector.

use half::f16;

pub fn group_size(head_dim: usize) -> usize {
    if head_dim.is_multiple_of(32) {
        32
    } else {
        head_dim
    }
}

/// 8-bit symmetric groups.
pub struct Q8Store {
    group: usize,
    q: Vec<i8>,
    /// f16 bits (zero-allocated, see `kv_store`).
    scale: Vec<u16>,
}

impl Q8Store {
    pub fn new(n: usize, group: usize) -> Self {
        Self {
            group,
            q: vec![0; n],
            scale: vec![0; n / group],
        }
    }

    /// `at` and `x.len()` are whole groups (callers write whole head vectors).
    pub fn write(&mut self, at: usize, x: &[f32]) {
        for (gi, g) in x.chunks_exact(self.group).enumerate() {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let base = at + gi * self.group;
            for (o, v) in self.q[base..base + self.group].iter_mut().zip(g) {
                *o = (v * id).round().clamp(-127.0, 127.0) as i8;
            }
            self.scale[base / self.group] = f16::from_f32(d).to_bits();
        }
    }

    pub fn read(&self, at: usize, out: &mut [f32]) {
        for (gi, o) in out.chunks_exact_mut(self.group).enumerate() {
            let base = at + gi * self.group;
            let d = f16::from_bits(self.scale[base / self.group]).to_f32();
            for (y, &q) in o.iter_mut().zip(&self.q[base..base + self.group]) {
                *y = q as f32 * d;
            }
        }
    }
}

/// 4-bit asymmetric groups (scale and minimum), two values per byte.
pub struct Q4Store {
    group: usize,
    q: Vec<u8>,
    scale: Vec<u16>,
    min: Vec<u16>,
}

impl Q4Store {
    pub fn new(n: usize, group: usize) -> Self {
        Self {
            group,
            q: vec![0; n.div_ceil(2)],
            scale: vec![0; n / group],
            min: vec![0; n / group],
        }
    }

    pub fn write(&mut self, at: usize, x: &[f32]) {
        for (gi, g) in x.chunks_exact(self.group).enumerate() {
            let lo = g.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (hi - lo) / 15.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let base = at + gi * self.group;
            // Quantize against the rounded parameters that `read` will use.
            let (d16, lo16) = (f16::from_f32(d), f16::from_f32(lo));
            let lo_r = lo16.to_f32();
            for (i, v) in g.iter().enumerate() {
                let q = ((v - lo_r) * id).round().clamp(0.0, 15.0) as u8;
                let e = base + i;
                let byte = &mut self.q[e / 2];
                *byte = if e.is_multiple_of(2) {
                    (*byte & 0xf0) | q
                } else {
                    (*byte & 0x0f) | (q << 4)
                };
            }
            self.scale[base / self.group] = d16.to_bits();
            self.min[base / self.group] = lo16.to_bits();
        }
    }

    pub fn read(&self, at: usize, out: &mut [f32]) {
        for (gi, o) in out.chunks_exact_mut(self.group).enumerate() {
            let base = at + gi * self.group;
            let d = f16::from_bits(self.scale[base / self.group]).to_f32();
            let m = f16::from_bits(self.min[base / self.group]).to_f32();
            for (i, y) in o.iter_mut().enumerate() {
                let e = base + i;
                let q = if e.is_multiple_of(2) {
                    self.q[e / 2] & 0x0f
                } else {
                    self.q[e / 2] >> 4
                };
                *y = q as f32 * d + m;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * (1.0 + (i % 7) as f32))
            .collect()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    #[test]
    fn eight_bit_round_trip_is_within_half_a_step() {
        let x = data(128);
        let mut s = Q8Store::new(256, 32);
        s.write(64, &x);
        let mut y = vec![0.0; 128];
        s.read(64, &mut y);
        assert!(max_rel(&y, &x) < 1.0 / 127.0, "{}", max_rel(&y, &x));
    }

    #[test]
    fn four_bit_round_trip_is_within_half_a_step() {
        let x = data(96);
        let mut s = Q4Store::new(192, 32);
        s.write(32, &x);
        let mut y = vec![0.0; 96];
        s.read(32, &mut y);
        assert!(max_rel(&y, &x) < 1.0 / 15.0, "{}", max_rel(&y, &x));
        // Neighbouring groups are untouched by a write.
        let mut s2 = Q4Store::new(192, 32);
        s2.write(0, &x[..32]);
        s2.write(32, &x[32..64]);
        let mut a = vec![0.0; 32];
        s2.read(0, &mut a);
        assert!(max_rel(&a, &x[..32]) < 1.0 / 15.0);
    }
}
