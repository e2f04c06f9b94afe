//! The quantized matmul on integer tensor cores (MMQ, kernels/mmq.cu) for batches past the int8
//! GEMV: `out[n, rows] = x[n, cols] · Wᵀ` for Q4_K, Q6_K and Q8_0 weights, each weight byte
//! read once per call, against activations quantized once to int8 blocks of 32 (the GEMV's
//! integers and scales, in a layout of their own: see mmq.cu).
//!
//! It owns the launches and the rule for when the device has them (sm_80 and later, and
//! `AFM_MMQ` not `0`); which batch sizes take it is `matmul.rs`'s path choice.

use cudarc::driver::LaunchConfig;

use super::context::scratch;
use super::device_weight::DeviceWeight;
use super::ops::grid_1d;
use super::{launch, CudaContext, CudaError, Result};
use crate::switch::Switch;
use crate::DType;

/// Activation rows one MMQ launch takes (`mmq_w*_1` .. `mmq_w*_8`: tiles of 8); more go in
/// launches of this many against one quantization.
pub const MMQ_LAUNCH_ROWS: usize = 64;
/// Activation rows per tile of the kernels (the mma's n).
const TILE_N: usize = 8;
/// Values per int8 activation block.
const Q8_BLOCK: usize = 32;
/// Warps per MMQ block that the kernels come in (`MMQ_BOTH` in mmq.cu).
const WARP_COUNTS: [usize; 2] = [4, 8];
/// Columns from which a block splits them over 8 warps rather than 4: two Q4_K/Q6_K
/// super-blocks per warp at 4096 (Qwen3-8B's width). Eight warps per block are twice the loads
/// in flight on a 4096-row matrix, whose 128 blocks are one per SM. `cuda_bench mmq` on the
/// H200: 8 warps win at every measured shape (all 4096 or 12288 columns), e.g. Q4_K
/// 4096×12288 at 32 rows 48.6 vs 85.8 µs; narrower matrices (Qwen3-0.6B's 1024) are not
/// measured, so 4 warps stay there. NVRTC spends 4.5 s of CPU on each set (on the build
/// machine; gemv.cu takes 10 s).
const WIDE_COLS: usize = 4096;

/// Every kernel of mmq.cu, for the context's loader.
pub(super) fn kernel_names() -> Vec<String> {
    let mut v = vec!["mmq_quantize".to_string()];
    for w in WARP_COUNTS {
        v.extend((1..=MMQ_LAUNCH_ROWS / TILE_N).map(|nt| format!("mmq_w{w}_{nt}")));
    }
    v
}

/// Whether `AFM_MMQ` allows the tensor-core path in automatic path choice (read once; on
/// unless `0`). An A/B switch: `AFM_MMQ=0` sends those batches back to dequantize + cuBLAS.
pub(super) fn mmq_env_on() -> bool {
    static ON: Switch = Switch::new("AFM_MMQ", true);
    ON.on()
}

/// The kernels' weight type code (`MMQ_Q4_K`.. in mmq.cu); `None` for unquantized types.
fn mmq_type(t: DType) -> Option<i32> {
    match t {
        DType::Q4K => Some(0),
        DType::Q6K => Some(1),
        DType::Q8_0 => Some(2),
        _ => None,
    }
}

/// Weight rows per MMQ block (two tiles of 16; for gate+up 16 rows of each).
const BLOCK_ROWS: usize = 32;

/// `MmqMats` in mmq.cu: up to three matrices (weights, outputs, type codes, rows; rows 0 for
/// absent ones), served by consecutive ranges of blocks; for gate+up, gate and up in `w[0..2]`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MmqMats {
    w: [u64; 3],
    out: [u64; 3],
    ty: [i32; 3],
    rows: [i32; 3],
    /// 1: `out += x · Wᵀ` (a residual add folded into the projection).
    accumulate: i32,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct (six pointers, seven ints).
unsafe impl cudarc::driver::DeviceRepr for MmqMats {}

/// Device addresses of activations quantized for MMQ (`mmq_quantize`'s outputs).
#[derive(Clone, Copy)]
pub(super) struct MmqActs {
    /// i8 `[np][cols]`.
    q: u64,
    /// f32 `[cols / 32][np][2]`: (d, d · Σq) per block.
    ds: u64,
    n: usize,
    /// `n` rounded up to a whole tile: the stride of `ds`.
    np: usize,
    cols: usize,
}

