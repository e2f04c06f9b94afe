//! Text <-> token ids. One `Tokenizer` type serves GGUF vocabularies (llama.cpp's algorithms, so ids
//! equal llama.cpp's) and HF `tokenizer.json` (HF's pipeline, so ids equal transformers').
//!
//! ```text
//! encode: text ─► split out special/added tokens ─► per text fragment:
//!           BPE: pre-tokenize (regex) ─► byte-level chars ─► merges by rank
//!           SPM: ' '→'▁' (+ space prefix) ─► bigram merges by score ─► <0xNN> byte fallback
//!           HF : normalizer ─► pre-tokenizers ─► BPE (byte-level or byte fallback)
//!         ─► + BOS/EOS per the model's rules
//! decode: ids ─► raw bytes per token ─► UTF-8 (lossy)
//! ```
//! It does not own chat templates (see `template`) or streaming (see `detokenize`).

mod bpe;
mod gguf;
pub(crate) mod hf;
mod hf_pipeline;
mod pretokenize;
mod spm;
pub(crate) mod unicode;
mod unicode_data;
mod vocab;

pub use vocab::{VocabModel, VocabSpec};

use crate::ChatError;
use aho_corasick::AhoCorasick;
use bpe::{MergeTable, Symbol};
use pretokenize::LlamaPreTokenizer;
use vocab::{attr, attr_from_type, Vocab};

/// How a text fragment becomes ids.
enum Encoder {
    /// llama.cpp byte-level BPE.
    Bpe {
        pre: LlamaPreTokenizer,
        ignore_merges: bool,
    },
    /// llama.cpp SentencePiece.
    Spm,
    /// llama.cpp's gemma4 BPE (`encode_gemma4`).
    Gemma4,
    /// HF tokenizer.json pipeline (BPE model).
    Hf(hf_pipeline::Pipeline),
}

/// How a normal token's text becomes bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceStyle {
    /// GPT-2 byte-level chars.
    ByteLevel,
    /// SentencePiece: '▁' is a space.
    Metaspace,
}

pub struct Tokenizer {
    vocab: Vocab,
    encoder: Encoder,
    merges: MergeTable,
    style: PieceStyle,
    /// Special-token texts to split out, longest first, and an automaton that finds which occur.
    special_order: Vec<u32>,
    special_finder: Option<AhoCorasick>,
    byte_tokens: Vec<Option<u32>>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    warnings: Vec<String>,
}

/// A piece of input after special-token splitting.
enum Frag<'a> {
    Text(&'a str),
    Token(u32),
}

/// Options that differ between the GGUF (llama.cpp) and tokenizer.json (HF) loaders.
pub(crate) struct BuildOptions {
    pub encoder: Option<hf_pipeline::Pipeline>,
    pub style: Option<PieceStyle>,
    /// Per-token extra attribute bits (LSTRIP/RSTRIP from HF added tokens).
    pub extra_attrs: Vec<(u32, u32)>,
    pub clean_spaces: Option<bool>,
}

impl Tokenizer {
    /// Builds a tokenizer from plain vocabulary data, following llama.cpp's rules.
    pub fn from_spec(spec: VocabSpec) -> Result<Self, ChatError> {
        Self::build(
            spec,
            BuildOptions {
                encoder: None,
                style: None,
                extra_attrs: Vec::new(),
                clean_spaces: None,
            },
        )
    }

    pub fn from_gguf(g: &afm_models::weights::GgufFile) -> Result<Self, ChatError> {
        Self::from_spec(gguf::vocab_spec(g)?)
    }

    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Self, ChatError> {
        hf::load(dir)
    }

