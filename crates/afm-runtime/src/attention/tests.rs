use super::*;
use crate::kv_store::{KvCache, KvDtype, LayerKvShape};

/// Dense causal attention over contiguous K/V, the textbook formula.
fn dense(
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    pos: usize,
    scale: f32,
    window: Option<usize>,
) -> Vec<f32> {
    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let mut s: Vec<f32> = (first..=pos)
        .map(|j| q.iter().zip(&k[j]).map(|(a, b)| a * b).sum::<f32>() * scale)
        .collect();
    crate::ops::softmax(&mut s);
    let mut o = vec![0.0; q.len()];
    for (w, j) in s.iter().zip(first..=pos) {
        for (x, y) in o.iter_mut().zip(&v[j]) {
            *x += w * y;
        }
    }
    o
}

#[test]
fn paged_equals_dense_across_blocks_and_windows() {
    let d = 4;
    let shape = LayerKvShape {
        n_kv_heads: 1,
        head_dim: d,
    };
    let cases = [
        (KvDtype::F32, 1e-5),
        (KvDtype::F16, 2e-3),
        (KvDtype::Q8, 2e-2),
        (KvDtype::Q4, 0.2),
    ];
    for (dtype, tol) in cases {
        check_against_dense(KvCache::new(&[shape], 8, 3, dtype), tol);
    }
}

