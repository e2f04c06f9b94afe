//! Tool calls in the server: picks a request's dialect (`--tool-call-parser`, else the model's
//! own), runs each choice's `content` through afm-chat's streaming [`ToolCallParser`] (after
//! the reasoning split: calls are never parsed out of reasoning), and shapes what it finds as
//! OpenAI `tool_calls`, streamed fragments and final message alike.
//!
//! Parsing, repair and the dialects themselves live in afm-chat; this file only applies the
//! request's wishes (`parallel_tool_calls`) and the wire shapes.
//!
//! ```text
//!  content ─► ToolCallParser ─► Text ───────────────► delta.content
//!                             └► CallStart/CallArgs ─► delta.tool_calls[{index, ..}]
//!                                (index renumbered over the calls let through)
//! ```

use std::sync::Arc;

use afm_chat::tool_calls::{ParserOptions, ToolCall, ToolCallFormat, ToolCallParser, ToolEvent};
use serde_json::{json, Value};

/// Server-wide tool-call settings, from the command line.
#[derive(Debug, Clone, Copy, Default)]
pub struct ToolCallConfig {
    /// `--tool-call-parser`: forces a dialect; `None` takes the model's own.
    pub format: Option<ToolCallFormat>,
    /// `--fix-tool-args`: repair arguments (JSON ones then arrive in one fragment).
    pub fix_args: bool,
    /// `AFM_DEBUG=1`: `[ToolCallParser]` lines on stderr.
    pub debug: bool,
}

/// What the choices of one request parse for.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub format: ToolCallFormat,
    /// The request's `tools`, for repair against their schemas.
    pub tools: Arc<[Value]>,
    pub options: ParserOptions,
    /// `parallel_tool_calls`: false keeps only the first completed call.
    pub parallel: bool,
}

impl ToolSpec {
    /// `None` when nothing is to be parsed: no tools in the request (validation already
    /// removed them for `tool_choice: "none"`) or the dialect `none`.
    pub fn for_request(
        config: &ToolCallConfig,
        model_format: ToolCallFormat,
        tools: Option<&[Value]>,
        parallel: bool,
    ) -> Option<Self> {
        let tools = tools.filter(|t| !t.is_empty())?;
        let format = config.format.unwrap_or(model_format);
        if format == ToolCallFormat::None {
            return None;
        }
        Some(ToolSpec {
            format,
            tools: tools.into(),
            options: ParserOptions {
                fix_args: config.fix_args,
                debug: config.debug,
            },
            parallel,
        })
    }
}

/// One piece of a call as it streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolCallDelta {
    /// The call's first chunk: its index, id and name, with empty arguments.
    Start {
        index: usize,
        id: String,
        name: String,
    },
    /// More argument text of call `index`.
    Args { index: usize, fragment: String },
}

impl ToolCallDelta {
    /// The element of a chunk's `delta.tool_calls`.
    pub fn to_json(&self) -> Value {
        match self {
            ToolCallDelta::Start { index, id, name } => json!({
                "index": index, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""},
            }),
            ToolCallDelta::Args { index, fragment } => json!({
                "index": index, "function": {"arguments": fragment},
            }),
        }
    }
}

/// Content after extraction, in output order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Calls(Vec<ToolCallDelta>),
}

/// One choice's parser, with `parallel_tool_calls` applied and indices renumbered over the
/// calls let through (so a client that indexes a list never sees a gap).
pub struct ToolStage {
    parser: ToolCallParser,
    parallel: bool,
    /// Parser index → streamed index, for each call let through.
    streamed: Vec<(usize, usize)>,
    /// A call has completed: with `parallel_tool_calls: false` later ones are dropped.
    completed: bool,
}

impl ToolStage {
    pub fn new(spec: &ToolSpec) -> Self {
        ToolStage {
            parser: ToolCallParser::new(spec.format, &spec.tools, spec.options),
            parallel: spec.parallel,
            streamed: Vec::new(),
            completed: false,
        }
    }