    pub(crate) fn build(mut spec: VocabSpec, opts: BuildOptions) -> Result<Self, ChatError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(ChatError::Tokenizer("vocabulary has no tokens".into()));
        }
        let check = |name: &str, id: Option<u32>| -> Result<Option<u32>, ChatError> {
            match id {
                Some(i) if i as usize >= n => Err(ChatError::Tokenizer(format!(
                    "{name} = {i} is outside the vocabulary of {n} tokens"
                ))),
                other => Ok(other),
            }
        };
        let bos = check("bos_token_id", spec.bos)?;
        let eos = check("eos_token_id", spec.eos)?;
        let eot = check("eot_token_id", spec.eot)?;
        let eom = check("eom_token_id", spec.eom)?;
        let llama_attrs = opts.encoder.is_none();
        let vocab = token_table(&mut spec, &opts.extra_attrs, [eos, eot, eom], llama_attrs);

        let mut warnings = Vec::new();
        let mut add_bos = false;
        let mut add_space_prefix = false;
        let mut clean_spaces = false;
        let (encoder, style) = match (opts.encoder, spec.model) {
            (Some(p), _) => (Encoder::Hf(p), opts.style.unwrap_or(PieceStyle::ByteLevel)),
            (None, VocabModel::Bpe) => {
                let (pre, settings, warning) = LlamaPreTokenizer::for_name(&spec.pre)?;
                warnings.extend(warning);
                add_bos = settings.add_bos;
                clean_spaces = settings.clean_spaces;
                let ignore_merges = settings.ignore_merges;
                (Encoder::Bpe { pre, ignore_merges }, PieceStyle::ByteLevel)
            }
            (None, VocabModel::Spm) => {
                add_bos = true;
                add_space_prefix = true;
                (Encoder::Spm, PieceStyle::Metaspace)
            }
            (None, VocabModel::Gemma4) => {
                // llama.cpp forces add_bos for gemma4 whatever the file says.
                spec.add_bos = Some(true);
                clean_spaces = true;
                (Encoder::Gemma4, PieceStyle::Metaspace)
            }
        };
        let add_bos = spec.add_bos.unwrap_or(add_bos);
        let add_eos = spec.add_eos.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(ChatError::Tokenizer(
                "add_bos_token is true, but bos_token_id is not set".into(),
            ));
        }
        if add_eos && eos.is_none() {
            return Err(ChatError::Tokenizer(
                "add_eos_token is true, but eos_token_id is not set".into(),
            ));
        }
        let (merges, dropped) = merge_table(&spec.merges, &vocab);
        if dropped > 0 {
            warnings.push(format!(
                "{dropped} merges name tokens missing from the vocabulary and were ignored"
            ));
        }
        let byte_tokens = byte_tokens(&vocab);
        let (special_order, special_finder) = special_matcher(&vocab)?;
        Ok(Self {
            vocab,
            encoder,
            merges,
            style,
            special_order,
            special_finder,
            byte_tokens,
            bos,
            eos,
            add_bos,
            add_eos,
            add_space_prefix: spec.add_space_prefix.unwrap_or(add_space_prefix),
            clean_spaces: opts.clean_spaces.unwrap_or(clean_spaces),
            warnings,
        })
    }

    /// Things the loader could not honour exactly (e.g. an unknown pre-tokenizer), for logging.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// `add_special`: apply the model's BOS/EOS rules; `parse_special`: recognise control-token
    /// text such as "<|im_start|>" as single tokens (llama.cpp's `special=true`). User-defined
    /// added tokens are always recognised, as in both llama.cpp and HF.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut prev_special = true; // SPM: the first fragment gets the space prefix
        for (k, frag) in frags.into_iter().enumerate() {
            match frag {
                Frag::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Frag::Text(t) => {
                    match &self.encoder {
                        Encoder::Bpe { pre, ignore_merges } => {
                            self.encode_bpe(pre, *ignore_merges, t, &mut out)
                        }
                        Encoder::Spm => self.encode_spm(t, prev_special, &mut out),
                        Encoder::Gemma4 => self.encode_gemma4(t, &mut out),
                        Encoder::Hf(p) => p.encode(self, t, k == 0, &mut out),
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Splits out special tokens the way llama.cpp's `tokenizer_st_partition` does: for each
    /// special token, longest text first, every remaining text fragment is cut at its occurrences.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Frag<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Frag::Text(text)];
        let Some(finder) = &self.special_finder else {
            return frags;
        };
        let mut present = vec![false; self.special_order.len()];
        for m in finder.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
        }
        let c_space = |c: char| matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r');
        for (k, &id) in self.special_order.iter().enumerate() {
            let a = self.vocab.attrs[id as usize];
            if !present[k] || (!parse_special && a & (attr::CONTROL | attr::UNKNOWN) != 0) {
                continue;
            }
            let tok = self.vocab.texts[id as usize].as_str();
            let mut out = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Frag::Text(mut rest) = f else {
                    out.push(f);
                    continue;
                };
                while let Some(i) = rest.find(tok) {
                    let mut left = &rest[..i];
                    if a & attr::LSTRIP != 0 {
                        left = left.trim_end_matches(c_space);
                    }
                    if !left.is_empty() {
                        out.push(Frag::Text(left));
                    }
                    out.push(Frag::Token(id));
                    rest = &rest[i + tok.len()..];
                    if a & attr::RSTRIP != 0 {
                        rest = rest.trim_start_matches(c_space);
                    }
                }
                if !rest.is_empty() {
                    out.push(Frag::Text(rest));
                }
            }
            frags = out;
        }
        frags
    }

    fn encode_bpe(
        &self,
        pre: &LlamaPreTokenizer,
        ignore_merges: bool,
        text: &str,
        out: &mut Vec<u32>,
    ) {
        let mut enc = String::new();
        for word in pre.split(text) {
            enc.clear();
            unicode::byte_encode(word, &mut enc);
            if ignore_merges {
                if let Some(id) = self.vocab.find(&enc) {
                    out.push(id);
                    continue;
                }
            }
            self.merge_word(&enc, out, |bytes, out| {
                // llama.cpp looks each byte of an unknown symbol up as a one-byte string.
                for &b in bytes {
                    if b < 0x80 {
                        out.extend(self.vocab.find(&(b as char).to_string()));
                    }
                }
            });
        }
    }

    /// BPE-merges one word, starting from its chars; `unknown` spells symbols without an id.
    fn merge_word(
        &self,
        word: &str,
        out: &mut Vec<u32>,
        mut unknown: impl FnMut(&[u8], &mut Vec<u32>),
    ) {
        let mut buf = [0u8; 4];
        let symbols: Vec<Symbol> = word
            .char_indices()
            .map(|(i, c)| Symbol::new(self.vocab.find(c.encode_utf8(&mut buf)), i, c.len_utf8()))
            .collect();
        for s in self.merge_symbols(symbols) {
            match s.id {
                Some(id) => out.push(id),
                None => unknown(&word.as_bytes()[s.start..s.start + s.len], out),
            }
        }
    }

    pub(crate) fn merge_symbols(&self, symbols: Vec<Symbol>) -> Vec<Symbol> {
        bpe::merge(symbols, &self.merges)
    }

    /// Adds end-of-generation ids named outside the vocabulary (generation_config.json).
    pub(crate) fn add_eog(&mut self, ids: impl IntoIterator<Item = u32>) {
        let n = self.vocab.texts.len() as u32;
        self.vocab.eog.extend(ids.into_iter().filter(|&i| i < n));
        self.vocab.eog.sort_unstable();
        self.vocab.eog.dedup();
    }

    /// llama.cpp's gemma4 BPE session: spaces become '▁', the text splits into runs of
    /// newlines and runs of anything else; a newline run that is itself a token stays whole,
    /// every other run is merged from its chars, and a symbol left without a token is spelled
    /// as `<0xXX>` byte tokens (a byte without one is dropped, as llama.cpp does).
    fn encode_gemma4(&self, text: &str, out: &mut Vec<u32>) {
        let text = text.replace(' ', "\u{2581}");
        let mut rest = text.as_str();
        while let Some(c) = rest.chars().next() {
            let newline = c == '\n';
            let end = rest
                .find(|ch: char| (ch == '\n') != newline)
                .unwrap_or(rest.len());
            let (word, tail) = rest.split_at(end);
            rest = tail;
            if newline {
                if let Some(id) = self.vocab.find(word) {
                    out.push(id);
                    continue;
                }
            }
            self.merge_word(word, out, |bytes, out| {
                for &b in bytes {
                    out.extend(self.vocab.find(&format!("<0x{b:02X}>")));
                }
            });
        }
    }

    fn encode_spm(&self, text: &str, prev_special: bool, out: &mut Vec<u32>) {
        let mut t = String::with_capacity(text.len() + 4);
        if self.add_space_prefix && prev_special {
            t.push(' ');
        }
        t.push_str(text);
        let t = t.replace(' ', "\u{2581}");
        let byte_token = |b: u8| self.byte_tokens[b as usize];
        spm::tokenize(&t, &self.vocab.ids, &self.vocab.scores, &byte_token, out);
    }

    /// Text of `ids`. `skip_special` drops control/unknown tokens (and a leading BOS / trailing EOS
    /// the model adds itself), as llama.cpp's `detokenize(remove_special=true)`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if skip_special && self.add_bos && self.bos.is_some() && ids.first().copied() == self.bos {
            ids = &ids[1..];
            remove_space = false;
        }
        if skip_special && self.add_eos && self.eos.is_some() && ids.last().copied() == self.eos {
            ids = &ids[..ids.len() - 1];
        }
        let mut out = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                remove_space = false;
                continue;
            }
            let piece = self.token_bytes(id);
            let piece = if remove_space && piece.first() == Some(&b' ') {
                &piece[1..]
            } else {
                &piece[..]
            };
            out.extend_from_slice(piece);
            remove_space = false;
        }
        if self.clean_spaces {
            out = clean_spaces(&out);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The raw bytes `id` contributes: byte-level BPE chars mapped back to bytes, SPM '▁' as space,
    /// `<0xNN>` as the byte, special tokens as their text. Out-of-range ids give nothing.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.vocab.texts.get(id as usize) else {
            return Vec::new();
        };
        let a = self.vocab.attrs[id as usize];
        if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if a & attr::NORMAL != 0 {
            return match self.style {
                PieceStyle::ByteLevel => {
                    let mut out = Vec::with_capacity(text.len());
                    for c in text.chars() {
                        match unicode::char_to_byte(c) {
                            Some(b) => out.push(b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                }
                PieceStyle::Metaspace => text.replace('\u{2581}', " ").into_bytes(),
            };
        }
        if a & attr::BYTE != 0 {
            if let Some(b) = text
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                return vec![b];
            }
        }
        Vec::new()
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.texts.len()
    }

    /// Exact lookup of a token's text, e.g. "<think>".
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.find(text)
    }

    /// The token's text as stored in the vocabulary (byte-level chars, '▁', ...).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The model's own EOS id (the one `add_special` appends, when it appends one).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special=true, ..)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Every end-of-generation id (eos, eot, "<|im_end|>", "<end_of_turn>", ...), llama.cpp's EOG set.
    pub fn eos_ids(&self) -> &[u32] {
        &self.vocab.eog
    }

    /// Control or unknown tokens: not text, hidden by `decode(.., skip_special=true)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.vocab
            .attrs
            .get(id as usize)
            .is_some_and(|a| a & (attr::CONTROL | attr::UNKNOWN) != 0)
    }

    pub(crate) fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    pub(crate) fn byte_token(&self, b: u8) -> Option<u32> {
        self.byte_tokens[b as usize]
    }
}

