//! Dialects whose calls are JSON objects: Hermes (`<tool_call>{..}</tool_call>`), Llama 3
//! (`{"name":..,"parameters":..}` with `;` between calls) and Mistral (`[TOOL_CALLS][{..}]`,
//! `[TOOL_CALLS]name[ARGS]{..}`). The call object is read key by key so the name goes out as
//! soon as it is known and the arguments stream raw; the `<tool_call>` block also accepts a
//! Qwen XML body (`afm_adaptive_xml` semantics).

use super::emit::Emitter;
use super::scan::{
    partial_suffix_len, peek, peek_any, read_until, ws_len, JsonScan, Peek, ScanEnd,
};
use super::xml_calls::{Xml, QWEN};
use super::{Body, Flow};

/// Longest name or key read before deciding the text is not a call.
const MAX_HEADER: usize = 256;

/// Whether a header whose terminator ends `through` bytes in fits [`MAX_HEADER`]. Streaming
/// gives up once more than `MAX_HEADER` bytes wait without a complete terminator (at most
/// `through - 1` of them); a header seen whole must meet the same bound, or the outcome would
/// depend on how the output was chunked.
fn header_fits(through: usize) -> bool {
    through.saturating_sub(1) <= MAX_HEADER
}

/// How a run of JSON call objects is laid out.
pub(crate) struct ListCfg {
    /// A leading `[` may open an array of calls.
    pub array: bool,
    /// Characters skipped between calls.
    pub separators: &'static str,
    /// Markers that end the run (and cut off arguments that reach them).
    pub closers: &'static [&'static str],
    /// Reject an object whose first keys are not call keys (Llama's bare `{`).
    pub strict_keys: bool,
}

pub(crate) const HERMES_LIST: ListCfg = ListCfg {
    array: true,
    separators: ",",
    closers: &["</tool_call>"],
    strict_keys: false,
};

/// A Markdown ```json fence holding a call, as small Qwen 2.5 Coder models write instead of
/// `<tool_call>`: strict keys, so a fence holding ordinary JSON stays text.
pub(crate) const HERMES_FENCE_LIST: ListCfg = ListCfg {
    array: true,
    separators: ",",
    closers: &["```"],
    strict_keys: true,
};

pub(crate) const LLAMA_LIST: ListCfg = ListCfg {
    array: true,
    separators: ";,",
    closers: &["<|eom_id|>", "<|eot_id|>"],
    strict_keys: true,
};

const MISTRAL_LIST: ListCfg = ListCfg {
    array: true,
    separators: ",",
    closers: &["[TOOL_CALLS]"],
    strict_keys: false,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Name,
    /// `"function": {..}` wrapping the real call object (OpenAI style).
    Function,
    Args,
    Other,
}

fn slot(key: &str) -> Slot {
    match key {
        "name" | "tool_name" => Slot::Name,
        "function" => Slot::Function,
        "arguments" | "parameters" | "args" => Slot::Args,
        _ => Slot::Other,
    }
}

enum St {
    Between,
    Key,
    Colon(Slot),
    Value(Slot),
    Args(JsonScan),
    ArgsString(JsonScan, String),
    Skip(JsonScan),
    AfterValue,
}

/// The call object being read.
#[derive(Default)]
struct CallObj {
    name: Option<String>,
    started: bool,
    /// Arguments seen before the name.
    pending: String,
    nest: usize,
}

pub(crate) struct JsonCalls {
    cfg: &'static ListCfg,
    st: St,
    in_array: bool,
    made: usize,
    obj: CallObj,
}

impl JsonCalls {
    pub(crate) fn new(cfg: &'static ListCfg) -> Self {
        Self {
            cfg,
            st: St::Between,
            in_array: false,
            made: 0,
            obj: CallObj::default(),
        }
    }

    /// For an opener that already consumed the object's `{`.
    pub(crate) fn in_object(cfg: &'static ListCfg) -> Self {
        Self {
            st: St::Key,
            ..Self::new(cfg)
        }
    }

