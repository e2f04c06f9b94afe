//! The 32-weight block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): decoding, bit-exact with
//! GGML's `dequantize_row_*`, and the scalar dot products against Q8 activation blocks.
//!
//! Block layouts (`ggml-common.h`), all little-endian, 32 weights each:
//! ```text
//! Q4_0 18 B: f16 d | u8 qs[16]                  w = d·(q-8)
//! Q4_1 20 B: f16 d | f16 m | u8 qs[16]          w = d·q + m
//! Q5_0 22 B: f16 d | u32 qh | u8 qs[16]         w = d·(q-16)
//! Q5_1 24 B: f16 d | f16 m | u32 qh | u8 qs[16] w = d·q + m
//! Q8_0 34 B: f16 d | i8 qs[32]                  w = d·q
//! ```
//! Nibbles: `qs[j] & 0xF` is weight j, `qs[j] >> 4` is weight j+16; bit j of `qh` is the fifth
//! bit of weight j.

use super::activations::Q8Rows;
use super::f16_at;

/// Weights per block.
pub(super) const QK: usize = 32;

/// The 4-bit values of a block, in weight order.
#[inline(always)]
fn nibbles(qs: &[u8]) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..QK / 2 {
        q[j] = qs[j] & 0x0F;
        q[j + QK / 2] = qs[j] >> 4;
    }
    q
}

/// The 5-bit values of a block: nibbles plus the bit from `qh`.
#[inline(always)]
fn five_bit(qh: &[u8], qs: &[u8]) -> [u8; QK] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = nibbles(qs);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((h >> j) & 1) as u8) << 4;
    }
    q
}

pub(super) fn dequantize_q4_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (o, q) in y.iter_mut().zip(nibbles(&b[2..18])) {
            *o = (q as i32 - 8) as f32 * d;
        }
    }
}

pub(super) fn dequantize_q4_1(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (o, q) in y.iter_mut().zip(nibbles(&b[4..20])) {
            *o = q as f32 * d + m;
        }
    }
}

pub(super) fn dequantize_q5_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (o, q) in y.iter_mut().zip(five_bit(&b[2..6], &b[6..22])) {
            *o = (q as i32 - 16) as f32 * d;
        }
    }
}

pub(super) fn dequantize_q5_1(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(24).zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (o, q) in y.iter_mut().zip(five_bit(&b[4..8], &b[8..24])) {
            *o = q as f32 * d + m;
        }
    }
}

pub(super) fn dequantize_q8_0(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for (o, &q) in y.iter_mut().zip(&b[2..34]) {
            *o = q as i8 as f32 * d;
        }
    }
}

/// Unsigned block values and the affine map `w = scale·q + offset` of one block.
type Decoded = ([u8; QK], f32, f32);

fn decode_q4_0(b: &[u8]) -> Decoded {
    let d = f16_at(b, 0);
    (nibbles(&b[2..18]), d, -8.0 * d)
}

fn decode_q4_1(b: &[u8]) -> Decoded {
    (nibbles(&b[4..20]), f16_at(b, 0), f16_at(b, 2))
}

fn decode_q5_0(b: &[u8]) -> Decoded {
    let d = f16_at(b, 0);
    (five_bit(&b[2..6], &b[6..22]), d, -16.0 * d)
}

fn decode_q5_1(b: &[u8]) -> Decoded {
    (five_bit(&b[4..8], &b[8..24]), f16_at(b, 0), f16_at(b, 2))
}

/// Σ over blocks of `scale·d_x·Σ q·x_q + offset·s_x`: the block offset meets the activation
/// block sum, so the integer part stays unsigned.
fn dot_affine(
    w: &[u8],
    bytes: usize,
    decode: fn(&[u8]) -> Decoded,
    x: &Q8Rows,
    i0: usize,
    out: &mut [f32],
) {
    for (j, o) in out.iter_mut().enumerate() {
        let xr = x.row(i0 + j);
        let mut acc = 0f32;
        for (k, b) in w.chunks_exact(bytes).enumerate() {
            let (q, scale, offset) = decode(b);
            let xq = &xr.qs[k * QK..(k + 1) * QK];
            let sumi: i32 = q.iter().zip(xq).map(|(&a, &c)| a as i32 * c as i32).sum();
            acc += scale * xr.ds[k][0] * sumi as f32 + offset * xr.ds[k][1];
        }
        *o = acc;
    }
}

pub(super) fn dot_q4_0(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
    dot_affine(w, 18, decode_q4_0, x, i0, out)
}

pub(super) fn dot_q4_1(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
    dot_affine(w, 20, decode_q4_1, x, i0, out)
}

pub(super) fn dot_q5_0(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
    dot_affine(w, 22, decode_q5_0, x, i0, out)
}

pub(super) fn dot_q5_1(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
    dot_affine(w, 24, decode_q5_1, x, i0, out)
}

pub(super) fn dot_q8_0(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        let xr = x.row(i0 + j);
        let mut acc = 0f32;
        for (k, b) in w.chunks_exact(34).enumerate() {
            let xq = &xr.qs[k * QK..(k + 1) * QK];
            let sumi: i32 = b[2..34]
                .iter()
                .zip(xq)
                .map(|(&a, &c)| a as i8 as i32 * c as i32)
                .sum();
            acc += f16_at(b, 0) * xr.ds[k][0] * sumi as f32;
        }
        *o = acc;
    }
}
