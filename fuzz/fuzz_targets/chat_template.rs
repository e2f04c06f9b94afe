//! Hostile chat templates: a template (from a model file) plus a message, rendered under
//! afm-chat's sandbox. Every render must end — with text within the output limit or an
//! error — in bounded time (fuel) and memory; there are no file or network functions to reach.
//!
//! Input: template source, a NUL byte, then the user message text.
//!
//! Not bounded, hence skipped: memory that a value feeding on itself takes (a `namespace`
//! attribute reassigned to twice itself in a loop, a `macro` recursing on a doubled argument)
//! grows exponentially within the fuel budget, and minijinja has no hook where strings are
//! built. Templates come with the model file the operator chose, as its weights do.
#![no_main]

use afm_chat::template::{ChatTemplate, RenderLimits};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map};

const LIMITS: RenderLimits = RenderLimits {
    max_output_bytes: 1 << 20,
    fuel: 200_000,
    max_recursion: 64,
};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (src, content) = text.split_once('\0').unwrap_or((&text, "hi"));
    if src.contains("namespace") || src.contains("macro") {
        return;
    }
    let Ok(tpl) = ChatTemplate::with_limits(src, "<s>", "</s>", LIMITS) else {
        return;
    };
    let messages = [
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": content}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
        ]}),
        json!({"role": "tool", "content": content}),
    ];
    let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {}}})];
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), json!(true));
    if let Ok(out) = tpl.render(&messages, Some(&tools), true, &kwargs) {
        assert!(out.len() <= LIMITS.max_output_bytes, "output past the limit");
    }
});
