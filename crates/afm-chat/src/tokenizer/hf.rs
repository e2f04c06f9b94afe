//! HF `tokenizer.json` (+ tokenizer_config.json, generation_config.json, config.json): the BPE
//! model with its normalizers, pre-tokenizers and decoder, reproducing HF `tokenizers` so ids equal
//! transformers'. Supported components: normalizers Replace/Prepend/NF(K)C/NF(K)D/Sequence; pre-tokenizers
//! Split/Digits/ByteLevel/Metaspace/Sequence; BPE with byte-level chars or byte fallback.
//! Anything else is refused with its name, never silently approximated. One known difference:
//! added tokens are matched on the raw text, where HF matches `normalized: true` added tokens on
//! the normalized text (only matters when the normalizer rewrites the token's own text).

use super::bpe::Symbol;
use super::vocab::{attr, VocabModel, VocabSpec};
use super::{unicode, BuildOptions, PieceStyle, Tokenizer};
use crate::ChatError;
use serde_json::Value;
use std::path::Path;
use unicode_normalization::UnicodeNormalization;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Behavior {
    Removed,
    Isolated,
    MergedWithPrevious,
    MergedWithNext,
    Contiguous,
}

enum Normalizer {
    Replace { from: String, to: String },
    Prepend(String),
    Nfc,
    Nfkc,
    Nfd,
    Nfkd,
}

enum PreStep {
    Split {
        re: fancy_regex::Regex,
        behavior: Behavior,
        invert: bool,
    },
    Digits {
        individual: bool,
    },
    ByteLevel {
        add_prefix_space: bool,
        use_regex: bool,
    },
    Metaspace {
        replacement: String,
        prepend: Prepend,
        split: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Prepend {
    Always,
    First,
    Never,
}

pub(crate) struct Pipeline {
    normalizers: Vec<Normalizer>,
    steps: Vec<PreStep>,
    byte_level: bool,
    ignore_merges: bool,
    byte_fallback: bool,
    unk: Option<u32>,
    fuse_unk: bool,
}

const GPT2_HF: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

fn unsupported(what: &str, v: &Value) -> ChatError {
    let t = v.get("type").and_then(Value::as_str).unwrap_or("?");
    ChatError::Tokenizer(format!(
        "tokenizer.json: {what} type {t:?} is not supported"
    ))
}

fn pattern(v: &Value) -> Result<fancy_regex::Regex, ChatError> {
    let src = if let Some(s) = v.get("String").and_then(Value::as_str) {
        fancy_regex::escape(s).into_owned()
    } else if let Some(r) = v.get("Regex").and_then(Value::as_str) {
        r.to_string()
    } else {
        return Err(ChatError::Tokenizer(format!(
            "tokenizer.json: pattern {v} has neither String nor Regex"
        )));
    };
    fancy_regex::Regex::new(&src)
        .map_err(|e| ChatError::Tokenizer(format!("tokenizer.json: regex {src:?}: {e}")))
}

fn parse_normalizer(v: &Value, out: &mut Vec<Normalizer>) -> Result<(), ChatError> {
    if v.is_null() {
        return Ok(());
    }
    match v.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            for n in v
                .get("normalizers")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                parse_normalizer(n, out)?;
            }
        }
        Some("Replace") => {
            let from = v
                .pointer("/pattern/String")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    unsupported("Replace normalizer with a regex pattern; normalizer", v)
                })?;
            let to = v.get("content").and_then(Value::as_str).unwrap_or("");
            out.push(Normalizer::Replace {
                from: from.into(),
                to: to.into(),
            });
        }
        Some("Prepend") => out.push(Normalizer::Prepend(
            v.get("prepend")
                .and_then(Value::as_str)
                .unwrap_or("")
                .into(),
        )),
        Some("NFC") => out.push(Normalizer::Nfc),
        Some("NFKC") => out.push(Normalizer::Nfkc),
        Some("NFD") => out.push(Normalizer::Nfd),
        Some("NFKD") => out.push(Normalizer::Nfkd),
        _ => return Err(unsupported("normalizer", v)),
    }
    Ok(())
}

