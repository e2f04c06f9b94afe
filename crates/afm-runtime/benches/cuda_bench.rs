//! CUDA micro-benchmarks against the card's own ceiling, measured in the same run:
//! device-to-device copy bandwidth (bytes read + written), then GEMV at Qwen3-0.6B and
//! Qwen3-8B shapes (Q4_K, Q6_K, Q8_0, BF16; GB/s of weights read, as a fraction of the copy
//! rate; quantized ones through the int8/dp4a kernels, with one and four weight rows per
//! thread group, `int8r1`/`int8r4` (`int8`: the automatic choice)), the int8 tensor-core
//! matmul (MMQ) against dequantize + cuBLAS and the int8 GEMV at 17..64 rows, the 16-bit one
//! (MMH) against x → bf16 + cuBLAS at 16..64 rows, Q/K/V and gate+up fused
//! and not, decode attention at 1k and 16k context with split-K on and off, a decode step's
//! prologue + attention in one launch and two
//! (`attend_prologue`), prefill attention (the tensor-core kernel against the SIMT one
//! at Qwen3-0.6B's heads, 1k and 16k tokens) and sampling; `small`: issue #9's latency-bound
//! kernels (add_rms_norm, gated_act, decode attention new against AFM_ATTN_DECODE_OLD's).
//!
//! Every timed buffer set is rotated over ≥ 512 MB so the 60 MB L2 cannot serve repeats; data is
//! random; times are CUDA-event medians of 5 batches after warm-up.
//! Run: `target/cuda/bin/cuda_bench [SECTION...]` (device `AFM_CUDA_DEVICE`, default 0); with
//! section names (copy, gemv, gemv_rows, mmq, mmh, fused_projections, prefill_matmul,
//! decode_attention, attend_prologue, prefill_mma, sampling, small) only those run
//! (the copy ceiling always does). `gemv_rows`: issue #9's one-row 16-bit GEMVs at 1, 2, 4 and 8
//! weight rows per block, and for one matrix also 2 and 4 with two units in flight (`matmul.rs`
//! `half_rows_rule`), with and without the folded norm.
//!
//! Measured 2026-11-29 on the H200 (copy ceiling 4251 GB/s), batch-1 GEMV as % of it (the
//! quantized kernels of then are gone; the int8 ones' times are in bench/RESULTS.md, "Quantized
//! GEMV with int8 activations and dp4a"):
//! ```text
//!                 4096x4096  12288x4096  4096x12288  151936x4096
//! BF16 (own)         66%        91%         91%         108%  (read-only beats read+write copy)
//! BF16 (cuBLAS)      50%        73%         72%
//! decode attention, 32/8 heads, d 128, f16 KV, split-K auto (off):
//!   1k  batch 1  16.9 us (110 us)   16k batch 1   70 us (1671 us)   16k batch 8  342 us (1668 us)
//! ```
//! Small matrices are bound by launch and ramp-up (two launches for quantized types).

use afm_runtime::attention::{AttnParams, AttnSeq};
use afm_runtime::cuda::{
    Activation, AttnBatch, AttnKernel, CudaContext, CudaSlice, DeviceKvCache, DeviceWeight,
    MatmulPath, RopeTable, RowNorm, SampleParams, MMQ_GATED_MAX_ROWS,
};
use afm_runtime::kv_store::{KvDtype, LayerKvShape};
use afm_runtime::ops::{Rope, RopeStyle};
use afm_runtime::{DType, WeightBytes, WeightMatrix};
use half::f16;

type R<T> = Result<T, Box<dyn std::error::Error>>;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn sym(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

const ROTATE_BYTES: usize = 512 << 20;

/// Enough device copies of the matrices `host` (one set) to pass [`ROTATE_BYTES`], so the L2
/// never serves a repeat: (the set's weight bytes, the copies).
fn rotated_sets(c: &CudaContext, host: &[&WeightMatrix]) -> R<(usize, Vec<Vec<DeviceWeight>>)> {
    let set_bytes: usize = host.iter().map(|w| w.bytes().len()).sum();
    let copies = ROTATE_BYTES.div_ceil(set_bytes).clamp(2, 1024);
    let sets = (0..copies)
        .map(|_| host.iter().map(|w| DeviceWeight::upload(c, w)).collect())
        .collect::<Result<_, _>>()?;
    Ok((set_bytes, sets))
}

/// Median over 5 batches of `reps` calls (after 3 warm-up calls) of the mean ms per call.
fn time_ms(c: &mut CudaContext, reps: usize, mut f: impl FnMut(&mut CudaContext, usize)) -> R<f64> {
    for i in 0..3 {
        f(c, i);
    }
    let t = c.timer()?;
    let mut v = Vec::new();
    for b in 0..5 {
        t.start(c)?;
        for i in 0..reps {
            f(c, b * reps + i);
        }
        t.stop(c)?;
        v.push(t.elapsed_ms()? as f64 / reps as f64);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[2])
}

fn random_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> R<WeightMatrix> {
    let n = dtype.row_bytes(cols).ok_or("unaligned")? * rows;
    let mut b: Vec<u8> = (0..n.div_ceil(8))
        .flat_map(|_| rng.next().to_le_bytes())
        .collect();
    b.truncate(n);
    let scale = f16::from_f32(0.004).to_le_bytes();
    match dtype {
        DType::BF16 => b
            .chunks_exact_mut(2)
            .for_each(|x| x[1] = 0x3c | (x[1] & 0x80)),
        DType::Q8_0 => b
            .chunks_exact_mut(34)
            .for_each(|k| k[..2].copy_from_slice(&scale)),
        DType::Q4K => b.chunks_exact_mut(144).for_each(|k| {
            k[..2].copy_from_slice(&scale);
            k[2..4].copy_from_slice(&scale);
        }),
        DType::Q6K => b
            .chunks_exact_mut(210)
            .for_each(|k| k[208..].copy_from_slice(&scale)),
        _ => {}
    }
    Ok(WeightMatrix::new(
        dtype,
        rows,
        cols,
        WeightBytes::from_vec(b),
    )?)
}

fn copy_ceiling(c: &mut CudaContext) -> R<f64> {
    let n = 1usize << 31; // 2 GiB each way
    let src: CudaSlice<u8> = c.upload(&vec![0x5au8; n])?;
    let mut dst: CudaSlice<u8> = c.alloc(n)?;
    let ms = time_ms(c, 10, |c, _| c.copy(&src, &mut dst).expect("copy"))?;
    Ok(2.0 * n as f64 / ms / 1e6)
}

/// Qwen3-0.6B projections (q, k/v, gate/up, down): narrow matrices, where launch, ramp-up and
/// idle threads weigh most.
const QWEN3_06B: [(usize, usize); 4] = [(2048, 1024), (1024, 1024), (3072, 1024), (1024, 3072)];
/// Qwen3-8B projections (q/o, gate/up, down) and its 151936-row output matrix (batch 1 only).
const QWEN3_8B: [(usize, usize); 4] = [(4096, 4096), (12288, 4096), (4096, 12288), (151_936, 4096)];

/// The paths timed for `n` rows of `dtype`: quantized weights through the int8 GEMV with one
/// and with four weight rows per thread group (`Auto` picks one by grid size), and past 8 rows
/// also dequantize + cuBLAS.
fn bench_paths(dtype: DType, rows: usize, n: usize) -> &'static [MatmulPath] {
    let quant = dtype != DType::BF16;
    match (quant, n) {
        (true, 1..=8) => &[MatmulPath::GemvRows(1), MatmulPath::GemvRows(4)],
        (true, _) => &[MatmulPath::Gemv, MatmulPath::Gemm],
        (false, 1) if rows < 100_000 => &[MatmulPath::Gemv, MatmulPath::Gemm],
        (false, _) => &[MatmulPath::Gemv],
    }
}

