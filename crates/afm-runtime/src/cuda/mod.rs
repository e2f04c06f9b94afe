//! The CUDA backend of afm-runtime (feature `cuda`): a device context, device buffers and the
//! kernels of a transformer step, each checked against the CPU implementation in this crate.
//!
//! - `context`: [`CudaContext`] (device, one stream, cuBLAS, the NVRTC-compiled modules),
//!   allocation, host↔device copies and event timing.
//! - `ops`: norms, RoPE, gated activations, residual add, softcap, embedding lookups.
//! - `matmul`: weights on the device ([`DeviceWeight`]) and `out = x · Wᵀ` for f32/f16/bf16
//!   (cuBLAS) and Q8_0/Q4_K/Q6_K (own GEMV kernels reading GGML blocks; dequantize + cuBLAS
//!   for large batches).
//! - `gemv_shape`: the one-row 16-bit GEMVs' block shape (rows per block, units in flight),
//!   from a measured table.
//! - `mmq`: Q8_0/Q4_K/Q6_K times 17..64 activation rows on int8 tensor cores (`mma.sync`).
//! - `mmh`: BF16/F16 times 9..64 activation rows on 16-bit tensor cores (`mma.sync`), with
//!   Q/K/V, gate+up and `out +=` in one launch each.
//! - `skinny`: BF16/F16 times 9..64 activation rows, TMA-fed, column splits merged in a thread
//!   block cluster (batch-invariant; opt-in, slower than cuBLAS at 64 rows so far).
//! - `attention`: the paged KV cache on the device, the KV write, the attention prologue (head
//!   norms, RoPE and the KV write in one launch) and paged attention (decode with a split over
//!   the key range for long contexts, merged in the same launch, and prefill).
//! - `attention_mma`: prefill attention on tensor cores (mma.sync, FlashAttention-2 style) for
//!   long chunks over an f16 cache, and the rule for when it replaces the SIMT kernel.
//! - `sampling`: greedy and top-k/top-p/min-p sampling without copying logits to the host.
//! - `decode_fused`: a whole llama-family decode step of one sequence in one persistent launch.
//! - `kernel_cache`: NVRTC to CUBIN for the device's architecture, kept on disk.
//!
//! Activations are f32 row-major `[rows][features]` buffers ([`CudaSlice<f32>`]), as on the CPU.
//! Kernels are CUDA C (`kernels/*.cu`) compiled by NVRTC when the context is created, except
//! the opt-in paths' modules ([`OPT_IN`]: MMH and the fused decode step),
//! compiled on first use unless their switch is on; cudarc loads libcuda, libnvrtc and libcublas
//! at run time, so building needs no CUDA toolkit.
//! Nothing here knows about models, requests or the scheduler.

mod attention;
mod attention_mma;
mod context;
mod decode_fused;
mod device_weight;
mod gemv_shape;
mod handover;
mod kernel_cache;
mod matmul;
mod mmh;
mod mmq;
mod ops;
mod sampling;
mod skinny;

pub use attention::{AttnBatch, DeviceKvCache, DeviceLayerKv, KvBuf};
pub use attention_mma::AttnKernel;
pub(crate) use context::arch_for;
pub use context::{
    compile_kernels, CudaContext, DeviceInfo, GpuTimer, Readback, Workspace, KERNEL_MODULES, OPT_IN,
};
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
pub use decode_fused::{FusedShape, FusedState, LAYER_FIELDS};
pub use device_weight::DeviceWeight;
pub use matmul::{MatmulPath, RowNorm, GEMV_MAX_BATCH, MMQ_GATED_MAX_ROWS};
pub use mmh::{MMH_GATED_MAX_ROWS, MMH_LAUNCH_ROWS, MMH_MAX_ROWS};
pub use mmq::MMQ_LAUNCH_ROWS;
pub use ops::{Activation, RopeTable};
pub use sampling::{LogitAdjust, SampleParams};
pub use skinny::{skinny_plan, SkinnyPlan, SKINNY_ROWS};

/// A device buffer that is either owned or borrowed from a longer-lived owner (the static
/// input buffers of CUDA graphs): borrowed ones are never freed when dropped.
pub enum Buf<T> {
    Owned(CudaSlice<T>),
    Borrowed(Option<CudaSlice<T>>),
}

