//! The skinny GEMM (`kernels/skinny.cu`): 16-bit weights times 9 to 64 rows of 16-bit
//! activations, in place of cuBLAS for the decode steps of 9..64 streams. [`skinny_plan`]
//! picks each matrix's tile height and column split from its shape and the SM count alone
//! (integers, unit-tested here), so a row's result never depends on how many rows run beside
//! it.
//!
//! On by default on compute capability 9.0 (`AFM_SKINNY=0`: cuBLAS), where its consumers are
//! wgmma warpgroups (session 21). Session 14's `mma.sync` consumers were 3–32% slower than
//! cuBLAS per Qwen3-8B matrix at 64 rows and lost end to end. On wgmma, with the plans below
//! (`cuda_bench skinny`, bench/RESULTS.md session 21), the 8B's Q/K/V, O and down are 0.7–9%
//! faster than cuBLAS at 64 rows and gate+up is even; the gated MLP also drops the f32 gate/up
//! products and the activation launch. End to end on the H200 (`gpu_bench`, 16 / 32 / 64
//! streams): Qwen3-8B 3,004 / 5,596 / 10,869 tok/s against 2,910 / 5,507 / 10,551 with cuBLAS,
//! Qwen3-0.6B 12,096 / 20,577 / 34,509 against 10,301 / 18,508 / 33,008. A first mainloop with
//! cp.async and a block barrier per stage streamed only ~21–27 GB/s per SM; 128-byte
//! `cp.async.bulk` copies per row were slower still (TMA issue cost); one tensor-map copy per
//! tile is what reached the copy rate.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::LaunchConfig;

use super::context::CudaContext;
use super::{cluster_fits, launch, CudaError, Result};
use crate::switch::Switch;

/// Activation rows the skinny GEMM serves (below: the GEMV kernels; above: cuBLAS).
pub const SKINNY_ROWS: std::ops::RangeInclusive<usize> = 9..=64;

/// Columns per pipeline stage (`SK_BK` in skinny.cu).
const BK: usize = 64;

/// Warps per block the kernels come in (32 weight rows each).
const WARPS: [usize; 4] = [8, 6, 4, 2];
/// Column splits tried (cluster sizes; past 8 needs the non-portable cluster attribute).
const SPLITS: [usize; 5] = [1, 2, 4, 8, 16];
/// Fewest columns per split: two stages, so the pipeline has something to overlap.
const MIN_SPLIT_COLS: usize = 2 * BK;
/// Matrices taller than this stay with cuBLAS (lm_head: 151,936 rows, read at 3.9 TB/s there).
const MAX_ROWS: usize = 65_536;

/// Whether the skinny GEMM replaces cuBLAS where it applies (on; `AFM_SKINNY=0` turns it off,
/// see the module header).
pub(crate) fn skinny_on() -> bool {
    static ON: Switch = Switch::new("AFM_SKINNY", true);
    ON.on()
}

/// A matrix's launch shape: weight rows per block (32 per warp) and column splits per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyPlan {
    pub warps: usize,
    pub splits: usize,
}

impl SkinnyPlan {
    fn rows_per_block(self) -> usize {
        32 * self.warps
    }
}

/// Most column splits a plan takes: past 4 the cluster merge costs more than the fuller grid
/// gains (`cuda_bench skinny`, session 21: Qwen3-0.6B's O, 1024×2048 at 64 rows, 7.7 µs at 4
/// splits, 10.2 at 8).
const MAX_PLAN_SPLITS: usize = 4;

/// The shape for `rows` × `cols` weights on `sms` SMs, or `None` (cuBLAS): columns a multiple
/// of 64 and at most [`MAX_ROWS`] rows. The shortest blocks whose tiles fit one wave (one
/// block an SM: a block's ring takes most of the shared memory), then the most column splits,
/// up to [`MAX_PLAN_SPLITS`], that keep one wave and whole stages of at least two. Fitted to
/// the wgmma kernel's sweep on the H200 (`cuda_bench skinny`, session 21, bench/RESULTS.md):
/// it picks the fastest or within 0.7 µs of it for every Qwen3-0.6B and -8B decode matrix at
/// 64 rows (e.g. Q/K/V 6144×4096 2 warps, 1 split: 19.0 µs; gate+up 24576×4096 6 warps:
/// 55.3; down 4096×12288 2 warps, 2 splits: 34.2).
pub fn skinny_plan(rows: usize, cols: usize, sms: usize) -> Option<SkinnyPlan> {
    if rows == 0 || rows > MAX_ROWS || cols == 0 || !cols.is_multiple_of(BK) || sms == 0 {
        return None;
    }
    let tiles = |warps: usize| rows.div_ceil(32 * warps);
    let warps = WARPS
        .into_iter()
        .rev()
        .find(|&w| tiles(w) <= sms)
        .unwrap_or(WARPS[0]);
    let whole = |s: usize| {
        let per = cols / s;
        cols.is_multiple_of(s) && per.is_multiple_of(BK) && (s == 1 || per >= MIN_SPLIT_COLS)
    };
    let splits = SPLITS
        .into_iter()
        .filter(|&s| s <= MAX_PLAN_SPLITS && whole(s) && (s == 1 || tiles(warps) * s <= sms))
        .max()
        .unwrap_or(1);
    Some(SkinnyPlan { warps, splits })
}

