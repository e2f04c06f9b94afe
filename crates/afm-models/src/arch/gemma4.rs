//! `gemma4` / `gemma4_text` (Gemma 4 31B dense, 26B-A4B MoE; the language model of the
//! multimodal wrapper, whose vision and audio towers are not read). Gemma 3's sandwich-normed
//! decoder with these differences (transformers 5 `modeling_gemma4.py`):
//!
//! - RMSNorm multiplies by `w` itself (not `1 + w`); V gets a weightless RMSNorm (`v_norm`).
//! - Attention scale 1 (q_norm/k_norm carry it). Sliding and global layers differ in head_dim
//!   and KV heads, so each layer has its own KV shape; with `attention_k_eq_v` global layers
//!   have no v_proj: V is the raw k_proj output, v-normed, unrotated.
//! - Global RoPE is "proportional": a table over the whole head where only the first
//!   `partial_rotary_factor · head_dim / 2` pairs (i, i + head_dim/2) turn.
//! - Every layer's output (residual included) is multiplied by its `layer_scalar`; final
//!   logits are soft-capped.
//! - MoE layers run the dense MLP and the experts side by side on the post-attention residual:
//!   `r + post_ffn(post_ffn_1(mlp(pre_ffn(r))) + post_ffn_2(experts(pre_ffn_2(r))))`, routed by
//!   `softmax(proj(rmsnorm(r) · scale · H^-½))`, top-k, renormalized, × `per_expert_scale`.
//!   Routing runs on the host ([`Device::read_back`]), so a MoE model's decode steps run
//!   without CUDA graphs (the read-back is refused inside one).
//! - Per-layer input embeddings (`hidden_size_per_layer_input` > 0, the small variants): a
//!   second embedding plus a projection of the first, one slice per layer, gated into the
//!   residual after the MLP.
//!
//! A GGUF (`general.architecture` gemma4, as llama.cpp's converter writes it) feeds the same
//! model: [`adjust_gguf_config`] restates its metadata as these keys, and the tensors only
//! Gemma 4 has are named by `load_block`'s `own`.
//!
//! Refused at load with the key named: KV-sharing layers (`num_kv_shared_layers`, E2B/E4B),
//! bidirectional attention, RoPE types other than default/proportional.

use afm_runtime::attention::AttnParams;
use afm_runtime::compute::{Activation, ComputeError, Device, KvPool, Rotary, Step, Tensor};
use afm_runtime::kv_store::LayerKvShape;
use afm_runtime::ops::{Rope, RopeStyle};
use afm_runtime::DType;
use serde_json::{json, Value};

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::config::TransformerConfig;
use crate::forward::{CausalLm, ForwardBatch};
use crate::layers::{matrix, rotary, Embedding, GatedMlp, Linear, RmsNorm};
use crate::moe::{softmax_top_k, ExpertShape, Experts};
use crate::weights::GgufFile;
use crate::ModelError;

const N: NormNaming = NormNaming::Gemma;
const ACT: Activation = Activation::GeluTanh;

/// Attention geometry of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LayerGeometry {
    sliding: bool,
    head_dim: usize,
    n_kv_heads: usize,
    /// V is the k_proj output (no v_proj).
    k_eq_v: bool,
}

/// What Gemma 4 reads beyond [`TransformerConfig`], checked once.
#[derive(Debug, Clone)]
struct Params {
    layers: Vec<LayerGeometry>,
    local_rope: Rope,
    global_rope: Rope,
    moe: Option<(ExpertShape, usize)>,
    /// Per-layer input width and vocabulary (0: none).
    ple: (usize, usize),
    attention_bias: bool,
}

fn bad(key: &str, reason: String) -> ModelError {
    ModelError::Config {
        key: key.into(),
        reason,
    }
}

fn uint(raw: &Value, key: &str) -> Option<usize> {
    raw.get(key).and_then(Value::as_u64).map(|v| v as usize)
}

fn float(raw: &Value, key: &str) -> Option<f64> {
    raw.get(key).and_then(Value::as_f64)
}