fn path_name(dtype: DType, path: MatmulPath) -> &'static str {
    match path {
        MatmulPath::Gemm => "cuBLAS",
        MatmulPath::GemvRows(1) => "int8r1",
        MatmulPath::GemvRows(_) => "int8r4",
        _ if dtype == DType::BF16 => "gemv",
        _ => "int8",
    }
}

fn gemv(c: &mut CudaContext, copy_gbs: f64, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(1);
    let shapes = QWEN3_06B
        .iter()
        .map(|&s| (s, true))
        .chain(QWEN3_8B.iter().map(|&s| (s, false)));
    for dtype in [DType::Q4K, DType::Q6K, DType::Q8_0, DType::BF16] {
        for ((rows, cols), small) in shapes.clone() {
            let w = random_weight(&mut rng, dtype, rows, cols)?;
            let (bytes, ws) = rotated_sets(c, &[&w])?;
            // Quantized 8B matrices also at 16 and 32 rows, by GEMV launches and by the
            // dequantize + cuBLAS path, to place the switch between them (`matmul.rs`).
            let quant = dtype != DType::BF16;
            let batches: &[usize] = match (rows > 100_000, quant, small) {
                (true, _, _) => &[1],
                (false, true, false) => &[1, 8, 16, 32],
                _ => &[1, 8],
            };
            for &n in batches {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
                let xd = c.upload(&x)?;
                let mut y: CudaSlice<f32> = c.alloc(n * rows)?;
                for &path in bench_paths(dtype, rows, n) {
                    let ms = time_ms(c, 20, |c, i| {
                        c.matmul_with(path, &ws[i % ws.len()][0], &xd, n, &mut y)
                            .expect("matmul")
                    })?;
                    let gbs = bytes as f64 / ms / 1e6;
                    out.push(format!(
                        "| {:5} | {rows:6}x{cols:<5} | {n:2} | {:6} | {:7.2} us | {gbs:7.0} GB/s | {:5.1}% |",
                        dtype.name(),
                        path_name(dtype, path),
                        ms * 1e3,
                        100.0 * gbs / copy_gbs
                    ));
                    println!("{}", out.last().expect("pushed"));
                }
            }
        }
    }
    Ok(())
}

/// One row's kinds of 16-bit product in a decode step, as the engine launches them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OneRow {
    /// q+k+v in one launch (`gemv3`).
    Qkv,
    /// The same of rms_norm(x) (`gemv3n`).
    QkvNorm,
    /// A separate `rms_norm` launch, then `Qkv`: what `QkvNorm` replaces.
    NormThenQkv,
    /// One matrix with the residual add folded in (`gemva`: O, down).
    Add,
    /// One matrix (`gemv`: lm_head).
    Plain,
    /// gate+up with SiLU (`gemvg`).
    Gated,
    /// The same of rms_norm(x) (`gemvgn`; at 4,096 columns only with the override's
    /// `gated_norm_any_width`, as the engine does not fold it there at R = 4).
    GatedNorm,
    /// A separate `rms_norm` launch, then `Gated`.
    NormThenGated,
}

/// Issue #9's one-row 16-bit GEMVs at each block shape (weight rows per block R = 1, 2, 4, 8,
/// and for one matrix, O, down and lm_head, R = 2 and 4 with two units of each row in flight,
/// "2u2" and "4u2"; forced through `set_gemv_half`, then `auto`: `matmul.rs`'s table) on
/// Qwen3-0.6B and Qwen3-8B bf16 shapes: µs, GB/s of weights read and its fraction of the copy
/// ceiling. The folded norms beside a separate norm launch plus the unfolded kernel. Weights
/// rotate over ≥ 512 MB ([`rotated_sets`]).
fn gemv_rows(c: &mut CudaContext, copy_gbs: f64, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(10);
    // (model, hidden, q rows, kv rows, intermediate); O is hidden x q.
    for (model, h, q, kv, inter) in [
        ("Qwen3-0.6B", 1024, 2048, 1024, 3072),
        ("Qwen3-8B", 4096, 4096, 1024, 12288),
    ] {
        let vocab = 151_936;
        // (what, kind, matrices (rows, cols))
        let cases = [
            ("q+k+v", OneRow::Qkv, vec![(q, h), (kv, h), (kv, h)]),
            (
                "norm q+k+v",
                OneRow::QkvNorm,
                vec![(q, h), (kv, h), (kv, h)],
            ),
            (
                "norm, q+k+v",
                OneRow::NormThenQkv,
                vec![(q, h), (kv, h), (kv, h)],
            ),
            ("o +=", OneRow::Add, vec![(h, q)]),
            ("down +=", OneRow::Add, vec![(h, inter)]),
            ("gate+up", OneRow::Gated, vec![(inter, h), (inter, h)]),
            (
                "norm gate+up",
                OneRow::GatedNorm,
                vec![(inter, h), (inter, h)],
            ),
            (
                "norm, gate+up",
                OneRow::NormThenGated,
                vec![(inter, h), (inter, h)],
            ),
            ("lm_head", OneRow::Plain, vec![(vocab, h)]),
        ];
        let x: Vec<f32> = (0..h.max(inter).max(q)).map(|_| rng.sym()).collect();
        let g: Vec<f32> = (0..h).map(|_| 0.5 + rng.sym().abs()).collect();
        let gd = c.upload(&g)?;
        for (what, kind, mats) in cases {
            let host: Vec<WeightMatrix> = mats
                .iter()
                .map(|&(r, k)| random_weight(&mut rng, DType::BF16, r, k))
                .collect::<R<_>>()?;
            let (bytes, sets) = rotated_sets(c, &host.iter().collect::<Vec<_>>())?;
            let cols = mats[0].1;
            let xd = c.upload(&x[..cols])?;
            let mut xn: CudaSlice<f32> = c.alloc(cols)?;
            let mut ys: Vec<CudaSlice<f32>> = mats
                .iter()
                .map(|&(r, _)| c.alloc(r))
                .collect::<Result<_, _>>()?;
            // Two units in flight only where the kernels have them (the others would repeat R).
            let one_matrix = matches!(kind, OneRow::Add | OneRow::Plain);
            let shapes = ["1", "2", "4", "8"]
                .into_iter()
                .chain(one_matrix.then_some(["2u2", "4u2"]).into_iter().flatten())
                .map(Some)
                .chain([None]);
            for block in shapes {
                c.set_gemv_half(block, true)?;
                let ms = time_ms(c, 20, |c, i| {
                    let set = &sets[i % sets.len()];
                    let norm = || RowNorm {
                        w: gd.slice(..),
                        eps: 1e-6,
                    };
                    if matches!(kind, OneRow::NormThenQkv | OneRow::NormThenGated) {
                        c.rms_norm(&xd, &gd, 1e-6, &mut xn).expect("rms_norm");
                    }
                    let ws: Vec<&DeviceWeight> = set.iter().collect();
                    let done = match kind {
                        OneRow::Qkv => {
                            let mut o: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
                            c.matmul_many(&ws, &xd, 1, &mut o)
                        }
                        OneRow::NormThenQkv => {
                            let mut o: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
                            c.matmul_many(&ws, &xn, 1, &mut o)
                        }
                        OneRow::QkvNorm => {
                            let mut o: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
                            c.matmul_many_norm(&ws, &xd, norm(), 1, &mut o)
                        }
                        OneRow::Add => c.matmul_add(ws[0], &xd, 1, &mut ys[0]).map(|_| true),
                        OneRow::Plain => c.matmul(ws[0], &xd, 1, &mut ys[0]).map(|_| true),
                        OneRow::Gated => {
                            c.matmul_gated(ws[0], ws[1], Activation::Silu, &xd, 1, &mut ys[0])
                        }
                        OneRow::NormThenGated => {
                            c.matmul_gated(ws[0], ws[1], Activation::Silu, &xn, 1, &mut ys[0])
                        }
                        OneRow::GatedNorm => c.matmul_gated_norm(
                            ws[0],
                            ws[1],
                            Activation::Silu,
                            &xd,
                            norm(),
                            1,
                            &mut ys[0],
                        ),
                    };
                    assert!(done.expect("one-row GEMV"), "{what}: the GEMV declined");
                })?;
                let gbs = bytes as f64 / ms / 1e6;
                let shape = mats
                    .iter()
                    .map(|&(r, k)| format!("{r}x{k}"))
                    .collect::<Vec<_>>()
                    .join("+");
                let r = block.map_or("auto".to_string(), |r| format!("R={r}"));
                out.push(format!(
                    "| gemv_rows {model:10} | {what:13} | {shape:24} | {r:6} | {:7.2} us | {gbs:5.0} GB/s | {:5.1}% |",
                    ms * 1e3,
                    100.0 * gbs / copy_gbs
                ));
                println!("{}", out.last().expect("pushed"));
            }
        }
    }
    c.set_gemv_half(None, false)?;
    Ok(())
}

