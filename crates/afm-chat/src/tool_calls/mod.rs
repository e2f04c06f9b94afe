//! Streaming tool-call parsing: turns a model's generated text into plain text plus OpenAI-style
//! tool calls while it streams, for every tool-call dialect afm serves (Hermes JSON, Llama 3
//! JSON, Mistral, Qwen XML, Gemma, GLM, Kimi K2, MiniMax M2, DeepSeek V3 and DSML).
//!
//! It owns the text/call boundary, per-call indices and ids, argument streaming and repair
//! (`--fix-tool-args`). It knows nothing of HTTP or the engine: the server feeds it detokenized
//! text (special tokens included) and maps [`ToolEvent`]s to `delta.tool_calls`.
//!
//! ```text
//!  push(text) ─► Text mode ──opener──► dialect body ──call done──► Text mode ...
//!                 │ emits Text as soon        │ CallStart / CallArgs / CallEnd
//!                 │ as no marker can start    │ (a tag inside a JSON string never closes)
//! ```
//!
//! Invariant the tests hold: for call `i`, the `CallArgs` fragments concatenate to
//! `calls()[i].arguments`, however the input was chunked.

mod dialects;
mod emit;
mod gemma;
mod json_calls;
mod lenient;
mod scan;
mod schema;
mod token_calls;
mod xml_calls;

#[cfg(test)]
mod tests;

use emit::Emitter;
pub use schema::{json_type, types_of};

/// The tool-call dialects afm can parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (Qwen 2.5/3, Hermes, SmolLM3).
    Hermes,
    /// `{"name": .., "parameters": {..}}`, optionally after `<|python_tag|>`, `;`-separated.
    Llama3Json,
    /// `[TOOL_CALLS][{..}]` (v3 tokenizers) and `[TOOL_CALLS]name[ARGS]{..}` (v11+).
    Mistral,
    /// `<tool_call><function=name><parameter=p>value</parameter></function></tool_call>`.
    QwenXml,
    /// `<|tool_call>call:name{k:<|"|>v<|"|>}<tool_call|>` (Gemma 4), FunctionGemma's
    /// `<start_function_call>`, and Gemma 3's ```` ```tool_code ```` blocks.
    Gemma,
    /// `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>` (GLM 4.5–4.7).
    Glm4,
    /// `<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{..}..`
    KimiK2,
    /// `<minimax:tool_call><invoke name="f"><parameter name="p">v</parameter></invoke>..`
    MinimaxM2,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name ```json..` (and V3.1's
    /// `name<｜tool▁sep｜>{..}`).
    DeepSeekV3,
    /// DSML: `<｜DSML｜tool_calls>` (V4) or `<｜DSML｜function_calls>` (V3.2) around
    /// `<｜DSML｜invoke name=..><｜DSML｜parameter name=.. string="true|false">..`.
    DeepSeekV4Dsml,
    /// Tool extraction off: everything is text.
    None,
}

impl ToolCallFormat {
    /// Every dialect that extracts calls (all but `None`), for tests and fuzzing that cover
    /// each one.
    pub const DIALECTS: [ToolCallFormat; 10] = [
        ToolCallFormat::Hermes,
        ToolCallFormat::Llama3Json,
        ToolCallFormat::Mistral,
        ToolCallFormat::QwenXml,
        ToolCallFormat::Gemma,
        ToolCallFormat::Glm4,
        ToolCallFormat::KimiK2,
        ToolCallFormat::MinimaxM2,
        ToolCallFormat::DeepSeekV3,
        ToolCallFormat::DeepSeekV4Dsml,
    ];

