//! A weight matrix in its storage type, and `y = x · Wᵀ` against it.
//!
//! Layout: `rows` output features × `cols` input features, row-major, each row a whole number
//! of blocks of `dtype` (checked once in `new`).
//!
//! `matmul` quantizes the activations once (8-bit blocks for quantized weights, as llama.cpp
//! does), then splits the weight rows into chunks over the `threads` pool. Inside a chunk,
//! each weight row is decoded once per tile of up to `MAX_TILE` activation rows, and the
//! activation rows are walked in blocks small enough to stay in cache, so prefill reuses
//! every weight byte across the batch instead of streaming the matrix once per token:
//! ```text
//! for act_block in x (≤ ~256 KiB of quantized activations):
//!     for r in chunk rows:                  // weight row stays in L1
//!         for tile in act_block (4 rows):   // kernel: 1 weight row × 4 activation rows
//! ```
//! Call it from inside `threads::install` (a whole forward pass at a time): handing each
//! matmul from an outside thread to the pool costs ~15–20 µs of wake-ups per call, more than a
//! small decode matmul itself.

use crate::quant::{self, Isa, Q8Rows, Q8kRows, RowKernel, MAX_TILE};
use crate::{DType, RuntimeError, WeightBytes};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};

/// See [`set_f32_activations`].
static F32_ACTIVATIONS: AtomicBool = AtomicBool::new(false);

/// Process-wide switch for measurements that must not carry the 8-bit activation rounding
/// (the KV quantization quality example): `matmul` then multiplies f32 activations with the
/// dequantized weights. Slower (each call dequantizes the whole matrix); off by default.
pub fn set_f32_activations(on: bool) {
    F32_ACTIVATIONS.store(on, Ordering::Relaxed);
}

#[derive(Clone, Debug)]
pub struct WeightMatrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: WeightBytes,
}

