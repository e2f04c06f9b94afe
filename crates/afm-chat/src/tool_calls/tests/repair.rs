//! `--fix-tool-args`: malformed JSON salvaged, values coerced to the tool's schema,
//! misnamed arguments mapped to declared names, and the behaviour without the flag.

use serde_json::json;

use super::{expect, tool, weather_tools};
use crate::tool_calls::{ParserOptions, ToolCallFormat, ToolCallParser, ToolEvent};

const H: ToolCallFormat = ToolCallFormat::Hermes;

#[test]
fn malformed_json_is_salvaged() {
    let cases = [
        r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 3,}}"#,
        r#"{"name": "get_weather", "arguments": {'city': 'Paris', 'days': 3}}"#,
        r#"{"name": "get_weather", "arguments": {city: "Paris", days: 3}}"#,
        r#"{'name': 'get_weather', 'arguments': {'city': 'Paris', 'days': 3}}"#,
    ];
    for body in cases {
        let input = format!("<tool_call>\n{body}\n</tool_call>");
        expect(
            H,
            &weather_tools(),
            true,
            &input,
            "",
            &[("get_weather", json!({"city": "Paris", "days": 3}))],
        );
    }
}

#[test]
fn missing_closing_braces_are_added_at_the_end_of_output() {
    let input =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3";
    expect(
        H,
        &weather_tools(),
        true,
        input,
        "",
        &[("get_weather", json!({"city": "Paris", "days": 3}))],
    );
}

#[test]
fn values_are_coerced_to_the_schema() {
    let tools = vec![tool(
        "search",
        json!({"limit": {"type": "integer"}, "exact": {"type": "boolean"}, "score": {"type": "number"},
               "filter": {"type": "object", "properties": {"year": {"type": "integer"}}},
               "tags": {"type": "array", "items": {"type": "string"}}, "q": {"type": "string"}}),
        &["q"],
    )];
    let input = r#"<tool_call>{"name": "search", "arguments": {"q": 42, "limit": "5", "exact": "true", "score": "0.5", "filter": "{\"year\": \"2024\"}", "tags": "solo"}}</tool_call>"#;
    expect(
        H,
        &tools,
        true,
        input,
        "",
        &[(
            "search",
            json!({"q": "42", "limit": 5, "exact": true, "score": 0.5, "filter": {"year": 2024}, "tags": ["solo"]}),
        )],
    );
    // Without repair, JSON arguments pass through untouched.
    expect(
        H,
        &tools,
        false,
        input,
        "",
        &[(
            "search",
            json!({"q": 42, "limit": "5", "exact": "true", "score": "0.5", "filter": "{\"year\": \"2024\"}", "tags": "solo"}),
        )],
    );
}

#[test]
fn misnamed_arguments_map_to_declared_names() {
    let input = r#"<tool_call>{"name": "get_weather", "arguments": {"City": "Paris", "Days": "2", "is-metric": true, "metrics": false}}</tool_call>"#;
    // "is-metric" is two edits from "metric" but so is nothing else; "metrics" too: with both
    // present, the later one keeps its own name since "metric" is taken.
    expect(
        H,
        &weather_tools(),
        true,
        input,
        "",
        &[(
            "get_weather",
            json!({"city": "Paris", "days": 2, "metric": true, "metrics": false}),
        )],
    );
}

#[test]
fn misnamed_xml_parameters_map_while_streaming() {
    let input = "<tool_call>\n<function=get_weather>\n<parameter=CITY>\nLyon\n</parameter>\n<parameter=num_days>\n4\n</parameter>\n</function>\n</tool_call>";
    // "num_days" is not within two edits of "days" (normalized "numdays" vs "days": 3).
    expect(
        ToolCallFormat::QwenXml,
        &weather_tools(),
        true,
        input,
        "",
        &[("get_weather", json!({"city": "Lyon", "num_days": "4"}))],
    );
    expect(
        ToolCallFormat::QwenXml,
        &weather_tools(),
        false,
        input,
        "",
        &[("get_weather", json!({"CITY": "Lyon", "num_days": "4"}))],
    );
}

#[test]
fn misnamed_tool_is_mapped_to_the_declared_one() {
    let input = r#"<tool_call>{"name": "Get-Weather", "arguments": {"city": "Paris"}}</tool_call>"#;
    expect(
        H,
        &weather_tools(),
        true,
        input,
        "",
        &[("get_weather", json!({"city": "Paris"}))],
    );
}

#[test]
fn repaired_json_arguments_arrive_in_one_fragment_at_the_end() {
    let opts = ParserOptions {
        fix_args: true,
        debug: false,
    };
    let mut p = ToolCallParser::new(H, &weather_tools(), opts);
    let ev = p.push("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": \"3\"");
    assert_eq!(
        ev.len(),
        1,
        "only the start, the arguments wait for repair: {ev:?}"
    );
    let ev = p.push("}}</tool_call>");
    assert_eq!(
        ev,
        vec![
            ToolEvent::CallArgs {
                index: 0,
                fragment: r#"{"city":"Paris","days":3}"#.into()
            },
            ToolEvent::CallEnd { index: 0 },
        ]
    );
}

#[test]
fn debug_mode_reports_without_changing_output() {
    let input = r#"<tool_call>{"name": "get_weather", "arguments": {"days": 1}}</tool_call>"#;
    let opts = ParserOptions {
        fix_args: true,
        debug: true,
    };
    let mut p = ToolCallParser::new(H, &weather_tools(), opts);
    p.push(input);
    p.finish();
    assert_eq!(p.calls()[0].arguments, r#"{"days":1}"#);
}

#[test]
fn missing_comma_between_members() {
    let input =
        "<tool_call>{\"name\": \"get_weather\"\n\"arguments\": {\"city\": \"Paris\"}}</tool_call>";
    expect(
        H,
        &weather_tools(),
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Paris"}))],
    );
}
