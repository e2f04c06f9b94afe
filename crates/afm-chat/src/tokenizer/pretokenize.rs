//! llama.cpp's BPE pre-tokenizers, selected by GGUF `tokenizer.ggml.pre`.
//!
//! Each pre-tokenizer is a list of regexes applied in turn, each splitting the pieces the previous
//! one produced (matches and the gaps between them both become pieces). Like llama.cpp, the GPT-2
//! and Llama-3 regexes run as hand-written scanners, and the others run on a "collapsed" text in
//! which every non-ASCII codepoint is replaced by one stand-in char per Unicode category, with
//! `\p{..}` in the regex rewritten to match the stand-in. That is what makes our splits equal
//! llama.cpp's, including its quirks (e.g. all non-ASCII letters count as both upper and lower case).

use super::unicode::{category, flags, is_whitespace, Category};
use crate::ChatError;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

/// Settings that llama.cpp ties to the pre-tokenizer name.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PreSettings {
    pub clean_spaces: bool,
    pub ignore_merges: bool,
    /// `Some(true)` where llama.cpp turns BOS on for the family (before GGUF overrides it).
    pub add_bos: bool,
}

enum SplitExpr {
    Gpt2,
    Llama3,
    /// A regex run on the collapsed text (`true`) or on the text with non-ASCII spaces as \x0B.
    Regex(fancy_regex::Regex, bool),
}

pub(crate) struct LlamaPreTokenizer {
    exprs: Vec<SplitExpr>,
}

impl LlamaPreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value; unknown names fall back to GPT-2
    /// (llama.cpp refuses them) and return a warning to show.
    pub(crate) fn for_name(name: &str) -> Result<(Self, PreSettings, Option<String>), ChatError> {
        let mut s = PreSettings {
            clean_spaces: true,
            ignore_merges: false,
            add_bos: false,
        };
        let mut warning = None;
        let exprs: Vec<&str> = match name {
            "" | "default" => DEFAULT.to_vec(),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" => {
                s.ignore_merges = true;
                s.add_bos = true;
                vec![LLAMA3]
            }
            "dbrx" | "smaug-bpe" => vec![LLAMA3],
            "qwen2" | "deepseek-r1-qwen" => {
                s.clean_spaces = false;
                vec![QWEN2]
            }
            "megrez" | "stablelm2" => vec![QWEN2],
            "smollm" | "command-r" => {
                s.clean_spaces = false;
                vec![r"\p{N}", GPT2]
            }
            "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" => vec![r"\p{N}", GPT2],
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais"
            | "exaone4" => vec![GPT2],
            "trillion" | "granite-docling" => {
                s.clean_spaces = false;
                vec![GPT2]
            }
            "gpt-4o" | "llama4" | "kanana2" => {
                s.clean_spaces = false;
                vec![GPT4O]
            }
            other => {
                warning = Some(format!(
                    "tokenizer.ggml.pre = {other:?} is not supported; using the GPT-2 pre-tokenizer (token ids may differ from llama.cpp)"
                ));
                vec![GPT2]
            }
        };
        let exprs = exprs
            .into_iter()
            .map(compile)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((Self { exprs }, s, warning))
    }

    /// Splits `text` into words, as UTF-8 strings (not yet byte-level encoded).
    pub(crate) fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let cpts: Vec<u32> = text.chars().map(|c| c as u32).collect();
        let mut offsets = vec![cpts.len()];
        for expr in &self.exprs {
            offsets = match expr {
                SplitExpr::Gpt2 => split_chunks(&cpts, &offsets, split_gpt2),
                SplitExpr::Llama3 => split_chunks(&cpts, &offsets, split_llama3),
                SplitExpr::Regex(re, collapsed) => split_regex(&cpts, &offsets, re, *collapsed),
            };
        }
        // Codepoint lengths back to string slices.
        let mut words = Vec::with_capacity(offsets.len());
        let mut chars = text
            .char_indices()
            .map(|(i, _)| i)
            .chain(std::iter::once(text.len()));
        let mut start = chars.next().unwrap_or(0);
        for len in offsets {
            if len == 0 {
                continue;
            }
            let end = chars.nth(len - 1).unwrap_or(text.len());
            words.push(&text[start..end]);
            start = end;
        }
        words
    }
}