/// Qwen3-8B's projections (q/o, down, gate/up, k/v) in Q4_K and Q6_K at 17, 32 and 64
/// activation rows, the batch sizes that `matmul.rs` sends to MMQ: MMQ (activation quantization
/// included; columns split over 4 and over 8 warps per block, `mmq.rs` picks 8 from 4096
/// columns) against dequantize + cuBLAS and the int8 GEMV (launches of 8 rows), µs and GB/s of
/// weights read; then gate+up with SiLU as the engine runs them against two MMQ launches, and
/// Q/K/V in one launch against three. Weights rotate over ≥ 512 MB ([`rotated_sets`]).
fn mmq(c: &mut CudaContext, copy_gbs: f64, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(7);
    let shapes = [(4096, 4096), (4096, 12288), (12288, 4096), (1024, 4096)];
    for dtype in [DType::Q4K, DType::Q6K] {
        for (rows, cols) in shapes {
            let w = random_weight(&mut rng, dtype, rows, cols)?;
            let (bytes, ws) = rotated_sets(c, &[&w])?;
            for n in [17, 32, 64] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
                let xd = c.upload(&x)?;
                let mut y: CudaSlice<f32> = c.alloc(n * rows)?;
                for (path, name) in [
                    (MatmulPath::MmqWarps(4), "MMQ w4"),
                    (MatmulPath::MmqWarps(8), "MMQ w8"),
                    (MatmulPath::Gemm, "cuBLAS"),
                    (MatmulPath::Gemv, "int8"),
                ] {
                    let ms = time_ms(c, 20, |c, i| {
                        c.matmul_with(path, &ws[i % ws.len()][0], &xd, n, &mut y)
                            .expect("matmul")
                    })?;
                    let gbs = bytes as f64 / ms / 1e6;
                    out.push(format!(
                        "| {:5} | {rows:5}x{cols:<5} | {n:2} | {name:6} | {:7.2} us | {gbs:6.0} GB/s | {:5.1}% |",
                        dtype.name(),
                        ms * 1e3,
                        100.0 * gbs / copy_gbs
                    ));
                    println!("{}", out.last().expect("pushed"));
                }
            }
        }
    }
    // Qwen3-8B's gate and up (Q4_K) with SiLU as the engine runs them (one fused MMQ launch up
    // to MMQ_GATED_MAX_ROWS rows; past it one two-matrix launch, then the activation) against
    // two MMQ launches (each quantizing x again; the SiLU not applied).
    let (rows, cols) = (12288, 4096);
    let host = [
        random_weight(&mut rng, DType::Q4K, rows, cols)?,
        random_weight(&mut rng, DType::Q4K, rows, cols)?,
    ];
    let (set_bytes, sets) = rotated_sets(c, &[&host[0], &host[1]])?;
    for n in [32, 64] {
        let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
        let xd = c.upload(&x)?;
        let mut y: CudaSlice<f32> = c.alloc(n * rows)?;
        let mut y2: CudaSlice<f32> = c.alloc(n * rows)?;
        let mut act: CudaSlice<f32> = c.alloc(n * rows)?;
        let fused = n <= MMQ_GATED_MAX_ROWS;
        let engine = time_ms(c, 20, |c, i| {
            let (g, u) = (&sets[i % sets.len()][0], &sets[i % sets.len()][1]);
            if fused {
                let done = c.matmul_gated(g, u, Activation::Silu, &xd, n, &mut act);
                assert!(done.expect("gated"), "MMQ gate+up applies (AFM_MMQ=0 set?)");
            } else {
                let done = c.matmul_many(&[g, u], &xd, n, &mut [&mut y, &mut y2]);
                assert!(
                    done.expect("gate+up"),
                    "MMQ gate+up applies (AFM_MMQ=0 set?)"
                );
                c.gated_act(Activation::Silu, &y, &y2, n, rows, rows, &mut act)
                    .expect("activation");
            }
        })?;
        let separate = time_ms(c, 20, |c, i| {
            let (g, u) = (&sets[i % sets.len()][0], &sets[i % sets.len()][1]);
            c.matmul_with(MatmulPath::Mmq, g, &xd, n, &mut y)
                .expect("gate");
            c.matmul_with(MatmulPath::Mmq, u, &xd, n, &mut y2)
                .expect("up");
        })?;
        let how = if fused { "fused" } else { "2 + act" };
        out.push(format!(
            "| gate+up Q4_K {rows}x{cols} | {n:2} | MMQ {how:7} {:7.2} us | separate {:7.2} us | {:6.0} GB/s |",
            engine * 1e3,
            separate * 1e3,
            set_bytes as f64 / engine / 1e6
        ));
        println!("{}", out.last().expect("pushed"));
    }
    // Qwen3-8B's Q (Q4_K), K (Q4_K) and V (Q6_K), as in a Q4_K_M file: one quantization and one
    // MMQ launch against three of each.
    let mats = [(DType::Q4K, 4096), (DType::Q4K, 1024), (DType::Q6K, 1024)];
    let host: Vec<WeightMatrix> = mats
        .iter()
        .map(|&(t, r)| random_weight(&mut rng, t, r, cols))
        .collect::<R<_>>()?;
    let (set_bytes, sets) = rotated_sets(c, &host.iter().collect::<Vec<_>>())?;
    let copies = sets.len();
    for n in [32, 64] {
        let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
        let xd = c.upload(&x)?;
        let mut ys: Vec<CudaSlice<f32>> = mats
            .iter()
            .map(|&(_, r)| c.alloc(n * r))
            .collect::<Result<_, _>>()?;
        let fused = time_ms(c, 20, |c, i| {
            let ws: Vec<&DeviceWeight> = sets[i % copies].iter().collect();
            let mut outs: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
            let done = c.matmul_many(&ws, &xd, n, &mut outs);
            assert!(done.expect("q+k+v"), "MMQ Q/K/V applies (AFM_MMQ=0 set?)");
        })?;
        let separate = time_ms(c, 20, |c, i| {
            for (w, y) in sets[i % copies].iter().zip(ys.iter_mut()) {
                c.matmul_with(MatmulPath::Mmq, w, &xd, n, y)
                    .expect("matmul");
            }
        })?;
        out.push(format!(
            "| q+k+v Q4_K_M x {cols} | {n:2} | MMQ one launch {:7.2} us | three {:7.2} us | {:6.0} GB/s one |",
            fused * 1e3,
            separate * 1e3,
            set_bytes as f64 / fused / 1e6
        ));
        println!("{}", out.last().expect("pushed"));
    }
    Ok(())
}

