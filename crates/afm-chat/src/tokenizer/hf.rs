//! Loading a HF tokenizer directory: tokenizer.json (BPE vocabulary, merges, added tokens,
//! decoder), tokenizer_config.json (bos/eos names, add_bos/add_eos, cleanup), generation_config.json
//! and config.json (eos ids). The text pipeline itself lives in `hf_pipeline`.

use super::hf_pipeline::{decoder_style, unsupported, Pipeline};
use super::vocab::{attr, VocabModel, VocabSpec};
use super::{BuildOptions, Tokenizer};
use crate::ChatError;
use serde_json::Value;
use std::path::Path;

fn read_json(path: &Path) -> Result<Option<Value>, ChatError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(ChatError::Io {
                path: path.display().to_string(),
                source: e,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ChatError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })
}

/// Reads `file` in `dir` as JSON, if present.
pub(crate) fn dir_json(dir: &Path, file: &str) -> Result<Option<Value>, ChatError> {
    read_json(&dir.join(file))
}

/// A token given as a string or as `{"content": ..}` (tokenizer_config.json style).
pub(crate) fn token_content(v: Option<&Value>) -> Option<String> {
    let v = v?;
    v.as_str()
        .map(str::to_string)
        .or_else(|| v.get("content").and_then(Value::as_str).map(str::to_string))
}

fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

pub(super) fn load(dir: &Path) -> Result<Tokenizer, ChatError> {
    let path = dir.join("tokenizer.json");
    let tj = read_json(&path)?
        .ok_or_else(|| ChatError::Tokenizer(format!("{} not found", path.display())))?;
    let cfg = dir_json(dir, "tokenizer_config.json")?.unwrap_or(Value::Null);
    let gen = dir_json(dir, "generation_config.json")?.unwrap_or(Value::Null);
    let model_cfg = dir_json(dir, "config.json")?.unwrap_or(Value::Null);

    let model = &tj["model"];
    if model
        .get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| t != "BPE")
    {
        return Err(unsupported("model", model));
    }
    for k in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if model
            .get(k)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
        {
            return Err(ChatError::Tokenizer(format!(
                "tokenizer.json: BPE {k} is not supported"
            )));
        }
    }
    let byte_fallback = model
        .get("byte_fallback")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let ModelTokens {
        tokens,
        types,
        extra_attrs,
        unk,
    } = model_tokens(&tj, byte_fallback)?;
    let find = |t: &str| tokens.iter().position(|x| x == t).map(|i| i as u32);
    let merges = merges_of(model);

    let pipeline = Pipeline::from_json(&tj, byte_fallback, unk)?;
    let (style, strips_space) = decoder_style(&tj);

    let specials = special_ids(&tj, [&cfg, &gen, &model_cfg], &find);

    let model_kind = if pipeline.byte_level() {
        VocabModel::Bpe
    } else {
        VocabModel::Spm
    };
    let mut spec = VocabSpec::new(model_kind, tokens);
    spec.token_types = types;
    spec.merges = merges;
    spec.bos = specials.bos;
    spec.eos = specials.eos;
    spec.unk = unk;
    spec.add_bos = Some(specials.add_bos && specials.bos.is_some());
    spec.add_eos = Some(specials.add_eos && specials.eos.is_some());
    spec.add_space_prefix = Some(strips_space);
    let clean = cfg
        .get("clean_up_tokenization_spaces")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut tok = Tokenizer::build(
        spec,
        BuildOptions {
            encoder: Some(pipeline),
            style: Some(style),
            extra_attrs,
            clean_spaces: Some(clean),
        },
    )?;
    tok.add_eog(specials.extra_eog);
    Ok(tok)
}

/// The vocabulary as a dense list (model vocab plus added tokens), with token types
/// (added special -> control, other added -> user-defined, `<0xNN>` -> byte under byte fallback,
/// the unk token -> unknown) and the lstrip/rstrip bits of added tokens.
struct ModelTokens {
    tokens: Vec<String>,
    types: Vec<i32>,
    extra_attrs: Vec<(u32, u32)>,
    unk: Option<u32>,
}

const MAX_VOCAB: usize = 4_000_000;

