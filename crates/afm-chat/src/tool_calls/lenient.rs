//! A forgiving reader for the almost-JSON that models write: trailing commas, single quotes,
//! unquoted keys, Python literals (`True`, `None`), missing closing braces and strings at the
//! end of output, and Gemma's `<|"|>`/`<escape>` string delimiters. Used for repair
//! (`--fix-tool-args`), for Gemma's nested values and for Python-style `tool_code` calls.
//! Strict JSON goes through serde_json first; this runs only when that fails.

use serde_json::{Map, Number, Value};

/// Gemma 4 and FunctionGemma string delimiters (special tokens, so never inside a string).
pub(crate) const GEMMA_DELIMS: [&str; 2] = ["<|\"|>", "<escape>"];

/// Nesting deeper than this is not an argument object; it is refused, not recursed into.
const MAX_DEPTH: usize = 64;

/// Parses all of `s` leniently; text after the first value is ignored.
pub(crate) fn parse(s: &str) -> Option<Value> {
    parse_prefix(s).map(|(v, _)| v)
}

/// Parses one value at the start of `s`; returns it and the bytes it took.
pub(crate) fn parse_prefix(s: &str) -> Option<(Value, usize)> {
    let mut p = Reader { s, i: 0 };
    p.skip_ws();
    if p.i >= s.len() {
        return None;
    }
    let v = p.value(0)?;
    Some((v, p.i))
}

/// Strict JSON first, then the lenient reader.
pub(crate) fn parse_any(s: &str) -> Option<Value> {
    serde_json::from_str(s.trim()).ok().or_else(|| parse(s))
}

struct Reader<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Reader<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.i..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn skip_ws(&mut self) {
        self.i += super::scan::ws_len(self.rest());
    }

    fn skip_separators(&mut self) {
        loop {
            self.skip_ws();
            match self.peek() {
                Some(',') => self.i += 1,
                _ => return,
            }
        }
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.skip_ws();
        if let Some(d) = GEMMA_DELIMS.iter().find(|d| self.rest().starts_with(*d)) {
            self.i += d.len();
            return Some(Value::String(self.delimited(d)));
        }
        match self.peek()? {
            '{' => {
                self.i += 1;
                self.object(depth)
            }
            '[' | '(' => {
                self.i += 1;
                self.array(depth)
            }
            q @ ('"' | '\'') => {
                self.i += 1;
                Some(Value::String(self.quoted(q)))
            }
            _ => Some(self.bare()),
        }
    }

    fn object(&mut self, depth: usize) -> Option<Value> {
        let mut map = Map::new();
        loop {
            self.skip_separators();
            match self.peek() {
                None => return Some(Value::Object(map)),
                Some('}') => {
                    self.i += 1;
                    return Some(Value::Object(map));
                }
                _ => {}
            }
            let start = self.i;
            let key = self.key();
            self.skip_ws();
            if matches!(self.peek(), Some(':' | '=')) {
                self.i += 1;
            }
            self.skip_ws();
            let value = match self.peek() {
                // A key with its value cut off by the end of output.
                None | Some('}' | ',') => Value::Null,
                _ => self.value(depth + 1)?,
            };
            if self.i == start {
                // No progress on junk: stop rather than loop.
                return Some(Value::Object(map));
            }
            map.insert(key, value);
        }
    }

    fn array(&mut self, depth: usize) -> Option<Value> {
        let mut items = Vec::new();
        loop {
            self.skip_separators();
            match self.peek() {
                None => return Some(Value::Array(items)),
                Some(']' | ')') => {
                    self.i += 1;
                    return Some(Value::Array(items));
                }
                _ => {}
            }
            let start = self.i;
            items.push(self.value(depth + 1)?);
            if self.i == start {
                return Some(Value::Array(items));
            }
        }
    }

    fn key(&mut self) -> String {
        if let Some(d) = GEMMA_DELIMS.iter().find(|d| self.rest().starts_with(*d)) {
            self.i += d.len();
            return self.delimited(d);
        }
        match self.peek() {
            Some(q @ ('"' | '\'')) => {
                self.i += 1;
                self.quoted(q)
            }
            _ => {
                let rest = self.rest();
                let end = rest
                    .find(|c: char| matches!(c, ':' | '=' | ',' | '}') || c.is_whitespace())
                    .unwrap_or(rest.len());
                self.i += end;
                rest[..end].to_string()
            }
        }
    }

    fn delimited(&mut self, delim: &str) -> String {
        let rest = self.rest();
        let end = rest.find(delim);
        let text = rest[..end.unwrap_or(rest.len())].to_string();
        self.i += end.map_or(rest.len(), |e| e + delim.len());
        text
    }

    /// A quoted string with JSON/Python escapes; an unterminated one runs to the end.
    fn quoted(&mut self, q: char) -> String {
        let mut out = String::new();
        let mut chars = self.rest().char_indices();
        while let Some((at, c)) = chars.next() {
            if c == q {
                self.i += at + 1;
                return out;
            }
            if c != '\\' {
                out.push(c);
                continue;
            }
            match chars.next() {
                Some((_, 'n')) => out.push('\n'),
                Some((_, 't')) => out.push('\t'),
                Some((_, 'r')) => out.push('\r'),
                Some((_, 'b')) => out.push('\u{8}'),
                Some((_, 'f')) => out.push('\u{c}'),
                Some((_, 'u')) => {
                    let hex: String = chars.by_ref().take(4).map(|(_, c)| c).collect();
                    let code = u32::from_str_radix(&hex, 16).ok();
                    out.push(code.and_then(char::from_u32).unwrap_or('\u{fffd}'));
                }
                Some((_, other)) => out.push(other),
                None => {}
            }
        }
        self.i = self.s.len();
        out
    }

    /// Numbers, literals, and anything else up to a delimiter (kept as a string).
    fn bare(&mut self) -> Value {
        let rest = self.rest();
        let end = rest.find([',', '}', ']', ')', '\n']).unwrap_or(rest.len());
        let word = rest[..end].trim();
        self.i += end;
        scalar(word)
    }
}