/// Issue #9's 16-bit matmul at 16, 32 and 64 rows (BF16, Qwen3-8B and -0.6B projections):
/// MMH with its automatic shape against the cuBLAS path it replaces (x → bf16 conversion
/// included), µs and GB/s of weights read, then every forced shape (4 or 8 warps per block,
/// K split 1..16 ways) to check `mmh.rs`'s choice; then Q/K/V in one launch, gate+up fused and
/// as a two-matrix launch plus the activation, and the O projection with the residual add
/// folded in (`matmul_add`) against matmul + add. Weights rotate over ≥ 512 MB. The Q/K/V
/// and gate+up lines go through automatic path choice: run with `AFM_MMH=1` while MMH is off
/// by default.
/// Median ms of `path` over the rotated weight copies `ws` (each set's first matrix) and x.
fn time_path(
    c: &mut CudaContext,
    path: MatmulPath,
    ws: &[Vec<DeviceWeight>],
    x: &CudaSlice<f32>,
    n: usize,
    y: &mut CudaSlice<f32>,
) -> R<f64> {
    time_ms(c, 20, |c, i| {
        c.matmul_with(path, &ws[i % ws.len()][0], x, n, y)
            .expect("matmul")
    })
}

fn mmh(c: &mut CudaContext, copy_gbs: f64, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(8);
    let shapes = QWEN3_8B[..3]
        .iter()
        .chain(&[(1024, 4096)])
        .chain(&QWEN3_06B)
        .copied();
    for (rows, cols) in shapes {
        let w = random_weight(&mut rng, DType::BF16, rows, cols)?;
        let (bytes, ws) = rotated_sets(c, &[&w])?;
        for n in [16, 32, 64] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
            let xd = c.upload(&x)?;
            let mut y: CudaSlice<f32> = c.alloc(n * rows)?;
            let mut time = |c: &mut CudaContext, path| time_path(c, path, &ws, &xd, n, &mut y);
            let auto = time(c, MatmulPath::Mmh)?;
            let blas = time(c, MatmulPath::Gemm)?;
            let MatmulPath::MmhWith {
                warps: aw,
                splits: asp,
                fixup: afx,
                prefetch: apf,
            } = c.mmh_auto_path(&[rows], false, cols, n)
            else {
                unreachable!("mmh_auto_path returns MmhWith");
            };
            // The automatic shape with other prefetch distances and the other way of summing the
            // splits, then every warps x splits (f: the last split sums in the kernel, r:
            // mmh_reduce).
            let mut sweep = Vec::new();
            for prefetch in [0, 2, 8] {
                let path = MatmulPath::MmhWith {
                    warps: aw,
                    splits: asp,
                    fixup: afx,
                    prefetch,
                };
                sweep.push(format!("pf{prefetch} {:.1}", time(c, path)? * 1e3));
            }
            let how = |fixup: bool| if fixup { "f" } else { "r" };
            if asp > 1 {
                let path = MatmulPath::MmhWith {
                    warps: aw,
                    splits: asp,
                    fixup: !afx,
                    prefetch: apf,
                };
                sweep.push(format!("{} {:.1}", how(!afx), time(c, path)? * 1e3));
            }
            for warps in [4, 8] {
                for splits in [1, 2, 4, 8, 16].into_iter().filter(|&s| s <= cols / 64) {
                    for fixup in [true, false].into_iter().filter(|&f| f || splits > 1) {
                        let path = MatmulPath::MmhWith {
                            warps,
                            splits,
                            fixup,
                            prefetch: apf,
                        };
                        let ms = time(c, path)?;
                        sweep.push(format!("w{warps}s{splits}{} {:.1}", how(fixup), ms * 1e3));
                    }
                }
            }
            let gbs = bytes as f64 / auto / 1e6;
            out.push(format!(
                "| BF16 {rows:5}x{cols:<5} | {n:2} | MMH w{aw}s{asp}{}pf{apf} {:6.2} us {gbs:5.0} GB/s {:5.1}% | cuBLAS {:6.2} us | {} |",
                how(afx),
                auto * 1e3,
                100.0 * gbs / copy_gbs,
                blas * 1e3,
                sweep.join(", ")
            ));
            println!("{}", out.last().expect("pushed"));
        }
    }
    // Q/K/V (one MMH launch vs three cuBLAS calls, each converting x) and gate+up (fused with
    // SiLU; as one two-matrix launch + the activation; cuBLAS twice + the activation).
    for (hidden, q, kv, ff) in [(4096, 4096, 1024, 12288), (1024, 2048, 1024, 3072)] {
        let host: Vec<WeightMatrix> = [q, kv, kv, ff, ff]
            .iter()
            .map(|&r| random_weight(&mut rng, DType::BF16, r, hidden))
            .collect::<R<_>>()?;
        let (set_bytes, sets) = rotated_sets(c, &host.iter().collect::<Vec<_>>())?;
        let qkv_bytes = (q + 2 * kv) * hidden * 2;
        let copies = sets.len();
        for n in [32, 64] {
            let x: Vec<f32> = (0..n * hidden).map(|_| rng.sym()).collect();
            let xd = c.upload(&x)?;
            let mut ys: Vec<CudaSlice<f32>> = [q, kv, kv, ff, ff, ff]
                .iter()
                .map(|&r| c.alloc(n * r))
                .collect::<Result<_, _>>()?;
            let one = time_ms(c, 20, |c, i| {
                let ws: Vec<&DeviceWeight> = sets[i % copies][..3].iter().collect();
                let mut outs: Vec<&mut CudaSlice<f32>> = ys[..3].iter_mut().collect();
                let done = c.matmul_many(&ws, &xd, n, &mut outs).expect("q+k+v");
                assert!(
                    done,
                    "MMH Q/K/V applies (automatic path choice takes MMH: AFM_MMH)"
                );
            })?;
            let three = time_ms(c, 20, |c, i| {
                for (w, y) in sets[i % copies][..3].iter().zip(ys.iter_mut()) {
                    c.matmul_with(MatmulPath::Gemm, w, &xd, n, y)
                        .expect("matmul");
                }
            })?;
            out.push(format!(
                "| q+k+v BF16 x {hidden} | {n:2} | MMH one launch {:7.2} us {:5.0} GB/s | cuBLAS x3 {:7.2} us |",
                one * 1e3,
                qkv_bytes as f64 / one / 1e6,
                three * 1e3
            ));
            println!("{}", out.last().expect("pushed"));
            let (gu, rest) = ys[3..].split_at_mut(2);
            let (g, u) = gu.split_at_mut(1);
            let act = &mut rest[0];
            let fused = time_ms(c, 20, |c, i| {
                let (wg, wu) = (&sets[i % copies][3], &sets[i % copies][4]);
                c.matmul_gated_with(MatmulPath::Mmh, wg, wu, Activation::Silu, &xd, n, act)
                    .expect("gated");
            })?;
            let two = time_ms(c, 20, |c, i| {
                let (wg, wu) = (&sets[i % copies][3], &sets[i % copies][4]);
                let done = c.matmul_many(&[wg, wu], &xd, n, &mut [&mut g[0], &mut u[0]]);
                assert!(
                    done.expect("gate+up"),
                    "MMH gate+up applies (automatic path choice takes MMH: AFM_MMH)"
                );
                c.gated_act(Activation::Silu, &g[0], &u[0], n, ff, ff, act)
                    .expect("activation");
            })?;
            let blas = time_ms(c, 20, |c, i| {
                let (wg, wu) = (&sets[i % copies][3], &sets[i % copies][4]);
                c.matmul_with(MatmulPath::Gemm, wg, &xd, n, &mut g[0])
                    .expect("gate");
                c.matmul_with(MatmulPath::Gemm, wu, &xd, n, &mut u[0])
                    .expect("up");
                c.gated_act(Activation::Silu, &g[0], &u[0], n, ff, ff, act)
                    .expect("activation");
            })?;
            // The fused launch at other shapes (the automatic one first in the line).
            let mut sweep = vec![format!("{:?}", c.mmh_auto_path(&[ff], true, hidden, n))];
            for (warps, splits) in [(4, 1), (8, 1), (4, 2), (8, 2), (8, 4)] {
                let path = MatmulPath::MmhWith {
                    warps,
                    splits,
                    fixup: splits <= 2,
                    prefetch: 4,
                };
                let ms = time_ms(c, 20, |c, i| {
                    let (wg, wu) = (&sets[i % copies][3], &sets[i % copies][4]);
                    c.matmul_gated_with(path, wg, wu, Activation::Silu, &xd, n, act)
                        .expect("gated");
                })?;
                sweep.push(format!("w{warps}s{splits} {:.1}", ms * 1e3));
            }
            out.push(format!(
                "| gate+up BF16 {ff}x{hidden} | {n:2} | MMH fused {:7.2} us {:5.0} GB/s | MMH 2 + act {:7.2} us | cuBLAS x2 + act {:7.2} us | {} |",
                fused * 1e3,
                (set_bytes - qkv_bytes) as f64 / fused / 1e6,
                two * 1e3,
                blas * 1e3,
                sweep.join(", ")
            ));
            println!("{}", out.last().expect("pushed"));
        }
    }
    // The O projection with the residual add: one MMH launch with accumulate, against MMH +
    // add and the cuBLAS path + add.
    let (rows, cols) = (4096, 4096);
    let w = random_weight(&mut rng, DType::BF16, rows, cols)?;
    let (_, ws) = rotated_sets(c, &[&w])?;
    for n in [32, 64] {
        let xd = c.upload(&(0..n * cols).map(|_| rng.sym()).collect::<Vec<f32>>())?;
        let mut h: CudaSlice<f32> = c.zeros(n * rows)?;
        let mut y: CudaSlice<f32> = c.alloc(n * rows)?;
        let folded = time_ms(c, 20, |c, i| {
            c.matmul_into(MatmulPath::Mmh, &ws[i % ws.len()][0], &xd, n, &mut h, true)
                .expect("matmul_add");
        })?;
        let mut with_add = |c: &mut CudaContext, path| {
            time_ms(c, 20, |c, i| {
                c.matmul_with(path, &ws[i % ws.len()][0], &xd, n, &mut y)
                    .expect("matmul");
                c.add_assign(&mut h, &y).expect("add");
            })
        };
        let (mmh_add, blas_add) = (
            with_add(c, MatmulPath::Mmh)?,
            with_add(c, MatmulPath::Gemm)?,
        );
        out.push(format!(
            "| o_proj + residual BF16 {rows}x{cols} | {n:2} | MMH accumulate {:7.2} us | MMH + add {:7.2} us | cuBLAS + add {:7.2} us |",
            folded * 1e3,
            mmh_add * 1e3,
            blas_add * 1e3
        ));
        println!("{}", out.last().expect("pushed"));
    }
    Ok(())
}

