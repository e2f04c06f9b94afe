//! Which dot-product kernel runs for a weight type: the instruction set is detected once at
//! run time, and each type maps to one function for its activation format.

use super::activations::{Q8Rows, Q8kRows};
use super::{float, kquants, legacy};
use crate::DType;
use std::sync::OnceLock;

/// Instruction set a kernel is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust; the reference the SIMD kernels are tested against.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64).
    Avx2,
    /// AVX2 plus AVX-512 F/BW/VL/VNNI, used at 256 bits: the 32-weight formats get
    /// `vpdpbusd` kernels, everything else runs the AVX2 ones.
    Avx512Vnni,
}

impl Isa {
    /// The best instruction set this CPU supports (detected once).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                let vnni = is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni");
                return if vnni { Isa::Avx512Vnni } else { Isa::Avx2 };
            }
            Isa::Scalar
        })
    }

    /// Whether this CPU can run `self`; a kernel asked for an unusable set falls back to scalar.
    pub fn usable(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => Isa::best() != Isa::Scalar,
            Isa::Avx512Vnni => Isa::best() == Isa::Avx512Vnni,
        }
    }

    /// Every instruction set usable here (tests compare them).
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|i| i.usable())
            .collect()
    }

    /// Whether the AVX2 kernels (and the AVX2 activation quantizer) may run.
    pub(super) fn has_avx2(self) -> bool {
        self != Isa::Scalar && self.usable()
    }
}

/// Most activation rows one kernel call handles: each weight block is decoded once and used
/// against up to this many rows.
pub const MAX_TILE: usize = 4;

/// Float weights against f32 activations: `out[j] = w · x[(i0+j)·cols ..][..cols]`.
pub type FloatKernel = fn(w: &[u8], x: &[f32], cols: usize, i0: usize, out: &mut [f32]);
/// 32-weight formats against Q8 rows `i0..i0+out.len()`.
pub type Q8Kernel = fn(w: &[u8], x: &Q8Rows, i0: usize, out: &mut [f32]);
/// K-quants against Q8K rows `i0..i0+out.len()`.
pub type Q8kKernel = fn(w: &[u8], x: &Q8kRows, i0: usize, out: &mut [f32]);

/// One weight row against a tile of 1..=`MAX_TILE` activation rows, by activation format.
#[derive(Clone, Copy)]
pub enum RowKernel {
    Float(FloatKernel),
    Q8(Q8Kernel),
    Q8k(Q8kKernel),
}

impl RowKernel {
    pub fn for_type(dtype: DType, isa: Isa) -> RowKernel {
        #[cfg(target_arch = "x86_64")]
        {
            if isa == Isa::Avx512Vnni && isa.usable() {
                if let Some(k) = vnni(dtype) {
                    return k;
                }
            }
            if isa.has_avx2() {
                if let Some(k) = avx2(dtype) {
                    return k;
                }
            }
        }
        let _ = isa;
        match dtype {
            DType::F32 => RowKernel::Float(float::dot_f32),
            DType::F16 => RowKernel::Float(float::dot_f16),
            DType::BF16 => RowKernel::Float(float::dot_bf16),
            DType::Q4_0 => RowKernel::Q8(legacy::dot_q4_0),
            DType::Q4_1 => RowKernel::Q8(legacy::dot_q4_1),
            DType::Q5_0 => RowKernel::Q8(legacy::dot_q5_0),
            DType::Q5_1 => RowKernel::Q8(legacy::dot_q5_1),
            DType::Q8_0 => RowKernel::Q8(legacy::dot_q8_0),
            DType::Q2K => RowKernel::Q8k(kquants::dot_q2_k),
            DType::Q3K => RowKernel::Q8k(kquants::dot_q3_k),
            DType::Q4K => RowKernel::Q8k(kquants::dot_q4_k),
            DType::Q5K => RowKernel::Q8k(kquants::dot_q5_k),
            DType::Q6K => RowKernel::Q8k(kquants::dot_q6_k),
            DType::Mxfp4 => RowKernel::Float(super::mxfp4::dot_mxfp4),
        }
    }
}

/// AVX-512 VNNI kernels; `None` where the AVX2 one is used.
#[cfg(target_arch = "x86_64")]
fn vnni(dtype: DType) -> Option<RowKernel> {
    use super::{vnni_kquants as k, vnni_legacy as v};
    Some(match dtype {
        DType::Q4_0 => RowKernel::Q8(v::dot_q4_0),
        DType::Q4_1 => RowKernel::Q8(v::dot_q4_1),
        DType::Q5_0 => RowKernel::Q8(v::dot_q5_0),
        DType::Q5_1 => RowKernel::Q8(v::dot_q5_1),
        DType::Q8_0 => RowKernel::Q8(v::dot_q8_0),
        DType::Q4K => RowKernel::Q8k(k::dot_q4_k),
        DType::Q6K => RowKernel::Q8k(k::dot_q6_k),
        _ => return None,
    })
}

