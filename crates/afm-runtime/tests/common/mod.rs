//! Set-up shared by the GPU test binaries (`cuda_ops`, `cuda_gemv_int8`, `cuda_mmq`,
//! `cuda_mmh`, `cuda_fused`, `cuda_attention_mma`, ...): the one device context per binary,
//! reproducible random data, error measures and poisoned outputs here; random GGML weights and
//! their CPU references in [`weights`]; the int8 matmul tests' activations and references in
//! [`int8`]; the matmul tests' case loops (exact products, gated launches, the automatic path,
//! refusals) in [`matmul`]; attention scenarios run on the CPU and the device over the same KV
//! cache contents in [`attention`].
// Each test binary uses a part of this module.
#![allow(dead_code)]

pub mod attention;
pub mod int8;
pub mod matmul;
pub mod weights;

use std::sync::{Mutex, MutexGuard, OnceLock};

use afm_runtime::cuda::{CudaContext, CudaSlice, DeviceWeight, MatmulPath};

/// The test binary's context on device `AFM_CUDA_DEVICE` (default 0); tests take turns.
pub fn ctx() -> MutexGuard<'static, CudaContext> {
    static CTX: OnceLock<Mutex<CudaContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let ordinal = std::env::var("AFM_CUDA_DEVICE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let c = CudaContext::new(ordinal).unwrap_or_else(|e| panic!("CUDA context: {e}"));
        eprintln!("device: {:?}", c.info());
        Mutex::new(c)
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

/// splitmix64: reproducible data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f32) -> f32 {
        (2.0 * self.unit() - 1.0) * a
    }
    pub fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// The bit patterns of `v`, for tests that two paths give exactly the same floats.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// ‖got − want‖ / ‖want‖ in f64; fails on a non-finite output (unwritten or overflow).
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(
            g.is_finite(),
            "non-finite output {g} (unwritten or overflow)"
        );
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_err(got, want);
    eprintln!("{what}: rel err {e:.2e}");
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

/// A device buffer of NaN, so an output element no kernel wrote fails the comparison.
pub fn poisoned(c: &CudaContext, n: usize) -> CudaSlice<f32> {
    c.upload(&vec![f32::NAN; n]).expect("upload")
}

/// `matmul_many` over the first two, then all three of `ws` (one shared launch; the test fails
/// if it declines) against each matrix alone on `path`: hands `check` each output's
/// description, shared result and single result.
pub fn shared_launch_vs_single(
    c: &mut CudaContext,
    ws: &[DeviceWeight],
    xd: &CudaSlice<f32>,
    n: usize,
    path: MatmulPath,
    check: impl Fn(&str, &[f32], &[f32]),
) {
    for k in [2, 3] {
        let mut outs: Vec<CudaSlice<f32>> =
            ws[..k].iter().map(|w| poisoned(c, n * w.rows())).collect();
        let mut refs: Vec<&mut CudaSlice<f32>> = outs.iter_mut().collect();
        let wrefs: Vec<&DeviceWeight> = ws[..k].iter().collect();
        let shared = c
            .matmul_many(&wrefs, xd, n, &mut refs)
            .expect("matmul_many");
        assert!(
            shared,
            "n={n}, {k} matrices: matmul_many declined the shared launch"
        );
        for (w, o) in ws.iter().zip(&outs) {
            let mut one = poisoned(c, n * w.rows());
            c.matmul_with(path, w, xd, n, &mut one).expect("matmul");
            let got = c.download(o).expect("download");
            let want = c.download(&one).expect("download");
            let what = format!("{:?} {}x{} n={n} of {k}", w.dtype(), w.rows(), w.cols());
            check(&what, &got, &want);
        }
    }
}
