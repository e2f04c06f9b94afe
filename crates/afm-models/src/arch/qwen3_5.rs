//! `qwen3_5` / `qwen3_5_text` (dense) and `qwen3_5_moe` / `qwen3_5_moe_text` (Qwen3.5 and
//! Qwen3.6): a hybrid of Gated DeltaNet linear-attention layers and gated full-attention layers
//! (by default 3 : 1), pre-norm blocks with zero-centred RMSNorm (`x · (1 + w)`), and a SwiGLU
//! MLP or a sparse MoE (`qwen3_5_moe.rs`). The `mtp.*` head is loaded into [`Mtp`] for
//! speculative decoding; it takes no part in `forward`.
//!
//! ```text
//! full attention:  q_proj → per head [q | gate]; q_norm, k_norm (1 + w); RoPE on the first
//!                  `partial_rotary_factor · head_dim` dims (NeoX pairs); attn · σ(gate) → o_proj
//! Gated DeltaNet:  in_proj_qkv → causal depthwise conv (kernel K, rolling window) → SiLU
//!                  → q, k (L2-normed, q / √Dk), v;  β = σ(b), g = −exp(A_log) · softplus(a + dt_bias)
//!                  per value head:  S ← S·eᵍ;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq
//!                  o → RMSNorm · w · SiLU(z) → out_proj
//! ```
//!
//! Models hold weights only: each DeltaNet layer's conv window and state matrix live in the
//! engine's [`StatePool`], in the slot each sequence names (`SeqChunk::state_slot`). The
//! recurrence runs token by token for prefill and decode alike, so chunking cannot change the
//! result; the per-token cost (heads · Dk · Dv) is small beside the projections.
//!
//! Text-only input makes the multimodal RoPE (mrope) plain 1-D RoPE, which is what this runs.
//!
//! A GGUF (`qwen35`, `qwen35moe`, as llama.cpp's converter writes it) feeds the same model:
//! [`adjust_gguf_config`] restates its metadata as the HF keys, [`gguf_name`] maps the names,
//! and three of the converter's value changes are taken as stored: norms hold `1 + w` (all but
//! the DeltaNet's gated norm), `ssm_a` holds `−exp(A_log)`, and the value heads are in tiled
//! order (head `h` reads key head `h mod k_heads`, not `h / (v_heads / k_heads)`), consistently
//! across `attn_gate`, `ssm_alpha`/`ssm_beta`, `ssm_a`, `ssm_dt`, the conv's v channels and
//! `ssm_out`'s columns, so only the key-head lookup changes.

use afm_runtime::attention::AttnParams;
use afm_runtime::compute::{
    Activation, ComputeError, Device, KvPool, LayerStateShape, Rotary, StatePool, Step, Tensor,
};
use afm_runtime::kv_store::LayerKvShape;
use afm_runtime::ops::{Rope, RopeStyle};
use rayon::prelude::*;
use serde_json::Value;

use super::qwen3_5_moe::{MoeShape, SparseMoe};
use crate::checkpoint::{Checkpoint, NormNaming};
use crate::config::TransformerConfig;
use crate::forward::{CausalLm, ForwardBatch};
use crate::layers::{matrix, rotary, Embedding, GatedMlp, Linear, RmsNorm};
use crate::ModelError;

#[path = "qwen3_5_gguf.rs"]
mod gguf;
use gguf::GGUF_MISSING;
pub use gguf::{adjust_gguf_config, gguf_name};

const N: NormNaming = NormNaming::Llama;

/// What Qwen3.5 adds to [`TransformerConfig`], read from the HF text config.
#[derive(Debug, Clone)]
pub struct Qwen35Config {
    /// Per layer: full attention (else Gated DeltaNet).
    pub full_attention: Vec<bool>,
    pub rotary_dims: usize,
    pub conv_kernel: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub moe: Option<MoeShape>,
    /// Value heads in llama.cpp's tiled order (GGUF): head `h` uses key head `h mod k_heads`.
    pub v_tiled: bool,
}

fn cfg_err(key: &str, reason: String) -> ModelError {
    ModelError::Config {
        key: key.into(),
        reason,
    }
}

