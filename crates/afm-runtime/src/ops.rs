//! Element-wise and per-row ops of a transformer layer, on f32 rows.
//! Weights that a checkpoint stores with an offset (Gemma's `1 + w` norms) are folded in at load
//! time, so these kernels are the plain formulas.

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// `x ← x / rms(x) · w` over each row of `x` (`rows × w.len()`).
///
/// llama.cpp's order of operations, so both engines quantize the same activations: f32
/// squares summed in f64 one after another, the mean rounded to f32, then `(x·inv)·w`. Eight
/// rows' sums run side by side (each still its own sequential chain), so a batch waits on one
/// add's latency per element, not eight.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    const ROWS: usize = 8;
    let d = w.len();
    if d == 0 {
        return;
    }
    let scale = |row: &mut [f32], sum: f64| {
        let ms = (sum / d as f64) as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    };
    let mut groups = x.chunks_exact_mut(ROWS * d);
    for group in &mut groups {
        let mut sums = [0f64; ROWS];
        for i in 0..d {
            for (r, s) in sums.iter_mut().enumerate() {
                let v = group[r * d + i];
                *s += (v * v) as f64;
            }
        }
        for (row, &sum) in group.chunks_exact_mut(d).zip(&sums) {
            scale(row, sum);
        }
    }
    for row in groups.into_remainder().chunks_exact_mut(d) {
        let sum = row.iter().fold(0f64, |s, v| s + (v * v) as f64);
        scale(row, sum);
    }
}

/// Like [`rms_norm`] but writing into `out`, leaving `x` (the residual stream) untouched.
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm(out, w, eps);
}

/// `x += b` for each row.
pub fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        for (v, bb) in row.iter_mut().zip(b) {
            *v += bb;
        }
    }
}

/// `x += y` element-wise.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `x·sigmoid(x)` with llama.cpp's vectorized `expf` ([`expf_llama`]), so SwiGLU matches it
/// bit for bit.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + expf_llama(0.0 - x))
}

/// llama.cpp's AVX2 `ggml_v_expf`, one lane (about 1.5 ulp). Softmax in attention and SiLU
/// use it so afm's activations round like llama.cpp's (docs/DECISIONS.md, "llama.cpp's
/// arithmetic").
#[inline(always)]
pub fn expf_llama(x: f32) -> f32 {
    let fma = |a: f32, b: f32, c: f32| a.mul_add(b, c);
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = fma(x, f32::from_bits(0x3fb8_aa3b), r); // 0x1.715476p+0
    let n = z - r;
    let b = fma(
        -n,
        f32::from_bits(0x35bf_be8e),             // 0x1.7f7d1cp-20
        fma(-n, f32::from_bits(0x3f31_7200), x), // 0x1.62e4p-1
    );
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = fma(
        fma(
            fma(f32::from_bits(0x3c07_2010), b, f32::from_bits(0x3d2b_9f17)), // 0x1.0e4020p-7, 0x1.573e2ep-5
            u,
            fma(f32::from_bits(0x3e2a_af33), b, f32::from_bits(0x3eff_fedb)), // 0x1.555e66p-3, 0x1.fffdb6p-2
        ),
        u,
        f32::from_bits(0x3f7f_fff6) * b, // 0x1.ffffecp-1
    );
    if n.abs() <= 126.0 {
        return fma(k, j, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        fma(s2, j, s2) * s1
    }
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    0.5 * x * (1.0 + tanh(C * (x + 0.044_715 * x * x * x)))
}

/// `eˣ` to about 2 ulp, branch-free so loops over slices vectorize (libm's `expf` is a call
/// per element: in long-prompt attention and GeGLU it was a large share of the time).
/// Inputs are clamped to ±87.3: the result is never inf or a denormal.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5·2²³: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 87.3);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    // Taylor terms to r⁶ on |r| ≤ ln2/2: the truncation error is below 2⁻²⁴.
    let mut p: f32 = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `tanh(x) = sign(x)·(1 − e^{−2|x|}) / (1 + e^{−2|x|})`, through [`exp`].
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let t = exp(-2.0 * x.abs());
    ((1.0 - t) / (1.0 + t)).copysign(x)
}