/// The rotary table of one layer type from `rope_parameters[layer_type]`.
fn rope_of(raw: &Value, layer_type: &str, head_dim: usize) -> Result<Rope, ModelError> {
    let key = format!("rope_parameters.{layer_type}");
    let p = raw.get("rope_parameters").and_then(|p| p.get(layer_type));
    let (kind, theta) = match p {
        Some(p) => (
            p.get("rope_type")
                .and_then(Value::as_str)
                .unwrap_or("default"),
            float(p, "rope_theta"),
        ),
        // transformers' defaults for a config without rope_parameters.
        None if layer_type == "full_attention" => ("proportional", Some(1e6)),
        None => ("default", Some(1e4)),
    };
    let theta = theta.ok_or_else(|| bad(&key, "no rope_theta".into()))? as f32;
    let factor = p.and_then(|p| float(p, "factor")).unwrap_or(1.0) as f32;
    match kind {
        "default" => Ok(Rope::new(head_dim, theta, 1.0, RopeStyle::Neox)),
        "proportional" => {
            let partial = p
                .and_then(|p| float(p, "partial_rotary_factor"))
                .unwrap_or(if p.is_none() { 0.25 } else { 1.0 });
            let rotated = (partial * head_dim as f64 / 2.0).floor() as usize;
            Ok(Rope::proportional(
                head_dim,
                theta,
                factor,
                rotated,
                RopeStyle::Neox,
            ))
        }
        other => Err(bad(
            &key,
            format!("rope_type '{other}' is not supported (supported: default, proportional)"),
        )),
    }
}

