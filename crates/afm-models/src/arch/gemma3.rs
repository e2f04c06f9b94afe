//! `gemma3` / `gemma3_text`: sandwich-normed decoder (norms before and after attention and MLP),
//! embeddings scaled by √hidden, per-head Q/K RMSNorm, GeGLU MLP, and a mix of sliding-window
//! layers (local RoPE base) and global layers. HF stores RMSNorm weights as `w` for `x·(1 + w)`;
//! llama.cpp's GGUF stores `1 + w`, so the offset is folded in at load.

use afm_runtime::attention::AttnParams;
use afm_runtime::compute::{
    Activation, ComputeError, Device, KvPool, QkNorm, Qkv, Rotary, Step, Tensor,
};
use afm_runtime::kv_store::LayerKvShape;
use afm_runtime::ops::{Rope, RopeStyle};

use super::llama::rope_for;
use crate::checkpoint::{Checkpoint, NormNaming};
use crate::config::TransformerConfig;
use crate::forward::{CausalLm, ForwardBatch};
use crate::layers::{matrix, rotary, Embedding, GatedMlp, Linear, RmsNorm};
use crate::weights::GgufFile;
use crate::ModelError;

const N: NormNaming = NormNaming::Gemma;

struct Block {
    input_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    mlp: GatedMlp,
    post_ffn_norm: RmsNorm,
    sliding: bool,
}

pub struct Gemma3 {
    cfg: TransformerConfig,
    dev: Device,
    embed: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope_global: Rotary,
    rope_local: Rotary,
}

/// What llama.cpp hard-codes for Gemma 3 rather than storing in the GGUF.
pub fn adjust_gguf_config(cfg: &mut TransformerConfig, _g: &GgufFile) {
    cfg.layer_sliding = (0..cfg.num_layers).map(|i| (i + 1) % 6 != 0).collect();
    cfg.rope_local_theta = 10_000.0;
    cfg.query_pre_attn_scalar = Some(cfg.head_dim as f32);
}

impl Gemma3 {
    pub fn load(
        ck: &Checkpoint,
        cfg: &TransformerConfig,
        dev: &Device,
    ) -> Result<Self, ModelError> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let eps = cfg.rms_eps;
        let offset = if ck.is_gguf() { 0.0 } else { 1.0 };
        let norm = |name: &str, len: usize| RmsNorm::load(ck, dev, name, N, len, eps, offset);
        let table = matrix(ck, dev, "embed_tokens.weight", N, cfg.vocab_size, h)?;
        let lm_head = if ck.has("lm_head.weight", N) {
            Linear::load(ck, dev, "lm_head", N, cfg.vocab_size, h, false)?
        } else {
            Linear {
                w: table.clone(),
                b: None,
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("layers.{i}");
            let lin = |m: &str, out: usize, inp: usize| {
                Linear::load(ck, dev, &format!("{p}.self_attn.{m}"), N, out, inp, false)
            };
            layers.push(Block {
                input_norm: norm(&format!("{p}.input_layernorm"), h)?,
                q: lin("q_proj", cfg.num_heads * hd, h)?,
                k: lin("k_proj", cfg.num_kv_heads * hd, h)?,
                v: lin("v_proj", cfg.num_kv_heads * hd, h)?,
                o: lin("o_proj", h, cfg.num_heads * hd)?,
                q_norm: norm(&format!("{p}.self_attn.q_norm"), hd)?,
                k_norm: norm(&format!("{p}.self_attn.k_norm"), hd)?,
                post_attn_norm: norm(&format!("{p}.post_attention_layernorm"), h)?,
                pre_ffn_norm: norm(&format!("{p}.pre_feedforward_layernorm"), h)?,
                mlp: GatedMlp::load(
                    ck,
                    dev,
                    &format!("{p}.mlp"),
                    N,
                    h,
                    cfg.intermediate_size,
                    Activation::GeluTanh,
                )?,
                post_ffn_norm: norm(&format!("{p}.post_feedforward_layernorm"), h)?,
                sliding: cfg.layer_sliding[i],
            });
        }
        let global = rope_for(cfg, cfg.rope_theta, RopeStyle::Neox);
        let local = Rope::new(hd, cfg.rope_local_theta, 1.0, RopeStyle::Neox);
        Ok(Self {
            embed: Embedding {
                table,
                scale: (h as f32).sqrt(),
            },
            layers,
            norm: norm("norm", h)?,
            lm_head,
            rope_global: rotary(dev, global, hd, RopeStyle::Neox, cfg.max_position)?,
            rope_local: rotary(dev, local, hd, RopeStyle::Neox, cfg.max_position)?,
            dev: dev.clone(),
            cfg: cfg.clone(),
        })
    }

    fn attention(
        &self,
        b: &Block,
        x: &Tensor,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
    ) -> Result<Tensor, ComputeError> {
        let (dev, hd) = (&self.dev, self.cfg.head_dim);
        // One launch for the three projections where the device can (as llama.rs).
        let qkv = dev.linear_many(x, &[(&b.q.w, None), (&b.k.w, None), (&b.v.w, None)])?;
        let n = qkv.len();
        let [q, k, v]: [Tensor; 3] = qkv.try_into().map_err(|_| ComputeError::Shape {
            what: "projections returned by linear_many",
            got: n,
            want: 3,
        })?;
        let rope = if b.sliding {
            &self.rope_local
        } else {
            &self.rope_global
        };
        // Head norms, RoPE, the K/V store and attention: one launch for a decode step on a
        // GPU where the decode kernel takes the heads (two otherwise).
        let norm = QkNorm {
            q: &b.q_norm.w,
            k: &b.k_norm.w,
            eps: b.q_norm.eps,
        };
        let params = AttnParams {
            n_heads: self.cfg.num_heads,
            head_dim: hd,
            scale: 1.0 / self.cfg.query_pre_attn_scalar.unwrap_or(hd as f32).sqrt(),
            window: if b.sliding {
                self.cfg.sliding_window
            } else {
                None
            },
            softcap: self.cfg.attn_logit_softcap,
        };
        let qkv = Qkv::new(q, k, v)?;
        let o = dev.attend_prologue(rope, Some(norm), qkv, kv, layer, step, &params)?;
        b.o.forward(dev, &o)
    }
}

impl CausalLm for Gemma3 {
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvPool) -> Result<Vec<f32>, ComputeError> {
        let dev = &self.dev;
        let step = dev.step(&batch.attn_seqs(), kv, self.cfg.num_heads)?;
        let mut x = self.embed.forward(dev, batch.tokens)?;
        for (i, b) in self.layers.iter().enumerate() {
            let h = b.input_norm.forward(dev, &x)?;
            let mut a = self.attention(b, &h, kv, i, &step)?;
            b.post_attn_norm.forward_inplace(dev, &mut a)?;
            dev.add_assign(&mut x, &a)?;
            let h = b.pre_ffn_norm.forward(dev, &x)?;
            let mut m = b.mlp.forward(dev, &h)?;
            b.post_ffn_norm.forward_inplace(dev, &mut m)?;
            dev.add_assign(&mut x, &m)?;
        }
        let mut last = dev.gather_rows(&x, &batch.logit_rows())?;
        self.norm.forward_inplace(dev, &mut last)?;
        let mut logits = self.lm_head.forward(dev, &last)?;
        if let Some(cap) = self.cfg.final_logit_softcap {
            dev.softcap(&mut logits, cap)?;
        }
        dev.to_host(logits)
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
