//! The output side shared by all dialects: numbering and ids of calls, the event list, the
//! arguments text of each call (streamed raw for JSON dialects, built as a JSON object
//! parameter by parameter for XML-like ones), schema coercion and repair, debug lines.
//!
//! ```text
//!  JSON dialects:  json_args("{\"city\": \"Pa") json_args("ris\"}")       -> streamed as is
//!  XML dialects:   param_begin("city") param_text("Pa") param_text("ris") param_end()
//!                  -> `{"city": "Pa`  `ris`  `"`  ...  end_call -> `}`
//! ```

use serde_json::Value;

use super::schema::{self, Schemas};
use super::{ParserOptions, ToolCall, ToolEvent};

/// How a dialect presents a parameter value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Declared {
    /// Raw text meant as a string (XML element content, a Gemma `<|"|>` string).
    String,
    /// JSON text (DSML `string="false"`).
    Json,
    /// Unmarked: JSON/Python literal if it parses, else a string (GLM, Gemma bare values).
    Auto,
}

/// Whitespace a dialect's value syntax adds around a string value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trim {
    None,
    /// One leading and one trailing newline (Qwen XML puts values on their own lines).
    Newline,
    /// All leading and trailing whitespace.
    Space,
}

enum Param {
    /// A string value going out as it arrives; `held` is trailing whitespace that the
    /// dialect's trim may still drop.
    Stream {
        trim: Trim,
        started: bool,
        held: String,
    },
    /// A typed value, converted when complete.
    Buffer {
        declared: Declared,
        trim: Trim,
        text: String,
        schema: Option<Value>,
    },
}

enum Args {
    Empty,
    /// Raw JSON text; with fix_args it is held in `pending` until the call ends.
    Json {
        pending: String,
    },
    Params {
        keys: Vec<String>,
        current: Option<Param>,
    },
}

struct OpenCall {
    index: usize,
    id: String,
    name: String,
    /// Everything sent as CallArgs so far.
    sent: String,
    args: Args,
}

pub(crate) struct Emitter {
    pub(crate) calls: Vec<ToolCall>,
    events: Vec<ToolEvent>,
    open: Option<OpenCall>,
    /// Indices are never reused, even after a call is abandoned: a streaming client has
    /// already seen the abandoned one's index.
    next_index: usize,
    ended: bool,
    schemas: Schemas,
    opts: ParserOptions,
}

impl Emitter {
    pub(crate) fn new(tools: &[Value], opts: ParserOptions) -> Self {
        Self {
            calls: Vec::new(),
            events: Vec::new(),
            open: None,
            next_index: 0,
            ended: false,
            schemas: Schemas::new(tools),
            opts,
        }
    }

    pub(crate) fn debug(&self, line: impl FnOnce() -> String) {
        if self.opts.debug {
            eprintln!("[ToolCallParser] {}", line());
        }
    }

    pub(crate) fn fix_args(&self) -> bool {
        self.opts.fix_args
    }

    pub(crate) fn call_open(&self) -> bool {
        self.open.is_some()
    }

    pub(crate) fn take_events(&mut self) -> Vec<ToolEvent> {
        std::mem::take(&mut self.events)
    }

    /// Whether a call ended since the last look.
    pub(crate) fn take_ended(&mut self) -> bool {
        std::mem::take(&mut self.ended)
    }

    pub(crate) fn text(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        match self.events.last_mut() {
            Some(ToolEvent::Text(prev)) => prev.push_str(t),
            _ => self.events.push(ToolEvent::Text(t.to_string())),
        }
    }

    pub(crate) fn start_call(&mut self, name: &str) {
        if self.open.is_some() {
            self.end_call();
        }
        let mut name = name.trim().to_string();
        if self.opts.fix_args && !self.schemas.knows(&name) {
            if let Some(mapped) = self.schemas.map_tool_name(&name) {
                self.debug(|| format!("tool name '{name}' -> '{mapped}'"));
                name = mapped.to_string();
            }
        }
        if !self.schemas.is_empty() && !self.schemas.knows(&name) {
            self.debug(|| format!("call to undeclared tool '{name}'"));
        }
        let index = self.next_index;
        self.next_index += 1;
        let id = new_call_id();
        self.events.push(ToolEvent::CallStart {
            index,
            id: id.clone(),
            name: name.clone(),
        });
        self.open = Some(OpenCall {
            index,
            id,
            name,
            sent: String::new(),
            args: Args::Empty,
        });
    }