/// A prefill chunk (many query rows, causal), GQA, a head size with a ragged tail past
/// the 16-column tiles, windows and softcap: every row and head against the dense formula.
#[test]
fn prefill_rows_equal_dense_per_row() {
    let (d, n_kv, group, bs) = (20, 2, 3, 8);
    let shape = LayerKvShape {
        n_kv_heads: n_kv,
        head_dim: d,
    };
    let val = |i: usize, j: usize| (((i * 13 + j * 7) % 23) as f32 / 11.0 - 1.0) * 0.7;
    let (pos0, len) = (5, 37);
    let ctx = pos0 + len;
    for (dtype, tol) in [(KvDtype::F32, 2e-5), (KvDtype::F16, 3e-3)] {
        let mut cache = KvCache::new(&[shape], 8, bs, dtype);
        let table = [3u32, 6, 1, 7, 0, 2];
        let kv_at = |p: usize, h: usize, off: usize| -> Vec<f32> {
            (0..d).map(|j| val(p + off + 31 * h, j)).collect()
        };
        for p in 0..ctx {
            let k: Vec<f32> = (0..n_kv).flat_map(|h| kv_at(p, h, 0)).collect();
            let v: Vec<f32> = (0..n_kv).flat_map(|h| kv_at(p, h, 5)).collect();
            cache.layers[0].write(&table, p, &k, &v);
        }
        let n_heads = n_kv * group;
        let q: Vec<f32> = (0..len * n_heads * d).map(|i| val(i, 3)).collect();
        for (window, softcap) in [(None, None), (Some(9), None), (None, Some(0.8))] {
            let params = AttnParams {
                n_heads,
                head_dim: d,
                scale: 0.6,
                window,
                softcap,
            };
            let seqs = [AttnSeq {
                row0: 0,
                len,
                pos0,
                block_table: &table,
            }];
            let mut out = vec![0.0; len * n_heads * d];
            paged_attention(&q, &cache.layers[0], &seqs, &params, &mut out);
            for r in 0..len {
                let pos = pos0 + r;
                for h in 0..n_heads {
                    let kh = h / group;
                    let ks: Vec<Vec<f32>> = (0..ctx).map(|p| kv_at(p, kh, 0)).collect();
                    let vs: Vec<Vec<f32>> = (0..ctx).map(|p| kv_at(p, kh, 5)).collect();
                    let qh = &q[(r * n_heads + h) * d..][..d];
                    let want = dense_capped(qh, &ks, &vs, pos, 0.6, window, softcap);
                    let got = &out[(r * n_heads + h) * d..][..d];
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() < tol,
                            "{dtype:?} row {r} head {h}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

/// The register-friendly 32-lane tiles (one new token) sum in exactly the order of the
/// plain per-lane statement (`qk_tile`, `pv_tile`), bit for bit: head sizes below, at
/// and above 32, windows that start off a lane boundary, partial query tiles.
#[test]
fn single_token_tiles_keep_the_32_lane_order() {
    let val = |i: usize| ((i * 2_654_435_761) % 1999) as f32 / 997.0 - 1.0;
    for d in [20, 64, 96, 256] {
        for (n, base) in [(7usize, 0usize), (45, 0), (70, 5), (33, 37)] {
            let stride = n.div_ceil(KEY_TILE) * KEY_TILE;
            let keys: Vec<f32> = (0..n * d).map(|i| val(i + 11)).collect();
            let values: Vec<f32> = (0..n * d).map(|i| val(3 * i + 5)).collect();
            let keys_t = transpose(&keys, d, stride);
            let qs: Vec<f32> = (0..Q_TILE * d).map(|i| val(7 * i + 1)).collect();
            for mt in 1..=Q_TILE {
                for j0 in (0..n).step_by(KEY_TILE) {
                    let want = qk_tile::<true, 32>(&qs, d, &keys_t, stride, j0);
                    let got = qk_tile32::<true>(&qs, d, &keys_t, stride, j0, mt);
                    if d % 8 == 0 {
                        let rows = qk_rows32::<true>(&qs, d, &keys, j0, mt);
                        for t in 0..mt {
                            for l in 0..KEY_TILE.min(n - j0) {
                                assert_eq!(
                                    want[t][l].to_bits(),
                                    rows[t][l].to_bits(),
                                    "rows: d {d} n {n} query {t} key {}",
                                    j0 + l
                                );
                            }
                        }
                    }
                    for t in 0..mt {
                        let same = want[t]
                            .iter()
                            .zip(&got[t])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "scores d {d} n {n} query {t} keys {j0}..");
                    }
                }
                let lo = (n / 3) / KEY_TILE * KEY_TILE;
                let span = n - lo;
                let sw = span.div_ceil(KEY_TILE) * KEY_TILE;
                let w: Vec<f32> = (0..Q_TILE * sw).map(|i| val(5 * i + 2).abs()).collect();
                let want = pv_tile::<true, 32>(&w, sw, &values, d, lo, span, base);
                let got = pv_tile32::<true>(&w, sw, &values, d, lo, span, base, mt);
                for i in 0..mt * d {
                    assert_eq!(
                        want[i].to_bits(),
                        got[i].to_bits(),
                        "values d {d} n {n} base {base} output {i}"
                    );
                }
            }
        }
    }
}

/// Decode with an f16 cache reads keys and values straight from the blocks; its output is
/// bit for bit the output over a converted f32 copy (the path prefill and other caches
/// take): head sizes of one, one and a half and two 64-column passes (the AVX2 kernel of
/// `decode_f16`) and of 8, blocks that split the context off a lane boundary, windows,
/// several sequences.
#[test]
fn f16_decode_from_blocks_equals_converted_copy() {
    let val = |i: usize| ((i * 2_654_435_761) % 1999) as f32 / 997.0 - 1.0;
    for (d, bs) in [(64, 16), (96, 5), (8, 7), (128, 16), (32, 4)] {
        let (n_kv, group) = (2, 3);
        let shape = LayerKvShape {
            n_kv_heads: n_kv,
            head_dim: d,
        };
        let mut cache = KvCache::new(&[shape], 40, bs, KvDtype::F16);
        let tables: [Vec<u32>; 2] = [
            (0..20).map(|i| (i * 7 % 40) as u32).collect(),
            (0..20).map(|i| (39 - i) as u32).collect(),
        ];
        let ctxs = [70usize, 33];
        for (si, table) in tables.iter().enumerate() {
            for p in 0..ctxs[si] {
                let k: Vec<f32> = (0..n_kv * d).map(|i| val(i + 1000 * p + si)).collect();
                let v: Vec<f32> = (0..n_kv * d).map(|i| val(3 * i + 777 * p + si)).collect();
                cache.layers[0].write(table, p, &k, &v);
            }
        }
        let n_heads = n_kv * group;
        let q: Vec<f32> = (0..2 * n_heads * d).map(|i| val(5 * i + 3)).collect();
        let seqs: Vec<AttnSeq> = (0..2)
            .map(|si| AttnSeq {
                row0: si,
                len: 1,
                pos0: ctxs[si] - 1,
                block_table: &tables[si],
            })
            .collect();
        for window in [None, Some(37), Some(9)] {
            let p = AttnParams {
                n_heads,
                head_dim: d,
                scale: 0.3,
                window,
                softcap: None,
            };
            let mut out = vec![0.0; 2 * n_heads * d];
            paged_attention(&q, &cache.layers[0], &seqs, &p, &mut out);
            for (si, s) in seqs.iter().enumerate() {
                for kh in 0..n_kv {
                    let layer = &cache.layers[0];
                    assert!(half_head(layer, s, kh, d, window).is_some());
                    let mut sc = KvScratch::default();
                    let head = sc.fill(layer, s, kh, d, window);
                    let want = attend_rows(&q, &head, s, kh, group, 0..1, true, &p);
                    for g in 0..group {
                        let at = (si * n_heads + kh * group + g) * d;
                        for c in 0..d {
                            assert_eq!(
                                out[at + c].to_bits(),
                                want[g * d + c].to_bits(),
                                "d {d} bs {bs} window {window:?} seq {si} head {kh}/{g} col {c}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// `dense` with an optional softcap on the scaled scores.
fn dense_capped(
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    pos: usize,
    scale: f32,
    window: Option<usize>,
    softcap: Option<f32>,
) -> Vec<f32> {
    let Some(cap) = softcap else {
        return dense(q, k, v, pos, scale, window);
    };
    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let mut s: Vec<f64> = (first..=pos)
        .map(|j| {
            let x: f64 = q
                .iter()
                .zip(&k[j])
                .map(|(a, b)| (a * b) as f64)
                .sum::<f64>();
            cap as f64 * (x * scale as f64 / cap as f64).tanh()
        })
        .collect();
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    s.iter_mut().for_each(|x| *x = (*x - max).exp());
    let sum: f64 = s.iter().sum();
    let mut o = vec![0.0; q.len()];
    for (w, j) in s.iter().zip(first..=pos) {
        for (x, y) in o.iter_mut().zip(&v[j]) {
            *x += (w / sum) as f32 * y;
        }
    }
    o
}

fn check_against_dense(mut cache: KvCache, tol: f32) {
    let d = 4;
    let table = [5u32, 2, 7, 0]; // scattered blocks
    let val = |i: usize, j: usize| ((i * 7 + j * 3) % 11) as f32 / 5.0 - 1.0;
    let ks: Vec<Vec<f32>> = (0..10)
        .map(|i| (0..d).map(|j| val(i, j)).collect())
        .collect();
    let vs: Vec<Vec<f32>> = (0..10)
        .map(|i| (0..d).map(|j| val(i + 3, j)).collect())
        .collect();
    for p in 0..10 {
        cache.layers[0].write(&table, p, &ks[p], &vs[p]);
    }
    for window in [None, Some(4)] {
        let q: Vec<f32> = (0..2 * d).map(|j| val(j, 1)).collect(); // 2 heads share the kv head
        let params = AttnParams {
            n_heads: 2,
            head_dim: d,
            scale: 0.5,
            window,
            softcap: None,
        };
        let seqs = [AttnSeq {
            row0: 0,
            len: 1,
            pos0: 9,
            block_table: &table,
        }];
        let mut out = vec![0.0; 2 * d];
        paged_attention(&q, &cache.layers[0], &seqs, &params, &mut out);
        for h in 0..2 {
            let want = dense(&q[h * d..(h + 1) * d], &ks, &vs, 9, 0.5, window);
            for (a, b) in out[h * d..(h + 1) * d].iter().zip(&want) {
                assert!((a - b).abs() < tol, "{a} vs {b}");
            }
        }
    }
}

/// The 512-bit prompt tiles sum in tinyBLAS's 8-lane order exactly as the portable tiles do:
/// head sizes 16 to 128, key tiles running past the last key, position lanes starting off a
/// multiple of 8, spans that end mid-run.
#[cfg(target_arch = "x86_64")]
#[test]
fn prompt_tiles_512_equal_the_8_lane_tiles() {
    if crate::quant::Isa::best() != crate::quant::Isa::Avx512Vnni {
        return;
    }
    let val = |i: usize| ((i * 2_654_435_761) % 1999) as f32 / 997.0 - 1.0;
    for d in [16, 48, 64, 128] {
        let n = 37;
        let keys: Vec<f32> = (0..n * d).map(|i| val(3 * i + 1)).collect();
        let qs: Vec<f32> = (0..Q_TILE * d).map(|i| val(7 * i + 5)).collect();
        for (lo, hi) in [(0usize, 37usize), (16, 37), (32, 35), (0, 5)] {
            let sw = (hi - lo).div_ceil(KEY_TILE) * KEY_TILE;
            let mut got = vec![0f32; Q_TILE * sw];
            // SAFETY: AVX-512 detected above; `fits(d)`; `got` is Q_TILE rows of `sw`.
            unsafe { prompt_512::qk_tiles8(&qs, d, &keys, (lo, hi), &mut got, sw) };
            for j0 in (lo..hi).step_by(KEY_TILE) {
                let want = llama_order::qk_tile8::<true>(&qs, d, &keys, j0);
                for t in 0..Q_TILE {
                    for k in 0..KEY_TILE.min(hi - j0) {
                        let g = got[t * sw + j0 - lo + k];
                        assert_eq!(
                            want[t][k].to_bits(),
                            g.to_bits(),
                            "qk d {d} {lo}..{hi} {t} {j0}+{k}"
                        );
                    }
                }
            }
        }
        let values: Vec<f32> = (0..n * d).map(|i| val(5 * i + 2)).collect();
        for (lo, span, base) in [
            (0usize, 37usize, 0usize),
            (3, 30, 5),
            (9, 17, 14),
            (1, 8, 7),
            (0, 1, 3),
        ] {
            let sw = span.div_ceil(KEY_TILE) * KEY_TILE;
            let w: Vec<f32> = (0..Q_TILE * sw).map(|i| val(11 * i + 3)).collect();
            let want = pv_tile::<true, 8>(&w, sw, &values, d, lo, span, base);
            // SAFETY: as above; `w` holds Q_TILE rows of `sw`, `values` rows up to `lo + span`.
            let got = unsafe { prompt_512::pv_tile8(&w, sw, &values, d, lo, span, base) };
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "pv d {d} lo {lo} span {span} base {base} at {i}"
                );
            }
        }
    }
}

/// The vectorized softmax rounds as `softmax_llama`: lengths from 1 to past two vectors,
/// positions starting on and off a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[test]
fn vector_softmax_equals_softmax_llama() {
    if crate::quant::Isa::best() == crate::quant::Isa::Scalar {
        return;
    }
    let val = |i: usize| ((i * 2_654_435_761) % 1999) as f32 / 97.0 - 10.0;
    for n in [1, 3, 7, 8, 9, 16, 17, 31, 100] {
        for pos0 in [0, 1, 5, 7, 8, 13] {
            let x: Vec<f32> = (0..n).map(|i| val(i + 31 * pos0 + 7 * n)).collect();
            let (mut want, mut got) = (x.clone(), x);
            llama_order::softmax_llama(&mut want, pos0);
            // SAFETY: AVX2 and FMA detected (`Isa::best` is not scalar).
            unsafe { llama_order::softmax_llama_x86(&mut got, pos0) };
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "n {n} pos0 {pos0} at {i}");
            }
        }
    }
}