/// Runs `$body` in a copy compiled for AVX2+FMA where the CPU has them, so the loops over
/// slices vectorize to 8 lanes and `mul_add` (in [`exp`] and [`expf_llama`]) is one
/// instruction rather than a libm call; elsewhere as is. The results are the same: `mul_add`
/// rounds once either way.
macro_rules! fast_path {
    ($name:ident($($arg:ident: $t:ty),*) $body:block) => {{
        #[inline(always)]
        fn body($($arg: $t),*) $body
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $name($($arg: $t),*) {
            body($($arg),*)
        }
        #[cfg(target_arch = "x86_64")]
        if crate::quant::Isa::best() != crate::quant::Isa::Scalar {
            // SAFETY: `Isa::best` detected AVX2 and FMA.
            return unsafe { $name($($arg),*) };
        }
        body($($arg),*)
    }};
}

/// `out[i] = src[i]` widened from f16 (exact). With F16C, eight at a time inline: the `half`
/// crate's slice conversion calls a non-inlined function per eight values, which was ~12% of
/// a decode step at eight sequences (reading the f16 KV cache).
pub fn f16_to_f32(src: &[half::f16], out: &mut [f32]) {
    assert_eq!(src.len(), out.len(), "f16_to_f32: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Isa::best() != crate::quant::Isa::Scalar {
        // SAFETY: `Isa::best` detected AVX2 and F16C; the lengths are equal.
        return unsafe { f16_to_f32_f16c(src, out) };
    }
    for (o, v) in out.iter_mut().zip(src) {
        *o = v.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_to_f32_f16c(src: &[half::f16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    for i in n8..src.len() {
        out[i] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(src[i].to_bits() as i32)));
    }
}

/// Gated MLP activation: `gate ← act(gate) · up`, in the FMA copy where the CPU has one.
///
/// Takes the activation by name, not as a function pointer: comparing `fn` addresses to pick
/// the fast copy missed (an `#[inline(always)]` fn has one address per codegen unit), and
/// SiLU then ran a libm `fmaf` call per `mul_add` (~18% of a Qwen2.5 prefill).
pub fn gated_act(gate: &mut [f32], up: &[f32], act: crate::compute::Activation) {
    use crate::compute::Activation;
    match act {
        Activation::GeluTanh => {
            fast_path!(gated_gelu(gate: &mut [f32], up: &[f32]) { gated(gate, up, gelu_tanh) })
        }
        Activation::Silu => {
            #[cfg(target_arch = "x86_64")]
            if crate::quant::Isa::best() != crate::quant::Isa::Scalar {
                // SAFETY: `Isa::best` detected AVX2 and FMA.
                return unsafe { x86::gated_silu(gate, up) };
            }
            gated(gate, up, silu)
        }
    }
}

#[inline(always)]
fn gated(gate: &mut [f32], up: &[f32], act: impl Fn(f32) -> f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = act(*g) * u;
    }
}

/// `x ← cap · tanh(x / cap)`.
pub fn softcap(x: &mut [f32], cap: f32) {
    fast_path!(softcap_fast(x: &mut [f32], cap: f32) {
        for v in x {
            *v = cap * tanh(*v / cap);
        }
    })
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// How rotary dimensions are paired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (i, i + d/2): HF's `rotate_half` (GPT-NeoX).
    Neox,
    /// Pairs (2i, 2i + 1): GGML's default, used by llama GGUFs whose Q/K rows were permuted.
    Interleaved,
}

/// Rotary embedding tables for one frequency base.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Rotated dimensions (≤ head_dim; partial rotary rotates only the first `dims`).
    dims: usize,
    style: RopeStyle,
    /// Multiplies cos/sin (YaRN-style attention factor); 1 otherwise.
    mscale: f32,
    /// `(base^(−2/dims), 1/linear_factor)` for plain RoPE, whose angles are then made as
    /// llama.cpp makes them (see `apply`); `None` when the frequencies were reshaped.
    ggml: Option<(f32, f32)>,
    /// Each position's `(cos, sin)` pairs, computed on first use: a decode step rotates the
    /// same positions in every layer, and the `sinf`/`cosf` calls were most of the CPU
    /// prologue (~1.2% of an 8-row SmolLM2 step). Positions past the table's length (a few
    /// MiB at most, `ANGLE_CACHE_BYTES`) are computed each time; the values are the same.
    angles: Vec<std::sync::OnceLock<Angles>>,
}

