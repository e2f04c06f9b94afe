//! The CUDA arm of device dispatch: each op of `compute` on `crate::cuda`'s kernels, plus five
//! small kernels that module lacks (scale, bias add, row gather, weighted row add, column
//! slice) and the KV row access of `kv_rows`, compiled here at open.
//!
//! Weight types without a CUDA kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K: llama.cpp's
//! Q4_K_M files of small models are mostly Q5_0) are dequantized to F16 on the host at load:
//! 16/5.5 times their memory, a relative rounding of at most 2⁻¹², and the F16 kernels' speed.
//!
//! `CudaContext` keeps scratch buffers that its matmul, attention and sampling grow, so its
//! methods take `&mut self`; the context sits behind a `Mutex` that each op holds for its
//! launches only (uncontended: one engine thread drives a device). Outputs are fresh
//! stream-ordered allocations (cuMemAllocAsync's pool), freed in order when dropped.

use std::sync::{Mutex, MutexGuard};

use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::{
    check, wrong, Activation, ComputeError, Data, KvData, KvPool, Result, Step, StepData, Tensor,
    Vector, VectorData, Weight, WeightData,
};
use crate::attention::{AttnParams, AttnSeq};
use crate::cuda::{
    self, launch, AttnBatch, Buf, CudaContext, CudaSlice, DeviceKvCache, DeviceWeight,
};
use crate::cuda::{CudaError, RopeTable};
use crate::kv_store::{KvDtype, LayerKvShape};
use crate::ops::{Rope, RopeStyle};
use crate::{DType, WeightMatrix};

/// Weight types the CUDA matmul and embedding kernels read; others are stored as F16.
const WEIGHT_TYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4K,
    DType::Q6K,
];

/// The type a weight of `dtype` is kept in on the GPU.
pub(super) fn stored_type(dtype: DType) -> DType {
    if WEIGHT_TYPES.contains(&dtype) {
        dtype
    } else {
        DType::F16
    }
}

/// Every row dequantized and rounded to F16, in parallel over rows.
fn dequantize_to_f16(w: &WeightMatrix) -> Result<WeightMatrix> {
    use rayon::prelude::*;
    let (rows, cols) = (w.rows(), w.cols());
    let mut bytes = vec![0u8; rows * cols * 2];
    bytes
        .par_chunks_mut(2 * cols.max(1))
        .enumerate()
        .for_each(|(r, out)| {
            let mut row = vec![0f32; cols];
            w.dequantize_row(r, &mut row);
            for (o, v) in out.chunks_exact_mut(2).zip(&row) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        });
    let bytes = crate::WeightBytes::from_vec(bytes);
    Ok(WeightMatrix::new(DType::F16, rows, cols, bytes).map_err(CudaError::from)?)
}