/// The token table: texts (empty ones renamed, as llama.cpp does, so no text matches them),
/// scores, and attributes from the token types plus loader-given bits.
fn token_table(
    spec: &mut VocabSpec,
    extra_attrs: &[(u32, u32)],
    ids_meta: [Option<u32>; 3],
    llama_attrs: bool,
) -> Vocab {
    let n = spec.tokens.len();
    let texts: Vec<String> = std::mem::take(&mut spec.tokens)
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t
            }
        })
        .collect();
    let mut attrs: Vec<u32> = (0..n)
        .map(|i| {
            spec.token_types
                .get(i)
                .map_or(attr::NORMAL, |&t| attr_from_type(t))
        })
        .collect();
    for &(id, bits) in extra_attrs {
        if let Some(a) = attrs.get_mut(id as usize) {
            *a |= bits;
        }
    }
    let mut scores = std::mem::take(&mut spec.scores);
    scores.resize(n, 0.0);
    Vocab::new(texts, scores, attrs, ids_meta, llama_attrs)
}

/// `<0xNN>` byte tokens (SPM byte fallback), else the one-char token for ASCII bytes.
fn byte_tokens(vocab: &Vocab) -> Vec<Option<u32>> {
    (0..=255u8)
        .map(|b| {
            vocab.find(&format!("<0x{b:02X}>")).or_else(|| {
                if b < 0x80 {
                    vocab.find(&(b as char).to_string())
                } else {
                    None
                }
            })
        })
        .collect()
}