impl Params {
    fn read(cfg: &TransformerConfig) -> Result<Self, ModelError> {
        let raw = &cfg.raw;
        if let Some(n) = uint(raw, "num_kv_shared_layers").filter(|&n| n > 0) {
            return Err(bad(
                "num_kv_shared_layers",
                format!("{n} KV-sharing layers are not supported (supported: 0)"),
            ));
        }
        if let Some(b) = raw
            .get("use_bidirectional_attention")
            .and_then(Value::as_str)
        {
            if b == "all" {
                return Err(bad(
                    "use_bidirectional_attention",
                    "'all' is not supported (a causal LM is)".into(),
                ));
            }
        }
        if let Some(a) = raw.get("hidden_activation").and_then(Value::as_str) {
            if a != "gelu_pytorch_tanh" {
                return Err(bad(
                    "hidden_activation",
                    format!("'{a}' is not supported (supported: gelu_pytorch_tanh)"),
                ));
            }
        }
        let k_eq_v = raw
            .get("attention_k_eq_v")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let global_hd = uint(raw, "global_head_dim").unwrap_or(cfg.head_dim);
        // transformers overrides the global KV heads only where k_eq_v is set.
        let global_kv = uint(raw, "num_global_key_value_heads")
            .filter(|_| k_eq_v)
            .unwrap_or(cfg.num_kv_heads);
        let per_layer = raw.get("per_layer_config");
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (i, &sliding) in cfg.layer_sliding.iter().enumerate() {
            let over = per_layer.and_then(|p| p.get(i.to_string()));
            let (hd, kv) = if sliding {
                (cfg.head_dim, cfg.num_kv_heads)
            } else {
                (global_hd, global_kv)
            };
            let g = LayerGeometry {
                sliding,
                head_dim: over.and_then(|o| uint(o, "head_dim")).unwrap_or(hd),
                n_kv_heads: over
                    .and_then(|o| uint(o, "num_key_value_heads"))
                    .unwrap_or(kv),
                k_eq_v: k_eq_v && !sliding,
            };
            if g.n_kv_heads == 0
                || !cfg.num_heads.is_multiple_of(g.n_kv_heads)
                || g.head_dim == 0
                || !g.head_dim.is_multiple_of(2)
            {
                return Err(bad(
                    &format!("per_layer_config.{i}"),
                    format!(
                        "head_dim {} / {} KV heads do not fit {} query heads",
                        g.head_dim, g.n_kv_heads, cfg.num_heads
                    ),
                ));
            }
            layers.push(g);
        }
        // One rotary table per layer type: every layer of a type shares its head_dim.
        let dim_of = |sliding: bool| {
            layers
                .iter()
                .find(|g| g.sliding == sliding)
                .map(|g| g.head_dim)
        };
        for g in &layers {
            if Some(g.head_dim) != dim_of(g.sliding) {
                return Err(bad(
                    "per_layer_config",
                    "layers of one type with different head_dim are not supported".into(),
                ));
            }
        }
        let local_rope = rope_of(
            raw,
            "sliding_attention",
            dim_of(true).unwrap_or(cfg.head_dim),
        )?;
        let global_rope = rope_of(raw, "full_attention", dim_of(false).unwrap_or(global_hd))?;
        let moe = if raw.get("enable_moe_block").and_then(Value::as_bool) == Some(true) {
            let need = |k: &str| {
                uint(raw, k)
                    .filter(|&v| v > 0)
                    .ok_or_else(|| bad(k, "a MoE model needs a positive value".into()))
            };
            let shape = ExpertShape {
                num_experts: need("num_experts")?,
                hidden: cfg.hidden_size,
                inter: need("moe_intermediate_size")?,
            };
            let k = need("top_k_experts")?;
            if k > shape.num_experts {
                return Err(bad(
                    "top_k_experts",
                    format!("{k} exceeds num_experts {}", shape.num_experts),
                ));
            }
            Some((shape, k))
        } else {
            None
        };
        let ple_dim = uint(raw, "hidden_size_per_layer_input").unwrap_or(0);
        let ple_vocab = uint(raw, "vocab_size_per_layer_input").unwrap_or(cfg.vocab_size);
        Ok(Self {
            layers,
            local_rope,
            global_rope,
            moe,
            ple: (ple_dim, ple_vocab),
            attention_bias: raw
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    }
}

/// llama.cpp's `gemma4` metadata (its converter's `Gemma4Model`) restated as the HF keys
/// [`Params::read`] reads: per-layer KV heads and head dims, the SWA pattern, both RoPE bases,
/// the rotated share of global RoPE (from `rope_freqs`: factor 1 turns, 1e30 stays), MoE sizes,
/// K-as-V (global layers without `attn_v`) and the per-layer input width.
pub fn adjust_gguf_config(cfg: &mut TransformerConfig, g: &GgufFile) {
    let key = |k: &str| g.get(&format!("gemma4.{k}"));
    let uint = |k: &str| key(k).and_then(|v| v.as_u64()).map(|v| v as usize);
    let n = cfg.num_layers;
    if let Some(p) = key("attention.sliding_window_pattern").and_then(|v| v.as_array()) {
        cfg.layer_sliding = p.iter().map(|b| b.as_bool().unwrap_or(false)).collect();
    }
    let hd_full = uint("attention.key_length").unwrap_or(cfg.head_dim);
    let hd_swa = uint("attention.key_length_swa").unwrap_or(hd_full);
    let kv: Vec<usize> = match key("attention.head_count_kv") {
        Some(v) => match v.as_array() {
            Some(a) => a.iter().map(|x| x.as_u64().unwrap_or(0) as usize).collect(),
            None => vec![v.as_u64().unwrap_or(cfg.num_heads as u64) as usize; n],
        },
        None => vec![cfg.num_heads; n],
    };
    let sliding = |i: usize| cfg.layer_sliding.get(i).copied().unwrap_or(false);
    let first_swa = (0..n).find(|&i| sliding(i)).unwrap_or(0);
    cfg.head_dim = hd_swa;
    cfg.num_kv_heads = kv.get(first_swa).copied().unwrap_or(cfg.num_kv_heads);
    cfg.rope_local_theta = key("rope.freq_base_swa")
        .and_then(|v| v.as_f64())
        .unwrap_or(10_000.0) as f32;
    let per_layer: serde_json::Map<String, Value> = (0..n)
        .map(|i| {
            let hd = if sliding(i) { hd_swa } else { hd_full };
            let kv_i = kv.get(i).copied().unwrap_or(cfg.num_kv_heads);
            (
                i.to_string(),
                json!({"head_dim": hd, "num_key_value_heads": kv_i}),
            )
        })
        .collect();
    let k_eq_v = (0..n).any(|i| !sliding(i) && !g.contains(&format!("blk.{i}.attn_v.weight")));
    let rotated = g
        .tensor("rope_freqs.weight")
        .and_then(|t| t.to_f32())
        .map_or(hd_full / 2, |f| f.iter().filter(|&&x| x < 1e29).count());
    let experts = uint("expert_count").unwrap_or(0);
    let ple_vocab = g
        .tensor("per_layer_token_embd.weight")
        .map_or(cfg.vocab_size, |t| t.shape[0]);
    cfg.raw = json!({
        "global_head_dim": hd_full,
        "per_layer_config": per_layer,
        "attention_k_eq_v": k_eq_v,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": cfg.rope_theta,
                "partial_rotary_factor": (2 * rotated) as f64 / hd_full.max(1) as f64,
            },
        },
        "enable_moe_block": experts > 0,
        "num_experts": experts,
        "top_k_experts": uint("expert_used_count").unwrap_or(0),
        "moe_intermediate_size": uint("expert_feed_forward_length").unwrap_or(0),
        "hidden_size_per_layer_input": uint("embedding_length_per_layer_input").unwrap_or(0),
        "vocab_size_per_layer_input": ple_vocab,
        "num_kv_shared_layers": uint("attention.shared_kv_layers").unwrap_or(0),
    });
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Option<Linear>,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
    geo: LayerGeometry,
}