/// One layer's projections of one input through shared int8 activations, Qwen3-0.6B and -8B
/// shapes as in a Q4_K_M file, each fused and as separate matmuls (each quantizing again):
/// Q (Q4_K), K (Q4_K) and V (Q6_K) in one launch against three; gate and up (Q4_K) with the
/// SiLU in one launch against two (without the SiLU).
fn fused_projections(c: &mut CudaContext, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(6);
    // (hidden, q rows, kv rows, intermediate)
    for (cols, q, kv, inter) in [(1024, 2048, 1024, 3072), (4096, 4096, 1024, 12288)] {
        let qkv = [(DType::Q4K, q), (DType::Q4K, kv), (DType::Q6K, kv)];
        let gu = [(DType::Q4K, inter), (DType::Q4K, inter)];
        for (name, mats) in [("q+k+v", &qkv[..]), ("gate+up", &gu[..])] {
            let host: Vec<WeightMatrix> = mats
                .iter()
                .map(|&(t, r)| random_weight(&mut rng, t, r, cols))
                .collect::<R<_>>()?;
            let (_, sets) = rotated_sets(c, &host.iter().collect::<Vec<_>>())?;
            let copies = sets.len();
            for n in [1, 8] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
                let xd = c.upload(&x)?;
                let mut ys: Vec<CudaSlice<f32>> = mats
                    .iter()
                    .map(|&(_, r)| c.alloc(n * r))
                    .collect::<Result<_, _>>()?;
                let fused = time_ms(c, 20, |c, i| {
                    let set = &sets[i % copies];
                    let done = if set.len() == 2 {
                        c.matmul_gated(&set[0], &set[1], Activation::Silu, &xd, n, &mut ys[0])
                    } else {
                        let ws: Vec<&DeviceWeight> = set.iter().collect();
                        let mut outs: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
                        c.matmul_many(&ws, &xd, n, &mut outs)
                    };
                    assert!(done.expect("fused"), "the fused int8 GEMV applies here");
                })?;
                let separate = time_ms(c, 20, |c, i| {
                    for (w, y) in sets[i % copies].iter().zip(ys.iter_mut()) {
                        c.matmul_with(MatmulPath::Gemv, w, &xd, n, y)
                            .expect("matmul");
                    }
                })?;
                out.push(format!(
                    "| {name:7} Q4_K_M x {cols:5} | {n:2} | fused {:7.2} us | separate {:7.2} us |",
                    fused * 1e3,
                    separate * 1e3
                ));
                println!("{}", out.last().expect("pushed"));
            }
        }
    }
    Ok(())
}

/// Prefill-sized products (n = 512) through dequantize/convert + cuBLAS, in TFLOP/s.
fn prefill_matmul(c: &mut CudaContext, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(5);
    let (rows, cols, n) = (4096, 12288, 512);
    for dtype in [DType::Q4K, DType::Q8_0, DType::BF16] {
        let w = DeviceWeight::upload(c, &random_weight(&mut rng, dtype, rows, cols)?)?;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
        let xd = c.upload(&x)?;
        let mut y: CudaSlice<f32> = c.alloc(n * rows)?;
        let ms = time_ms(c, 10, |c, _| c.matmul(&w, &xd, n, &mut y).expect("matmul"))?;
        out.push(format!(
            "| {:5} | {rows}x{cols} | n={n} | {:8.1} us | {:6.1} TFLOP/s |",
            dtype.name(),
            ms * 1e3,
            2.0 * (rows * cols * n) as f64 / ms / 1e9
        ));
        println!("{}", out.last().expect("pushed"));
    }
    Ok(())
}

/// Decode attention, Qwen3-8B heads (32 query, 8 KV, head_dim 128), f16 cache; where the step
/// has enough sequences for the tensor-core decode kernel, it and the SIMT one
/// (`set_decode_attention_mma`).
fn decode_attention(c: &mut CudaContext, copy_gbs: f64, out: &mut Vec<String>) -> R<()> {
    let (nh, nkv, d, bs) = (32, 8, 128, 16);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: d,
    };
    let mut rng = Rng(2);
    let cases = [
        (1024, 1),
        (1024, 16),
        (16384, 1),
        (16384, 8),
        (256, 64),
        (1024, 64),
        (4096, 32),
    ];
    for (ctx_len, batch) in cases {
        let blocks_per_seq = ctx_len / bs;
        let num_blocks = blocks_per_seq * batch;
        let layer_bytes = batch * ctx_len * nkv * d * 2 * 2;
        let layers = ROTATE_BYTES.div_ceil(layer_bytes).clamp(2, 128);
        let mut cache = DeviceKvCache::new(c, &vec![shape; layers], num_blocks, bs, KvDtype::F16)?;
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| {
                (0..blocks_per_seq)
                    .map(|b| (b * batch + s) as u32)
                    .collect()
            })
            .collect();
        // Fill every layer with random K/V through one prefill-shaped batch.
        let fill: Vec<AttnSeq> = (0..batch)
            .map(|s| AttnSeq {
                row0: s * ctx_len,
                len: ctx_len,
                pos0: 0,
                block_table: &tables[s],
            })
            .collect();
        let fb = AttnBatch::new(c, &cache, &fill, nh)?;
        let kv: Vec<f32> = (0..batch * ctx_len * nkv * d).map(|_| rng.sym()).collect();
        let kvd = c.upload(&kv)?;
        for l in 0..layers {
            c.kv_write(&mut cache, l, &fb, &kvd, nkv * d, &kvd, nkv * d)?;
        }
        drop(kvd);
        let step: Vec<AttnSeq> = (0..batch)
            .map(|s| AttnSeq {
                row0: s,
                len: 1,
                pos0: ctx_len - 1,
                block_table: &tables[s],
            })
            .collect();
        let sb = AttnBatch::new(c, &cache, &step, nh)?;
        let q: Vec<f32> = (0..batch * nh * d).map(|_| rng.sym()).collect();
        let qd = c.upload(&q)?;
        let mut o: CudaSlice<f32> = c.alloc(batch * nh * d)?;
        let p = AttnParams::scaled(nh, d);
        // Runs past the SM count: both decode kernels (the tensor-core one is the default).
        let many = batch * nkv >= c.info().sm_count;
        let runs: &[(&str, Option<usize>, bool)] = if many {
            &[("mma, auto", None, true), ("simt, auto", None, false)]
        } else {
            &[("split-K auto", None, true), ("split-K off", Some(1), true)]
        };
        for &(name, splits, mma) in runs {
            c.set_decode_attention_mma(mma);
            let ms = time_ms(c, 20, |c, i| {
                c.paged_attention(
                    &cache,
                    i % layers,
                    &sb,
                    &qd,
                    nh * d,
                    &p,
                    &mut o,
                    nh * d,
                    splits,
                )
                .expect("attention")
            })?;
            let gbs = layer_bytes as f64 / ms / 1e6;
            out.push(format!(
                "| ctx {ctx_len:5} | batch {batch:2} | {name:12} | {:8.2} us | {gbs:6.0} GB/s | {:5.1}% |",
                ms * 1e3,
                100.0 * gbs / copy_gbs
            ));
            println!("{}", out.last().expect("pushed"));
        }
        c.set_decode_attention_mma(true);
    }
    Ok(())
}