/// The entry points of `kernels/skinny.cu`.
pub(super) fn kernel_names() -> Vec<String> {
    let mut v = Vec::new();
    for name in ["skinny", "skinnyg"] {
        for t in ["bf16", "f16"] {
            for w in WARPS {
                for n in [16, 32, 64] {
                    v.push(format!("{name}_{t}_w{w}_n{n}"));
                }
            }
        }
    }
    v
}

/// A block's shared memory budget for its ring, and the part of it kept for the 1 KB ring
/// alignment (the swizzle's period) and the barriers.
const SMEM_MAX: usize = 227 * 1024;
const SMEM_RESERVED: usize = 2048;

/// Columns of a block's share from which its ring takes up to 16 stages rather than 8.
const DEEP_RING_COLS: usize = 2048;

/// A ring's stages for blocks of `rows` weight rows, `n_tile` activation rows and `cols`
/// columns each: as many as fit, up to 16 for tiles of 16 or 32 activation rows whose blocks
/// read at least [`DEEP_RING_COLS`] columns, else up to 8. Measured on the H200 (session 22,
/// `gpu_bench`): 16 stages gave Qwen3-8B (column shares of 2,048 to 6,144) 3,156 tok/s at 16
/// streams and 5,912 at 32, against 2,998 and 5,600 with 8; Qwen3-0.6B (shares of 512 to
/// 1,024) lost ~1% with them (16 streams 11,898–11,915 against 12,047–12,057; 32 streams
/// 20,292–20,301 against 20,480–20,535), and the 8B at 64 streams lost ~1% (10,725–10,777
/// against 10,839–10,947). Also measured there and not taken: stages of two 64-column boxes
/// (as 16 stages at 16 and 32 streams, −1% at 64), a ring in half the shared memory so the
/// next kernel's blocks fit beside it (−10% at 64 streams), and kernels that let the next one
/// launch before their own PDL wait (+0.4%, within noise).
fn stages(rows: usize, n_tile: usize, cols: usize) -> usize {
    let cap = if n_tile <= 32 && cols >= DEEP_RING_COLS {
        16
    } else {
        8
    };
    ((SMEM_MAX - SMEM_RESERVED) / stage_bytes(rows, n_tile)).min(cap)
}

/// A stage's bytes: `rows` weight rows and `n_tile` activation rows of 64 16-bit columns.
fn stage_bytes(rows: usize, n_tile: usize) -> usize {
    (rows + n_tile) * BK * 2
}

/// A TMA descriptor of the 16-bit row-major matrix at `ptr` (`rows` × `cols`), read in boxes of
/// 64 columns × `box_rows` rows with the 128-byte swizzle (`sk_at`'s layout); rows past
/// `rows` read as zeros.
fn tensor_map(
    ptr: u64,
    rows: usize,
    cols: usize,
    box_rows: usize,
    bf16: bool,
) -> Result<TensorMap> {
    use cudarc::driver::sys::{
        self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
        CUtensorMapL2promotion, CUtensorMapSwizzle,
    };
    let ty = if bf16 {
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    } else {
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    };
    let dims = [cols as u64, rows as u64];
    let strides = [(cols * 2) as u64];
    let boxes = [BK as u32, box_rows as u32];
    let steps = [1u32, 1];
    let mut map = TensorMap(sys::CUtensorMap { opaque: [0; 16] });
    // SAFETY: every array has the rank's length (strides one less), and `map` is written.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map.0,
            ty,
            2,
            ptr as *mut core::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result()?;
    Ok(map)
}

