//! The 16-bit matmul on tensor cores (MMH, kernels/mmh.cu) for batches past the bf16/f16 GEMV:
//! `out[n, rows] (+)= x[n, cols] · Wᵀ` for BF16 and F16 weights, each weight byte read once per
//! call, with x rounded to the weights' type inside the kernel (no conversion launch) and f32
//! accumulation: the cuBLAS path's arithmetic (`f32_to_bf16` + GEMM) in one launch, for one to
//! three matrices of one width (Q/K/V), gate+up with the activation, and `out +=` (the residual
//! add of the O and down projections, [`CudaContext::matmul_add`]).
//!
//! It owns the launches, their shape (warps per block, K splits, who sums the splits: the last
//! one inside the kernel or the `mmh_reduce` launch, both in a fixed order, so results do not
//! depend on scheduling), their shared memory (a ring of [`stages`] weight + activation tiles
//! that cp.async fills ahead of the tensor cores) and the rule for when the device has them
//! (sm_80 and later with the shared memory per block, with `AFM_MMH=1`); which batch sizes
//! take it is `matmul.rs`'s path choice.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::context::{scratch, scratch_zeroed};
use super::device_weight::DeviceWeight;
use super::matmul::{MatmulPath, GEMV_MAX_BATCH};
use super::ops::grid_1d;
use super::{check_len, launch, CudaContext, CudaError, Result};
use crate::switch::Switch;
use crate::DType;

/// Activation rows one MMH launch takes (`mmh_*_1` .. `mmh_*_8`: tiles of 8); more go in
/// launches of this many, each reading the weights again.
pub const MMH_LAUNCH_ROWS: usize = 64;
/// The automatic path's largest batch for 16-bit weights on MMH (one launch); cuBLAS above.
pub const MMH_MAX_ROWS: usize = 64;
/// The fused gate+up launch serves up to this many rows; past it `matmul_gated` declines and the
/// caller runs gate and up as one two-matrix launch plus the activation. Not yet measured
/// against that alternative (`cuda_bench mmh` times both): all of MMH's rows for now.
pub const MMH_GATED_MAX_ROWS: usize = 64;
/// Activation rows per tile of the kernels (the mma's n).
const TILE_N: usize = 8;
/// Columns per step of the kernels (`MMH_CHUNK`): the width must be a multiple.
const CHUNK: usize = 64;
/// Warps per block that the kernels come in (`MMH_ALL` in mmh.cu).
const WARP_COUNTS: [usize; 2] = [4, 8];
/// Most K splits of one launch (partials and the last block's sum grow with them).
const MAX_SPLITS: usize = 16;
/// How many 64-column chunks ahead each warp asks L2 for its weights (`pf` in mmh.cu): none, as
/// the cp.async ring already has [`stages`] - 2 chunks in flight past the next (64 KB per
/// block, about twice what the copy bandwidth needs per SM at a microsecond's latency). Not
/// yet measured with the ring: `cuda_bench mmh` times 0, 2 and 8 at the automatic shape.
const PREFETCH_CHUNKS: usize = 0;
/// Pipeline stages of the kernels with `warps` warps (`MmhSmem::ST` in mmh.cu): chunks in the
/// shared-memory ring, the one the warps multiply, the next (its x being rounded) and the rest
/// in flight: 64 KB of weights at 8 warps (4 stages of 32 KB) and at 4 (6 of 16 KB).
fn stages(warps: usize) -> usize {
    if warps == 8 {
        4
    } else {
        6
    }
}
/// Words per row of the 16-bit x buffers (`MMH_XB_STRIDE`): 32 pairs and 16 of padding.
const XB_STRIDE: usize = 48;
const BLOCKS_PER_SM_BY_REGS: [(usize, usize); 2] = [(4, 3), (8, 1)];
/// Weight rows (gate and up counted both) from which blocks have 8 warps (256 rows, 2 tiles of
/// 16 per warp) rather than 4: at a given fill of the device, twice the rows per block halve
/// the re-reads of x from L2 (half a weight byte per byte at 64 rows with 8 warps). Below it
/// (Qwen3 K/V, Qwen3-0.6B's Q) 8-warp blocks are too few to fill the device without more
/// splits than columns. A guess, not yet measured with the cp.async ring: `cuda_bench mmh`
/// times both.
const WIDE_ROWS: usize = 4096;