    fn send(&mut self, frag: &str) {
        let Some(call) = self.open.as_mut() else {
            return;
        };
        if frag.is_empty() {
            return;
        }
        call.sent.push_str(frag);
        let index = call.index;
        match self.events.last_mut() {
            Some(ToolEvent::CallArgs { index: i, fragment }) if *i == index => {
                fragment.push_str(frag)
            }
            _ => self.events.push(ToolEvent::CallArgs {
                index,
                fragment: frag.to_string(),
            }),
        }
    }

    /// Raw JSON text of the arguments (JSON dialects).
    pub(crate) fn json_args(&mut self, frag: &str) {
        let fix = self.opts.fix_args;
        let Some(call) = self.open.as_mut() else {
            return;
        };
        if let Args::Empty = call.args {
            call.args = Args::Json {
                pending: String::new(),
            };
        }
        match &mut call.args {
            Args::Json { pending } if fix => pending.push_str(frag),
            Args::Json { .. } => self.send(frag),
            _ => {}
        }
    }

    fn params_of(&self) -> Option<&Value> {
        self.open
            .as_ref()
            .and_then(|c| self.schemas.params(&c.name))
    }

    /// Opens parameter `key` of an XML-like call; its value follows via `param_text`.
    pub(crate) fn param_begin(&mut self, key: &str, declared: Declared, trim: Trim) {
        self.param_end();
        let mut key = key.trim().to_string();
        let params = self.params_of().cloned();
        if let Some(mapped) = params
            .as_ref()
            .filter(|_| self.opts.fix_args)
            .and_then(|p| schema::map_key(p, &key))
        {
            self.debug(|| format!("argument '{key}' -> '{mapped}'"));
            key = mapped;
        }
        let prop = params
            .as_ref()
            .and_then(|p| schema::property(p, &key))
            .cloned();
        // A string streams as it arrives; anything typed waits for its whole text.
        let stream = match &prop {
            Some(p) => schema::is_plain_string(p) && declared != Declared::Json,
            None => declared == Declared::String,
        };
        let Some(call) = self.open.as_mut() else {
            return;
        };
        if !matches!(call.args, Args::Params { .. }) {
            call.args = Args::Params {
                keys: Vec::new(),
                current: None,
            };
        }
        let Args::Params { keys, current } = &mut call.args else {
            return;
        };
        let sep = if keys.is_empty() { "{" } else { ", " };
        keys.push(key.clone());
        *current = Some(match stream {
            true => Param::Stream {
                trim,
                started: false,
                held: String::new(),
            },
            false => Param::Buffer {
                declared,
                trim,
                text: String::new(),
                schema: prop,
            },
        });
        let head = format!(
            "{sep}{}: {}",
            json_string(&key),
            if stream { "\"" } else { "" }
        );
        self.send(&head);
    }

    /// More of the open parameter's value text.
    pub(crate) fn param_text(&mut self, t: &str) {
        let Some(Args::Params {
            current: Some(p), ..
        }) = self.open.as_mut().map(|c| &mut c.args)
        else {
            return;
        };
        match p {
            Param::Buffer { text, .. } => text.push_str(t),
            Param::Stream {
                trim,
                started,
                held,
            } => {
                let out = stream_trimmed(t, *trim, started, held);
                if !out.is_empty() {
                    let escaped = json_string(&out);
                    self.send(&escaped[1..escaped.len() - 1]);
                }
            }
        }
    }

    /// Closes the open parameter, if any.
    pub(crate) fn param_end(&mut self) {
        let fix = self.opts.fix_args;
        let Some(Args::Params { current, .. }) = self.open.as_mut().map(|c| &mut c.args) else {
            return;
        };
        let Some(param) = current.take() else {
            return;
        };
        let out = match param {
            Param::Stream { .. } => "\"".to_string(),
            Param::Buffer {
                declared,
                trim,
                text,
                schema,
            } => {
                let value = typed_value(&text, declared, trim, schema.as_ref(), fix);
                value.to_string()
            }
        };
        self.send(&out);
    }

    /// Closes the open call: emits what its arguments still need and `CallEnd`.
    pub(crate) fn end_call(&mut self) {
        self.param_end();
        let Some(call) = self.open.as_ref() else {
            return;
        };
        let tail = match &call.args {
            Args::Empty => "{}".to_string(),
            Args::Params { .. } => "}".to_string(),
            Args::Json { pending } if self.opts.fix_args => self.repair_json(pending),
            Args::Json { .. } => String::new(),
        };
        self.send(&tail);
        let Some(call) = self.open.take() else {
            return;
        };
        self.report_missing(&call);
        self.events.push(ToolEvent::CallEnd { index: call.index });
        self.calls.push(ToolCall {
            id: call.id,
            name: call.name,
            arguments: call.sent,
        });
        self.ended = true;
    }

