//! Tests of the tool-call parser against output in each model family's real format (shapes
//! taken from the models' chat templates and vLLM's parsers). Every sample is fed whole,
//! char by char, split at every position and in random chunks: all must give the same text
//! and calls, and the streamed events must be well formed (indices 0,1,2.. in order, one
//! CallEnd each, argument fragments concatenating to the final arguments).

mod api;
mod gemma;
mod json_formats;
mod reference;
mod repair;
mod robustness;
mod token_formats;
mod xml_formats;

use std::collections::HashMap;

use serde_json::{json, Value};

use super::{ParserOptions, ToolCall, ToolCallFormat, ToolCallParser, ToolEvent};

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Outcome {
    pub text: String,
    /// (name, arguments JSON text) of each completed call.
    pub calls: Vec<(String, String)>,
}

/// One OpenAI tool definition.
pub(super) fn tool(name: &str, props: Value, required: &[&str]) -> Value {
    json!({"type": "function", "function": {"name": name, "description": "test tool",
        "parameters": {"type": "object", "properties": props, "required": required}}})
}

/// `get_weather(city: string, days: integer, metric: boolean)`, city required.
pub(super) fn weather_tools() -> Vec<Value> {
    vec![
        tool(
            "get_weather",
            json!({"city": {"type": "string"}, "days": {"type": "integer"},
                   "metric": {"type": "boolean"}}),
            &["city"],
        ),
        tool("get_time", json!({}), &[]),
    ]
}

/// Feeds `chunks` in order, checks the event stream, and returns what came out.
pub(super) fn run<'a>(
    format: ToolCallFormat,
    tools: &[Value],
    fix: bool,
    chunks: impl IntoIterator<Item = &'a str>,
) -> Outcome {
    let opts = ParserOptions {
        fix_args: fix,
        debug: false,
    };
    let mut p = ToolCallParser::new(format, tools, opts);
    let mut events = Vec::new();
    for c in chunks {
        events.extend(p.push(c));
    }
    events.extend(p.finish());
    check_events(&events, p.calls());
    let text = events
        .iter()
        .filter_map(|e| match e {
            ToolEvent::Text(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let calls = p
        .calls()
        .iter()
        .map(|c| (c.name.clone(), c.arguments.clone()))
        .collect();
    Outcome { text, calls }
}

struct Seen {
    id: String,
    name: String,
    args: String,
    ended: bool,
}

fn check_events(events: &[ToolEvent], calls: &[ToolCall]) {
    let mut seen: HashMap<usize, Seen> = HashMap::new();
    let mut next = 0;
    for e in events {
        match e {
            ToolEvent::Text(t) => assert!(!t.is_empty(), "empty Text event"),
            ToolEvent::CallStart { index, id, name } => {
                assert_eq!(*index, next, "call indices must count up from 0");
                next += 1;
                assert!(id.starts_with("call_") && id.len() == 29, "id {id}");
                assert!(!name.is_empty());
                let s = Seen {
                    id: id.clone(),
                    name: name.clone(),
                    args: String::new(),
                    ended: false,
                };
                seen.insert(*index, s);
            }
            ToolEvent::CallArgs { index, fragment } => {
                let s = seen.get_mut(index).expect("CallArgs before CallStart");
                assert!(!s.ended, "CallArgs after CallEnd");
                assert!(!fragment.is_empty(), "empty CallArgs");
                s.args.push_str(fragment);
            }
            ToolEvent::CallEnd { index } => {
                let s = seen.get_mut(index).expect("CallEnd before CallStart");
                assert!(!s.ended, "second CallEnd for {index}");
                s.ended = true;
            }
        }
    }
    let mut ended: Vec<(usize, &Seen)> = seen
        .iter()
        .filter(|(_, s)| s.ended)
        .map(|(i, s)| (*i, s))
        .collect();
    ended.sort_by_key(|(i, _)| *i);
    assert_eq!(
        ended.len(),
        calls.len(),
        "every ended call, and only those, is in calls()"
    );
    for ((_, s), c) in ended.iter().zip(calls) {
        assert_eq!((&s.id, &s.name), (&c.id, &c.name));
        assert_eq!(
            s.args, c.arguments,
            "fragments must concatenate to the arguments"
        );
    }
    let mut ids: Vec<&String> = calls.iter().map(|c| &c.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), calls.len(), "call ids must be unique");
}

/// Char boundaries of `s`, excluding 0 and len.
fn cuts(s: &str) -> Vec<usize> {
    s.char_indices()
        .map(|(i, _)| i)
        .filter(|&i| i > 0)
        .collect()
}

fn split_at_cuts<'a>(s: &'a str, at: &[usize]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut prev = 0;
    for &i in at {
        out.push(&s[prev..i]);
        prev = i;
    }
    out.push(&s[prev..]);
    out
}

/// Feeds `input` whole, char by char, split once at every position and in 40 random
/// chunkings; asserts they all agree and returns the outcome.
pub(super) fn parse_all_ways(
    format: ToolCallFormat,
    tools: &[Value],
    fix: bool,
    input: &str,
) -> Outcome {
    let whole = run(format, tools, fix, [input]);
    let all = cuts(input);
    let by_char = run(format, tools, fix, split_at_cuts(input, &all));
    assert_eq!(
        by_char, whole,
        "char by char differs from whole for {input:?}"
    );
    for &c in &all {
        let two = run(format, tools, fix, split_at_cuts(input, &[c]));
        assert_eq!(two, whole, "split at {c} differs for {input:?}");
    }
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ input.len() as u64;
    for _ in 0..40 {
        let picked: Vec<usize> = all
            .iter()
            .copied()
            .filter(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state.is_multiple_of(5)
            })
            .collect();
        let random = run(format, tools, fix, split_at_cuts(input, &picked));
        assert_eq!(random, whole, "chunks at {picked:?} differ for {input:?}");
    }
    whole
}

/// Parses every way and checks the text and the calls (arguments compared as JSON values).
pub(super) fn expect(
    format: ToolCallFormat,
    tools: &[Value],
    fix: bool,
    input: &str,
    text: &str,
    calls: &[(&str, Value)],
) -> Outcome {
    let out = parse_all_ways(format, tools, fix, input);
    assert_eq!(out.text, text, "text for {input:?}");
    let got: Vec<(&str, Value)> = out
        .calls
        .iter()
        .map(|(n, a)| {
            let v =
                serde_json::from_str(a).unwrap_or_else(|e| panic!("arguments {a:?} not JSON: {e}"));
            (n.as_str(), v)
        })
        .collect();
    let want: Vec<(&str, Value)> = calls.iter().map(|(n, v)| (*n, v.clone())).collect();
    assert_eq!(got, want, "calls for {input:?}");
    out
}