/// One position's `(cos, sin)` per rotated pair.
type Angles = Box<[(f32, f32)]>;

/// The most bytes of cached `(cos, sin)` pairs one `Rope` keeps.
const ANGLE_CACHE_BYTES: usize = 4 << 20;

impl Rope {
    /// `inv_freq[i] = 1 / base^(2i/dims)`, divided by `linear_factor` (position interpolation).
    pub fn new(dims: usize, base: f32, linear_factor: f32, style: RopeStyle) -> Self {
        let inv_freq = (0..dims / 2)
            .map(|i| 1.0 / (base as f64).powf(2.0 * i as f64 / dims as f64) as f32 / linear_factor)
            .collect();
        Self {
            inv_freq,
            dims,
            style,
            mscale: 1.0,
            angles: (0..(ANGLE_CACHE_BYTES / (4 * dims.max(2))).min(1 << 16))
                .map(|_| std::sync::OnceLock::new())
                .collect(),
            ggml: Some((base.powf(-2.0 / dims as f32), 1.0 / linear_factor)),
        }
    }

    /// Gemma 4's "proportional" RoPE: the table spans the whole head (`dims` = head_dim, with
    /// base exponents over head_dim) but only the first `rotated` pairs turn; the remaining
    /// pairs have frequency 0, the identity. So with rotate-half pairing, (i, i + dims/2) for
    /// i < `rotated` rotate, unlike partial RoPE over the first dimensions.
    pub fn proportional(
        dims: usize,
        base: f32,
        factor: f32,
        rotated: usize,
        style: RopeStyle,
    ) -> Self {
        let mut r = Self::new(dims, base, factor, style);
        r.ggml = None;
        r.inv_freq.iter_mut().skip(rotated).for_each(|f| *f = 0.0);
        r
    }

    /// Llama 3's frequency-dependent scaling of long wavelengths.
    pub fn llama3(
        dims: usize,
        base: f32,
        factor: f32,
        low: f32,
        high: f32,
        orig_ctx: f32,
        style: RopeStyle,
    ) -> Self {
        let mut r = Self::new(dims, base, 1.0, style);
        r.ggml = None;
        let low_wavelen = orig_ctx / low;
        let high_wavelen = orig_ctx / high;
        for f in r.inv_freq.iter_mut() {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            if wavelen > low_wavelen {
                *f /= factor;
            } else if wavelen >= high_wavelen {
                let smooth = (orig_ctx / wavelen - low) / (high - low);
                *f = (1.0 - smooth) * *f / factor + smooth * *f;
            }
        }
        r
    }

    /// `(cos, sin)` of each rotated pair at `pos` (see `apply`).
    fn angles_at(&self, pos: usize) -> Vec<(f32, f32)> {
        let half = self.dims / 2;
        let mut cs = Vec::with_capacity(half);
        match self.ggml {
            Some((theta_scale, freq_scale)) => {
                let mut theta = pos as f32;
                for _ in 0..half {
                    let (s, c) = (freq_scale * theta).sin_cos();
                    cs.push((c * self.mscale, s * self.mscale));
                    theta *= theta_scale;
                }
            }
            None => cs.extend(self.inv_freq.iter().map(|f| {
                let (s, c) = (pos as f32 * f).sin_cos();
                (c * self.mscale, s * self.mscale)
            })),
        }
        cs
    }

