//! Kimi K2 (`<|tool_calls_section_begin|>` … `functions.name:N` …) and DeepSeek V3/R1
//! (`function<｜tool▁sep｜>name` + fenced JSON) and V3.1 (`name<｜tool▁sep｜>{..}`).

use serde_json::json;

use super::{expect, parse_all_ways};
use crate::tool_calls::ToolCallFormat;

const K: ToolCallFormat = ToolCallFormat::KimiK2;

#[test]
fn kimi_k2_section_with_two_calls() {
    let input = "I'll check both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Beijing\", \"note\": \"<|tool_call_end|> is a token\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
    expect(
        K,
        &[],
        false,
        input,
        "I'll check both.",
        &[
            (
                "get_weather",
                json!({"city": "Beijing", "note": "<|tool_call_end|> is a token"}),
            ),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn kimi_k2_call_without_section_and_text_after() {
    let input = "<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"q\": \"rust\"}<|tool_call_end|>\nSearching now.";
    expect(
        K,
        &[],
        false,
        input,
        "\nSearching now.",
        &[("search", json!({"q": "rust"}))],
    );
}

#[test]
fn kimi_k2_unterminated() {
    let input = "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"q\": \"ru";
    let out = parse_all_ways(K, &[], false, input);
    assert_eq!((out.text.as_str(), out.calls.len()), (input, 0));
    expect(K, &[], true, input, "", &[("search", json!({"q": "ru"}))]);
}

const D: ToolCallFormat = ToolCallFormat::DeepSeekV3;

#[test]
fn deepseek_v3_fenced_json_calls() {
    let input = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"code\": \"```\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    expect(
        D,
        &[],
        false,
        input,
        "",
        &[
            ("get_weather", json!({"city": "Paris", "code": "```"})),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn deepseek_v31_name_before_separator() {
    let input = "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    expect(
        D,
        &[],
        false,
        input,
        "Let me look.",
        &[("get_weather", json!({"city": "Paris"}))],
    );
}

#[test]
fn deepseek_v3_unterminated() {
    let input = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Par";
    let out = parse_all_ways(D, &[], false, input);
    assert_eq!((out.text.as_str(), out.calls.len()), (input, 0));
    expect(
        D,
        &[],
        true,
        input,
        "",
        &[("get_weather", json!({"city": "Par"}))],
    );
}