/// The MoE half of a MoE layer's feed-forward.
struct MoeBlock {
    /// `rmsnorm(r) · scale · H^-½` as one norm with weight `scale · H^-½`.
    router_norm: RmsNorm,
    router: Linear,
    per_expert_scale: Vec<f32>,
    top_k: usize,
    experts: Experts,
    pre_norm: RmsNorm,
    post_norm_mlp: RmsNorm,
    post_norm_experts: RmsNorm,
}

/// A layer's share of the per-layer input embeddings.
struct LayerInput {
    gate: Linear,
    proj: Linear,
    post_norm: RmsNorm,
}

struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_ffn_norm: RmsNorm,
    mlp: GatedMlp,
    moe: Option<MoeBlock>,
    post_ffn_norm: RmsNorm,
    input: Option<LayerInput>,
    scalar: f32,
}

/// Per-layer input embeddings (PLE): `[tokens][layers · dim]`, one `dim` slice per layer.
struct PerLayerInputs {
    table: Embedding,
    proj: Linear,
    proj_scale: f32,
    norm: RmsNorm,
    dim: usize,
}

pub struct Gemma4 {
    cfg: TransformerConfig,
    dev: Device,
    embed: Embedding,
    ple: Option<PerLayerInputs>,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope_local: Rotary,
    rope_global: Rotary,
}

/// A weightless RMSNorm (`v_norm`, the router's) as a norm with constant weight `w`.
fn constant_norm(dev: &Device, len: usize, w: f32, eps: f32) -> Result<RmsNorm, ModelError> {
    Ok(RmsNorm {
        w: dev
            .vector(vec![w; len])
            .map_err(|source| ModelError::Device {
                name: "constant norm".into(),
                source,
            })?,
        eps,
    })
}

/// √hidden rounded to the embedding table's type, as transformers multiplies in that type.
fn embed_scale(hidden: usize, dtype: DType) -> f32 {
    let s = (hidden as f32).sqrt();
    match dtype {
        DType::BF16 => half::bf16::from_f32(s).to_f32(),
        DType::F16 => half::f16::from_f32(s).to_f32(),
        _ => s,
    }
}