fn parse_pre(v: &Value, out: &mut Vec<PreStep>) -> Result<(), ChatError> {
    if v.is_null() {
        return Ok(());
    }
    let b = |k: &str, d: bool| v.get(k).and_then(Value::as_bool).unwrap_or(d);
    match v.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            for p in v
                .get("pretokenizers")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                parse_pre(p, out)?;
            }
        }
        Some("Split") => {
            let behavior = match v.get("behavior").and_then(Value::as_str) {
                Some("Removed") => Behavior::Removed,
                Some("Isolated") => Behavior::Isolated,
                Some("MergedWithPrevious") => Behavior::MergedWithPrevious,
                Some("MergedWithNext") => Behavior::MergedWithNext,
                Some("Contiguous") => Behavior::Contiguous,
                _ => return Err(unsupported("Split behavior of pre_tokenizer", v)),
            };
            let re = pattern(v.get("pattern").unwrap_or(&Value::Null))?;
            out.push(PreStep::Split {
                re,
                behavior,
                invert: b("invert", false),
            });
        }
        Some("Digits") => out.push(PreStep::Digits {
            individual: b("individual_digits", false),
        }),
        Some("ByteLevel") => out.push(PreStep::ByteLevel {
            add_prefix_space: b("add_prefix_space", false),
            use_regex: b("use_regex", true),
        }),
        Some("Metaspace") => {
            let prepend = match v.get("prepend_scheme").and_then(Value::as_str) {
                Some("first") => Prepend::First,
                Some("never") => Prepend::Never,
                Some(_) => Prepend::Always,
                None if b("add_prefix_space", true) => Prepend::Always,
                None => Prepend::Never,
            };
            let replacement = v
                .get("replacement")
                .and_then(Value::as_str)
                .unwrap_or("\u{2581}")
                .to_string();
            out.push(PreStep::Metaspace {
                replacement,
                prepend,
                split: b("split", true),
            });
        }
        _ => return Err(unsupported("pre_tokenizer", v)),
    }
    Ok(())
}

/// Splits `s` by `re` with HF's delimiter behaviours; returns byte ranges.
fn split_by(
    s: &str,
    matches: &[(usize, usize)],
    behavior: Behavior,
    invert: bool,
) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize, bool)> = Vec::new();
    let mut prev = 0;
    for &(a, e) in matches {
        if a > prev {
            spans.push((prev, a, invert));
        }
        if e > a {
            spans.push((a, e, !invert));
        }
        prev = e;
    }
    if prev < s.len() {
        spans.push((prev, s.len(), invert));
    }
    let mut out: Vec<(usize, usize)> = Vec::new();
    match behavior {
        Behavior::Isolated => out.extend(spans.iter().map(|&(a, e, _)| (a, e))),
        Behavior::Removed => out.extend(spans.iter().filter(|s| !s.2).map(|&(a, e, _)| (a, e))),
        Behavior::MergedWithPrevious => {
            let mut prev_match = false;
            for &(a, e, m) in &spans {
                match out.last_mut() {
                    Some(last) if m && !prev_match => last.1 = e,
                    _ => out.push((a, e)),
                }
                prev_match = m;
            }
        }
        Behavior::MergedWithNext => {
            let mut prev_match = false;
            for &(a, e, m) in spans.iter().rev() {
                match out.last_mut() {
                    Some(last) if m && !prev_match => last.0 = a,
                    _ => out.push((a, e)),
                }
                prev_match = m;
            }
            out.reverse();
        }
        Behavior::Contiguous => {
            let mut prev_match = false;
            for &(a, e, m) in &spans {
                match out.last_mut() {
                    Some(last) if m && prev_match => last.1 = e,
                    _ => out.push((a, e)),
                }
                prev_match = m;
            }
        }
    }
    out
}

fn regex_matches(re: &fancy_regex::Regex, s: &str) -> Vec<(usize, usize)> {
    // A backtracking-limit error ends the scan; the rest stays one piece.
    re.find_iter(s)
        .map_while(Result::ok)
        .map(|m| (m.start(), m.end()))
        .collect()
}

fn char_matches(s: &str, pred: impl Fn(char) -> bool) -> Vec<(usize, usize)> {
    s.char_indices()
        .filter(|&(_, c)| pred(c))
        .map(|(i, c)| (i, i + c.len_utf8()))
        .collect()
}

