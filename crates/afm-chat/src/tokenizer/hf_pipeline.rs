//! The HF `tokenizers` text pipeline for a BPE model: normalizers, pre-tokenizers, and the word
//! -> symbols step (byte-level chars, or chars with byte fallback / UNK), reproducing HF so ids
//! equal transformers'. Supported: normalizers Replace/Prepend/NF(K)C/NF(K)D/Sequence;
//! pre-tokenizers Split/Digits/ByteLevel/Metaspace/Sequence. Anything else is refused with its
//! name, never silently approximated. One known difference: added tokens are matched on the raw
//! text, where HF matches `normalized: true` added tokens on the normalized text (only matters
//! when the normalizer rewrites the token's own text).

use super::bpe::Symbol;
use super::{unicode, PieceStyle, Tokenizer};
use crate::ChatError;
use serde_json::Value;
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

pub(crate) fn unsupported(what: &str, v: &Value) -> ChatError {
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

impl Pipeline {
    /// The pipeline tokenizer.json describes (`byte_fallback` and `unk` come from its model).
    pub(crate) fn from_json(
        tj: &Value,
        byte_fallback: bool,
        unk: Option<u32>,
    ) -> Result<Self, ChatError> {
        let model = &tj["model"];
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
        let flag = |k: &str| model.get(k).and_then(Value::as_bool).unwrap_or(false);
        Ok(Self {
            normalizers,
            steps,
            byte_level,
            ignore_merges: flag("ignore_merges"),
            byte_fallback,
            unk,
            fuse_unk: flag("fuse_unk"),
        })
    }

    pub(crate) fn byte_level(&self) -> bool {
        self.byte_level
    }
}

/// How the decoder turns tokens into text: byte-level or '▁'-as-space, and whether it strips the
/// leading space of the first token (Strip decoder, or Metaspace with a prepend scheme).
pub(crate) fn decoder_style(tj: &Value) -> (PieceStyle, bool) {
    let dec = tj.get("decoder").map(Value::to_string).unwrap_or_default();
    let style = if dec.contains("\"ByteLevel\"") {
        PieceStyle::ByteLevel
    } else {
        PieceStyle::Metaspace
    };
    let strips =
        dec.contains("\"Strip\"") || (dec.contains("\"Metaspace\"") && !dec.contains("\"never\""));
    (style, strips)
}
