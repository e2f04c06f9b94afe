//! Gemma's dialects. Gemma 4: `<|tool_call>call:name{key:<|"|>text<|"|>,n:5}<tool_call|>`;
//! FunctionGemma: the same inside `<start_function_call>`…`<end_function_call>` with
//! `<escape>` as the string delimiter; Gemma 3 (prompted): a ```` ```tool_code ```` block
//! holding `name(key="text", n=5)` (optionally in `print(..)`) or a `call:` expression.
//!
//! Keys are unquoted and strings are delimited by special tokens, so no brace or quote in a
//! string can end anything. Top-level string values stream; numbers, booleans and nested
//! objects/lists go out when complete.

use serde_json::Value;

use super::emit::{Declared, Emitter, Trim};
use super::lenient::{self, GEMMA_DELIMS};
use super::scan::{find_marker, peek, peek_any, read_until, ws_len, Peek};
use super::{Body, Flow};

const MAX_HEADER: usize = 256;

/// Whether a name, key or bare value whose terminator ends `through` bytes in fits
/// [`MAX_HEADER`]: streaming gives up with more than `MAX_HEADER` bytes and no terminator yet
/// (at most `through - 1`), so text seen whole must meet the same bound, or the outcome would
/// depend on how the output was chunked.
fn header_fits(through: usize) -> bool {
    through.saturating_sub(1) <= MAX_HEADER
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Head,
    Key,
    Value,
    Str(&'static str),
    Nested,
    Bare,
    AfterCall,
    Code,
}

pub(crate) struct Gemma {
    closer: &'static str,
    st: St,
    key: String,
    /// Nested value or code block text so far, and the scan state through it.
    buf: String,
    depth: usize,
    in_str: Option<&'static str>,
    code_fence: CodeFence,
    made: usize,
}

impl Gemma {
    /// After `<|tool_call>` or `<start_function_call>`; `closer` ends the block.
    pub(crate) fn new(closer: &'static str) -> Self {
        Self {
            closer,
            st: St::Head,
            key: String::new(),
            buf: String::new(),
            depth: 0,
            in_str: None,
            code_fence: CodeFence::default(),
            made: 0,
        }
    }

    /// After ```` ```tool_code ````.
    pub(crate) fn code_block() -> Self {
        Self {
            st: St::Code,
            ..Self::new("```")
        }
    }

    fn head(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        let prefix = match peek(t, "call:") {
            Peek::Yes => "call:".len(),
            Peek::Maybe => return Flow::Need,
            Peek::No => 0,
        };
        let Some((name, used)) =
            read_until(&t[prefix..], "{").filter(|(_, used)| header_fits(prefix + used))
        else {
            return self.too_long(t);
        };
        let name = name.trim();
        if name.is_empty() || name.contains(|c: char| c.is_whitespace() || c == '<') {
            return self.give_up();
        }
        em.start_call(name);
        self.st = St::Key;
        Flow::Step(ws + prefix + used)
    }

    fn key(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        match t.chars().next() {
            None => Flow::Need,
            Some(',') => Flow::Step(ws + 1),
            Some('}') => {
                em.end_call();
                self.made += 1;
                self.st = St::AfterCall;
                Flow::Step(ws + 1)
            }
            Some(_) => {
                let Some((key, used)) = read_until(t, ":").filter(|(_, used)| header_fits(*used))
                else {
                    return self.too_long(t);
                };
                let mut key = key.trim();
                for d in GEMMA_DELIMS {
                    key = key.strip_prefix(d).unwrap_or(key);
                    key = key.strip_suffix(d).unwrap_or(key);
                }
                self.key = key.to_string();
                self.st = St::Value;
                Flow::Step(ws + used)
            }
        }
    }

    fn value(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        match peek_any(t, &GEMMA_DELIMS) {
            Ok(i) => {
                em.param_begin(&self.key, Declared::String, Trim::None);
                self.st = St::Str(GEMMA_DELIMS[i]);
                return Flow::Step(ws + GEMMA_DELIMS[i].len());
            }
            Err(true) => return Flow::Need,
            Err(false) => {}
        }
        self.st = match t.chars().next() {
            Some('{' | '[') => {
                self.buf.clear();
                self.depth = 0;
                self.in_str = None;
                St::Nested
            }
            _ => St::Bare,
        };
        Flow::Step(ws)
    }

    fn string(&mut self, input: &str, delim: &'static str, em: &mut Emitter) -> Flow {
        match find_marker(input, delim) {
            Ok(at) => {
                em.param_text(&input[..at]);
                em.param_end();
                self.st = St::Key;
                Flow::Step(at + delim.len())
            }
            Err(0) => Flow::Need,
            Err(safe) => {
                em.param_text(&input[..safe]);
                Flow::Step(safe)
            }
        }
    }

    /// A nested object or list: read to its matching close, then parse it whole.
    fn nested(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        let (used, done) = self.scan_nested(input, eof);
        self.buf.push_str(&input[..used]);
        if !done && !eof {
            return if used == 0 {
                Flow::Need
            } else {
                Flow::Step(used)
            };
        }
        let value = lenient::parse(&self.buf).unwrap_or(Value::Null);
        self.put(value, em);
        self.st = St::Key;
        if done {
            Flow::Step(used)
        } else {
            Flow::Need
        }
    }

    fn scan_nested(&mut self, input: &str, eof: bool) -> (usize, bool) {
        let mut i = 0;
        while i < input.len() {
            let rest = &input[i..];
            if let Some(d) = self.in_str {
                match find_marker(rest, d) {
                    Ok(at) => {
                        i += at + d.len();
                        self.in_str = None;
                        continue;
                    }
                    Err(safe) => return (i + safe, false),
                }
            }
            match peek_any(rest, &GEMMA_DELIMS) {
                Ok(k) => {
                    self.in_str = Some(GEMMA_DELIMS[k]);
                    i += GEMMA_DELIMS[k].len();
                    continue;
                }
                Err(true) if !eof && rest.starts_with('<') => return (i, false),
                _ => {}
            }
            let c = rest.chars().next().unwrap_or(' ');
            match c {
                '{' | '[' => self.depth += 1,
                '}' | ']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return (i + 1, true);
                    }
                }
                _ => {}
            }
            i += c.len_utf8();
        }
        (i, false)
    }

    fn bare(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        let at = match input.find([',', '}']) {
            Some(at) if header_fits(at + 1) => at,
            None if eof && input.len() <= MAX_HEADER => input.len(),
            _ => return self.too_long(input),
        };
        em.param_begin(&self.key, Declared::Auto, Trim::Space);
        em.param_text(&input[..at]);
        em.param_end();
        self.st = St::Key;
        Flow::Step(at)
    }

    fn put(&mut self, value: Value, em: &mut Emitter) {
        em.param_begin(&self.key, Declared::Json, Trim::None);
        em.param_text(&value.to_string());
        em.param_end();
    }

    fn after_call(&mut self, input: &str) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        match peek_any(t, &[self.closer, "call:"]) {
            Ok(0) => Flow::Done(ws + self.closer.len()),
            Ok(_) => {
                self.st = St::Head;
                Flow::Step(ws)
            }
            Err(true) => Flow::Need,
            Err(false) => Flow::Done(0),
        }
    }

    /// A ```` ```tool_code ```` block: read to the closing fence, then parse its calls.
    fn code(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        let (used, end) = self.code_fence.feed(input, eof);
        self.buf.push_str(&input[..used]);
        if !end {
            return if used == 0 {
                Flow::Need
            } else {
                Flow::Step(used)
            };
        }
        let Some(calls) = parse_code(&self.buf) else {
            return Flow::Reject;
        };
        for (name, args) in calls {
            em.start_call(&name);
            em.json_args(&args.to_string());
            em.end_call();
        }
        Flow::Done(used + 3)
    }

    fn too_long(&self, t: &str) -> Flow {
        if t.len() > MAX_HEADER {
            self.give_up()
        } else {
            Flow::Need
        }
    }

    fn give_up(&self) -> Flow {
        if self.made == 0 && self.st == St::Head {
            Flow::Reject
        } else {
            Flow::Abandon
        }
    }
}

