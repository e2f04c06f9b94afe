//! Hyper-parameters of the decoder-only transformers of the general runtime, read once from an
//! HF `config.json` or from GGUF metadata, and checked before any weight is bound.

use serde_json::Value;

use crate::weights::GgufFile;
use crate::ModelError;

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear(f32),
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
}

#[derive(Debug, Clone)]
pub struct TransformerConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Base of local (sliding-window) layers where it differs (Gemma 3).
    pub rope_local_theta: f32,
    pub max_position: usize,
    pub tie_embeddings: bool,
    /// Per layer: attends through a sliding window of `sliding_window` positions.
    pub layer_sliding: Vec<bool>,
    pub sliding_window: Option<usize>,
    /// Attention scale is `query_pre_attn_scalar^-0.5` where set, else `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    pub attn_logit_softcap: Option<f32>,
    /// The HF text config as read (`Null` for GGUF), for the keys only one architecture reads
    /// (Gemma 4's per-layer-type geometry, MoE sizes); that architecture checks them at load.
    pub raw: Value,
}

fn get<'a>(cfg: &'a Value, key: &str) -> Option<&'a Value> {
    cfg.get(key).filter(|v| !v.is_null())
}

fn usize_key(cfg: &Value, key: &str) -> Result<usize, ModelError> {
    get(cfg, key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| ModelError::Config {
            key: key.into(),
            reason: "missing or not a non-negative integer".into(),
        })
}

fn f32_key(cfg: &Value, key: &str) -> Option<f32> {
    get(cfg, key).and_then(Value::as_f64).map(|v| v as f32)
}