fn num(j: &Value, key: &str, default: Option<usize>) -> Result<usize, ModelError> {
    match j.get(key).filter(|v| !v.is_null()) {
        Some(v) => v
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| cfg_err(key, format!("{v} is not a non-negative integer"))),
        None => default.ok_or_else(|| cfg_err(key, "missing".into())),
    }
}

impl Qwen35Config {
    pub fn from_hf(cfg: &TransformerConfig) -> Result<Self, ModelError> {
        let j = &cfg.raw;
        if !j.is_object() {
            return Err(cfg_err(
                "config",
                "Qwen3.5 needs its HF config.json or a qwen35/qwen35moe GGUF".into(),
            ));
        }
        if let Some(missing) = j.get(GGUF_MISSING).and_then(Value::as_array) {
            if !missing.is_empty() {
                let keys: Vec<&str> = missing.iter().filter_map(Value::as_str).collect();
                return Err(cfg_err(
                    "GGUF metadata",
                    format!("missing {} (a qwen35 GGUF has them)", keys.join(", ")),
                ));
            }
        }
        let full_attention = match j.get("layer_types").and_then(Value::as_array) {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(true),
                    Some("linear_attention") => Ok(false),
                    _ => Err(cfg_err(
                        "layer_types",
                        format!("{t} is neither full_attention nor linear_attention"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let every = num(j, "full_attention_interval", Some(4))?.max(1);
                (0..cfg.num_layers).map(|i| (i + 1) % every == 0).collect()
            }
        };
        if full_attention.len() != cfg.num_layers {
            return Err(cfg_err(
                "layer_types",
                format!(
                    "{} entries for {} layers",
                    full_attention.len(),
                    cfg.num_layers
                ),
            ));
        }
        let factor = j
            .get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor"))
            .or_else(|| j.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .unwrap_or(0.25);
        let rotary_dims = (cfg.head_dim as f64 * factor).round() as usize;
        if rotary_dims == 0 || !rotary_dims.is_multiple_of(2) || rotary_dims > cfg.head_dim {
            return Err(cfg_err(
                "partial_rotary_factor",
                format!(
                    "{factor} × head_dim {} is not an even width ≤ head_dim",
                    cfg.head_dim
                ),
            ));
        }
        let k_heads = num(j, "linear_num_key_heads", Some(16))?;
        let v_heads = num(j, "linear_num_value_heads", Some(32))?;
        if k_heads == 0 || v_heads % k_heads != 0 {
            return Err(cfg_err(
                "linear_num_value_heads",
                format!("{v_heads} is not a multiple of linear_num_key_heads {k_heads}"),
            ));
        }
        let moe = match num(j, "num_experts", Some(0))? {
            0 => None,
            e => Some(MoeShape {
                num_experts: e,
                top_k: num(j, "num_experts_per_tok", None)?.clamp(1, e),
                expert_inter: num(j, "moe_intermediate_size", None)?,
                shared_inter: num(j, "shared_expert_intermediate_size", None)?,
            }),
        };
        Ok(Self {
            full_attention,
            rotary_dims,
            conv_kernel: num(j, "linear_conv_kernel_dim", Some(4))?.max(1),
            k_heads,
            v_heads,
            k_dim: num(j, "linear_key_head_dim", Some(128))?,
            v_dim: num(j, "linear_value_head_dim", Some(128))?,
            moe,
            v_tiled: false,
        })
    }

    /// The key head value head `h` reads.
    fn key_head(&self, h: usize) -> usize {
        if self.v_tiled {
            h % self.k_heads
        } else {
            h / (self.v_heads / self.k_heads)
        }
    }

    fn key_width(&self) -> usize {
        self.k_heads * self.k_dim
    }

    fn value_width(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// Channels of the convolution: q, k and v side by side.
    fn conv_dim(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    fn state_shape(&self) -> LayerStateShape {
        LayerStateShape {
            conv: (self.conv_kernel - 1) * self.conv_dim(),
            ssm: self.v_heads * self.k_dim * self.v_dim,
        }
    }
}

/// Gated full attention; `kv_layer` is its layer in the KV pool (full-attention layers only).
struct GatedAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    kv_layer: usize,
}

/// Gated DeltaNet; `state_layer` is its layer in the [`StatePool`].
struct DeltaNet {
    in_qkv: Linear,
    in_z: Linear,
    in_b: Linear,
    in_a: Linear,
    /// `[conv_dim][K]`, host memory: the recurrence runs on the host.
    conv: Vec<f32>,
    /// `−exp(A_log)` per value head.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    /// Gated RMSNorm weight (used as `w`, not `1 + w`), one value head wide.
    norm: Vec<f32>,
    out: Linear,
    state_layer: usize,
}

enum Mixer {
    Full(GatedAttention),
    Linear(DeltaNet),
}

// One per layer, built once at load: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Ffn {
    Dense(GatedMlp),
    Moe(SparseMoe),
}

struct Block {
    input_norm: RmsNorm,
    mixer: Mixer,
    post_norm: RmsNorm,
    ffn: Ffn,
}

/// The multi-token-prediction head (`mtp.*`): `fc(cat(norm_e(embed(x_{t+1})), norm_h(h_t)))`,
/// full-attention decoder layers, a final norm; embeddings and `lm_head` are the model's.
/// Loaded for a later `--mtp`; its attention layers would need their own KV layers.
pub struct Mtp {
    pub fc: Linear,
    pub pre_fc_norm_embedding: RmsNorm,
    pub pre_fc_norm_hidden: RmsNorm,
    pub norm: RmsNorm,
    pub num_layers: usize,
    #[allow(dead_code)] // run by the MTP drafter, not yet written
    layers: Vec<Block>,
}

pub struct Qwen35 {
    cfg: TransformerConfig,
    q: Qwen35Config,
    dev: Device,
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rotary,
    mtp: Option<Mtp>,
}

struct Loader<'a> {
    ck: &'a Checkpoint<'a>,
    cfg: &'a TransformerConfig,
    q: &'a Qwen35Config,
    dev: &'a Device,
}

impl Loader<'_> {
    /// The checkpoint's name for an HF name.
    fn name(&self, hf: &str) -> String {
        match self.ck.is_gguf() {
            true => gguf_name(hf, self.cfg.num_layers),
            false => hf.to_string(),
        }
    }

    /// Zero-centred RMSNorm: the checkpoint stores `w`, the model multiplies by `1 + w`
    /// (a GGUF stores `1 + w` already).
    fn norm(&self, name: &str, len: usize) -> Result<RmsNorm, ModelError> {
        let offset = if self.ck.is_gguf() { 0.0 } else { 1.0 };
        let (ck, dev, eps) = (self.ck, self.dev, self.cfg.rms_eps);
        RmsNorm::load(ck, dev, &self.name(name), N, len, eps, offset)
    }

    fn lin(&self, name: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
        Linear::load(self.ck, self.dev, &self.name(name), N, out, inp, false)
    }

    fn has(&self, name: &str) -> bool {
        self.ck.has(&self.name(name), N)
    }

    fn attention(&self, p: &str, kv_layer: usize) -> Result<GatedAttention, ModelError> {
        let (h, hd, c) = (self.cfg.hidden_size, self.cfg.head_dim, self.cfg);
        Ok(GatedAttention {
            q: self.lin(&format!("{p}.q_proj"), 2 * c.num_heads * hd, h)?,
            k: self.lin(&format!("{p}.k_proj"), c.num_kv_heads * hd, h)?,
            v: self.lin(&format!("{p}.v_proj"), c.num_kv_heads * hd, h)?,
            o: self.lin(&format!("{p}.o_proj"), h, c.num_heads * hd)?,
            q_norm: self.norm(&format!("{p}.q_norm"), hd)?,
            k_norm: self.norm(&format!("{p}.k_norm"), hd)?,
            kv_layer,
        })
    }

    fn delta_net(&self, p: &str, state_layer: usize) -> Result<DeltaNet, ModelError> {
        let (h, q) = (self.cfg.hidden_size, self.q);
        let vec = |m: &str, len: usize| self.ck.vector(&self.name(&format!("{p}.{m}")), N, len);
        let conv_name = self.name(&format!("{p}.conv1d.weight"));
        let view = self.ck.view(&conv_name, N)?;
        let want = vec![q.conv_dim(), 1, q.conv_kernel];
        if view.shape != want && view.shape != [q.conv_dim(), q.conv_kernel] {
            return Err(ModelError::Shape {
                name: view.name,
                want,
                got: view.shape,
            });
        }
        Ok(DeltaNet {
            in_qkv: self.lin(&format!("{p}.in_proj_qkv"), q.conv_dim(), h)?,
            in_z: self.lin(&format!("{p}.in_proj_z"), q.value_width(), h)?,
            in_b: self.lin(&format!("{p}.in_proj_b"), q.v_heads, h)?,
            in_a: self.lin(&format!("{p}.in_proj_a"), q.v_heads, h)?,
            conv: view.to_f32()?,
            // llama.cpp's converter stores −exp(A_log) itself.
            neg_a: match self.ck.is_gguf() {
                true => vec("A_log", q.v_heads)?,
                false => vec("A_log", q.v_heads)?.iter().map(|a| -a.exp()).collect(),
            },
            dt_bias: vec("dt_bias", q.v_heads)?,
            norm: vec("norm.weight", q.v_dim)?,
            out: self.lin(&format!("{p}.out_proj"), h, q.value_width())?,
            state_layer,
        })
    }

    fn ffn(&self, p: &str) -> Result<Ffn, ModelError> {
        let h = self.cfg.hidden_size;
        let inter = self.cfg.intermediate_size;
        Ok(match self.q.moe {
            Some(s) => {
                let name = |hf: &str| self.name(hf);
                Ffn::Moe(SparseMoe::load(self.ck, self.dev, p, &name, h, s)?)
            }
            None => Ffn::Dense(GatedMlp {
                gate: self.lin(&format!("{p}.gate_proj"), inter, h)?,
                up: self.lin(&format!("{p}.up_proj"), inter, h)?,
                down: self.lin(&format!("{p}.down_proj"), h, inter)?,
                act: Activation::Silu,
            }),
        })
    }

    fn block(&self, p: &str, mixer: Mixer) -> Result<Block, ModelError> {
        let h = self.cfg.hidden_size;
        Ok(Block {
            input_norm: self.norm(&format!("{p}.input_layernorm"), h)?,
            mixer,
            post_norm: self.norm(&format!("{p}.post_attention_layernorm"), h)?,
            ffn: self.ffn(&format!("{p}.mlp"))?,
        })
    }

    /// `first_kv` is the KV layer its first attention layer would use (after the model's).
    /// `mtp.*` sits beside `model.` (or `model.language_model.`), so `self.ck` is unprefixed.
    fn mtp(&self, first_kv: usize) -> Result<Option<Mtp>, ModelError> {
        if !self.has("mtp.fc.weight") {
            return Ok(None);
        }
        let h = self.cfg.hidden_size;
        let mut layers = Vec::new();
        while self.has(&format!(
            "mtp.layers.{}.input_layernorm.weight",
            layers.len()
        )) {
            let p = format!("mtp.layers.{}", layers.len());
            let attn = self.attention(&format!("{p}.self_attn"), first_kv + layers.len())?;
            layers.push(self.block(&p, Mixer::Full(attn))?);
        }
        Ok(Some(Mtp {
            fc: self.lin("mtp.fc", h, 2 * h)?,
            pre_fc_norm_embedding: self.norm("mtp.pre_fc_norm_embedding", h)?,
            pre_fc_norm_hidden: self.norm("mtp.pre_fc_norm_hidden", h)?,
            norm: self.norm("mtp.norm", h)?,
            num_layers: layers.len(),
            layers,
        }))
    }
}

impl Qwen35 {
    pub fn load(
        ck: &Checkpoint,
        cfg: &TransformerConfig,
        dev: &Device,
    ) -> Result<Self, ModelError> {
        let mut q = Qwen35Config::from_hf(cfg)?;
        q.v_tiled = ck.is_gguf();
        let l = Loader {
            ck,
            cfg,
            q: &q,
            dev,
        };
        let h = cfg.hidden_size;
        let table = matrix(
            ck,
            dev,
            &l.name("embed_tokens.weight"),
            N,
            cfg.vocab_size,
            h,
        )?;
        let lm_head = if l.has("lm_head.weight") {
            l.lin("lm_head", cfg.vocab_size, h)?
        } else {
            Linear {
                w: table.clone(),
                b: None,
            }
        };
        let (mut kv_layers, mut state_layers) = (0, 0);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (i, &full) in q.full_attention.iter().enumerate() {
            let p = format!("layers.{i}");
            let mixer = if full {
                kv_layers += 1;
                Mixer::Full(l.attention(&format!("{p}.self_attn"), kv_layers - 1)?)
            } else {
                state_layers += 1;
                Mixer::Linear(l.delta_net(&format!("{p}.linear_attn"), state_layers - 1)?)
            };
            layers.push(l.block(&p, mixer)?);
        }
        let style = RopeStyle::Neox;
        let rope = Rope::new(q.rotary_dims, cfg.rope_theta, 1.0, style);
        Ok(Self {
            embed: Embedding { table, scale: 1.0 },
            layers,
            norm: l.norm("norm", h)?,
            lm_head,
            rope: rotary(dev, rope, q.rotary_dims, style, cfg.max_position)?,
            mtp: Loader {
                ck: &ck.unprefixed(),
                ..l
            }
            .mtp(kv_layers)?,
            dev: dev.clone(),
            cfg: cfg.clone(),
            q,
        })
    }

