//! `qwen3` (dense Qwen 3): the llama decoder with an RMSNorm over each head of Q and K.

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
            qkv_bias: false,
            qk_norm: true,
        },
        RopeStyle::Neox,
    )
}
