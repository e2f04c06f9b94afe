//! The CUDA backend of afm-runtime (feature `cuda`): a device context, device buffers and the
//! kernels of a transformer step, each checked against the CPU implementation in this crate.
//!
//! - `context`: [`CudaContext`] (device, one stream, cuBLAS, the NVRTC-compiled modules),
//!   allocation, host↔device copies and event timing.
//! - `ops`: norms, RoPE, gated activations, residual add, softcap, embedding lookups.
//! - `matmul`: weights on the device ([`DeviceWeight`]) and `out = x · Wᵀ` for f32/f16/bf16
//!   (cuBLAS) and Q8_0/Q4_K/Q6_K (own GEMV kernels reading GGML blocks; dequantize + cuBLAS
//!   for large batches).
//! - `attention`: the paged KV cache on the device, the KV write, the attention prologue (head
//!   norms, RoPE and the KV write in one launch) and paged attention (decode with a split over
//!   the key range for long contexts, merged in the same launch, and prefill).
//! - `sampling`: greedy and top-k/top-p/min-p sampling without copying logits to the host.
//!
//! Activations are f32 row-major `[rows][features]` buffers ([`CudaSlice<f32>`]), as on the CPU.
//! Kernels are CUDA C (`kernels/*.cu`) compiled by NVRTC once when the context is created;
//! cudarc loads libcuda, libnvrtc and libcublas at run time, so building needs no CUDA toolkit.
//! Nothing here knows about models, requests or the scheduler.

mod attention;
mod context;
mod matmul;
mod ops;
mod sampling;

pub use attention::{AttnBatch, DeviceKvCache, DeviceLayerKv, KvBuf};
pub use context::{compile_kernels, CudaContext, DeviceInfo, GpuTimer, Workspace, KERNEL_MODULES};
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
pub use matmul::{DeviceWeight, MatmulPath, GEMV_MAX_BATCH};
pub use ops::{Activation, RopeTable};
pub use sampling::{LogitAdjust, SampleParams};

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
/// device pointer `u64`, an `i32`/`i64`/`f32` or a `#[repr(C)]` argument struct).
macro_rules! launch {
    ($ctx:expr, $f:expr, $cfg:expr; $($arg:ident),* $(,)?) => {{
        let mut b = $ctx.stream().launch_builder($f);
        $( cudarc::driver::PushKernelArg::arg(&mut b, &$arg); )*
        // SAFETY: every kernel's argument list is written next to its CUDA signature in the
        // wrappers, and buffer sizes are checked before the launch.
        unsafe { b.launch($cfg) }.map(|_| ()).map_err($crate::cuda::CudaError::from)
    }};
}
pub(crate) use launch;