impl Pipeline {
    /// Pieces of one text fragment; `first` says whether it starts the input (Metaspace "first").
    fn pre_tokenize(&self, text: &str, first: bool) -> Vec<String> {
        let mut pieces = vec![text.to_string()];
        for step in &self.steps {
            let mut next = Vec::with_capacity(pieces.len());
            for (k, p) in pieces.into_iter().enumerate() {
                let (piece, ranges) = match step {
                    PreStep::Split {
                        re,
                        behavior,
                        invert,
                    } => {
                        let m = regex_matches(re, &p);
                        let r = split_by(&p, &m, *behavior, *invert);
                        (p, r)
                    }
                    PreStep::Digits { individual } => {
                        let m = char_matches(&p, char::is_numeric);
                        let beh = if *individual {
                            Behavior::Isolated
                        } else {
                            Behavior::Contiguous
                        };
                        let r = split_by(&p, &m, beh, false);
                        (p, r)
                    }
                    PreStep::ByteLevel {
                        add_prefix_space,
                        use_regex,
                    } => {
                        let p = if *add_prefix_space && !p.starts_with(' ') {
                            format!(" {p}")
                        } else {
                            p
                        };
                        let r = if *use_regex {
                            let re = gpt2_regex();
                            split_by(&p, &regex_matches(re, &p), Behavior::Isolated, false)
                        } else {
                            vec![(0, p.len())]
                        };
                        (p, r)
                    }
                    PreStep::Metaspace {
                        replacement,
                        prepend,
                        split,
                    } => {
                        let mut p = p.replace(' ', replacement);
                        let add = match prepend {
                            Prepend::Always => true,
                            Prepend::First => first && k == 0,
                            Prepend::Never => false,
                        };
                        if add && !p.starts_with(replacement.as_str()) {
                            p.insert_str(0, replacement);
                        }
                        let r = if *split {
                            let m: Vec<_> = p
                                .match_indices(replacement.as_str())
                                .map(|(i, s)| (i, i + s.len()))
                                .collect();
                            split_by(&p, &m, Behavior::MergedWithNext, false)
                        } else {
                            vec![(0, p.len())]
                        };
                        (p, r)
                    }
                };
                next.extend(
                    ranges
                        .into_iter()
                        .filter(|r| r.1 > r.0)
                        .map(|(a, e)| piece[a..e].to_string()),
                );
            }
            pieces = next;
        }
        pieces
    }

    pub(crate) fn encode(&self, tok: &Tokenizer, text: &str, first: bool, out: &mut Vec<u32>) {
        let mut t = text.to_string();
        for n in &self.normalizers {
            match n {
                Normalizer::Replace { from, to } => t = t.replace(from.as_str(), to),
                Normalizer::Prepend(p) => {
                    if !t.is_empty() {
                        t.insert_str(0, p);
                    }
                }
                Normalizer::Nfc => t = t.nfc().collect(),
                Normalizer::Nfkc => t = t.nfkc().collect(),
                Normalizer::Nfd => t = t.nfd().collect(),
                Normalizer::Nfkd => t = t.nfkd().collect(),
            }
        }
        for word in self.pre_tokenize(&t, first) {
            let word = if self.byte_level {
                let mut enc = String::with_capacity(word.len() * 2);
                unicode::byte_encode(&word, &mut enc);
                enc
            } else {
                word
            };
            if self.ignore_merges {
                if let Some(id) = tok.vocab().find(&word) {
                    out.push(id);
                    continue;
                }
            }
            let symbols = self.symbols(tok, &word);
            out.extend(tok.merge_symbols(symbols).into_iter().filter_map(|s| s.id));
        }
    }

    /// Initial symbols of a word, HF-style: known chars, else byte-fallback tokens, else UNK.
    fn symbols(&self, tok: &Tokenizer, word: &str) -> Vec<Symbol> {
        let mut syms: Vec<Symbol> = Vec::with_capacity(word.len());
        let mut last_unk = false;
        let mut buf = [0u8; 4];
        for (i, c) in word.char_indices() {
            let s = c.encode_utf8(&mut buf);
            if let Some(id) = tok.vocab().find(s) {
                syms.push(Symbol::new(Some(id), i, s.len()));
                last_unk = false;
                continue;
            }
            if self.byte_fallback {
                let bytes: Option<Vec<u32>> = s.bytes().map(|b| tok.byte_token(b)).collect();
                if let Some(bytes) = bytes {
                    for (j, id) in bytes.into_iter().enumerate() {
                        syms.push(Symbol::new(Some(id), i + j, 1));
                    }
                    last_unk = false;
                    continue;
                }
            }
            if let Some(unk) = self.unk {
                match syms.last_mut() {
                    Some(prev) if self.fuse_unk && last_unk => prev.len += s.len(),
                    _ => syms.push(Symbol::new(Some(unk), i, s.len())),
                }
                last_unk = true;
            }
        }
        syms
    }
}