impl Body for Gemma {
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        match self.st {
            St::Head => self.head(input, em),
            St::Key => self.key(input, em),
            St::Value => self.value(input, em),
            St::Str(delim) => self.string(input, delim, em),
            St::Nested => self.nested(input, eof, em),
            St::Bare => self.bare(input, eof, em),
            St::AfterCall => self.after_call(input),
            St::Code => self.code(input, eof, em),
        }
    }

    fn finish(&mut self, em: &mut Emitter) -> bool {
        if !em.call_open() {
            return self.st == St::AfterCall && self.made > 0;
        }
        if !em.fix_args() {
            return false;
        }
        em.end_call();
        true
    }
}

/// Finds a code block's closing ```` ``` ````, skipping Python string literals, across chunks.
#[derive(Default)]
struct CodeFence {
    quote: Option<char>,
    escape: bool,
}

impl CodeFence {
    /// Bytes of code before the fence (all of `s` if none yet, less a possible partial
    /// fence), and whether the fence was found right after them.
    fn feed(&mut self, s: &str, eof: bool) -> (usize, bool) {
        for (i, c) in s.char_indices() {
            match self.quote {
                Some(_) if self.escape => self.escape = false,
                Some(_) if c == '\\' => self.escape = true,
                Some(q) if c == q => self.quote = None,
                Some(_) => {}
                None if c == '"' || c == '\'' => self.quote = Some(c),
                None if s[i..].starts_with("```") => return (i, true),
                None if !eof && c == '`' && "```".starts_with(&s[i..]) => return (i, false),
                None => {}
            }
        }
        (s.len(), false)
    }
}

