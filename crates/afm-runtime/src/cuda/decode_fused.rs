//! The persistent decode kernel (`kernels/decode_fused.cu`): every layer of a llama-family
//! step (one sequence, one new token) in one launch, phases separated by a grid barrier.
//!
//! Scope: 16-bit weights (bf16 or f16, one type for all layers), an f16 KV cache, head_dim 64
//! or 128, GQA with any group size, optional Q/K/V biases and per-head Q/K norms, no sliding
//! window or softcap. Callers check the model's side (`compute::decode_fused`); this file
//! checks what the kernel needs of the device and owns the per-model device state:
//! ```text
//! layers  [n_layers][16] u64   wq wk wv wo wg wu wd | in_norm post_norm q_norm k_norm
//!                              | bq bk bv | k cache, v cache    (0 = absent)
//! scratch q[nh·D] k[nkv·D] v[nkv·D] att[nh·D] act[inter] f32; split partials
//!         [nh][max_splits][D+2] f32; split counters [nkv·chunks] i32 (zero between phases)
//! bar     one u64 that only grows: the grid barrier (reset-free across launches and graphs)
//! ```
//! Residency: the grid barrier needs every CTA running at once. The launch is an ordinary one
//! (CUDA graphs capture it as a kernel node) of at most `SMs × occupancy` CTAs, and the device
//! runs nothing else that could hold SMs forever: on the single stream the kernel before it
//! has started all its CTAs when this one starts (PDL starts a dependent only once every CTA
//! of the primary ran `griddepcontrol.launch_dependents`, i.e. was resident) and drains, and
//! the kernel after it cannot start before this one's CTAs trigger it, which they do only by
//! exiting. So every CTA of this grid becomes resident as SMs free up, and none waits on a
//! kernel that waits on it. A barrier that still waits over 2 s traps (fails the launch).
//!
//! `AFM_FUSED_PROFILE=1` (read once): CTA 0 records `%globaltimer` at every barrier into a
//! small device buffer, and a one-thread kernel after each step (captured into CUDA graphs like
//! the step) sums them and prints per-phase means every [`PROFILE_EVERY`] steps (device printf,
//! so on stdout, flushed at the next synchronisation): each phase's work, the skew to the last
//! CTA's arrival, and the barrier's own latency; then CTA 0's inner view of each GEMV phase
//! (input load, wait for its first ring stage, the rest, how many stages the producer had
//! issued ahead, whether the first was already full). Off, the module is compiled without the
//! profile's code (`FD_PROFILE`, cuda/context.rs's `MODULE_DEFINES`).
//!
//! Weights reach the consumer warps through a ring of shared-memory stages that a producer
//! warp fills with bulk copies (sm_90), tiles of 8 rows by up to 1,024 columns, which the
//! tensor cores multiply; so rows must be 16-byte aligned and the widths multiples of 32 (a
//! pair of k16 tiles); the ring takes whatever shared memory the phases' buffers leave.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{launch, AttnBatch, CudaContext, CudaError, Result, RopeTable};
use crate::switch::Switch;

/// `FD_*` in decode_fused.cu.
const WARPS: usize = 7;
/// The consumer warps and the weight ring's producer warp.
const THREADS: u32 = 32 * (WARPS as u32 + 1);
const GH: usize = 4;
const HEAD: usize = 128;
/// `FD_STAGE_BYTES`, `FD_MAX_STAGES`: the weight ring's slots (8 rows of 1,024 16-bit
/// values, each padded by 16 bytes).
const STAGE_BYTES: usize = TILE_ROWS * (2 * 1024 + 16);
/// `FD_TILE_ROWS`: the weight rows of a ring slot's tile (a row group).
const TILE_ROWS: usize = 8;
/// `FD_GROUP_FLOATS`: a row group's partials, 8 sums per consumer warp and 8 residual rows.
const GROUP_FLOATS: usize = 8 * WARPS + 8;
const MAX_STAGES: usize = 16;
/// Fewest ring slots worth running: one in use while the next one fills.
const MIN_STAGES: usize = 2;
/// `FD_PROF_SLOTS`: the profile buffer's header (u64s) before 3 per barrier.
const PROF_SLOTS: usize = 60;
/// Steps per printed profile.
const PROFILE_EVERY: i32 = 64;
/// Fields per layer in the pointer table (`L_FIELDS`).
pub const LAYER_FIELDS: usize = 16;