    /// The multi-token-prediction head, where the checkpoint has one.
    pub fn mtp(&self) -> Option<&Mtp> {
        self.mtp.as_ref()
    }

    fn attention(
        &self,
        a: &GatedAttention,
        x: &Tensor,
        kv: &mut KvPool,
        step: &Step,
    ) -> Result<Tensor, ComputeError> {
        let (dev, hd, nh) = (&self.dev, self.cfg.head_dim, self.cfg.num_heads);
        let qg = a.q.forward(dev, x)?;
        let rows = x.rows();
        // Each head's projection is [q_h | gate_h].
        let half = |op, second: usize| {
            dev.host_compute(op, &[&qg], rows, nh * hd, |v| {
                Ok(v[0]
                    .chunks_exact(2 * hd)
                    .flat_map(|head| head[second * hd..(second + 1) * hd].iter().copied())
                    .collect())
            })
        };
        let mut q = half("split attention query", 0)?;
        let gate = half("split attention gate", 1)?;
        let mut k = a.k.forward(dev, x)?;
        let v = a.v.forward(dev, x)?;
        a.q_norm.forward_inplace(dev, &mut q)?;
        a.k_norm.forward_inplace(dev, &mut k)?;
        dev.rope(&self.rope, &mut q, hd, step)?;
        dev.rope(&self.rope, &mut k, hd, step)?;
        let params = AttnParams::scaled(nh, hd);
        let o = dev.attention(kv, a.kv_layer, step, &q, &k, &v, &params)?;
        let o = dev.host_compute("attention output gate", &[&o, &gate], rows, nh * hd, |v| {
            Ok(v[0]
                .iter()
                .zip(v[1])
                .map(|(o, g)| o * sigmoid(*g))
                .collect())
        })?;
        a.o.forward(dev, &o)
    }