    /// The format for a `--tool-call-parser` name; `None` (the Option) for an unknown name.
    pub fn from_name(name: &str) -> Option<Self> {
        let f = match name.trim().to_ascii_lowercase().as_str() {
            "hermes" | "json" | "qwen" | "qwen25" => Self::Hermes,
            "llama3_json" | "llama3" | "llama4_json" => Self::Llama3Json,
            "mistral" => Self::Mistral,
            "qwen3_xml" | "xml_function" | "afm_adaptive_xml" | "qwen3_coder" => Self::QwenXml,
            "gemma" | "gemma3" | "gemma4" | "functiongemma" => Self::Gemma,
            "glm4" | "glm45" | "glm47" | "glm4_moe" => Self::Glm4,
            "kimi_k2" => Self::KimiK2,
            "minimax_m2" | "minimax" => Self::MinimaxM2,
            "deepseek_v3" | "deepseek_v31" | "deepseek" => Self::DeepSeekV3,
            "deepseek_v4" | "deepseek_v32" | "dsml" => Self::DeepSeekV4Dsml,
            "none" => Self::None,
            _ => return None,
        };
        Some(f)
    }

    /// The canonical `--tool-call-parser` name of this format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
            Self::QwenXml => "qwen3_xml",
            Self::Gemma => "gemma",
            Self::Glm4 => "glm4",
            Self::KimiK2 => "kimi_k2",
            Self::MinimaxM2 => "minimax_m2",
            Self::DeepSeekV3 => "deepseek_v3",
            Self::DeepSeekV4Dsml => "deepseek_v4",
            Self::None => "none",
        }
    }

    /// Picks the format from the chat template's concrete call examples first (they beat
    /// `model_type`: Qwen3-Coder reports `qwen3_moe` but writes XML), then from `model_type`.
    /// Unknown models get Hermes, the most common dialect.
    pub fn detect(model_type: &str, chat_template: Option<&str>) -> Self {
        if let Some(f) = chat_template.and_then(Self::from_template) {
            return f;
        }
        Self::from_model_type(model_type).unwrap_or(Self::Hermes)
    }

    fn from_template(t: &str) -> Option<Self> {
        // Order matters: more specific markers first (`<tool_call>` also wraps GLM and Qwen XML).
        let table: [(&[&str], Self); 10] = [
            (&["｜DSML｜"], Self::DeepSeekV4Dsml),
            (&["tool▁calls▁begin", "tool▁call▁begin"], Self::DeepSeekV3),
            (
                &["<|tool_calls_section_begin|>", "<|tool_call_begin|>"],
                Self::KimiK2,
            ),
            (&["<minimax:tool_call>", "<invoke name="], Self::MinimaxM2),
            (&["<arg_key>"], Self::Glm4),
            (&["<|tool_call>", "<start_function_call>"], Self::Gemma),
            (&["<function=", "<parameter="], Self::QwenXml),
            (&["[TOOL_CALLS]"], Self::Mistral),
            (&["<tool_call>"], Self::Hermes),
            (&["<|python_tag|>"], Self::Llama3Json),
        ];
        table
            .iter()
            .find(|(marks, _)| marks.iter().any(|m| t.contains(m)))
            .map(|(_, f)| *f)
    }

    fn from_model_type(model_type: &str) -> Option<Self> {
        let m = model_type.trim().to_ascii_lowercase();
        let f = match m.as_str() {
            "qwen3_coder" | "qwen3_next" | "qwen3_5" | "qwen3_5_moe" | "qwen3_6"
            | "qwen3_6_moe" | "nemotron_h" => Self::QwenXml,
            "llama" | "llama4" | "llama4_text" => Self::Llama3Json,
            "mistral" | "mistral3" | "ministral" | "ministral3" | "mixtral" => Self::Mistral,
            "kimi_k2" | "kimi_k25" => Self::KimiK2,
            "minimax_m2" | "minimax" => Self::MinimaxM2,
            "deepseek_v3" | "deepseek_v2" => Self::DeepSeekV3,
            "deepseek_v32" | "deepseek_v4" | "deepseek4" => Self::DeepSeekV4Dsml,
            _ if m.starts_with("gemma") => Self::Gemma,
            _ if m.starts_with("glm") || m == "chatglm" => Self::Glm4,
            _ if m.starts_with("qwen") || m == "smollm3" => Self::Hermes,
            _ => return None,
        };
        Some(f)
    }
}