impl WeightMatrix {
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: WeightBytes,
    ) -> Result<Self, RuntimeError> {
        let row = dtype
            .row_bytes(cols)
            .ok_or(RuntimeError::RowNotBlockAligned {
                dtype: dtype.name(),
                cols,
                block: dtype.block_elems(),
            })?;
        let want = row * rows;
        if bytes.len() != want {
            return Err(RuntimeError::SizeMismatch {
                dtype: dtype.name(),
                rows,
                cols,
                want,
                got: bytes.len(),
            });
        }
        Ok(Self {
            dtype,
            rows,
            cols,
            bytes,
        })
    }

    /// An f32 matrix from values (tests, converted weights).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(
            values.len(),
            rows * cols,
            "from_f32: values do not fill the shape"
        );
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self {
            dtype: DType::F32,
            rows,
            cols,
            bytes: WeightBytes::from_vec(bytes),
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn bytes(&self) -> &WeightBytes {
        &self.bytes
    }

    fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("checked in new")
    }

    fn row_slice(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes.as_slice()[r * rb..(r + 1) * rb]
    }

    /// Row `r` as f32 (embedding lookups).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        quant::dequantize_row(self.dtype, self.row_slice(r), &mut out[..self.cols]);
    }

    /// `out[i, r] = Σ_c x[i, c] · W[r, c]` for `n` input rows: x is `[n, cols]`, out `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        let float = matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16);
        if !float && F32_ACTIVATIONS.load(Ordering::Relaxed) {
            return self.dequantized().matmul_with(Isa::best(), x, n, out);
        }
        self.matmul_with(Isa::best(), x, n, out)
    }

    /// This matrix as F32 (`set_f32_activations`).
    fn dequantized(&self) -> WeightMatrix {
        let cols = self.cols;
        let mut bytes = vec![0u8; self.rows * cols * 4];
        bytes
            .par_chunks_mut((cols * 4).max(1))
            .enumerate()
            .for_each_init(
                || vec![0f32; cols],
                |row, (r, out)| {
                    self.dequantize_row(r, row);
                    for (o, v) in out.chunks_exact_mut(4).zip(row.iter()) {
                        o.copy_from_slice(&v.to_le_bytes());
                    }
                },
            );
        Self {
            dtype: DType::F32,
            rows: self.rows,
            cols,
            bytes: WeightBytes::from_vec(bytes),
        }
    }

    /// `matmul` with the kernels of a given instruction set (tests and benchmarks compare
    /// them); an `isa` this CPU lacks falls back to scalar.
    pub fn matmul_with(&self, isa: Isa, x: &[f32], n: usize, out: &mut [f32]) {
        Self::many_with(&[self], isa, x, n, &mut [out]);
    }

    /// `matmul` of one input by several matrices (a layer's Q, K and V; gate and up):
    /// `outs[m]` is `[n, ms[m].rows]`. Matrices of one type and width share the quantized
    /// input and one parallel pass, so the input is quantized once and the threads meet once,
    /// not once per matrix; each output is the one `matmul` gives.
    pub fn matmul_many(ms: &[&WeightMatrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(ms.len(), outs.len(), "matmul_many: one output per matrix");
        let shared = ms
            .windows(2)
            .all(|p| p[0].dtype == p[1].dtype && p[0].cols == p[1].cols);
        let float = ms
            .iter()
            .any(|m| matches!(m.dtype, DType::F32 | DType::F16 | DType::BF16));
        if !shared || (!float && F32_ACTIVATIONS.load(Ordering::Relaxed)) {
            for (m, out) in ms.iter().zip(outs.iter_mut()) {
                m.matmul(x, n, out);
            }
            return;
        }
        Self::many_with(ms, Isa::best(), x, n, outs)
    }

    /// `matmul_many` of matrices that share type and width, with `isa`'s kernels.
    fn many_with(ms: &[&WeightMatrix], isa: Isa, x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        let Some(first) = ms.first() else {
            return;
        };
        let (dtype, cols) = (first.dtype, first.cols);
        assert_eq!(
            x.len(),
            n * cols,
            "matmul: x must be n={n} rows of {cols} values"
        );
        for (m, out) in ms.iter().zip(outs.iter()) {
            assert_eq!(
                out.len(),
                n * m.rows,
                "matmul: out must be n={n} rows of {} values",
                m.rows
            );
        }
        if n == 0 || ms.iter().all(|m| m.rows == 0) {
            return;
        }
        if cols == 0 {
            outs.iter_mut().for_each(|o| o.fill(0.0));
            return;
        }
        match RowKernel::for_type(dtype, isa) {
            RowKernel::Float(k) => drive(ms, n, 4 * cols, Lanes::NONE, outs, |w, i0, o| {
                k(w, x, cols, i0, o)
            }),
            RowKernel::Q8(k) => {
                let a = Q8Rows::quantize_for_weight(x, cols, dtype, isa);
                #[cfg(target_arch = "x86_64")]
                if let Some(lk) = quant::lanes_kernel(dtype, isa).filter(|_| n >= LANES_MIN_N) {
                    let l = quant::Q8Lanes::from_rows(&a, dtype, lane_groups(n, LANES_PAD_MIN));
                    let lanes = Lanes {
                        rows: l.rows(),
                        tile: quant::LANES * quant::MAX_GROUPS_32,
                        weight_rows: 1,
                    };
                    return drive(ms, n, cols, lanes, outs, |w, i0, o| {
                        if i0 < lanes.rows {
                            lk(w, &l, i0 / quant::LANES, o)
                        } else {
                            k(w, &a, i0, o)
                        }
                    });
                }
                #[cfg(target_arch = "x86_64")]
                if let Some(qk) = quant::quads_kernel(dtype, isa).filter(|_| n >= QUADS_MIN_N) {
                    // n < LANES_MIN_N here: one quad group (padded), in the driver's 8-wide
                    // lanes tiles (rows past the group's four are zeros, never copied out).
                    let l = quant::Q8Quads::from_rows(&a, dtype);
                    let lanes = Lanes {
                        rows: LANE_GROUP,
                        tile: LANE_GROUP,
                        weight_rows: 1,
                    };
                    return drive(ms, n, cols, lanes, outs, |w, _, o| qk(w, &l, o));
                }
                drive(ms, n, cols, Lanes::NONE, outs, |w, i0, o| k(w, &a, i0, o))
            }
            RowKernel::Q8k(k) => {
                let a = Q8kRows::quantize(x, cols, isa);
                #[cfg(target_arch = "x86_64")]
                if let Some(lk) = quant::k_lanes_kernel(dtype, isa).filter(|_| n >= K_LANES_PAD_MIN)
                {
                    let l = quant::Q8kLanes::from_rows(&a, lane_groups(n, K_LANES_PAD_MIN));
                    let lanes = Lanes {
                        rows: l.rows(),
                        tile: quant::LANES * quant::MAX_GROUPS,
                        weight_rows: quant::MAX_ROWS,
                    };
                    return drive(ms, n, cols, lanes, outs, |w, i0, o| {
                        if i0 < lanes.rows {
                            lk(w, &l, i0 / quant::LANES, o)
                        } else {
                            k(w, &a, i0, o)
                        }
                    });
                }
                drive(ms, n, cols, Lanes::NONE, outs, |w, i0, o| k(w, &a, i0, o))
            }
        }
    }

    /// The plain reference: dequantize each row and dot in f64. Slow; tests compare with it.
    pub fn matmul_reference(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "matmul: input shape");
        assert_eq!(out.len(), n * self.rows, "matmul: output shape");
        let mut w = vec![0f32; self.cols];
        for r in 0..self.rows {
            self.dequantize_row(r, &mut w);
            for i in 0..n {
                let xi = &x[i * self.cols..(i + 1) * self.cols];
                let dot: f64 = xi.iter().zip(&w).map(|(&a, &b)| a as f64 * b as f64).sum();
                out[i * self.rows + r] = dot as f32;
            }
        }
    }
}