impl Gemma4 {
    pub fn load(
        ck: &Checkpoint,
        cfg: &TransformerConfig,
        dev: &Device,
    ) -> Result<Self, ModelError> {
        let p = Params::read(cfg)?;
        let h = cfg.hidden_size;
        let table = matrix(ck, dev, "embed_tokens.weight", N, cfg.vocab_size, h)?;
        let lm_head = if ck.has("lm_head.weight", N) {
            Linear::load(ck, dev, "lm_head", N, cfg.vocab_size, h, false)?
        } else {
            Linear {
                w: table.clone(),
                b: None,
            }
        };
        let ple = match p.ple {
            (0, _) => None,
            (dim, vocab) => {
                let width = cfg.num_layers * dim;
                let gguf = ck.is_gguf();
                let name = |hf: &'static str, gg: &'static str| if gguf { gg } else { hf };
                let t = matrix(
                    ck,
                    dev,
                    name(
                        "embed_tokens_per_layer.weight",
                        "per_layer_token_embd.weight",
                    ),
                    N,
                    vocab,
                    width,
                )?;
                let scale = embed_scale(dim, t.dtype());
                Some(PerLayerInputs {
                    table: Embedding { table: t, scale },
                    proj: Linear::load(
                        ck,
                        dev,
                        name("per_layer_model_projection", "per_layer_model_proj"),
                        N,
                        width,
                        h,
                        false,
                    )?,
                    proj_scale: (h as f32).powf(-0.5),
                    norm: RmsNorm::load(
                        ck,
                        dev,
                        name("per_layer_projection_norm", "per_layer_proj_norm"),
                        N,
                        dim,
                        cfg.rms_eps,
                        0.0,
                    )?,
                    dim,
                })
            }
        };
        let layers = (0..cfg.num_layers)
            .map(|i| load_block(ck, cfg, &p, dev, i))
            .collect::<Result<Vec<_>, _>>()?;
        let max_pos = cfg.max_position;
        let dim = |sliding| {
            p.layers
                .iter()
                .find(|g| g.sliding == sliding)
                .map_or(cfg.head_dim, |g| g.head_dim)
        };
        Ok(Self {
            embed: Embedding {
                scale: embed_scale(h, table.dtype()),
                table,
            },
            ple,
            layers,
            norm: RmsNorm::load(ck, dev, "norm", N, h, cfg.rms_eps, 0.0)?,
            lm_head,
            rope_local: rotary(
                dev,
                p.local_rope.clone(),
                dim(true),
                RopeStyle::Neox,
                max_pos,
            )?,
            rope_global: rotary(
                dev,
                p.global_rope.clone(),
                dim(false),
                RopeStyle::Neox,
                max_pos,
            )?,
            dev: dev.clone(),
            cfg: cfg.clone(),
        })
    }

    fn attention(
        &self,
        a: &Attention,
        x: &Tensor,
        kv: &mut KvPool,
        layer: usize,
        step: &Step,
    ) -> Result<Tensor, ComputeError> {
        let (dev, hd) = (&self.dev, a.geo.head_dim);
        let mut q = a.q.forward(dev, x)?;
        let mut k = a.k.forward(dev, x)?;
        let mut v = match &a.v {
            Some(v) => v.forward(dev, x)?,
            None => a.v_norm.forward(dev, &k)?,
        };
        if a.v.is_some() {
            a.v_norm.forward_inplace(dev, &mut v)?;
        }
        a.q_norm.forward_inplace(dev, &mut q)?;
        a.k_norm.forward_inplace(dev, &mut k)?;
        let rope = if a.geo.sliding {
            &self.rope_local
        } else {
            &self.rope_global
        };
        dev.rope(rope, &mut q, hd, step)?;
        dev.rope(rope, &mut k, hd, step)?;
        let params = AttnParams {
            n_heads: self.cfg.num_heads,
            head_dim: hd,
            scale: 1.0,
            window: if a.geo.sliding {
                self.cfg.sliding_window
            } else {
                None
            },
            softcap: None,
        };
        let o = dev.attention(kv, layer, step, &q, &k, &v, &params)?;
        a.o.forward(dev, &o)
    }