impl TransformerConfig {
    /// From an HF `config.json` (transformers 4 and 5 spellings).
    pub fn from_hf(cfg: &Value) -> Result<Self, ModelError> {
        let hidden_size = usize_key(cfg, "hidden_size")?;
        let num_heads = usize_key(cfg, "num_attention_heads")?;
        let num_layers = usize_key(cfg, "num_hidden_layers")?;
        let head_dim = match get(cfg, "head_dim") {
            Some(v) => v
                .as_u64()
                .ok_or_else(|| bad("head_dim", "not an integer"))? as usize,
            None => hidden_size / num_heads.max(1),
        };
        let rope = rope_params(cfg);
        let rope_theta = rope.0.unwrap_or(10_000.0);
        let layer_sliding = match get(cfg, "layer_types").and_then(Value::as_array) {
            Some(types) => types
                .iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect(),
            None => match get(cfg, "sliding_window_pattern").and_then(Value::as_u64) {
                Some(p) => (0..num_layers).map(|i| (i + 1) % p as usize != 0).collect(),
                None => vec![false; num_layers],
            },
        };
        let c = Self {
            vocab_size: usize_key(cfg, "vocab_size")?,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads: get(cfg, "num_key_value_heads")
                .and_then(Value::as_u64)
                .map_or(num_heads, |v| v as usize),
            head_dim,
            // MoE-only configs (qwen3_5_moe) have no dense MLP width.
            intermediate_size: usize_key(cfg, "intermediate_size")
                .or_else(|_| usize_key(cfg, "moe_intermediate_size"))?,
            rms_eps: f32_key(cfg, "rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_scaling: rope.1,
            rope_local_theta: rope
                .2
                .or_else(|| f32_key(cfg, "rope_local_base_freq"))
                .unwrap_or(rope_theta),
            max_position: get(cfg, "max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(4096) as usize,
            tie_embeddings: get(cfg, "tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            sliding_window: get(cfg, "sliding_window")
                .and_then(Value::as_u64)
                .map(|v| v as usize),
            layer_sliding,
            query_pre_attn_scalar: f32_key(cfg, "query_pre_attn_scalar"),
            final_logit_softcap: f32_key(cfg, "final_logit_softcapping"),
            attn_logit_softcap: f32_key(cfg, "attn_logit_softcapping"),
            raw: cfg.clone(),
        };
        c.validate()
    }

    /// From GGUF metadata under `{arch}.*` (llama.cpp's key names).
    pub fn from_gguf(g: &GgufFile, arch: &str) -> Result<Self, ModelError> {
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| -> Result<usize, ModelError> {
            g.get(&key(k))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| bad(&key(k), "missing or not an integer"))
        };
        let f = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64()).map(|v| v as f32);
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        // llama.cpp appends multi-token-prediction layers after the model's own blocks
        // (`blk.{n}` .. for `nextn_predict_layers` of them) and counts them in `block_count`.
        let blocks = u("block_count")?;
        let nextn = u("nextn_predict_layers").unwrap_or(0);
        let num_layers = blocks.checked_sub(nextn).ok_or_else(|| {
            bad(
                &key("nextn_predict_layers"),
                &format!("{nextn} is more than block_count {blocks}"),
            )
        })?;
        let head_dim = u("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = g
            .tensor("token_embd.weight")
            .map(|t| t.shape[0])
            .map_err(ModelError::Weights)?;
        let rope_scaling = match (
            g.get(&key("rope.scaling.type")).and_then(|v| v.as_str()),
            f("rope.scaling.factor"),
        ) {
            (Some("linear"), Some(fac)) if fac > 0.0 && fac != 1.0 => RopeScaling::Linear(fac),
            _ => RopeScaling::None,
        };
        let rope_theta = f("rope.freq_base").unwrap_or(10_000.0);
        let sliding_window = u("attention.sliding_window").ok();
        let c = Self {
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads: u("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            // MoE-only models (qwen35moe, deepseek4) write only the expert width.
            intermediate_size: u("feed_forward_length")
                .or_else(|_| u("expert_feed_forward_length"))?,
            rms_eps: f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            rope_local_theta: rope_theta,
            max_position: u("context_length").unwrap_or(4096),
            tie_embeddings: !g.tensor_names().any(|n| n == "output.weight"),
            layer_sliding: vec![false; num_layers],
            sliding_window,
            query_pre_attn_scalar: None,
            final_logit_softcap: f("final_logit_softcapping"),
            attn_logit_softcap: f("attn_logit_softcapping"),
            raw: Value::Null,
        };
        c.validate()
    }

    fn validate(self) -> Result<Self, ModelError> {
        let checks: [(&str, bool); 6] = [
            ("num_attention_heads", self.num_heads > 0),
            (
                "num_key_value_heads",
                self.num_kv_heads > 0 && self.num_heads.is_multiple_of(self.num_kv_heads),
            ),
            (
                "head_dim",
                self.head_dim > 0 && self.head_dim.is_multiple_of(2),
            ),
            ("hidden_size", self.hidden_size > 0),
            ("vocab_size", self.vocab_size > 0),
            ("layer_types", self.layer_sliding.len() == self.num_layers),
        ];
        for (k, ok) in checks {
            if !ok {
                return Err(bad(k, "inconsistent with the other dimensions"));
            }
        }
        if self.layer_sliding.iter().any(|s| *s) && self.sliding_window.is_none() {
            return Err(bad("sliding_window", "sliding layers need a window size"));
        }
        Ok(self)
    }
}

fn bad(key: &str, reason: &str) -> ModelError {
    ModelError::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

/// (global theta, scaling, local theta) from `rope_theta`/`rope_scaling` (transformers 4) or
/// `rope_parameters` (transformers 5, possibly split per layer type).
fn rope_params(cfg: &Value) -> (Option<f32>, RopeScaling, Option<f32>) {
    if let Some(p) = get(cfg, "rope_parameters") {
        if let Some(full) = get(p, "full_attention") {
            let local = get(p, "sliding_attention").and_then(|s| f32_key(s, "rope_theta"));
            return (f32_key(full, "rope_theta"), scaling(full), local);
        }
        return (f32_key(p, "rope_theta"), scaling(p), None);
    }
    let s = get(cfg, "rope_scaling").map_or(RopeScaling::None, scaling);
    (f32_key(cfg, "rope_theta"), s, None)
}

fn scaling(p: &Value) -> RopeScaling {
    let kind = get(p, "rope_type")
        .or_else(|| get(p, "type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = f32_key(p, "factor").unwrap_or(1.0);
    match kind {
        "linear" if factor != 1.0 => RopeScaling::Linear(factor),
        "llama3" => RopeScaling::Llama3 {
            factor,
            low_freq_factor: f32_key(p, "low_freq_factor").unwrap_or(1.0),
            high_freq_factor: f32_key(p, "high_freq_factor").unwrap_or(4.0),
            original_max_position: f32_key(p, "original_max_position_embeddings").unwrap_or(8192.0),
        },
        _ => RopeScaling::None,
    }
}
