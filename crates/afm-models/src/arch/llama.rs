//! `llama` (SmolLM2, Llama 2/3): pre-norm decoder, GQA attention with RoPE, SwiGLU MLP.
//! Qwen 2 (`qwen2.rs`: Q/K/V biases) and Qwen 3 (`qwen3.rs`: per-head Q/K RMSNorm) are this
//! model with one option each, so they build it through [`LlamaOptions`].

use afm_runtime::attention::AttnParams;
use afm_runtime::compute::{
    Activation, ComputeError, Device, FusedDecoder, FusedLayer, KvPool, QkNorm, Rotary, Step,
    Tensor,
};
use afm_runtime::kv_store::LayerKvShape;
use afm_runtime::ops::{Rope, RopeStyle};

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::config::{RopeScaling, TransformerConfig};
use crate::forward::{CausalLm, ForwardBatch};
use crate::layers::{matrix, rotary, Embedding, GatedMlp, Linear, RmsNorm};
use crate::ModelError;

const N: NormNaming = NormNaming::Llama;

#[derive(Debug, Clone, Copy, Default)]
pub struct LlamaOptions {
    /// Q, K and V projections carry biases (Qwen 2).
    pub qkv_bias: bool,
    /// RMSNorm over each head of Q and K before RoPE (Qwen 3).
    pub qk_norm: bool,
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
}

impl Attention {
    /// The per-head Q/K norms as the device's attention prologue takes them (Qwen 3).
    fn qk_norm(&self) -> Option<QkNorm<'_>> {
        match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => Some(QkNorm {
                q: &qn.w,
                k: &kn.w,
                eps: qn.eps,
            }),
            _ => None,
        }
    }
}

struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    mlp: GatedMlp,
}

pub struct Llama {
    cfg: TransformerConfig,
    dev: Device,
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rotary,
}

/// The rotary table of a config; llama.cpp's llama conversion permutes Q/K rows so that the
/// GGUF weights pair dimensions interleaved instead of by halves.
pub fn rope_for(cfg: &TransformerConfig, theta: f32, style: RopeStyle) -> Rope {
    match cfg.rope_scaling {
        RopeScaling::None => Rope::new(cfg.head_dim, theta, 1.0, style),
        RopeScaling::Linear(f) => Rope::new(cfg.head_dim, theta, f, style),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => Rope::llama3(
            cfg.head_dim,
            theta,
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
            style,
        ),
    }
}

