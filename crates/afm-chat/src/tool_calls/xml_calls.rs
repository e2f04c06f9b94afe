//! Dialects whose calls are XML-like elements with one element per parameter: Qwen XML
//! (`<function=f><parameter=p>v</parameter></function>`), MiniMax M2
//! (`<invoke name="f"><parameter name="p">v</parameter></invoke>`), DeepSeek DSML (the same
//! with `｜DSML｜` tags and `string="true|false"`), and GLM 4.5+
//! (`name<arg_key>p</arg_key><arg_value>v</arg_value>`).
//!
//! Values stream into a JSON object as they arrive. A closing tag only closes when what
//! follows it is the syntax that may follow (another parameter, the call's end, the end of
//! output); otherwise it was part of the value, e.g. source code that mentions `</parameter>`.

use super::emit::{Declared, Emitter, Trim};
use super::scan::{
    partial_suffix_len, peek, peek_any, read_until, ws_len, JsonScan, Peek, ScanEnd,
};
use super::{Body, Flow};

const MAX_HEADER: usize = 256;

/// Whether a header whose terminator ends `through` bytes in fits [`MAX_HEADER`]: streaming
/// gives up with more than `MAX_HEADER` bytes and no terminator yet (at most `through - 1`),
/// so text seen whole must meet the same bound, or the outcome would depend on chunking.
fn header_fits(through: usize) -> bool {
    through.saturating_sub(1) <= MAX_HEADER
}

pub(crate) struct XmlSpec {
    pub call_open: &'static str,
    pub param_open: &'static str,
    pub param_close: &'static str,
    pub call_close: &'static str,
    /// Closers of the section around the calls.
    pub section_close: &'static [&'static str],
    pub trim: Trim,
    /// How an unmarked value is meant when the schema does not say.
    pub declared: Declared,
}

pub(crate) const QWEN: XmlSpec = XmlSpec {
    call_open: "<function=",
    param_open: "<parameter=",
    param_close: "</parameter>",
    call_close: "</function>",
    section_close: &["</tool_call>"],
    trim: Trim::Newline,
    declared: Declared::String,
};

pub(crate) const MINIMAX: XmlSpec = XmlSpec {
    call_open: "<invoke name=",
    param_open: "<parameter name=",
    param_close: "</parameter>",
    call_close: "</invoke>",
    section_close: &["</minimax:tool_call>"],
    trim: Trim::Space,
    declared: Declared::String,
};

