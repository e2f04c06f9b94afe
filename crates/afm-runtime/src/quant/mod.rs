//! GGML block formats: bit-exact dequantization and the dot-product kernels `matmul` runs.
//!
//! Layout of this module:
//! - `float`, `legacy`, `kquants`: decoding of F32/F16/BF16, the 32-weight formats
//!   (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the 256-weight K-quants (Q2_K..Q6_K), plus the portable
//!   scalar dot kernels against quantized activations.
//! - `activations`: activation rows quantized once per matmul call (8-bit, as llama.cpp does).
//! - `avx2_*`: the same kernels with AVX2+FMA, and `vnni_legacy` the 32-weight ones (and
//!   `vnni_kquants` Q4_K and Q6_K) with AVX-512 VNNI, chosen at run time by `kernel`;
//!   `vnni_lanes` the 32-weight formats, Q4_K and Q6_K against groups of eight activation rows
//!   at once (small batches and prefill), `vnni_quads` the 32-weight formats against batches
//!   of three or four rows.
//!
//! It does not own threading or tiling; `matmul` does.

mod activations;
#[cfg(target_arch = "x86_64")]
mod avx2_float;
#[cfg(target_arch = "x86_64")]
mod avx2_kquants;
#[cfg(target_arch = "x86_64")]
mod avx2_legacy;
mod float;
mod kernel;
mod kquants;
mod legacy;
mod mxfp4;
#[cfg(target_arch = "x86_64")]
mod vnni_kquants;
#[cfg(target_arch = "x86_64")]
mod vnni_lanes;
#[cfg(target_arch = "x86_64")]
mod vnni_legacy;
#[cfg(target_arch = "x86_64")]
mod vnni_quads;

use crate::DType;

pub(crate) use activations::{Q8Rows, Q8kRows};
pub use kernel::Isa;
#[cfg(target_arch = "x86_64")]
pub(crate) use kernel::{k_lanes_kernel, lanes_kernel, quads_kernel};
pub(crate) use kernel::{RowKernel, MAX_TILE};
#[cfg(target_arch = "x86_64")]
pub(crate) use vnni_lanes::{Q8Lanes, Q8kLanes, LANES, MAX_GROUPS, MAX_GROUPS_32, MAX_ROWS};
#[cfg(target_arch = "x86_64")]
pub(crate) use vnni_quads::Q8Quads;

/// Decode one row stored as `dtype` into f32, bit-exact with GGML's reference dequantization.
///
/// Panics when `src` is not exactly the encoding of `out.len()` elements; callers size both
/// from a shape checked at load time.
pub fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    assert_eq!(
        dtype.row_bytes(out.len()),
        Some(src.len()),
        "dequantize_row: {} bytes do not encode {} {} values",
        src.len(),
        out.len(),
        dtype.name()
    );
    match dtype {
        DType::F32 => float::dequantize_f32(src, out),
        DType::F16 => float::dequantize_f16(src, out),
        DType::BF16 => float::dequantize_bf16(src, out),
        DType::Q4_0 => legacy::dequantize_q4_0(src, out),
        DType::Q4_1 => legacy::dequantize_q4_1(src, out),
        DType::Q5_0 => legacy::dequantize_q5_0(src, out),
        DType::Q5_1 => legacy::dequantize_q5_1(src, out),
        DType::Q8_0 => legacy::dequantize_q8_0(src, out),
        DType::Q2K => kquants::dequantize_q2_k(src, out),
        DType::Q3K => kquants::dequantize_q3_k(src, out),
        DType::Q4K => kquants::dequantize_q4_k(src, out),
        DType::Q5K => kquants::dequantize_q5_k(src, out),
        DType::Q6K => kquants::dequantize_q6_k(src, out),
        DType::Mxfp4 => mxfp4::dequantize_mxfp4(src, out),
    }
}

/// Little-endian f16 at byte `i`, widened exactly.
#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

#[cfg(test)]
mod tests;

/// Bytes of weights a kernel asks for ahead of the block it reads: the hardware prefetcher
/// alone left the kernels waiting on the weight stream (in-process A/B on SmolLM2 and
/// Qwen2.5-0.5B decode steps, bench/RESULTS.md; 1–4 KiB alike, 512 bytes half the gain).
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 2048;

/// Asks for the cache lines of the `bytes` bytes `PREFETCH_AHEAD` past `p`. Past the end of a
/// row it asks for the next row's blocks, which the same thread usually reads next.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(p: *const u8, bytes: usize) {
    for at in (0..bytes).step_by(64) {
        // SAFETY: a prefetch is a hint; it never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(PREFETCH_AHEAD + at) as *const i8,
            )
        };
    }
}