/// A decode step's attention with its prologue: `attn_prologue` + `paged_attention` (two
/// launches) against `attend_prologue` (one: the prologue folded into the decode kernel), at
/// Qwen3-0.6B's and Qwen3-8B's heads (d 128, f16 cache, Q/K norms), ~200 keys per sequence.
/// Back-to-back launches without a graph, rotating over 16 layers of cache (as a step walks
/// its layers), so launch and tail costs count as they do in a step. There the kernel before
/// each attention is another attention; at batch 1 also, as in a step, behind the Q/K/V
/// GEMV that writes its q, k and v (`gemv3n`, bf16 weights rotated over >= 512 MB, under PDL):
/// the attention's share is the pair's time less the GEMV's alone, which is where its work
/// before the PDL wait (metadata, and the K/V ring's first fill) overlaps the kernel before.
fn attend_prologue(c: &mut CudaContext, out: &mut Vec<String>) -> R<()> {
    let (d, bs, pos, layers) = (128, 16, 200, 16);
    let mut rng = Rng(8);
    for (name, nh, nkv, hidden) in [("qwen3-0.6b", 16, 8, 1024), ("qwen3-8b", 32, 8, 4096)] {
        for batch in [1, 64] {
            let shape = LayerKvShape {
                n_kv_heads: nkv,
                head_dim: d,
            };
            let blocks = (pos + 1usize).div_ceil(bs);
            let shapes = vec![shape; layers];
            let mut cache = DeviceKvCache::new(c, &shapes, blocks * batch, bs, KvDtype::F16)?;
            let tables: Vec<Vec<u32>> = (0..batch)
                .map(|s| (0..blocks).map(|b| (b * batch + s) as u32).collect())
                .collect();
            let step: Vec<AttnSeq> = (0..batch)
                .map(|s| AttnSeq {
                    row0: s,
                    len: 1,
                    pos0: pos,
                    block_table: &tables[s],
                })
                .collect();
            let sb = AttnBatch::new(c, &cache, &step, nh)?;
            let rope = Rope::new(d, 1e6, 1.0, RopeStyle::Neox);
            let table = RopeTable::from_cpu(c, &rope, d, RopeStyle::Neox, pos + 1)?;
            let pd = c.upload(&vec![pos as i32; batch])?;
            let vals = |n: usize, rng: &mut Rng| (0..n).map(|_| rng.sym()).collect::<Vec<f32>>();
            let mut qd = c.upload(&vals(batch * nh * d, &mut rng))?;
            let mut kd = c.upload(&vals(batch * nkv * d, &mut rng))?;
            let mut vd = c.upload(&vals(batch * nkv * d, &mut rng))?;
            let (qn, kn) = (c.upload(&vec![1f32; d])?, c.upload(&vec![1f32; d])?);
            let (qnv, knv) = (qn.slice(0..d), kn.slice(0..d));
            let mut o = c.zeros::<f32>(batch * nh * d)?;
            let p = AttnParams::scaled(nh, d);
            let norms = Some((&qnv, &knv, 1e-6));
            // Without a kernel ahead, then (batch 1) behind the Q/K/V GEMV.
            let qkv = if batch == 1 {
                Some(QkvGemv::new(c, &mut rng, hidden, nh * d, nkv * d)?)
            } else {
                None
            };
            for lead in [None, qkv.as_ref()]
                .into_iter()
                .take(1 + qkv.is_some() as usize)
            {
                let gemv = match lead {
                    Some(g) => time_ms(c, 200, |c, i| g.run(c, i, &mut qd, &mut kd, &mut vd))?,
                    None => 0.0,
                };
                let two = time_ms(c, 200, |c, i| {
                    let l = i % layers;
                    if let Some(g) = lead {
                        g.run(c, i, &mut qd, &mut kd, &mut vd);
                    }
                    c.attn_prologue(
                        &mut cache, l, &sb, &table, &pd, &mut qd, nh, &mut kd, &vd, norms,
                    )
                    .expect("prologue");
                    c.paged_attention(&cache, l, &sb, &qd, nh * d, &p, &mut o, nh * d, None)
                        .expect("attention");
                })?;
                let mut fused_taken = true;
                let one = time_ms(c, 200, |c, i| {
                    if let Some(g) = lead {
                        g.run(c, i, &mut qd, &mut kd, &mut vd);
                    }
                    fused_taken &= c
                        .attend_prologue(
                            &mut cache,
                            i % layers,
                            &sb,
                            &table,
                            &pd,
                            &mut qd,
                            &mut kd,
                            &vd,
                            norms,
                            &p,
                            &mut o,
                            None,
                        )
                        .expect("attend_prologue");
                })?;
                let ahead = match lead {
                    Some(_) => format!("after qkv gemv {:5.2} us", gemv * 1e3),
                    None => format!("batch {batch:2}"),
                };
                out.push(format!(
                    "| attend_prologue {name:10} | {ahead} | ctx {pos} | prologue + attn {:6.2} us | fused {:6.2} us{} | saved {:5.2} us |",
                    (two - gemv) * 1e3,
                    (one - gemv) * 1e3,
                    if fused_taken { "" } else { " (NOT one launch)" },
                    (two - one) * 1e3
                ));
                println!("{}", out.last().expect("pushed"));
            }
        }
    }
    Ok(())
}

/// A decode step's Q/K/V projection of one row (`gemv3n`: rms_norm folded in), bf16 weights
/// in enough copies to pass [`ROTATE_BYTES`], as the kernel before a step's attention.
struct QkvGemv {
    sets: Vec<Vec<DeviceWeight>>,
    x: CudaSlice<f32>,
    norm: CudaSlice<f32>,
}

impl QkvGemv {
    fn new(c: &CudaContext, rng: &mut Rng, hidden: usize, q: usize, kv: usize) -> R<Self> {
        let host = [q, kv, kv]
            .iter()
            .map(|&r| random_weight(rng, DType::BF16, r, hidden))
            .collect::<R<Vec<_>>>()?;
        let (_, sets) = rotated_sets(c, &host.iter().collect::<Vec<_>>())?;
        let x: Vec<f32> = (0..hidden).map(|_| rng.sym()).collect();
        let g: Vec<f32> = (0..hidden).map(|_| 0.5 + rng.sym().abs()).collect();
        Ok(Self {
            sets,
            x: c.upload(&x)?,
            norm: c.upload(&g)?,
        })
    }

