//! DeepSeek V4's hyper-parameters beyond [`TransformerConfig`]: the attention schedule, the
//! compression ratios, mHC, MoE and indexer sizes and the two RoPE tables, read once from
//! `config.json` (transformers 5 keys and the legacy ones its config folds in), or from a
//! `deepseek4` GGUF's metadata restated as those keys by [`adjust_gguf_config`].

use serde_json::{json, Map, Value};

use crate::config::TransformerConfig;
use crate::weights::{GgufFile, GgufValue};
use crate::ModelError;

/// Where [`adjust_gguf_config`] lists the GGUF keys it needed and did not find.
const GGUF_MISSING: &str = "gguf_missing_keys";

/// llama.cpp's `deepseek4` metadata (its converter's `DeepseekV4Model`) restated as the
/// released config's keys, which [`V4Config::from_hf`] reads: per-layer `compress_ratios`,
/// `num_hash_layers`, the YaRN of the compressed branch under `rope_scaling`. The converter
/// leaves the MTP module out of the main file (`--mtp` writes it alone), so none is read.
/// Keys it cannot find are listed under [`GGUF_MISSING`] so the load names them.
pub fn adjust_gguf_config(cfg: &mut TransformerConfig, g: &GgufFile) {
    let arch = g.architecture().unwrap_or("deepseek4").to_string();
    let mut missing = Vec::new();
    let mut raw = Map::new();
    let mut copy = |gguf: &str, hf: &str, first_of_array: bool| {
        let key = format!("{arch}.{gguf}");
        let v = g.get(&key).and_then(|v| match (v, first_of_array) {
            (GgufValue::Array(a), true) => a.first(),
            _ => Some(v),
        });
        match v.and_then(gguf_json) {
            Some(j) => {
                raw.insert(hf.to_string(), j);
            }
            None => missing.push(key),
        }
    };
    for (gguf, hf) in [
        ("attention.compress_ratios", "compress_ratios"),
        ("hash_layer_count", "num_hash_layers"),
        ("rope.dimension_count", "qk_rope_head_dim"),
        ("attention.q_lora_rank", "q_lora_rank"),
        ("attention.output_group_count", "o_groups"),
        ("attention.output_lora_rank", "o_lora_rank"),
        ("attention.sliding_window", "sliding_window"),
        ("hyper_connection.count", "hc_mult"),
        ("hyper_connection.sinkhorn_iterations", "hc_sinkhorn_iters"),
        ("hyper_connection.epsilon", "hc_eps"),
        ("expert_count", "n_routed_experts"),
        ("expert_used_count", "num_experts_per_tok"),
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_weights_scale", "routed_scaling_factor"),
        ("attention.indexer.head_count", "index_n_heads"),
        ("attention.indexer.key_length", "index_head_dim"),
        ("attention.indexer.top_k", "index_topk"),
        ("attention.compress_rope_freq_base", "compress_rope_theta"),
        ("rope.freq_base", "rope_theta"),
    ] {
        copy(gguf, hf, false);
    }
    copy("swiglu_clamp_exp", "swiglu_limit", true);
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS is 4.
    let gating = g
        .get(&format!("{arch}.expert_gating_func"))
        .and_then(|v| v.as_u64());
    raw.insert(
        "scoring_func".into(),
        json!(match gating {
            Some(4) => "sqrtsoftplus".to_string(),
            other => format!("llama.cpp expert_gating_func {other:?}"),
        }),
    );
    let rope = |k: &str| {
        g.get(&format!("{arch}.rope.scaling.{k}"))
            .and_then(gguf_json)
    };
    if let Some(kind) = rope("type") {
        let mut yarn = Map::new();
        yarn.insert("type".into(), kind);
        for (gguf, hf) in [
            ("factor", "factor"),
            (
                "original_context_length",
                "original_max_position_embeddings",
            ),
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
        ] {
            if let Some(v) = rope(gguf) {
                yarn.insert(hf.into(), v);
            }
        }
        raw.insert("rope_scaling".into(), Value::Object(yarn));
    }
    raw.insert("num_nextn_predict_layers".into(), json!(0));
    raw.insert(GGUF_MISSING.into(), json!(missing));
    cfg.raw = Value::Object(raw);
}

fn gguf_json(v: &GgufValue) -> Option<Value> {
    Some(match v {
        GgufValue::Array(a) => Value::Array(a.iter().map(gguf_json).collect::<Option<_>>()?),
        GgufValue::Bool(b) => json!(b),
        GgufValue::Str(s) => json!(s),
        GgufValue::F32(_) | GgufValue::F64(_) => json!(v.as_f64()?),
        _ => json!(v.as_i64()?),
    })
}

/// Which long-range branch a layer adds to its sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKind {
    Sliding,
    /// Compressed sparse attention: overlapping windows, lightning-indexer top-k.
    Csa,
    /// Heavily compressed attention: disjoint windows, every compressed row.
    Hca,
}

