//! From a resolved `-m` location to a ready model: config, architecture row, weights bound and
//! placed on the chosen [`Device`] (the CPU by default).

use std::path::Path;

use crate::arch::{supported_names, Architecture, ARCHITECTURES};
use afm_runtime::compute::Device;
use afm_runtime::kv_store::KvDtype;
use afm_runtime::DType;

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::config::TransformerConfig;
use crate::forward::CausalLm;
use crate::source::ModelLocation;
use crate::weights::{GgufFile, SafetensorsSet, WeightSource};
use crate::ModelError;

pub struct LoadedModel {
    /// Name reported to clients (file stem or directory name).
    pub name: String,
    pub arch: &'static str,
    pub config: TransformerConfig,
    pub model: Box<dyn CausalLm>,
    pub location: ModelLocation,
    /// The weight files, kept for their metadata (tokenizer, template); weights share its mapping.
    pub source: WeightSource,
    /// Precision of the KV cache: f32 for f32 checkpoints (exact against transformers), f16
    /// otherwise (llama.cpp's choice: half the memory, same greedy output).
    pub kv_dtype: KvDtype,
    /// Where the weights live; the engine makes the KV cache here too.
    pub device: Device,
}

impl LoadedModel {
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.source {
            WeightSource::Gguf(g) => Some(g),
            WeightSource::Safetensors(_) => None,
        }
    }

    pub fn hf_dir(&self) -> Option<&Path> {
        match &self.location {
            ModelLocation::HfDir(d) => Some(d),
            ModelLocation::Gguf(_) => None,
        }
    }
}

fn unsupported(name: &str) -> ModelError {
    ModelError::UnsupportedArch(name.to_string(), supported_names())
}

/// Loads onto the CPU.
pub fn load_model(loc: &ModelLocation) -> Result<LoadedModel, ModelError> {
    load_model_on(loc, &Device::Cpu)
}

/// Loads with weights on `device`, in their storage types; a type the device cannot compute
/// with fails with the tensor's name and type.
pub fn load_model_on(loc: &ModelLocation, device: &Device) -> Result<LoadedModel, ModelError> {
    let m = match loc {
        ModelLocation::Gguf(path) => load_gguf(path, loc, device),
        ModelLocation::HfDir(dir) => load_hf(dir, loc, device),
    }?;
    note_converted(&m.source, device);
    Ok(m)
}

/// One line naming the weight types the device stores in another type (F16 on a GPU without
/// kernels for them), so memory and speed are not a surprise.
fn note_converted(source: &WeightSource, dev: &Device) {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for name in source.tensor_names() {
        if let Ok(t) = source.tensor(&name) {
            if t.shape.len() == 2 && dev.stored_type(t.dtype) != t.dtype {
                *counts.entry(t.dtype.name()).or_default() += 1;
            }
        }
    }
    if !counts.is_empty() {
        let list: Vec<String> = counts
            .iter()
            .map(|(t, n)| format!("{t} ({n} tensors)"))
            .collect();
        eprintln!(
            "[Device] {} has no kernels for {}: dequantized to F16 at load",
            dev.describe(),
            list.join(", ")
        );
    }
}