    fn run(
        &self,
        c: &mut CudaContext,
        i: usize,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
    ) {
        let ws: Vec<&DeviceWeight> = self.sets[i % self.sets.len()].iter().collect();
        let norm = RowNorm {
            w: self.norm.slice(..),
            eps: 1e-6,
        };
        let done = c
            .matmul_many_norm(&ws, &self.x, norm, 1, &mut [q, k, v])
            .expect("q+k+v GEMV");
        assert!(done, "q+k+v GEMV declined one row");
    }
}

/// Causal prefill attention at Qwen3-0.6B's heads (16 query, 8 KV, head_dim 128, f16 cache),
/// SIMT kernel against the tensor-core one, with the relative difference of their outputs as a
/// check that the timed kernels compute the same thing: whole prompts of 1k and 16k tokens in
/// one chunk, and the last 512-token chunk of a 16k prompt (the engine's default chunk).
fn prefill_attention_mma(c: &mut CudaContext, out: &mut Vec<String>) -> R<()> {
    let (nh, nkv, d, bs) = (16, 8, 128, 16);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: d,
    };
    let mut rng = Rng(6);
    for (hd, regs, local) in c.attn_mma_resources()? {
        out.push(format!(
            "| attn_mma_f16_{hd} | {regs} registers | {local} bytes local (spills) per thread |"
        ));
        println!("{}", out.last().expect("pushed"));
    }
    // (positions in the cache, queries: the last `chunk` of them, calls per timed batch)
    for (n, chunk, reps) in [(1024usize, 1024, 10), (16384, 16384, 1), (16384, 512, 5)] {
        let mut cache = DeviceKvCache::new(c, &[shape], n / bs, bs, KvDtype::F16)?;
        let table: Vec<u32> = (0..(n / bs) as u32).collect();
        let fill = [AttnSeq {
            row0: 0,
            len: n,
            pos0: 0,
            block_table: &table,
        }];
        let fb = AttnBatch::new(c, &cache, &fill, nh)?;
        let k: Vec<f32> = (0..n * nkv * d).map(|_| rng.sym()).collect();
        let v: Vec<f32> = (0..n * nkv * d).map(|_| rng.sym()).collect();
        let (kd, vd) = (c.upload(&k)?, c.upload(&v)?);
        c.kv_write(&mut cache, 0, &fb, &kd, nkv * d, &vd, nkv * d)?;
        drop((kd, vd, fb));
        let seqs = [AttnSeq {
            row0: 0,
            len: chunk,
            pos0: n - chunk,
            block_table: &table,
        }];
        let b = AttnBatch::new(c, &cache, &seqs, nh)?;
        let q: Vec<f32> = (0..chunk * nh * d).map(|_| rng.sym()).collect();
        let qd = c.upload(&q)?;
        let p = AttnParams::scaled(nh, d);
        // QK^T and PV over the keys each query sees (positions 0..=pos).
        let keys: usize = (n - chunk..n).map(|p| p + 1).sum();
        let flops = 4.0 * keys as f64 * (nh * d) as f64;
        let mut times = Vec::new();
        let mut outs = Vec::new();
        for kernel in [AttnKernel::Simt, AttnKernel::Mma] {
            let mut o: CudaSlice<f32> = c.alloc(chunk * nh * d)?;
            let ms = time_ms(c, reps, |c, _| {
                c.paged_attention_with(kernel, &cache, 0, &b, &qd, nh * d, &p, &mut o, nh * d, None)
                    .expect("attention")
            })?;
            times.push(ms);
            outs.push(c.download(&o)?);
        }
        let (mut num, mut den) = (0f64, 0f64);
        for (x, y) in outs[1].iter().zip(&outs[0]) {
            num += (*x as f64 - *y as f64).powi(2);
            den += (*y as f64).powi(2);
        }
        out.push(format!(
            "| prefill qwen3-0.6b {chunk:5} rows at {:5} | simt {:9.3} ms {:5.1} TFLOP/s | mma {:8.3} ms {:6.1} TFLOP/s | {:5.1}x | rel diff {:.1e} |",
            n - chunk,
            times[0],
            flops / times[0] / 1e9,
            times[1],
            flops / times[1] / 1e9,
            times[0] / times[1],
            (num / den.max(1e-30)).sqrt()
        ));
        println!("{}", out.last().expect("pushed"));
    }
    Ok(())
}

fn sampling(c: &mut CudaContext, out: &mut Vec<String>) -> R<()> {
    let vocab = 151_936;
    let mut rng = Rng(4);
    for rows in [1usize, 64] {
        let logits: Vec<f32> = (0..rows * vocab).map(|_| 4.0 * rng.sym()).collect();
        let ld = c.upload(&logits)?;
        let mut ids: CudaSlice<i32> = c.alloc(rows)?;
        let p = SampleParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            u: 0.5,
        };
        let params = vec![p; rows];
        let greedy = time_ms(c, 20, |c, _| {
            c.argmax(&ld, vocab, &mut ids).expect("argmax")
        })?;
        let sample = time_ms(c, 20, |c, _| {
            c.sample(&ld, vocab, &params, &mut ids).expect("sample")
        })?;
        out.push(format!(
            "| sampling {rows:2} x {vocab} | argmax {:7.1} us | top-k/p/min-p {:7.1} us |",
            greedy * 1e3,
            sample * 1e3
        ));
        println!("{}", out.last().expect("pushed"));
    }
    Ok(())
}

/// `add_rms_norm` (the residual form every block runs twice) at Qwen3-0.6B's and Qwen3-8B's
/// widths, 1 and 64 rows: back-to-back launches (launch and PDL overlap included), 1000 per
/// batch. Before this kernel (ncu, per call): 4.28 us (1024 x 1), 4.54 (1024 x 64), 14.24
/// (4096 x 1), 13.29 (4096 x 64).
fn small_norm(c: &mut CudaContext, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(9);
    for d in [1024, 4096] {
        for rows in [1, 64] {
            let n = rows * d;
            let vals = |rng: &mut Rng, n: usize| (0..n).map(|_| rng.sym()).collect::<Vec<f32>>();
            let mut x = c.upload(&vals(&mut rng, n))?;
            let r = c.upload(&vals(&mut rng, n))?;
            let w = c.upload(&vals(&mut rng, d))?;
            let mut o: CudaSlice<f32> = c.alloc(n)?;
            let ms = time_ms(c, 1000, |c, _| {
                c.add_rms_norm(&mut x, &r, &w, 1e-6, &mut o).expect("norm")
            })?;
            out.push(format!(
                "| small add_rms_norm d {d:4} | rows {rows:2} | {:6.2} us |",
                ms * 1e3
            ));
            println!("{}", out.last().expect("pushed"));
            // SiLU(gate) * up over a fused [rows][2 * ff] gate_up, ff = 3d (Qwen3's).
            let ff = 3 * d;
            let gu = c.upload(&vals(&mut rng, rows * 2 * ff))?;
            let mut a: CudaSlice<f32> = c.alloc(rows * ff)?;
            let ms = time_ms(c, 1000, |c, _| {
                c.gated_act_fused(Activation::Silu, &gu, rows, ff, &mut a)
                    .expect("gated_act")
            })?;
            out.push(format!(
                "| small gated_act ff {ff:5} | rows {rows:2} | {:6.2} us |",
                ms * 1e3
            ));
            println!("{}", out.last().expect("pushed"));
        }
    }
    Ok(())
}