/// Run `kernel(weight_rows, i0, out_tile)` over every weight row of every matrix in `ms` and
/// every activation tile, weight-row chunks (of all matrices together) in parallel.
/// `act_row_bytes` sizes the cache blocking. Activation rows below `lanes.rows` (whole groups
/// of 8, the last maybe padded past `n`) go to a lanes kernel in tiles of up to `lanes.tile`
/// rows × `lanes.weight_rows` weight rows (`out_tile` row-major by weight row); the rest to
/// the one-row kernels, one weight row and up to `MAX_TILE` rows a call.
fn drive<K>(
    ms: &[&WeightMatrix],
    n: usize,
    act_row_bytes: usize,
    lanes: Lanes,
    outs: &mut [&mut [f32]],
    kernel: K,
) where
    K: Fn(&[u8], usize, &mut [f32]) + Sync,
{
    // Each chunk of a matrix's weight rows owns the matching column range of every output
    // row: pieces are (matrix, chunk, output row's columns), grouped by (matrix, chunk).
    let mut pieces: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (mi, (m, out)) in ms.iter().zip(outs.iter_mut()).enumerate() {
        if m.rows == 0 {
            continue;
        }
        let chunk = chunk_rows(m.rows, n, m.row_bytes());
        let at = pieces.len();
        pieces.extend(
            out.chunks_exact_mut(m.rows)
                .flat_map(|row| row.chunks_mut(chunk).enumerate())
                .map(|(c, o)| (mi, c, o)),
        );
        // Stable: activation rows stay in order within a chunk.
        pieces[at..].sort_by_key(|p| p.1);
    }
    let act_block =
        (ACT_BLOCK_BYTES / act_row_bytes.max(1)).clamp(LANE_TILE, 64) / LANE_TILE * LANE_TILE;
    let weight_rows = lanes.weight_rows.max(1);
    pieces.par_chunks_mut(n).for_each(|outs| {
        let m = ms[outs[0].0];
        let (rows, rb, w) = (m.rows, m.row_bytes(), m.bytes.as_slice());
        let chunk = chunk_rows(rows, n, rb);
        let r0 = outs[0].1 * chunk;
        let r1 = (r0 + chunk).min(rows);
        // A lanes tile's outputs are gathered for a run of weight rows, then copied to each
        // activation row as one contiguous run: per-call copies of 1–4 values cost ~7% of an
        // 8-row decode step.
        let mut tile = [0f32; LANE_TILE * LANE_RUN];
        for b0 in (0..n).step_by(act_block) {
            let b1 = (b0 + act_block).min(n);
            for run0 in (r0..r1).step_by(LANE_RUN) {
                let run1 = (run0 + LANE_RUN).min(r1);
                let mut i0 = b0;
                while i0 < b1 {
                    if i0 < lanes.rows {
                        // `nb` real rows; the kernel runs whole groups (`lane_groups` pads).
                        let nb = (lanes.rows.min(b1) - i0).min(lanes.tile);
                        let nbk = nb.div_ceil(LANE_GROUP) * LANE_GROUP;
                        for r in (run0..run1).step_by(weight_rows) {
                            let rw = (run1 - r).min(weight_rows);
                            let at = (r - run0) * nbk;
                            kernel(&w[r * rb..(r + rw) * rb], i0, &mut tile[at..at + rw * nbk]);
                        }
                        let run = run1 - run0;
                        scatter_tile(&tile[..run * nbk], nbk, &mut outs[i0..i0 + nb], run0 - r0);
                        i0 += nb;
                        continue;
                    }
                    let nb = (b1 - i0).min(MAX_TILE);
                    for q in run0..run1 {
                        kernel(&w[q * rb..(q + 1) * rb], i0, &mut tile[..nb]);
                        for (o, &v) in outs[i0..i0 + nb].iter_mut().zip(&tile[..nb]) {
                            o.2[q - r0] = v;
                        }
                    }
                    i0 += nb;
                }
            }
        }
    });
}