fn compile(expr: &str) -> Result<SplitExpr, ChatError> {
    if expr == GPT2 {
        return Ok(SplitExpr::Gpt2);
    }
    if expr == LLAMA3 {
        return Ok(SplitExpr::Llama3);
    }
    let collapsed = expr.contains(r"\p{");
    let pattern = if collapsed {
        collapse_regex(expr)
    } else {
        expr.to_string()
    };
    let re = fancy_regex::Regex::new(&pattern).map_err(|e| {
        ChatError::Tokenizer(format!(
            "pre-tokenizer regex {expr:?} does not compile: {e}"
        ))
    })?;
    Ok(SplitExpr::Regex(re, collapsed))
}

// Stand-ins for non-ASCII codepoints in the collapsed text (private-use chars, never \s).
const C_OTHER: char = '\u{E0D0}';
const C_NUMBER: char = '\u{E0D1}';
const C_LETTER: char = '\u{E0D2}';
const C_PUNCT: char = '\u{E0D3}';
const C_MARK: char = '\u{E0D4}';
const C_SYMBOL: char = '\u{E0D5}';

fn collapse_char(cp: u32) -> char {
    if cp < 128 {
        return char::from_u32(cp).unwrap_or(C_OTHER);
    }
    if is_whitespace(cp) {
        return '\x0B';
    }
    match category(cp) {
        Category::Number => C_NUMBER,
        Category::Letter => C_LETTER,
        Category::Punctuation => C_PUNCT,
        Category::Mark => C_MARK,
        Category::Symbol => C_SYMBOL,
        _ => C_OTHER,
    }
}

/// Class body (without brackets) matching a category in the collapsed text: its stand-in plus
/// the ASCII members llama.cpp lists for it.
fn category_class(name: &str) -> Option<String> {
    let (stand_in, ascii) = match name {
        "N" => (C_NUMBER, r"0-9"),
        "L" | "Lu" | "Ll" | "Lt" | "Lm" | "Lo" => (C_LETTER, r"A-Za-z"),
        "P" => (
            C_PUNCT,
            r"\x21-\x23\x25-\x2A\x2C-\x2F\x3A-\x3B\x3F-\x40\x5B-\x5D\x5F\x7B\x7D",
        ),
        "M" => (C_MARK, ""),
        "S" => (C_SYMBOL, r"\x24\x2B\x3C-\x3E\x5E\x60\x7C"),
        _ => return None,
    };
    Some(format!(r"\x{{{:X}}}{ascii}", stand_in as u32))
}

/// Rewrites `\p{X}` into classes over the collapsed alphabet (llama.cpp's regex_expr_collapsed).
fn collapse_regex(expr: &str) -> String {
    let b = expr.as_bytes();
    let mut out = String::with_capacity(expr.len() * 2);
    let mut inside = false;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'[' && (i == 0 || b[i - 1] != b'\\') {
            out.push('[');
            inside = true;
            i += 1;
            continue;
        }
        if inside && c == b']' && b[i - 1] != b'\\' {
            out.push(']');
            inside = false;
            i += 1;
            continue;
        }
        if c == b'\\' && expr[i..].starts_with(r"\p{") {
            if let Some(close) = expr[i..].find('}') {
                if let Some(class) = category_class(&expr[i + 3..i + close]) {
                    if inside {
                        out.push_str(&class);
                    } else {
                        out.push('[');
                        out.push_str(&class);
                        out.push(']');
                    }
                    i += close + 1;
                    continue;
                }
            }
        }
        // The supported regexes are ASCII, so byte-wise copying is char-wise.
        out.push(c as char);
        i += 1;
    }
    out
}

