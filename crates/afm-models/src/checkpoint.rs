//! Typed access to a checkpoint's tensors by their Hugging Face names, whichever file holds them.
//! GGUF files use llama.cpp's names (`blk.3.attn_q.weight`); the mapping lives here, once.

use afm_runtime::WeightMatrix;

use crate::weights::{TensorView, WeightSource};
use crate::ModelError;

pub struct Checkpoint<'a> {
    source: &'a WeightSource,
    /// Prepended to HF names (`model.` for most, `model.language_model.` for multimodal wrappers).
    prefix: String,
}

/// How a GGUF names `post_attention_layernorm`: llama-like models use it before the MLP (`ffn_norm`);
/// Gemma uses it after attention (`post_attention_norm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormNaming {
    Llama,
    Gemma,
}

impl<'a> Checkpoint<'a> {
    pub fn new(source: &'a WeightSource, prefix: &str) -> Self {
        Self {
            source,
            prefix: prefix.to_string(),
        }
    }

    pub fn is_gguf(&self) -> bool {
        matches!(self.source, WeightSource::Gguf(_))
    }

    fn resolve(&self, name: &str, naming: NormNaming) -> String {
        match self.source {
            WeightSource::Gguf(_) => gguf_name(name, naming),
            WeightSource::Safetensors(_) if name == "lm_head.weight" => name.to_string(),
            WeightSource::Safetensors(_) => format!("{}{name}", self.prefix),
        }
    }

    pub fn has(&self, name: &str, naming: NormNaming) -> bool {
        self.source.contains(&self.resolve(name, naming))
    }

    pub fn view(&self, name: &str, naming: NormNaming) -> Result<TensorView, ModelError> {
        Ok(self.source.tensor(&self.resolve(name, naming))?)
    }

    /// The same checkpoint with names taken as stored, without the `model.` prefix (DeepSeek's
    /// own checkpoints name `layers.0.attn.wq_a.weight`, `head.weight` at the top level).
    pub fn unprefixed(&self) -> Checkpoint<'a> {
        Checkpoint {
            source: self.source,
            prefix: String::new(),
        }
    }

    /// An integer tensor (safetensors I64/I32) as i64 values with its shape.
    pub fn integers(
        &self,
        name: &str,
        naming: NormNaming,
    ) -> Result<(Vec<usize>, Vec<i64>), ModelError> {
        Ok(self.source.integers(&self.resolve(name, naming))?)
    }

    /// A `[rows, cols]` matrix, shape checked.
    pub fn matrix(
        &self,
        name: &str,
        naming: NormNaming,
        rows: usize,
        cols: usize,
    ) -> Result<WeightMatrix, ModelError> {
        let v = self.view(name, naming)?;
        if v.shape != [rows, cols] {
            return Err(ModelError::Shape {
                name: v.name,
                want: vec![rows, cols],
                got: v.shape,
            });
        }
        Ok(v.into_matrix()?)
    }

    /// A 1-D tensor of `len` values as f32, shape checked.
    pub fn vector(
        &self,
        name: &str,
        naming: NormNaming,
        len: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let v = self.view(name, naming)?;
        if v.numel() != len || v.shape.len() != 1 {
            return Err(ModelError::Shape {
                name: v.name,
                want: vec![len],
                got: v.shape,
            });
        }
        Ok(v.to_f32()?)
    }
}

/// HF name (without the `model.` prefix, e.g. `layers.3.self_attn.q_proj.weight`) → GGUF name.
fn gguf_name(name: &str, naming: NormNaming) -> String {
    match name {
        "embed_tokens.weight" => return "token_embd.weight".into(),
        "norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let Some(rest) = name.strip_prefix("layers.") else {
        return name.into();
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return name.into();
    };
    let (module, suffix) = tail.rsplit_once('.').unwrap_or((tail, ""));
    let short = match (module, naming) {
        ("input_layernorm", _) => "attn_norm",
        ("post_attention_layernorm", NormNaming::Llama) => "ffn_norm",
        ("post_attention_layernorm", NormNaming::Gemma) => "post_attention_norm",
        ("pre_feedforward_layernorm", _) => "ffn_norm",
        ("post_feedforward_layernorm", _) => "post_ffw_norm",
        ("self_attn.q_proj", _) => "attn_q",
        ("self_attn.k_proj", _) => "attn_k",
        ("self_attn.v_proj", _) => "attn_v",
        ("self_attn.o_proj", _) => "attn_output",
        ("self_attn.q_norm", _) => "attn_q_norm",
        ("self_attn.k_norm", _) => "attn_k_norm",
        ("mlp.gate_proj", _) => "ffn_gate",
        ("mlp.up_proj", _) => "ffn_up",
        ("mlp.down_proj", _) => "ffn_down",
        _ => return name.into(),
    };
    format!("blk.{layer}.{short}.{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_hf_names_to_llama_cpp_names() {
        assert_eq!(
            gguf_name("layers.3.self_attn.q_proj.weight", NormNaming::Llama),
            "blk.3.attn_q.weight"
        );
        assert_eq!(
            gguf_name("layers.0.self_attn.k_proj.bias", NormNaming::Llama),
            "blk.0.attn_k.bias"
        );
        assert_eq!(
            gguf_name(
                "layers.1.post_attention_layernorm.weight",
                NormNaming::Llama
            ),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name(
                "layers.1.post_attention_layernorm.weight",
                NormNaming::Gemma
            ),
            "blk.1.post_attention_norm.weight"
        );
        assert_eq!(
            gguf_name(
                "layers.1.pre_feedforward_layernorm.weight",
                NormNaming::Gemma
            ),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name("embed_tokens.weight", NormNaming::Llama),
            "token_embd.weight"
        );
    }
}
