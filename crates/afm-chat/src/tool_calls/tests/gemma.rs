//! Gemma 4 (`<|tool_call>call:name{..}<tool_call|>` with `<|"|>` strings), FunctionGemma
//! (`<start_function_call>` with `<escape>`), and Gemma 3's prompted ```` ```tool_code ````.

use serde_json::json;

use super::{expect, parse_all_ways, tool, weather_tools};
use crate::tool_calls::ToolCallFormat;

const G: ToolCallFormat = ToolCallFormat::Gemma;

#[test]
fn gemma4_call_with_typed_values() {
    let input = "<|tool_call>call:get_weather{city:<|\"|>Paris, France<|\"|>,days:3,metric:true}<tool_call|>";
    let out = expect(
        G,
        &[],
        false,
        input,
        "",
        &[(
            "get_weather",
            json!({"city": "Paris, France", "days": 3, "metric": true}),
        )],
    );
    assert_eq!(
        out.calls[0].1,
        r#"{"city": "Paris, France", "days": 3, "metric": true}"#
    );
}

#[test]
fn gemma4_braces_and_quotes_inside_strings_and_nested_values() {
    let input = "Scheduling it.<|tool_call>call:create_event{title:<|\"|>Sync {weekly}, \"all hands\"<|\"|>,attendees:[<|\"|>ann<|\"|>,<|\"|>bob<|\"|>],meta:{priority:2,room:<|\"|>B}2<|\"|>}}<tool_call|>";
    expect(
        G,
        &[],
        false,
        input,
        "Scheduling it.",
        &[(
            "create_event",
            json!({"title": "Sync {weekly}, \"all hands\"", "attendees": ["ann", "bob"], "meta": {"priority": 2, "room": "B}2"}}),
        )],
    );
}

#[test]
fn gemma4_consecutive_calls_and_text_after() {
    let input = "<|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}<tool_call|><|tool_call>call:get_time{}<tool_call|>Both requested.";
    expect(
        G,
        &[],
        false,
        input,
        "Both requested.",
        &[
            ("get_weather", json!({"city": "Oslo"})),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn gemma4_schema_turns_a_bare_number_into_a_string() {
    let tools = vec![tool(
        "lookup",
        json!({"zip": {"type": "string"}, "n": {"type": "integer"}}),
        &[],
    )];
    let input = "<|tool_call>call:lookup{zip:02139,n:<|\"|>4<|\"|>}<tool_call|>";
    expect(
        G,
        &tools,
        false,
        input,
        "",
        &[("lookup", json!({"zip": "02139", "n": 4}))],
    );
}

#[test]
fn function_gemma_escape_delimiters() {
    let input = "<start_function_call>call:get_weather{city:<escape>Tokyo<escape>,days:2}<end_function_call>";
    expect(
        G,
        &weather_tools(),
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Tokyo", "days": 2}))],
    );
}

#[test]
fn gemma3_tool_code_block() {
    let input = "I'll check.\n```tool_code\nprint(default_api.get_weather(city=\"London, UK\", days=2, metric=True))\nget_time()\n```\n";
    expect(
        G,
        &[],
        false,
        input,
        "I'll check.\n",
        &[
            (
                "get_weather",
                json!({"city": "London, UK", "days": 2, "metric": true}),
            ),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn gemma3_tool_code_that_is_not_a_call_stays_text() {
    let input = "```tool_code\nx = 1 + 2\n```";
    expect(G, &[], false, input, input, &[]);
}

#[test]
fn gemma4_unterminated() {
    let input = "<|tool_call>call:get_weather{city:<|\"|>Par";
    let out = parse_all_ways(G, &[], false, input);
    assert_eq!((out.text.as_str(), out.calls.len()), (input, 0));
    expect(
        G,
        &[],
        true,
        input,
        "",
        &[("get_weather", json!({"city": "Par"}))],
    );
}