    /// Rotate each `head_dim`-sized head of `x` (one token's heads, concatenated) at `pos`.
    ///
    /// Plain RoPE reproduces llama.cpp's float operations exactly (`ggml_rope_cache_init`,
    /// `rotate_pairs`): angle `i` is `pos` multiplied `i` times by `base^(−2/dims)` in f32,
    /// then by `1/linear_factor`; libm's `cosf`/`sinf`; the rotation with the FMAs its compiler
    /// forms. Bit-equal rotated queries and keys keep afm's 8-bit activation rounding on
    /// llama.cpp's path (docs/DECISIONS.md).
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        // `mul_add` below is one instruction in the FMA copy, not a libm call per element.
        let this = self;
        fast_path!(rope_fast(this: &Rope, x: &mut [f32], head_dim: usize, pos: usize) {
            this.apply_body(x, head_dim, pos)
        })
    }

    #[inline(always)]
    fn apply_body(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let owned;
        let cs: &[(f32, f32)] = match self.angles.get(pos) {
            Some(cell) => cell.get_or_init(|| self.angles_at(pos).into()),
            None => {
                owned = self.angles_at(pos);
                &owned
            }
        };
        let half = self.dims / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match self.style {
                    RopeStyle::Neox => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0.mul_add(c, -(x1 * s));
                head[b] = x0.mul_add(s, x1 * c);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorizable exp/tanh against the C library's, over the range models feed them.
    #[test]
    fn exp_and_tanh_match_libm() {
        let mut worst = (0f32, 0f32);
        for i in -40_000..=40_000 {
            let x = i as f32 * 2.1e-3;
            let (e, want) = (exp(x), x.exp());
            worst.0 = worst.0.max(((e - want) / want).abs());
            worst.1 = worst.1.max((tanh(x) - x.tanh()).abs());
        }
        assert!(worst.0 < 3e-7, "exp relative error {}", worst.0);
        assert!(worst.1 < 3e-7, "tanh absolute error {}", worst.1);
        assert_eq!(exp(-1e30), exp(-87.3));
        assert!(exp(1e30).is_finite());
        assert_eq!(tanh(0.0), 0.0);
    }

    #[test]
    fn rope_styles_agree_up_to_pairing() {
        let neox = Rope::new(4, 10_000.0, 1.0, RopeStyle::Neox);
        let inter = Rope::new(4, 10_000.0, 1.0, RopeStyle::Interleaved);
        let mut a = vec![1.0, 2.0, 3.0, 4.0]; // pairs (1,3) (2,4)
        let mut b = vec![1.0, 3.0, 2.0, 4.0]; // same pairs, interleaved
        neox.apply(&mut a, 4, 7);
        inter.apply(&mut b, 4, 7);
        assert!((a[0] - b[0]).abs() < 1e-6 && (a[2] - b[1]).abs() < 1e-6);
        assert!((a[1] - b[2]).abs() < 1e-6 && (a[3] - b[3]).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1000.0, 1001.0, 999.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[0] && x[0] > x[2]);
    }

    /// The eight-lane SiLU gate (AVX2) is the scalar one bit for bit, through `expf`'s
    /// ordinary range and both of its far branches (|n| > 126, > 192), and for a tail.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_silu_gate_equals_scalar() {
        if crate::quant::Isa::best() == crate::quant::Isa::Scalar {
            return;
        }
        let gate: Vec<f32> = (-3000..3003).map(|i| i as f32 * 0.071).collect();
        let up: Vec<f32> = (0..gate.len())
            .map(|i| ((i * 37) % 19) as f32 - 9.5)
            .collect();
        let mut want = gate.clone();
        gated(&mut want, &up, silu);
        let mut got = gate.clone();
        // SAFETY: `Isa::best` detected AVX2 and FMA.
        unsafe { x86::gated_silu(&mut got, &up) };
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.to_bits(), g.to_bits(), "x {} : {w} vs {g}", gate[i]);
        }
    }

    /// Norming rows eight at a time gives each row exactly what norming it alone gives.
    #[test]
    fn rms_norm_rows_together_equal_alone() {
        let d = 100;
        let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        let x: Vec<f32> = (0..19 * d)
            .map(|i| ((i * 7919) % 211) as f32 * 0.37 - 40.0)
            .collect();
        let mut together = x.clone();
        rms_norm(&mut together, &w, 1e-6);
        for (r, row) in x.chunks_exact(d).enumerate() {
            let mut alone = row.to_vec();
            rms_norm(&mut alone, &w, 1e-6);
            let same = alone
                .iter()
                .zip(&together[r * d..(r + 1) * d])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "row {r}");
        }
    }
}