/// Most K splits the last one of which sums the partials in the main kernel; more go to the
/// `mmh_reduce` launch after it, where every SM shares the sum (the in-kernel sum is one block
/// reading `splits - 1` partial tiles, 64 KB each at 64 rows and 8 warps). A guess, not yet
/// measured: `cuda_bench mmh` times both at the automatic shape.
const MAX_FIXUP_SPLITS: usize = 2;

/// Dynamic shared memory of a launch with `warps` warps per block and `nt` activation tiles
/// (`MmhSmem<NT, W>::BYTES` in mmh.cu): [`stages`] x (weights 32·warps rows x 128 bytes, x
/// 8·nt rows x 64 f32), then two 16-bit x buffers of 8·nt rows x [`XB_STRIDE`] words. 216 KB
/// at 64 rows, with 4 warps as with 8.
fn smem_bytes(warps: usize, nt: usize) -> usize {
    let (stage, xb) = (
        32 * warps * 2 * CHUNK + TILE_N * nt * CHUNK * 4,
        TILE_N * nt * XB_STRIDE * 4,
    );
    stages(warps) * stage + 2 * xb
}

/// The device's shared memory in bytes: the most one block may opt in to, and per SM.
#[derive(Debug, Clone, Copy)]
struct Smem {
    block: usize,
    sm: usize,
}

/// Every kernel of mmh.cu, for the context's loader.
pub(super) fn kernel_names() -> Vec<String> {
    let mut v = vec!["mmh_reduce".to_string()];
    for t in ["bf16", "f16"] {
        for w in WARP_COUNTS {
            v.extend((1..=MMH_LAUNCH_ROWS / TILE_N).map(|nt| format!("mmh_{t}_w{w}_{nt}")));
        }
    }
    v
}

/// Whether `AFM_MMH=1` puts the tensor-core path in automatic path choice (read once; off
/// otherwise). Off by default because it measured slower than x → bf16 + cuBLAS end to end on
/// the H200 (session 7, gpu_bench, random bf16 models, AFM_MMH=1 vs 0; the second version,
/// weights through a cp.async ring): Qwen3-0.6B 7,855 vs 7,370 tok/s at 16 streams, 13,076 vs
/// 12,980 at 32, but 19,519 vs 22,968 at 64; Qwen3-8B slower at all three (2,229 vs 2,406,
/// 3,806 vs 4,450, 5,505 vs 8,126). `cuda_bench mmh`: 12288×4096 at 64 rows 70 µs against
/// cuBLAS's 32.5 (Hopper cuBLAS uses wgmma; `mma.sync` with its shared-memory traffic does not
/// reach the weights' bandwidth at 64 rows).
fn mmh_env_on() -> bool {
    static ON: Switch = Switch::new("AFM_MMH", false);
    ON.on()
}

/// `MmhMats` in mmh.cu: up to three matrices (weights, outputs, rows; rows 0 for absent
/// ones), served by consecutive ranges of blocks; for gate+up, gate and up in `w[0..2]`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MmhMats {
    w: [u64; 3],
    out: [u64; 3],
    rows: [i32; 3],
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct (six pointers, three ints).
unsafe impl cudarc::driver::DeviceRepr for MmhMats {}

/// How a launch covers its matrices: warps per block (4 or 8), K splits, who sums the splits
/// (the last one in the kernel, or `mmh_reduce`) and the L2 prefetch distance in chunks (0:
/// none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MmhShape {
    warps: usize,
    splits: usize,
    fixup: bool,
    prefetch: usize,
}

/// Row blocks of a launch over matrices of `rows` with `warps` warps (gated: 16 output rows
/// per warp, of gate and up each; else 32).
fn row_blocks(rows: &[usize], gated: bool, warps: usize) -> usize {
    let rb = if gated { 16 } else { 32 } * warps;
    rows.iter().map(|r| r.div_ceil(rb)).sum()
}

