//! Reads the GGUF `tokenizer.ggml.*` metadata into a `VocabSpec`, with llama.cpp's defaults for
//! keys a file leaves out.

use super::vocab::{VocabModel, VocabSpec};
use crate::ChatError;
use afm_models::weights::{GgufFile, GgufValue};

fn strings(g: &GgufFile, key: &str) -> Result<Option<Vec<String>>, ChatError> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let arr = v
        .as_array()
        .ok_or_else(|| ChatError::Tokenizer(format!("{key} is not an array")))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| ChatError::Tokenizer(format!("{key}[{i}] is not a string")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn numbers<T>(
    g: &GgufFile,
    key: &str,
    conv: impl Fn(&GgufValue) -> Option<T>,
) -> Result<Vec<T>, ChatError> {
    let Some(v) = g.get(key) else {
        return Ok(Vec::new());
    };
    let arr = v
        .as_array()
        .ok_or_else(|| ChatError::Tokenizer(format!("{key} is not an array")))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| {
            conv(v).ok_or_else(|| ChatError::Tokenizer(format!("{key}[{i}] is not a number")))
        })
        .collect()
}

fn id(g: &GgufFile, key: &str) -> Option<u32> {
    g.get(key)
        .and_then(GgufValue::as_u64)
        .and_then(|v| u32::try_from(v).ok())
}

fn flag(g: &GgufFile, key: &str) -> Option<bool> {
    g.get(key).and_then(GgufValue::as_bool)
}

pub(super) fn vocab_spec(g: &GgufFile) -> Result<VocabSpec, ChatError> {
    let model_name = g
        .get("tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .ok_or_else(|| ChatError::Tokenizer("GGUF has no tokenizer.ggml.model".into()))?;
    let model = match model_name {
        "gpt2" => VocabModel::Bpe,
        "llama" => VocabModel::Spm,
        "gemma4" => VocabModel::Gemma4,
        other => {
            return Err(ChatError::Tokenizer(format!(
                "tokenizer.ggml.model = {other:?} is not supported (supported: gpt2, llama, gemma4)"
            )))
        }
    };
    let tokens = strings(g, "tokenizer.ggml.tokens")?
        .ok_or_else(|| ChatError::Tokenizer("GGUF has no tokenizer.ggml.tokens".into()))?;
    let n = tokens.len();
    let mut spec = VocabSpec::new(model, tokens);
    spec.scores = numbers(g, "tokenizer.ggml.scores", |v| v.as_f64().map(|x| x as f32))?;
    spec.token_types = numbers(g, "tokenizer.ggml.token_type", |v| {
        v.as_i64().and_then(|x| i32::try_from(x).ok())
    })?;
    for (key, len) in [
        ("tokenizer.ggml.scores", spec.scores.len()),
        ("tokenizer.ggml.token_type", spec.token_types.len()),
    ] {
        if len != 0 && len < n {
            return Err(ChatError::Tokenizer(format!(
                "{key} has {len} entries for {n} tokens"
            )));
        }
    }
    if matches!(model, VocabModel::Bpe | VocabModel::Gemma4) {
        spec.merges = strings(g, "tokenizer.ggml.merges")?.ok_or_else(|| {
            ChatError::Tokenizer(format!(
                "GGUF {model_name} vocabulary has no tokenizer.ggml.merges"
            ))
        })?;
    }
    spec.pre = g
        .get("tokenizer.ggml.pre")
        .and_then(GgufValue::as_str)
        .unwrap_or("")
        .to_string();
    // llama.cpp's defaults, then the file's keys; out-of-range ids fall back to the default.
    let (bos, eos, unk) = match model {
        VocabModel::Spm => (Some(1), Some(2), Some(0)),
        VocabModel::Bpe => (Some(11), Some(11), None),
        // gemma4: no defaults, the file names them.
        VocabModel::Gemma4 => (None, None, None),
    };
    let pick = |key: &str, default: Option<u32>| {
        let default = default.filter(|&d| (d as usize) < n);
        id(g, key).filter(|&v| (v as usize) < n).or(default)
    };
    spec.bos = pick("tokenizer.ggml.bos_token_id", bos);
    spec.eos = pick("tokenizer.ggml.eos_token_id", eos);
    spec.unk = pick("tokenizer.ggml.unknown_token_id", unk);
    spec.eot = pick("tokenizer.ggml.eot_token_id", None);
    spec.eom = pick("tokenizer.ggml.eom_token_id", None);
    spec.pad = pick("tokenizer.ggml.padding_token_id", None);
    spec.add_bos = flag(g, "tokenizer.ggml.add_bos_token");
    spec.add_eos = flag(g, "tokenizer.ggml.add_eos_token");
    spec.add_space_prefix = flag(g, "tokenizer.ggml.add_space_prefix");
    Ok(spec)
}
