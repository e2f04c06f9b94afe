//! `llama` (SmolLM2, Llama 2/3): pre-norm decoder, GQA attention with RoPE, SwiGLU MLP.
//! Qwen 2 (`qwen2.rs`: Q/K/V biases) and Qwen 3 (`qwen3.rs`: per-head Q/K RMSNorm) are this
//! model with one option each, so they build it through [`LlamaOptions`].

use afm_runtime::attention::AttnParams;
use afm_runtime::kv_store::{KvCache, LayerKvShape};
use afm_runtime::ops::{self, Rope, RopeStyle};

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::config::{RopeScaling, TransformerConfig};
use crate::forward::{CausalLm, ForwardBatch};
use crate::layers::{
    apply_rope, cached_attention, gather_rows, Embedding, GatedMlp, Linear, RmsNorm,
};
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

struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    mlp: GatedMlp,
}

pub struct Llama {
    cfg: TransformerConfig,
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
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
        opts: LlamaOptions,
        style: RopeStyle,
    ) -> Result<Self, ModelError> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let table = ck.matrix("embed_tokens.weight", N, cfg.vocab_size, h)?;
        let lm_head = if ck.has("lm_head.weight", N) {
            Linear::load(ck, "lm_head", N, cfg.vocab_size, h, false)?
        } else {
            Linear {
                w: table.clone(),
                b: None,
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("layers.{i}");
            let head_norm =
                |n: &str| RmsNorm::load(ck, &format!("{p}.self_attn.{n}"), N, hd, cfg.rms_eps, 0.0);
            let attn = Attention {
                q: Linear::load(
                    ck,
                    &format!("{p}.self_attn.q_proj"),
                    N,
                    cfg.num_heads * hd,
                    h,
                    opts.qkv_bias,
                )?,
                k: Linear::load(
                    ck,
                    &format!("{p}.self_attn.k_proj"),
                    N,
                    cfg.num_kv_heads * hd,
                    h,
                    opts.qkv_bias,
                )?,
                v: Linear::load(
                    ck,
                    &format!("{p}.self_attn.v_proj"),
                    N,
                    cfg.num_kv_heads * hd,
                    h,
                    opts.qkv_bias,
                )?,
                o: Linear::load(
                    ck,
                    &format!("{p}.self_attn.o_proj"),
                    N,
                    h,
                    cfg.num_heads * hd,
                    false,
                )?,
                q_norm: if opts.qk_norm {
                    Some(head_norm("q_norm")?)
                } else {
                    None
                },
                k_norm: if opts.qk_norm {
                    Some(head_norm("k_norm")?)
                } else {
                    None
                },
            };
            layers.push(Block {
                input_norm: RmsNorm::load(
                    ck,
                    &format!("{p}.input_layernorm"),
                    N,
                    h,
                    cfg.rms_eps,
                    0.0,
                )?,
                attn,
                post_attn_norm: RmsNorm::load(
                    ck,
                    &format!("{p}.post_attention_layernorm"),
                    N,
                    h,
                    cfg.rms_eps,
                    0.0,
                )?,
                mlp: GatedMlp::load(
                    ck,
                    &format!("{p}.mlp"),
                    N,
                    h,
                    cfg.intermediate_size,
                    ops::silu,
                )?,
            });
        }
        Ok(Self {
            embed: Embedding { table, scale: 1.0 },
            layers,
            norm: RmsNorm::load(ck, "norm", N, h, cfg.rms_eps, 0.0)?,
            lm_head,
            rope: rope_for(cfg, cfg.rope_theta, style),
            cfg: cfg.clone(),
        })
    }

    fn attention(
        &self,
        a: &Attention,
        x: &[f32],
        kv: &mut afm_runtime::kv_store::LayerKv,
        batch: &ForwardBatch,
        pos: &[usize],
    ) -> Vec<f32> {
        let (n, hd) = (pos.len(), self.cfg.head_dim);
        let mut q = a.q.forward(x, n);
        let mut k = a.k.forward(x, n);
        let v = a.v.forward(x, n);
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            qn.forward_inplace(&mut q);
            kn.forward_inplace(&mut k);
        }
        apply_rope(&self.rope, &mut q, hd, pos);
        apply_rope(&self.rope, &mut k, hd, pos);
        let params = AttnParams {
            n_heads: self.cfg.num_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            softcap: None,
        };
        let o = cached_attention(&q, &k, &v, kv, batch, &params);
        a.o.forward(&o, n)
    }
}

impl CausalLm for Llama {
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Vec<f32> {
        let pos = batch.positions();
        let n = pos.len();
        let mut x = self.embed.forward(batch.tokens);
        for (layer, cache) in self.layers.iter().zip(kv.layers.iter_mut()) {
            let h = layer.input_norm.forward(&x);
            let a = self.attention(&layer.attn, &h, cache, batch, &pos);
            ops::add_assign(&mut x, &a);
            let h = layer.post_attn_norm.forward(&x);
            let m = layer.mlp.forward(&h, n);
            ops::add_assign(&mut x, &m);
        }
        let rows = batch.logit_rows();
        let mut last = gather_rows(&x, self.cfg.hidden_size, &rows);
        self.norm.forward_inplace(&mut last);
        self.lm_head.forward(&last, rows.len())
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