    /// Drops the open call (its source is going out as text instead).
    pub(crate) fn abandon(&mut self) {
        if let Some(call) = self.open.take() {
            self.debug(|| {
                format!(
                    "call {} '{}' left unterminated; kept as text",
                    call.index, call.name
                )
            });
        }
    }

    fn repair_json(&self, raw: &str) -> String {
        let name = self.open.as_ref().map_or("", |c| c.name.as_str());
        let mut value = match serde_json::from_str::<Value>(raw.trim()) {
            Ok(v) => v,
            Err(_) if raw.trim().is_empty() => Value::Object(Default::default()),
            Err(_) => match super::lenient::parse(raw) {
                Some(v) => {
                    self.debug(|| format!("{name}: salvaged malformed JSON arguments"));
                    v
                }
                None => return raw.to_string(),
            },
        };
        if let Some(v) = value.as_str().and_then(super::lenient::parse_any) {
            self.debug(|| format!("{name}: arguments were a JSON string; unwrapped"));
            value = v;
        }
        if value.is_null() {
            value = Value::Object(Default::default());
        }
        if let Some(params) = self.params_of() {
            let mut notes = Vec::new();
            value = schema::coerce(value, params, true, &mut notes);
            if !notes.is_empty() {
                self.debug(|| format!("{name}: repaired {}", notes.join(", ")));
            }
        }
        value.to_string()
    }

    fn report_missing(&self, call: &OpenCall) {
        if !self.opts.debug {
            return;
        }
        let Some(params) = self.schemas.params(&call.name) else {
            return;
        };
        let keys: Vec<String> = serde_json::from_str::<Value>(&call.sent)
            .ok()
            .and_then(|v| v.as_object().map(|o| o.keys().cloned().collect()))
            .unwrap_or_default();
        let missing = schema::missing_required(params, &keys);
        if !missing.is_empty() {
            self.debug(|| {
                format!(
                    "call {} '{}': missing required parameter(s): {}",
                    call.index,
                    call.name,
                    missing.join(", ")
                )
            });
        }
    }
}

/// Applies a string value's trim while streaming: drops the leading part at the start and
/// holds trailing whitespace until more text shows it is inside the value.
fn stream_trimmed(t: &str, trim: Trim, started: &mut bool, held: &mut String) -> String {
    let mut t = t;
    if !*started {
        match trim {
            Trim::Newline if !t.is_empty() => {
                t = t.strip_prefix('\n').unwrap_or(t);
                *started = true;
            }
            Trim::Space => {
                t = t.trim_start();
                *started = !t.is_empty();
            }
            Trim::Newline => {}
            Trim::None => *started = true,
        }
    }
    let mut out = std::mem::take(held);
    out.push_str(t);
    let keep = match trim {
        Trim::None => out.len(),
        Trim::Newline => out.strip_suffix('\n').map_or(out.len(), str::len),
        Trim::Space => out.trim_end().len(),
    };
    *held = out.split_off(keep);
    out
}

/// Converts a complete parameter value to its JSON value, by the schema when there is one.
fn typed_value(
    text: &str,
    declared: Declared,
    trim: Trim,
    prop: Option<&Value>,
    fix: bool,
) -> Value {
    let trimmed = match trim {
        Trim::Newline => text.strip_prefix('\n').unwrap_or(text),
        _ => text,
    };
    let trimmed = match trim {
        Trim::Newline => trimmed.strip_suffix('\n').unwrap_or(trimmed),
        Trim::Space => trimmed.trim(),
        Trim::None => trimmed,
    };
    let parse = |s: &str| match fix {
        true => super::lenient::parse_any(s),
        false => serde_json::from_str(s.trim()).ok(),
    };
    let value = match declared {
        Declared::String => Value::String(trimmed.to_string()),
        Declared::Json => parse(trimmed).unwrap_or_else(|| Value::String(trimmed.to_string())),
        Declared::Auto => {
            let t = trimmed.trim();
            parse(t).unwrap_or_else(|| super::lenient::scalar(t))
        }
    };
    match prop {
        Some(p) => schema::coerce(value, p, fix, &mut Vec::new()),
        None => value,
    }
}

pub(crate) fn json_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `call_` + 24 alphanumerics. Std's per-instance random hasher keys, mixed with a counter
/// and the clock, are random enough for ids that only need to be unique in a conversation.
fn new_call_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut id = String::from("call_");
    let mut bits = 0u64;
    for i in 0..24 {
        if i % 8 == 0 {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
            h.write_u64(nanos);
            bits = h.finish();
        }
        id.push(ALPHABET[(bits % ALPHABET.len() as u64) as usize] as char);
        bits /= ALPHABET.len() as u64;
    }
    id
}
