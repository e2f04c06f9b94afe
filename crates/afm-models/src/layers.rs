//! Building blocks shared by the architecture files: projections, norms, embeddings, gated MLPs
//! and RoPE, each bound to the model's [`Device`] at load and run through it. The attention step
//! over the engine's paged cache is [`Device::attention`].

use afm_runtime::compute::{Activation, ComputeError, Device, Rotary, Tensor, Vector, Weight};
use afm_runtime::ops::{Rope, RopeStyle};

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::ModelError;

type Result<T> = std::result::Result<T, ComputeError>;

fn placed<T>(name: &str, r: Result<T>) -> std::result::Result<T, ModelError> {
    r.map_err(|source| ModelError::Device {
        name: name.to_string(),
        source,
    })
}

/// A `[rows, cols]` matrix of the checkpoint, shape checked, on `dev`.
pub fn matrix(
    ck: &Checkpoint,
    dev: &Device,
    name: &str,
    n: NormNaming,
    rows: usize,
    cols: usize,
) -> std::result::Result<Weight, ModelError> {
    placed(name, dev.weight(ck.matrix(name, n, rows, cols)?))
}

/// `y = x·Wᵀ (+ b)`.
pub struct Linear {
    pub w: Weight,
    pub b: Option<Vector>,
}

impl Linear {
    pub fn load(
        ck: &Checkpoint,
        dev: &Device,
        name: &str,
        n: NormNaming,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> std::result::Result<Self, ModelError> {
        let [l] = Self::load_joined(ck, dev, [(name, out)], n, inp, bias)?;
        Ok(l)
    }

    /// Projections of one input (`names` with their output sizes), their weights placed side
    /// by side where the device can multiply them as one ([`Device::weights_joined`]).
    pub fn load_joined<const K: usize>(
        ck: &Checkpoint,
        dev: &Device,
        names: [(&str, usize); K],
        n: NormNaming,
        inp: usize,
        bias: bool,
    ) -> std::result::Result<[Self; K], ModelError> {
        let mats = names
            .iter()
            .map(|&(name, out)| ck.matrix(&format!("{name}.weight"), n, out, inp))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let first = names.first().map_or("", |(nm, _)| nm);
        let ws = placed(&format!("{first}.weight"), dev.weights_joined(mats))?;
        let got = ws.len();
        let all = names
            .iter()
            .zip(ws)
            .map(|(&(name, out), w)| {
                let b = if bias {
                    let bn = format!("{name}.bias");
                    Some(placed(&bn, dev.vector(ck.vector(&bn, n, out)?))?)
                } else {
                    None
                };
                Ok(Self { w, b })
            })
            .collect::<std::result::Result<Vec<_>, ModelError>>()?;
        all.try_into().map_err(|_| ModelError::Config {
            key: first.to_string(),
            reason: format!("the device placed {got} of {K} joined matrices"),
        })
    }

    /// `x` is `[rows][in]`; returns `[rows][out]`.
    pub fn forward(&self, dev: &Device, x: &Tensor) -> Result<Tensor> {
        dev.linear(x, &self.w, self.b.as_ref())
    }
}

pub struct RmsNorm {
    pub w: Vector,
    pub eps: f32,
}

impl RmsNorm {
    /// `offset` is added to the stored weight: Gemma's HF checkpoints store `w` and compute
    /// `x·(1 + w)`, while llama.cpp's GGUF conversion already stores `1 + w`.
    pub fn load(
        ck: &Checkpoint,
        dev: &Device,
        name: &str,
        n: NormNaming,
        len: usize,
        eps: f32,
        offset: f32,
    ) -> std::result::Result<Self, ModelError> {
        let name = format!("{name}.weight");
        let mut w = ck.vector(&name, n, len)?;
        w.iter_mut().for_each(|v| *v += offset);
        Ok(Self {
            w: placed(&name, dev.vector(w))?,
            eps,
        })
    }

    pub fn forward(&self, dev: &Device, x: &Tensor) -> Result<Tensor> {
        dev.rms_norm(x, &self.w, self.eps)
    }

    pub fn forward_inplace(&self, dev: &Device, x: &mut Tensor) -> Result<()> {
        dev.rms_norm_in_place(x, &self.w, self.eps)
    }
}

/// Token embeddings, optionally scaled (Gemma multiplies by √hidden).
pub struct Embedding {
    pub table: Weight,
    pub scale: f32,
}

impl Embedding {
    pub fn forward(&self, dev: &Device, tokens: &[u32]) -> Result<Tensor> {
        dev.embed(&self.table, tokens, self.scale)
    }
}

/// `down(act(gate(x)) · up(x))`.
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub act: Activation,
}

impl GatedMlp {
    pub fn load(
        ck: &Checkpoint,
        dev: &Device,
        prefix: &str,
        n: NormNaming,
        hidden: usize,
        inter: usize,
        act: Activation,
    ) -> std::result::Result<Self, ModelError> {
        let (g, u) = (format!("{prefix}.gate_proj"), format!("{prefix}.up_proj"));
        let names = [(g.as_str(), inter), (u.as_str(), inter)];
        let [gate, up] = Linear::load_joined(ck, dev, names, n, hidden, false)?;
        let down = Linear::load(
            ck,
            dev,
            &format!("{prefix}.down_proj"),
            n,
            hidden,
            inter,
            false,
        )?;
        Ok(Self {
            gate,
            up,
            down,
            act,
        })
    }

    pub fn forward(&self, dev: &Device, x: &Tensor) -> Result<Tensor> {
        let g = self.gated(dev, x)?;
        self.down.forward(dev, &g)
    }

    /// `x += forward(norm(x))`: the MLP sub-layer with its pre-norm and residual add, each
    /// folded into a product's launches where the device can (a GPU's decode GEMVs).
    pub fn forward_residual(&self, dev: &Device, norm: &RmsNorm, x: &mut Tensor) -> Result<()> {
        let (gate, up, down) = (&self.gate, &self.up, &self.down);
        if gate.b.is_none() && up.b.is_none() && down.b.is_none() {
            let (n, eps) = (&norm.w, norm.eps);
            return dev.norm_gated_mlp_add(x, n, eps, &gate.w, &up.w, &down.w, self.act);
        }
        let g = if self.gate.b.is_none() && self.up.b.is_none() {
            dev.norm_gated_linear(x, &norm.w, norm.eps, &self.gate.w, &self.up.w, self.act)?
        } else {
            self.gated(dev, &norm.forward(dev, x)?)?
        };
        dev.linear_add(&g, &self.down.w, self.down.b.as_ref(), x)
    }

    /// `act(gate(x)) · up(x)`.
    fn gated(&self, dev: &Device, x: &Tensor) -> Result<Tensor> {
        if self.gate.b.is_none() && self.up.b.is_none() {
            // Gate, up and activation in one launch where the device can.
            return dev.gated_linear(x, &self.gate.w, &self.up.w, self.act);
        }
        let mut g = self.gate.forward(dev, x)?;
        let u = self.up.forward(dev, x)?;
        dev.gated_act(self.act, &mut g, &u)?;
        Ok(g)
    }
}

/// RoPE over whole heads of `head_dim`, placed on `dev` for positions below `max_pos`.
pub fn rotary(
    dev: &Device,
    rope: Rope,
    head_dim: usize,
    style: RopeStyle,
    max_pos: usize,
) -> std::result::Result<Rotary, ModelError> {
    placed("rotary table", dev.rotary(rope, head_dim, style, max_pos))
}