/// DeepSeek V4's hyper-parameters beyond [`TransformerConfig`], read from `config.json` once.
#[derive(Debug, Clone)]
pub struct V4Config {
    pub hidden: usize,
    pub vocab: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    /// Trailing dims of each head that RoPE rotates.
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub eps: f32,
    pub window: usize,
    pub kinds: Vec<AttnKind>,
    /// The MTP blocks' attention, where a legacy `compress_ratios` lists them after the layers.
    pub mtp_kinds: Vec<AttnKind>,
    pub hash_routed: Vec<bool>,
    pub csa_ratio: usize,
    pub hca_ratio: usize,
    pub hc_mult: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub experts: usize,
    pub top_k: usize,
    pub moe_inter: usize,
    pub routed_scale: f32,
    pub swiglu_limit: f32,
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    pub mtp_layers: usize,
    /// Inverse frequencies of the sliding layers' RoPE and of the compressed branches' RoPE.
    pub main_inv_freq: Vec<f32>,
    pub compress_inv_freq: Vec<f32>,
}

pub(super) fn cfg_err(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn uint(v: &Value, key: &str, default: Option<usize>) -> Result<usize, ModelError> {
    match get(v, key) {
        Some(x) => x
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| cfg_err(key, "not a non-negative integer")),
        None => default.ok_or_else(|| cfg_err(key, "missing")),
    }
}

fn float(v: &Value, key: &str, default: f32) -> f32 {
    get(v, key)
        .and_then(Value::as_f64)
        .map_or(default, |x| x as f32)
}

impl V4Config {
    /// Reads transformers 5's keys and the legacy ones its `__post_init__` folds in
    /// (`compress_ratios`, `num_hash_layers`, `compress_rate_*`, `qk_rope_head_dim`).
    pub fn from_hf(c: &TransformerConfig) -> Result<Self, ModelError> {
        let raw = &c.raw;
        if let Some(missing) = get(raw, GGUF_MISSING).and_then(Value::as_array) {
            if !missing.is_empty() {
                let keys: Vec<&str> = missing.iter().filter_map(Value::as_str).collect();
                let why = format!("missing {} (a deepseek4 GGUF has them)", keys.join(", "));
                return Err(cfg_err("GGUF metadata", why));
            }
        }
        let n = c.num_layers;
        let head_dim = c.head_dim;
        let rate = |kind: &str, legacy: &str, default: usize| match get(raw, "compress_rates") {
            Some(rates) if get(rates, kind).is_some() => uint(rates, kind, None),
            _ => uint(raw, legacy, Some(default)),
        };
        let csa_ratio = rate("compressed_sparse_attention", "compress_rate_csa", 4)?;
        let hca_default = legacy_hca_ratio(raw)?.unwrap_or(128);
        let hca_ratio = rate(
            "heavily_compressed_attention",
            "compress_rate_hca",
            hca_default,
        )?;
        let mut kinds = layer_kinds(raw, n)?;
        let mtp_kinds = kinds.split_off(n.min(kinds.len()));
        let hash_routed = match get(raw, "mlp_layer_types").and_then(Value::as_array) {
            Some(t) => t.iter().map(|x| x.as_str() == Some("hash_moe")).collect(),
            None => {
                let h = uint(raw, "num_hash_layers", Some(3))?;
                (0..n).map(|i| i < h).collect()
            }
        };
        let rope_dim = match get(raw, "partial_rotary_factor").and_then(Value::as_f64) {
            Some(f) => (head_dim as f64 * f) as usize,
            None => uint(raw, "qk_rope_head_dim", Some(64))?,
        };
        let scoring = get(raw, "scoring_func")
            .and_then(Value::as_str)
            .unwrap_or("sqrtsoftplus");
        if scoring != "sqrtsoftplus" {
            return Err(cfg_err(
                "scoring_func",
                format!("{scoring} (supported: sqrtsoftplus)"),
            ));
        }
        let (main, compress) = rope_tables(raw, rope_dim, c.max_position)?;
        let cfg = Self {
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            n_heads: c.num_heads,
            head_dim,
            rope_dim,
            q_lora_rank: uint(raw, "q_lora_rank", None)?,
            o_groups: uint(raw, "o_groups", None)?,
            o_lora_rank: uint(raw, "o_lora_rank", None)?,
            eps: c.rms_eps,
            window: uint(raw, "sliding_window", Some(128))?,
            kinds,
            mtp_kinds,
            hash_routed,
            csa_ratio,
            hca_ratio,
            hc_mult: uint(raw, "hc_mult", Some(4))?,
            sinkhorn_iters: uint(raw, "hc_sinkhorn_iters", Some(20))?,
            hc_eps: float(raw, "hc_eps", 1e-6),
            experts: uint(raw, "n_routed_experts", None)?,
            top_k: uint(raw, "num_experts_per_tok", None)?,
            moe_inter: uint(raw, "moe_intermediate_size", None)?,
            routed_scale: float(raw, "routed_scaling_factor", 1.5),
            swiglu_limit: float(raw, "swiglu_limit", 10.0),
            index_heads: uint(raw, "index_n_heads", Some(64))?,
            index_dim: uint(raw, "index_head_dim", Some(128))?,
            index_topk: uint(raw, "index_topk", Some(512))?,
            mtp_layers: uint(raw, "num_nextn_predict_layers", Some(0))?,
            main_inv_freq: main,
            compress_inv_freq: compress,
        };
        cfg.validate(n)
    }