/// The eight-rows-in-lanes kernel for `dtype` (`vnni_lanes`), where this CPU and type have one.
#[cfg(target_arch = "x86_64")]
pub(crate) fn lanes_kernel(dtype: DType, isa: Isa) -> Option<super::vnni_lanes::LanesKernel> {
    use super::vnni_lanes as v;
    if isa != Isa::Avx512Vnni || !isa.usable() {
        return None;
    }
    Some(match dtype {
        DType::Q4_0 => v::dot_q4_0,
        DType::Q4_1 => v::dot_q4_1,
        DType::Q5_0 => v::dot_q5_0,
        DType::Q5_1 => v::dot_q5_1,
        DType::Q8_0 => v::dot_q8_0,
        _ => return None,
    })
}

/// The four-rows-in-quads kernel for `dtype` (`vnni_quads`), where this CPU and type have one.
#[cfg(target_arch = "x86_64")]
pub(crate) fn quads_kernel(dtype: DType, isa: Isa) -> Option<super::vnni_quads::QuadsKernel> {
    use super::vnni_quads as v;
    if isa != Isa::Avx512Vnni || !isa.usable() {
        return None;
    }
    Some(match dtype {
        DType::Q4_0 => v::dot_q4_0,
        DType::Q4_1 => v::dot_q4_1,
        DType::Q5_0 => v::dot_q5_0,
        DType::Q5_1 => v::dot_q5_1,
        DType::Q8_0 => v::dot_q8_0,
        _ => return None,
    })
}

/// The K-quant eight-rows-in-lanes kernel for `dtype`, where this CPU and type have one.
#[cfg(target_arch = "x86_64")]
pub(crate) fn k_lanes_kernel(dtype: DType, isa: Isa) -> Option<super::vnni_lanes::KLanesKernel> {
    use super::vnni_lanes as v;
    if isa != Isa::Avx512Vnni || !isa.usable() {
        return None;
    }
    Some(match dtype {
        DType::Q4K => v::dot_q4_k,
        DType::Q6K => v::dot_q6_k,
        _ => return None,
    })
}

/// AVX2 kernels (every type has one).
#[cfg(target_arch = "x86_64")]
fn avx2(dtype: DType) -> Option<RowKernel> {
    use super::{avx2_float as f, avx2_kquants as k, avx2_legacy as l};
    Some(match dtype {
        DType::F32 => RowKernel::Float(f::dot_f32),
        DType::F16 => RowKernel::Float(f::dot_f16),
        DType::BF16 => RowKernel::Float(f::dot_bf16),
        DType::Q4_0 => RowKernel::Q8(l::dot_q4_0),
        DType::Q4_1 => RowKernel::Q8(l::dot_q4_1),
        DType::Q5_0 => RowKernel::Q8(l::dot_q5_0),
        DType::Q5_1 => RowKernel::Q8(l::dot_q5_1),
        DType::Q8_0 => RowKernel::Q8(l::dot_q8_0),
        DType::Q2K => RowKernel::Q8k(k::dot_q2_k),
        DType::Q3K => RowKernel::Q8k(k::dot_q3_k),
        DType::Q4K => RowKernel::Q8k(k::dot_q4_k),
        DType::Q5K => RowKernel::Q8k(k::dot_q5_k),
        DType::Q6K => RowKernel::Q8k(k::dot_q6_k),
        DType::Mxfp4 => RowKernel::Float(super::mxfp4::avx2::dot_mxfp4),
    })
}

/// Runs `$body` with `$nb` bound to the tile size `$n` as a constant, so kernels can keep one
/// accumulator register per activation row.
macro_rules! with_tile {
    ($n:expr, $nb:ident => $body:expr) => {
        match $n {
            1 => {
                const $nb: usize = 1;
                $body
            }
            2 => {
                const $nb: usize = 2;
                $body
            }
            3 => {
                const $nb: usize = 3;
                $body
            }
            4 => {
                const $nb: usize = 4;
                $body
            }
            n => panic!(
                "a kernel tile has 1..={} rows, got {n}",
                $crate::quant::kernel::MAX_TILE
            ),
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use with_tile;
