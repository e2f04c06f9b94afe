//! The tile kernels of `attend_rows_impl`, summing in llama.cpp's orders (docs/DECISIONS.md):
//! `ggml_vec_dot_f16`'s 32 lanes for one new token, tinyBLAS's 8 lanes for a prompt chunk,
//! its softmax arithmetic and f16 rounding. Each function is one stated order; the tests hold
//! the register-blocked variants (`qk_tile32`, `qk_rows32`, `pv_tile32`) to the plain ones.

use super::head_kv::{F32Rows, Row, Rows};

/// Keys per score tile (two 8-lane vectors).
pub(super) const KEY_TILE: usize = 16;
/// Queries per tile.
pub(super) const Q_TILE: usize = 4;

/// `a·b + c`, fused where the build has FMA (`FMA`), else two roundings.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `x` rounded to the nearest f16 (ties to even), as f32; for the attention weights
/// (0..=1), where the `half` crate's per-element conversion was a large share of the time.
#[inline(always)]
pub(super) fn round_f16(x: f32) -> f32 {
    // Below f16's smallest normal (2⁻¹⁴) the step is 2⁻²⁴: adding 0.75 (whose ulp is 2⁻²⁴)
    // rounds to it. Above, keep 10 of f32's 23 mantissa bits, ties to even.
    let sub = (x + 0.75) - 0.75;
    let b = x.to_bits();
    let normal = f32::from_bits((b + 0x0fff + ((b >> 13) & 1)) & !0x1fff);
    if x.abs() < 6.103_515_6e-5 {
        sub
    } else {
        normal
    }
}

/// The eight lanes summed as llama.cpp's x86 `hsum` does: halves, then pairs, then the two.
#[inline(always)]
fn hsum8(a: [f32; 8]) -> f32 {
    let t = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// llama.cpp sums its f16 attention products in one of two orders (docs/DECISIONS.md): a
/// prompt batch goes through tinyBLAS (eight lanes, `NL = 8`), a single new token through
/// `ggml_vec_dot_f16` (four 8-lane accumulators, `NL = 32`). Element `i` of a dot goes to lane
/// `i % NL`; each lane is one FMA chain; `reduce` adds the lanes in that kernel's order.
#[inline(always)]
fn reduce<const NL: usize>(a: [f32; NL]) -> f32 {
    if NL == 8 {
        return hsum8(std::array::from_fn(|l| a[l]));
    }
    // GGML_F32x8_REDUCE: x0 += x2, x1 += x3, x0 += x1, then halves and two `hadd`s.
    let x: [f32; 8] = std::array::from_fn(|l| (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l]));
    let t = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
    (t[0] + t[1]) + (t[2] + t[3])
}

/// Scores of the `Q_TILE` queries in `qs` (`[Q_TILE][d]`) against keys `j0..j0+16`, in
/// llama.cpp's order for `NL` lanes (see `reduce`): the plain statement of the order, which
/// the tests hold `qk_tile32` and `qk_tile8` to.
#[cfg(test)]
pub(super) fn qk_tile<const FMA: bool, const NL: usize>(
    qs: &[f32],
    d: usize,
    keys_t: &[f32],
    stride: usize,
    j0: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let mut acc = [[[0f32; KEY_TILE]; NL]; Q_TILE];
    for c in 0..d {
        let k: &[f32; KEY_TILE] = keys_t[c * stride + j0..][..KEY_TILE]
            .try_into()
            .expect("stride is a multiple of the key tile");
        for (t, a) in acc.iter_mut().enumerate() {
            let qv = qs[t * d + c];
            let a = &mut a[c % NL];
            for l in 0..KEY_TILE {
                a[l] = madd::<FMA>(qv, k[l], a[l]);
            }
        }
    }
    std::array::from_fn(|t| {
        std::array::from_fn(|l| reduce::<NL>(std::array::from_fn(|i| acc[t][i][l])))
    })
}