    fn between(&mut self, input: &str) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        let Some(c) = t.chars().next() else {
            return Flow::Need;
        };
        match c {
            '{' => {
                self.obj = CallObj::default();
                self.st = St::Key;
                return Flow::Step(ws + 1);
            }
            '[' if self.cfg.array && !self.in_array && self.made == 0 => {
                self.in_array = true;
                return Flow::Step(ws + 1);
            }
            ']' if self.in_array => {
                self.in_array = false;
                return Flow::Step(ws + 1);
            }
            c if self.cfg.separators.contains(c) => return Flow::Step(ws + 1),
            _ => {}
        }
        match peek_any(t, self.cfg.closers) {
            Ok(i) => Flow::Done(ws + self.cfg.closers[i].len()),
            Err(true) => Flow::Need,
            Err(false) if self.made == 0 => Flow::Reject,
            Err(false) => Flow::Done(0),
        }
    }

    fn key(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        let Some(c) = t.chars().next() else {
            return Flow::Need;
        };
        match c {
            '}' => return self.close_object(ws + 1, em),
            ',' => return Flow::Step(ws + 1),
            _ => {}
        }
        if peek_any(t, self.cfg.closers).is_ok() {
            return self.cut_off(ws, em);
        }
        let early = !self.obj.started && self.obj.name.is_none();
        if self.cfg.strict_keys && early && self.made == 0 && c != '"' {
            return Flow::Reject;
        }
        let (key, used) = match c {
            '"' | '\'' => match quoted(t) {
                Some(k) if header_fits(k.1) => k,
                _ => return self.need_header(t),
            },
            _ => match read_until(t, ":") {
                Some((k, _)) if header_fits(k.len() + 1) => (k.trim().to_string(), k.len()),
                _ => return self.need_header(t),
            },
        };
        let slot = slot(&key);
        let call_key = slot != Slot::Other || matches!(key.as_str(), "type" | "id");
        if self.cfg.strict_keys && early && !call_key && self.made == 0 {
            return Flow::Reject;
        }
        self.st = St::Colon(slot);
        Flow::Step(ws + used)
    }

    fn value(&mut self, input: &str, slot: Slot, em: &mut Emitter) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        let Some(c) = t.chars().next() else {
            return Flow::Need;
        };
        let quote = matches!(c, '"' | '\'');
        match slot {
            Slot::Name | Slot::Function if quote => {
                let Some((name, used)) = quoted(t).filter(|(_, used)| header_fits(*used)) else {
                    return self.need_header(t);
                };
                self.obj.name = Some(name);
                self.start(em);
                self.st = St::AfterValue;
                return Flow::Step(ws + used);
            }
            Slot::Function if c == '{' => {
                self.obj.nest += 1;
                self.st = St::Key;
                return Flow::Step(ws + 1);
            }
            Slot::Args if quote => self.st = St::ArgsString(JsonScan::default(), String::new()),
            Slot::Args => self.st = St::Args(JsonScan::default()),
            _ => self.st = St::Skip(JsonScan::default()),
        }
        Flow::Step(ws)
    }

    fn after_value(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let ws = ws_len(input);
        match input[ws..].chars().next() {
            None => Flow::Need,
            Some(',') => {
                self.st = St::Key;
                Flow::Step(ws + 1)
            }
            Some('}') => self.close_object(ws + 1, em),
            // A missing comma between members.
            Some('"' | '\'') => {
                self.st = St::Key;
                Flow::Step(ws)
            }
            // Missing closing brace: with the call's parts all read, close it anyway.
            Some(_) if em.call_open() => {
                self.obj.nest = 0;
                self.close_object(0, em)
            }
            Some(_) => self.cut_off(ws, em),
        }
    }

    fn start(&mut self, em: &mut Emitter) {
        if self.obj.started {
            return;
        }
        let Some(name) = &self.obj.name else {
            return;
        };
        em.start_call(name);
        self.obj.started = true;
        let pending = std::mem::take(&mut self.obj.pending);
        if !pending.is_empty() {
            em.json_args(&pending);
        }
    }

    fn args(&mut self, text: &str, em: &mut Emitter) {
        match self.obj.started {
            true => em.json_args(text),
            false => self.obj.pending.push_str(text),
        }
    }

    /// `}` at the object's top level ends the call.
    fn close_object(&mut self, used: usize, em: &mut Emitter) -> Flow {
        if self.obj.nest > 0 {
            self.obj.nest -= 1;
            self.st = St::AfterValue;
            return Flow::Step(used);
        }
        self.st = St::Between;
        if self.obj.name.is_none() {
            // An object without a name is not a call.
            return if self.made == 0 {
                Flow::Reject
            } else {
                Flow::Step(used)
            };
        }
        self.start(em);
        em.end_call();
        self.made += 1;
        Flow::Step(used)
    }

    /// A closer appeared inside the object: salvage under fix_args, else give up the call.
    fn cut_off(&mut self, used: usize, em: &mut Emitter) -> Flow {
        if self.obj.started && em.fix_args() {
            em.end_call();
            self.st = St::Between;
            self.made += 1;
            return Flow::Step(used);
        }
        match self.made {
            0 if !self.obj.started => Flow::Reject,
            _ => Flow::Abandon,
        }
    }

    fn need_header(&self, t: &str) -> Flow {
        if t.len() <= MAX_HEADER {
            Flow::Need
        } else if self.made == 0 && !self.obj.started {
            Flow::Reject
        } else {
            Flow::Abandon
        }
    }

    fn scan(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        let closers = self.cfg.closers;
        let (used, end, text) = match &mut self.st {
            St::Args(s) => {
                let (n, end) = s.feed(input, closers, eof);
                (n, end, Some(input[..n].to_string()))
            }
            St::ArgsString(s, buf) => {
                let (n, end) = s.feed(input, closers, eof);
                buf.push_str(&input[..n]);
                let decoded = (end == ScanEnd::Done)
                    .then(|| super::lenient::parse(buf))
                    .flatten();
                (
                    n,
                    end,
                    decoded.map(|v| v.as_str().unwrap_or_default().to_string()),
                )
            }
            St::Skip(s) => {
                let (n, end) = s.feed(input, closers, eof);
                (n, end, None)
            }
            _ => return Flow::Need,
        };
        if let Some(text) = text {
            self.args(&text, em);
        }
        match end {
            ScanEnd::Done => {
                self.st = St::AfterValue;
                Flow::Step(used)
            }
            ScanEnd::More if used == 0 => Flow::Need,
            ScanEnd::More => Flow::Step(used),
            ScanEnd::Stopped => self.cut_off(used, em),
        }
    }
}

