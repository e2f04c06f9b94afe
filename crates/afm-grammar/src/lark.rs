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

    /// `text` as a Lark atom: its special token, or the literal.
    pub fn atom(&self, text: &str) -> String {
        match self.token(text) {
            Some(id) => format!("<[{id}]>"),
            None => lit(text),
        }
    }

    /// Markers and text in order, each as its atom.
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
        let split = closer
            .iter()
            .position(|c| markers.token(c).is_some())
            .unwrap_or(closer.len());
        let text = closer[..split].concat();
        let mut out = vec![match text.is_empty() {
            true => t,
            false => self.terminal(&format!("{t} {}", lit(&text))),
        }];
        out.extend(closer[split..].iter().map(|c| markers.atom(c)));
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
