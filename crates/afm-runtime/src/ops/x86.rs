//! Eight-lane AVX2 copies of llama.cpp's vectorized activations, for the hot loops that
//! must round exactly as llama.cpp does (its `ggml_v_expf` and `ggml_v_silu`): each lane
//! runs the same operations as the scalar [`super::expf_llama`] / [`super::silu`].

use std::arch::x86_64::*;

/// llama.cpp's AVX2 `ggml_v_expf`: eight lanes of `ops::expf_llama`, the same operations.
#[inline(always)]
pub(crate) unsafe fn expf(x: __m256) -> __m256 {
    let c = |b: u32| _mm256_set1_ps(f32::from_bits(b));
    let r = c(0x4b40_0000);
    let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(
        e,
        _mm256_castps_si256(_mm256_set1_ps(1.0)),
    ));
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        ),
        u,
        _mm256_mul_ps(c(0x3f7f_fff6), b),
    );
    let normal = _mm256_fmadd_ps(j, k, k);
    if _mm256_movemask_ps(big) == 0 {
        return normal;
    }
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let huge = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    let scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
    let mid = _mm256_blendv_ps(normal, scaled, big);
    _mm256_blendv_ps(mid, _mm256_mul_ps(s1, s1), huge)
}

/// `gate ← silu(gate) · up` (`ggml_v_silu`: `x / (1 + exp(0 − x))`), eight at a time; the
/// tail in the scalar copy, which computes the same.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gated_silu(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let whole = n / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    for i in (0..whole).step_by(8) {
        let x = _mm256_loadu_ps(gate.as_ptr().add(i));
        let e = expf(_mm256_sub_ps(_mm256_setzero_ps(), x));
        let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        let u = _mm256_loadu_ps(up.as_ptr().add(i));
        _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
    }
    for i in whole..n {
        gate[i] = super::silu(gate[i]) * up[i];
    }
}