const EXTRA_KERNELS: &str = r#"
// Programmatic dependent launch: as `pdl_begin` in cuda/kernels/common.cuh.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_BEGIN asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;");
#else
#define PDL_BEGIN
#endif
extern "C" __global__ void scale_f32(float* x, long long n, float s) { PDL_BEGIN
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
extern "C" __global__ void add_bias_rows(float* x, const float* b, long long n, int cols) { PDL_BEGIN
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}
// Q/K/V biases added to rows [q | k | v] of one joined product: column c of a row takes
// b0[c], b1[c - c0] or b2[c - c0 - c1].
extern "C" __global__ void add_bias3_rows(float* x, const float* b0, const float* b1,
                                          const float* b2, long long n, int c0, int c1, int c2) { PDL_BEGIN
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int c = (int)(i % (c0 + c1 + c2));
    x[i] += c < c0 ? b0[c] : c < c0 + c1 ? b1[c - c0] : b2[c - c0 - c1];
}
// One block per output row.
extern "C" __global__ void gather_rows_f32(const float* x, const int* rows, float* out, int cols) { PDL_BEGIN
    const float* src = x + (long long)rows[blockIdx.x] * cols;
    float* dst = out + (long long)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}
// One block per source row: out[rows[i]] += w[i] * src[i] (rows distinct, checked by the caller).
extern "C" __global__ void index_add_rows_f32(float* out, const float* src, const int* rows,
                                              const float* w, int cols) { PDL_BEGIN
    const float* s = src + (long long)blockIdx.x * cols;
    float* d = out + (long long)rows[blockIdx.x] * cols;
    const float wi = w[blockIdx.x];
    for (int c = threadIdx.x; c < cols; c += blockDim.x) d[c] += wi * s[c];
}
// One block per row: out[r] = x[r][start .. start + width].
extern "C" __global__ void columns_f32(const float* x, float* out, int cols, int start, int width) { PDL_BEGIN
    const float* s = x + (long long)blockIdx.x * cols + start;
    float* d = out + (long long)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}
"#;

/// The PTX of `EXTRA_KERNELS` and the KV row kernels for `arch` (NVRTC).
fn compile_extra(
    arch: Option<&'static str>,
) -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    let opts = CompileOptions {
        arch,
        options: vec!["--std=c++17".into()],
        name: Some("compute_extra.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(format!("{EXTRA_KERNELS}{}", kv_rows::KERNELS), opts)
}

struct Extra {
    scale: CudaFunction,
    add_bias: CudaFunction,
    add_bias3: CudaFunction,
    gather: CudaFunction,
    index_add: CudaFunction,
    columns: CudaFunction,
    kv: kv_rows::Kernels,
}

pub struct CudaDevice {
    ctx: Mutex<CudaContext>,
    extra: Extra,
    ordinal: usize,
    name: String,
    /// Set while a decode forward runs against the graphs' static buffers (warm-up or
    /// capture): the ops then read inputs from, and write logits to, those buffers.
    io: Mutex<Option<graphs::StaticIo>>,
    graphs: Mutex<Option<graphs::Graphs>>,
    /// Bytes of every weight placed on the device (for `--gpu-profile`).
    weight_bytes: std::sync::atomic::AtomicUsize,
    /// Device state of the fused decode step, per model (`decode_fused`).
    fused: Mutex<decode_fused::FusedStates>,
}

mod attn_step;
mod decode_fused;
mod graphs;
mod kv_rows;

fn grid(n: usize, threads: u32) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: ((n as u64).div_ceil(threads as u64).max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device buffer of a tensor, as a view of exactly its `rows × cols` values.
fn view<'a>(t: &'a Tensor, op: &'static str) -> Result<CudaView<'a, f32>> {
    match &t.data {
        Data::Cuda(b) => Ok(b.slice(0..t.rows * t.cols)),
        Data::Host(_) => Err(wrong(op, "cpu", "cuda")),
    }
}

fn view_mut<'a>(t: &'a mut Tensor, op: &'static str) -> Result<CudaViewMut<'a, f32>> {
    let n = t.rows * t.cols;
    match &mut t.data {
        Data::Cuda(b) => Ok(b.slice_mut(0..n)),
        Data::Host(_) => Err(wrong(op, "cpu", "cuda")),
    }
}

fn vector<'a>(v: &'a Vector, op: &'static str) -> Result<CudaView<'a, f32>> {
    match &v.data {
        VectorData::Cuda(b) => Ok(b.slice(0..v.len)),
        VectorData::Host(_) => Err(wrong(op, "cpu", "cuda")),
    }
}

/// A norm's weights and epsilon as the CUDA context takes them.
fn row_norm<'a>((w, eps): (&'a Vector, f32)) -> Result<cuda::RowNorm<'a>> {
    Ok(cuda::RowNorm {
        w: vector(w, "rms_norm")?,
        eps,
    })
}

fn weight<'a>(w: &'a Weight, op: &'static str) -> Result<&'a DeviceWeight> {
    match &w.data {
        WeightData::Cuda(d) => Ok(d),
        WeightData::Host(_) => Err(wrong(op, "cpu", "cuda")),
    }
}

fn cuda_act(act: Activation) -> cuda::Activation {
    match act {
        Activation::Silu => cuda::Activation::Silu,
        Activation::GeluTanh => cuda::Activation::GeluTanh,
    }
}