/// Copies a lanes tile (`tile`: [weight row][nbk], `nbk ≥ outs.len()`) into the activation
/// rows' outputs from `at` on: `outs[j].2[at + q] = tile[q·nbk + j]`. Whole 8×8 squares go
/// through an AVX transpose (the element-wise copy was ~3% of an 8-row decode step).
fn scatter_tile(tile: &[f32], nbk: usize, outs: &mut [(usize, usize, &mut [f32])], at: usize) {
    let run = tile.len() / nbk.max(1);
    let mut squares = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Isa::best() != crate::quant::Isa::Scalar {
        squares = (outs.len() / 8, run / 8);
        for jg in 0..squares.0 {
            let o = &mut outs[8 * jg..8 * jg + 8];
            for qg in 0..squares.1 {
                let dst: [&mut [f32]; 8] = {
                    let mut it = o.iter_mut();
                    std::array::from_fn(|_| match it.next() {
                        Some(p) => &mut p.2[at + 8 * qg..at + 8 * qg + 8],
                        None => &mut [],
                    })
                };
                let src = &tile[8 * qg * nbk + 8 * jg..];
                // SAFETY: `Isa::best` detected AVX2; `transpose8` reads 8 rows of 8 values `nbk`
                // apart from `src` (in bounds: 8·qg + 7 < run, 8·jg + 8 ≤ nbk) and writes
                // 8 values to each `dst` slice (each exactly 8 long).
                unsafe { transpose8(src, nbk, dst) };
            }
        }
    }
    // The rest (rows and columns past whole squares) one value at a time.
    for (j, o) in outs.iter_mut().enumerate() {
        let q0 = if j < 8 * squares.0 { 8 * squares.1 } else { 0 };
        for q in q0..run {
            o.2[at + q] = tile[q * nbk + j];
        }
    }
}

/// `dst[j][i] = src[i·stride + j]` for an 8×8 square.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8(src: &[f32], stride: usize, dst: [&mut [f32]; 8]) {
    use std::arch::x86_64::*;
    assert!(src.len() >= 7 * stride + 8 && dst.iter().all(|d| d.len() == 8));
    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.as_ptr().add(i * stride)));
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // t0 = unpacklo(r0, r1), t1 = unpackhi(r0, r1), t2/t3 from r2, r3, t4..t7 from r4..r7.
    let s: [__m256; 8] = std::array::from_fn(|i| {
        let (half, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * half + k / 2], t[4 * half + 2 + k / 2]);
        if k % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xEE>(a, b)
        }
    });
    for (j, d) in dst.into_iter().enumerate() {
        let v = if j < 4 {
            _mm256_permute2f128_ps::<0x20>(s[j], s[4 + j])
        } else {
            _mm256_permute2f128_ps::<0x31>(s[j - 4], s[j])
        };
        _mm256_storeu_ps(d.as_mut_ptr(), v);
    }
}

