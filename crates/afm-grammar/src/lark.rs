//! Writing llguidance Lark text: fresh rule and terminal names, literals, regexes, and the
//! dialect markers, which are written as the vocabulary's special token (`<[id]>`) when the
//! model has one with exactly that text and as plain text otherwise.
//!
//! Why both: a control token's bytes are marked in the token trie (vocab.rs), so text can never
//! spell it; a model whose markers are control tokens (Kimi's `<|tool_call_begin|>`, Gemma 4's
//! `<|tool_call>`) must be offered the token. A model without them (SmolLM2 forced to another
//! dialect) writes the marker as text, which is also what the parser reads either way.
//!
//! Terminals are greedy in llguidance, so free text followed by a text closer is written as
//! one terminal (`BODY "closer"`): the body can then never swallow the closer's first bytes.

use std::collections::HashMap;

use afm_chat::Tokenizer;

/// The special (control) tokens of a vocabulary by text.
#[derive(Debug, Default, Clone)]
pub struct Markers {
    special: HashMap<String, u32>,
}

impl Markers {
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Self {
        let special = (0..tokenizer.vocab_size() as u32)
            .filter(|&id| tokenizer.is_special(id))
            .filter_map(|id| Some((tokenizer.token_text(id)?.to_string(), id)))
            .collect();
        Markers { special }
    }

    /// The special token spelled exactly `text`, if the vocabulary has one.
    pub fn token(&self, text: &str) -> Option<u32> {
        self.special.get(text).copied()
    }

    /// `text` split into special tokens (longest first, anywhere in it) and the text between
    /// them: a marker may be one token (`<|tool_call_begin|>`), or a token plus text.
    pub fn pieces<'t>(&self, text: &'t str) -> Vec<(Option<u32>, &'t str)> {
        let mut out = Vec::new();
        let (mut i, mut plain) = (0, 0);
        while i < text.len() {
            let hit = (i + 1..=text.len())
                .rev()
                .filter(|&j| text.is_char_boundary(j))
                .find_map(|j| self.token(&text[i..j]).map(|id| (j, id)));
            match hit {
                Some((j, id)) => {
                    if plain < i {
                        out.push((None, &text[plain..i]));
                    }
                    out.push((Some(id), &text[i..j]));
                    (i, plain) = (j, j);
                }
                None => i += text[i..].chars().next().map_or(1, char::len_utf8),
            }
        }
        if plain < text.len() {
            out.push((None, &text[plain..]));
        }
        out
    }

    /// `text` as Lark atoms: its special tokens as `<[id]>`, the rest as literals.
    pub fn atom(&self, text: &str) -> String {
        let atoms: Vec<String> = self
            .pieces(text)
            .into_iter()
            .map(|(id, t)| match id {
                Some(id) => format!("<[{id}]>"),
                None => lit(t),
            })
            .collect();
        atoms.join(" ")
    }

    /// Markers and text in order, each as its atoms.
    pub fn seq(&self, parts: &[&str]) -> String {
        let atoms: Vec<String> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| self.atom(p))
            .collect();
        atoms.join(" ")
    }
}