/// The automatic shape for `n` activation rows: 8 warps per block from [`WIDE_ROWS`] weight
/// rows, and as many K splits as fill the device once (blocks per SM by shared memory and
/// registers: one at the Qwen3 shapes on the H200), at most one per 64-column chunk,
/// [`MAX_SPLITS`], and as many as keep the f32 partials (splits x n x rows x 4 bytes, written
/// and read back through L2) within half the weights' bytes (rows x cols x 2): Qwen3-0.6B's
/// 1024 columns at 64 rows take 4. None where the device's shared memory per block is too
/// small even for 4 warps.
fn auto_shape(
    rows: &[usize],
    gated: bool,
    cols: usize,
    n: usize,
    sm_count: usize,
    smem: Smem,
) -> Option<MmhShape> {
    let weight_rows: usize = rows.iter().sum::<usize>() * if gated { 2 } else { 1 };
    let np = n.clamp(1, MMH_LAUNCH_ROWS).next_multiple_of(TILE_N);
    let nt = np / TILE_N;
    let wide = weight_rows >= WIDE_ROWS && smem_bytes(8, nt) <= smem.block;
    let warps = if wide { 8 } else { 4 };
    let bytes = smem_bytes(warps, nt);
    if bytes > smem.block {
        return None;
    }
    // Blocks per SM: shared memory (1 KB of it reserved per block) and registers.
    let by_regs = BLOCKS_PER_SM_BY_REGS
        .iter()
        .find(|&&(w, _)| w == warps)
        .map_or(1, |&(_, b)| b);
    let per_sm = (smem.sm / (bytes + 1024)).clamp(1, by_regs);
    let slots = sm_count * per_sm;
    let blocks = row_blocks(rows, gated, warps).max(1);
    let most = (cols / CHUNK).min(MAX_SPLITS).min(cols / (4 * np)).max(1);
    let splits = (slots / blocks).clamp(1, most);
    Some(MmhShape {
        warps,
        splits,
        fixup: splits <= MAX_FIXUP_SPLITS,
        prefetch: PREFETCH_CHUNKS,
    })
}

/// What a forced path asks of MMH: `Some(None)` for `Mmh` (automatic shape), `Some(shape)` for
/// `MmhWith`, `None` for other paths.
pub(super) fn mmh_shape(path: MatmulPath) -> Option<Option<MmhShape>> {
    match path {
        MatmulPath::Mmh => Some(None),
        MatmulPath::MmhWith {
            warps,
            splits,
            fixup,
            prefetch,
        } => Some(Some(MmhShape {
            warps,
            splits,
            fixup,
            prefetch,
        })),
        _ => None,
    }
}

impl CudaContext {
    /// Whether MMH serves `ws` against activations at `xp`: one 16-bit type and width, the
    /// width a whole number of 64-column chunks, x and the weights 16-byte aligned (read as
    /// float4 / uint4).
    fn mmh_fits(&self, ws: &[&DeviceWeight], xp: u64) -> bool {
        let Some(first) = ws.first() else {
            return false;
        };
        matches!(first.dtype(), DType::BF16 | DType::F16)
            && first.cols() > 0
            && first.cols().is_multiple_of(CHUNK)
            && xp.is_multiple_of(16)
            && ws.iter().all(|w| {
                w.dtype() == first.dtype()
                    && w.cols() == first.cols()
                    && self.weight_ptr(w).is_multiple_of(16)
            })
    }

    /// Whether the device runs the MMH kernels (bf16 `mma.sync` and cp.async need sm_80).
    fn mmh_supported(&self) -> bool {
        self.info().compute_capability.0 >= 8
    }

