//! Round trip through a real chat template: assistant turns with `tool_calls`, rendered by
//! transformers' `apply_chat_template` with Qwen2.5's own template (recorded in
//! `tests/fixtures/templates.json`), are what the model is trained to write; parsing them
//! back must give the original calls and content.

use serde_json::Value;

use super::parse_all_ways;
use crate::tool_calls::ToolCallFormat;

fn recorded() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/templates.json");
    let text = std::fs::read_to_string(path).expect("templates fixture exists");
    serde_json::from_str(&text).expect("templates fixture is JSON")
}

/// The assistant turns of a ChatML rendering.
fn assistant_turns(rendered: &str) -> Vec<&str> {
    rendered
        .split("<|im_start|>assistant\n")
        .skip(1)
        .filter_map(|turn| turn.split_once("<|im_end|>").map(|(body, _)| body))
        .collect()
}

#[test]
fn qwen25_template_renderings_parse_back_to_their_calls() {
    let f = recorded();
    let template = f["templates"]["qwen25"].as_str().expect("qwen25 template");
    let format = ToolCallFormat::detect("qwen2", Some(template));
    assert_eq!(format, ToolCallFormat::Hermes);
    let mut checked = 0;
    for case in f["cases"].as_array().expect("cases") {
        if case["template"] != "qwen25" {
            continue;
        }
        let wanted: Vec<&Value> = case["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .filter(|m| m["role"] == "assistant")
            .collect();
        let turns = assistant_turns(case["output"].as_str().expect("output"));
        for (msg, turn) in wanted.iter().zip(turns) {
            let out = parse_all_ways(format, &[], false, turn);
            let content = msg["content"].as_str().unwrap_or("");
            assert_eq!(out.text.trim_end(), content, "content of {turn:?}");
            let calls = msg["tool_calls"].as_array().cloned().unwrap_or_default();
            assert_eq!(out.calls.len(), calls.len(), "calls in {turn:?}");
            for ((name, args), want) in out.calls.iter().zip(&calls) {
                assert_eq!(name, &want["function"]["name"]);
                let args: Value = serde_json::from_str(args).expect("arguments are JSON");
                let want_args = want["function"]["arguments"].as_str().expect("string");
                assert_eq!(
                    args,
                    serde_json::from_str::<Value>(want_args).expect("JSON")
                );
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 3,
        "the fixture holds assistant tool calls ({checked} checked)"
    );
}