/// One parsed tool call, as it goes into `message.tool_calls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_` + 24 random alphanumerics.
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (an object unless the model wrote something else).
    pub arguments: String,
}

/// What one chunk of model output turned into, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Plain assistant text (never part of a call's syntax).
    Text(String),
    /// A call began; `index` counts calls of this turn from 0.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s argument JSON.
    CallArgs { index: usize, fragment: String },
    /// Call `index` is complete.
    CallEnd { index: usize },
}

#[derive(Debug, Clone, Copy, Default)]
pub struct ParserOptions {
    /// `--fix-tool-args`: repair malformed JSON, coerce types to the schema, map misnamed
    /// arguments, salvage a call cut off by the end of output. JSON-format arguments are then
    /// sent in one fragment at the end of the call, since repair needs the whole object.
    pub fix_args: bool,
    /// `AFM_DEBUG`: `[ToolCallParser]` lines on stderr.
    pub debug: bool,
}

/// What a dialect body did with the input it was shown.
pub(crate) enum Flow {
    /// Consumed this many bytes (possibly 0 with a state change); call again.
    Step(usize),
    /// Cannot go on without more input (at end of input: `finish` decides).
    Need,
    /// The body is over after consuming this many bytes; back to text.
    Done(usize),
    /// Not a call after all: the opener and everything consumed are plain text.
    Reject,
    /// A call broke off mid-way (e.g. a block closer inside its arguments) and cannot be
    /// salvaged: it is dropped from `calls()` and its source is text, read again as for
    /// `Reject` (it may hold another opener).
    Abandon,
}

/// A dialect's state machine for the text after one of its openers.
pub(crate) trait Body: Send {
    /// Looks at the unconsumed input (`eof`: no more will come) and makes one step.
    fn step(&mut self, input: &str, eof: bool, em: &mut Emitter) -> Flow;
    /// End of output with the body still open: closes an open call (salvage, under
    /// `fix_args`) and returns true, or returns false to have the source emitted as text.
    fn finish(&mut self, em: &mut Emitter) -> bool;
}

enum Mode {
    Text,
    Body(Box<dyn Body>),
}

/// The streaming parser for one generated turn.
pub struct ToolCallParser {
    format: ToolCallFormat,
    em: Emitter,
    mode: Mode,
    /// Unconsumed input; `pos` is how much of it has been handled.
    buf: String,
    pos: usize,
    /// Source of the open body since its opener (or since its last completed call).
    raw: String,
    opener_len: usize,
    /// `raw` starts with the opener (no call of this body has completed yet).
    opener_in_raw: bool,
    /// Whitespace held at a boundary (start of output, after a call): dropped if a call
    /// follows, emitted if text does.
    ws_pending: String,
    at_boundary: bool,
    seen_text: bool,
}

impl ToolCallParser {
    pub fn new(format: ToolCallFormat, tools: &[serde_json::Value], opts: ParserOptions) -> Self {
        let em = Emitter::new(tools, opts);
        em.debug(|| format!("format: {}", format.name()));
        Self {
            format,
            em,
            mode: Mode::Text,
            buf: String::new(),
            pos: 0,
            raw: String::new(),
            opener_len: 0,
            opener_in_raw: false,
            ws_pending: String::new(),
            at_boundary: true,
            seen_text: false,
        }
    }

    pub fn format(&self) -> ToolCallFormat {
        self.format
    }