    fn validate(self, n_layers: usize) -> Result<Self, ModelError> {
        let checks: [(&str, bool); 9] = [
            ("layer_types", self.kinds.len() == n_layers),
            ("mlp_layer_types", self.hash_routed.len() == n_layers),
            (
                "partial_rotary_factor",
                self.rope_dim.is_multiple_of(2)
                    && self.rope_dim <= self.head_dim
                    && self.rope_dim <= self.index_dim,
            ),
            (
                "o_groups",
                self.o_groups > 0 && self.n_heads.is_multiple_of(self.o_groups),
            ),
            ("hc_mult", self.hc_mult > 0),
            ("hc_sinkhorn_iters", self.sinkhorn_iters > 0),
            (
                "num_experts_per_tok",
                self.top_k > 0 && self.top_k <= self.experts,
            ),
            ("compress_rates", self.csa_ratio > 0 && self.hca_ratio > 0),
            ("sliding_window", self.window > 0),
        ];
        for (key, ok) in checks {
            if !ok {
                return Err(cfg_err(key, "inconsistent with the other dimensions"));
            }
        }
        Ok(self)
    }

    pub fn ratio(&self, kind: AttnKind) -> usize {
        match kind {
            AttnKind::Sliding => 0,
            AttnKind::Csa => self.csa_ratio,
            AttnKind::Hca => self.hca_ratio,
        }
    }
}

/// The HCA ratio a legacy `compress_ratios` list implies (its one value other than 0 and 4).
fn legacy_hca_ratio(raw: &Value) -> Result<Option<usize>, ModelError> {
    let Some(ratios) = get(raw, "compress_ratios").and_then(Value::as_array) else {
        return Ok(None);
    };
    let mut hca: Vec<u64> = ratios
        .iter()
        .filter_map(Value::as_u64)
        .filter(|&r| r != 0 && r != 4)
        .collect();
    hca.sort_unstable();
    hca.dedup();
    match hca.as_slice() {
        [] => Ok(None),
        [r] => Ok(Some(*r as usize)),
        more => Err(cfg_err(
            "compress_ratios",
            format!("HCA layers with different ratios {more:?} (one ratio is supported)"),
        )),
    }
}

fn layer_kinds(raw: &Value, n: usize) -> Result<Vec<AttnKind>, ModelError> {
    if let Some(types) = get(raw, "layer_types").and_then(Value::as_array) {
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(AttnKind::Sliding),
                Some("compressed_sparse_attention") => Ok(AttnKind::Csa),
                Some("heavily_compressed_attention") => Ok(AttnKind::Hca),
                other => Err(cfg_err("layer_types", format!("unknown entry {other:?}"))),
            })
            .collect();
    }
    if let Some(ratios) = get(raw, "compress_ratios").and_then(Value::as_array) {
        return ratios
            .iter()
            .map(|r| match r.as_u64() {
                // DeepSeek's own rule: ratio 4 overlaps windows and has the indexer.
                Some(0) => Ok(AttnKind::Sliding),
                Some(4) => Ok(AttnKind::Csa),
                Some(_) => Ok(AttnKind::Hca),
                None => Err(cfg_err("compress_ratios", "entries must be integers")),
            })
            .collect();
    }
    // transformers' default: two HCA layers, then CSA/HCA alternating.
    Ok((0..n)
        .map(|i| match i {
            0 | 1 => AttnKind::Hca,
            _ if (i - 2) % 2 == 1 => AttnKind::Csa,
            _ => AttnKind::Hca,
        })
        .collect())
}

