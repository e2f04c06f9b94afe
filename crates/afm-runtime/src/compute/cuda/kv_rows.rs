//! The CUDA arm of `compute::kv_rows`: rows of given (block, slot)s of one pool layer, every
//! head, gathered to the host or scattered from it. Row offsets are computed on the host
//! (`((block · n_kv_heads + 0) · block_size + slot) · head_dim`; head h adds
//! `h · block_size · head_dim`), so the kernels only copy and convert.

use cudarc::driver::{CudaFunction, LaunchConfig};

use super::{alloc, ptr, ptr_mut, upload, CudaDevice};
use crate::compute::{check, ComputeError, KvPart, Result};
use crate::cuda::{launch, DeviceKvCache, DeviceLayerKv};
use crate::kv_store::KvDtype;

/// Appended to `EXTRA_KERNELS` and compiled with them at open.
pub(super) const KERNELS: &str = r#"
// One block per row r: out[r][h * D + d] = cache[base[r] + h * hs + d].
// Programmatic dependent launch: as `pdl_begin` in cuda/kernels/common.cuh.
// The writers only wait: their dependents launch when they have finished, because the decode
// attention reads cached rows below the new token before its own wait (cuda/attention.rs), which
// holds only while the kernel just ahead of it writes no such row.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_BEGIN asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;");
#define PDL_WAIT asm volatile("griddepcontrol.wait;" ::: "memory");
#else
#define PDL_BEGIN
#define PDL_WAIT
#endif
extern "C" __global__ void kv_rows_read_f32(const float* c, const long long* base, float* out,
                                            int nkv, int D, long long hs) { PDL_BEGIN
    const long long b = base[blockIdx.x];
    float* o = out + (long long)blockIdx.x * nkv * D;
    for (int e = threadIdx.x; e < nkv * D; e += blockDim.x) o[e] = c[b + (e / D) * hs + e % D];
}
extern "C" __global__ void kv_rows_read_f16(const unsigned short* c, const long long* base,
                                            float* out, int nkv, int D, long long hs) { PDL_BEGIN
    const long long b = base[blockIdx.x];
    float* o = out + (long long)blockIdx.x * nkv * D;
    for (int e = threadIdx.x; e < nkv * D; e += blockDim.x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(c[b + (e / D) * hs + e % D]));
        o[e] = f;
    }
}
extern "C" __global__ void kv_rows_write_f32(float* c, const long long* base, const float* src,
                                             int nkv, int D, long long hs) { PDL_WAIT
    const long long b = base[blockIdx.x];
    const float* s = src + (long long)blockIdx.x * nkv * D;
    for (int e = threadIdx.x; e < nkv * D; e += blockDim.x) c[b + (e / D) * hs + e % D] = s[e];
}
extern "C" __global__ void kv_rows_write_f16(unsigned short* c, const long long* base,
                                             const float* src, int nkv, int D, long long hs) { PDL_WAIT
    const long long b = base[blockIdx.x];
    const float* s = src + (long long)blockIdx.x * nkv * D;
    for (int e = threadIdx.x; e < nkv * D; e += blockDim.x) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(s[e]));
        c[b + (e / D) * hs + e % D] = h;
    }
}
"#;

pub(super) struct Kernels {
    read_f32: CudaFunction,
    read_f16: CudaFunction,
    write_f32: CudaFunction,
    write_f16: CudaFunction,
}

impl Kernels {
    pub(super) fn load(f: impl Fn(&str) -> Result<CudaFunction>) -> Result<Self> {
        Ok(Self {
            read_f32: f("kv_rows_read_f32")?,
            read_f16: f("kv_rows_read_f16")?,
            write_f32: f("kv_rows_write_f32")?,
            write_f16: f("kv_rows_write_f16")?,
        })
    }
}

/// Launch geometry and row offsets of one call.
struct Rows {
    base: Vec<i64>,
    nkv: i32,
    d: i32,
    head_stride: i64,
    cfg: LaunchConfig,
}