/// Device buffer for `n` values (at least one element: zero-byte allocations are refused).
fn alloc<T: DeviceRepr>(ctx: &CudaContext, n: usize) -> Result<CudaSlice<T>> {
    Ok(ctx.alloc::<T>(n.max(1))?)
}

fn upload<T: DeviceRepr>(ctx: &CudaContext, v: &[T]) -> Result<CudaSlice<T>> {
    if v.is_empty() {
        alloc(ctx, 1)
    } else {
        Ok(ctx.upload(v)?)
    }
}

fn ids_i32(what: &'static str, v: impl Iterator<Item = usize>) -> Result<Vec<i32>> {
    v.map(|x| {
        i32::try_from(x).map_err(|_| ComputeError::Shape {
            what,
            got: x,
            want: i32::MAX as usize,
        })
    })
    .collect()
}

fn check_len_c(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got >= want {
        Ok(())
    } else {
        Err(ComputeError::Shape { what, got, want })
    }
}

fn ptr<T>(ctx: &CudaContext, x: &impl DevicePtr<T>) -> u64 {
    x.device_ptr(ctx.stream()).0
}

fn ptr_mut<T>(ctx: &CudaContext, x: &mut impl DevicePtrMut<T>) -> u64 {
    x.device_ptr_mut(ctx.stream()).0
}