/// Inverse frequencies of the `main` (plain, `rope_theta`) and `compress` (`compress_rope_theta`,
/// YaRN where configured, cos/sin unscaled) RoPEs, in f32 as transformers computes them.
fn rope_tables(
    raw: &Value,
    rope_dim: usize,
    max_pos: usize,
) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
    let params = get(raw, "rope_parameters");
    let nested = |k: &str| params.and_then(|p| get(p, k)).filter(|v| v.is_object());
    let main_theta = nested("main").map_or(float(raw, "rope_theta", 10_000.0), |m| {
        float(m, "rope_theta", 10_000.0)
    });
    let flat = params
        .filter(|_| nested("compress").is_none())
        .or_else(|| get(raw, "rope_scaling"));
    let compress = nested("compress").or(flat);
    let compress_theta = nested("compress")
        .map_or(float(raw, "compress_rope_theta", 160_000.0), |c| {
            float(c, "rope_theta", 160_000.0)
        });
    let main = default_inv_freq(main_theta, rope_dim);
    let kind = compress
        .and_then(|c| get(c, "rope_type").or_else(|| get(c, "type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let comp = match (kind, compress) {
        ("yarn", Some(c)) => yarn_inv_freq(c, compress_theta, rope_dim, max_pos)?,
        ("default", _) => default_inv_freq(compress_theta, rope_dim),
        (other, _) => {
            return Err(cfg_err(
                "rope_parameters.compress.rope_type",
                format!("{other} (supported: default, yarn)"),
            ))
        }
    };
    Ok((main, comp))
}

fn default_inv_freq(theta: f32, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32))
        .collect()
}

/// transformers' `_compute_yarn_parameters` (truncated correction range).
fn yarn_inv_freq(
    p: &Value,
    theta: f32,
    dim: usize,
    max_pos: usize,
) -> Result<Vec<f32>, ModelError> {
    let orig = get(p, "original_max_position_embeddings")
        .and_then(Value::as_f64)
        .ok_or_else(|| {
            cfg_err(
                "rope_parameters.original_max_position_embeddings",
                "missing",
            )
        })?;
    let factor = get(p, "factor")
        .and_then(Value::as_f64)
        .unwrap_or(max_pos as f64 / orig);
    // transformers forces 1 (cos/sin unscaled) unless the checkpoint names another factor.
    if let Some(a) = get(p, "attention_factor").and_then(Value::as_f64) {
        if a != 1.0 {
            return Err(cfg_err(
                "rope_parameters.compress.attention_factor",
                format!("{a} (supported: 1)"),
            ));
        }
    }
    let beta_fast = get(p, "beta_fast").and_then(Value::as_f64).unwrap_or(32.0);
    let beta_slow = get(p, "beta_slow").and_then(Value::as_f64).unwrap_or(1.0);
    let base = theta as f64;
    let corr = |rot: f64| {
        dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = corr(beta_fast).floor().max(0.0);
    let mut high = corr(beta_slow).ceil().min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    Ok((0..dim / 2)
        .map(|i| {
            let pos_freq = theta.powf((2 * i) as f32 / dim as f32);
            let extrap = 1.0 / pos_freq;
            let interp = 1.0 / (factor as f32 * pos_freq);
            let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            interp * (1.0 - keep) + extrap * keep
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::testfiles::{GgufBuilder, TestTensor};

    /// A deepseek4 GGUF lacking keys is refused naming them (not read with HF's defaults),
    /// and the keys it has land where the released config keeps them.
    #[test]
    fn gguf_metadata_is_restated_or_named_missing() {
        let u = |v: u32| GgufValue::U32(v);
        let ratios = GgufValue::Array(vec![u(0), u(4), u(128)]);
        let bytes = GgufBuilder::new()
            .kv("general.architecture", GgufValue::Str("deepseek4".into()))
            .kv("deepseek4.embedding_length", u(32))
            .kv("deepseek4.attention.head_count", u(2))
            .kv("deepseek4.block_count", u(3))
            .kv("deepseek4.expert_feed_forward_length", u(32))
            .kv("deepseek4.attention.compress_ratios", ratios)
            .kv("deepseek4.expert_gating_func", u(4))
            .kv(
                "deepseek4.swiglu_clamp_exp",
                GgufValue::Array(vec![GgufValue::F32(7.0); 3]),
            )
            .tensor(TestTensor::f32("token_embd.weight", &[32, 2], &[0.0; 64]))
            .build();
        let g = GgufFile::from_bytes(bytes).expect("valid file");
        let mut cfg = TransformerConfig::from_gguf(&g, "deepseek4").expect("base config");
        adjust_gguf_config(&mut cfg, &g);
        assert_eq!(cfg.raw["compress_ratios"], json!([0, 4, 128]));
        assert_eq!(cfg.raw["swiglu_limit"], json!(7.0));
        assert_eq!(cfg.raw["scoring_func"], json!("sqrtsoftplus"));
        let msg = V4Config::from_hf(&cfg)
            .expect_err("keys missing")
            .to_string();
        for key in [
            "deepseek4.hash_layer_count",
            "deepseek4.hyper_connection.count",
        ] {
            assert!(msg.contains(key), "{msg}");
        }
        assert!(!msg.contains("compress_ratios"), "{msg}");
    }
}
