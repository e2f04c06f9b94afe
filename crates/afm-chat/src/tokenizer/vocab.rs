//! The vocabulary as loaded (`VocabSpec`, plain data either loader fills) and the token attributes,
//! special-token set and end-of-generation set derived from it the way llama.cpp's `llama_vocab::load`
//! derives them (including its by-text detection of EOT/EOG/FIM tokens).

use std::collections::HashMap;

/// Which tokenization algorithm the vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabModel {
    /// Byte-level BPE with merges (GGUF `tokenizer.ggml.model = "gpt2"`).
    Bpe,
    /// SentencePiece with scores and byte fallback (GGUF `tokenizer.ggml.model = "llama"`).
    Spm,
    /// SentencePiece-style BPE (GGUF `tokenizer.ggml.model = "gemma4"`): merges over raw UTF-8
    /// with '▁' for spaces and `<0xXX>` byte fallback, split only at newline runs.
    Gemma4,
}

/// A vocabulary in plain form: what GGUF `tokenizer.ggml.*` holds. Build a tokenizer from it with
/// [`crate::Tokenizer::from_spec`], which follows llama.cpp's rules.
#[derive(Clone, Debug)]
pub struct VocabSpec {
    pub model: VocabModel,
    pub tokens: Vec<String>,
    /// Per-token scores (SPM); empty means all 0.
    pub scores: Vec<f32>,
    /// GGUF token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte); empty = normal.
    pub token_types: Vec<i32>,
    /// BPE merges as "left right".
    pub merges: Vec<String>,
    /// Pre-tokenizer name (`tokenizer.ggml.pre`).
    pub pre: String,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    /// `None`: the model family's default.
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

impl VocabSpec {
    pub fn new(model: VocabModel, tokens: Vec<String>) -> Self {
        Self {
            model,
            tokens,
            scores: Vec::new(),
            token_types: Vec::new(),
            merges: Vec::new(),
            pre: String::new(),
            bos: None,
            eos: None,
            eot: None,
            eom: None,
            unk: None,
            pad: None,
            add_bos: None,
            add_eos: None,
            add_space_prefix: None,
        }
    }
}

/// Token attribute bits (llama.cpp's `llama_token_attr`).
pub(crate) mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
    pub const LSTRIP: u32 = 1 << 7;
    pub const RSTRIP: u32 = 1 << 8;
}

pub(crate) fn attr_from_type(t: i32) -> u32 {
    match t {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => 0,
    }
}

/// Texts llama.cpp treats as end of generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const FIM_PRE: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP: &[&str] = &["<|file_sep|>"];

/// Token table with attributes finalized.
pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u32>,
    pub ids: HashMap<String, u32>,
    /// Sorted end-of-generation ids.
    pub eog: Vec<u32>,
}

impl Vocab {
    pub(crate) fn find(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Builds the table and applies llama.cpp's by-text fix-ups. `eos`, `eot`, `eom` are the ids
    /// from metadata (already range-checked). `llama_attrs`: also apply llama.cpp's attribute
    /// changes (tokens it recognises by text become control tokens); HF vocabularies keep their
    /// own attributes and only get the end-of-generation set.
    pub(crate) fn new(
        texts: Vec<String>,
        scores: Vec<f32>,
        attrs: Vec<u32>,
        ids_meta: [Option<u32>; 3],
        llama_attrs: bool,
    ) -> Self {
        let [eos, eot, eom] = ids_meta;
        let original = attrs.clone();
        let mut v = Self::with_llama_fixups(texts, scores, attrs, eos, eot, eom);
        if !llama_attrs {
            v.attrs = original;
        }
        v
    }

    fn with_llama_fixups(
        texts: Vec<String>,
        scores: Vec<f32>,
        mut attrs: Vec<u32>,
        eos: Option<u32>,
        eot: Option<u32>,
        eom: Option<u32>,
    ) -> Self {
        let mut ids = HashMap::with_capacity(texts.len());
        for (i, t) in texts.iter().enumerate() {
            // Duplicates keep the first id, as a lookup by text can only return one.
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let find_any = |list: &[&str]| list.iter().filter_map(|t| ids.get(*t).copied()).min();
        let mark_control = |id: Option<u32>, attrs: &mut Vec<u32>| {
            if let Some(a) = id.and_then(|id| attrs.get_mut(id as usize)) {
                *a |= attr::CONTROL;
            }
        };
        let eot = eot.or_else(|| find_any(EOT_TEXTS));
        mark_control(eot, &mut attrs);
        let eom = eom.or_else(|| find_any(&["<|eom_id|>"]));
        mark_control(eom, &mut attrs);
        for list in [FIM_PRE, FIM_SUF, FIM_MID] {
            mark_control(find_any(list), &mut attrs);
        }
        let mut eog = Vec::new();
        for list in [FIM_PAD, FIM_REP, FIM_SEP] {
            let id = find_any(list);
            mark_control(id, &mut attrs);
            eog.extend(id);
        }
        // Control tokens named "unused" are unused (llama.cpp's auto-detection).
        for (i, t) in texts.iter().enumerate() {
            if attrs[i] & attr::CONTROL != 0 && t.contains("unused") {
                attrs[i] |= attr::UNUSED;
            }
        }
        for t in EOG_TEXTS {
            if let Some(&id) = ids.get(*t) {
                attrs[id as usize] |= attr::CONTROL;
                eog.push(id);
            }
        }
        // gpt-oss channel markers are always rendered.
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = ids.get(t) {
                attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        let has = |eog: &[u32], t: &str| ids.get(t).is_some_and(|id| eog.contains(id));
        // Harmony / solar-open: "<|end|>" ends a message, not the generation.
        let harmony = has(&eog, "<|return|>") && has(&eog, "<|call|>") && has(&eog, "<|end|>");
        let solar = has(&eog, "<|calls|>") && has(&eog, "<|flush|>") && has(&eog, "<|end|>");
        if harmony || solar {
            let end = ids["<|end|>"];
            eog.retain(|&i| i != end);
            attrs[end as usize] = attr::USER_DEFINED;
        }
        if has(&eog, "<|tool_response>") && has(&eog, "</s>") {
            let s = ids["</s>"];
            eog.retain(|&i| i != s);
            attrs[s as usize] = attr::NORMAL;
        }
        Self {
            texts,
            scores,
            attrs,
            ids,
            eog,
        }
    }
}
