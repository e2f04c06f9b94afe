//! The architectures of the general runtime: one file each, one row each in [`ARCHITECTURES`].

pub mod deepseek_v4;
pub mod gemma3;
pub mod gemma4;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_moe;

use afm_runtime::compute::Device;
use afm_runtime::ops::RopeStyle;

use crate::checkpoint::Checkpoint;
use crate::config::TransformerConfig;
use crate::forward::CausalLm;
use crate::weights::GgufFile;
use crate::ModelError;

/// Binds a checkpoint's weights into the architecture's model, placed on the device.
type LoadFn = fn(&Checkpoint, &TransformerConfig, &Device) -> Result<Box<dyn CausalLm>, ModelError>;

pub struct Architecture {
    /// HF `model_type` values.
    pub hf_types: &'static [&'static str],
    /// GGUF `general.architecture`.
    pub gguf_arch: &'static str,
    /// Fills in what llama.cpp keeps out of the GGUF metadata.
    pub adjust_gguf: fn(&mut TransformerConfig, &GgufFile),
    pub load: LoadFn,
}

fn no_adjust(_: &mut TransformerConfig, _: &GgufFile) {}

pub const ARCHITECTURES: &[Architecture] = &[
    Architecture {
        hf_types: &["llama"],
        gguf_arch: "llama",
        adjust_gguf: no_adjust,
        load: |ck, cfg, dev| {
            // llama.cpp permutes llama's Q/K rows so GGML can rotate interleaved pairs.
            let style = if ck.is_gguf() {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            };
            Ok(Box::new(llama::Llama::load(
                ck,
                cfg,
                dev,
                Default::default(),
                style,
            )?))
        },
    },
    Architecture {
        hf_types: &["qwen2"],
        gguf_arch: "qwen2",
        adjust_gguf: no_adjust,
        load: |ck, cfg, dev| Ok(Box::new(qwen2::load(ck, cfg, dev)?)),
    },
    Architecture {
        hf_types: &["qwen3"],
        gguf_arch: "qwen3",
        adjust_gguf: no_adjust,
        load: |ck, cfg, dev| Ok(Box::new(qwen3::load(ck, cfg, dev)?)),
    },
    Architecture {
        hf_types: &["gemma3", "gemma3_text"],
        gguf_arch: "gemma3",
        adjust_gguf: gemma3::adjust_gguf_config,
        load: |ck, cfg, dev| Ok(Box::new(gemma3::Gemma3::load(ck, cfg, dev)?)),
    },
    Architecture {
        hf_types: &["qwen3_5", "qwen3_5_text"],
        gguf_arch: "qwen35",
        adjust_gguf: qwen3_5::adjust_gguf_config,
        load: |ck, cfg, dev| Ok(Box::new(qwen3_5::Qwen35::load(ck, cfg, dev)?)),
    },
    Architecture {
        hf_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        gguf_arch: "qwen35moe",
        adjust_gguf: qwen3_5::adjust_gguf_config,
        load: |ck, cfg, dev| Ok(Box::new(qwen3_5::Qwen35::load(ck, cfg, dev)?)),
    },
    Architecture {
        hf_types: &["gemma4", "gemma4_text"],
        gguf_arch: "gemma4",
        adjust_gguf: gemma4::adjust_gguf_config,
        load: |ck, cfg, dev| Ok(Box::new(gemma4::Gemma4::load(ck, cfg, dev)?)),
    },
    Architecture {
        hf_types: &["deepseek_v4"],
        gguf_arch: "deepseek4",
        adjust_gguf: deepseek_v4::adjust_gguf_config,
        load: |ck, cfg, dev| Ok(Box::new(deepseek_v4::DeepseekV4::load(ck, cfg, dev)?)),
    },
];

pub fn supported_names() -> String {
    ARCHITECTURES
        .iter()
        .flat_map(|a| a.hf_types.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}