/// A kernel argument of 128 bytes (`TmaDesc` in skinny.cu).
#[derive(Clone, Copy)]
#[repr(C)]
struct TensorMap(cudarc::driver::sys::CUtensorMap);

/// Who runs a 16-bit GEMM: the skinny kernel where it applies, else cuBLAS (`Auto`); cuBLAS
/// only (`MatmulPath::Gemm`); the skinny kernel with a forced shape (`MatmulPath::Skinny`,
/// an error where it cannot run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmChoice {
    Auto,
    Cublas,
    Skinny(SkinnyPlan),
}

/// One skinny product's operands: device addresses of W (`rows` × `cols`), x (`n` × `cols`)
/// and out (`n` rows, `ldc` apart, f32; added to when `accumulate`). With `gated`, W is the
/// gate matrix, `up` one of the same shape, and out `act(x · Wᵀ) · (x · upᵀ)` in W's 16-bit
/// type (`accumulate` unused).
#[derive(Clone, Copy)]
pub(crate) struct SkinnyArgs {
    pub w: u64,
    pub x: u64,
    pub out: u64,
    pub rows: usize,
    pub cols: usize,
    pub n: usize,
    pub ldc: usize,
    pub accumulate: bool,
    pub bf16: bool,
    pub gated: Option<SkinnyGated>,
}

/// The up matrix and activation code (0 SiLU, 1 GELU-tanh) of a gated skinny product.
#[derive(Clone, Copy)]
pub(crate) struct SkinnyGated {
    pub up: u64,
    pub act: i32,
}

impl CudaContext {
    /// Runs the skinny GEMM if it applies (rows in [`SKINNY_ROWS`], a plan, the cluster fits);
    /// `Ok(false)`: the caller uses cuBLAS.
    pub(crate) fn skinny_gemm(&self, a: SkinnyArgs) -> Result<bool> {
        match self.gemm_choice {
            GemmChoice::Cublas => return Ok(false),
            GemmChoice::Skinny(plan) => {
                return match self.skinny_with(a, plan)? {
                    true => Ok(true),
                    false => Err(CudaError::Unsupported {
                        what: "skinny GEMM shape",
                        value: format!("{plan:?} for {}x{}", a.rows, a.cols),
                        supported: "a shape whose cluster fits the device (sm_90)",
                    }),
                };
            }
            GemmChoice::Auto => {}
        }
        if !skinny_on() || !SKINNY_ROWS.contains(&a.n) {
            return Ok(false);
        }
        // A gated block holds gate and up rows half and half: the plan of both stacked.
        let rows = if a.gated.is_some() {
            2 * a.rows
        } else {
            a.rows
        };
        let Some(plan) = skinny_plan(rows, a.cols, self.info().sm_count) else {
            return Ok(false);
        };
        self.skinny_with(a, plan)
    }