    /// The feed-forward half on the post-attention residual `r`, before `post_ffn_norm`.
    fn feed_forward(&self, b: &Block, r: &Tensor) -> Result<Tensor, ComputeError> {
        let dev = &self.dev;
        let h = b.pre_ffn_norm.forward(dev, r)?;
        let mut m = b.mlp.forward(dev, &h)?;
        let Some(moe) = &b.moe else {
            return Ok(m);
        };
        moe.post_norm_mlp.forward_inplace(dev, &mut m)?;
        let routed = moe.router_norm.forward(dev, r)?;
        let logits = dev.read_back(&moe.router.forward(dev, &routed)?)?;
        let n = moe.experts.shape().num_experts;
        let mut routes = softmax_top_k(&logits, n, moe.top_k, true);
        for route in &mut routes {
            route.weight *= moe.per_expert_scale[route.expert];
        }
        let h2 = moe.pre_norm.forward(dev, r)?;
        let mut e = moe.experts.forward(dev, &h2, &routes)?;
        moe.post_norm_experts.forward_inplace(dev, &mut e)?;
        dev.add_assign(&mut m, &e)?;
        Ok(m)
    }

    /// `(norm(proj(x) · H^-½) + table[tokens]) · 2^-½`: `[tokens][layers · dim]`.
    fn per_layer_inputs(
        &self,
        p: &PerLayerInputs,
        tokens: &[u32],
        x: &Tensor,
    ) -> Result<Tensor, ComputeError> {
        let dev = &self.dev;
        let mut proj = p.proj.forward(dev, x)?;
        dev.scale(&mut proj, p.proj_scale)?;
        p.norm.forward_inplace(dev, &mut proj)?;
        let t = p.table.forward(dev, tokens)?;
        dev.add_assign(&mut proj, &t)?;
        dev.scale(&mut proj, std::f32::consts::FRAC_1_SQRT_2)?;
        Ok(proj)
    }
}

fn load_block(
    ck: &Checkpoint,
    cfg: &TransformerConfig,
    p: &Params,
    dev: &Device,
    i: usize,
) -> Result<Block, ModelError> {
    let (h, eps) = (cfg.hidden_size, cfg.rms_eps);
    let pre = format!("layers.{i}");
    // Names only Gemma 4 has: HF's, or llama.cpp's in a GGUF (the checkpoint maps the rest).
    let own = |hf: &str, gguf: &str| match ck.is_gguf() {
        true => format!("blk.{i}.{gguf}"),
        false => format!("{pre}.{hf}"),
    };
    let named = |name: &str, len: usize| RmsNorm::load(ck, dev, name, N, len, eps, 0.0);
    let norm = |name: &str, len: usize| named(&format!("{pre}.{name}"), len);
    let geo = p.layers[i];
    let (hd, nq, nkv) = (geo.head_dim, cfg.num_heads, geo.n_kv_heads);
    let lin = |m: &str, out: usize, inp: usize, bias: bool| {
        Linear::load(ck, dev, &format!("{pre}.self_attn.{m}"), N, out, inp, bias)
    };
    let bias = p.attention_bias;
    let attn = Attention {
        q: lin("q_proj", nq * hd, h, bias)?,
        k: lin("k_proj", nkv * hd, h, bias)?,
        v: (!geo.k_eq_v)
            .then(|| lin("v_proj", nkv * hd, h, bias))
            .transpose()?,
        o: lin("o_proj", h, nq * hd, bias)?,
        q_norm: norm("self_attn.q_norm", hd)?,
        k_norm: norm("self_attn.k_norm", hd)?,
        v_norm: constant_norm(dev, hd, 1.0, eps)?,
        geo,
    };
    let moe = match p.moe {
        None => None,
        Some((shape, top_k)) => {
            let mut scale = ck.vector(&own("router.scale", "ffn_gate_inp.scale"), N, h)?;
            scale.iter_mut().for_each(|s| *s *= (h as f32).powf(-0.5));
            let per_expert_scale = ck.vector(
                &own("router.per_expert_scale", "ffn_down_exps.scale"),
                N,
                shape.num_experts,
            )?;
            let fused = own("experts.gate_up_proj", "ffn_gate_up_exps.weight");
            let experts = if ck.has(&fused, N) {
                Experts::load_fused(
                    ck,
                    dev,
                    &fused,
                    &own("experts.down_proj", "ffn_down_exps.weight"),
                    N,
                    shape,
                    ACT,
                )?
            } else {
                Experts::load_per_expert(ck, dev, &format!("{pre}.experts"), N, shape, ACT)?
            };
            Some(MoeBlock {
                router_norm: RmsNorm {
                    w: dev.vector(scale).map_err(|source| ModelError::Device {
                        name: format!("{pre}.router.scale"),
                        source,
                    })?,
                    eps,
                },
                router: Linear::load(
                    ck,
                    dev,
                    &own("router.proj", "ffn_gate_inp"),
                    N,
                    shape.num_experts,
                    h,
                    false,
                )?,
                per_expert_scale,
                top_k,
                experts,
                pre_norm: named(&own("pre_feedforward_layernorm_2", "pre_ffw_norm_2"), h)?,
                post_norm_mlp: named(&own("post_feedforward_layernorm_1", "post_ffw_norm_1"), h)?,
                post_norm_experts: named(
                    &own("post_feedforward_layernorm_2", "post_ffw_norm_2"),
                    h,
                )?,
            })
        }
    };
    let input = match p.ple.0 {
        0 => None,
        dim => Some(LayerInput {
            gate: Linear::load(
                ck,
                dev,
                &own("per_layer_input_gate", "inp_gate"),
                N,
                dim,
                h,
                false,
            )?,
            proj: Linear::load(
                ck,
                dev,
                &own("per_layer_projection", "proj"),
                N,
                h,
                dim,
                false,
            )?,
            post_norm: named(&own("post_per_layer_input_norm", "post_norm"), h)?,
        }),
    };
    let scalar_name = own("layer_scalar", "layer_output_scale.weight");
    let scalar = if ck.has(&scalar_name, N) {
        ck.vector(&scalar_name, N, 1)?[0]
    } else {
        1.0
    };
    Ok(Block {
        input_norm: norm("input_layernorm", h)?,
        attn,
        post_attn_norm: norm("post_attention_layernorm", h)?,
        pre_ffn_norm: norm("pre_feedforward_layernorm", h)?,
        mlp: GatedMlp::load(
            ck,
            dev,
            &format!("{pre}.mlp"),
            N,
            h,
            cfg.intermediate_size,
            ACT,
        )?,
        moe,
        post_ffn_norm: norm("post_feedforward_layernorm", h)?,
        input,
        scalar,
    })
}