fn split_regex(
    cpts: &[u32],
    offsets: &[usize],
    re: &fancy_regex::Regex,
    collapsed: bool,
) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let chunk = &cpts[start..start + len];
        start += len;
        let mut s = String::with_capacity(len);
        let mut char_at_byte = Vec::with_capacity(len + 1); // byte offset of each char
        for &cp in chunk {
            char_at_byte.push(s.len());
            let c = if collapsed {
                collapse_char(cp)
            } else if cp > 0x7F && is_whitespace(cp) {
                '\x0B'
            } else {
                char::from_u32(cp).unwrap_or('\u{FFFD}')
            };
            s.push(c);
        }
        char_at_byte.push(s.len());
        let to_char = |byte: usize| char_at_byte.partition_point(|&b| b < byte);
        let mut prev = 0;
        let mut pos = 0;
        // A regex error (backtrack limit) leaves the rest of the chunk as one piece.
        while pos <= s.len() {
            let Ok(Some(m)) = re.find_from_pos(&s, pos) else {
                break;
            };
            let (ms, me) = (to_char(m.start()), to_char(m.end()));
            if ms > prev {
                out.push(ms - prev);
            }
            if me > ms {
                out.push(me - ms);
            }
            prev = me;
            pos = if m.end() > m.start() {
                m.end()
            } else {
                next_char_boundary(&s, m.end())
            };
        }
        if len > prev {
            out.push(len - prev);
        }
    }
    out
}

fn next_char_boundary(s: &str, at: usize) -> usize {
    let mut i = at + 1;
    while i < s.len() && !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// Runs a hand-written scanner over each chunk; the scanner returns piece lengths.
fn split_chunks(cpts: &[u32], offsets: &[usize], scan: fn(&[u32], &mut Vec<usize>)) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        scan(&cpts[start..start + len], &mut out);
        start += len;
    }
    out
}

/// Emits pieces as lengths, tracking where the previous piece ended.
struct Pieces<'a> {
    out: &'a mut Vec<usize>,
    prev_end: usize,
}

impl Pieces<'_> {
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }
}

fn is_contraction(c: &[u32], pos: usize, lower: bool) -> usize {
    let get = |i: usize| {
        c.get(i).map(|&x| {
            if lower && (b'A' as u32..=b'Z' as u32).contains(&x) {
                x + 32
            } else {
                x
            }
        })
    };
    if c[pos] != '\'' as u32 || pos + 1 >= c.len() {
        return 0;
    }
    let n = get(pos + 1).unwrap_or(0);
    if [b's', b't', b'm', b'd'].iter().any(|&x| n == x as u32) {
        return 2;
    }
    if pos + 2 < c.len() {
        let nn = get(pos + 2).unwrap_or(0);
        let pair = |a: u8, b: u8| n == a as u32 && nn == b as u32;
        if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
            return 3;
        }
    }
    0
}

/// llama.cpp's GPT-2 scanner: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
fn split_gpt2(c: &[u32], out: &mut Vec<usize>) {
    let f = |i: usize| flags(c.get(i).copied());
    let mut p = Pieces { out, prev_end: 0 };
    let mut pos = 0;
    while pos < c.len() {
        let cpt = c[pos];
        let n = is_contraction(c, pos, false);
        if n > 0 {
            pos += p.add(pos + n);
            continue;
        }
        let space = cpt == ' ' as u32;
        let f2 = if space { f(pos + 1) } else { f(pos) };
        let other =
            |fl: super::unicode::Flags| !(fl.whitespace || fl.letter || fl.number) && fl.present;
        if f2.letter || f2.number || other(f2) {
            pos += space as usize;
            if f2.letter {
                while f(pos).letter {
                    pos += 1;
                }
            } else if f2.number {
                while f(pos).number {
                    pos += 1;
                }
            } else {
                while other(f(pos)) {
                    pos += 1;
                }
            }
            p.add(pos);
            continue;
        }
        let mut nws = 0;
        while f(pos + nws).whitespace {
            nws += 1;
        }
        if nws > 1 && pos + nws < c.len() {
            pos += nws - 1;
            p.add(pos);
            continue;
        }
        if nws > 0 {
            pos += nws;
            p.add(pos);
            continue;
        }
        pos += 1;
        p.add(pos);
    }
}

