//! Dialects framed by special tokens with JSON arguments: Kimi K2
//! (`<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{..}<|tool_call_end|>`
//! inside `<|tool_calls_section_begin|>`…`<|tool_calls_section_end|>`) and DeepSeek V3/R1
//! (`<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{..}\n```<｜tool▁call▁end｜>`), whose
//! V3.1 form puts the name before the separator (`name<｜tool▁sep｜>{..}`).

use super::emit::Emitter;
use super::scan::{peek, peek_any, read_until, ws_len, JsonScan, Peek, ScanEnd};
use super::{Body, Flow};

const MAX_HEADER: usize = 256;

/// Whether a header whose terminator ends `through` bytes in fits [`MAX_HEADER`]: streaming
/// gives up with more than `MAX_HEADER` bytes and no terminator yet (at most `through - 1`),
/// so text seen whole must meet the same bound, or the outcome would depend on chunking.
fn header_fits(through: usize) -> bool {
    through.saturating_sub(1) <= MAX_HEADER
}

pub(crate) struct TokSpec {
    pub call_begin: &'static str,
    /// Between the call's header and its arguments.
    pub sep: &'static str,
    pub call_end: &'static str,
    pub section_end: &'static str,
    /// DeepSeek: a header of `function` means the name follows the separator.
    pub deepseek: bool,
}

pub(crate) const KIMI: TokSpec = TokSpec {
    call_begin: "<|tool_call_begin|>",
    sep: "<|tool_call_argument_begin|>",
    call_end: "<|tool_call_end|>",
    section_end: "<|tool_calls_section_end|>",
    deepseek: false,
};

pub(crate) const DEEPSEEK: TokSpec = TokSpec {
    call_begin: "<｜tool▁call▁begin｜>",
    sep: "<｜tool▁sep｜>",
    call_end: "<｜tool▁call▁end｜>",
    section_end: "<｜tool▁calls▁end｜>",
    deepseek: true,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TSt {
    Section,
    Header,
    /// DeepSeek V3: the name line after `function<｜tool▁sep｜>`.
    NameLine,
    /// Optional ```` ```json ```` fence and whitespace before the arguments.
    Fence,
    Args,
    AfterArgs,
}

pub(crate) struct TokenCalls {
    spec: &'static TokSpec,
    st: TSt,
    scan: JsonScan,
    made: usize,
}

impl TokenCalls {
    /// After a section opener.
    pub(crate) fn new(spec: &'static TokSpec) -> Self {
        Self {
            spec,
            st: TSt::Section,
            scan: JsonScan::default(),
            made: 0,
        }
    }

    /// After a call opener (no section token).
    pub(crate) fn in_call(spec: &'static TokSpec) -> Self {
        Self {
            st: TSt::Header,
            ..Self::new(spec)
        }
    }

    fn section(&mut self, input: &str) -> Flow {
        let s = self.spec;
        let ws = ws_len(input);
        match peek_any(&input[ws..], &[s.call_begin, s.section_end]) {
            Ok(0) => {
                self.st = TSt::Header;
                Flow::Step(ws + s.call_begin.len())
            }
            Ok(_) => Flow::Done(ws + s.section_end.len()),
            Err(true) => Flow::Need,
            Err(false) if self.made == 0 => Flow::Reject,
            Err(false) => Flow::Done(0),
        }
    }

    fn header(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let Some((head, used)) =
            read_until(input, self.spec.sep).filter(|(_, used)| header_fits(*used))
        else {
            return self.too_long(input);
        };
        let head = head.trim();
        if self.spec.deepseek && head == "function" {
            self.st = TSt::NameLine;
            return Flow::Step(used);
        }
        let name = match self.spec.deepseek {
            true => head,
            // `functions.get_weather:0` → `get_weather`
            false => {
                let base = head.rsplit_once(':').map_or(head, |(b, _)| b);
                base.strip_prefix("functions.").unwrap_or(base)
            }
        };
        if name.is_empty() || name.contains('<') {
            return self.give_up();
        }
        em.start_call(name);
        self.st = TSt::Fence;
        Flow::Step(used)
    }

    fn name_line(&mut self, input: &str, em: &mut Emitter) -> Flow {
        let hit = ["\n", "```", "{"]
            .iter()
            .filter_map(|m| input.find(m).map(|at| (at, m.len())))
            .min()
            .filter(|(at, len)| header_fits(at + len));
        let Some((at, _)) = hit else {
            return self.too_long(input);
        };
        let name = input[..at].trim();
        if name.is_empty() {
            return self.give_up();
        }
        em.start_call(name);
        self.st = TSt::Fence;
        Flow::Step(at)
    }

    fn fence(&mut self, input: &str) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        if t.is_empty() {
            return Flow::Need;
        }
        // "```json" before "```": the shorter must not win while the longer may still come.
        for fence in ["```json", "```"] {
            match peek(t, fence) {
                Peek::Yes => return Flow::Step(ws + fence.len()),
                Peek::Maybe => return Flow::Need,
                Peek::No => {}
            }
        }
        self.scan = JsonScan::default();
        self.st = TSt::Args;
        Flow::Step(ws)
    }

    fn args(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        let s = self.spec;
        let (n, end) = self.scan.feed(input, &[s.call_end, s.section_end], eof);
        em.json_args(&input[..n]);
        match end {
            ScanEnd::Done => self.end_call(n, em),
            ScanEnd::More if n == 0 => Flow::Need,
            ScanEnd::More => Flow::Step(n),
            ScanEnd::Stopped if em.fix_args() => self.end_call(n, em),
            ScanEnd::Stopped => Flow::Abandon,
        }
    }

    fn end_call(&mut self, used: usize, em: &mut Emitter) -> Flow {
        em.end_call();
        self.made += 1;
        self.st = TSt::AfterArgs;
        Flow::Step(used)
    }

    /// Closing fence and `call_end` after the arguments; lenient if they are missing.
    fn after_args(&mut self, input: &str) -> Flow {
        let ws = ws_len(input);
        let t = &input[ws..];
        match peek_any(t, &["```", self.spec.call_end]) {
            Ok(0) => Flow::Step(ws + 3),
            Ok(_) => {
                self.st = TSt::Section;
                Flow::Step(ws + self.spec.call_end.len())
            }
            Err(true) => Flow::Need,
            Err(false) => {
                self.st = TSt::Section;
                Flow::Step(0)
            }
        }
    }

    fn too_long(&self, input: &str) -> Flow {
        if input.len() > MAX_HEADER {
            self.give_up()
        } else {
            Flow::Need
        }
    }

    fn give_up(&self) -> Flow {
        if self.made == 0 {
            Flow::Reject
        } else {
            Flow::Abandon
        }
    }
}

impl Body for TokenCalls {
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow {
        match self.st {
            TSt::Section => self.section(input),
            TSt::Header => self.header(input, em),
            TSt::NameLine => self.name_line(input, em),
            TSt::Fence => self.fence(input),
            TSt::Args => self.args(input, eof, em),
            TSt::AfterArgs => self.after_args(input),
        }
    }

    fn finish(&mut self, em: &mut Emitter) -> bool {
        if !em.call_open() {
            return matches!(self.st, TSt::Section | TSt::AfterArgs) && self.made > 0;
        }
        if !em.fix_args() {
            return false;
        }
        em.end_call();
        true
    }
}