impl CudaDevice {
    pub(super) fn open(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal)?;
        // The device's architecture, as for the other modules: the kernels' PDL wait
        // (`PDL_BEGIN`) is compiled in only for Hopper and later, where launches ask for it.
        let arch = crate::cuda::arch_for(ctx.info().compute_capability);
        let ptx = compile_extra(arch).map_err(|e| CudaError::Compile {
            module: "compute_extra",
            log: format!("{e:?}"),
        })?;
        let module = ctx
            .stream()
            .context()
            .load_module(ptx)
            .map_err(CudaError::from)?;
        let f = |name: &str| module.load_function(name).map_err(CudaError::from);
        let extra = Extra {
            scale: f("scale_f32")?,
            add_bias: f("add_bias_rows")?,
            add_bias3: f("add_bias3_rows")?,
            gather: f("gather_rows_f32")?,
            index_add: f("index_add_rows_f32")?,
            columns: f("columns_f32")?,
            kv: kv_rows::Kernels::load(|n| Ok(f(n)?))?,
        };
        let name = ctx.info().name.clone();
        Ok(Self {
            ctx: Mutex::new(ctx),
            extra,
            ordinal,
            name,
            io: Mutex::new(None),
            graphs: Mutex::new(None),
            weight_bytes: Default::default(),
            fused: Default::default(),
        })
    }

    /// The context; a panic while it was held leaves it usable (its stream is in order).
    fn lock(&self) -> MutexGuard<'_, CudaContext> {
        self.ctx.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The static buffers, while a graph's decode forward runs.
    fn static_io(&self) -> Option<graphs::StaticIo> {
        *self.io.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    pub(super) fn memory(&self) -> Result<(usize, usize)> {
        Ok(self.lock().mem_info()?)
    }

    /// Matrices sharing an input, placed back to back where their type allows one GEMM over
    /// all of them (`DeviceWeight::upload_joined`).
    pub(super) fn weights_joined(&self, ws: &[WeightMatrix]) -> Result<Vec<DeviceWeight>> {
        let converted: Vec<Option<WeightMatrix>> = ws
            .iter()
            .map(|w| {
                (stored_type(w.dtype()) != w.dtype())
                    .then(|| dequantize_to_f16(w))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        let stored: Vec<&WeightMatrix> = ws
            .iter()
            .zip(&converted)
            .map(|(w, c)| c.as_ref().unwrap_or(w))
            .collect();
        let d = DeviceWeight::upload_joined(&self.lock(), &stored)?;
        let bytes: usize = d.iter().map(DeviceWeight::byte_len).sum();
        self.weight_bytes
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(d)
    }

    /// Bytes of the weights placed so far, and the memory bandwidth's peak (bytes/s).
    pub(super) fn weight_bytes_and_peak(&self) -> (usize, f64) {
        let wb = self.weight_bytes.load(std::sync::atomic::Ordering::Relaxed);
        (wb, self.lock().info().peak_bandwidth)
    }

    pub(super) fn upload(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        upload(&self.lock(), v)
    }

    pub(super) fn rope_table(
        &self,
        rope: &Rope,
        dims: usize,
        style: RopeStyle,
        max_pos: usize,
    ) -> Result<RopeTable> {
        Ok(RopeTable::from_cpu(
            &self.lock(),
            rope,
            dims,
            style,
            max_pos,
        )?)
    }

    pub(super) fn kv_cache(
        &self,
        shapes: &[LayerKvShape],
        num_blocks: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Result<DeviceKvCache> {
        Ok(DeviceKvCache::new(
            &self.lock(),
            shapes,
            num_blocks,
            block_size,
            dtype,
        )?)
    }

    pub(super) fn step(
        &self,
        seqs: &[AttnSeq],
        positions: &[usize],
        kv: &KvPool,
        n_heads: usize,
    ) -> Result<StepData> {
        let KvData::Cuda(cache) = &kv.data else {
            return Err(wrong("step", "cpu", "cuda"));
        };
        let ctx = self.lock();
        if let Some(io) = self.static_io() {
            check("graph batch sequences (its bucket)", seqs.len(), io.bucket)?;
            // SAFETY: the static buffers live in `self.graphs` for as long as the device.
            return Ok(unsafe {
                StepData::Cuda {
                    positions: Buf::borrowed(&ctx, io.positions, io.bucket),
                    attn: AttnBatch::fixed_decode(
                        &ctx,
                        cache,
                        io.meta,
                        io.bucket,
                        io.max_blocks,
                        n_heads,
                    )?,
                }
            });
        }
        let pos = ids_i32("position", positions.iter().copied())?;
        Ok(StepData::Cuda {
            positions: Buf::Owned(upload(&ctx, &pos)?),
            attn: AttnBatch::new(&ctx, cache, seqs, n_heads)?,
        })
    }

    fn scale(&self, ctx: &CudaContext, x: &mut CudaSlice<f32>, n: usize, s: f32) -> Result<()> {
        let (xp, ni) = (ptr_mut(ctx, x), n as i64);
        launch!(ctx, &self.extra.scale, grid(n, 256); xp, ni, s)?;
        Ok(())
    }

    pub(super) fn embed(
        &self,
        table: &Weight,
        tokens: &[u32],
        scale: f32,
    ) -> Result<CudaSlice<f32>> {
        let ctx = self.lock();
        let n = tokens.len() * table.cols;
        let mut out = alloc(&ctx, n)?;
        if tokens.is_empty() {
            return Ok(out);
        }
        let ids = match self.static_io() {
            Some(io) => {
                check("graph batch tokens (its bucket)", tokens.len(), io.bucket)?;
                // SAFETY: the static buffers live in `self.graphs` for as long as the device.
                unsafe { Buf::borrowed(&ctx, io.tokens, io.bucket) }
            }
            None => Buf::Owned(upload(
                &ctx,
                &ids_i32("token id", tokens.iter().map(|&t| t as usize))?,
            )?),
        };
        ctx.embed(weight(table, "embed")?, &*ids, &mut out.slice_mut(0..n))?;
        if scale != 1.0 {
            self.scale(&ctx, &mut out, n, scale)?;
        }
        Ok(out)
    }

    pub(super) fn linear(
        &self,
        x: &Tensor,
        w: &Weight,
        bias: Option<&Vector>,
    ) -> Result<CudaSlice<f32>> {
        let mut ctx = self.lock();
        let (n, rows) = (x.rows, w.rows);
        let mut out = alloc(&ctx, n * rows)?;
        if n == 0 {
            return Ok(out);
        }
        ctx.matmul(
            weight(w, "linear")?,
            &view(x, "linear")?,
            n,
            &mut out.slice_mut(0..n * rows),
        )?;
        if let Some(b) = bias {
            let (op, bp) = (
                ptr_mut(&ctx, &mut out),
                ptr(&ctx, &vector(b, "linear bias")?),
            );
            let (len, cols) = ((n * rows) as i64, rows as i32);
            launch!(ctx, &self.extra.add_bias, grid(n * rows, 256); op, bp, len, cols)?;
        }
        Ok(out)
    }

    pub(super) fn rms_norm(&self, x: &Tensor, w: &Vector, eps: f32) -> Result<CudaSlice<f32>> {
        let ctx = self.lock();
        let n = x.rows * x.cols;
        let mut out = alloc(&ctx, n)?;
        if n > 0 {
            let wv = vector(w, "rms_norm")?;
            ctx.rms_norm(&view(x, "rms_norm")?, &wv, eps, &mut out.slice_mut(0..n))?;
        }
        Ok(out)
    }

    pub(super) fn rms_norm_in_place(&self, x: &mut Tensor, w: &Vector, eps: f32) -> Result<()> {
        if x.rows == 0 {
            return Ok(());
        }
        let ctx = self.lock();
        let wv = vector(w, "rms_norm")?;
        Ok(ctx.rms_norm_in_place(&mut view_mut(x, "rms_norm")?, &wv, eps)?)
    }

    pub(super) fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        if x.rows == 0 {
            return Ok(());
        }
        let ctx = self.lock();
        let yv = view(y, "add")?;
        Ok(ctx.add_assign(&mut view_mut(x, "add")?, &yv)?)
    }

    pub(super) fn gated_act(&self, act: Activation, gate: &mut Tensor, up: &Tensor) -> Result<()> {
        let ctx = self.lock();
        let (n, ff) = (gate.rows, gate.cols);
        let mut out = alloc(&ctx, n * ff)?;
        if n > 0 {
            let a = cuda_act(act);
            let (g, u) = (view(gate, "gated_act")?, view(up, "gated_act")?);
            ctx.gated_act(a, &g, &u, n, ff, ff, &mut out.slice_mut(0..n * ff))?;
        }
        gate.data = Data::Cuda(out);
        Ok(())
    }

    pub(super) fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        if x.rows == 0 {
            return Ok(());
        }
        let ctx = self.lock();
        Ok(ctx.softcap(&mut view_mut(x, "softcap")?, cap)?)
    }

    pub(super) fn rope(
        &self,
        t: &RopeTable,
        x: &mut Tensor,
        head_dim: usize,
        step: &Step,
    ) -> Result<()> {
        let StepData::Cuda { positions, .. } = &step.data else {
            return Err(wrong("rope", "cpu", "cuda"));
        };
        if let Some(&p) = step.positions.iter().find(|&&p| p >= t.max_pos()) {
            return Err(ComputeError::Shape {
                what: "position (below the rotary table's length, the model's context)",
                got: p,
                want: t.max_pos(),
            });
        }
        if x.rows == 0 {
            return Ok(());
        }
        let ctx = self.lock();
        let (heads, stride) = (x.cols / head_dim, x.cols);
        let pos = positions.slice(0..x.rows);
        let mut xv = view_mut(x, "rope")?;
        Ok(ctx.rope(t, &mut xv, &pos, heads, head_dim, stride)?)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        p: &AttnParams,
    ) -> Result<CudaSlice<f32>> {
        let KvData::Cuda(cache) = &mut kv.data else {
            return Err(wrong("attention", "cpu", "cuda"));
        };
        let StepData::Cuda { attn, .. } = &step.data else {
            return Err(wrong("attention", "cpu", "cuda"));
        };
        let shape = cache.layers[layer].shape;
        check(
            "attention key width (the cache's)",
            k.cols,
            shape.n_kv_heads * shape.head_dim,
        )?;
        let mut ctx = self.lock();
        let n = q.rows * q.cols;
        let mut out = alloc(&ctx, n)?;
        if n == 0 {
            return Ok(out);
        }
        let (qv, kv_, vv) = (
            view(q, "attention")?,
            view(k, "attention")?,
            view(v, "attention")?,
        );
        ctx.kv_write(cache, layer, attn, &kv_, k.cols, &vv, v.cols)?;
        let mut ov = out.slice_mut(0..n);
        ctx.paged_attention(cache, layer, attn, &qv, q.cols, p, &mut ov, q.cols, None)?;
        Ok(out)
    }

    pub(super) fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<CudaSlice<f32>> {
        let ctx = self.lock();
        let mut out = alloc(&ctx, rows.len() * x.cols)?;
        if rows.is_empty() || x.cols == 0 {
            return Ok(out);
        }
        if rows.iter().enumerate().all(|(i, &r)| i == r) {
            // Every row of a decode step (and under graph capture, where uploads cannot be).
            ctx.copy(
                &view(x, "gather_rows")?.slice(0..rows.len() * x.cols),
                &mut out,
            )?;
            return Ok(out);
        }
        let idx = upload(&ctx, &ids_i32("row", rows.iter().copied())?)?;
        let (xp, ip, op) = (
            ptr(&ctx, &view(x, "gather_rows")?),
            ptr(&ctx, &idx),
            ptr_mut(&ctx, &mut out),
        );
        let cols = x.cols as i32;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(ctx, &self.extra.gather, cfg; xp, ip, op, cols)?;
        Ok(out)
    }

    pub(super) fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.lock().zeros::<f32>(n.max(1))?)
    }

    pub(super) fn scale_in_place(&self, x: &mut Tensor, s: f32) -> Result<()> {
        let n = x.rows * x.cols;
        if n == 0 {
            return Ok(());
        }
        let ctx = self.lock();
        let (xp, ni) = (ptr_mut(&ctx, &mut view_mut(x, "scale")?), n as i64);
        launch!(ctx, &self.extra.scale, grid(n, 256); xp, ni, s)?;
        Ok(())
    }

    pub(super) fn index_add_rows(
        &self,
        out: &mut Tensor,
        src: &Tensor,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        if rows.is_empty() || src.cols == 0 {
            return Ok(());
        }
        let ctx = self.lock();
        let idx = upload(&ctx, &ids_i32("row", rows.iter().copied())?)?;
        let w = upload(&ctx, weights)?;
        let (sp, ip, wp) = (
            ptr(&ctx, &view(src, "index_add_rows")?),
            ptr(&ctx, &idx),
            ptr(&ctx, &w),
        );
        let op = ptr_mut(&ctx, &mut view_mut(out, "index_add_rows")?);
        let cols = src.cols as i32;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(ctx, &self.extra.index_add, cfg; op, sp, ip, wp, cols)?;
        Ok(())
    }

    pub(super) fn columns(&self, x: &Tensor, start: usize, width: usize) -> Result<CudaSlice<f32>> {
        let ctx = self.lock();
        let mut out = alloc(&ctx, x.rows * width)?;
        if x.rows == 0 || width == 0 {
            return Ok(out);
        }
        let (xp, op) = (ptr(&ctx, &view(x, "columns")?), ptr_mut(&ctx, &mut out));
        let (cols, st, wd) = (x.cols as i32, start as i32, width as i32);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (x.rows as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(ctx, &self.extra.columns, cfg; xp, op, cols, st, wd)?;
        Ok(out)
    }

    pub(super) fn read_back(&self, b: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        if self.static_io().is_some() {
            return Err(ComputeError::Unsupported {
                what: "a host read-back (MoE routing)",
                value: "inside a CUDA decode graph".into(),
                device: self.name.clone(),
                supported: "eager steps",
            });
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        Ok(self.lock().download(&b.slice(0..n))?)
    }

    pub(super) fn download(&self, b: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let ctx = self.lock();
        if let Some(io) = self.static_io() {
            // Under a graph the logits stay on the device, in the static output buffer.
            check_len_c("graph logits", io.logits_len, n)?;
            // SAFETY: the static buffers live in `self.graphs` for as long as the device.
            let mut dst = unsafe { Buf::<f32>::borrowed(&ctx, io.logits, n) };
            ctx.copy(&b.slice(0..n), &mut *dst)?;
            return Ok(Vec::new());
        }
        Ok(ctx.download(&b.slice(0..n))?)
    }
}

/// Fused decode ops (one launch each where the kernels apply; `None` sends the caller to the
/// unfused ops).
impl CudaDevice {
    pub(super) fn linear_many(
        &self,
        x: &Tensor,
        ws: &[&Weight],
    ) -> Result<Option<Vec<CudaSlice<f32>>>> {
        self.many(x, None, ws)
    }

    /// `linear_many(rms_norm(x, w), ws)` with the norm folded into the matmul's launches;
    /// `None` (nothing launched) where it cannot be.
    pub(super) fn norm_linear_many(
        &self,
        x: &Tensor,
        norm: (&Vector, f32),
        ws: &[&Weight],
    ) -> Result<Option<Vec<CudaSlice<f32>>>> {
        self.many(x, Some(norm), ws)
    }

    fn many(
        &self,
        x: &Tensor,
        norm: Option<(&Vector, f32)>,
        ws: &[&Weight],
    ) -> Result<Option<Vec<CudaSlice<f32>>>> {
        let mut ctx = self.lock();
        let n = x.rows;
        let dws = ws
            .iter()
            .map(|w| weight(w, "linear"))
            .collect::<Result<Vec<_>>>()?;
        let xv = view(x, "linear")?;
        if norm.is_some() && !ctx.folds_norm(&dws, false, n, &xv) {
            return Ok(None);
        }
        let mut outs = dws
            .iter()
            .map(|w| alloc::<f32>(&ctx, n * w.rows()))
            .collect::<Result<Vec<_>>>()?;
        let mut refs: Vec<&mut CudaSlice<f32>> = outs.iter_mut().collect();
        let done = match norm {
            None => ctx.matmul_many(&dws, &xv, n, &mut refs)?,
            Some(nm) => ctx.matmul_many_norm(&dws, &xv, row_norm(nm)?, n, &mut refs)?,
        };
        Ok(done.then_some(outs))
    }

    /// Q, K and V of `x` (of `rms_norm(x, w)` with `norm`) whose weights lie back to back, as
    /// one buffer of rows `[q | k | v]` ([`cuda::CudaContext::matmul_joined`]), plus each
    /// one's bias (one launch for the three; lengths checked by the caller); `None` (nothing
    /// launched) where that does not apply.
    pub(super) fn linear_qkv_joined(
        &self,
        x: &Tensor,
        norm: Option<(&Vector, f32)>,
        ws: [&Weight; 3],
        biases: Option<[&Vector; 3]>,
    ) -> Result<Option<CudaSlice<f32>>> {
        let mut ctx = self.lock();
        let dws = ws
            .iter()
            .map(|w| weight(w, "linear"))
            .collect::<Result<Vec<_>>>()?;
        let xv = view(x, "linear")?;
        let rn = norm.map(row_norm).transpose()?;
        let Some(mut out) = ctx.matmul_joined(&dws, &xv, rn, x.rows)? else {
            return Ok(None);
        };
        if let Some([b0, b1, b2]) = biases {
            let [c0, c1, c2] = ws.map(|w| w.rows as i32);
            let len = x.rows * ws.iter().map(|w| w.rows).sum::<usize>();
            let op = ptr_mut(&ctx, &mut out);
            let (p0, p1, p2) = (
                ptr(&ctx, &vector(b0, "linear bias")?),
                ptr(&ctx, &vector(b1, "linear bias")?),
                ptr(&ctx, &vector(b2, "linear bias")?),
            );
            let n = len as i64;
            launch!(ctx, &self.extra.add_bias3, grid(len, 256); op, p0, p1, p2, n, c0, c1, c2)?;
        }
        Ok(Some(out))
    }

    /// `gated_linear(rms_norm(x, w), gate, up)` with the norm folded in; `None` (nothing
    /// launched) where it cannot be.
    pub(super) fn norm_gated_linear(
        &self,
        x: &Tensor,
        norm: (&Vector, f32),
        gate: &Weight,
        up: &Weight,
        act: Activation,
    ) -> Result<Option<CudaSlice<f32>>> {
        self.gated(x, Some(norm), gate, up, act)
    }

    /// `acc += x · Wᵀ`, the matmul adding into `acc` itself.
    pub(super) fn linear_add(&self, x: &Tensor, w: &Weight, acc: &mut Tensor) -> Result<()> {
        if x.rows == 0 {
            return Ok(());
        }
        let mut ctx = self.lock();
        let xv = view(x, "linear")?;
        let mut av = view_mut(acc, "linear")?;
        Ok(ctx.matmul_add(weight(w, "linear")?, &xv, x.rows, &mut av)?)
    }

    /// `x += down(act(gate(n)) · up(n))` with `n = rms_norm(x)` in one CudaContext path
    /// ([`cuda::CudaContext::matmul_mlp_add`]); `false` (nothing launched) where it does not
    /// apply.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_gated_mlp_add(
        &self,
        x: &mut Tensor,
        norm: (&Vector, f32),
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        act: Activation,
    ) -> Result<bool> {
        let n = x.rows;
        if n == 0 {
            return Ok(false);
        }
        let mut ctx = self.lock();
        let (g, u, d) = (
            weight(gate, "mlp")?,
            weight(up, "mlp")?,
            weight(down, "mlp")?,
        );
        let rn = row_norm(norm)?;
        let mut xv = view_mut(x, "mlp")?;
        Ok(ctx.matmul_mlp_add(g, u, d, cuda_act(act), &mut xv, rn, n)?)
    }

    pub(super) fn gated_linear(
        &self,
        x: &Tensor,
        gate: &Weight,
        up: &Weight,
        act: Activation,
    ) -> Result<Option<CudaSlice<f32>>> {
        self.gated(x, None, gate, up, act)
    }

    fn gated(
        &self,
        x: &Tensor,
        norm: Option<(&Vector, f32)>,
        gate: &Weight,
        up: &Weight,
        act: Activation,
    ) -> Result<Option<CudaSlice<f32>>> {
        let mut ctx = self.lock();
        let n = x.rows;
        let (g, u) = (weight(gate, "gated_linear")?, weight(up, "gated_linear")?);
        let xv = view(x, "gated_linear")?;
        if norm.is_some() && !ctx.folds_norm(&[g, u], true, n, &xv) {
            return Ok(None);
        }
        let mut out = alloc::<f32>(&ctx, n * g.rows())?;
        let done = match norm {
            None => ctx.matmul_gated(g, u, cuda_act(act), &xv, n, &mut out)?,
            Some(nm) => {
                ctx.matmul_gated_norm(g, u, cuda_act(act), &xv, row_norm(nm)?, n, &mut out)?
            }
        };
        Ok(done.then_some(out))
    }

    pub(super) fn add_rms_norm(
        &self,
        x: &mut Tensor,
        y: &Tensor,
        w: &Vector,
        eps: f32,
    ) -> Result<CudaSlice<f32>> {
        let ctx = self.lock();
        let n = x.rows * x.cols;
        let mut out = alloc(&ctx, n)?;
        if n > 0 {
            let (yv, wv) = (view(y, "add_rms_norm")?, vector(w, "add_rms_norm")?);
            let mut xv = view_mut(x, "add_rms_norm")?;
            ctx.add_rms_norm(&mut xv, &yv, &wv, eps, &mut out.slice_mut(0..n))?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    /// The small kernels `open` loads compile and are entry points of the PTX (a broken one
    /// fails every `Device::open` on the GPU). Needs libnvrtc only.
    #[test]
    fn extra_kernels_compile() {
        let ptx = super::compile_extra(Some("compute_90")).expect("compute_extra compiles");
        let text = ptx.to_src();
        let names = [
            "scale_f32",
            "add_bias_rows",
            "add_bias3_rows",
            "gather_rows_f32",
        ];
        for name in names
            .into_iter()
            .chain(["index_add_rows_f32", "columns_f32"])
        {
            assert!(text.contains(&format!(".entry {name}(")), "no entry {name}");
        }
    }
}