    fn delta_net(
        &self,
        d: &DeltaNet,
        x: &Tensor,
        batch: &ForwardBatch,
        slots: &[u32],
        states: &mut StatePool,
    ) -> Result<Tensor, ComputeError> {
        let dev = &self.dev;
        let qkv = d.in_qkv.forward(dev, x)?;
        let z = d.in_z.forward(dev, x)?;
        let b = d.in_b.forward(dev, x)?;
        let a = d.in_a.forward(dev, x)?;
        let width = self.q.value_width();
        let o = dev.host_compute(
            "gated delta rule",
            &[&qkv, &z, &b, &a],
            x.rows(),
            width,
            |v| {
                let mut out = vec![0f32; x.rows() * width];
                let mut row0 = 0;
                for (s, &slot) in batch.seqs.iter().zip(slots) {
                    let rows = row0..row0 + s.len;
                    let (conv, ssm) = states.layer_mut(slot, d.state_layer)?;
                    let io = DeltaIo {
                        qkv: &v[0][rows.start * self.q.conv_dim()..rows.end * self.q.conv_dim()],
                        z: &v[1][rows.start * width..rows.end * width],
                        b: &v[2][rows.start * self.q.v_heads..rows.end * self.q.v_heads],
                        a: &v[3][rows.start * self.q.v_heads..rows.end * self.q.v_heads],
                        out: &mut out[rows.start * width..rows.end * width],
                    };
                    delta_rule(&self.q, d, self.cfg.rms_eps, io, conv, ssm);
                    row0 += s.len;
                }
                Ok(out)
            },
        )?;
        d.out.forward(dev, &o)
    }