/// A Lark string literal.
pub fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// `s` as a regex matching exactly it.
pub fn rx_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
            | '#' | '&' | '-' | '~' => {
                out.push('\\');
                out.push(c);
            }
            '/' => out.push_str("\\/"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

/// A Lark regex atom (`/…/`) for a regex already escaped for Lark (no bare `/`).
pub fn rx(body: &str) -> String {
    format!("/{body}/")
}

/// Text that contains none of `words`: a terminal conjunct. Closers that open with their only
/// `<` get a plain regex (`[^<]*(<S)*`, S a `<`-free run that starts no closer's tail), which
/// llguidance's lexer derives cheaply; a complement (`~/.*(a|b).*/`) intersected with length
/// bounds can exhaust its per-token fuel.
pub fn not_containing(words: &[&str]) -> Option<String> {
    if words.is_empty() {
        return None;
    }
    let simple = words
        .iter()
        .all(|w| w.len() > 1 && w.starts_with('<') && !w[1..].contains('<'));
    if simple {
        let tails: Vec<&str> = words.iter().map(|w| &w[1..]).collect();
        return Some(rx(&format!("(?s:[^<]*(?:<{})*)", run_avoiding(&tails, ""))));
    }
    let alts: Vec<String> = words.iter().map(|w| rx_escape(w)).collect();
    Some(format!("~/(?s:.*(?:{}).*)/", alts.join("|")))
}

/// A `<`-free run that does not start with any of `tails`, given it starts with `prefix`
/// (a proper prefix of some tail): end here, leave the tails' paths, or follow one.
fn run_avoiding(tails: &[&str], prefix: &str) -> String {
    let mut next: Vec<char> = tails
        .iter()
        .filter_map(|t| t.strip_prefix(prefix).and_then(|r| r.chars().next()))
        .collect();
    next.sort_unstable();
    next.dedup();
    let mut banned: String = next.iter().collect();
    banned.push('<');
    let class: String = banned.chars().map(class_escape).collect();
    let mut alts = vec![String::new(), format!("[^{class}][^<]*")];
    for c in next {
        let p = format!("{prefix}{c}");
        if !tails.contains(&p.as_str()) {
            alts.push(format!(
                "{}{}",
                rx_escape(&c.to_string()),
                run_avoiding(tails, &p)
            ));
        }
    }
    format!("(?:{})", alts.join("|"))
}

fn class_escape(c: char) -> String {
    match c {
        '\\' | ']' | '[' | '^' | '-' | '&' | '~' => format!("\\{c}"),
        '/' => "\\/".into(),
        '\n' => "\\n".into(),
        c => c.to_string(),
    }
}

/// A grammar under construction: rules and terminals with fresh names.
#[derive(Default)]
pub struct Lark {
    lines: Vec<String>,
    next: usize,
}

impl Lark {
    /// A new rule (lowercase name) with `body`; returns its name.
    pub fn rule(&mut self, body: &str) -> String {
        self.next += 1;
        let name = format!("r{}", self.next);
        self.lines.push(format!("{name}: {body}"));
        name
    }

    /// A new terminal (uppercase name) with `body`; returns its name.
    pub fn terminal(&mut self, body: &str) -> String {
        self.next += 1;
        let name = format!("T{}", self.next);
        self.lines.push(format!("{name}: {body}"));
        name
    }

    /// Free text matching the terminal expression `body`, then the markers `closer` in
    /// order: the closer's leading text goes into one terminal with the body (see the module
    /// comment); from its first special token on, the closer is written as atoms.
    pub fn text_then(&mut self, body: &str, closer: &[&str], markers: &Markers) -> String {
        let t = self.terminal(body);
        let joined = closer.concat();
        let pieces = markers.pieces(&joined);
        let split = pieces
            .iter()
            .position(|p| p.0.is_some())
            .unwrap_or(pieces.len());
        let text: String = pieces[..split].iter().map(|p| p.1).collect();
        let mut out = vec![match text.is_empty() {
            true => t,
            false => self.terminal(&format!("{t} {}", lit(&text))),
        }];
        out.extend(pieces[split..].iter().map(|p| match p.0 {
            Some(id) => format!("<[{id}]>"),
            None => lit(p.1),
        }));
        out.join(" ")
    }

    /// The finished grammar with `start` as its start rule body.
    pub fn finish(mut self, start: &str) -> String {
        self.lines.insert(0, format!("start: {start}"));
        let mut out = self.lines.join("\n");
        out.push('\n');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_split_into_special_tokens_and_text() {
        let m = Markers {
            special: [
                ("<｜DSML｜".to_string(), 7),
                ("<|tool_call>".to_string(), 9),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(
            m.pieces("\n<｜DSML｜invoke name=\"f\">"),
            vec![
                (None, "\n"),
                (Some(7), "<｜DSML｜"),
                (None, "invoke name=\"f\">")
            ]
        );
        assert_eq!(m.atom("<|tool_call>"), "<[9]>");
        assert_eq!(m.atom("<tool_call>"), "\"<tool_call>\"");
        let mut lark = Lark::default();
        // Text after the body joins its terminal; from the first token on, atoms.
        let v = lark.text_then("/a/", &["\n", "<|tool_call>", "x"], &m);
        assert_eq!(v, "T2 <[9]> \"x\"");
        assert!(lark.finish("x").contains("T2: T1 \"\\n\""));
    }
}