/// Special and added tokens in llama.cpp's splitting order (longest text first, then id), and an
/// automaton over their texts used to skip the ones absent from an input.
fn special_matcher(vocab: &Vocab) -> Result<(Vec<u32>, Option<AhoCorasick>), ChatError> {
    let special = attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN;
    let mut order: Vec<u32> = (0..vocab.texts.len() as u32)
        .filter(|&i| vocab.attrs[i as usize] & special != 0)
        .collect();
    order.sort_by(|&a, &b| {
        let len = |i: u32| vocab.texts[i as usize].len();
        len(b).cmp(&len(a)).then(a.cmp(&b))
    });
    if order.is_empty() {
        return Ok((order, None));
    }
    let pats: Vec<&str> = order
        .iter()
        .map(|&i| vocab.texts[i as usize].as_str())
        .collect();
    let finder = AhoCorasick::new(pats)
        .map_err(|e| ChatError::Tokenizer(format!("special-token matcher: {e}")))?;
    Ok((order, Some(finder)))
}

/// Merge rules keyed by token ids; rules naming unknown tokens are dropped (and counted).
fn merge_table(merges: &[String], vocab: &Vocab) -> (MergeTable, usize) {
    let mut table = MergeTable::with_capacity(merges.len());
    let mut dropped = 0;
    for (rank, m) in merges.iter().enumerate() {
        // llama.cpp splits at the first space after the first byte.
        let Some(pos) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
            dropped += 1;
            continue;
        };
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        match (vocab.find(a), vocab.find(b), vocab.find(&format!("{a}{b}"))) {
            (Some(x), Some(y), Some(z)) => {
                table.entry((x, y)).or_insert((rank as u32, z));
            }
            _ => dropped += 1,
        }
    }
    (table, dropped)
}