impl Body for JsonCalls {
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        match self.st {
            St::Between => self.between(input),
            St::Key => self.key(input, em),
            St::Colon(slot) => {
                let ws = ws_len(input);
                match input[ws..].chars().next() {
                    None => Flow::Need,
                    Some(':') => {
                        self.st = St::Value(slot);
                        Flow::Step(ws + 1)
                    }
                    Some(_) => {
                        self.st = St::Value(slot);
                        Flow::Step(ws)
                    }
                }
            }
            St::Value(slot) => self.value(input, slot, em),
            St::AfterValue => self.after_value(input, em),
            St::Args(_) | St::ArgsString(..) | St::Skip(_) => self.scan(input, eof, em),
        }
    }

    fn finish(&mut self, em: &mut Emitter) -> bool {
        if em.call_open() {
            if !em.fix_args() {
                return false;
            }
            em.end_call();
            self.made += 1;
            return true;
        }
        matches!(self.st, St::Between) && self.made > 0
    }
}

/// A quoted string at the start of `t` (either quote kind, escapes honoured): its decoded
/// text and byte length, or None if its closing quote has not arrived.
fn quoted(t: &str) -> Option<(String, usize)> {
    let q = t.chars().next()?;
    let mut escape = false;
    for (i, c) in t.char_indices().skip(1) {
        if escape {
            escape = false;
        } else if c == '\\' {
            escape = true;
        } else if c == q {
            let text = super::lenient::parse(&t[..=i])?;
            return Some((text.as_str()?.to_string(), i + 1));
        }
    }
    None
}

/// `<tool_call>` for Hermes and Qwen XML: a JSON call object (or array), or an XML function.
pub(crate) struct Block {
    inner: Option<Box<dyn Body>>,
}

impl Block {
    pub(crate) fn new() -> Self {
        Self { inner: None }
    }
}

impl Body for Block {
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        if let Some(inner) = self.inner.as_mut() {
            return inner.step(input, eof, em);
        }
        let t = &input[ws_len(input)..];
        match t.chars().next() {
            None => return Flow::Need,
            Some('{' | '[') => self.inner = Some(Box::new(JsonCalls::new(&HERMES_LIST))),
            Some(_) => match peek(t, QWEN.call_open) {
                Peek::Yes => self.inner = Some(Box::new(Xml::new(&QWEN))),
                Peek::Maybe => return Flow::Need,
                Peek::No => return Flow::Reject,
            },
        }
        Flow::Step(0)
    }

    fn finish(&mut self, em: &mut Emitter) -> bool {
        self.inner.as_mut().is_some_and(|b| b.finish(em))
    }
}

