//! F32, F16 and BF16 rows: decoding and the scalar f32 dot products against them.
//! Floats are not quantized on the activation side; weights are widened on the fly.

use super::f16_at;

pub(super) fn dequantize_f32(src: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

pub(super) fn dequantize_f16(src: &[u8], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = f16_at(src, 2 * i);
    }
}

/// BF16 is the top half of an f32, so widening is a shift.
pub(super) fn dequantize_bf16(src: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
    }
}

/// `out[j] = Σ_c w[c]·x[i0+j][c]`, widening each weight with `get`.
#[inline(always)]
fn dot_rows(
    w: &[u8],
    x: &[f32],
    cols: usize,
    i0: usize,
    out: &mut [f32],
    get: impl Fn(&[u8], usize) -> f32,
) {
    for (j, o) in out.iter_mut().enumerate() {
        let xr = &x[(i0 + j) * cols..(i0 + j + 1) * cols];
        *o = xr.iter().enumerate().map(|(c, &v)| get(w, c) * v).sum();
    }
}

pub(super) fn dot_f32(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    dot_rows(w, x, cols, i0, out, |w, c| {
        f32::from_le_bytes([w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]])
    })
}

pub(super) fn dot_f16(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    dot_rows(w, x, cols, i0, out, |w, c| f16_at(w, 2 * c))
}

pub(super) fn dot_bf16(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]) {
    dot_rows(w, x, cols, i0, out, |w, c| {
        f32::from_bits((u16::from_le_bytes([w[2 * c], w[2 * c + 1]]) as u32) << 16)
    })
}
