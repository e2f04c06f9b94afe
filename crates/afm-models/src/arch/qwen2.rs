//! `qwen2` (Qwen 2 / 2.5): the llama decoder with biases on the Q, K and V projections.

use afm_runtime::compute::Device;
use afm_runtime::ops::RopeStyle;

use super::llama::{Llama, LlamaOptions};
use crate::checkpoint::Checkpoint;
use crate::config::TransformerConfig;
use crate::ModelError;

pub fn load(ck: &Checkpoint, cfg: &TransformerConfig, dev: &Device) -> Result<Llama, ModelError> {
    Llama::load(
        ck,
        cfg,
        dev,
        LlamaOptions {
            qkv_bias: true,
            qk_norm: false,
        },
        RopeStyle::Neox,
    )
}