fn display_name(p: &Path) -> String {
    let stem = if p.is_dir() {
        p.file_name()
    } else {
        p.file_stem()
    };
    stem.map_or_else(
        || p.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

fn load_gguf(path: &Path, loc: &ModelLocation, dev: &Device) -> Result<LoadedModel, ModelError> {
    let g = GgufFile::open(path)?;
    let name = g.architecture().unwrap_or("<none>").to_string();
    let arch = ARCHITECTURES
        .iter()
        .find(|a| a.gguf_arch == name)
        .ok_or_else(|| unsupported(&name))?;
    refuse_mtp_only(&g, &name)?;
    let mut config = TransformerConfig::from_gguf(&g, arch.gguf_arch)?;
    (arch.adjust_gguf)(&mut config, &g);
    let source = WeightSource::Gguf(g);
    let ck = Checkpoint::new(&source, "");
    let model = (arch.load)(&ck, &config, dev)?;
    let kv_dtype = kv_dtype_for(&ck)?;
    Ok(LoadedModel {
        name: display_name(path),
        arch: arch.gguf_arch,
        config,
        model,
        location: loc.clone(),
        source,
        kv_dtype,
        device: dev.clone(),
    })
}

/// llama.cpp's converter can write a model's multi-token-prediction layers alone
/// (`--mtp`: `nextn_predict_layers` set, the trunk's blocks absent); that file is a draft head
/// for the main GGUF, not a model.
fn refuse_mtp_only(g: &GgufFile, arch: &str) -> Result<(), ModelError> {
    let nextn = g
        .get(&format!("{arch}.nextn_predict_layers"))
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    if nextn > 0 && !g.contains("blk.0.attn_norm.weight") {
        return Err(ModelError::Config {
            key: format!("{arch}.nextn_predict_layers"),
            reason: format!(
                "{nextn}, and blk.0 is absent: this GGUF holds only the MTP layers \
                 (convert_hf_to_gguf.py --mtp); load the main model's GGUF"
            ),
        });
    }
    Ok(())
}

fn load_hf(dir: &Path, loc: &ModelLocation, dev: &Device) -> Result<LoadedModel, ModelError> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::File {
        path: cfg_path.display().to_string(),
        reason: e.to_string(),
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::File {
        path: cfg_path.display().to_string(),
        reason: e.to_string(),
    })?;
    // Multimodal wrappers keep the language model's config under `text_config`.
    let (text_cfg, prefix) = match json.get("text_config") {
        Some(t) if t.is_object() => (t.clone(), "model.language_model."),
        _ => (json.clone(), "model."),
    };
    let towers: Vec<&str> = ["vision", "audio"]
        .into_iter()
        .filter(|t| {
            json.get(format!("{t}_config"))
                .is_some_and(|c| c.is_object())
        })
        .collect();
    if !towers.is_empty() {
        eprintln!(
            "[Load] {}: serving the language model only; its {} weights are not loaded",
            dir.display(),
            towers.join(" and ")
        );
    }
    let model_type = text_cfg
        .get("model_type")
        .or_else(|| json.get("model_type"))
        .and_then(|v| v.as_str())
        .unwrap_or("<none>");
    let arch: &Architecture = ARCHITECTURES
        .iter()
        .find(|a| a.hf_types.contains(&model_type))
        .ok_or_else(|| unsupported(model_type))?;
    let config = TransformerConfig::from_hf(&text_cfg)?;
    let source = WeightSource::Safetensors(SafetensorsSet::open_dir(dir)?);
    let ck = Checkpoint::new(&source, prefix);
    let model = (arch.load)(&ck, &config, dev)?;
    let kv_dtype = kv_dtype_for(&ck)?;
    Ok(LoadedModel {
        name: display_name(dir),
        arch: arch.hf_types[0],
        config,
        model,
        location: loc.clone(),
        source,
        kv_dtype,
        device: dev.clone(),
    })
}

/// The embedding table's type stands for the checkpoint's precision.
fn kv_dtype_for(ck: &Checkpoint) -> Result<KvDtype, ModelError> {
    // DeepSeek's own checkpoints: `embed.weight`, outside `model.`.
    let embed = match ck.view("embed_tokens.weight", NormNaming::Llama) {
        Ok(v) => v,
        Err(e) => ck
            .unprefixed()
            .view("embed.weight", NormNaming::Llama)
            .map_err(|_| e)?,
    };
    Ok(if embed.dtype == DType::F32 {
        KvDtype::F32
    } else {
        KvDtype::F16
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::testfiles::{GgufBuilder, ScratchDir, TestTensor};
    use crate::weights::GgufValue;

    /// A GGUF of MTP layers alone is refused in one line that says what it is.
    #[test]
    fn an_mtp_only_gguf_is_refused_naming_it() {
        let u = |v: u32| GgufValue::U32(v);
        let bytes = GgufBuilder::new()
            .kv("general.architecture", GgufValue::Str("qwen35".into()))
            .kv("qwen35.block_count", u(5))
            .kv("qwen35.nextn_predict_layers", u(1))
            .tensor(TestTensor::f32("token_embd.weight", &[2, 2], &[0.0; 4]))
            .tensor(TestTensor::f32("blk.4.attn_norm.weight", &[2], &[1.0; 2]))
            .build();
        let dir = ScratchDir::new("mtp-only");
        let path = dir.write("mtp-qwen.gguf", &bytes);
        let err = load_model(&ModelLocation::Gguf(path))
            .err()
            .expect("refused");
        let msg = err.to_string();
        assert!(
            msg.contains("only the MTP layers") && !msg.contains('\n'),
            "{msg}"
        );
    }
}
