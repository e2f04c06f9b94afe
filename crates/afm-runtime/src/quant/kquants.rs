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

use super::activations::Q8kRows;
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

/// Per-superblock integer sums of one K-quant block against one Q8K block:
/// `sumi = Σ_g scale_g·Σ_{e∈g} q_e·x_e` and `summ = Σ_g min_g·Σ_{e∈g} x_e`, so the block's dot
/// is `d·d_x·sumi − dmin·d_x·summ`.
struct Sums {
    d: f32,
    dmin: f32,
    sumi: i32,
    summ: i32,
}

/// Σ_{e∈[from, from+len)} q_e·x_e for decoded values `q`.
#[inline(always)]
fn isum<T: Copy + Into<i32>>(q: &[T], x: &[i8], from: usize, len: usize) -> i32 {
    q[from..from + len]
        .iter()
        .zip(&x[from..from + len])
        .map(|(&a, &b)| a.into() * b as i32)
        .sum()
}

fn sums_q2_k(b: &[u8], x: &[i8], bsums: &[i16]) -> Sums {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let q: [u8; QK_K] = std::array::from_fn(|e| q2k_q(qs, e));
    let (mut sumi, mut summ) = (0, 0);
    for g in 0..16 {
        sumi += (scales[g] & 0xF) as i32 * isum(&q, x, 16 * g, 16);
        summ += (scales[g] >> 4) as i32 * bsums[g] as i32;
    }
    Sums {
        d: f16_at(b, 80),
        dmin: f16_at(b, 82),
        sumi,
        summ,
    }
}

fn sums_q3_k(b: &[u8], x: &[i8], _bsums: &[i16]) -> Sums {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = q3k_scales(&b[96..108]);
    let q: [i8; QK_K] = std::array::from_fn(|e| q3k_q(hmask, qs, e));
    let sumi = (0..16)
        .map(|g| scales[g] as i32 * isum(&q, x, 16 * g, 16))
        .sum();
    Sums {
        d: f16_at(b, 108),
        dmin: 0.0,
        sumi,
        summ: 0,
    }
}

fn sums_q45_k(b: &[u8], x: &[i8], bsums: &[i16], q: &[u8; QK_K]) -> Sums {
    let (mut sumi, mut summ) = (0, 0);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        sumi += sc as i32 * isum(q, x, 32 * j, 32);
        summ += m as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
    }
    Sums {
        d: f16_at(b, 0),
        dmin: f16_at(b, 2),
        sumi,
        summ,
    }
}

fn sums_q4_k(b: &[u8], x: &[i8], bsums: &[i16]) -> Sums {
    let qs = &b[16..144];
    sums_q45_k(b, x, bsums, &std::array::from_fn(|e| q4k_q(qs, e)))
}

fn sums_q5_k(b: &[u8], x: &[i8], bsums: &[i16]) -> Sums {
    let (qh, qs) = (&b[16..48], &b[48..176]);
    sums_q45_k(b, x, bsums, &std::array::from_fn(|e| q5k_q(qh, qs, e)))
}

fn sums_q6_k(b: &[u8], x: &[i8], _bsums: &[i16]) -> Sums {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let q: [i8; QK_K] = std::array::from_fn(|e| q6k_q(ql, qh, e));
    let sumi = (0..16)
        .map(|g| scales[g] as i8 as i32 * isum(&q, x, 16 * g, 16))
        .sum();
    Sums {
        d: f16_at(b, 208),
        dmin: 0.0,
        sumi,
        summ: 0,
    }
}

fn dot_k(
    w: &[u8],
    bytes: usize,
    sums: fn(&[u8], &[i8], &[i16]) -> Sums,
    x: &Q8kRows,
    i0: usize,
    out: &mut [f32],
) {
    for (j, o) in out.iter_mut().enumerate() {
        let xr = x.row(i0 + j);
        let mut acc = 0f32;
        for (k, b) in w.chunks_exact(bytes).enumerate() {
            let xq = &xr.qs[k * QK_K..(k + 1) * QK_K];
            let s = sums(b, xq, &xr.bsums[16 * k..16 * (k + 1)]);
            acc += s.d * xr.d[k] * s.sumi as f32 - s.dmin * xr.d[k] * s.summ as f32;
        }
        *o = acc;
    }
}

pub(super) fn dot_q2_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    dot_k(w, 84, sums_q2_k, x, i0, out)
}

pub(super) fn dot_q3_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    dot_k(w, 110, sums_q3_k, x, i0, out)
}

pub(super) fn dot_q4_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    dot_k(w, 144, sums_q4_k, x, i0, out)
}

pub(super) fn dot_q5_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    dot_k(w, 176, sums_q5_k, x, i0, out)
}

pub(super) fn dot_q6_k(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]) {
    dot_k(w, 210, sums_q6_k, x, i0, out)
}