pub(crate) const DSML: XmlSpec = XmlSpec {
    call_open: "<｜DSML｜invoke name=",
    param_open: "<｜DSML｜parameter name=",
    param_close: "</｜DSML｜parameter>",
    call_close: "</｜DSML｜invoke>",
    section_close: &["</｜DSML｜tool_calls>", "</｜DSML｜function_calls>"],
    trim: Trim::None,
    declared: Declared::String,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum XSt {
    Section,
    CallHeader,
    InCall,
    ParamHeader,
    Value,
    /// At a parameter closer (`true`) or call closer (`false`) met inside a value.
    CloseCheck(bool),
}

pub(crate) struct Xml {
    spec: &'static XmlSpec,
    st: XSt,
    made: usize,
}

impl Xml {
    /// Inside a section, before the first call.
    pub(crate) fn new(spec: &'static XmlSpec) -> Self {
        Self {
            spec,
            st: XSt::Section,
            made: 0,
        }
    }

    /// After an opener that was the call tag itself (`<function=` outside `<tool_call>`).
    pub(crate) fn in_header(spec: &'static XmlSpec) -> Self {
        Self {
            st: XSt::CallHeader,
            ..Self::new(spec)
        }
    }

    fn section(&mut self, input: &str) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        if t.is_empty() {
            return Flow::Need;
        }
        if t.starts_with(self.spec.call_open) {
            self.st = XSt::CallHeader;
            return Flow::Step(ws + self.spec.call_open.len());
        }
        match peek_any(t, self.spec.section_close) {
            Ok(i) => Flow::Done(ws + self.spec.section_close[i].len()),
            Err(true) => Flow::Need,
            Err(false) if peek(t, self.spec.call_open) == Peek::Maybe => Flow::Need,
            Err(false) if self.made == 0 => Flow::Reject,
            Err(false) => Flow::Done(0),
        }
    }

    fn header(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let Some((head, used)) = read_until(input, ">").filter(|(_, used)| header_fits(*used))
        else {
            return self.too_long(input);
        };
        let name = tag_name(head);
        if name.is_empty() || name.contains('<') {
            return self.give_up();
        }
        if self.st == XSt::CallHeader {
            // A call only once its body shows up: `<function=x>` in prose is not one.
            let after = &input[used..];
            let body = &after[ws_len(after)..];
            match peek_any(body, &[self.spec.param_open, self.spec.call_close]) {
                Ok(_) => {}
                Err(true) if body.len() < MAX_HEADER => return Flow::Need,
                Err(_) => return self.give_up(),
            }
            em.start_call(&name);
            self.st = XSt::InCall;
        } else {
            let declared = match () {
                _ if head.contains("string=\"false\"") => Declared::Json,
                _ if head.contains("string=\"true\"") => Declared::String,
                _ => self.spec.declared,
            };
            em.param_begin(&name, declared, self.spec.trim);
            self.st = XSt::Value;
        }
        Flow::Step(used)
    }

    fn in_call(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let s = self.spec;
        let ws = ws_len(input);
        let t = &input[ws..];
        if t.is_empty() {
            return Flow::Need;
        }
        if t.starts_with(s.param_open) {
            self.st = XSt::ParamHeader;
            return Flow::Step(ws + s.param_open.len());
        }
        if t.starts_with(s.call_close) {
            return self.end_call(ws + s.call_close.len(), em);
        }
        match peek_any(t, s.section_close) {
            // The call's own closer is missing; the section's closes it.
            Ok(_) => return self.end_call(ws, em),
            Err(true) => return Flow::Need,
            Err(false) => {}
        }
        if [s.param_open, s.call_close]
            .iter()
            .any(|m| peek(t, m) == Peek::Maybe)
        {
            return Flow::Need;
        }
        // Stray text between parameters: skip it.
        let first = t.chars().next().map_or(1, char::len_utf8);
        let skip = t[first..].find('<').map_or(t.len(), |at| at + first);
        Flow::Step(ws + skip)
    }

    fn value(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let s = self.spec;
        let hit = [(s.param_close, true), (s.call_close, false)]
            .into_iter()
            .filter_map(|(m, p)| input.find(m).map(|at| (at, p)))
            .min_by_key(|(at, _)| *at);
        let safe = match hit {
            Some((at, param)) => {
                self.st = XSt::CloseCheck(param);
                at
            }
            None => input.len() - partial_suffix_len(input, &[s.param_close, s.call_close]),
        };
        em.param_text(&input[..safe]);
        match (safe, hit) {
            (0, None) => Flow::Need,
            _ => Flow::Step(safe),
        }
    }

    fn close_check(&mut self, input: &str, param: bool, eof: bool, em: &mut Emitter) -> Flow {
        let s = self.spec;
        let closer = if param { s.param_close } else { s.call_close };
        let after = &input[closer.len()..];
        let rest = &after[ws_len(after)..];
        let mut follow = match param {
            true => vec![s.param_open, s.call_close],
            false => vec![s.call_open],
        };
        follow.extend_from_slice(s.section_close);
        let real = match peek_any(rest, &follow) {
            Ok(_) => true,
            _ if rest.is_empty() || eof => eof,
            Err(true) => return Flow::Need,
            Err(false) => false,
        };
        if rest.is_empty() && !eof {
            return Flow::Need;
        }
        if !real {
            em.param_text(closer);
            self.st = XSt::Value;
            return Flow::Step(closer.len());
        }
        if param {
            em.param_end();
            self.st = XSt::InCall;
            return Flow::Step(closer.len());
        }
        self.end_call(closer.len(), em)
    }

    fn end_call(&mut self, used: usize, em: &mut Emitter) -> Flow {
        em.end_call();
        self.made += 1;
        self.st = XSt::Section;
        Flow::Step(used)
    }

    fn too_long(&self, input: &str) -> Flow {
        if input.len() > MAX_HEADER {
            self.give_up()
        } else {
            Flow::Need
        }
    }

    fn give_up(&self) -> Flow {
        if self.made == 0 && self.st == XSt::CallHeader {
            Flow::Reject
        } else {
            Flow::Abandon
        }
    }
}