fn rows(l: &DeviceLayerKv, block_size: usize, at: &[(usize, usize)]) -> Rows {
    let (nkv, d) = (l.shape.n_kv_heads, l.shape.head_dim);
    Rows {
        base: at
            .iter()
            .map(|&(b, s)| ((b * nkv * block_size + s) * d) as i64)
            .collect(),
        nkv: nkv as i32,
        d: d as i32,
        head_stride: (block_size * d) as i64,
        cfg: LaunchConfig {
            grid_dim: (at.len() as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        },
    }
}

impl CudaDevice {
    /// Host code waits on these; a CUDA graph cannot.
    fn refuse_in_graph(&self, op: &str) -> Result<()> {
        if self.static_io().is_some() {
            return Err(ComputeError::Unsupported {
                what: "host access to KV rows",
                value: format!("{op} inside a CUDA decode graph"),
                device: self.name.clone(),
                supported: "eager steps",
            });
        }
        Ok(())
    }

    /// `at`: (block, slot) of each row, checked against the pool by the caller.
    pub(in crate::compute) fn kv_read_rows(
        &self,
        c: &DeviceKvCache,
        layer: usize,
        at: &[(usize, usize)],
        part: KvPart,
    ) -> Result<Vec<f32>> {
        self.refuse_in_graph("kv_read_rows")?;
        let l = &c.layers[layer];
        let n = at.len() * l.shape.n_kv_heads * l.shape.head_dim;
        if n == 0 {
            return Ok(Vec::new());
        }
        let r = rows(l, c.block_size(), at);
        let ctx = self.lock();
        let base = upload(&ctx, &r.base)?;
        let mut out = alloc::<f32>(&ctx, n)?;
        let (k, v) = l.addresses(&ctx);
        let src = if part == KvPart::Keys { k } else { v };
        let f = match l.dtype() {
            KvDtype::F32 => &self.extra.kv.read_f32,
            _ => &self.extra.kv.read_f16,
        };
        let (bp, op) = (ptr(&ctx, &base), ptr_mut(&ctx, &mut out));
        let (nkv, d, hs) = (r.nkv, r.d, r.head_stride);
        launch!(ctx, f, r.cfg; src, bp, op, nkv, d, hs)?;
        Ok(ctx.download(&out.slice(0..n))?)
    }

    /// Writes `keys` and/or `values` (`[rows][n_kv_heads · head_dim]`) at `at`.
    pub(in crate::compute) fn kv_write_rows(
        &self,
        c: &DeviceKvCache,
        layer: usize,
        at: &[(usize, usize)],
        keys: Option<&[f32]>,
        values: Option<&[f32]>,
    ) -> Result<()> {
        self.refuse_in_graph("kv_write_rows")?;
        let l = &c.layers[layer];
        let n = at.len() * l.shape.n_kv_heads * l.shape.head_dim;
        if n == 0 {
            return Ok(());
        }
        let r = rows(l, c.block_size(), at);
        let ctx = self.lock();
        let base = upload(&ctx, &r.base)?;
        let (k, v) = l.addresses(&ctx);
        let f = match l.dtype() {
            KvDtype::F32 => &self.extra.kv.write_f32,
            _ => &self.extra.kv.write_f16,
        };
        for (dst, src) in [(k, keys), (v, values)] {
            let Some(src) = src else { continue };
            check(
                "kv_write_rows values (rows × heads × head_dim)",
                src.len(),
                n,
            )?;
            let src = upload(&ctx, src)?;
            let (bp, sp) = (ptr(&ctx, &base), ptr(&ctx, &src));
            let (nkv, d, hs) = (r.nkv, r.d, r.head_stride);
            launch!(ctx, f, r.cfg; dst, bp, sp, nkv, d, hs)?;
        }
        Ok(())
    }
}