/// `qk_tile::<FMA, 32>` for the first `mt` queries, with keys as vector lanes (`keys_t`): lane
/// `i`'s chain (head-dimension elements `i, i + 32, …`) runs eight keys at a time, and the 32
/// chains meet in `reduce::<32>`'s tree as they finish — the same order with a few registers
/// instead of `[4][32][16]` accumulators in memory. (Helpers are `inline(always)` fns, not
/// closures: a closure is not compiled with the caller's FMA feature, and `mul_add` in it
/// became a libm call.)
#[inline(always)]
pub(super) fn qk_tile32<const FMA: bool>(
    qs: &[f32],
    d: usize,
    keys_t: &[f32],
    stride: usize,
    j0: usize,
    mt: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let mut out = [[0f32; KEY_TILE]; Q_TILE];
    for (t, o) in out.iter_mut().enumerate().take(mt) {
        let q = &qs[t * d..(t + 1) * d];
        for h in (0..KEY_TILE).step_by(8) {
            let k = &keys_t[j0 + h..];
            // reduce::<32>: x_l = (a_l + a_16+l) + (a_8+l + a_24+l), then
            // ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)).
            let mut x = [[0f32; 8]; 8];
            for (l, xl) in x.iter_mut().enumerate() {
                let (a0, a16) = (
                    chain32::<FMA>(q, k, stride, l),
                    chain32::<FMA>(q, k, stride, 16 + l),
                );
                let (a8, a24) = (
                    chain32::<FMA>(q, k, stride, 8 + l),
                    chain32::<FMA>(q, k, stride, 24 + l),
                );
                *xl = add8(add8(a0, a16), add8(a8, a24));
            }
            let lo = add8(add8(x[0], x[4]), add8(x[1], x[5]));
            let hi = add8(add8(x[2], x[6]), add8(x[3], x[7]));
            o[h..h + 8].copy_from_slice(&add8(lo, hi));
        }
    }
    out
}

/// `qk_tile::<FMA, 32>` for the first `mt` queries with keys as read (`keys[j][d]`, `d` a
/// multiple of 8): per query–key pair, four 8-lane accumulators hold the 32 lanes (lane `i` in
/// accumulator `i / 8`), then `reduce::<32>` — no transposed copy of the keys.
#[inline(always)]
pub(super) fn qk_rows32<const FMA: bool>(
    qs: &[f32],
    d: usize,
    keys: &[f32],
    j0: usize,
    mt: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    qk_rows32_by::<FMA, _>(qs, d, &F32Rows { data: keys, d }, j0, mt)
}

/// `qk_rows32` over any [`Rows`]: each 8 columns of a key are read once for all `mt` queries
/// (each query's chains still run over the columns in order).
#[inline(always)]
pub(super) fn qk_rows32_by<const FMA: bool, R: Rows>(
    qs: &[f32],
    d: usize,
    keys: &R,
    j0: usize,
    mt: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let n = keys.len();
    let mut out = [[0f32; KEY_TILE]; Q_TILE];
    for j in j0..(j0 + KEY_TILE).min(n) {
        let key = keys.row(j);
        let mut a = [[[0f32; 8]; 4]; Q_TILE];
        for c in (0..d).step_by(32) {
            for m in 0..4 {
                if c + 8 * m < d {
                    let kc = key.at8::<FMA>(c + 8 * m);
                    for (t, at) in a.iter_mut().enumerate().take(mt) {
                        let qc = &qs[t * d + c + 8 * m..][..8];
                        for l in 0..8 {
                            at[m][l] = madd::<FMA>(qc[l], kc[l], at[m][l]);
                        }
                    }
                }
            }
        }
        for (t, o) in out.iter_mut().enumerate().take(mt) {
            let a = &a[t];
            let x = add8(add8(a[0], a[2]), add8(a[1], a[3]));
            o[j - j0] = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
        }
    }
    out
}

/// Lane `lane`'s FMA chain of a 32-lane dot for eight keys: `Σ q[c]·k[c·stride + 0..8]` over
/// `c = lane, lane + 32, …`.
#[inline(always)]
fn chain32<const FMA: bool>(q: &[f32], k: &[f32], stride: usize, lane: usize) -> [f32; 8] {
    let mut a = [0f32; 8];
    let mut c = lane;
    while c < q.len() {
        let kc = &k[c * stride..][..8];
        for l in 0..8 {
            a[l] = madd::<FMA>(q[c], kc[l], a[l]);
        }
        c += 32;
    }
    a
}

#[inline(always)]
fn add8(x: [f32; 8], y: [f32; 8]) -> [f32; 8] {
    std::array::from_fn(|l| x[l] + y[l])
}

