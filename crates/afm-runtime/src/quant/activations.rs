//! Activation rows quantized to 8 bits once per matmul call, so the weight kernels can use
//! integer dot products (llama.cpp's approach and accuracy).
//!
//! ```text
//! Q8Rows  (for the 32-weight formats), per 32 values:  [d, s = d·Σq]: [f32; 2] | q: i8[32]
//! Q8kRows (for the K-quants),          per 256 values: d: f32 | q: i8[256] | bsums: i16[16]
//! ```
//! `x ≈ d·q` with `d = max|x| / 127`; `q` rounds half to even, so the scalar and the AVX2
//! builds of this code produce the same bytes. The sums let kernels fold per-block offsets and
//! minimums in without touching `q` again.

use super::kernel::Isa;

/// Values per Q8 block and per Q8K block.
pub const Q8_BLOCK: usize = 32;
pub const Q8K_BLOCK: usize = 256;

/// `n` activation rows of `cols` values as Q8 blocks of 32 (structure of arrays).
pub struct Q8Rows {
    pub(crate) cols: usize,
    pub(crate) qs: Vec<i8>,
    /// `[d, d·Σq]` per block, side by side so a kernel loads both with one instruction.
    pub(crate) ds: Vec<[f32; 2]>,
}

/// `n` activation rows of `cols` values as Q8K blocks of 256.
pub struct Q8kRows {
    pub(crate) cols: usize,
    pub(crate) qs: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) bsums: Vec<i16>,
}

/// One row of `Q8Rows`.
#[derive(Clone, Copy)]
pub(crate) struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub ds: &'a [[f32; 2]],
}

/// One row of `Q8kRows`.
#[derive(Clone, Copy)]
pub(crate) struct Q8kRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub bsums: &'a [i16],
}

impl Q8Rows {
    /// Quantize `x` (`n` rows of `cols`, `cols` a multiple of 32).
    pub fn quantize(x: &[f32], cols: usize, isa: Isa) -> Self {
        assert!(
            cols.is_multiple_of(Q8_BLOCK) && x.len().is_multiple_of(cols.max(1)),
            "Q8Rows: {} values are not whole rows of {cols}, a multiple of {Q8_BLOCK}",
            x.len()
        );
        let nb = x.len() / Q8_BLOCK;
        let mut r = Self {
            cols,
            qs: vec![0; x.len()],
            ds: vec![[0.0; 2]; nb],
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `has_avx2` confirmed AVX2 and FMA at run time.
            _ if isa.has_avx2() => unsafe { quantize_q8_avx2(x, &mut r.qs, &mut r.ds) },
            _ => quantize_q8(x, &mut r.qs, &mut r.ds),
        }
        r
    }

    pub(crate) fn row(&self, i: usize) -> Q8Row<'_> {
        let nb = self.cols / Q8_BLOCK;
        Q8Row {
            qs: &self.qs[i * self.cols..(i + 1) * self.cols],
            ds: &self.ds[i * nb..(i + 1) * nb],
        }
    }
}

impl Q8kRows {
    /// Quantize `x` (`n` rows of `cols`, `cols` a multiple of 256).
    pub fn quantize(x: &[f32], cols: usize, isa: Isa) -> Self {
        assert!(
            cols.is_multiple_of(Q8K_BLOCK) && x.len().is_multiple_of(cols.max(1)),
            "Q8kRows: {} values are not whole rows of {cols}, a multiple of {Q8K_BLOCK}",
            x.len()
        );
        let nb = x.len() / Q8K_BLOCK;
        let mut r = Self {
            cols,
            qs: vec![0; x.len()],
            d: vec![0.0; nb],
            bsums: vec![0; nb * 16],
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `has_avx2` confirmed AVX2 and FMA at run time.
            _ if isa.has_avx2() => unsafe {
                quantize_q8k_avx2(x, &mut r.qs, &mut r.d, &mut r.bsums)
            },
            _ => quantize_q8k(x, &mut r.qs, &mut r.d, &mut r.bsums),
        }
        r
    }

    pub(crate) fn row(&self, i: usize) -> Q8kRow<'_> {
        let nb = self.cols / Q8K_BLOCK;
        Q8kRow {
            qs: &self.qs[i * self.cols..(i + 1) * self.cols],
            d: &self.d[i * nb..(i + 1) * nb],
            bsums: &self.bsums[i * nb * 16..(i + 1) * nb * 16],
        }
    }
}

/// Scale of one block and the values quantized with it; returns `(d, Σq)`.
#[inline(always)]
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    // For finite floats, |x| orders like its bit pattern; the integer max vectorizes.
    let amax_bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .fold(0, u32::max);
    let d = f32::from_bits(amax_bits) / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    // Adding 1.5·2²³ rounds to an integer, half to even (exact for |v| ≤ 127).
    const ROUND: f32 = 12_582_912.0;
    let mut sum = 0i32;
    for (qv, &v) in q.iter_mut().zip(x) {
        let r = ((v * id + ROUND) - ROUND) as i32;
        *qv = r as i8;
        sum += r;
    }
    (d, sum)
}

#[inline(always)]
fn quantize_q8_body(x: &[f32], qs: &mut [i8], ds: &mut [[f32; 2]]) {
    let blocks = x.chunks_exact(Q8_BLOCK).zip(qs.chunks_exact_mut(Q8_BLOCK));
    for ((xb, qb), dsb) in blocks.zip(ds.iter_mut()) {
        let (scale, sum) = quantize_block(xb, qb);
        *dsb = [scale, scale * sum as f32];
    }
}

#[inline(always)]
fn quantize_q8k_body(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    let blocks = x
        .chunks_exact(Q8K_BLOCK)
        .zip(qs.chunks_exact_mut(Q8K_BLOCK));
    for ((xb, qb), (db, bs)) in blocks.zip(d.iter_mut().zip(bsums.chunks_exact_mut(16))) {
        *db = quantize_block(xb, qb).0;
        for (b, q16) in bs.iter_mut().zip(qb.chunks_exact(16)) {
            *b = q16.iter().map(|&v| v as i16).sum();
        }
    }
}

fn quantize_q8(x: &[f32], qs: &mut [i8], ds: &mut [[f32; 2]]) {
    quantize_q8_body(x, qs, ds)
}

fn quantize_q8k(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    quantize_q8k_body(x, qs, d, bsums)
}

/// The same code compiled for AVX2, so the compiler vectorizes it; results are identical
/// because every step is the same IEEE operation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_q8_avx2(x: &[f32], qs: &mut [i8], ds: &mut [[f32; 2]]) {
    quantize_q8_body(x, qs, ds)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_q8k_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    quantize_q8k_body(x, qs, d, bsums)
}