/// llama.cpp's Llama-3 scanner for its regex (see `LLAMA3`).
fn split_llama3(c: &[u32], out: &mut Vec<usize>) {
    let f = |i: usize| flags(c.get(i).copied());
    let is_rn = |i: usize| matches!(c.get(i), Some(&x) if x == '\r' as u32 || x == '\n' as u32);
    let mut p = Pieces { out, prev_end: 0 };
    let mut pos = 0;
    while pos < c.len() {
        let cpt = c[pos];
        let fl = f(pos);
        let n = is_contraction(c, pos, true);
        if n > 0 {
            pos += p.add(pos + n);
            continue;
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(is_rn(pos) || fl.number) && (fl.letter || f(pos + 1).letter) {
            pos += 1;
            while f(pos).letter {
                pos += 1;
            }
            p.add(pos);
            continue;
        }
        // \p{N}{1,3}
        if fl.number {
            let mut ini = pos;
            while f(pos).number {
                pos += 1;
                if pos - ini >= 3 {
                    p.add(pos);
                    ini = pos;
                }
            }
            p.add(pos);
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let space = cpt == ' ' as u32;
        let f2 = if space { f(pos + 1) } else { fl };
        let other = |x: super::unicode::Flags| !(x.whitespace || x.letter || x.number) && x.present;
        if !(f2.whitespace || f2.letter || f2.number) && fl.present {
            pos += space as usize;
            while other(f(pos)) {
                pos += 1;
            }
            while is_rn(pos) {
                pos += 1;
            }
            p.add(pos);
            continue;
        }
        let mut nws = 0;
        let mut last_rn = 0;
        while f(pos + nws).whitespace {
            if is_rn(pos + nws) {
                last_rn = pos + nws + 1;
            }
            nws += 1;
        }
        if last_rn > 0 {
            pos = last_rn;
            p.add(pos);
            continue;
        }
        if nws > 1 && pos + nws < c.len() {
            pos += nws - 1;
            p.add(pos);
            continue;
        }
        if nws > 0 {
            pos += nws;
            p.add(pos);
            continue;
        }
        pos += 1;
        p.add(pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: &str, text: &str) -> Vec<String> {
        let (p, _, _) = LlamaPreTokenizer::for_name(pre).expect("known pre-tokenizer");
        p.split(text).into_iter().map(str::to_string).collect()
    }

    #[test]
    fn gpt2_splits_like_the_regex() {
        assert_eq!(
            words("gpt-2", "Hello world's  end 123"),
            ["Hello", " world", "'s", " ", " end", " 123"]
        );
        assert_eq!(words("gpt-2", "a \n\n b"), ["a", " \n\n", " b"]);
    }

    #[test]
    fn smollm_isolates_digits() {
        assert_eq!(words("smollm", "x=12 3"), ["x", "=", "1", "2", " ", "3"]);
    }

    #[test]
    fn qwen2_regex_on_collapsed_text() {
        assert_eq!(
            words("qwen2", "Héllo, 世界!\n\n  x"),
            ["Héllo", ",", " 世界", "!\n\n", " ", " x"]
        );
        assert_eq!(words("qwen2", "I'M 42"), ["I", "'M", " ", "4", "2"]);
    }

    #[test]
    fn llama3_groups_three_digits() {
        assert_eq!(words("llama3", "12345 ab"), ["123", "45", " ab"]);
    }
}
