//! `out[n, rows] = x[n, cols] · Wᵀ` against weights on the device (`device_weight.rs`).
//!
//! Paths, chosen by type and batch size `n`:
//! ```text
//! F32                         any n     cuBLAS SGEMM (f32 throughout)
//! BF16/F16    n ≤ 8           GEMV kernels, one launch, f32 activations
//!             9 ≤ n ≤ 64      with `AFM_MMH=1` (off by default: slower, see `mmh.rs`): MMH,
//!                             16-bit tensor cores, x rounded to bf16/f16 in the kernel (sm_80+,
//!                             width a multiple of 64)
//!             n > 8           x → bf16/f16 (once for Q/K/V, once for gate and up), cuBLAS
//!                             GEMM with f32 accumulation and output; one GEMM for Q/K/V
//!                             and one for gate+up where their weights lie back to back
//!                             ([`DeviceWeight::upload_joined`]), Q/K/V's output left as one
//!                             buffer of rows [q | k | v] for the attention to read in place
//!                             ([`CudaContext::matmul_joined`])
//! Q8_0/Q4_K/Q6_K  n ≤ 16      x → int8 blocks of 32, GEMV kernels on the GGML blocks (dp4a),
//!                             8 activation rows per launch
//!             17 ≤ n ≤ 64     x → int8 blocks of 32, MMQ: int8 tensor cores on the GGML blocks
//!                             (`mmq.rs`; sm_80 and later, `AFM_MMQ=0` turns it off)
//!             n > 64          W → f16 scratch (≤ 32M weights at a time), x → f16, cuBLAS GEMM
//! ```
//! Weights stay in their storage type in device memory; the f16 scratch is transient.
//! `AFM_GEMV_PREFETCH=0` turns off the quantized GEMV's L2 prefetch of its first weights (on by
//! default; an A/B knob until the prefetch is measured end to end).
//!
//! At one activation row the 16-bit GEMV blocks own R = 1, 2, 4 or 8 weight rows (the
//! one-matrix kernels at R = 2 and 4 also with two units of each row in flight per thread),
//! picked per kernel from the grid size and width by `gemv_shape`'s table; `AFM_GEMV_R=1|2|4|8|2u2|4u2`
//! forces one (A/B runs), as does [`CudaContext::set_gemv_half`] (benchmarks). Every shape gives
//! the same bits.
//!
//! Several quantized matrices of one input share one activation quantization and one launch:
//! Q/K/V, of any mix of the three types ([`CudaContext::matmul_many`]), and gate with up,
//! fused with the activation ([`CudaContext::matmul_gated`]), on the GEMV and the MMQ path.
//!
//! Every path can add its result to what the output holds ([`CudaContext::matmul_add`]: the
//! residual add folded into a projection), and where the input is an RMSNorm's the norm can
//! fold into the int8 quantization (up to 16 rows) or the one-row 16-bit GEMV
//! ([`CudaContext::matmul_many_norm`], [`CudaContext::matmul_gated_norm`]).

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig};

use super::context::scratch;
use super::device_weight::{joined, DeviceWeight};
use super::gemv_shape::{self, half_rows, HalfKernel, GEMV_HALF_ROWS, GEMV_HALF_U2_ROWS};
use super::mmh::{mmh_shape, MMH_GATED_MAX_ROWS};
use super::mmq::mmq_env_on;
use super::ops::grid_1d;
use super::skinny::{GemmChoice, SkinnyArgs, SkinnyGated, SkinnyPlan};
use super::{check_len, launch, CudaContext, CudaError, Result};
use crate::switch::Switch;
use crate::DType;

/// Most activation rows one GEMV launch handles (each weight block is reused across them).
/// 16-bit weights take one launch at most: past that cuBLAS reads them once (measured on the
/// H200: 32 streams of Qwen3-8B bf16 decoded 1,014 tok/s through four GEMV launches).
pub const GEMV_MAX_BATCH: usize = 8;
/// Quantized weights take GEMV launches (each reading the weights again) up to this batch;
/// past it the MMQ kernels (up to `MMQ_MAX_ROWS`, or with `AFM_MMQ=0` dequantization to f16
/// in chunks for cuBLAS). `cuda_bench` on the H200 (int8
/// kernels, 2026-11-30), Qwen3-8B Q4_K matrices: at 16 rows two launches beat cuBLAS (4096×12288
/// 51 vs 132 µs, 12288×4096 68 vs 101 µs), at 32 rows four launches mostly lose (12288×4096
/// 133 vs 102 µs, 4096×4096 52 vs 36 µs; 4096×12288 98 vs 132 µs).
const GEMV_MAX_ROWS: usize = 16;
/// Quantized weights take the MMQ kernels (`mmq.rs`) past `GEMV_MAX_ROWS` up to this batch
/// and dequantize + cuBLAS above it. 64: the most one MMQ launch takes (two 16-row weight
/// tiles per block against at most 8 tiles of 8 activation rows); more would take a second
/// launch, reading the weights again. `cuda_bench mmq` on the H200 (2026-11-30, Qwen3-8B
/// matrices, 8 warps): MMQ beats both neighbours at every measured size, e.g. Q4_K 4096×4096 at
/// 17 rows 14.7 µs (int8 GEMV 30.9, cuBLAS 35.8), at 64 rows 20.5 µs (cuBLAS 35.4); Q6_K
/// 4096×12288 at 64 rows 62.9 µs (cuBLAS 123.0). Below 17 rows it is not measured.
const MMQ_MAX_ROWS: usize = 64;
/// The fused gate+up MMQ launch serves up to this many rows; past it gate and up go as one
/// two-matrix MMQ launch and the activation as its own kernel. `cuda_bench mmq` (Q4_K
/// 12288×4096 each): fused 96.8 vs 100.4 µs at 32 rows, but 119.3 vs 103.5 µs at 64.
pub const MMQ_GATED_MAX_ROWS: usize = 32;
/// Weight rows per GEMV block (`GEMV_ROWS` in gemv.cu); per thread group in the int8 kernels.
pub(super) const GEMV_ROWS: usize = 4;
/// Activation rows up to which the 16-bit GEMV folds a preceding RMSNorm in (gemv.cu
/// `gemv3n_*`, `gemvgn_*`): on the H200 at one row Qwen3-0.6B went from 940 to 1,051 tok/s; at 8
/// rows the extra products per weight (the step is issue-bound there) made Qwen3-8B 29% slower
/// than a separate norm launch (706 vs 989 tok/s; session 7, bench/RESULTS.md).
const NORM_FOLD_MAX_ROWS: usize = 1;
/// Widest input the gate+up GEMV folds the norm into (gemv.cu `gemvgn_*`). ncu on the H200
/// (session 7, batch 1, 4 rows per block): at Qwen3-8B's 4,096 columns the folded launch took
/// 53.8 µs against 47.8 + a 3.4 µs norm launch; at 8 rows per block (session 8, `cuda_bench
/// gemv_rows`) 47.8 µs against 49.3 for the norm launch then gate+up, so it folds there too.
const NORM_FOLD_GATED_MAX_COLS: usize = 4096;
/// Threads per GEMV block (`GEMV_THREADS` in gemv.cu).
const GEMV_THREADS: usize = 128;
/// Values per int8 activation block (and weights per int8 GEMV work unit).
const Q8_BLOCK: usize = 32;
/// Weights dequantized to f16 per cuBLAS call, bounding the scratch (64 MiB).
const DEQUANT_CHUNK: usize = 32 << 20;

