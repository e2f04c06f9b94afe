//! Scaled dot-product attention of new query tokens against a paged KV cache.
//!
//! Every new token attends to all cached positions of its own sequence up to and including its
//! own position (causal), optionally limited to a sliding window. Prefill, chunked prefill,
//! decode and verification of drafted tokens are all this one call.
//!
//! This file holds the call and its per-task driver (`attend_rows`); the rest is split by job:
//! ```text
//! head_kv      where a (sequence, KV head)'s keys and values are read from (Rows, HeadKv)
//! llama_order  the tile kernels, summing in llama.cpp's 8- and 32-lane orders, its softmax
//! decode_f16   one new token against an f16 cache, vectorized (AVX2, or AVX-512 F)
//! prompt_512   a prompt chunk's 8-lane tiles in 512-bit registers (AVX-512 F)
//! ```

use half::f16;
use rayon::prelude::*;

use crate::kv_store::{KvDtype, LayerKv};

#[cfg(target_arch = "x86_64")]
mod decode_f16;
mod head_kv;
mod llama_order;
#[cfg(target_arch = "x86_64")]
mod prompt_512;

use head_kv::{half_head, single_order, HeadKv, KvScratch};
#[cfg(target_arch = "x86_64")]
use head_kv::{HalfRows, Rows};
use llama_order::{pv_tile, pv_tile32, pv_tile32_by, KEY_TILE, Q_TILE};
use llama_order::{qk_rows32, qk_rows32_by, qk_tile32, qk_tile8, round_f16, softmax_llama};
#[cfg(test)]
use {head_kv::transpose, llama_order::qk_tile};

/// One sequence's share of a step: `len` new tokens at rows `row0..row0+len` of `q`,
/// at positions `pos0..pos0+len`, reading keys through `block_table`.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    pub row0: usize,
    pub len: usize,
    pub pos0: usize,
    pub block_table: &'a [u32],
}

#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub n_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Attend to at most this many most recent positions (the query's own included).
    pub window: Option<usize>,
    /// `cap · tanh(score / cap)` before softmax (Gemma 2).
    pub softcap: Option<f32>,
}

impl AttnParams {
    /// Plain scaled dot-product attention over `n_heads` heads of `head_dim`: scores times
    /// `1/√head_dim`, no window, no softcap.
    pub fn scaled(n_heads: usize, head_dim: usize) -> Self {
        Self {
            n_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
        }
    }
}

/// `q`: `[tokens][n_heads * head_dim]`; `out` the same shape.
///
/// Each (sequence, KV head) reads its keys and values out of the paged cache once
/// (dequantized to f32 in one contiguous run, keys transposed); tasks of a few query rows
/// then share them, so one sequence's prefill spreads over every thread even with one KV head.
/// A task's queries (its rows × the GQA group's heads) go through in tiles of four:
/// ```text
/// scores[4][keys] = Q[4][d] · Kᵀ[d][keys]   16 keys at a time, 8 accumulators in registers
/// softmax per query over its own causal/window range (exact, two passes)
/// out[4][d]       = P[4][keys] · V[keys][d]  16 columns at a time
/// ```
pub fn paged_attention(q: &[f32], kv: &LayerKv, seqs: &[AttnSeq], p: &AttnParams, out: &mut [f32]) {
    let d = p.head_dim;
    let n_kv = kv.shape.n_kv_heads;
    let group = p.n_heads / n_kv;
    let heads: Vec<(usize, usize)> = (0..seqs.len())
        .flat_map(|s| (0..n_kv).map(move |h| (s, h)))
        .collect();
    // Query rows per task: enough tasks to balance the threads, few enough to keep the
    // per-task overhead small.
    let total_rows: usize = seqs.iter().map(|s| s.len).sum::<usize>() * n_kv;
    let per_task = (total_rows / (8 * rayon::current_num_threads().max(1))).clamp(1, 64);
    let half = kv.dtype() == KvDtype::F16;
    let tasks: Vec<(usize, usize, usize)>;
    let results: Vec<Vec<f32>>;
    if seqs.iter().all(|s| s.len <= per_task) {
        // One task per (sequence, KV head) (decode): it reads its keys and values into this
        // thread's reused scratch and attends at once, so the f32 copy stays in cache and no
        // per-step buffers are allocated and zero-filled.
        tasks = heads
            .iter()
            .enumerate()
            .map(|(hi, &(si, _))| (hi, 0, seqs[si].len))
            .collect();
        results = heads
            .par_iter()
            .map(|&(si, kh)| {
                let s = &seqs[si];
                if let Some(head) = half_head(kv, s, kh, d, p.window) {
                    return attend_rows(q, &head, s, kh, group, 0..s.len, half, p);
                }
                SCRATCH.with(|sc| {
                    let mut sc = sc.borrow_mut();
                    let head = sc.fill(kv, &seqs[si], kh, d, p.window);
                    attend_rows(q, &head, &seqs[si], kh, group, 0..seqs[si].len, half, p)
                })
            })
            .collect();
    } else {
        let mut loaded: Vec<KvScratch> = heads.iter().map(|_| KvScratch::default()).collect();
        let views: Vec<HeadKv> = loaded
            .par_iter_mut()
            .zip(&heads)
            .map(|(sc, &(si, kh))| sc.fill(kv, &seqs[si], kh, d, p.window))
            .collect();
        tasks = heads
            .iter()
            .enumerate()
            .flat_map(|(hi, &(si, _))| {
                (0..seqs[si].len)
                    .step_by(per_task)
                    .map(move |r0| (hi, r0, (r0 + per_task).min(seqs[si].len)))
            })
            .collect();
        results = tasks
            .par_iter()
            .map(|&(hi, r0, r1)| {
                let (si, kh) = heads[hi];
                attend_rows(q, &views[hi], &seqs[si], kh, group, r0..r1, half, p)
            })
            .collect();
    }
    // Scatter: each result is `[row][head in group][head_dim]`.
    for (&(hi, r0, r1), res) in tasks.iter().zip(&results) {
        let (si, kh) = heads[hi];
        let s = &seqs[si];
        for r in r0..r1 {
            for g in 0..group {
                let dst = ((s.row0 + r) * p.n_heads + kh * group + g) * d;
                let src = ((r - r0) * group + g) * d;
                out[dst..dst + d].copy_from_slice(&res[src..src + d]);
            }
        }
    }
}

