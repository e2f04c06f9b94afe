//! Element-wise and per-row ops of a transformer layer, on f32 rows.
//! Weights that a checkpoint stores with an offset (Gemma's `1 + w` norms) are folded in at load
//! time, so these kernels are the plain formulas.

/// `x ← x / rms(x) · w` over each row of `x` (`rows × w.len()`).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_exact_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v *= inv * g;
        }
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

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// Gated MLP activation: `gate ← act(gate) · up`.
pub fn gated_act(gate: &mut [f32], up: &[f32], act: fn(f32) -> f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = act(*g) * u;
    }
}

/// `x ← cap · tanh(x / cap)`.
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
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
}

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

    /// Rotate each `head_dim`-sized head of `x` (one token's heads, concatenated) at `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.dims / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let angle = pos as f32 * f;
                let (s, c) = angle.sin_cos();
                let (s, c) = (s * self.mscale, c * self.mscale);
                let (a, b) = match self.style {
                    RopeStyle::Neox => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