    /// Feeds the next piece of content; `last` ends the turn (flushes held-back text and
    /// closes or gives up an open call).
    pub fn push(&mut self, content: &str, last: bool) -> Vec<Piece> {
        let mut events = self.parser.push(content);
        if last {
            events.extend(self.parser.finish());
        }
        let mut pieces: Vec<Piece> = Vec::new();
        for event in events {
            let delta = match event {
                ToolEvent::Text(t) => {
                    match pieces.last_mut() {
                        Some(Piece::Text(prev)) => prev.push_str(&t),
                        _ => pieces.push(Piece::Text(t)),
                    }
                    continue;
                }
                ToolEvent::CallStart { index, id, name } => {
                    if self.completed && !self.parallel {
                        continue;
                    }
                    let out = self.streamed.len();
                    self.streamed.push((index, out));
                    ToolCallDelta::Start {
                        index: out,
                        id,
                        name,
                    }
                }
                ToolEvent::CallArgs { index, fragment } => match self.out_index(index) {
                    Some(out) => ToolCallDelta::Args {
                        index: out,
                        fragment,
                    },
                    None => continue,
                },
                ToolEvent::CallEnd { .. } => {
                    self.completed = true;
                    continue;
                }
            };
            match pieces.last_mut() {
                Some(Piece::Calls(calls)) => calls.push(delta),
                _ => pieces.push(Piece::Calls(vec![delta])),
            }
        }
        pieces
    }

    /// The completed calls, as `message.tool_calls` should list them.
    pub fn calls(&self) -> Vec<ToolCall> {
        let calls = self.parser.calls();
        let keep = if self.parallel { calls.len() } else { 1 };
        calls.iter().take(keep).cloned().collect()
    }

    fn out_index(&self, parser_index: usize) -> Option<usize> {
        self.streamed
            .iter()
            .find(|(p, _)| *p == parser_index)
            .map(|(_, out)| *out)
    }
}

/// `message.tool_calls` of a non-streamed answer.
pub fn message_tool_calls(calls: &[ToolCall]) -> Vec<Value> {
    calls
        .iter()
        .map(|c| {
            json!({
                "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(parallel: bool) -> ToolStage {
        let config = ToolCallConfig::default();
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let spec = ToolSpec::for_request(&config, ToolCallFormat::Hermes, Some(&tools), parallel)
            .expect("tools given");
        ToolStage::new(&spec)
    }

    fn run(stage: &mut ToolStage, text: &str) -> Vec<Piece> {
        // One character at a time, as a byte-level model would stream it.
        let mut pieces = Vec::new();
        for c in text.chars() {
            pieces.extend(stage.push(&c.to_string(), false));
        }
        pieces.extend(stage.push("", true));
        pieces
    }

    fn starts(pieces: &[Piece]) -> Vec<(usize, String)> {
        pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Calls(c) => Some(c),
                Piece::Text(_) => None,
            })
            .flatten()
            .filter_map(|d| match d {
                ToolCallDelta::Start { index, name, .. } => Some((*index, name.clone())),
                ToolCallDelta::Args { .. } => None,
            })
            .collect()
    }

    const TWO: &str = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>\n\
                       <tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";

    #[test]
    fn parallel_calls_stream_with_their_own_indices() {
        let mut s = stage(true);
        let pieces = run(&mut s, TWO);
        assert_eq!(starts(&pieces), [(0, "f".into()), (1, "g".into())]);
        assert_eq!(s.calls().len(), 2);
    }

    #[test]
    fn parallel_false_keeps_the_first_call_only() {
        let mut s = stage(false);
        let pieces = run(&mut s, TWO);
        assert_eq!(starts(&pieces), [(0, "f".into())]);
        let calls = s.calls();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, "{\"a\": 1}");
    }

    #[test]
    fn no_tools_or_format_none_means_no_parsing() {
        let config = ToolCallConfig::default();
        assert!(ToolSpec::for_request(&config, ToolCallFormat::Hermes, None, true).is_none());
        assert!(ToolSpec::for_request(&config, ToolCallFormat::Hermes, Some(&[]), true).is_none());
        let forced = ToolCallConfig {
            format: Some(ToolCallFormat::None),
            ..config
        };
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        assert!(
            ToolSpec::for_request(&forced, ToolCallFormat::Hermes, Some(&tools), true).is_none()
        );
    }

    #[test]
    fn wire_shapes_follow_openai() {
        let start = ToolCallDelta::Start {
            index: 0,
            id: "call_x".into(),
            name: "f".into(),
        };
        assert_eq!(
            start.to_json(),
            json!({"index": 0, "id": "call_x", "type": "function",
                   "function": {"name": "f", "arguments": ""}})
        );
        let args = ToolCallDelta::Args {
            index: 1,
            fragment: "{\"a\"".into(),
        };
        assert_eq!(
            args.to_json(),
            json!({"index": 1, "function": {"arguments": "{\"a\""}})
        );
    }
}