fn gpt2_regex() -> &'static fancy_regex::Regex {
    static RE: std::sync::OnceLock<fancy_regex::Regex> = std::sync::OnceLock::new();
    RE.get_or_init(|| fancy_regex::Regex::new(GPT2_HF).expect("the GPT-2 regex compiles"))
}

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
        if let (Some(id), Some(c)) = (
            a.get("id").and_then(Value::as_u64),
            a.get("content").and_then(Value::as_str),
        ) {
            entries.push((id as u32, c.to_string()));
        }
    }
    let n = entries.iter().map(|e| e.0 as usize + 1).max().unwrap_or(0);
    if n > 4_000_000 {
        return Err(ChatError::Tokenizer(format!(
            "tokenizer.json: token id {} exceeds the limit of 4000000",
            n - 1
        )));
    }
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    for (id, t) in entries {
        tokens[id as usize] = t;
    }
    let byte_fallback = model
        .get("byte_fallback")
        .and_then(Value::as_bool)
        .unwrap_or(false);
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
        let Some(id) = a.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
        types[id as usize] = if special { 3 } else { 4 };
        let mut bits = 0;
        if a.get("lstrip").and_then(Value::as_bool) == Some(true) {
            bits |= attr::LSTRIP;
        }
        if a.get("rstrip").and_then(Value::as_bool) == Some(true) {
            bits |= attr::RSTRIP;
        }
        if bits != 0 {
            extra_attrs.push((id as u32, bits));
        }
    }
    let find = |t: &str| tokens.iter().position(|x| x == t).map(|i| i as u32);
    let unk = token_content(model.get("unk_token")).and_then(|t| find(&t));
    if let Some(u) = unk {
        if types[u as usize] == 1 {
            types[u as usize] = 2;
        }
    }
    let merges: Vec<String> = model
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
        .unwrap_or_default();

    let mut normalizers = Vec::new();
    parse_normalizer(
        tj.get("normalizer").unwrap_or(&Value::Null),
        &mut normalizers,
    )?;
    let mut steps = Vec::new();
    parse_pre(tj.get("pre_tokenizer").unwrap_or(&Value::Null), &mut steps)?;
    let byte_level = steps.iter().any(|s| matches!(s, PreStep::ByteLevel { .. }));
    if byte_level && !matches!(steps.last(), Some(PreStep::ByteLevel { .. })) {
        return Err(ChatError::Tokenizer(
            "tokenizer.json: a pre-tokenizer after ByteLevel is not supported".into(),
        ));
    }
    let decoder = tj.get("decoder").cloned().unwrap_or(Value::Null);
    let dec_str = decoder.to_string();
    let style = if dec_str.contains("\"ByteLevel\"") {
        PieceStyle::ByteLevel
    } else {
        PieceStyle::Metaspace
    };
    let strips_space = dec_str.contains("\"Strip\"")
        || (dec_str.contains("\"Metaspace\"") && !dec_str.contains("\"never\""));

    // Special ids: tokenizer_config names, then generation_config/config ids.
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
    let add_bos = cfg
        .get("add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(tpl_bos);
    let add_eos = cfg
        .get("add_eos_token")
        .and_then(Value::as_bool)
        .unwrap_or(tpl_eos);

    let mut spec = VocabSpec::new(
        if byte_level {
            VocabModel::Bpe
        } else {
            VocabModel::Spm
        },
        tokens,
    );
    spec.token_types = types;
    spec.merges = merges;
    spec.bos = bos;
    spec.eos = eos;
    spec.unk = unk;
    spec.add_bos = Some(add_bos && bos.is_some());
    spec.add_eos = Some(add_eos && eos.is_some());
    spec.add_space_prefix = Some(strips_space);
    let pipeline = Pipeline {
        normalizers,
        steps,
        byte_level,
        ignore_merges: model
            .get("ignore_merges")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        byte_fallback,
        unk,
        fuse_unk: model
            .get("fuse_unk")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
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
    tok.add_eog(gen_eos.iter().chain(&cfg_eos).copied());
    Ok(tok)
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