/// The model's shape as the kernel reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedShape {
    pub n_layers: usize,
    pub hidden: usize,
    pub inter: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// bf16 weights (else f16).
    pub bf16: bool,
    /// 0 = SiLU, 1 = GELU (tanh).
    pub act: i32,
    pub eps: f32,
    pub qk_eps: f32,
    pub scale: f32,
}

/// Mirror of `FusedArgs` in decode_fused.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct FusedArgs {
    n_layers: i32,
    hidden: i32,
    inter: i32,
    n_heads: i32,
    n_kv_heads: i32,
    block_size: i32,
    max_blocks: i32,
    rope_dims: i32,
    neox: i32,
    max_pos: i32,
    act: i32,
    max_splits: i32,
    eps: f32,
    qk_eps: f32,
    scale: f32,
    stages: i32,
    ring_at: i32,
}

// SAFETY: plain #[repr(C)] data, laid out as the CUDA struct.
unsafe impl cudarc::driver::DeviceRepr for FusedArgs {}

/// Device state of one model (and KV pool): the pointer table it was built from, scratch and
/// the barrier counter. Never freed while the device lives, as CUDA graphs bake its addresses.
pub struct FusedState {
    shape: FusedShape,
    table: Vec<u64>,
    layers: CudaSlice<u64>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    act: CudaSlice<f32>,
    ws: CudaSlice<f32>,
    done: CudaSlice<i32>,
    bar: CudaSlice<u64>,
    /// The phase profile's buffer (`AFM_FUSED_PROFILE=1`).
    prof: Option<CudaSlice<u64>>,
    grid: u32,
    smem: u32,
    ring_at: u32,
    stages: u32,
    max_splits: usize,
}

impl FusedState {
    /// Whether this state was built for `shape` and exactly these layer addresses.
    pub fn serves(&self, shape: &FusedShape, table: &[u64]) -> bool {
        self.shape == *shape && self.table == table
    }
}

fn kernel_name(shape: &FusedShape) -> String {
    let t = if shape.bf16 { "bf16" } else { "f16" };
    format!("decode_fused_{t}_{}", shape.head_dim)
}

/// Where the weight ring starts in dynamic shared memory (bytes, 128-aligned): after
/// `FD_HEAD` floats of block scratch (with the ring's mbarriers) and the phases' buffers, the
/// widest of: a GEMV phase's ([`gemv_floats`]); an attention item's (`FdAttnSmem`: 4 q heads,
/// a k head, (m, l) and D outputs per warp and head).
fn ring_at(s: &FusedShape, grid: usize) -> usize {
    let d = s.head_dim;
    let attn = GH * d + d + 2 * WARPS * GH + WARPS * GH * d;
    (4 * (HEAD + gemv_floats(s, grid).max(attn))).next_multiple_of(128)
}