fn model_tokens(tj: &Value, byte_fallback: bool) -> Result<ModelTokens, ChatError> {
    let model = &tj["model"];
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| ChatError::Tokenizer("tokenizer.json: model.vocab missing".into()))?;
    let added: Vec<&Value> = tj
        .get("added_tokens")
        .and_then(Value::as_array)
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let mut entries: Vec<(u32, String)> = vocab
        .iter()
        .filter_map(|(t, id)| Some((u32::try_from(id.as_u64()?).ok()?, t.clone())))
        .collect();
    for a in &added {
        let id = a
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|i| u32::try_from(i).ok());
        if let (Some(id), Some(c)) = (id, a.get("content").and_then(Value::as_str)) {
            entries.push((id, c.to_string()));
        }
    }
    let n = entries.iter().map(|e| e.0 as usize + 1).max().unwrap_or(0);
    if n > MAX_VOCAB {
        return Err(ChatError::Tokenizer(format!(
            "tokenizer.json: token id {} exceeds the limit of {MAX_VOCAB}",
            n - 1
        )));
    }
    // Ids nobody names get a placeholder text no input can contain.
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    for (id, t) in entries {
        tokens[id as usize] = t;
    }
    let mut types: Vec<i32> = tokens
        .iter()
        .map(|t| {
            if byte_fallback && is_byte_token(t) {
                6
            } else {
                1
            }
        })
        .collect();
    let mut extra_attrs = Vec::new();
    for a in &added {
        let Some(id) = a
            .get("id")
            .and_then(Value::as_u64)
            .filter(|&i| (i as usize) < n)
        else {
            continue;
        };
        let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
        types[id as usize] = if special { 3 } else { 4 };
        let flag = |k: &str, bit: u32| {
            if a.get(k).and_then(Value::as_bool) == Some(true) {
                bit
            } else {
                0
            }
        };
        let bits = flag("lstrip", attr::LSTRIP) | flag("rstrip", attr::RSTRIP);
        if bits != 0 {
            extra_attrs.push((id as u32, bits));
        }
    }
    let unk = token_content(model.get("unk_token"))
        .and_then(|t| tokens.iter().position(|x| *x == t))
        .map(|i| i as u32);
    if let Some(u) = unk {
        if types[u as usize] == 1 {
            types[u as usize] = 2;
        }
    }
    Ok(ModelTokens {
        tokens,
        types,
        extra_attrs,
        unk,
    })
}

/// Merges as "left right", from either the string or the pair form.
fn merges_of(model: &Value) -> Vec<String> {
    model
        .get("merges")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|m| match m {
                    Value::String(s) => Some(s.clone()),
                    Value::Array(p) if p.len() == 2 => {
                        Some(format!("{} {}", p[0].as_str()?, p[1].as_str()?))
                    }
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

struct Specials {
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    /// eos ids from generation_config.json / config.json (often several).
    extra_eog: Vec<u32>,
}

/// BOS/EOS: tokenizer_config.json names them, generation_config.json / config.json give ids;
/// whether to add them: tokenizer_config.json flags, else the post-processor template.
fn special_ids(
    tj: &Value,
    [cfg, gen, model_cfg]: [&Value; 3],
    find: &dyn Fn(&str) -> Option<u32>,
) -> Specials {
    let named = |k: &str| token_content(cfg.get(k)).and_then(|t| find(&t));
    let gen_eos = ids_of(gen.get("eos_token_id"));
    let cfg_eos = ids_of(model_cfg.get("eos_token_id"));
    let eos = named("eos_token")
        .or_else(|| gen_eos.first().copied())
        .or_else(|| cfg_eos.first().copied());
    let bos = named("bos_token")
        .or_else(|| ids_of(gen.get("bos_token_id")).first().copied())
        .or_else(|| ids_of(model_cfg.get("bos_token_id")).first().copied());
    let (tpl_bos, tpl_eos) = post_processor_adds(tj.get("post_processor"));
    let flag = |k: &str, default: bool| cfg.get(k).and_then(Value::as_bool).unwrap_or(default);
    Specials {
        bos,
        eos,
        add_bos: flag("add_bos_token", tpl_bos),
        add_eos: flag("add_eos_token", tpl_eos),
        extra_eog: gen_eos.into_iter().chain(cfg_eos).collect(),
    }
}

fn is_byte_token(t: &str) -> bool {
    t.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && u8::from_str_radix(&t[3..5], 16).is_ok()
}

/// Whether a TemplateProcessing post-processor puts a special token before / after a single text.
fn post_processor_adds(pp: Option<&Value>) -> (bool, bool) {
    let Some(pp) = pp else { return (false, false) };
    let single = match pp.get("type").and_then(Value::as_str) {
        Some("TemplateProcessing") => pp.get("single").and_then(Value::as_array),
        Some("Sequence") => {
            let inner = pp
                .get("processors")
                .and_then(Value::as_array)
                .and_then(|ps| {
                    ps.iter().find(|p| {
                        p.get("type").and_then(Value::as_str) == Some("TemplateProcessing")
                    })
                });
            return post_processor_adds(inner);
        }
        _ => None,
    };
    let Some(single) = single else {
        return (false, false);
    };
    let is_special = |v: Option<&Value>| v.is_some_and(|v| v.get("SpecialToken").is_some());
    (is_special(single.first()), is_special(single.last()))
}
