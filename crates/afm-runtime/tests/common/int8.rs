//! What the int8 matmul tests (`cuda_gemv_int8`, `cuda_mmq`) share: activations with outlier
//! channels, the int8 rounding the kernels apply to them, one matmul on the device, the accuracy
//! check against the CPU's own int8 matmul, and the two gated activations as the kernels compute
//! them.

use afm_runtime::cuda::{DeviceWeight, MatmulPath};
use afm_runtime::DType;

use super::matmul::exact_cases;
use super::{ctx, poisoned, rel_err, Rng};

/// Uniform in ±1 with every 61st column 8× larger: hidden states have outlier channels, which
/// set a block's int8 scale.
pub fn activations(rng: &mut Rng, n: usize, cols: usize) -> Vec<f32> {
    let mut x = rng.vec(n * cols, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        if (i % cols).is_multiple_of(61) {
            *v *= 8.0;
        }
    }
    x
}

/// `x` as the int8 kernels see it: per block of 32, `q = round(x · 127/amax)` (half to even)
/// and `x̂ = (amax/127) · q`.
pub fn int8_rounded(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks_exact(32) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let d = amax / 127.0;
        out.extend(b.iter().map(|&v| d * (v * id).round_ties_even()));
    }
    out
}

/// `x · wᵀ` for `n` rows through `path`, into a NaN-poisoned output.
pub fn gpu_matmul(path: MatmulPath, w: &DeviceWeight, x: &[f32], n: usize) -> Vec<f32> {
    let mut c = ctx();
    let xd = c.upload(x).expect("upload");
    let mut out = poisoned(&c, n * w.rows());
    c.matmul_with(path, w, &xd, n, &mut out).expect("matmul");
    c.download(&out).expect("download")
}

/// `path` on the device is no less accurate than the CPU's own quantized matmul (llama.cpp's
/// Q8/Q8_K activations), both measured against the exact product of the dequantized weights,
/// for each of `dtypes`, `shapes` (rows, cols) and batch sizes `batches`.
pub fn assert_as_accurate_as_the_cpu(
    rng: &mut Rng,
    path: MatmulPath,
    dtypes: &[DType],
    shapes: &[(usize, usize)],
    batches: &[usize],
) {
    // The activations unrounded: the exact product.
    let unrounded = |_: DType, x: &[f32]| x.to_vec();
    exact_cases(
        rng,
        dtypes,
        shapes,
        |_| batches.to_vec(),
        unrounded,
        |case| {
            let (dtype, rows, cols, n) = (case.dtype, case.rows, case.cols, case.n);
            let mut cpu = vec![0f32; n * rows];
            case.host.matmul(case.x, n, &mut cpu);
            let got = case.run(path);
            let (e_gpu, e_cpu) = (rel_err(&got, case.want), rel_err(&cpu, case.want));
            eprintln!(
                "{dtype:?} {rows}x{cols} n={n}: vs exact {path:?} {e_gpu:.2e} cpu {e_cpu:.2e}"
            );
            assert!(
                e_gpu <= 1.1 * e_cpu + 1e-5,
                "{dtype:?} {rows}x{cols} n={n}: {path:?} error {e_gpu:.3e} > CPU's {e_cpu:.3e}"
            );
        },
    );
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh form, as elementwise.cu's gated_act.
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())
}