/// `pv_tile::<FMA, 32>` for the first `mt` weight rows: lane `i`'s chain (the positions
/// `base + lo + j ≡ i mod 32`, in order) runs over up to 64 value columns at once in registers,
/// its result goes to a small buffer, and the 32 lanes then meet in `reduce::<32>`'s tree
/// column by column — the same order without `[4][32][16]` accumulators updated in memory.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn pv_tile32<const FMA: bool>(
    w: &[f32],
    sw: usize,
    values: &[f32],
    d: usize,
    lo: usize,
    span: usize,
    base: usize,
    mt: usize,
) -> Vec<f32> {
    pv_tile32_by::<FMA, _>(w, sw, &F32Rows { data: values, d }, d, lo, span, base, mt)
}

/// `pv_tile32` over any [`Rows`]: the same chains and tree.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn pv_tile32_by<const FMA: bool, R: Rows>(
    w: &[f32],
    sw: usize,
    values: &R,
    d: usize,
    lo: usize,
    span: usize,
    base: usize,
    mt: usize,
) -> Vec<f32> {
    const COLS: usize = 64;
    let mut out = vec![0f32; Q_TILE * d];
    let mut lanes = [[0f32; COLS]; 32];
    let first = (32 - (base + lo) % 32) % 32;
    for t in 0..mt {
        let wt = &w[t * sw..t * sw + span];
        for c0 in (0..d).step_by(COLS) {
            let cols = (d - c0).min(COLS);
            for (i, lane) in lanes.iter_mut().enumerate() {
                let j0 = (first + i) % 32;
                *lane = if cols == COLS {
                    pv_chain::<FMA, R, COLS>(wt, values, lo, c0, j0, COLS)
                } else {
                    pv_chain::<FMA, R, COLS>(wt, values, lo, c0, j0, cols)
                };
            }
            let o = &mut out[t * d + c0..t * d + c0 + cols];
            for (c, oc) in o.iter_mut().enumerate() {
                let a = |i: usize| lanes[i][c];
                let x = |l: usize| (a(l) + a(16 + l)) + (a(8 + l) + a(24 + l));
                *oc = ((x(0) + x(4)) + (x(1) + x(5))) + ((x(2) + x(6)) + (x(3) + x(7)));
            }
        }
    }
    out
}

/// One lane's chain of `pv_tile32_by`: `Σ w[j]·values[lo + j][c0..c0 + cols]` over
/// `j = j0, j0 + 32, …` (`cols` ≤ N), eight columns at a time and the rest one by one. (The
/// full-width call passes the constant `N`, so its column loop unrolls.)
#[inline(always)]
fn pv_chain<const FMA: bool, R: Rows, const N: usize>(
    w: &[f32],
    values: &R,
    lo: usize,
    c0: usize,
    j0: usize,
    cols: usize,
) -> [f32; N] {
    let mut a = [0f32; N];
    let whole = cols / 8 * 8;
    let mut j = j0;
    while j < w.len() {
        let row = values.row(lo + j);
        for c in (0..whole).step_by(8) {
            let vj = row.at8::<FMA>(c0 + c);
            for l in 0..8 {
                a[c + l] = madd::<FMA>(w[j], vj[l], a[c + l]);
            }
        }
        for (c, ac) in a.iter_mut().enumerate().take(cols).skip(whole) {
            *ac = madd::<FMA>(w[j], row.at(c0 + c), *ac);
        }
        j += 32;
    }
    a
}