impl CausalLm for Gemma4 {
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvPool) -> Result<Vec<f32>, ComputeError> {
        let dev = &self.dev;
        let step = dev.step(&batch.attn_seqs(), kv, self.cfg.num_heads)?;
        let mut x = self.embed.forward(dev, batch.tokens)?;
        let ple = match &self.ple {
            Some(p) => Some((p, self.per_layer_inputs(p, batch.tokens, &x)?)),
            None => None,
        };
        for (i, b) in self.layers.iter().enumerate() {
            let h = b.input_norm.forward(dev, &x)?;
            let mut a = self.attention(&b.attn, &h, kv, i, &step)?;
            b.post_attn_norm.forward_inplace(dev, &mut a)?;
            dev.add_assign(&mut x, &a)?;
            let mut m = self.feed_forward(b, &x)?;
            b.post_ffn_norm.forward_inplace(dev, &mut m)?;
            dev.add_assign(&mut x, &m)?;
            if let (Some(li), Some((p, inputs))) = (&b.input, &ple) {
                let mut g = li.gate.forward(dev, &x)?;
                let slice = dev.columns(inputs, i * p.dim, p.dim)?;
                dev.gated_act(ACT, &mut g, &slice)?;
                let mut y = li.proj.forward(dev, &g)?;
                li.post_norm.forward_inplace(dev, &mut y)?;
                dev.add_assign(&mut x, &y)?;
            }
            if b.scalar != 1.0 {
                dev.scale(&mut x, b.scalar)?;
            }
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
        self.layers
            .iter()
            .map(|b| LayerKvShape {
                n_kv_heads: b.attn.geo.n_kv_heads,
                head_dim: b.attn.geo.head_dim,
            })
            .collect()
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }
}