/// The calls in a code block: `name(k=v, ..)` lines (module prefixes and `print(..)`
/// dropped) or Gemma `call:name{..}` expressions. None if any part is not a call.
fn parse_code(code: &str) -> Option<Vec<(String, Value)>> {
    let mut calls = Vec::new();
    let mut rest = code.trim();
    while !rest.is_empty() {
        let printed = rest.starts_with("print(");
        if printed {
            rest = &rest["print(".len()..];
        }
        let (call, used) = match rest.strip_prefix("call:") {
            Some(after) => gemma_expr(after).map(|(c, n)| (c, n + "call:".len()))?,
            None => python_call(rest)?,
        };
        calls.push(call);
        rest = rest[used..].trim_start();
        if printed {
            rest = rest.strip_prefix(')')?.trim_start();
        }
        rest = rest.trim_start_matches([';', ',']).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

fn gemma_expr(s: &str) -> Option<((String, Value), usize)> {
    let brace = s.find('{')?;
    let name = s[..brace].trim();
    let (args, used) = lenient::parse_prefix(&s[brace..])?;
    args.is_object()
        .then(|| ((name.to_string(), args), brace + used))
}

fn python_call(s: &str) -> Option<((String, Value), usize)> {
    let open = s.find('(')?;
    let path = s[..open].trim();
    let ident = |c: char| c.is_alphanumeric() || c == '_' || c == '.';
    if path.is_empty() || !path.chars().all(ident) {
        return None;
    }
    let name = path.rsplit('.').next().unwrap_or(path).to_string();
    let mut args = serde_json::Map::new();
    let mut i = open + 1;
    loop {
        let rest = s[i..].trim_start_matches(|c: char| c.is_whitespace() || c == ',');
        i = s.len() - rest.len();
        if let Some(after) = rest.strip_prefix(')') {
            return Some(((name, Value::Object(args)), s.len() - after.len()));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim();
        if key.is_empty() || !key.chars().all(ident) {
            return None;
        }
        let (value, used) = lenient::parse_prefix(&rest[eq + 1..])?;
        args.insert(key.to_string(), value);
        i += eq + 1 + used;
    }
}