/// Which kernels `matmul_with` uses (tests and benchmarks compare them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulPath {
    /// By batch size, as the table in this module's header.
    Auto,
    /// The GEMV kernels at any batch size (quantized and 16-bit types).
    Gemv,
    /// cuBLAS at any batch size.
    Gemm,
    /// As `Gemv`, with the quantized kernels' rows per thread group forced to 1 or 4 rather
    /// than chosen by `Q8Launch::new`: tests cover both kernel sets at every shape, and
    /// `cuda_bench` times both to check the choice.
    GemvRows(usize),
    /// The int8 tensor-core kernels (`mmq.rs`) at any batch size, regardless of `AFM_MMQ`:
    /// quantized weights on sm_80 and later only (an error elsewhere).
    Mmq,
    /// As `Mmq`, with the blocks' warps forced to 4 or 8 rather than chosen by width: tests
    /// cover both kernel sets, and `cuda_bench` times both to check the choice.
    MmqWarps(usize),
    /// The 16-bit tensor-core kernels (`mmh.rs`) at any batch size, regardless of `AFM_MMH`:
    /// BF16/F16 weights whose width is a multiple of 64, on sm_80 and later (an error elsewhere).
    Mmh,
    /// As `Mmh`, with the launch shape forced rather than chosen by the weights' shape: warps
    /// per block 4 or 8, K splits ≥ 1 (at most one per 64 columns are used), whether the last
    /// split sums them in the kernel (`fixup`) or a second launch does (at most 16 splits), L2
    /// prefetch distance in 64-column chunks (0: none). Tests and `cuda_bench`.
    MmhWith {
        warps: usize,
        splits: usize,
        fixup: bool,
        prefetch: usize,
    },
    /// The skinny GEMM (`skinny.rs`) with its shape forced: BF16/F16 weights whose width is a
    /// multiple of 64 (and of 64 × splits), 9..64 activation rows, sm_90 (an error elsewhere).
    /// Tests and benchmarks; `Gemm` is then cuBLAS alone.
    Skinny(SkinnyPlan),
}

/// Whether the quantized GEMV prefetches its first weights into L2 before waiting on the
/// kernel before it (gemv.cu `pf8_*`; `AFM_GEMV_PREFETCH`, see the module header; read once).
fn gemv_prefetch() -> i32 {
    static ON: Switch = Switch::new("AFM_GEMV_PREFETCH", true);
    i32::from(ON.on())
}

/// Widest matrix whose one-row 16-bit GEMV loads its first weights before the PDL wait (gemv.cu
/// `gemv_preload`, the "p" kernels) when `AFM_GEMV_PRELOAD=1`. Off by default: on the H200
/// (session 7, gpu_bench, random Qwen3-0.6B, graphs) batch 1 decoded 1,011 tok/s with it and
/// 1,148 without, in the same call; the loads it moves ahead of the wait did not overlap
/// usefully, and its registers (56 instead of 44-48) cost blocks per SM.
const PRELOAD_MAX_COLS: usize = 3072;

/// "p" (the preloading kernel) for `n` rows of a `cols`-wide 16-bit matrix with
/// `AFM_GEMV_PRELOAD=1` (read once).
fn preload_suffix(n: usize, cols: usize) -> &'static str {
    static ON: Switch = Switch::new("AFM_GEMV_PRELOAD", false);
    let on = ON.on();
    if on && n == 1 && cols <= PRELOAD_MAX_COLS {
        "p"
    } else {
        ""
    }
}

fn is_quant(t: DType) -> bool {
    matches!(t, DType::Q8_0 | DType::Q4K | DType::Q6K)
}

/// Thread groups per int8 GEMV block: as many as keep each group's threads busy with at least
/// one 32-weight unit per row (Qwen3-0.6B's 1024 columns: 32 units, so one warp per group).
fn q8_groups(cols: usize) -> usize {
    match cols / Q8_BLOCK {
        0..=32 => 4,
        33..=64 => 2,
        _ => 1,
    }
}

/// Blocks per SM below which the int8 GEMV gives each thread group one weight row instead of
/// four: four rows amortize activation loads, but on small matrices (Qwen3-0.6B's 1024-row
/// projections: 64 blocks of 4 × 4 rows) they leave one or two warps per SM to hide latency.
const Q8_MIN_BLOCKS_PER_SM: usize = 4;

/// How an int8 GEMV launch covers one to three matrices of `cols` columns.
struct Q8Launch {
    cfg: LaunchConfig,
    groups: i32,
    /// Weight rows per thread group: 4 (kernels `gemv8*`) or 1 (`gemv8r1*`).
    rows_per_group: usize,
}