thread_local! {
    /// Each worker thread's buffers for decode attention (see `paged_attention`).
    static SCRATCH: std::cell::RefCell<KvScratch> = std::cell::RefCell::new(KvScratch::default());
}

/// Rows `rows` of one sequence, every query head of KV head `kh`: `[row][head][d]`. With an f16
/// cache, like llama.cpp's CPU path, queries and attention weights are rounded to f16 where
/// they meet it.
#[allow(clippy::too_many_arguments)]
fn attend_rows(
    q: &[f32],
    kv: &HeadKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    rows: std::ops::Range<usize>,
    half: bool,
    p: &AttnParams,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Isa::best() != crate::quant::Isa::Scalar {
        let d = p.head_dim;
        if let (Some((keys, values)), true) = (&kv.half, decode_f16::fits(d)) {
            // One new token (`half_head`): its query heads are one run of `q`.
            let at = ((s.row0 + rows.start) * p.n_heads + kh * group) * d;
            let q = &q[at..at + group * d];
            let (base, scale, cap) = (kv.base, p.scale, p.softcap);
            // SAFETY: `Isa::best` detected AVX2, FMA and F16C (and for `Avx512Vnni` AVX-512
            // F/BW/VL); `fits(d)`.
            return unsafe {
                if crate::quant::Isa::best() == crate::quant::Isa::Avx512Vnni {
                    decode_f16::attend_512(q, group, d, keys, values, base, scale, cap)
                } else {
                    decode_f16::attend(q, group, d, keys, values, base, scale, cap)
                }
            };
        }
        if crate::quant::Isa::best() == crate::quant::Isa::Avx512Vnni && prompt_512::fits(d) {
            // SAFETY: `Isa::best` detected AVX-512 F/BW/VL with AVX2, FMA and F16C.
            return unsafe { attend_rows_avx512(q, kv, s, kh, group, rows, half, p) };
        }
        // SAFETY: `Isa::best` detected AVX2, FMA and F16C.
        return unsafe { attend_rows_avx2(q, kv, s, kh, group, rows, half, p) };
    }
    attend_rows_impl::<false, false>(q, kv, s, kh, group, rows, half, p)
}

