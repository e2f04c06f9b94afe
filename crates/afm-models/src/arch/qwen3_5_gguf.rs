//! What a `qwen35` / `qwen35moe` GGUF (llama.cpp's converter, `Qwen3_5TextModel`) needs beyond
//! the safetensors path of `qwen3_5.rs`: its metadata restated as the HF config keys, and its
//! tensor names. The value changes the converter makes (1 + w norms, −exp(A_log), tiled value
//! heads) are taken as stored by `qwen3_5.rs` itself.

use crate::config::TransformerConfig;
use crate::weights::GgufFile;

/// Where [`adjust_gguf_config`] lists the GGUF keys it needed and did not find.
pub(super) const GGUF_MISSING: &str = "gguf_missing_keys";

/// llama.cpp's `qwen35` / `qwen35moe` metadata (its converter's `Qwen3_5TextModel`) restated
/// as the HF keys [`Qwen35Config::from_hf`] reads. Keys it cannot find are listed under
/// [`GGUF_MISSING`], so the load fails naming them instead of falling back to HF defaults.
pub fn adjust_gguf_config(cfg: &mut TransformerConfig, g: &GgufFile) {
    let arch = g.architecture().unwrap_or("qwen35").to_string();
    let mut missing = Vec::new();
    let mut uint = |k: &str| {
        let key = format!("{arch}.{k}");
        let v = g.get(&key).and_then(|v| v.as_u64());
        if v.is_none() {
            missing.push(key);
        }
        v.unwrap_or(0)
    };
    let (kernel, k_dim) = (uint("ssm.conv_kernel"), uint("ssm.state_size"));
    let (k_heads, v_heads) = (uint("ssm.group_count"), uint("ssm.time_step_rank"));
    let inner = uint("ssm.inner_size");
    let rope_dims = uint("rope.dimension_count");
    let moe = g.get(&format!("{arch}.expert_count")).is_some();
    let experts = if moe {
        serde_json::json!({
            "num_experts": uint("expert_count"),
            "num_experts_per_tok": uint("expert_used_count"),
            "moe_intermediate_size": uint("expert_feed_forward_length"),
            "shared_expert_intermediate_size": uint("expert_shared_feed_forward_length"),
        })
    } else {
        serde_json::json!({})
    };
    let recurrent = g
        .get(&format!("{arch}.attention.recurrent_layers"))
        .and_then(|v| v.as_array());
    // llama.cpp's rule where the per-layer flags are absent: every `full_attention_interval`-th
    // layer (default 4) is full attention; `Qwen35Config::from_hf` applies the same rule.
    let interval = g
        .get(&format!("{arch}.full_attention_interval"))
        .and_then(|v| v.as_u64())
        .unwrap_or(4);
    let layer_types: Option<Vec<&str>> = recurrent.map(|r| {
        r.iter()
            .take(cfg.num_layers)
            .map(|b| match b.as_bool() {
                Some(true) => "linear_attention",
                _ => "full_attention",
            })
            .collect()
    });
    let mut raw = serde_json::json!({
        "layer_types": layer_types,
        "full_attention_interval": interval,
        "partial_rotary_factor": rope_dims as f64 / cfg.head_dim.max(1) as f64,
        "linear_conv_kernel_dim": kernel,
        "linear_key_head_dim": k_dim,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner / v_heads.max(1),
        GGUF_MISSING: missing,
    });
    if let (Some(r), Some(e)) = (raw.as_object_mut(), experts.as_object()) {
        r.extend(e.clone());
    }
    cfg.raw = raw;
}