/// Decode attention (f16 KV, split-K automatic) at Qwen3-0.6B's heads (16 q / 8 KV, d 128) and
/// Qwen3-8B's (32 / 8), batch 1 and 64, contexts 140, 1k and 16k, the decode kernel against
/// the one before it (`set_decode_attention_old`, as AFM_ATTN_DECODE_OLD=1). `140 in 1k`
/// is a 140-token context through the batch a CUDA graph of the 1k class replays (split count
/// baked for 1k keys). Caches are zeros (the kernels' time does not depend on values);
/// layers rotate over >= 512 MB so the L2 cannot hold them.
fn small_decode_attention(c: &mut CudaContext, out: &mut Vec<String>) -> R<()> {
    let (d, nkv, bs) = (128, 8, 16);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: d,
    };
    let mut rng = Rng(10);
    // Registers, spills, static shared memory, blocks per SM: the old kernel and the new.
    for k in [
        "attn_f16_128_2",
        "attn_f16_128_4",
        "attn_dec_f16_128_2",
        "attn_dec_f16_128_4",
    ] {
        let o = c.kernel_occupancy(k)?;
        out.push(format!("| small occupancy {k:18} | {o:?} |"));
        println!("{}", out.last().expect("pushed"));
    }
    for (name, nh) in [("qwen3-0.6b", 16), ("qwen3-8b", 32)] {
        for batch in [1, 64] {
            for (label, ctx_len, class) in [
                ("140", 140usize, 0usize),
                ("140 in 1k", 140, 1024),
                ("1k", 1024, 0),
                ("16k", 16384, 0),
            ] {
                let blocks_per_seq = ctx_len.max(class).div_ceil(bs);
                let layer_bytes = batch * blocks_per_seq * bs * nkv * d * 2 * 2;
                let layers = ROTATE_BYTES.div_ceil(layer_bytes).clamp(2, 128);
                let num_blocks = blocks_per_seq * batch;
                let cache =
                    DeviceKvCache::new(c, &vec![shape; layers], num_blocks, bs, KvDtype::F16)?;
                let tables: Vec<Vec<u32>> = (0..batch)
                    .map(|s| {
                        (0..blocks_per_seq)
                            .map(|b| (b * batch + s) as u32)
                            .collect()
                    })
                    .collect();
                let step: Vec<AttnSeq> = (0..batch)
                    .map(|s| AttnSeq {
                        row0: s,
                        len: 1,
                        pos0: ctx_len - 1,
                        block_table: &tables[s],
                    })
                    .collect();
                let q: Vec<f32> = (0..batch * nh * d).map(|_| rng.sym()).collect();
                let qd = c.upload(&q)?;
                let mut o: CudaSlice<f32> = c.alloc(batch * nh * d)?;
                let p = AttnParams::scaled(nh, d);
                let mut us = [0.0; 2];
                for (i, old) in [false, true].into_iter().enumerate() {
                    c.set_decode_attention_old(old);
                    // Packed after the switch: a graph batch bakes the rule's split count.
                    let sb = if class > 0 {
                        let mb = class.div_ceil(bs);
                        let meta = AttnBatch::pack_fixed_decode(&step, batch, mb, bs, num_blocks)?;
                        let md = c.upload(&meta)?;
                        AttnBatch::fixed_decode_owned(c, &cache, md, batch, mb, nh)?
                    } else {
                        AttnBatch::new(c, &cache, &step, nh)?
                    };
                    let ms = time_ms(c, 50, |c, i| {
                        c.paged_attention(
                            &cache,
                            i % layers,
                            &sb,
                            &qd,
                            nh * d,
                            &p,
                            &mut o,
                            nh * d,
                            None,
                        )
                        .expect("attention")
                    })?;
                    us[i] = ms * 1e3;
                }
                c.set_decode_attention_old(false);
                out.push(format!(
                    "| small attn {name:10} | batch {batch:2} | ctx {label:9} | new {:7.2} us | old {:7.2} us | {:4.1}x |",
                    us[0],
                    us[1],
                    us[1] / us[0]
                ));
                println!("{}", out.last().expect("pushed"));
            }
        }
    }
    Ok(())
}

/// The skinny GEMM (cuda/skinny.rs) against cuBLAS at the 0.6B's and 8B's decode shapes:
/// µs per product (x → bf16 conversion included in both), the automatic plan, and every
/// (warps, splits) plan.
fn skinny(c: &mut CudaContext, copy_gbs: f64, out: &mut Vec<String>) -> R<()> {
    let mut rng = Rng(9);
    let shapes = [
        (6144, 4096),
        (4096, 4096),
        (24576, 4096),
        (4096, 12288),
        (4096, 1024),
        (1024, 2048),
        (6144, 1024),
        (1024, 3072),
    ];
    for (rows, cols) in shapes {
        let w = random_weight(&mut rng, DType::BF16, rows, cols)?;
        let (bytes, ws) = rotated_sets(c, &[&w])?;
        for n in [16, 64] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.sym()).collect();
            let xd = c.upload(&x)?;
            let mut y: CudaSlice<f32> = c.alloc(n * rows)?;
            let mut time = |c: &mut CudaContext, path| time_path(c, path, &ws, &xd, n, &mut y);
            let blas = time(c, MatmulPath::Gemm)?;
            let plan = afm_runtime::cuda::skinny_plan(rows, cols, c.info().sm_count)
                .ok_or("no skinny plan")?;
            let auto = time(c, MatmulPath::Skinny(plan))?;
            let mut sweep = Vec::new();
            for warps in [2, 4, 6, 8] {
                for splits in [1, 2, 4, 8, 16] {
                    let per = cols / splits;
                    if per % 64 != 0 || (splits > 1 && per < 128) {
                        continue;
                    }
                    let path = MatmulPath::Skinny(afm_runtime::cuda::SkinnyPlan { warps, splits });
                    sweep.push(format!("w{warps}s{splits} {:.1}", time(c, path)? * 1e3));
                }
            }
            let gbs = |ms: f64| bytes as f64 / ms / 1e6;
            out.push(format!(
                "| skinny {rows:5}x{cols:<5} | {n:2} | w{}s{} {:6.2} us {:5.0} GB/s ({:4.1}%) | cuBLAS {:6.2} us {:5.0} GB/s | {} |",
                plan.warps,
                plan.splits,
                auto * 1e3,
                gbs(auto),
                100.0 * gbs(auto) / copy_gbs,
                blas * 1e3,
                gbs(blas),
                sweep.join(", ")
            ));
            println!("{}", out.last().expect("pushed"));
        }
    }
    Ok(())
}

fn main() -> R<()> {
    let ordinal = std::env::var("AFM_CUDA_DEVICE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut c = CudaContext::new(ordinal)?;
    println!("{:?}", c.info());
    let copy_gbs = copy_ceiling(&mut c)?;
    let mut table = vec![format!(
        "copy ceiling: {copy_gbs:.0} GB/s (bytes read + written)"
    )];
    println!("{}", table[0]);
    // Section names on the command line (cargo bench's own `--bench` flag aside) pick sections.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let run = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    if run("gemv") {
        gemv(&mut c, copy_gbs, &mut table)?;
    }
    if run("gemv_rows") {
        gemv_rows(&mut c, copy_gbs, &mut table)?;
    }
    if run("mmq") {
        mmq(&mut c, copy_gbs, &mut table)?;
    }
    if run("mmh") {
        mmh(&mut c, copy_gbs, &mut table)?;
    }
    if run("skinny") {
        skinny(&mut c, copy_gbs, &mut table)?;
    }
    if run("fused_projections") {
        fused_projections(&mut c, &mut table)?;
    }
    if run("prefill_matmul") {
        prefill_matmul(&mut c, &mut table)?;
    }
    if run("decode_attention") {
        decode_attention(&mut c, copy_gbs, &mut table)?;
    }
    if run("attend_prologue") {
        attend_prologue(&mut c, &mut table)?;
    }
    if run("prefill_mma") {
        prefill_attention_mma(&mut c, &mut table)?;
    }
    if run("sampling") {
        sampling(&mut c, &mut table)?;
    }
    // Issue #9's latency-bound kernels (h15): RMSNorm and decode attention, new against old.
    if run("small") {
        small_norm(&mut c, &mut table)?;
        small_decode_attention(&mut c, &mut table)?;
    }
    println!("\n{}", table.join("\n"));
    Ok(())
}