    /// [`skinny_gemm`](Self::skinny_gemm) with a forced plan (tests, benchmarks): `Ok(false)`
    /// if the device cannot run it (the kernels are empty but on compute capability 9.0:
    /// TMA, clusters and sm_90a's wgmma).
    pub(crate) fn skinny_with(&self, a: SkinnyArgs, plan: SkinnyPlan) -> Result<bool> {
        let whole_stages = plan.splits > 0 && a.cols.is_multiple_of(plan.splits * BK);
        let hopper = self.info().compute_capability == (9, 0);
        if !hopper || !WARPS.contains(&plan.warps) || !whole_stages || a.n == 0 || a.n > 64 {
            return Ok(false);
        }
        // The kernels come in 16-, 32- and 64-row activation tiles.
        let n_tile = if a.n <= 16 {
            16
        } else if a.n <= 32 {
            32
        } else {
            64
        };
        let ks = a.cols / plan.splits;
        let ring = stages(plan.rows_per_block(), n_tile, ks);
        // The stages (the epilogue reuses them for the split merge's partials: a unit test
        // checks they fit) and the reserve.
        let bytes = ring * stage_bytes(plan.rows_per_block(), n_tile) + SMEM_RESERVED;
        // Weight rows of one matrix per block: a gated block's tile is half gate, half up.
        let boxed = match a.gated {
            Some(_) => plan.rows_per_block() / 2,
            None => plan.rows_per_block(),
        };
        let cfg = LaunchConfig {
            grid_dim: (a.rows.div_ceil(boxed) as u32, 1, plan.splits as u32),
            // WARPS / 2 consumer warpgroups (64 weight rows each) and one producer warp.
            block_dim: (64 * plan.warps as u32 + 32, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        let ty = if a.bf16 { "bf16" } else { "f16" };
        let name = if a.gated.is_some() {
            "skinnyg"
        } else {
            "skinny"
        };
        let f = self.kernel(&format!("{name}_{ty}_w{}_n{n_tile}", plan.warps))?;
        self.stream().context().bind_to_thread()?;
        if f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .is_err()
        {
            return Ok(false);
        }
        let cluster = if plan.splits > 1 {
            plan.splits as u32
        } else {
            0
        };
        if cluster > 0 && !cluster_fits(self.stream(), f, cfg, cluster) {
            return Ok(false);
        }
        let wmap = tensor_map(a.w, a.rows, a.cols, boxed, a.bf16)?;
        let (umap, act) = match a.gated {
            Some(g) => (tensor_map(g.up, a.rows, a.cols, boxed, a.bf16)?, g.act),
            None => (wmap, 0),
        };
        let xmap = tensor_map(a.x, a.n, a.cols, n_tile, a.bf16)?;
        let (out, m, n, ldc) = (a.out, a.rows as i32, a.n as i32, a.ldc as i32);
        let (ks, acc, ring) = (ks as i32, i32::from(a.accumulate), ring as i32);
        launch!(self, f, cfg, cluster = cluster; wmap, umap, xmap, out, m, n, ldc, ks, acc, act, ring)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ring_fits_the_shared_memory_and_holds_the_epilogue() {
        for warps in WARPS {
            let rows = 32 * warps;
            for n_tile in [16, 32, 64] {
                for cols in [128, 1024, 2048, 6144] {
                    let ring = stages(rows, n_tile, cols);
                    let bytes = ring * stage_bytes(rows, n_tile);
                    assert!(ring >= 2, "{warps} warps, {n_tile} rows: {ring} stages");
                    assert!(
                        bytes + SMEM_RESERVED <= SMEM_MAX,
                        "{warps}/{n_tile}: {bytes}"
                    );
                    // The merge's partials.
                    let epilogue = n_tile * rows * 4;
                    assert!(epilogue <= bytes, "{warps}/{n_tile}: {epilogue} bytes");
                }
            }
        }
        // Deep rings only for 16/32-row tiles over long column shares (Qwen3-8B's, not 0.6B's).
        assert_eq!(stages(64, 32, 4096), 16);
        assert_eq!(stages(64, 32, 1024), 8);
        assert_eq!(stages(64, 64, 4096), 8);
    }

    #[test]
    fn qwen3_shapes_take_the_sweeps_fastest_plans_on_132_sms() {
        let p = |r, c| skinny_plan(r, c, 132).unwrap();
        let plan = |warps, splits| SkinnyPlan { warps, splits };
        // Qwen3-8B: Q/K/V joined, O, gate+up joined, down.
        assert_eq!(p(6144, 4096), plan(2, 1));
        assert_eq!(p(4096, 4096), plan(2, 2));
        assert_eq!(p(24576, 4096), plan(6, 1));
        assert_eq!(p(4096, 12288), plan(2, 2));
        // Qwen3-0.6B: the same four.
        assert_eq!(p(4096, 1024), plan(2, 2));
        assert_eq!(p(1024, 2048), plan(2, 4));
        assert_eq!(p(6144, 1024), plan(2, 1));
        assert_eq!(p(1024, 3072), plan(2, 4));
    }

    #[test]
    fn plans_keep_split_columns_whole_stages() {
        for rows in [16, 1000, 1024, 2048, 3072, 4096, 6144, 11008, 24576, 65536] {
            for cols in [64, 128, 896, 1024, 2048, 3072, 4096, 12288, 14336] {
                for sms in [1, 16, 78, 108, 132] {
                    let plan = skinny_plan(rows, cols, sms).unwrap();
                    let per = cols / plan.splits;
                    assert_eq!(per * plan.splits, cols);
                    assert_eq!(per % BK, 0, "{rows}x{cols} on {sms}: {plan:?}");
                    assert!(plan.splits == 1 || per >= MIN_SPLIT_COLS);
                    assert!(WARPS.contains(&plan.warps));
                }
            }
        }
    }

    #[test]
    fn unsupported_shapes_go_to_cublas() {
        assert_eq!(skinny_plan(151_936, 4096, 132), None);
        assert_eq!(skinny_plan(4096, 1000, 132), None);
        assert_eq!(skinny_plan(0, 4096, 132), None);
    }
}