/// An HF name as this file asks for it (`layers.0.linear_attn.A_log`, `mtp.fc.weight`) →
/// llama.cpp's GGUF name. `n` is the model's own block count: MTP blocks follow it.
pub fn gguf_name(hf: &str, n: usize) -> String {
    let (stem, suffix) = match hf.strip_suffix(".weight") {
        Some(stem) => (stem, ".weight"),
        None => (hf, ""),
    };
    let block = |rest: &str, first: usize| -> Option<(usize, String)> {
        let (i, tail) = rest.split_once('.')?;
        Some((first + i.parse::<usize>().ok()?, tail.to_string()))
    };
    let (b, tail) = if let Some(r) = stem.strip_prefix("layers.") {
        block(r, 0)
    } else if let Some(r) = stem.strip_prefix("mtp.layers.") {
        block(r, n)
    } else {
        stem.strip_prefix("mtp.").map(|r| (n, format!("mtp.{r}")))
    }
    .unwrap_or((usize::MAX, String::new()));
    let short = match tail.as_str() {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "post_attention_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "linear_attn.in_proj_qkv" => "attn_qkv",
        "linear_attn.in_proj_z" => "attn_gate",
        "linear_attn.in_proj_b" => "ssm_beta",
        "linear_attn.in_proj_a" => "ssm_alpha",
        "linear_attn.out_proj" => "ssm_out",
        "linear_attn.norm" => "ssm_norm",
        "linear_attn.conv1d" => "ssm_conv1d",
        "linear_attn.A_log" => "ssm_a",
        "linear_attn.dt_bias" => "ssm_dt.bias",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" => "ffn_gate_inp",
        // Whole stacked tensors, named without a suffix in HF's fused layout: always `.weight`.
        "mlp.experts.gate_proj" => return format!("blk.{b}.ffn_gate_exps.weight"),
        "mlp.experts.up_proj" => return format!("blk.{b}.ffn_up_exps.weight"),
        "mlp.experts.down_proj" => return format!("blk.{b}.ffn_down_exps.weight"),
        // --fuse-gate-up-exps: `[E, 2I, H]`, gate rows first, as HF's fused tensor.
        "mlp.experts.gate_up_proj" => return format!("blk.{b}.ffn_gate_up_exps.weight"),
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        "mtp.fc" => "nextn.eh_proj",
        "mtp.pre_fc_norm_embedding" => "nextn.enorm",
        "mtp.pre_fc_norm_hidden" => "nextn.hnorm",
        "mtp.norm" => "nextn.shared_head_norm",
        _ => {
            let top = match stem {
                "embed_tokens" => "token_embd",
                "norm" => "output_norm",
                "lm_head" => "output",
                _ => return hf.to_string(),
            };
            return format!("{top}{suffix}");
        }
    };
    format!("blk.{b}.{short}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::qwen3_5::Qwen35Config;
    use crate::weights::testfiles::{GgufBuilder, TestTensor};
    use crate::weights::GgufValue;

    /// Names as llama.cpp's tensor map and its converter's MTP remapping write them.
    #[test]
    fn hf_names_map_to_llama_cpp_names() {
        for (hf, want) in [
            ("layers.2.linear_attn.A_log", "blk.2.ssm_a"),
            ("layers.2.linear_attn.dt_bias", "blk.2.ssm_dt.bias"),
            (
                "layers.2.linear_attn.conv1d.weight",
                "blk.2.ssm_conv1d.weight",
            ),
            ("layers.2.linear_attn.in_proj_z", "blk.2.attn_gate"),
            (
                "layers.0.post_attention_layernorm",
                "blk.0.post_attention_norm",
            ),
            (
                "layers.1.mlp.experts.gate_up_proj",
                "blk.1.ffn_gate_up_exps.weight",
            ),
            (
                "layers.1.mlp.shared_expert_gate",
                "blk.1.ffn_gate_inp_shexp",
            ),
            ("mtp.fc.weight", "blk.4.nextn.eh_proj.weight"),
            ("mtp.norm", "blk.4.nextn.shared_head_norm"),
            ("mtp.layers.0.self_attn.q_proj", "blk.4.attn_q"),
            ("embed_tokens.weight", "token_embd.weight"),
            ("lm_head", "output"),
            ("layers.0.something_new", "layers.0.something_new"),
        ] {
            assert_eq!(gguf_name(hf, 4), want, "{hf}");
        }
    }

    /// A GGUF lacking the DeltaNet keys is refused naming each missing key, rather than
    /// loaded with HF's default sizes.
    #[test]
    fn missing_metadata_is_named() {
        let u = |v: u32| GgufValue::U32(v);
        let bytes = GgufBuilder::new()
            .kv("general.architecture", GgufValue::Str("qwen35".into()))
            .kv("qwen35.embedding_length", u(32))
            .kv("qwen35.attention.head_count", u(4))
            .kv("qwen35.block_count", u(2))
            .kv("qwen35.feed_forward_length", u(64))
            .kv("qwen35.ssm.conv_kernel", u(4))
            .kv("qwen35.rope.dimension_count", u(4))
            .tensor(TestTensor::f32("token_embd.weight", &[32, 2], &[0.0; 64]))
            .build();
        let g = GgufFile::from_bytes(bytes).expect("valid file");
        let mut cfg = TransformerConfig::from_gguf(&g, "qwen35").expect("base config");
        adjust_gguf_config(&mut cfg, &g);
        let err = Qwen35Config::from_hf(&cfg).expect_err("keys are missing");
        let msg = err.to_string();
        for key in [
            "qwen35.ssm.state_size",
            "qwen35.ssm.group_count",
            "qwen35.ssm.time_step_rank",
            "qwen35.ssm.inner_size",
        ] {
            assert!(msg.contains(key), "{msg}");
        }
        // Present, or (the layer pattern) derived as llama.cpp derives it.
        assert!(
            !msg.contains("conv_kernel") && !msg.contains("recurrent"),
            "{msg}"
        );
    }

    /// Without `attention.recurrent_layers` the pattern comes from `full_attention_interval`,
    /// as llama.cpp derives it: every interval-th layer is full attention.
    #[test]
    fn layer_pattern_falls_back_to_the_interval() {
        let u = |v: u32| GgufValue::U32(v);
        let mut b = GgufBuilder::new()
            .kv("general.architecture", GgufValue::Str("qwen35".into()))
            .tensor(TestTensor::f32("token_embd.weight", &[32, 2], &[0.0; 64]));
        for (k, v) in [
            ("embedding_length", 32),
            ("attention.head_count", 4),
            ("attention.key_length", 16),
            ("block_count", 4),
            ("feed_forward_length", 64),
            ("ssm.conv_kernel", 4),
            ("ssm.state_size", 16),
            ("ssm.group_count", 2),
            ("ssm.time_step_rank", 4),
            ("ssm.inner_size", 64),
            ("rope.dimension_count", 4),
            ("full_attention_interval", 2),
        ] {
            b = b.kv(&format!("qwen35.{k}"), u(v));
        }
        let g = GgufFile::from_bytes(b.build()).expect("valid file");
        let mut cfg = TransformerConfig::from_gguf(&g, "qwen35").expect("base config");
        adjust_gguf_config(&mut cfg, &g);
        let q = Qwen35Config::from_hf(&cfg).expect("complete metadata");
        assert_eq!(q.full_attention, [false, true, false, true]);
        assert_eq!((q.rotary_dims, q.k_dim, q.v_dim, q.v_heads), (4, 16, 16, 4));
    }
}