/// Floats of the widest GEMV phase's buffers (decode_fused.cu `fd_step`): its input vector
/// (gate+up's also the CTA's gate sums), then `FD_GROUP_FLOATS` per row group of the CTA's
/// rows. A CTA has at most ⌈rows / grid⌉ rows of a phase, and Q/K/V's three pieces add at
/// most two partial groups.
fn gemv_floats(s: &FusedShape, grid: usize) -> usize {
    let groups = |rows: usize| rows.div_ceil(grid.max(1)).div_ceil(TILE_ROWS);
    let (nq, nk) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
    let gate_end = s.hidden + s.inter.div_ceil(grid.max(1));
    [
        s.hidden + GROUP_FLOATS * (groups(nq + 2 * nk) + 2),
        nq + GROUP_FLOATS * groups(s.hidden),
        gate_end + GROUP_FLOATS * 2 * groups(s.inter),
        s.inter + GROUP_FLOATS * groups(s.hidden),
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
}

/// Ring slots that fit beside the buffers in `optin` bytes of shared memory (at most
/// `FD_MAX_STAGES`); `None` below two.
fn ring_stages(ring_at: usize, optin: usize) -> Option<usize> {
    let n = (optin.saturating_sub(ring_at) / STAGE_BYTES).min(MAX_STAGES);
    (n >= MIN_STAGES).then_some(n)
}

/// `AFM_FUSED_PROFILE`: also a compile-time switch of the module (`FD_PROFILE`, in
/// cuda/context.rs's `MODULE_DEFINES`), so the kernel carries the profile's code only when on.
pub(super) static PROFILE: Switch = Switch::new("AFM_FUSED_PROFILE", false);

fn profile_on() -> bool {
    PROFILE.on()
}

/// Entry points of decode_fused.cu.
pub(super) fn kernel_names() -> Vec<String> {
    let mut v = vec!["decode_fused_profile".to_string()];
    for t in ["bf16", "f16"] {
        for d in [64, 128] {
            v.push(format!("decode_fused_{t}_{d}"));
        }
    }
    v
}

impl CudaContext {
    /// Allocates the state for `shape` over `table` (`n_layers × LAYER_FIELDS` addresses).
    /// `None`: the device cannot run the kernel at this shape (compute capability below 9.0,
    /// too much shared memory, not one CTA per SM).
    pub fn fused_decode_state(
        &self,
        shape: FusedShape,
        table: &[u64],
    ) -> Result<Option<FusedState>> {
        super::check(
            "fused decode layer table",
            table.len(),
            shape.n_layers * LAYER_FIELDS,
        )?;
        if self.info().compute_capability.0 < 9 || !matches!(shape.head_dim, 64 | 128) {
            return Ok(None);
        }
        // The ring's bulk copies need 16-byte aligned rows; the tensor-core tiles, widths in
        // pairs of 16 columns (the heads' width, 64 or 128 per head, always is).
        let weights = |l: &[u64]| l[..7].iter().all(|&p| p != 0 && p.is_multiple_of(16));
        if !shape.hidden.is_multiple_of(32)
            || !shape.inter.is_multiple_of(32)
            || !table.chunks(LAYER_FIELDS).all(weights)
        {
            return Ok(None);
        }
        let f = self.kernel(&kernel_name(&shape))?;
        // One CTA per SM: the fewest CTAs at each barrier, and all resident (module header).
        let grid = self.info().sm_count;
        let at = ring_at(&shape, grid);
        let optin =
            self.stream().context().attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as usize;
        let Some(stages) = ring_stages(at, optin) else {
            return Ok(None);
        };
        let smem = at + stages * STAGE_BYTES;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let per_sm = f.occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)?;
        if per_sm == 0 {
            return Ok(None);
        }
        let d = shape.head_dim;
        let chunks = (shape.n_heads / shape.n_kv_heads.max(1)).div_ceil(GH);
        let max_splits = (grid / (shape.n_kv_heads * chunks).max(1)).max(1);
        let (nq, nk) = (shape.n_heads * d, shape.n_kv_heads * d);
        Ok(Some(FusedState {
            shape,
            table: table.to_vec(),
            layers: self.upload(table)?,
            q: self.zeros(nq)?,
            k: self.zeros(nk)?,
            v: self.zeros(nk)?,
            att: self.zeros(nq)?,
            act: self.zeros(shape.inter.max(1))?,
            ws: self.zeros(shape.n_heads * max_splits * (d + 2))?,
            done: self.zeros(shape.n_kv_heads * chunks)?,
            bar: self.zeros(1)?,
            prof: if profile_on() {
                Some(self.zeros(PROF_SLOTS + 3 * 5 * shape.n_layers)?)
            } else {
                None
            },
            grid: grid as u32,
            smem: smem as u32,
            ring_at: at as u32,
            stages: stages as u32,
            max_splits,
        }))
    }

    /// Runs every layer of the step for the batch's one sequence on `x` (`hidden` f32 at
    /// device address `x`, the residual stream), in place. `batch` holds one decode sequence
    /// (a padding one, of length 0, stores and attends nothing).
    pub fn fused_decode(
        &self,
        st: &FusedState,
        x: u64,
        batch: &AttnBatch,
        rope: &RopeTable,
        block_size: usize,
    ) -> Result<()> {
        if batch.n_seqs() != 1 || batch.n_rows() > 1 {
            return Err(CudaError::Shape {
                what: "fused decode sequences (one, of one new token)",
                got: batch.n_seqs().max(batch.n_rows()),
                want: 1,
            });
        }
        let s = &st.shape;
        let (cs, neox) = rope.kernel_table(self);
        let a = FusedArgs {
            n_layers: s.n_layers as i32,
            hidden: s.hidden as i32,
            inter: s.inter as i32,
            n_heads: s.n_heads as i32,
            n_kv_heads: s.n_kv_heads as i32,
            block_size: block_size as i32,
            max_blocks: batch.max_blocks() as i32,
            rope_dims: rope.dims() as i32,
            neox: i32::from(neox),
            max_pos: rope.max_pos() as i32,
            act: s.act,
            max_splits: st.max_splits as i32,
            eps: s.eps,
            qk_eps: s.qk_eps,
            scale: s.scale,
            stages: st.stages as i32,
            ring_at: st.ring_at as i32,
        };
        let (tab, seqs, _, _) = batch.ptrs(self);
        let layers = self.ptr(&st.layers);
        let (q, k, v) = (self.ptr(&st.q), self.ptr(&st.k), self.ptr(&st.v));
        let (att, act, ws) = (self.ptr(&st.att), self.ptr(&st.act), self.ptr(&st.ws));
        let (done, bar) = (self.ptr(&st.done), self.ptr(&st.bar));
        let cfg = LaunchConfig {
            grid_dim: (st.grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: st.smem,
        };
        let prof = st.prof.as_ref().map_or(0, |p| self.ptr(p));
        let f = self.kernel(&kernel_name(s))?;
        launch!(self, f, cfg; layers, x, q, k, v, att, act, ws, done, bar, tab, seqs, cs, prof, a)?;
        if prof != 0 {
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            let (n_layers, every) = (s.n_layers as i32, PROFILE_EVERY);
            let f = self.kernel("decode_fused_profile")?;
            launch!(self, f, cfg; prof, n_layers, every)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-8B's ring starts after its 12288-wide MLP input; the small models' after the
    /// attention buffers; an H200's 227 KB then hold 11 and 13 slots.
    #[test]
    fn the_ring_fits_beside_the_widest_phase() {
        let s = |hidden, inter, n_heads, head_dim| FusedShape {
            n_layers: 1,
            hidden,
            inter,
            n_heads,
            n_kv_heads: 8,
            head_dim,
            bf16: true,
            act: 0,
            eps: 1e-6,
            qk_eps: 1e-6,
            scale: 1.0,
        };
        let h200 = 232_448;
        let big = ring_at(&s(4096, 12288, 32, 128), 132);
        // Down's input (12,288 floats), then 64 partials for each of 4 row groups (32 rows of
        // 4,096 over 132 CTAs): still 11 ring slots on the H200.
        assert_eq!(big, 4 * (128 + 12288 + 64 * 4));
        assert_eq!(ring_stages(big, h200), Some(11));
        // 4 q heads, a k head, (m, l) and 4 heads' outputs for each of 7 warps, 128-aligned.
        let attn = (4 * (128usize + 4 * 128 + 128 + 2 * 7 * 4 + 7 * 4 * 128)).next_multiple_of(128);
        let small = ring_at(&s(1024, 3072, 16, 128), 132);
        assert_eq!(small, attn);
        assert_eq!(ring_stages(small, h200), Some(13));
        // One CTA with every row: gate+up's input (4,096 floats) and gate sums (4,104), then
        // 64 partials for each of 2 × 513 row groups.
        assert_eq!(
            ring_at(&s(4096, 4104, 8, 64), 1),
            (4 * (128 + 4096 + 4104 + 64 * 1026) as usize).next_multiple_of(128)
        );
        // A device of 48 KB holds no ring beside an 8B's buffers.
        assert_eq!(ring_stages(big, 48 * 1024), None);
        assert_eq!(ring_stages(0, 1 << 30), Some(16));
        assert_eq!(kernel_names().len(), 5);
    }
}