impl Q8Launch {
    /// `forced`: rows per group chosen by the caller (1 or 4), else by the grid size.
    fn new(rows: &[usize], cols: usize, sm_count: usize, forced: Option<usize>) -> Self {
        let groups = q8_groups(cols);
        let blocks = |r: usize| rows.iter().map(|&m| m.div_ceil(r * groups)).sum::<usize>();
        let r = forced.unwrap_or_else(|| {
            if blocks(GEMV_ROWS) >= Q8_MIN_BLOCKS_PER_SM * sm_count {
                GEMV_ROWS
            } else {
                1
            }
        });
        Self {
            cfg: LaunchConfig {
                grid_dim: (blocks(r) as u32, 1, 1),
                block_dim: (GEMV_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            groups: groups as i32,
            rows_per_group: r,
        }
    }

    /// The kernel for `n` activation rows (gated: gate and up fused).
    fn kernel(&self, gated: bool, n: usize) -> String {
        let g = if gated { "g" } else { "" };
        let r = if self.rows_per_group == 1 { "r1" } else { "" };
        format!("gemv8{g}{r}_{n}")
    }
}

/// The int8 kernels' weight type code (`Q8_Q4_K`.. in gemv.cu).
fn q8_type(t: DType) -> i32 {
    match t {
        DType::Q4K => 0,
        DType::Q6K => 1,
        _ => 2,
    }
}

/// `Q8Mats` in gemv.cu: up to three matrices (weights, outputs, type codes, rows; rows 0 for
/// absent ones), served by consecutive ranges of blocks.
#[repr(C)]
#[derive(Clone, Copy)]
struct Q8Mats {
    w: [u64; 3],
    out: [u64; 3],
    ty: [i32; 3],
    rows: [i32; 3],
    /// 1: `out += x · Wᵀ` (a residual add folded into the projection).
    accumulate: i32,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct (six pointers, seven ints).
unsafe impl cudarc::driver::DeviceRepr for Q8Mats {}

/// Every kernel of gemv.cu, for the context's loader.
pub(super) fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = [
        "quantize_x_q8",
        "norm_quantize_x_q8",
        "dequant_f16_q8_0",
        "dequant_f16_q4_k",
        "dequant_f16_q6_k",
    ]
    .map(String::from)
    .into();
    for n in 1..=GEMV_MAX_BATCH {
        for t in ["bf16", "f16"] {
            v.push(format!("gemv_{t}_{n}"));
            v.push(format!("gemva_{t}_{n}"));
            v.push(format!("gemv3_{t}_{n}"));
            v.push(format!("gemvg_{t}_{n}"));
            if n <= NORM_FOLD_MAX_ROWS {
                v.push(format!("gemv3n_{t}_{n}"));
                v.push(format!("gemvgn_{t}_{n}"));
            }
            if n == 1 {
                for k in ["gemvp", "gemvap", "gemv3p", "gemvgp", "gemv3np", "gemvgnp"] {
                    v.push(format!("{k}_{t}_{n}"));
                }
                for r in GEMV_HALF_ROWS.into_iter().filter(|&r| r != GEMV_ROWS) {
                    for k in ["gemv", "gemva", "gemv3", "gemvg", "gemv3n", "gemvgn"] {
                        v.push(format!("{k}_{t}_{n}_r{r}"));
                    }
                }
                for r in GEMV_HALF_U2_ROWS {
                    for k in ["gemv", "gemva"] {
                        v.push(format!("{k}_{t}_{n}_r{r}u2"));
                    }
                }
            }
        }
        for k in ["gemv8", "gemv8g", "gemv8r1", "gemv8gr1"] {
            v.push(format!("{k}_{n}"));
        }
    }
    v
}

/// Device addresses of activations quantized to int8 blocks (`quantize_x_q8`'s outputs).
#[derive(Clone, Copy)]
struct Q8Acts {
    /// i8 `[n][cols]`.
    q: u64,
    /// f32 `[n][cols / 32]`: block scales d.
    d: u64,
    /// f32 `[n][cols / 32]`: d · Σq per block.
    s: u64,
    cols: usize,
}

impl Q8Acts {
    /// The same activations from row `r` on.
    fn at_row(self, r: usize) -> Self {
        let blocks = (r * self.cols / Q8_BLOCK * 4) as u64;
        Self {
            q: self.q + (r * self.cols) as u64,
            d: self.d + blocks,
            s: self.s + blocks,
            cols: self.cols,
        }
    }
}

impl CudaContext {
    /// `out[i, r] = Σ_c x[i, c] · W[r, c]` for `n` rows of x (`[n, cols]`; out `[n, rows]`).
    pub fn matmul(
        &mut self,
        w: &DeviceWeight,
        x: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.matmul_with(MatmulPath::Auto, w, x, n, out)
    }

    /// Who runs the 16-bit GEMMs of the calls that take no path (the joined and shared
    /// products, [`matmul_mlp_add`](Self::matmul_mlp_add)) until set again: `Gemm` cuBLAS
    /// only, `Skinny(plan)` the skinny kernels with that plan (an error where it cannot run),
    /// anything else the automatic choice. For tests and benchmarks.
    pub fn set_gemm_path(&mut self, path: MatmulPath) {
        self.gemm_choice = match path {
            MatmulPath::Gemm => GemmChoice::Cublas,
            MatmulPath::Skinny(plan) => GemmChoice::Skinny(plan),
            _ => GemmChoice::Auto,
        };
    }

    pub fn matmul_with(
        &mut self,
        path: MatmulPath,
        w: &DeviceWeight,
        x: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.matmul_into(path, w, x, n, out, false)
    }

    /// `out[i, r] += Σ_c x[i, c] · W[r, c]`: a residual add folded into the projection (every
    /// path accumulates in its own store, so this costs no launch of its own).
    pub fn matmul_add(
        &mut self,
        w: &DeviceWeight,
        x: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.matmul_into(MatmulPath::Auto, w, x, n, out, true)
    }

    /// [`matmul_with`](Self::matmul_with), adding to `out` when `accumulate` is set.
    pub fn matmul_into(
        &mut self,
        path: MatmulPath,
        w: &DeviceWeight,
        x: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<()> {
        check_len("matmul input", x.len(), n * w.cols)?;
        check_len("matmul output", out.len(), n * w.rows)?;
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let quant = is_quant(w.dtype);
        let half = matches!(w.dtype, DType::BF16 | DType::F16);
        if !(quant || half || w.dtype == DType::F32) {
            return Err(CudaError::Unsupported {
                what: "matmul weight type",
                value: w.dtype.name().into(),
                supported: "F32, F16, BF16, Q8_0, Q4_K, Q6_K",
            });
        }
        let (xp, op) = (self.ptr(x), self.ptr_mut(out));
        let mmq_warps = match path {
            MatmulPath::Mmq => Some(None),
            MatmulPath::MmqWarps(k) => Some(Some(k)),
            MatmulPath::Auto if quant && self.mmq_auto(n) => Some(None),
            _ => None,
        };
        if let Some(warps) = mmq_warps {
            self.mmq_check(w)?;
            let acts = self.mmq_quantize(xp, n, w.cols)?;
            return self.mmq(&[w], &[op], acts, warps, accumulate);
        }
        let mmh_shape = match path {
            MatmulPath::Auto if self.mmh_auto(&[w], n, xp) => Some(None),
            path => mmh_shape(path),
        };
        if let Some(shape) = mmh_shape {
            return self.mmh(&[w], xp, n, &[op], shape, accumulate);
        }
        // The 16-bit GEMV reads activations as float4.
        let gemv_ok = quant || (half && w.cols.is_multiple_of(8) && xp.is_multiple_of(16));
        let use_gemv = match path {
            MatmulPath::Auto => gemv_ok && n <= if quant { GEMV_MAX_ROWS } else { GEMV_MAX_BATCH },
            MatmulPath::Gemv | MatmulPath::GemvRows(_) => gemv_ok,
            MatmulPath::Gemm
            | MatmulPath::Mmq
            | MatmulPath::MmqWarps(_)
            | MatmulPath::Mmh
            | MatmulPath::MmhWith { .. }
            | MatmulPath::Skinny(_) => false,
        };
        if !use_gemv {
            self.set_gemm_path(path);
            let r = self.gemm(w, xp, n, op, accumulate);
            self.gemm_choice = GemmChoice::Auto;
            r
        } else if quant {
            let forced = match path {
                MatmulPath::GemvRows(r) if r == 1 || r == GEMV_ROWS => Some(r),
                MatmulPath::GemvRows(r) => {
                    return Err(CudaError::Unsupported {
                        what: "GEMV rows per thread group",
                        value: r.to_string(),
                        supported: "1 or 4",
                    })
                }
                _ => None,
            };
            let acts = self.quantize_q8(xp, n, w.cols, None)?;
            self.gemv_q8(&[w], &[op], acts, n, forced, accumulate)
        } else {
            self.gemv_half(w, xp, n, op, accumulate)
        }
    }

    /// Process-wide overrides of the one-row 16-bit GEMV (they hold for every context of the
    /// process), for benchmarks and A/B runs: `shape`, as `AFM_GEMV_R` takes it: the weight
    /// rows per block R ("1", "2", "4", "8"), or R with two units in flight ("2u2", "4u2": the
    /// one-matrix kernels; the others take that R with one unit); `None`: `AFM_GEMV_R` if set,
    /// else the table, `half_rows_rule`. `gated_norm_any_width`: fold the RMSNorm into gate+up
    /// at any width, not only up to `NORM_FOLD_GATED_MAX_COLS` (set at R = 4). Results do not
    /// change with the shape, only times. An error (nothing changed) for a shape the kernels do
    /// not come in.
    pub fn set_gemv_half(&self, shape: Option<&str>, gated_norm_any_width: bool) -> Result<()> {
        gemv_shape::force(shape, gated_norm_any_width)
    }

    /// Registers per thread and local (spilled) bytes per thread of every one-row 16-bit GEMV
    /// kernel (each shape, with and without the folded norm) as the driver compiled it for this
    /// device: (name, registers, local bytes).
    pub fn gemv_half_resources(&self) -> Result<Vec<(String, i32, i32)>> {
        // bf16/f16 at one activation row: "gemv3n_bf16_1", "gemv_f16_1_r8", ...
        kernel_names()
            .into_iter()
            .filter(|k| k.ends_with("16_1") || k.contains("16_1_r"))
            .map(|k| {
                let f = self.kernel(&k)?;
                let (regs, local) = (f.num_regs()?, f.local_size_bytes()?);
                Ok((k, regs, local))
            })
            .collect()
    }

    /// Whether automatic path choice sends `n` rows of quantized weights to MMQ.
    fn mmq_auto(&self, n: usize) -> bool {
        (GEMV_MAX_ROWS + 1..=MMQ_MAX_ROWS).contains(&n) && mmq_env_on() && self.mmq_supported()
    }

    /// Quantizes `n` rows of `cols` activations at `xp` to int8 blocks of 32 in the scratch;
    /// with a `norm` (weight, eps), rows of `rms_norm(x)`, in one launch with the norm.
    fn quantize_q8(
        &mut self,
        xp: u64,
        n: usize,
        cols: usize,
        norm: Option<NormArg>,
    ) -> Result<Q8Acts> {
        let nblocks = n * cols / Q8_BLOCK;
        let stream = self.stream().clone();
        let q = scratch(&stream, &mut self.ws.xq, n * cols)?;
        let d = scratch(&stream, &mut self.ws.xd, nblocks)?;
        let s = scratch(&stream, &mut self.ws.xs, nblocks)?;
        match norm {
            None => {
                let nbi = nblocks as i64;
                let f = self.kernel("quantize_x_q8")?;
                launch!(self, f, grid_1d(nblocks * 32, 256); xp, q, d, s, nbi)?;
            }
            Some(NormArg { w: nw, eps }) => {
                // One block per row, a warp per 32-block up to 256 threads.
                let cfg = LaunchConfig {
                    grid_dim: (n as u32, 1, 1),
                    block_dim: ((cols / Q8_BLOCK).clamp(1, 8) as u32 * 32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ci = cols as i32;
                let f = self.kernel("norm_quantize_x_q8")?;
                launch!(self, f, cfg; xp, nw, eps, q, d, s, ci)?;
            }
        }
        Ok(Q8Acts { q, d, s, cols })
    }

    /// `outs[i] = x · wsᵢᵀ` for one to three quantized matrices of one width and `n` rows of
    /// int8 activations, in one launch per `GEMV_MAX_BATCH` rows (`forced`: rows per thread
    /// group, see [`Q8Launch::new`]).
    fn gemv_q8(
        &mut self,
        ws: &[&DeviceWeight],
        outs: &[u64],
        acts: Q8Acts,
        n: usize,
        forced: Option<usize>,
        accumulate: bool,
    ) -> Result<()> {
        debug_assert!((1..=3).contains(&ws.len()) && ws.len() == outs.len());
        let rows: Vec<usize> = ws.iter().map(|w| w.rows).collect();
        let shape = Q8Launch::new(&rows, acts.cols, self.info().sm_count, forced);
        if shape.cfg.grid_dim.0 == 0 {
            return Ok(()); // no rows at all: nothing to write (and no empty launch)
        }
        let mut m = Q8Mats {
            w: [self.weight_ptr(ws[0]); 3],
            out: [outs[0]; 3],
            ty: [q8_type(ws[0].dtype); 3],
            rows: [0; 3],
            accumulate: i32::from(accumulate),
        };
        for (i, w) in ws.iter().enumerate().skip(1) {
            m.w[i] = self.weight_ptr(w);
            m.ty[i] = q8_type(w.dtype);
        }
        let (cfg, groups, ci, pf) = (shape.cfg, shape.groups, acts.cols as i32, gemv_prefetch());
        for c0 in (0..n).step_by(GEMV_MAX_BATCH) {
            let nb = (n - c0).min(GEMV_MAX_BATCH);
            for (i, (&o, &r)) in outs.iter().zip(&rows).enumerate() {
                m.out[i] = o + (c0 * r * 4) as u64;
                m.rows[i] = r as i32;
            }
            let a = acts.at_row(c0);
            let (q0, d0, s0) = (a.q, a.d, a.s);
            let f = self.kernel(&shape.kernel(false, nb))?;
            launch!(self, f, cfg; m, q0, d0, s0, ci, groups, pf)?;
        }
        Ok(())
    }

    /// The 16-bit GEMV (f32 activations), in launches of at most `GEMV_MAX_BATCH` rows.
    fn gemv_half(
        &mut self,
        w: &DeviceWeight,
        xp: u64,
        n: usize,
        op: u64,
        accumulate: bool,
    ) -> Result<()> {
        let (rows, cols) = (w.rows, w.cols);
        let name = if accumulate { "gemva" } else { "gemv" };
        let wp = self.weight_ptr(w);
        let (ri, ci) = (rows as i32, cols as i32);
        let sm_count = self.info().sm_count;
        for c0 in (0..n).step_by(GEMV_MAX_BATCH) {
            let nb = (n - c0).min(GEMV_MAX_BATCH);
            let x0 = xp + (c0 * cols * 4) as u64;
            let o0 = op + (c0 * rows * 4) as u64;
            let pre = preload_suffix(nb, cols);
            let s = half_rows(
                HalfKernel::Plain,
                &[rows],
                cols,
                nb,
                !pre.is_empty(),
                sm_count,
            )?;
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(s.rows) as u32, 1, 1),
                block_dim: (GEMV_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let t = half_name(w);
            let f = self.kernel(&format!("{name}{pre}_{t}_{nb}{}", s.suffix()))?;
            launch!(self, f, cfg; wp, x0, o0, ri, ci)?;
        }
        Ok(())
    }

    /// Through cuBLAS (quantized weights dequantized to f16 in chunks first); `accumulate`:
    /// out += result (cuBLAS's beta = 1).
    fn gemm(
        &mut self,
        w: &DeviceWeight,
        xp: u64,
        n: usize,
        op: u64,
        accumulate: bool,
    ) -> Result<()> {
        let (rows, cols) = (w.rows, w.cols);
        let wp = self.weight_ptr(w);
        let stream = self.stream().clone();
        let dims = GemmDims {
            m: rows,
            n,
            k: cols,
            ldc: rows,
            accumulate,
        };
        match w.dtype {
            DType::F32 => self.blas_gemm(cudaDataType_t::CUDA_R_32F, wp, xp, op, dims),
            DType::BF16 | DType::F16 => self.gemm_many_half(&[w], xp, n, &[op], accumulate, None),
            _ => {
                let name = match w.dtype {
                    DType::Q8_0 => "dequant_f16_q8_0",
                    DType::Q4K => "dequant_f16_q4_k",
                    _ => "dequant_f16_q6_k",
                };
                let hx = scratch(&stream, &mut self.ws.half_x, n * cols)?;
                let len = (n * cols) as i64;
                let f = self.kernel("f32_to_f16")?;
                launch!(self, f, grid_1d(n * cols, 256); xp, hx, len)?;
                let chunk_rows = (DEQUANT_CHUNK / cols).clamp(1, rows);
                let hw = scratch(&stream, &mut self.ws.half_w, chunk_rows * cols)?;
                let rb = w.row_bytes();
                for r0 in (0..rows).step_by(chunk_rows) {
                    let nr = (rows - r0).min(chunk_rows);
                    let w0 = wp + (r0 * rb) as u64;
                    let (nri, ci, rbi) = (nr as i32, cols as i32, rb as i64);
                    // One thread per 32 weights (a GEMV work unit).
                    let f = self.kernel(name)?;
                    launch!(self, f, grid_1d(nr * cols / 32, 256); w0, hw, nri, ci, rbi)?;
                    let o0 = op + (r0 * 4) as u64;
                    let part = GemmDims { m: nr, ..dims };
                    self.blas_gemm(cudaDataType_t::CUDA_R_16F, hw, hx, o0, part)?;
                }
                Ok(())
            }
        }
    }

    /// `outs[i] = x · wsᵢᵀ` for 16-bit weights of one type and width through cuBLAS: `x`
    /// converted to that type once for all of them (Q/K/V, gate and up; at 64 streams of
    /// Qwen3-0.6B the conversions were five of a layer's fifteen kernels); with `norm`, of
    /// `rms_norm(x)`, normalized and converted in one launch (ncu on the H200 at 64 streams:
    /// each norm 3.0–3.6 µs and each conversion 2.0–2.8 µs, both latency-bound).
    fn gemm_many_half(
        &mut self,
        ws: &[&DeviceWeight],
        xp: u64,
        n: usize,
        ops: &[u64],
        accumulate: bool,
        norm: Option<NormArg>,
    ) -> Result<()> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        let cols = first.cols;
        let bf16 = first.dtype == DType::BF16;
        let ty = blas_half(bf16);
        let hx = self.half_input(xp, n, cols, bf16, norm)?;
        if let (Some(all), [_, _, ..], false) = (joined(ws), ws, accumulate) {
            return self.gemm_joined(ty, &all, ws, hx, n, ops);
        }
        for (w, &op) in ws.iter().zip(ops) {
            if w.rows > 0 {
                let wp = self.weight_ptr(w);
                let dims = GemmDims {
                    m: w.rows,
                    n,
                    k: cols,
                    ldc: w.rows,
                    accumulate,
                };
                self.blas_gemm(ty, wp, hx, op, dims)?;
            }
        }
        Ok(())
    }

    /// `x` (`n` × `cols`, f32), or `rms_norm(x)` with `norm`, as bf16 (else f16) in the
    /// workspace's `half_x`, one launch: the 16-bit GEMMs' input. Returns its address.
    fn half_input(
        &mut self,
        xp: u64,
        n: usize,
        cols: usize,
        bf16: bool,
        norm: Option<NormArg>,
    ) -> Result<u64> {
        if let (true, None) = (bf16, norm) {
            // The decode attention's own bf16 copy of x, where it made one (handover.rs).
            if let Some(at) = self.take_prepared_half(xp, n * cols) {
                return Ok(at);
            }
        }
        let stream = self.stream().clone();
        let hx = scratch(&stream, &mut self.ws.half_x, n * cols)?;
        if let Some(NormArg { w, eps }) = norm {
            self.rms_norm_half(xp, w, cols, eps, hx, n * cols, bf16)?;
        } else {
            let len = (n * cols) as i64;
            let f = self.kernel(if bf16 { "f32_to_bf16" } else { "f32_to_f16" })?;
            launch!(self, f, grid_1d(n * cols, 256); xp, hx, len)?;
        }
        Ok(hx)
    }

    /// Two or three products of weights lying back to back (`all`, [`joined`]) as one GEMM
    /// into `[n][Σ rows]`, then their columns split into each output (`split3_f32`). At 64
    /// streams a skinny GEMM costs about the same whatever its rows (Qwen3-0.6B's K and V,
    /// 2 MB each: 5.4 µs; Q, 4 MB: 5.7 µs), so one GEMM and a copy beat three GEMMs. The
    /// models skip the copy ([`matmul_joined`](Self::matmul_joined)); this serves
    /// `matmul_many`'s separate outputs (its other callers: benchmarks, tests).
    fn gemm_joined(
        &mut self,
        ty: cudaDataType_t,
        all: &DeviceWeight,
        ws: &[&DeviceWeight],
        hx: u64,
        n: usize,
        ops: &[u64],
    ) -> Result<()> {
        let mut tmp = self.alloc::<f32>(n * all.rows)?;
        let tp = self.ptr_mut(&mut tmp);
        let dims = GemmDims {
            m: all.rows,
            n,
            k: all.cols,
            ldc: all.rows,
            accumulate: false,
        };
        self.blas_gemm(ty, self.weight_ptr(all), hx, tp, dims)?;
        let width = |i: usize| ws.get(i).map_or(0, |w| w.rows);
        let (c0, c1, c2) = (width(0), width(1), width(2));
        let (o0, o1, o2) = (ops[0], ops[1], ops.get(2).copied().unwrap_or(0));
        let v4 = [c0, c1, c2].iter().all(|c| c.is_multiple_of(4))
            && [tp, o0, o1, o2].iter().all(|p| p.is_multiple_of(16));
        let w = if v4 { 4 } else { 1 };
        let (ni, c0i, c1i, c2i) = (n as i32, c0 as i32, c1 as i32, c2 as i32);
        let v4 = i32::from(v4);
        let f = self.kernel("split3_f32")?;
        launch!(self, f, grid_1d(n * all.rows / w, 256); tp, o0, o1, o2, ni, c0i, c1i, c2i, v4)
    }

    /// Column-major cuBLAS view of row-major `out[n, rows] = x[n, k] · W[rows, k]ᵀ`:
    /// `C (m×n, ldc) = Aᵀ (A: k×m, lda = k) · B (k×n, ldb = k)` (`+ C` with `accumulate`), f32
    /// output and accumulation.
    fn blas_gemm(&self, ty: cudaDataType_t, a: u64, b: u64, c: u64, d: GemmDims) -> Result<()> {
        let half = matches!(ty, cudaDataType_t::CUDA_R_16BF | cudaDataType_t::CUDA_R_16F);
        let skinny = SkinnyArgs {
            w: a,
            x: b,
            out: c,
            rows: d.m,
            cols: d.k,
            n: d.n,
            ldc: d.ldc,
            accumulate: d.accumulate,
            bf16: ty == cudaDataType_t::CUDA_R_16BF,
            gated: None,
        };
        if half && self.skinny_gemm(skinny)? {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, if d.accumulate { 1.0f32 } else { 0.0 });
        let (mi, ni, ki, ldci) = (d.m as i32, d.n as i32, d.k as i32, d.ldc as i32);
        super::handover::launched();
        // SAFETY: a, b and c are device buffers of at least m·k, k·n and (n−1)·ldc + m
        // elements, checked by the callers.
        unsafe {
            gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                mi,
                ni,
                ki,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                ty,
                ki,
                b as *const _,
                ty,
                ki,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                cudaDataType_t::CUDA_R_32F,
                ldci,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }
}

/// Gate and up products in f32 ([`CudaContext::gate_up_half`]): gate row r at `r · stride`,
/// up row r at `up + r · stride` (elements).
struct GateUp {
    buf: CudaSlice<f32>,
    up: usize,
    stride: usize,
}

/// A cuBLAS product's shape (see [`CudaContext::blas_gemm`]) and whether it adds to C.
#[derive(Clone, Copy)]
struct GemmDims {
    m: usize,
    n: usize,
    k: usize,
    ldc: usize,
    accumulate: bool,
}

/// An RMSNorm folded into a product's input: its weight (one per input column) and epsilon.
pub struct RowNorm<'a> {
    pub w: CudaView<'a, f32>,
    pub eps: f32,
}

/// A [`RowNorm`] as the kernels take it: the weight's device address (0: no norm) and epsilon.
#[derive(Clone, Copy)]
struct NormArg {
    w: u64,
    eps: f32,
}

impl CudaContext {
    /// The kernels' form of `norm`, checked to be one weight per column of `cols`.
    fn norm_arg(&self, norm: Option<&RowNorm>, cols: usize) -> Result<Option<NormArg>> {
        norm.map(|n| {
            check_len("folded norm weight", n.w.len(), cols)?;
            Ok(NormArg {
                w: self.ptr(&n.w),
                eps: n.eps,
            })
        })
        .transpose()
    }
}

/// `AFM_MLP_HALF=0` (read once) turns [`CudaContext::matmul_mlp_add`] off, for A/B.
fn mlp_half_on() -> bool {
    static ON: Switch = Switch::new("AFM_MLP_HALF", true);
    ON.on()
}

/// Whether the 16-bit GEMV folds a norm in for `n` rows of `ws` (gate+up when `gated`).
fn half_norm_fold(ws: &[&DeviceWeight], gated: bool, n: usize) -> bool {
    let any_width = gemv_shape::gated_norm_any_width();
    n <= NORM_FOLD_MAX_ROWS
        && (!gated || any_width || ws.iter().all(|w| w.cols <= NORM_FOLD_GATED_MAX_COLS))
}

/// Whether fused GEMV launches serve `n` rows of 16-bit weights `ws` (same type and width,
/// 16-byte aligned activations).
fn fused_ok(ws: &[&DeviceWeight], n: usize, xp: u64) -> bool {
    let Some(first) = ws.first() else {
        return false;
    };
    (1..=GEMV_MAX_BATCH).contains(&n)
        && matches!(first.dtype, DType::BF16 | DType::F16)
        && first.cols.is_multiple_of(8)
        && xp.is_multiple_of(16)
        && ws
            .iter()
            .all(|w| w.dtype == first.dtype && w.cols == first.cols)
}

/// Whether `n` rows of the 16-bit weights `ws` (same type and width) go to cuBLAS together
/// ([`CudaContext::gemm_many_half`]): past the GEMV's batch sizes.
fn half_gemm_ok(ws: &[&DeviceWeight], n: usize) -> bool {
    let Some(first) = ws.first() else {
        return false;
    };
    n > GEMV_MAX_BATCH
        && matches!(first.dtype, DType::BF16 | DType::F16)
        && ws
            .iter()
            .all(|w| w.dtype == first.dtype && w.cols == first.cols)
}

/// cuBLAS's type for 16-bit weights and activations: bf16, else f16.
fn blas_half(bf16: bool) -> cudaDataType_t {
    if bf16 {
        cudaDataType_t::CUDA_R_16BF
    } else {
        cudaDataType_t::CUDA_R_16F
    }
}

fn half_name(w: &DeviceWeight) -> &'static str {
    if w.dtype == DType::BF16 {
        "bf16"
    } else {
        "f16"
    }
}

/// Whether quantized weights `ws` of one width can share one int8 quantization of `n` rows
/// (the int8 GEMV path, at most `GEMV_MAX_ROWS` rows).
fn quant_shared_ok(ws: &[&DeviceWeight], n: usize) -> bool {
    let Some(first) = ws.first() else {
        return false;
    };
    (1..=GEMV_MAX_ROWS).contains(&n) && ws.iter().all(|w| is_quant(w.dtype) && w.cols == first.cols)
}

impl CudaContext {
    /// Two or three projections of the same `n` rows (Q, K, V; gate and up): `outs[i] = x ·
    /// wsᵢᵀ`, 16-bit weights in one GEMV launch (from 9 to 64 rows one MMH launch, past that
    /// one conversion of x and a cuBLAS GEMM each), quantized ones (types may differ) from one
    /// int8 quantization of x and one GEMV or MMQ launch. `false` (nothing launched) when none applies (more rows
    /// than the GEMV and MMQ take, mixed 16-bit and quantized weights): the caller runs them
    /// one by one.
    pub fn matmul_many(
        &mut self,
        ws: &[&DeviceWeight],
        x: &impl DevicePtr<f32>,
        n: usize,
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<bool> {
        self.many(ws, x, None, n, outs)
    }

    /// [`matmul_many`](Self::matmul_many) of `rms_norm(x)`, the norm folded into the 16-bit
    /// GEMV (each block sums the squares of its activation rows itself) or into the int8
    /// quantization (one launch for both): a launch fewer per block of a decode step. `false`
    /// (nothing launched) where neither applies (past the GEMV's batch sizes): the caller
    /// normalizes first.
    pub fn matmul_many_norm(
        &mut self,
        ws: &[&DeviceWeight],
        x: &impl DevicePtr<f32>,
        norm: RowNorm,
        n: usize,
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<bool> {
        self.many(ws, x, Some(&norm), n, outs)
    }

    /// Whether [`matmul_many_norm`](Self::matmul_many_norm) and
    /// [`matmul_gated_norm`](Self::matmul_gated_norm) can fold the norm in for `n` rows of
    /// `ws` (so callers allocate outputs only then).
    /// `gated`: gate and up (`ws` = [gate, up]).
    pub fn folds_norm(
        &self,
        ws: &[&DeviceWeight],
        gated: bool,
        n: usize,
        x: &impl DevicePtr<f32>,
    ) -> bool {
        quant_shared_ok(ws, n)
            || (half_norm_fold(ws, gated, n) && fused_ok(ws, n, self.ptr(x)))
            || half_gemm_ok(ws, n)
    }

    /// Two or three projections of the same `n` rows whose weights lie back to back
    /// ([`DeviceWeight::upload_joined`]; Q, K, V) as one GEMM into one `[n][Σ rows]` buffer,
    /// each row the outputs side by side (`[q | k | v]`), of `rms_norm(x)` with `norm`: what
    /// [`matmul_many`](Self::matmul_many) computes there, bit for bit, without its copy into
    /// separate outputs, for consumers that read rows with a stride
    /// ([`attend_prologue_joined`](Self::attend_prologue_joined)). `None` (nothing launched)
    /// where `matmul_many` would not take that GEMM: up to `GEMV_MAX_BATCH` rows, MMH on,
    /// quantized or separately uploaded weights.
    pub fn matmul_joined(
        &mut self,
        ws: &[&DeviceWeight],
        x: &impl DevicePtr<f32>,
        norm: Option<RowNorm>,
        n: usize,
    ) -> Result<Option<CudaSlice<f32>>> {
        let xp = self.ptr(x);
        let Some(all) = joined(ws) else {
            return Ok(None);
        };
        // As `many` chooses: MMH only without a norm, else cuBLAS past the GEMV's rows.
        let mmh = norm.is_none() && self.mmh_auto(ws, n, xp);
        if !(2..=3).contains(&ws.len()) || !half_gemm_ok(ws, n) || mmh {
            return Ok(None);
        }
        check_len("matmul input", x.len(), n * all.cols)?;
        let norm = self.norm_arg(norm.as_ref(), all.cols)?;
        let mut out = self.alloc::<f32>(n * all.rows)?;
        let op = self.ptr_mut(&mut out);
        self.gemm_many_half(&[&all], xp, n, &[op], false, norm)?;
        Ok(Some(out))
    }

    fn many(
        &mut self,
        ws: &[&DeviceWeight],
        x: &impl DevicePtr<f32>,
        norm: Option<&RowNorm>,
        n: usize,
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<bool> {
        let xp = self.ptr(x);
        if !(2..=3).contains(&ws.len()) || ws.len() != outs.len() {
            return Ok(false);
        }
        let norm = self.norm_arg(norm, ws[0].cols)?;
        let same_quant = ws.iter().all(|w| is_quant(w.dtype) && w.cols == ws[0].cols);
        let mmq = same_quant && self.mmq_auto(n);
        let quant = quant_shared_ok(ws, n);
        let mmh = self.mmh_auto(ws, n, xp);
        let half_gemm = half_gemm_ok(ws, n);
        let fused = fused_ok(ws, n, xp);
        let applies = if norm.is_some() {
            quant || (fused && half_norm_fold(ws, false, n)) || half_gemm
        } else {
            mmq || quant || mmh || half_gemm || fused
        };
        if !applies {
            return Ok(false);
        }
        check_len("matmul input", x.len(), n * ws[0].cols)?;
        for (w, o) in ws.iter().zip(outs.iter()) {
            check_len("matmul output", o.len(), n * w.rows)?;
        }
        let ops: Vec<u64> = outs.iter_mut().map(|o| self.ptr_mut(&mut **o)).collect();
        if norm.is_none() && mmq {
            let acts = self.mmq_quantize(xp, n, ws[0].cols)?;
            self.mmq(ws, &ops, acts, None, false)?;
            return Ok(true);
        }
        if quant {
            let acts = self.quantize_q8(xp, n, ws[0].cols, norm)?;
            self.gemv_q8(ws, &ops, acts, n, None, false)?;
            return Ok(true);
        }
        if norm.is_none() && mmh {
            self.mmh(ws, xp, n, &ops, None, false)?;
            return Ok(true);
        }
        if half_gemm {
            self.gemm_many_half(ws, xp, n, &ops, false, norm)?;
            return Ok(true);
        }
        let w3 = |i: usize| ws.get(i).unwrap_or(&ws[0]);
        let (w0, w1, w2) = (
            self.weight_ptr(w3(0)),
            self.weight_ptr(w3(1)),
            self.weight_ptr(w3(2)),
        );
        let (o0, o1, o2) = (ops[0], ops[1], ops.get(2).copied().unwrap_or(0));
        let NormArg { w: nw, eps } = norm.unwrap_or(NormArg { w: 0, eps: 0.0 });
        let rows = |i: usize| ws.get(i).map_or(0, |w| w.rows) as i32;
        let (r0, r1, r2, ci) = (rows(0), rows(1), rows(2), ws[0].cols as i32);
        let (name, kind) = if norm.is_some() {
            ("gemv3n", HalfKernel::QkvNorm)
        } else {
            ("gemv3", HalfKernel::Qkv)
        };
        let pre = preload_suffix(n, ws[0].cols);
        let mat_rows: Vec<usize> = ws.iter().map(|w| w.rows).collect();
        let s = half_rows(
            kind,
            &mat_rows,
            ws[0].cols,
            n,
            !pre.is_empty(),
            self.info().sm_count,
        )?;
        let blocks: usize = mat_rows.iter().map(|m| m.div_ceil(s.rows)).sum();
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (GEMV_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let t = half_name(ws[0]);
        let f = self.kernel(&format!("{name}{pre}_{t}_{n}{}", s.suffix()))?;
        launch!(self, f, cfg; w0, w1, w2, xp, nw, eps, o0, o1, o2, r0, r1, r2, ci)?;
        Ok(true)
    }

    /// `out = act(x · gateᵀ) · (x · upᵀ)` in one GEMV launch (act 0 = SiLU, 1 = GELU tanh),
    /// for 16-bit or same-typed quantized weights (after one int8 quantization of x, in
    /// launches of at most `GEMV_MAX_BATCH` rows; from 17 to [`MMQ_GATED_MAX_ROWS`] rows one MMQ
    /// launch; 16-bit ones from 9 to `MMH_GATED_MAX_ROWS` one MMH launch); `false` (nothing
    /// launched) where the fused kernels do not apply.
    pub fn matmul_gated(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        act: super::Activation,
        x: &impl DevicePtr<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        self.gated_into(gate, up, act, x, None, n, out)
    }

    /// [`matmul_gated`](Self::matmul_gated) of `rms_norm(x)`, the norm folded in as
    /// [`matmul_many_norm`](Self::matmul_many_norm) does; `false` (nothing launched) where it
    /// cannot be (MMQ's rows and past them).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_gated_norm(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        act: super::Activation,
        x: &impl DevicePtr<f32>,
        norm: RowNorm,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        self.gated_into(gate, up, act, x, Some(&norm), n, out)
    }

    /// The gated MLP of a residual block past the GEMV's rows, 16-bit weights through cuBLAS:
    /// `x += down(act(gate(rms_norm(x))) · up(rms_norm(x)))`, the normalized x and the
    /// activation each written once in 16 bits for the GEMMs (no f32 → 16-bit conversion
    /// launches), the down product adding into x. Bit-equal to `matmul_gated_norm` then
    /// `matmul_add`. `false` (nothing launched) where it does not apply: quantized or mixed
    /// weights, at most `GEMV_MAX_BATCH` rows, MMH on, or `AFM_MLP_HALF=0`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_mlp_add(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        down: &DeviceWeight,
        act: super::Activation,
        x: &mut impl DevicePtrMut<f32>,
        norm: RowNorm,
        n: usize,
    ) -> Result<bool> {
        let (d, ff) = (gate.cols, gate.rows);
        let xp = self.ptr_mut(x);
        let mmh = n <= MMH_GATED_MAX_ROWS && self.mmh_auto(&[gate, up], n, xp);
        let shapes = up.rows == ff && up.cols == d && down.cols == ff && down.rows == d;
        let half = half_gemm_ok(&[gate, up], n) && down.dtype == gate.dtype;
        if !(mlp_half_on() && shapes && half && !mmh) {
            return Ok(false);
        }
        check_len("matmul input", x.len(), n * d)?;
        let norm = self.norm_arg(Some(&norm), d)?;
        let bf16 = gate.dtype == DType::BF16;
        let mut h = self.alloc::<u16>(n * ff)?;
        let hp = self.ptr_mut(&mut h);
        // The skinny GEMM takes gate and up in one launch whose epilogue writes the activation
        // in 16 bits (no f32 products, no activation launch); else cuBLAS and `gated_act_h`.
        let hx = self.half_input(xp, n, d, bf16, norm)?;
        let gated = SkinnyArgs {
            w: self.weight_ptr(gate),
            x: hx,
            out: hp,
            rows: ff,
            cols: d,
            n,
            ldc: ff,
            accumulate: false,
            bf16,
            gated: Some(SkinnyGated {
                up: self.weight_ptr(up),
                act: act.code(),
            }),
        };
        if !self.skinny_gemm(gated)? {
            let mut gu = self.gate_up_from_half(gate, up, hx, n)?;
            let gp = self.ptr_mut(&mut gu.buf);
            let upp = gp + (4 * gu.up) as u64;
            self.gated_act_half(act, gp, upp, n, ff, gu.stride, hp, bf16)?;
        }
        let ty = blas_half(bf16);
        let dims = GemmDims {
            m: d,
            n,
            k: ff,
            ldc: d,
            accumulate: true,
        };
        let dp = self.weight_ptr(down);
        self.blas_gemm(ty, dp, hp, xp, dims)?;
        Ok(true)
    }

    /// Gate and up of 16-bit weights through cuBLAS, from one conversion of x (of
    /// `rms_norm(x)` with `norm`), in f32 ([`gate_up_from_half`](Self::gate_up_from_half)).
    fn gate_up_half(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        xp: u64,
        n: usize,
        norm: Option<NormArg>,
    ) -> Result<GateUp> {
        let hx = self.half_input(xp, n, gate.cols, gate.dtype == DType::BF16, norm)?;
        self.gate_up_from_half(gate, up, hx, n)
    }

    /// Gate and up of 16-bit weights through cuBLAS from `hx`, x already in their type
    /// ([`half_input`](Self::half_input)), in f32: one GEMM over both where they lie back to
    /// back ([`joined`]; each row `[gate | up]`), else two (`[2][n][rows]`).
    fn gate_up_from_half(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        hx: u64,
        n: usize,
    ) -> Result<GateUp> {
        let (rows, cols) = (gate.rows, gate.cols);
        let ty = blas_half(gate.dtype == DType::BF16);
        let mut buf = self.alloc::<f32>(2 * n * rows)?;
        let gp = self.ptr_mut(&mut buf);
        let product = |m, ldc| GemmDims {
            m,
            n,
            k: cols,
            ldc,
            accumulate: false,
        };
        if let Some(both) = joined(&[gate, up]) {
            let bp = self.weight_ptr(&both);
            self.blas_gemm(ty, bp, hx, gp, product(2 * rows, 2 * rows))?;
            return Ok(GateUp {
                buf,
                up: rows,
                stride: 2 * rows,
            });
        }
        let upp = gp + (4 * n * rows) as u64;
        for (w, op) in [(gate, gp), (up, upp)] {
            let wp = self.weight_ptr(w);
            self.blas_gemm(ty, wp, hx, op, product(rows, rows))?;
        }
        Ok(GateUp {
            buf,
            up: n * rows,
            stride: rows,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn gated_into(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        act: super::Activation,
        x: &impl DevicePtr<f32>,
        norm: Option<&RowNorm>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        let xp = self.ptr(x);
        let norm = self.norm_arg(norm, gate.cols)?;
        let quant = gate.dtype == up.dtype && quant_shared_ok(&[gate, up], n);
        let mmq = norm.is_none()
            && gate.dtype == up.dtype
            && is_quant(gate.dtype)
            && gate.cols == up.cols
            && n <= MMQ_GATED_MAX_ROWS
            && self.mmq_auto(n);
        let mmh = norm.is_none() && n <= MMH_GATED_MAX_ROWS && self.mmh_auto(&[gate, up], n, xp);
        let fused = fused_ok(&[gate, up], n, xp)
            && (norm.is_none() || half_norm_fold(&[gate, up], true, n));
        let half_gemm = half_gemm_ok(&[gate, up], n);
        if gate.rows != up.rows || !(mmq || quant || mmh || fused || half_gemm) {
            return Ok(false);
        }
        check_len("matmul input", x.len(), n * gate.cols)?;
        check_len("matmul output", out.len(), n * gate.rows)?;
        let (gp, up_, op) = (
            self.weight_ptr(gate),
            self.weight_ptr(up),
            self.ptr_mut(out),
        );
        let (ri, ci) = (gate.rows as i32, gate.cols as i32);
        let a = act.code();
        if mmq {
            let acts = self.mmq_quantize(xp, n, gate.cols)?;
            self.mmq_gated(gate, up, a, acts, op)?;
            return Ok(true);
        }
        if mmh {
            self.mmh_gated(gate, up, a, xp, n, op, None)?;
            return Ok(true);
        }
        if half_gemm {
            // Gate and up from one (normalized) conversion of x, then the activation.
            let gu = self.gate_up_half(gate, up, xp, n, norm)?;
            let (g, u) = (gu.buf.slice(..), gu.buf.slice(gu.up..));
            self.gated_act(act, &g, &u, n, gate.rows, gu.stride, out)?;
            return Ok(true);
        }
        if quant {
            if gate.rows == 0 {
                return Ok(true);
            }
            let acts = self.quantize_q8(xp, n, gate.cols, norm)?;
            let shape = Q8Launch::new(&[gate.rows], gate.cols, self.info().sm_count, None);
            let (cfg, groups, ty) = (shape.cfg, shape.groups, q8_type(gate.dtype));
            for c0 in (0..n).step_by(GEMV_MAX_BATCH) {
                let nb = (n - c0).min(GEMV_MAX_BATCH);
                let x0 = acts.at_row(c0);
                let (q0, d0, s0) = (x0.q, x0.d, x0.s);
                let o0 = op + (c0 * gate.rows * 4) as u64;
                let f = self.kernel(&shape.kernel(true, nb))?;
                let pf = gemv_prefetch();
                launch!(self, f, cfg; gp, up_, ty, q0, d0, s0, o0, ri, ci, groups, pf, a)?;
            }
            return Ok(true);
        }
        let (name, kind) = if norm.is_some() {
            ("gemvgn", HalfKernel::GatedNorm)
        } else {
            ("gemvg", HalfKernel::Gated)
        };
        let pre = preload_suffix(n, gate.cols);
        let s = half_rows(
            kind,
            &[gate.rows],
            gate.cols,
            n,
            !pre.is_empty(),
            self.info().sm_count,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (gate.rows.div_ceil(s.rows) as u32, 1, 1),
            block_dim: (GEMV_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let NormArg { w: nw, eps } = norm.unwrap_or(NormArg { w: 0, eps: 0.0 });
        let t = half_name(gate);
        let f = self.kernel(&format!("{name}{pre}_{t}_{n}{}", s.suffix()))?;
        launch!(self, f, cfg; gp, up_, xp, nw, eps, op, ri, ci, a)?;
        Ok(true)
    }
}