impl<T> Buf<T> {
    /// A view of `len` elements at device address `ptr`, owned elsewhere.
    ///
    /// # Safety
    /// `ptr` must point to at least `len` elements that outlive the returned value.
    pub(crate) unsafe fn borrowed(ctx: &CudaContext, ptr: u64, len: usize) -> Self {
        Buf::Borrowed(Some(ctx.stream().upgrade_device_ptr(ptr, len)))
    }
}

impl<T> std::ops::Deref for Buf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        match self {
            Buf::Owned(s) => s,
            Buf::Borrowed(s) => s.as_ref().expect("taken only in drop"),
        }
    }
}

impl<T> std::ops::DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        match self {
            Buf::Owned(s) => s,
            Buf::Borrowed(s) => s.as_mut().expect("taken only in drop"),
        }
    }
}

impl<T> Drop for Buf<T> {
    fn drop(&mut self) {
        if let Buf::Borrowed(s) = self {
            if let Some(s) = s.take() {
                s.leak(); // the owner frees it
            }
        }
    }
}

/// Errors of the CUDA backend. Messages name the field, the value and the limit.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("NVRTC could not compile kernel module {module}: {log}")]
    Compile { module: &'static str, log: String },
    #[error("{what}: got {got}, expected {want}")]
    Shape {
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("{what} = {value} is not supported on the GPU (supported: {supported})")]
    Unsupported {
        what: &'static str,
        value: String,
        supported: &'static str,
    },
    #[error(transparent)]
    Runtime(#[from] crate::RuntimeError),
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Fails with [`CudaError::Shape`] unless `got == want`.
fn check(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(CudaError::Shape { what, got, want })
    }
}

/// Fails with [`CudaError::Shape`] unless the buffer holds at least `want` elements.
fn check_len(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got >= want {
        Ok(())
    } else {
        Err(CudaError::Shape { what, got, want })
    }
}

/// Launches `$f` on the context's stream with the listed locals as arguments (each a
/// device pointer `u64`, an `i32`/`i64`/`f32` or a `#[repr(C)]` argument struct), through
/// [`launch_raw`]. `launch!(ctx, f, cfg, cluster = z; ...)` launches thread block clusters of
/// z blocks along the grid's z axis (0: none).
macro_rules! launch {
    ($ctx:expr, $f:expr, $cfg:expr; $($arg:ident),* $(,)?) => {
        launch!($ctx, $f, $cfg, cluster = 0; $($arg),*)
    };
    ($ctx:expr, $f:expr, $cfg:expr, cluster = $z:expr; $($arg:ident),* $(,)?) => {{
        let mut params = [$( &$arg as *const _ as *mut ::core::ffi::c_void ),*];
        // SAFETY: every kernel's argument list is written next to its CUDA signature in the
        // wrappers, buffer sizes are checked before the launch, and `params` points at locals
        // that outlive the call (the driver copies the values at launch).
        unsafe { $crate::cuda::launch_raw($ctx.stream(), $f, $cfg, &mut params, $z) }
    }};
}

/// Whether kernels launch with programmatic dependent launch (`AFM_PDL=0` turns it off): a
/// kernel may then start while the one before it drains, and waits for it (and its memory)
/// in its first instruction (`pdl_begin` in `common.cuh`) — so launch latency and the
/// previous kernel's tail overlap, which is most of a small decode step's time.
fn pdl() -> bool {
    static ON: crate::switch::Switch = crate::switch::Switch::new("AFM_PDL", true);
    PDL_DEVICE.load(std::sync::atomic::Ordering::Relaxed) && ON.on()
}

/// Set when a device of compute capability 9.0 or later is opened (PDL needs Hopper).
pub(crate) static PDL_DEVICE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Launches `f` with `params` (one pointer to each argument's value) on `stream`, with the
/// programmatic-stream-serialization attribute when [`pdl`] is on. Every afm kernel begins by
/// waiting on the grids before it (`griddepcontrol.wait`), so none reads or overwrites a
/// buffer early; kernels launched by cuBLAS keep the ordinary full dependency. With
/// `cluster_z` > 0 the blocks run in thread block clusters of `cluster_z` along the grid's z
/// axis (it must divide the grid's z, and [`cluster_fits`] must have said yes).
///
/// # Safety
/// `params` must match `f`'s parameter list in number, order and types.
pub(crate) unsafe fn launch_raw(
    stream: &cudarc::driver::CudaStream,
    f: &cudarc::driver::CudaFunction,
    cfg: cudarc::driver::LaunchConfig,
    params: &mut [*mut core::ffi::c_void],
    cluster_z: u32,
) -> Result<()> {
    use cudarc::driver::sys;
    stream.context().bind_to_thread()?;
    let mut attrs = LaunchAttrs::new(cluster_z);
    let config = attrs.config(stream, cfg);
    // SAFETY: the caller's contract; `config` and `attrs` live through the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()?;
    handover::launched();
    Ok(())
}

/// A launch's attributes: programmatic stream serialization when [`pdl`] is on, a cluster
/// shape when `cluster_z` > 0.
struct LaunchAttrs {
    attrs: [cudarc::driver::sys::CUlaunchAttribute; 2],
    n: u32,
}

impl LaunchAttrs {
    fn new(cluster_z: u32) -> Self {
        use cudarc::driver::sys;
        // SAFETY: plain C structs; zero is a valid value of each field.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if pdl() {
            let a = &mut attrs[n];
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster_z > 0 {
            let a = &mut attrs[n];
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            a.value.clusterDim.x = 1;
            a.value.clusterDim.y = 1;
            a.value.clusterDim.z = cluster_z;
            n += 1;
        }
        Self { attrs, n: n as u32 }
    }

    /// The driver's configuration for launching `cfg` on `stream` with these attributes; it
    /// points at them, so they must outlive its use.
    fn config(
        &mut self,
        stream: &cudarc::driver::CudaStream,
        cfg: cudarc::driver::LaunchConfig,
    ) -> cudarc::driver::sys::CUlaunchConfig {
        cudarc::driver::sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: self.attrs.as_mut_ptr(),
            numAttrs: self.n,
        }
    }
}

/// Whether `f` can run in clusters of `cluster_z` blocks with `cfg`'s block shape and shared
/// memory (at least one such cluster resident on the device), asked of the driver once per
/// (function, cluster size, shared memory). Clusters past 8 blocks (non-portable) are allowed
/// for `f` on every call: the permission belongs to the loaded function, and a function
/// loaded later (another context) may reuse a cached one's address.
pub(crate) fn cluster_fits(
    stream: &cudarc::driver::CudaStream,
    f: &cudarc::driver::CudaFunction,
    cfg: cudarc::driver::LaunchConfig,
    cluster_z: u32,
) -> bool {
    use cudarc::driver::sys;
    use std::collections::HashMap;
    use std::sync::Mutex;
    /// (function, cluster size, dynamic shared memory) -> whether it fits.
    type Fits = HashMap<(usize, u32, u32), bool>;
    static FITS: Mutex<Option<Fits>> = Mutex::new(None);
    if stream.context().bind_to_thread().is_err() {
        return false;
    }
    if cluster_z > 8 {
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED;
        // SAFETY: a loaded function and a valid attribute.
        let set = unsafe { sys::cuFuncSetAttribute(f.cu_function(), attr, 1) };
        if set != sys::CUresult::CUDA_SUCCESS {
            return false;
        }
    }
    let key = (f.cu_function() as usize, cluster_z, cfg.shared_mem_bytes);
    let mut fits = FITS.lock().unwrap_or_else(|e| e.into_inner());
    let fits = fits.get_or_insert_with(HashMap::new);
    *fits.entry(key).or_insert_with(|| {
        let mut attrs = LaunchAttrs::new(cluster_z);
        let one = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, cluster_z),
            ..cfg
        };
        let config = attrs.config(stream, one);
        let mut count = 0;
        // SAFETY: `config` and `attrs` live through the call; `count` is written.
        let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut count, f.cu_function(), &config) };
        r == sys::CUresult::CUDA_SUCCESS && count > 0
    })
}
pub(crate) use launch;