impl CudaContext {
    /// Whether the device runs the MMQ kernels (int8 `mma.sync` needs sm_80).
    pub(super) fn mmq_supported(&self) -> bool {
        self.info().compute_capability.0 >= 8
    }

    /// Quantizes `n` rows of `cols` activations at `xp` for MMQ, into the scratch that the
    /// GEMV's quantization also uses (`xq`, `xd`).
    pub(super) fn mmq_quantize(&mut self, xp: u64, n: usize, cols: usize) -> Result<MmqActs> {
        let np = n.div_ceil(TILE_N) * TILE_N;
        let nkb = cols / Q8_BLOCK;
        let stream = self.stream().clone();
        let q = scratch(&stream, &mut self.ws.xq, np * cols)?;
        let ds = scratch(&stream, &mut self.ws.xd, 2 * np * nkb)?;
        let (ni, npi, ci) = (n as i32, np as i32, cols as i32);
        let f = self.kernel("mmq_quantize")?;
        launch!(self, f, grid_1d(np * nkb * 32, 256); xp, q, ds, ni, npi, ci)?;
        Ok(MmqActs { q, ds, n, np, cols })
    }

    /// The kernels' type code for `w`, or why MMQ cannot serve it on this device.
    pub(super) fn mmq_check(&self, w: &DeviceWeight) -> Result<i32> {
        let ty = mmq_type(w.dtype()).ok_or_else(|| CudaError::Unsupported {
            what: "MMQ weight type",
            value: w.dtype().name().into(),
            supported: "Q8_0, Q4_K, Q6_K",
        })?;
        if !self.mmq_supported() {
            let (major, minor) = self.info().compute_capability;
            return Err(CudaError::Unsupported {
                what: "MMQ (int8 tensor cores) on compute capability",
                value: format!("{major}.{minor}"),
                supported: "8.0 and later",
            });
        }
        Ok(ty)
    }

    /// `outs[i] = x · wsᵢᵀ` (`[n][wsᵢ.rows]`) for one to three quantized matrices of one
    /// width (types may differ: Q/K/V of a Q4_K_M file) against activations from
    /// [`Self::mmq_quantize`], in one launch per [`MMQ_LAUNCH_ROWS`] rows, with `warps` warps
    /// per block (4 or 8; `None`: by width, see [`WIDE_COLS`]); `accumulate`: outs += result.
    pub(super) fn mmq(
        &mut self,
        ws: &[&DeviceWeight],
        outs: &[u64],
        acts: MmqActs,
        warps: Option<usize>,
        accumulate: bool,
    ) -> Result<()> {
        if !(1..=3).contains(&ws.len()) || ws.len() != outs.len() {
            return Err(CudaError::Unsupported {
                what: "MMQ matrices per launch",
                value: format!("{} matrices, {} outputs", ws.len(), outs.len()),
                supported: "1 to 3, one output each",
            });
        }
        let mut m = MmqMats {
            w: [0; 3],
            out: [0; 3],
            ty: [0; 3],
            rows: [0; 3],
            accumulate: i32::from(accumulate),
        };
        for (i, (w, &o)) in ws.iter().zip(outs).enumerate() {
            m.ty[i] = self.mmq_check(w)?;
            super::check("MMQ activation width", acts.cols, w.cols())?;
            (m.w[i], m.out[i], m.rows[i]) = (self.weight_ptr(w), o, w.rows() as i32);
        }
        let blocks = ws.iter().map(|w| w.rows().div_ceil(BLOCK_ROWS)).sum();
        self.mmq_launch(m, blocks, -1, acts, warps)
    }