/// llama.cpp's `clean_spaces` pass over decoded text: " ?" " !" " ." " ," lose the space,
/// " ' " becomes "'", and " 's" " 'm" " 're" " 've" lose the space.
fn clean_spaces(t: &[u8]) -> Vec<u8> {
    if t.is_empty() {
        return Vec::new();
    }
    let mut p1 = vec![t[0]];
    for i in 1..t.len() {
        if t[i - 1] == b' ' && matches!(t[i], b'?' | b'!' | b'.' | b',') {
            p1.pop();
        }
        p1.push(t[i]);
    }
    let mut s = p1;
    let mut p2 = vec![s[0]];
    let mut i = 1;
    while i < s.len() {
        let x = s[i];
        if x == b'\'' && i + 1 < s.len() && s[i - 1] == b' ' && s[i + 1] == b' ' {
            p2.pop();
            s[i + 1] = 0; // marks the dropped space so it never reads as ' ' again
            p2.push(x);
            i += 2;
            continue;
        }
        p2.push(x);
        i += 1;
    }
    let t = p2;
    let mut p3 = vec![t[0]];
    for i in 1..t.len() {
        if t[i - 1] == b' ' && t[i] == b'\'' && i + 1 < t.len() {
            let x1 = t[i + 1];
            let x2 = t.get(i + 2).copied();
            let drop = matches!(x1, b's' | b'm')
                || (i + 2 < t.len() && matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e'))));
            if drop {
                p3.pop();
            }
        }
        p3.push(t[i]);
    }
    p3
}

#[cfg(test)]
mod tests;