/// `attend_rows_avx2` with a prompt chunk's tiles in 512-bit registers (`prompt_512`, same
/// bits); the caller checked `prompt_512::fits(head_dim)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_rows_avx512(
    q: &[f32],
    kv: &HeadKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    rows: std::ops::Range<usize>,
    half: bool,
    p: &AttnParams,
) -> Vec<f32> {
    attend_rows_impl::<true, true>(q, kv, s, kh, group, rows, half, p)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_rows_avx2(
    q: &[f32],
    kv: &HeadKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    rows: std::ops::Range<usize>,
    half: bool,
    p: &AttnParams,
) -> Vec<f32> {
    attend_rows_impl::<true, false>(q, kv, s, kh, group, rows, half, p)
}

/// `WIDE`: the prompt tiles of `prompt_512` (only inside `attend_rows_avx512`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_rows_impl<const FMA: bool, const WIDE: bool>(
    q: &[f32],
    kv: &HeadKv,
    s: &AttnSeq,
    kh: usize,
    group: usize,
    rows: std::ops::Range<usize>,
    half: bool,
    p: &AttnParams,
) -> Vec<f32> {
    let d = p.head_dim;
    let round = |x: f32| if half { f16::from_f32(x).to_f32() } else { x };
    let lo_of = |pos: usize| p.window.map_or(0, |w| (pos + 1).saturating_sub(w)) - kv.base;
    let r0 = rows.start;
    let nq = rows.len() * group;
    let mut res = vec![0f32; nq * d];
    // Query m of this task is row r0 + m / group, head kh·group + m % group.
    let mut qs = vec![0f32; Q_TILE * d];
    let mut scores = Vec::new();
    for m0 in (0..nq).step_by(Q_TILE) {
        let mt = (nq - m0).min(Q_TILE);
        // Per query: its key range [lo, hi) (relative to `kv.base`).
        let mut range = [(0usize, 0usize); Q_TILE];
        for (t, rg) in range.iter_mut().enumerate() {
            let m = m0 + t.min(mt - 1);
            let (r, g) = (r0 + m / group, m % group);
            let pos = s.pos0 + r;
            *rg = (lo_of(pos), pos + 1 - kv.base);
            let at = ((s.row0 + r) * p.n_heads + kh * group + g) * d;
            let qt = &mut qs[t * d..(t + 1) * d];
            qt.iter_mut()
                .zip(&q[at..at + d])
                .for_each(|(o, &x)| *o = round(x));
        }
        let lo = range.iter().map(|r| r.0).min().unwrap_or(0) / KEY_TILE * KEY_TILE;
        let hi = range.iter().map(|r| r.1).max().unwrap_or(0);
        let span = hi - lo;
        scores.clear();
        scores.resize(Q_TILE * span.div_ceil(KEY_TILE) * KEY_TILE, 0f32);
        let sw = span.div_ceil(KEY_TILE) * KEY_TILE;
        // One new token: llama.cpp's `ggml_vec_dot_f16` order; a prompt chunk: tinyBLAS's
        // (which takes only head sizes that are a multiple of 8).
        let single = single_order(s.len, d);
        if WIDE && !single && kv.half.is_none() {
            // SAFETY: `WIDE` only inside `attend_rows_avx512`, which checked `fits(d)`;
            // `scores` is `Q_TILE` rows of `sw`.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                prompt_512::qk_tiles8(&qs, d, kv.keys, (lo, hi), &mut scores, sw)
            };
        } else {
            for j0 in (lo..hi).step_by(KEY_TILE) {
                let tile = if let Some((keys, _)) = &kv.half {
                    qk_rows32_by::<FMA, _>(&qs, d, keys, j0, mt)
                } else if single && d.is_multiple_of(8) {
                    qk_rows32::<FMA>(&qs, d, kv.keys, j0, mt)
                } else if single {
                    qk_tile32::<FMA>(&qs, d, kv.keys_t, kv.stride, j0, mt)
                } else {
                    qk_tile8::<FMA>(&qs, d, kv.keys, j0)
                };
                for (t, row) in tile.iter().enumerate() {
                    scores[t * sw + j0 - lo..][..KEY_TILE].copy_from_slice(row);
                }
            }
        }
        for (t, &(qlo, qhi)) in range.iter().enumerate().take(mt) {
            let row = &mut scores[t * sw..(t + 1) * sw];
            row[..qlo - lo].fill(0.0);
            row[qhi - lo..].fill(0.0);
            let live = &mut row[qlo - lo..qhi - lo];
            live.iter_mut().for_each(|v| *v *= p.scale);
            if let Some(cap) = p.softcap {
                crate::ops::softcap(live, cap);
            }
            #[cfg(target_arch = "x86_64")]
            if FMA {
                // SAFETY: `FMA` only inside the AVX2 (and AVX-512) wrappers of this function.
                unsafe { llama_order::softmax_llama_x86(live, kv.base + qlo) }
            } else {
                softmax_llama(live, kv.base + qlo)
            }
            #[cfg(not(target_arch = "x86_64"))]
            softmax_llama(live, kv.base + qlo);
            if half {
                live.iter_mut().for_each(|v| *v = round_f16(*v));
            }
        }
        for t in mt..Q_TILE {
            scores[t * sw..(t + 1) * sw].fill(0.0);
        }
        let o = if let Some((_, values)) = &kv.half {
            pv_tile32_by::<FMA, _>(&scores, sw, values, d, lo, span, kv.base, mt)
        } else if single {
            pv_tile32::<FMA>(&scores, sw, kv.values, d, lo, span, kv.base, mt)
        } else {
            #[cfg(target_arch = "x86_64")]
            if WIDE {
                // SAFETY: as for `qk_tile8` above.
                unsafe { prompt_512::pv_tile8(&scores, sw, kv.values, d, lo, span, kv.base) }
            } else {
                pv_tile::<FMA, 8>(&scores, sw, kv.values, d, lo, span, kv.base)
            }
            #[cfg(not(target_arch = "x86_64"))]
            pv_tile::<FMA, 8>(&scores, sw, kv.values, d, lo, span, kv.base)
        };
        for t in 0..mt {
            res[(m0 + t) * d..(m0 + t + 1) * d].copy_from_slice(&o[t * d..(t + 1) * d]);
        }
    }
    res
}

#[cfg(test)]
mod tests;
