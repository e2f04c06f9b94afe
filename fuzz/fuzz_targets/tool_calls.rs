//! Every streaming tool-call parser on arbitrary model output in arbitrary chunkings.
//! Input: byte 0 picks the dialect, byte 1 `--fix-tool-args` and the chunking seed, the rest is
//! the model's text. Checked, beyond "no panic":
//! - for call `i`, the `CallArgs` fragments concatenate to `calls()[i].arguments`;
//! - arguments and ends come only inside a started call;
//! - the text, names and arguments do not depend on how the output was chunked.
#![no_main]

use afm_chat::tool_calls::{ParserOptions, ToolCallFormat, ToolCallParser, ToolEvent};

use libfuzzer_sys::fuzz_target;
use serde_json::json;

/// Text, and (name, arguments) per call, from one run over `chunks`.
fn run(format: ToolCallFormat, opts: ParserOptions, chunks: &[&str]) -> (String, Vec<(String, String)>) {
    let tools = [json!({"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}})];
    let mut parser = ToolCallParser::new(format, &tools, opts);
    let mut events = Vec::new();
    for chunk in chunks {
        events.extend(parser.push(chunk));
    }
    events.extend(parser.finish());
    let mut text = String::new();
    // An open call's fragments; a call cut off at the end of output is abandoned (its source
    // goes out as text after its CallStart was already streamed) and never ends.
    let mut open: Option<String> = None;
    let mut ended: Vec<String> = Vec::new();
    for event in events {
        match event {
            ToolEvent::Text(t) => text.push_str(&t),
            ToolEvent::CallStart { .. } => open = Some(String::new()),
            ToolEvent::CallArgs { index, fragment } => match &mut open {
                Some(args) => args.push_str(&fragment),
                None => panic!("CallArgs for call {index} outside a call"),
            },
            ToolEvent::CallEnd { index } => match open.take() {
                Some(args) => ended.push(args),
                None => panic!("CallEnd for call {index} outside a call"),
            },
        }
    }
    let calls = parser.calls();
    assert_eq!(calls.len(), ended.len(), "calls() and CallEnd events disagree");
    for (call, streamed) in calls.iter().zip(&ended) {
        assert_eq!(&call.arguments, streamed, "streamed fragments differ from the final arguments");
    }
    let calls = calls
        .iter()
        .map(|c| (c.name.clone(), c.arguments.clone()))
        .collect();
    (text, calls)
}

/// Splits `text` at char boundaries into pieces of 1..=8 bytes, driven by `seed`.
fn chunk(text: &str, mut seed: u32) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < text.len() {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        let mut end = (start + 1 + (seed % 8) as usize).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let [pick, flags, rest @ ..] = data else {
        return;
    };
    // Every dialect, and extraction off after them.
    let k = *pick as usize % (ToolCallFormat::DIALECTS.len() + 1);
    let format = ToolCallFormat::DIALECTS.get(k).copied().unwrap_or(ToolCallFormat::None);
    let opts = ParserOptions {
        fix_args: flags & 1 == 1,
        debug: false,
    };
    let text = String::from_utf8_lossy(rest);
    let whole = run(format, opts, &[&text]);
    let pieces = run(format, opts, &chunk(&text, u32::from(*flags) | 0x9e37_0000));
    assert_eq!(whole, pieces, "chunking changed the result");
});