    /// The slot of every sequence, each checked to hold exactly the tokens before its chunk
    /// (a chunk at position 0 starts from a zeroed slot).
    fn claim_slots(batch: &ForwardBatch, states: &mut StatePool) -> Result<Vec<u32>, ComputeError> {
        let mut slots = Vec::with_capacity(batch.seqs.len());
        for s in batch.seqs {
            let slot = s.state_slot.ok_or(ComputeError::Unsupported {
                what: "sequence without a state slot",
                value: format!("pos0 {}", s.pos0),
                device: "a Qwen3.5 model".into(),
                supported: "one state slot per sequence (SeqChunk::state_slot)",
            })?;
            if slots.contains(&slot) {
                return Err(ComputeError::Shape {
                    what: "state slot used by two sequences of one step",
                    got: slot as usize,
                    want: states.num_slots(),
                });
            }
            if s.pos0 == 0 {
                states.reset(slot)?;
            }
            let seen = states.seen(slot)?;
            if seen != s.pos0 {
                return Err(ComputeError::Shape {
                    what: "tokens held by the state slot (the chunk's first position)",
                    got: seen,
                    want: s.pos0,
                });
            }
            slots.push(slot);
        }
        Ok(slots)
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// PyTorch's softplus (beta 1, linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One sequence's rows of one DeltaNet layer.
struct DeltaIo<'a> {
    qkv: &'a [f32],
    z: &'a [f32],
    b: &'a [f32],
    a: &'a [f32],
    out: &'a mut [f32],
}

/// Runs one sequence's new rows through the convolution and the gated delta rule, updating its
/// state (`conv`: the last K−1 inputs, oldest first; `ssm`: `[v_heads][k_dim][v_dim]`), and
/// writes the gated-normed output per value head. The convolution walks the rows in order (its
/// window rolls); the value heads then run in parallel, each over its own state.
fn delta_rule(
    q: &Qwen35Config,
    d: &DeltaNet,
    eps: f32,
    io: DeltaIo,
    conv: &mut [f32],
    ssm: &mut [f32],
) {
    let (c, kk) = (q.conv_dim(), q.conv_kernel);
    let (kd, vd, kw, width) = (q.k_dim, q.v_dim, q.key_width(), q.value_width());
    let rows = io.qkv.len() / c;
    let mut mixed = vec![0f32; rows * c];
    for (x, m) in io.qkv.chunks_exact(c).zip(mixed.chunks_exact_mut(c)) {
        for (ch, m) in m.iter_mut().enumerate() {
            let w = &d.conv[ch * kk..(ch + 1) * kk];
            let mut acc = w[kk - 1] * x[ch];
            for (j, wj) in w[..kk - 1].iter().enumerate() {
                acc += wj * conv[j * c + ch];
            }
            *m = silu(acc);
        }
        if kk > 1 {
            conv.copy_within(c.., 0);
            conv[(kk - 2) * c..].copy_from_slice(x);
        }
        let (qs, ks) = m.split_at_mut(kw);
        for head in qs.chunks_exact_mut(kd) {
            l2_normalize(head, 1.0 / (kd as f32).sqrt());
        }
        for head in ks[..kw].chunks_exact_mut(kd) {
            l2_normalize(head, 1.0);
        }
    }
    let per_head: Vec<Vec<f32>> = ssm
        .par_chunks_mut(kd * vd)
        .enumerate()
        .map(|(h, s)| {
            let kh = q.key_head(h);
            let mut out = vec![0f32; rows * vd];
            let mut delta = vec![0f32; vd];
            for (t, o) in out.chunks_exact_mut(vd).enumerate() {
                let m = &mixed[t * c..(t + 1) * c];
                let qh = &m[kh * kd..(kh + 1) * kd];
                let kv = &m[kw + kh * kd..kw + (kh + 1) * kd];
                let vh = &m[2 * kw + h * vd..2 * kw + (h + 1) * vd];
                let at = t * q.v_heads + h;
                let decay = (d.neg_a[h] * softplus(io.a[at] + d.dt_bias[h])).exp();
                let beta = sigmoid(io.b[at]);
                s.iter_mut().for_each(|x| *x *= decay);
                delta.fill(0.0);
                for (srow, &k) in s.chunks_exact(vd).zip(kv) {
                    for (m, sv) in delta.iter_mut().zip(srow) {
                        *m += sv * k;
                    }
                }
                for (m, &v) in delta.iter_mut().zip(vh) {
                    *m = (v - *m) * beta; // Sᵀk became the update
                }
                for ((srow, &k), &qv) in s.chunks_exact_mut(vd).zip(kv).zip(qh) {
                    for ((sv, dv), ov) in srow.iter_mut().zip(&delta).zip(o.iter_mut()) {
                        *sv += k * dv;
                        *ov += *sv * qv;
                    }
                }
                let z = &io.z[t * width + h * vd..t * width + (h + 1) * vd];
                let inv = 1.0 / (o.iter().map(|v| v * v).sum::<f32>() / vd as f32 + eps).sqrt();
                for ((ov, w), zv) in o.iter_mut().zip(&d.norm).zip(z) {
                    *ov = *ov * inv * w * silu(*zv);
                }
            }
            out
        })
        .collect();
    for (h, head) in per_head.iter().enumerate() {
        for (t, o) in head.chunks_exact(vd).enumerate() {
            io.out[t * width + h * vd..t * width + (h + 1) * vd].copy_from_slice(o);
        }
    }
}

/// `x ← scale · x / sqrt(Σx² + 1e-6)` (FLA's l2norm, as transformers uses it).
fn l2_normalize(x: &mut [f32], scale: f32) {
    let inv = scale / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

impl CausalLm for Qwen35 {
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvPool) -> Result<Vec<f32>, ComputeError> {
        let dev = &self.dev;
        let no_pool = || ComputeError::Unsupported {
            what: "KV pool without recurrent state",
            value: "no StatePool attached".into(),
            device: dev.describe(),
            supported: "a KV pool given attach_states(StatePool::new(model.state_shapes(), n))",
        };
        let slots = Self::claim_slots(batch, kv.states_mut().ok_or_else(no_pool)?)?;
        let step = dev.step(&batch.attn_seqs(), kv, self.cfg.num_heads)?;
        let mut x = self.embed.forward(dev, batch.tokens)?;
        for layer in &self.layers {
            let h = layer.input_norm.forward(dev, &x)?;
            let m = match &layer.mixer {
                Mixer::Full(a) => self.attention(a, &h, kv, &step)?,
                Mixer::Linear(d) => {
                    let states = kv.states_mut().ok_or_else(no_pool)?;
                    self.delta_net(d, &h, batch, &slots, states)?
                }
            };
            dev.add_assign(&mut x, &m)?;
            let h = layer.post_norm.forward(dev, &x)?;
            let m = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(dev, &h)?,
                Ffn::Moe(moe) => moe.forward(dev, &h)?,
            };
            dev.add_assign(&mut x, &m)?;
        }
        let states = kv.states_mut().ok_or_else(no_pool)?;
        for (s, &slot) in batch.seqs.iter().zip(&slots) {
            states.set_seen(slot, s.pos0 + s.len)?;
        }
        let mut last = dev.gather_rows(&x, &batch.logit_rows())?;
        self.norm.forward_inplace(dev, &mut last)?;
        dev.to_host(self.lm_head.forward(dev, &last)?)
    }

    fn kv_shapes(&self) -> Vec<LayerKvShape> {
        let n = self.q.full_attention.iter().filter(|f| **f).count();
        vec![
            LayerKvShape {
                n_kv_heads: self.cfg.num_kv_heads,
                head_dim: self.cfg.head_dim
            };
            n
        ]
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn state_shapes(&self) -> Vec<LayerStateShape> {
        let n = self.q.full_attention.iter().filter(|f| !**f).count();
        vec![self.q.state_shape(); n]
    }
}