/// `qk_tile::<FMA, 8>` with the lanes as vector lanes: each query–key pair is one 8-lane
/// chain over the head dimension (keys as read, `[j][d]`, `d` a multiple of 8), reduced with
/// `hsum8` — the same order, with four accumulators in registers instead of 512 floats.
#[inline(always)]
pub(super) fn qk_tile8<const FMA: bool>(
    qs: &[f32],
    d: usize,
    keys: &[f32],
    j0: usize,
) -> [[f32; KEY_TILE]; Q_TILE] {
    let n = keys.len() / d.max(1);
    let mut out = [[0f32; KEY_TILE]; Q_TILE];
    for j in j0..(j0 + KEY_TILE).min(n) {
        let k = &keys[j * d..(j + 1) * d];
        let mut acc = [[0f32; 8]; Q_TILE];
        for (c, kc) in k.chunks_exact(8).enumerate() {
            for (t, a) in acc.iter_mut().enumerate() {
                let q = &qs[t * d + 8 * c..][..8];
                for l in 0..8 {
                    a[l] = madd::<FMA>(q[l], kc[l], a[l]);
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            out[t][j - j0] = hsum8(*a);
        }
    }
    out
}

/// `out[t][c] = Σ_j w[t][j] · values[lo + j][c]` for the `Q_TILE` weight rows of `w`
/// (row stride `sw`, `span` live columns), in llama.cpp's order for `NL` lanes (see `reduce`):
/// position `base + lo + j` (llama.cpp's cache cell) goes to lane `(base + lo + j) % NL`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn pv_tile<const FMA: bool, const NL: usize>(
    w: &[f32],
    sw: usize,
    values: &[f32],
    d: usize,
    lo: usize,
    span: usize,
    base: usize,
) -> Vec<f32> {
    const COLS: usize = 16;
    let mut out = vec![0f32; Q_TILE * d];
    let mut c0 = 0;
    while c0 < d {
        let cols = (d - c0).min(COLS);
        let mut acc = [[[0f32; COLS]; NL]; Q_TILE];
        for j in 0..span {
            let v = &values[(lo + j) * d + c0..][..cols];
            let lane = (base + lo + j) % NL;
            for (t, a) in acc.iter_mut().enumerate() {
                let wv = w[t * sw + j];
                let a = &mut a[lane];
                for l in 0..cols {
                    a[l] = madd::<FMA>(wv, v[l], a[l]);
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            for l in 0..cols {
                out[t * d + c0 + l] = reduce::<NL>(std::array::from_fn(|i| a[i][l]));
            }
        }
        c0 += cols;
    }
    out
}

/// Softmax of one query's scores `x` (position `pos0` first) with llama.cpp's arithmetic: its
/// vectorized `expf`, the values of each 8 consecutive positions (8-aligned, masked ones 0)
/// summed as `hsum` does and added in f64, and the reciprocal of the total rounded to f32.
#[inline(always)]
pub(super) fn softmax_llama(x: &mut [f32], pos0: usize) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    let mut lanes = [0f32; 8];
    let n = x.len();
    for (i, v) in x.iter_mut().enumerate() {
        *v = crate::ops::expf_llama(*v - max);
        let pos = pos0 + i;
        lanes[pos % 8] = *v;
        if pos % 8 == 7 || i + 1 == n {
            sum += hsum8(lanes) as f64;
            lanes = [0.0; 8];
        }
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `softmax_llama` eight positions at a time (`ops::x86::expf` is `expf_llama` per lane): the
/// same maximum (for scores that are not NaN), exponentials, 8-aligned `hsum8` runs added in
/// f64 and scaling, bit for bit (test `vector_softmax_equals_softmax_llama`). A 1,000-token
/// prefill spent most of its attention time in the scalar form.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn softmax_llama_x86(x: &mut [f32], pos0: usize) {
    use std::arch::x86_64::*;
    let n = x.len();
    if n == 0 {
        return;
    }
    let p = x.as_mut_ptr();
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in 0..n / 8 {
        m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(8 * c)));
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let max = x[n / 8 * 8..]
        .iter()
        .chain(&lanes)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let maxv = _mm256_set1_ps(max);
    // Chunk k holds positions pos0 − off + 8k + (0..8), lane l at position ≡ l (mod 8), so its
    // lanes are `softmax_llama`'s `lanes`; indices outside 0..n are masked to 0.
    let off = pos0 % 8;
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut sum = 0f64;
    for k in 0..(off + n).div_ceil(8) {
        let first = 8 * k as isize - off as isize;
        let idx = _mm256_add_epi32(lane, _mm256_set1_epi32(first as i32));
        let live = _mm256_and_si256(
            _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(-1)),
            _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx),
        );
        // Lanes outside 0..n are masked off: never read or written.
        let at = p.wrapping_offset(first);
        let v = _mm256_maskload_ps(at, live);
        let e = _mm256_and_ps(
            crate::ops::x86::expf(_mm256_sub_ps(v, maxv)),
            _mm256_castsi256_ps(live),
        );
        _mm256_maskstore_ps(at, live, e);
        // `hsum8`: t = [e0+e4, e1+e5, e2+e6, e3+e7], then (t0 + t2) + (t1 + t3).
        let t = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps::<1>(e));
        let h = _mm_add_ps(t, _mm_movehl_ps(t, t));
        sum += _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))) as f64;
    }
    let inv = (1.0 / sum) as f32;
    let invv = _mm256_set1_ps(inv);
    for c in 0..n / 8 {
        _mm256_storeu_ps(
            p.add(8 * c),
            _mm256_mul_ps(_mm256_loadu_ps(p.add(8 * c)), invv),
        );
    }
    x[n / 8 * 8..].iter_mut().for_each(|v| *v *= inv);
}