    /// The device's shared memory per block (opt-in) and per SM.
    fn mmh_smem(&self) -> Result<Smem> {
        let ctx = self.stream().context();
        let at = |a| ctx.attribute(a).map(|v| v.max(0) as usize);
        Ok(Smem {
            block: at(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            sm: at(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
        })
    }

    /// Whether automatic path choice sends `n` rows against `ws` to MMH: past the GEMV's
    /// batches up to [`MMH_MAX_ROWS`], on sm_80+ with the shared memory for 4-warp blocks, with
    /// `AFM_MMH=1`.
    pub(super) fn mmh_auto(&self, ws: &[&DeviceWeight], n: usize, xp: u64) -> bool {
        (GEMV_MAX_BATCH + 1..=MMH_MAX_ROWS).contains(&n)
            && mmh_env_on()
            && self.mmh_supported()
            && self.mmh_fits(ws, xp)
            && self
                .mmh_smem()
                .is_ok_and(|s| smem_bytes(4, n.div_ceil(TILE_N)) <= s.block)
    }

    /// Why MMH cannot serve `ws` at `xp` on this device, if it cannot (forced paths).
    fn mmh_check(&self, ws: &[&DeviceWeight], xp: u64) -> Result<()> {
        if !self.mmh_supported() {
            let (major, minor) = self.info().compute_capability;
            return Err(CudaError::Unsupported {
                what: "MMH (16-bit tensor cores) on compute capability",
                value: format!("{major}.{minor}"),
                supported: "8.0 and later",
            });
        }
        if self.mmh_fits(ws, xp) {
            return Ok(());
        }
        let what = ws
            .iter()
            .map(|w| format!("{} {}x{}", w.dtype().name(), w.rows(), w.cols()))
            .collect::<Vec<_>>()
            .join(", ");
        Err(CudaError::Unsupported {
            what: "MMH weights",
            value: format!("{what} (activations at {xp:#x})"),
            supported: "BF16 or F16 of one type and width, the width a multiple of 64, \
                        activations and weights 16-byte aligned",
        })
    }

    /// `outs[i] (+)= x · wsᵢᵀ` (`[n][wsᵢ.rows]`) for one to three 16-bit matrices of one type
    /// and width, x f32 at `xp`, in one launch per [`MMH_LAUNCH_ROWS`] rows; `shape` forced
    /// ([`mmh_shape`]), else [`auto_shape`].
    pub(super) fn mmh(
        &mut self,
        ws: &[&DeviceWeight],
        xp: u64,
        n: usize,
        outs: &[u64],
        shape: Option<MmhShape>,
        accumulate: bool,
    ) -> Result<()> {
        if !(1..=3).contains(&ws.len()) || ws.len() != outs.len() {
            return Err(CudaError::Unsupported {
                what: "MMH matrices per launch",
                value: format!("{} matrices, {} outputs", ws.len(), outs.len()),
                supported: "1 to 3, one output each",
            });
        }
        self.mmh_check(ws, xp)?;
        let mut m = MmhMats {
            w: [0; 3],
            out: [0; 3],
            rows: [0; 3],
        };
        for (i, (w, &o)) in ws.iter().zip(outs).enumerate() {
            (m.w[i], m.out[i], m.rows[i]) = (self.weight_ptr(w), o, w.rows() as i32);
        }
        let rows: Vec<usize> = ws.iter().map(|w| w.rows()).collect();
        self.mmh_launch(m, &rows, -1, ws[0], xp, n, shape, accumulate)
    }

    /// `out = act(x · gateᵀ) · (x · upᵀ)` (act 0 = SiLU, 1 = GELU tanh) for `gate` and `up` of
    /// one 16-bit type and shape: each warp computes 16 rows of both.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mmh_gated(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        act: i32,
        xp: u64,
        n: usize,
        out: u64,
        shape: Option<MmhShape>,
    ) -> Result<()> {
        self.mmh_check(&[gate, up], xp)?;
        super::check("MMH up rows", up.rows(), gate.rows())?;
        let r = gate.rows() as i32;
        let m = MmhMats {
            w: [self.weight_ptr(gate), self.weight_ptr(up), 0],
            out: [out, 0, 0],
            rows: [r, r, 0],
        };
        self.mmh_launch(m, &[gate.rows()], act, gate, xp, n, shape, false)
    }

    /// Launches the kernels over `m` (act ≥ 0: gate+up, `rows` the gate's) for each
    /// [`MMH_LAUNCH_ROWS`] activation rows; `first` gives the type and width.
    #[allow(clippy::too_many_arguments)]
    fn mmh_launch(
        &mut self,
        mut m: MmhMats,
        rows: &[usize],
        act: i32,
        first: &DeviceWeight,
        xp: u64,
        n: usize,
        shape: Option<MmhShape>,
        accumulate: bool,
    ) -> Result<()> {
        let (gated, cols) = (act >= 0, first.cols());
        let smem = self.mmh_smem()?;
        let shape =
            match shape {
                None => auto_shape(rows, gated, cols, n, self.info().sm_count, smem).ok_or_else(
                    || CudaError::Unsupported {
                        what: "MMH shared memory per block",
                        value: format!(
                            "{} bytes (4 warps, {} rows; this device allows {})",
                            smem_bytes(4, n.clamp(1, MMH_LAUNCH_ROWS).div_ceil(TILE_N)),
                            n.min(MMH_LAUNCH_ROWS),
                            smem.block
                        ),
                        supported: "at most the device's opt-in shared memory per block",
                    },
                )?,
                Some(s) if WARP_COUNTS.contains(&s.warps) && s.splits >= 1 => s,
                Some(s) => {
                    return Err(CudaError::Unsupported {
                        what: "MMH warps per block and K splits",
                        value: format!("{} warps, {} splits", s.warps, s.splits),
                        supported: "4 or 8 warps, at least 1 split",
                    })
                }
            };
        // More splits than chunks would leave blocks without columns; mmh_reduce holds at most
        // MAX_SPLITS partials per thread.
        let splits = shape.splits.min(cols / CHUNK);
        if splits > MAX_SPLITS && !shape.fixup {
            return Err(CudaError::Unsupported {
                what: "MMH K splits summed by mmh_reduce",
                value: splits.to_string(),
                supported: "at most 16 (MMH_MAX_SPLITS in mmh.cu)",
            });
        }
        let blocks = row_blocks(rows, gated, shape.warps);
        if blocks == 0 || n == 0 {
            return Ok(()); // nothing to write (and no empty launch)
        }
        let (part, done) = if splits > 1 {
            let stream = self.stream().clone();
            // [block][split][2 NT][32 W] float4, NT of the largest launch.
            let nt = n.min(MMH_LAUNCH_ROWS).div_ceil(TILE_N);
            let len = blocks * splits * 2 * nt * 32 * shape.warps * 4;
            (
                scratch(&stream, &mut self.ws.mmh_part, len)?,
                scratch_zeroed(&stream, &mut self.ws.mmh_done, blocks)?,
            )
        } else {
            (0, 0)
        };
        let ty = if first.dtype() == DType::BF16 {
            "bf16"
        } else {
            "f16"
        };
        let outs = m.out;
        let (ci, si, acc) = (cols as i32, splits as i32, i32::from(accumulate));
        let pf = shape.prefetch.min(cols / CHUNK) as i32;
        let fixup = i32::from(shape.fixup);
        for c0 in (0..n).step_by(MMH_LAUNCH_ROWS) {
            let nb = (n - c0).min(MMH_LAUNCH_ROWS);
            for (o, (&base, &r)) in m.out.iter_mut().zip(outs.iter().zip(&m.rows)) {
                if base != 0 {
                    *o = base + (c0 * r as usize * 4) as u64;
                }
            }
            let x0 = xp + (c0 * cols * 4) as u64;
            let (ni, nt) = (nb as i32, nb.div_ceil(TILE_N));
            let bytes = smem_bytes(shape.warps, nt);
            if bytes > smem.block {
                return Err(CudaError::Unsupported {
                    what: "MMH shared memory per block",
                    value: format!(
                        "{bytes} bytes ({} warps, {nb} rows; this device allows {})",
                        shape.warps, smem.block
                    ),
                    supported: "at most the device's opt-in shared memory per block",
                });
            }
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, splits as u32, 1),
                block_dim: (32 * shape.warps as u32, 1, 1),
                shared_mem_bytes: bytes as u32,
            };
            self.stream().context().bind_to_thread()?;
            let f = self.kernel(&format!("mmh_{ty}_w{}_{nt}", shape.warps))?;
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )?;
            launch!(self, f, cfg; m, x0, part, done, ci, ni, si, fixup, pf, act, acc)?;
            if splits > 1 && !shape.fixup {
                // One thread per (row block, activation tile, main-kernel thread).
                let threads = blocks * nt * 32 * shape.warps;
                let (bi, nti, wi) = (blocks as i32, nt as i32, shape.warps as i32);
                let f = self.kernel("mmh_reduce")?;
                launch!(self, f, grid_1d(threads, 256); m, part, bi, si, nti, wi, ni, act, acc)?;
            }
        }
        Ok(())
    }

    /// The shape `Mmh` picks for matrices of `rows` (gated: gate+up of `rows[0]` each) and
    /// `cols`, as the `MmhWith` path that forces it (benchmarks print and vary it); `Gemm`
    /// where the device's shared memory per block is too small for MMH at `n` rows.
    pub fn mmh_auto_path(&self, rows: &[usize], gated: bool, cols: usize, n: usize) -> MatmulPath {
        let shape = self
            .mmh_smem()
            .ok()
            .and_then(|smem| auto_shape(rows, gated, cols, n, self.info().sm_count, smem));
        match shape {
            Some(s) => MatmulPath::MmhWith {
                warps: s.warps,
                splits: s.splits.min((cols / CHUNK).max(1)),
                fixup: s.fixup,
                prefetch: s.prefetch,
            },
            None => MatmulPath::Gemm,
        }
    }

    /// Registers per thread and local (spilled) bytes per thread of every MMH kernel as the
    /// driver compiled it for this device: (name, registers, local bytes).
    pub fn mmh_resources(&self) -> Result<Vec<(String, i32, i32)>> {
        kernel_names()
            .into_iter()
            .map(|k| {
                let f = self.kernel(&k)?;
                let (regs, local) = (f.num_regs()?, f.local_size_bytes()?);
                Ok((k, regs, local))
            })
            .collect()
    }

    /// Gate+up with the activation through MMH at any batch size, `path` `Mmh` (automatic
    /// shape) or `MmhWith` (forced): what [`Self::matmul_gated`] launches from 9 to
    /// [`MMH_GATED_MAX_ROWS`] rows, for tests and benchmarks. An error where MMH cannot serve
    /// the weights or `path` is another one.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_gated_with(
        &mut self,
        path: MatmulPath,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        act: super::Activation,
        x: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let Some(shape) = mmh_shape(path) else {
            return Err(CudaError::Unsupported {
                what: "forced gated matmul path",
                value: format!("{path:?}"),
                supported: "Mmh, MmhWith",
            });
        };
        check_len("matmul input", x.len(), n * gate.cols())?;
        check_len("matmul output", out.len(), n * gate.rows())?;
        let (xp, op) = (self.ptr(x), self.ptr_mut(out));
        let a = act.code();
        self.mmh_gated(gate, up, a, xp, n, op, shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H200's shared memory (227 KB per block, 228 KB per SM).
    const H200: Smem = Smem {
        block: 232_448,
        sm: 233_472,
    };

    /// The automatic shapes at Qwen3-8B's and -0.6B's projections on the H200's 132 SMs at 64
    /// rows (16 where noted): 8-warp blocks from 4096 weight rows, splits that fill the device
    /// once (one block per SM: shared memory), never more than
    /// the chunks nor partials past half the weights' bytes.
    #[test]
    fn auto_shape_fills_the_device_once() {
        let s_at = |rows: &[usize], gated, cols, n| {
            let MmhShape {
                warps,
                splits,
                fixup,
                ..
            } = auto_shape(rows, gated, cols, n, 132, H200).expect("fits the H200");
            assert_eq!(
                fixup,
                splits <= MAX_FIXUP_SPLITS,
                "who sums {splits} splits"
            );
            (warps, splits)
        };
        let s = |rows: &[usize], gated, cols| s_at(rows, gated, cols, 64);
        assert_eq!(s(&[4096], false, 4096), (8, 8)); // 16 blocks x 8 = 128
        assert_eq!(s(&[1024], false, 4096), (4, 16)); // 8 blocks x 16
        assert_eq!(s(&[4096, 1024, 1024], false, 4096), (8, 5)); // 24 x 5 = 120
        assert_eq!(s(&[12288], true, 4096), (8, 1)); // 96 blocks of 128 gate + 128 up rows
        assert_eq!(s(&[4096], false, 12288), (8, 8));
        // Qwen3-0.6B: partials cap the splits at 1024 / (4 x 64) = 4 (16 at 16 rows: the chunks).
        assert_eq!(s(&[1024], false, 1024), (4, 4));
        assert_eq!(s_at(&[1024], false, 1024, 16), (4, 16));
        assert_eq!(s(&[3072], true, 1024), (8, 4)); // 24 blocks x 4
        assert_eq!(s(&[2048, 1024, 1024], false, 1024), (8, 4)); // 16 x 4
        assert_eq!(s(&[1024], false, 3072), (4, 12)); // 8 x 12
        assert_eq!(s(&[10], false, 64), (4, 1)); // one chunk: no split
    }

    /// The ring's shared memory: 216 KB at 64 rows (the H200 takes it); an A100 (163 KB per
    /// block) gets MMH up to 32 rows, with 4-warp blocks (8 warps need 172 KB there), and a
    /// device of 99 KB per block none.
    #[test]
    fn auto_shape_fits_the_shared_memory() {
        assert_eq!(smem_bytes(8, 8), 221_184);
        assert_eq!(smem_bytes(4, 8), 221_184);
        assert_eq!(smem_bytes(8, 4), 176_128);
        let a100 = Smem {
            block: 166_912,
            sm: 167_936,
        };
        let small = Smem {
            block: 101_376,
            sm: 102_400,
        };
        let warps = |smem, n| auto_shape(&[4096], false, 4096, n, 108, smem).map(|s| s.warps);
        assert_eq!(warps(H200, 64), Some(8));
        assert_eq!(warps(a100, 64), None);
        assert_eq!(warps(a100, 33), None);
        assert_eq!(warps(a100, 32), Some(4));
        assert_eq!(warps(small, 9), None);
    }
}