    /// `out = act(x · gateᵀ) · (x · upᵀ)` (act 0 = SiLU, 1 = GELU tanh) for `gate` and `up` of
    /// one quantized type and shape: each block computes 16 rows of both.
    pub(super) fn mmq_gated(
        &mut self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        act: i32,
        acts: MmqActs,
        out: u64,
    ) -> Result<()> {
        let ty = self.mmq_check(gate)?;
        super::check("MMQ activation width", acts.cols, gate.cols())?;
        super::check(
            "MMQ gate/up type",
            usize::from(gate.dtype() == up.dtype()),
            1,
        )?;
        super::check("MMQ up rows", up.rows(), gate.rows())?;
        super::check("MMQ up cols", up.cols(), gate.cols())?;
        let m = MmqMats {
            w: [self.weight_ptr(gate), self.weight_ptr(up), 0],
            out: [out, 0, 0],
            ty: [ty, ty, ty],
            rows: [gate.rows() as i32, 0, 0],
            accumulate: 0,
        };
        let blocks = gate.rows().div_ceil(BLOCK_ROWS / 2);
        self.mmq_launch(m, blocks, act, acts, None)
    }

    /// Launches `blocks` blocks over `m` (act ≥ 0: gate+up) for each [`MMQ_LAUNCH_ROWS`]
    /// activation rows.
    fn mmq_launch(
        &mut self,
        mut m: MmqMats,
        blocks: usize,
        act: i32,
        acts: MmqActs,
        warps: Option<usize>,
    ) -> Result<()> {
        let cols = acts.cols;
        let warps = match warps {
            None if cols >= WIDE_COLS => 8,
            None => 4,
            Some(k) if WARP_COUNTS.contains(&k) => k,
            Some(k) => {
                return Err(CudaError::Unsupported {
                    what: "MMQ warps per block",
                    value: k.to_string(),
                    supported: "4 or 8",
                })
            }
        };
        if blocks == 0 || acts.n == 0 {
            return Ok(()); // nothing to write (and no empty launch)
        }
        let outs = m.out;
        let (ci, npi) = (cols as i32, acts.np as i32);
        for c0 in (0..acts.n).step_by(MMQ_LAUNCH_ROWS) {
            let nb = (acts.n - c0).min(MMQ_LAUNCH_ROWS);
            let nt = nb.div_ceil(TILE_N);
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (32 * warps as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            for ((o, &base), &rows) in m.out.iter_mut().zip(&outs).zip(&m.rows) {
                *o = base + (c0 * rows as usize * 4) as u64;
            }
            // Row c0 of the activations: c0 is a whole number of tiles, so ds keeps its stride.
            let q0 = acts.q + (c0 * cols) as u64;
            let ds0 = acts.ds + (c0 * 2 * 4) as u64;
            let ni = nb as i32;
            let f = self.kernel(&format!("mmq_w{warps}_{nt}"))?;
            launch!(self, f, cfg; m, q0, ds0, ci, ni, npi, act)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block's int8 codes, scale and sum by the rule the kernels follow (gemv.cu / common.cuh
    /// `q8_quantize`): q = round half to even of v · (127 / amax), d = amax / 127,
    /// s = d · Σq, each one f32 operation rounded to nearest.
    fn reference_block(v: &[f32]) -> (Vec<i8>, f32, f32) {
        let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let q: Vec<i8> = v
            .iter()
            .map(|&x| (x * id).round_ties_even() as i8)
            .collect();
        let d = amax / 127.0;
        (
            q.clone(),
            d,
            d * q.iter().map(|&c| c as i32).sum::<i32>() as f32,
        )
    }

    /// Activations with the cases that decide rounding: ties at ±k.5 (amax 127, so id is 1),
    /// an all-zero block, a negative maximum, then random blocks of very different scales.
    fn activations(n: usize, cols: usize) -> Vec<f32> {
        let mut x = Vec::with_capacity(n * cols);
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..n * cols {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let scale = [1e-3f32, 1.0, 37.0, 1e4][(i / 32) % 4];
            x.push(unit * scale);
        }
        let ties = [127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -1.5, 126.5, -126.5];
        x[..ties.len()].copy_from_slice(&ties);
        x[32..64].fill(0.0);
        x[64..96].iter_mut().for_each(|v| *v *= 0.5);
        x[70] = -100.0;
        x
    }

    /// The rule's codes are the CPU quantizer's (which reproduces llama.cpp's
    /// `quantize_row_q8_0` codes): the GPU test below then ties the kernels to llama.cpp's.
    #[test]
    fn reference_rule_gives_the_cpu_quantizers_codes() {
        use crate::quant::{Isa, Q8Rows};
        let (n, cols) = (19, 256);
        let x = activations(n, cols);
        let want: Vec<i8> = x
            .chunks(Q8_BLOCK)
            .flat_map(|b| reference_block(b).0)
            .collect();
        let cpu = Q8Rows::quantize(&x, cols, Isa::Scalar);
        let got: Vec<i8> = (0..n).flat_map(|i| cpu.row(i).qs.to_vec()).collect();
        assert_eq!(got, want);
    }

    /// gemv.cu's `quantize_x_q8` and mmq.cu's `mmq_quantize` (one quantizer, common.cuh's
    /// `q8_quantize`) give the reference rule's codes and the same f32 bits of d and s, and
    /// MMQ's padding rows are zero. Runs with `AFM_TEST_DEVICE=cuda` (device 0).
    #[test]
    fn both_int8_quantizers_follow_the_rule_bit_for_bit() {
        if std::env::var("AFM_TEST_DEVICE").ok().as_deref() != Some("cuda") {
            eprintln!("skipped: set AFM_TEST_DEVICE=cuda to run on the GPU");
            return;
        }
        let mut ctx = CudaContext::new(0).expect("CUDA device 0");
        let (n, cols) = (19, 256); // 19 rows: MMQ pads to 24
        let nkb = cols / Q8_BLOCK;
        let x = activations(n, cols);
        let xd = ctx.upload(&x).expect("upload");
        let xp = ctx.ptr(&xd);

        let mut gq = ctx.alloc::<i8>(n * cols).expect("alloc");
        let mut gd = ctx.alloc::<f32>(n * nkb).expect("alloc");
        let mut gs = ctx.alloc::<f32>(n * nkb).expect("alloc");
        let (q, d, s) = (
            ctx.ptr_mut(&mut gq),
            ctx.ptr_mut(&mut gd),
            ctx.ptr_mut(&mut gs),
        );
        let nblocks = (n * nkb) as i64;
        let f = ctx.kernel("quantize_x_q8").expect("kernel");
        launch!(ctx, f, grid_1d(n * nkb * 32, 256); xp, q, d, s, nblocks).expect("launch");
        let (gq, gd, gs) = (
            ctx.download(&gq).expect("download"),
            ctx.download(&gd).expect("download"),
            ctx.download(&gs).expect("download"),
        );

        let acts = ctx.mmq_quantize(xp, n, cols).expect("mmq_quantize");
        let np = acts.np;
        let mq = ctx
            .download(ctx.ws.xq.as_ref().expect("xq"))
            .expect("download");
        let mds = ctx
            .download(ctx.ws.xd.as_ref().expect("ds"))
            .expect("download");

        for row in 0..np {
            for kb in 0..nkb {
                let at = row * cols + kb * Q8_BLOCK;
                let (mqb, (md, ms)) = (
                    &mq[at..at + Q8_BLOCK],
                    (mds[2 * (kb * np + row)], mds[2 * (kb * np + row) + 1]),
                );
                if row >= n {
                    assert!(mqb.iter().all(|&c| c == 0), "pad row {row}: codes");
                    assert_eq!((md, ms), (0.0, 0.0), "pad row {row}: d, s");
                    continue;
                }
                let (want_q, want_d, want_s) = reference_block(&x[at..at + Q8_BLOCK]);
                let what = format!("row {row} block {kb}");
                let b = row * nkb + kb;
                assert_eq!(&gq[at..at + Q8_BLOCK], &want_q[..], "{what}: GEMV codes");
                assert_eq!(mqb, &want_q[..], "{what}: MMQ codes");
                assert_eq!(gd[b].to_bits(), want_d.to_bits(), "{what}: GEMV d");
                assert_eq!(gs[b].to_bits(), want_s.to_bits(), "{what}: GEMV s");
                assert_eq!(md.to_bits(), want_d.to_bits(), "{what}: MMQ d");
                assert_eq!(ms.to_bits(), want_s.to_bits(), "{what}: MMQ s");
            }
        }
        // The ties round to even: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, ±0.5 -> 0, 126.5 -> 126.
        assert_eq!(&gq[..10], &[127, 2, 4, -2, 0, 0, 2, -2, 126, -126]);
    }
}