    /// Feeds the next piece of generated text; returns what became certain.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        self.run(false);
        self.compact();
        self.em.take_events()
    }

    /// Ends the turn: flushes held-back text and closes or gives up an open call.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        self.run(true);
        if !self.ws_pending.is_empty() && self.em.calls.is_empty() {
            let ws = std::mem::take(&mut self.ws_pending);
            self.em.text(&ws);
        }
        self.ws_pending.clear();
        self.compact();
        self.em.take_events()
    }

    /// The calls completed so far, in order.
    pub fn calls(&self) -> &[ToolCall] {
        &self.em.calls
    }

    fn compact(&mut self) {
        self.buf.drain(..self.pos);
        self.pos = 0;
    }

    fn run(&mut self, eof: bool) {
        loop {
            let progressed = match self.mode {
                Mode::Text => self.scan_text(eof),
                Mode::Body(_) => self.step_body(eof),
            };
            if !progressed {
                break;
            }
        }
    }

    /// Emits text up to the next opener (holding back a possible partial one) and enters the
    /// opener's body. Returns whether anything changed.
    fn scan_text(&mut self, eof: bool) -> bool {
        let rest = &self.buf[self.pos..];
        if rest.is_empty() {
            return false;
        }
        let at_start = !self.seen_text;
        let hit = dialects::find_opener(self.format, rest, at_start);
        let safe = match &hit {
            Some((at, _)) => *at,
            None if eof => rest.len(),
            None => rest.len() - dialects::partial_opener_len(self.format, rest, at_start),
        };
        let text = rest[..safe].to_string();
        self.pos += safe;
        self.emit_text(&text);
        let Some((_, opener)) = hit else {
            return safe > 0;
        };
        let len = opener.text.len();
        self.raw = self.buf[self.pos..self.pos + len].to_string();
        self.opener_len = len;
        self.opener_in_raw = true;
        self.pos += len;
        self.mode = Mode::Body(dialects::open_body(opener));
        true
    }

    fn emit_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let mut text = text;
        if self.at_boundary {
            let trimmed = text.trim_start();
            self.ws_pending
                .push_str(&text[..text.len() - trimmed.len()]);
            if trimmed.is_empty() {
                return;
            }
            text = trimmed;
            let ws = std::mem::take(&mut self.ws_pending);
            self.em.text(&ws);
            self.at_boundary = false;
        }
        self.seen_text = true;
        self.em.text(text);
    }

    fn step_body(&mut self, eof: bool) -> bool {
        let Mode::Body(body) = &mut self.mode else {
            return false;
        };
        let input = &self.buf[self.pos..];
        let flow = match body.step(input, eof, &mut self.em) {
            Flow::Need if !eof => return false,
            // End of output with the body open: close it, or give its source back as text.
            // What a body holds back at the end is call syntax (a partial closer): dropped.
            Flow::Need if body.finish(&mut self.em) => Flow::Done(input.len()),
            Flow::Need => Flow::Abandon,
            flow => flow,
        };
        match flow {
            Flow::Step(n) => {
                self.consume(n);
                if self.em.take_ended() {
                    // A call ended: whitespace held before it lay between calls.
                    self.raw.clear();
                    self.opener_in_raw = false;
                    self.ws_pending.clear();
                }
            }
            Flow::Done(n) => {
                self.consume(n);
                self.em.take_ended();
                self.leave_body();
            }
            Flow::Reject => self.back_to_text(),
            Flow::Abandon | Flow::Need => {
                self.em.abandon();
                self.back_to_text();
            }
        }
        true
    }

    /// Leaves a body that gave up. Only its opener is certain text; what followed may hold
    /// another opener, so it is read again. Reading it again (rather than passing on what the
    /// body had consumed as text) also keeps the outcome independent of chunking, since how
    /// much a body consumed before giving up depends on how its input arrived.
    fn back_to_text(&mut self) {
        let keep = if self.opener_in_raw {
            self.opener_len
        } else {
            0
        };
        let rest = self.raw.split_off(keep.min(self.raw.len()));
        let opener = std::mem::take(&mut self.raw);
        self.buf.replace_range(..self.pos, &rest);
        self.pos = 0;
        self.opener_in_raw = false;
        self.mode = Mode::Text;
        self.emit_text(&opener);
    }

    fn consume(&mut self, n: usize) {
        self.raw.push_str(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
    }

    fn leave_body(&mut self) {
        self.raw.clear();
        self.ws_pending.clear();
        self.mode = Mode::Text;
        self.at_boundary = true;
    }
}
