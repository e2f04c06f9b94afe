//! The 256-weight K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): decoding, bit-exact with GGML's
//! `dequantize_row_*`, and the scalar dot products against Q8K activation blocks.
//!
//! Block layouts (`ggml-common.h`), little-endian, QK_K = 256 weights each:
//! ```text
//! Q2_K  84 B: u8 scales[16] | u8 qs[64]  | f16 d | f16 dmin       16×16, 2-bit, 4+4-bit scale/min
//! Q3_K 110 B: u8 hmask[32] | u8 qs[64]  | u8 scales[12] | f16 d   16×16, 3-bit, 6-bit scales
//! Q4_K 144 B: f16 d | f16 dmin | u8 scales[12] | u8 qs[128]       8×32, 4-bit, 6-bit scale/min
//! Q5_K 176 B: f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
//! Q6_K 210 B: u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d       16×16, 6-bit
//! ```
//! Bit positions of weight `e` (0..256) are spelled out by the `*_q` helpers below.

use super::f16_at;

pub(super) const QK_K: usize = 256;

/// Sub-block `j` (0..8) scale and min of Q4_K/Q5_K: GGML's `get_scale_min_k4`.
#[inline(always)]
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The sixteen 6-bit Q3_K scales, offset by −32.
#[inline(always)]
pub(super) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Q2_K weight `e`: 2 bits of `qs`, scale/min byte `e/16`.
#[inline(always)]
fn q2k_q(qs: &[u8], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
}

/// Q3_K weight `e`, already offset: low 2 bits as Q2_K, minus 4 unless its `hmask` bit is set.
#[inline(always)]
fn q3k_q(hmask: &[u8], qs: &[u8], e: usize) -> i8 {
    let high = (hmask[e % 32] >> (e / 32)) & 1;
    q2k_q(qs, e) as i8 - if high == 0 { 4 } else { 0 }
}

/// Q4_K weight `e`: low nibbles are the first 32 of each 64, high nibbles the next 32.
#[inline(always)]
fn q4k_q(qs: &[u8], e: usize) -> u8 {
    (qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0xF
}

/// Q5_K weight `e`: the Q4_K nibble plus bit `e/32` of `qh[e%32]`.
#[inline(always)]
fn q5k_q(qh: &[u8], qs: &[u8], e: usize) -> u8 {
    q4k_q(qs, e) | (((qh[e % 32] >> (e / 32)) & 1) << 4)
}

/// Q6_K weight `e`, already offset by −32.
#[inline(always)]
fn q6k_q(ql: &[u8], qh: &[u8], e: usize) -> i8 {
    let (h, g, l) = (e / 128, (e % 128) / 32, e % 32);
    let low = (ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0xF;
    let high = (qh[32 * h + l] >> (2 * g)) & 3;
    (low | (high << 4)) as i8 - 32
}

pub(super) fn dequantize_q2_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(84).zip(out.chunks_exact_mut(QK_K)) {
        let (scales, qs) = (&b[0..16], &b[16..80]);
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (e, o) in y.iter_mut().enumerate() {
            let sc = scales[e / 16];
            let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
            *o = dl * q2k_q(qs, e) as f32 - ml;
        }
    }
}

pub(super) fn dequantize_q3_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(110).zip(out.chunks_exact_mut(QK_K)) {
        let (hmask, qs) = (&b[0..32], &b[32..96]);
        let scales = q3k_scales(&b[96..108]);
        let d = f16_at(b, 108);
        for (e, o) in y.iter_mut().enumerate() {
            let dl = d * scales[e / 16] as f32;
            *o = dl * q3k_q(hmask, qs, e) as f32;
        }
    }
}

pub(super) fn dequantize_q4_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(144).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, qs) = (&b[4..16], &b[16..144]);
        for (j, ys) in y.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(j, scales);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            for (l, o) in ys.iter_mut().enumerate() {
                *o = d1 * q4k_q(qs, 32 * j + l) as f32 - m1;
            }
        }
    }
}

pub(super) fn dequantize_q5_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(176).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
        for (j, ys) in y.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(j, scales);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            for (l, o) in ys.iter_mut().enumerate() {
                *o = d1 * q5k_q(qh, qs, 32 * j + l) as f32 - m1;
            }
        }
    }
}

pub(super) fn dequantize_q6_k(src: &[u8], out: &mut [f32]) {
    for (b, y) in src.chunks_exact(210).zip(out.chunks_exact_mut(QK_K)) {
        let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
        let d = f16_at(b, 208);
        for (e, o) in y.iter_mut().enumerate() {
            *o = d * scales[e / 16] as i8 as f32 * q6k_q(ql, qh, e) as f32;
        }
    }
}