enum MSt {
    Start,
    Name,
    CallId,
    Args(Option<JsonScan>),
    Json(JsonCalls),
}

/// Mistral: `[TOOL_CALLS]` then a JSON array/object of calls, or `name[ARGS]{..}` (v11+
/// tokenizers; `[CALL_ID]id` may sit between). Each `[TOOL_CALLS]` opens a new body, and in
/// `name[ARGS]{..}` form cuts the arguments short wherever it appears (a control token).
pub(crate) struct Mistral {
    st: MSt,
}

impl Mistral {
    pub(crate) fn new() -> Self {
        Self { st: MSt::Start }
    }

    fn name(&mut self, t: &str, em: &mut Emitter) -> Flow {
        // A second `[TOOL_CALLS]` before the name ends: no call here (the marker opens one).
        let ends = ["[ARGS]", "[CALL_ID]", "{", MISTRAL_LIST.closers[0]];
        let hit = ends
            .iter()
            .filter_map(|e| t.find(e).map(|at| (at, *e)))
            .min_by_key(|(at, _)| *at);
        let Some((at, end)) = hit.filter(|(at, end)| header_fits(at + end.len())) else {
            return if t.len() > MAX_HEADER {
                Flow::Reject
            } else {
                Flow::Need
            };
        };
        let name = t[..at].trim();
        if name.is_empty() || name.contains(char::is_whitespace) || end == ends[3] {
            return Flow::Reject;
        }
        em.start_call(name);
        self.st = match end {
            "[CALL_ID]" => MSt::CallId,
            _ => MSt::Args(None),
        };
        Flow::Step(if end == "{" { at } else { at + end.len() })
    }

    fn args(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        let MSt::Args(scan) = &mut self.st else {
            return Flow::Need;
        };
        let Some(s) = scan.as_mut() else {
            let ws = ws_len(input);
            if ws == input.len() {
                return Flow::Need;
            }
            *scan = Some(JsonScan::default());
            return Flow::Step(ws);
        };
        // `[TOOL_CALLS]` ends the arguments even inside a string: it is also the opener, so
        // what streams before an abandoned call can then hold no opener, and giving it out as
        // text equals rescanning it, however the output was chunked.
        let marker = MISTRAL_LIST.closers[0];
        let (shown, cut) = match input.find(marker) {
            Some(at) => (&input[..at], true),
            None if eof => (input, false),
            None => (
                &input[..input.len() - partial_suffix_len(input, &[marker])],
                false,
            ),
        };
        let (n, end) = match s.feed(shown, MISTRAL_LIST.closers, eof && !cut) {
            (n, ScanEnd::More) if cut && n == shown.len() => (n, ScanEnd::Stopped),
            fed => fed,
        };
        em.json_args(&input[..n]);
        match end {
            ScanEnd::Done => {
                em.end_call();
                Flow::Done(n)
            }
            ScanEnd::More if n == 0 => Flow::Need,
            ScanEnd::More => Flow::Step(n),
            ScanEnd::Stopped if em.fix_args() => {
                em.end_call();
                Flow::Done(n)
            }
            ScanEnd::Stopped => Flow::Abandon,
        }
    }
}

impl Body for Mistral {
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        match &mut self.st {
            MSt::Start => {
                let ws = ws_len(input);
                match input[ws..].chars().next() {
                    None => Flow::Need,
                    Some('[' | '{') => {
                        self.st = MSt::Json(JsonCalls::new(&MISTRAL_LIST));
                        Flow::Step(ws)
                    }
                    Some(_) => {
                        self.st = MSt::Name;
                        Flow::Step(ws)
                    }
                }
            }
            MSt::Name => self.name(input, em),
            MSt::CallId => match read_until(input, "[ARGS]") {
                Some((_, used)) if header_fits(used) => {
                    self.st = MSt::Args(None);
                    Flow::Step(used)
                }
                _ if input.len() > MAX_HEADER => Flow::Abandon,
                _ => Flow::Need,
            },
            MSt::Args(_) => self.args(input, eof, em),
            MSt::Json(inner) => inner.step(input, eof, em),
        }
    }

    fn finish(&mut self, em: &mut Emitter) -> bool {
        if let MSt::Json(inner) = &mut self.st {
            return inner.finish(em);
        }
        if em.call_open() && em.fix_args() {
            em.end_call();
            return true;
        }
        false
    }
}