/// How `drive` hands activation rows to a lanes kernel (`quant::vnni_lanes`).
#[derive(Clone, Copy)]
struct Lanes {
    /// Activation rows `0..rows` go to the lanes kernel (whole groups of 8; rows past `n` are
    /// padding).
    rows: usize,
    /// Most activation rows per call.
    tile: usize,
    /// Most weight rows per call.
    weight_rows: usize,
}

impl Lanes {
    const NONE: Lanes = Lanes {
        rows: 0,
        tile: 0,
        weight_rows: 1,
    };
}

/// Most activation rows any lanes-kernel call takes; activation blocks are multiples of it.
const LANE_TILE: usize = 32;
/// Activation rows per lanes-kernel group (`quant::LANES`).
const LANE_GROUP: usize = 8;
/// A remainder of this many rows past the whole groups of 8 (or a batch of this many) is
/// padded to one more group for the lanes kernels: from 5 rows on, 8 rows in lanes cost less
/// than the one-row kernels' (896×4864, 1 thread, µs per call: Q4_1 5 rows 477 one-row
/// against 8 in lanes 318, Q4_K 430–440 against 295–306, Q8_0 443–447 against 330–336; at 4
/// rows they are even).
#[cfg(target_arch = "x86_64")]
const LANES_PAD_MIN: usize = 5;

/// `LANES_PAD_MIN` for the K-quant lanes kernels: 8 rows in lanes cost less than 4 in the
/// one-row kernels (896×4864, 1 thread, µs per call: Q4_K 256–259 against 336–340, Q6_K
/// 343–352 against 349–359; at 3 rows Q4_K 263–268 and Q6_K 308–312 one-row).
#[cfg(target_arch = "x86_64")]
const K_LANES_PAD_MIN: usize = 4;

/// Groups of 8 activation rows the lanes kernels take for `n` rows, a remainder of `pad_min`
/// or more rows padded to a group.
#[cfg(target_arch = "x86_64")]
fn lane_groups(n: usize, pad_min: usize) -> usize {
    n / LANE_GROUP + usize::from(n % LANE_GROUP >= pad_min)
}
/// Most weight rows any lanes-kernel call takes.
const LANE_ROWS: usize = 4;
/// Weight rows whose lanes-tile outputs `drive` gathers before copying them out (a multiple
/// of `LANE_ROWS`, so kernel calls tile a run exactly).
const LANE_RUN: usize = 8 * LANE_ROWS;
/// From this many activation rows on, the lanes kernels take whole (or padded) groups of 8.
#[cfg(target_arch = "x86_64")]
const LANES_MIN_N: usize = LANES_PAD_MIN;
/// From this many activation rows up to `LANES_MIN_N`, the 32-weight formats take the quads
/// kernels (one group of four, padded). 896×4864, 1 thread, µs per call, quads against the
/// one-row kernels: 3 rows Q4_1 191 / 272, Q8_0 195 / 237, Q5_0 287 / 338; 4 rows Q4_1
/// 185–207 / 323, Q8_0 189–198 / 297, Q5_0 285–289 / 421; at 2 rows the one-row kernels win
/// (Q8_0 166 / 191, Q5_0 261 / 282).
#[cfg(target_arch = "x86_64")]
const QUADS_MIN_N: usize = 3;

/// Quantized activations kept hot while a chunk's weight rows pass over them.
const ACT_BLOCK_BYTES: usize = 256 << 10;

/// Weight rows per parallel task: two tasks per thread for balance (stealing evens out a
/// busy core), but each at least ~16 KiB of weights × activation rows so scheduling stays a
/// small cost. Four per thread lost ~2% of an 8-row SmolLM2 decode step to the handoffs and
/// the tail of each matmul (`examples/step_time`, 2 threads).
fn chunk_rows(rows: usize, n: usize, row_bytes: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let balanced = rows.div_ceil(2 * threads);
    let min_work = (16 << 10) / (row_bytes * n.min(64)).max(1);
    balanced.max(min_work).clamp(1, rows.max(1))
}

#[cfg(test)]
mod tests;