/// Reads a bare word as JSON/Python would: number, boolean, null, else the string itself.
pub(crate) fn scalar(word: &str) -> Value {
    match word {
        "true" | "True" => return Value::Bool(true),
        "false" | "False" => return Value::Bool(false),
        "null" | "None" | "nil" => return Value::Null,
        _ => {}
    }
    if let Ok(n) = serde_json::from_str::<Number>(word) {
        return Value::Number(n);
    }
    // Python-style forms JSON lacks (`5.`, `.5`, `+1`), but not `00123`: a zip code or id.
    let digits = word.trim_start_matches(['-', '+']);
    let leading_zero = digits.len() > 1 && digits.starts_with('0') && !digits[1..].starts_with('.');
    let looks_numeric =
        !leading_zero && digits.starts_with(|c: char| c.is_ascii_digit() || c == '.');
    if let Some(n) = looks_numeric
        .then(|| word.parse::<f64>().ok())
        .flatten()
        .and_then(Number::from_f64)
    {
        return Value::Number(n);
    }
    Value::String(word.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn salvages_what_models_write() {
        let cases = [
            (r#"{"a": 1, "b": [1, 2,],}"#, json!({"a": 1, "b": [1, 2]})),
            (
                "{'city': 'Paris', 'days': 3}",
                json!({"city": "Paris", "days": 3}),
            ),
            (
                "{city: \"Paris\", metric: True, x: None}",
                json!({"city": "Paris", "metric": true, "x": null}),
            ),
            (r#"{"q": "open string"#, json!({"q": "open string"})),
            (r#"{"a": {"b": [1, 2"#, json!({"a": {"b": [1, 2]}})),
            (
                r#"{"s": "it's \"quoted\"\n"}"#,
                json!({"s": "it's \"quoted\"\n"}),
            ),
            ("{k:<|\"|>a, b}<|\"|>,n:5}", json!({"k": "a, b}", "n": 5})),
            ("{'u': '\\u00e9t\\u00e9'}", json!({"u": "été"})),
        ];
        for (text, want) in cases {
            assert_eq!(parse(text), Some(want), "{text}");
        }
    }

    #[test]
    fn refuses_absurd_nesting_without_overflowing() {
        let deep = "[".repeat(100_000);
        assert_eq!(parse(&deep), None);
    }
}