impl Llama {
    pub fn load(
        ck: &Checkpoint,
        cfg: &TransformerConfig,
        dev: &Device,
        opts: LlamaOptions,
        style: RopeStyle,
    ) -> Result<Self, ModelError> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let table = matrix(ck, dev, "embed_tokens.weight", N, cfg.vocab_size, h)?;
        let lm_head = if ck.has("lm_head.weight", N) {
            Linear::load(ck, dev, "lm_head", N, cfg.vocab_size, h, false)?
        } else {
            Linear {
                w: table.clone(),
                b: None,
            }
        };
        let norm = |name: &str, len: usize| RmsNorm::load(ck, dev, name, N, len, cfg.rms_eps, 0.0);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("layers.{i}");
            let lin = |m: &str, out: usize, inp: usize, bias: bool| {
                Linear::load(ck, dev, &format!("{p}.self_attn.{m}"), N, out, inp, bias)
            };
            let head_norm = |m: &str| -> Result<Option<RmsNorm>, ModelError> {
                opts.qk_norm
                    .then(|| norm(&format!("{p}.self_attn.{m}"), hd))
                    .transpose()
            };
            let (qn, kn, vn) = (
                format!("{p}.self_attn.q_proj"),
                format!("{p}.self_attn.k_proj"),
                format!("{p}.self_attn.v_proj"),
            );
            let kv_out = cfg.num_kv_heads * hd;
            let qkv = [
                (qn.as_str(), cfg.num_heads * hd),
                (kn.as_str(), kv_out),
                (vn.as_str(), kv_out),
            ];
            let [q, k, v] = Linear::load_joined(ck, dev, qkv, N, h, opts.qkv_bias)?;
            let attn = Attention {
                q,
                k,
                v,
                o: lin("o_proj", h, cfg.num_heads * hd, false)?,
                q_norm: head_norm("q_norm")?,
                k_norm: head_norm("k_norm")?,
            };
            layers.push(Block {
                input_norm: norm(&format!("{p}.input_layernorm"), h)?,
                attn,
                post_attn_norm: norm(&format!("{p}.post_attention_layernorm"), h)?,
                mlp: GatedMlp::load(
                    ck,
                    dev,
                    &format!("{p}.mlp"),
                    N,
                    h,
                    cfg.intermediate_size,
                    Activation::Silu,
                )?,
            });
        }
        let rope = rope_for(cfg, cfg.rope_theta, style);
        Ok(Self {
            embed: Embedding { table, scale: 1.0 },
            layers,
            norm: norm("norm", h)?,
            lm_head,
            rope: rotary(dev, rope, hd, style, cfg.max_position)?,
            dev: dev.clone(),
            cfg: cfg.clone(),
        })
    }

    /// `x += o_proj(attention(norm(x)))`: the attention sub-layer with its pre-norm and
    /// residual add, each folded into a projection's launches where the device can.
    fn attention(
        &self,
        b: &Block,
        x: &mut Tensor,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
    ) -> Result<(), ComputeError> {
        let (dev, hd, a) = (&self.dev, self.cfg.head_dim, &b.attn);
        // One launch for the norm and the three projections where the device can; past the
        // GEMV's rows one GEMM into one buffer of rows [q | k | v], read in place below.
        let qkv = dev.norm_linear_qkv(
            x,
            &b.input_norm.w,
            b.input_norm.eps,
            [
                (&a.q.w, a.q.b.as_ref()),
                (&a.k.w, a.k.b.as_ref()),
                (&a.v.w, a.v.b.as_ref()),
            ],
        )?;
        // Head norms, RoPE, the K/V store and attention: one launch for a decode step on a
        // GPU (two otherwise).
        let norm = a.qk_norm();
        let params = AttnParams::scaled(self.cfg.num_heads, hd);
        let o = dev.attend_prologue(&self.rope, norm, qkv, kv, layer, step, &params)?;
        dev.linear_add(&o, &a.o.w, a.o.b.as_ref(), x)
    }

    /// The layer stack as `Device::fused_decode` reads it (one launch per decode step of one
    /// sequence on a GPU that has it).
    fn fused(&self) -> FusedDecoder<'_> {
        let layers = self.layers.iter().map(|l| {
            let a = &l.attn;
            let qkv_bias = match (&a.q.b, &a.k.b, &a.v.b) {
                (Some(q), Some(k), Some(v)) => Some([q, k, v]),
                _ => None,
            };
            let qk_norm = a.qk_norm();
            FusedLayer {
                input_norm: (&l.input_norm.w, l.input_norm.eps),
                q: &a.q.w,
                k: &a.k.w,
                v: &a.v.w,
                qkv_bias,
                qk_norm,
                o: &a.o.w,
                post_norm: (&l.post_attn_norm.w, l.post_attn_norm.eps),
                gate: &l.mlp.gate.w,
                up: &l.mlp.up.w,
                down: &l.mlp.down.w,
            }
        });
        FusedDecoder {
            layers: layers.collect(),
            n_heads: self.cfg.num_heads,
            n_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
            act: self.layers.first().map_or(Activation::Silu, |l| l.mlp.act),
            rope: &self.rope,
        }
    }
}

impl CausalLm for Llama {
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvPool) -> Result<Vec<f32>, ComputeError> {
        let dev = &self.dev;
        let step = dev.step(&batch.attn_seqs(), kv, self.cfg.num_heads)?;
        // The residual stream: each sub-layer normalizes it inside its first product and adds
        // its output back inside its last.
        let mut x = self.embed.forward(dev, batch.tokens)?;
        // A decode step of one sequence: every layer in one launch where the device has it.
        let fused =
            batch.tokens.len() == 1 && dev.fused_decode(|| self.fused(), &mut x, kv, &step)?;
        if !fused {
            for (i, layer) in self.layers.iter().enumerate() {
                self.attention(layer, &mut x, kv, i, &step)?;
                layer
                    .mlp
                    .forward_residual(dev, &layer.post_attn_norm, &mut x)?;
            }
        }
        let mut last = dev.gather_rows(&x, &batch.logit_rows())?;
        self.norm.forward_inplace(dev, &mut last)?;
        dev.to_host(self.lm_head.forward(dev, &last)?)
    }

    fn kv_shapes(&self) -> Vec<LayerKvShape> {
        vec![
            LayerKvShape {
                n_kv_heads: self.cfg.num_kv_heads,
                head_dim: self.cfg.head_dim
            };
            self.cfg.num_layers
        ]
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }
}