impl Body for Xml {
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        match self.st {
            XSt::Section => self.section(input),
            XSt::CallHeader | XSt::ParamHeader => self.header(input, em),
            XSt::InCall => self.in_call(input, em),
            XSt::Value => self.value(input, em),
            XSt::CloseCheck(param) => self.close_check(input, param, eof, em),
        }
    }

    fn finish(&mut self, em: &mut Emitter) -> bool {
        if !em.call_open() {
            return self.st == XSt::Section && self.made > 0;
        }
        if !em.fix_args() {
            return false;
        }
        em.debug(|| "salvaged a call cut off by the end of output".to_string());
        em.end_call();
        true
    }
}

/// The name in a tag header: `get_weather`, `"get_weather"`, `"loc" string="true"`.
fn tag_name(head: &str) -> String {
    let h = head.trim();
    if let Some(q) = h.chars().next().filter(|c| matches!(c, '"' | '\'')) {
        let body = &h[1..];
        return body[..body.find(q).unwrap_or(body.len())].to_string();
    }
    h[..h.find(char::is_whitespace).unwrap_or(h.len())].to_string()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GSt {
    Name,
    Args,
    Key,
    ValueOpen,
    Value,
    CloseCheck,
    Json(bool),
}

const ARG_KEY: &str = "<arg_key>";
const ARG_KEY_END: &str = "</arg_key>";
const ARG_VALUE: &str = "<arg_value>";
const ARG_VALUE_END: &str = "</arg_value>";
const GLM_END: &str = "</tool_call>";

/// GLM 4.5–4.7: after `<tool_call>`, the name, then `<arg_key>`/`<arg_value>` pairs (GLM 4.5
/// puts them on lines, 4.7 does not), or a JSON object (older GLM-4).
pub(crate) struct Glm {
    st: GSt,
    key: String,
    scan: JsonScan,
}

impl Glm {
    pub(crate) fn new() -> Self {
        Self {
            st: GSt::Name,
            key: String::new(),
            scan: JsonScan::default(),
        }
    }

    fn name(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let t = input.trim_start();
        let ws = input.len() - t.len();
        let hit = ["\n", ARG_KEY, GLM_END, "{"]
            .iter()
            .filter_map(|m| t.find(m).map(|at| (at, m.len())))
            .min()
            .filter(|(at, len)| header_fits(at + len));
        let Some((at, _)) = hit else {
            return if t.len() > MAX_HEADER {
                Flow::Reject
            } else {
                Flow::Need
            };
        };
        let name = t[..at].trim();
        if name.is_empty() || name.contains('<') {
            return Flow::Reject;
        }
        em.start_call(name);
        self.st = GSt::Args;
        Flow::Step(ws + at)
    }

    fn args(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        match t.chars().next() {
            None => return Flow::Need,
            Some('{') => {
                self.st = GSt::Json(false);
                return Flow::Step(ws);
            }
            _ => {}
        }
        match peek_any(t, &[ARG_KEY, GLM_END]) {
            Ok(0) => {
                self.st = GSt::Key;
                Flow::Step(ws + ARG_KEY.len())
            }
            Ok(_) => {
                em.end_call();
                Flow::Done(ws + GLM_END.len())
            }
            Err(true) => Flow::Need,
            Err(false) => Flow::Step(ws + t.chars().next().map_or(0, char::len_utf8)),
        }
    }

    fn value(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let hit = [ARG_VALUE_END, GLM_END]
            .iter()
            .filter_map(|m| input.find(m))
            .min();
        let safe = match hit {
            Some(at) => {
                self.st = GSt::CloseCheck;
                at
            }
            None => input.len() - partial_suffix_len(input, &[ARG_VALUE_END, GLM_END]),
        };
        em.param_text(&input[..safe]);
        match (safe, hit) {
            (0, None) => Flow::Need,
            _ => Flow::Step(safe),
        }
    }

    fn close_check(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        if input.starts_with(GLM_END) {
            em.end_call();
            return Flow::Done(GLM_END.len());
        }
        let after = &input[ARG_VALUE_END.len()..];
        let rest = &after[ws_len(after)..];
        match peek_any(rest, &[ARG_KEY, GLM_END]) {
            Ok(_) => {}
            _ if eof => {}
            Err(true) => return Flow::Need,
            Err(false) => {
                em.param_text(ARG_VALUE_END);
                self.st = GSt::Value;
                return Flow::Step(ARG_VALUE_END.len());
            }
        }
        em.param_end();
        self.st = GSt::Args;
        Flow::Step(ARG_VALUE_END.len())
    }

    fn json(&mut self, input: &str, done: bool, eof: bool, em: &mut Emitter) -> Flow {
        if done {
            let ws = ws_len(input);
            let used = if input[ws..].starts_with(GLM_END) {
                ws + GLM_END.len()
            } else {
                0
            };
            return match peek(&input[ws..], GLM_END) {
                Peek::Maybe if !eof => Flow::Need,
                _ => Flow::Done(used),
            };
        }
        let (n, end) = self.scan.feed(input, &[GLM_END], eof);
        em.json_args(&input[..n]);
        match end {
            ScanEnd::Done => {
                em.end_call();
                self.st = GSt::Json(true);
                Flow::Step(n)
            }
            ScanEnd::More if n == 0 => Flow::Need,
            ScanEnd::More => Flow::Step(n),
            ScanEnd::Stopped if em.fix_args() => {
                em.end_call();
                self.st = GSt::Json(true);
                Flow::Step(n)
            }
            ScanEnd::Stopped => Flow::Abandon,
        }
    }
}

impl Body for Glm {
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        match self.st {
            GSt::Name => self.name(input, em),
            GSt::Args => self.args(input, em),
            GSt::Key => match read_until(input, ARG_KEY_END) {
                Some((key, used)) if header_fits(used) => {
                    self.key = key.trim().to_string();
                    self.st = GSt::ValueOpen;
                    Flow::Step(used)
                }
                _ if input.len() > MAX_HEADER => Flow::Abandon,
                _ => Flow::Need,
            },
            GSt::ValueOpen => {
                let ws = ws_len(input);
                let used = match peek(&input[ws..], ARG_VALUE) {
                    Peek::Yes => ws + ARG_VALUE.len(),
                    Peek::Maybe => return Flow::Need,
                    Peek::No => ws,
                };
                em.param_begin(&self.key, Declared::Auto, Trim::None);
                self.st = GSt::Value;
                Flow::Step(used)
            }
            GSt::Value => self.value(input, em),
            GSt::CloseCheck => self.close_check(input, eof, em),
            GSt::Json(done) => self.json(input, done, eof, em),
        }
    }

    fn finish(&mut self, em: &mut Emitter) -> bool {
        if !em.call_open() {
            return matches!(self.st, GSt::Json(true));
        }
        if !em.fix_args() {
            return false;
        }
        em.end_call();
        true
    }
}
