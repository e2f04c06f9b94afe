//! Qwen3-Coder / Qwen 3.5 XML (`<function=..><parameter=..>`, one value per line as the
//! template renders it), MiniMax M2 (`<invoke name=..>`), DeepSeek DSML (V3.2
//! `function_calls`, V4 `tool_calls`) and GLM 4.5/4.7 (`<arg_key>`/`<arg_value>`).

use serde_json::json;

use super::{expect, parse_all_ways, tool, weather_tools};
use crate::tool_calls::{ParserOptions, ToolCallFormat, ToolCallParser, ToolEvent};

const Q: ToolCallFormat = ToolCallFormat::QwenXml;

const QWEN_CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

#[test]
fn qwen_xml_values_follow_the_schema() {
    let out = expect(
        Q,
        &weather_tools(),
        false,
        QWEN_CALL,
        "",
        &[("get_weather", json!({"city": "Paris", "days": 3}))],
    );
    assert_eq!(out.calls[0].1, r#"{"city": "Paris", "days": 3}"#);
}

#[test]
fn qwen_xml_without_schema_keeps_strings() {
    expect(
        Q,
        &[],
        false,
        QWEN_CALL,
        "",
        &[("get_weather", json!({"city": "Paris", "days": "3"}))],
    );
}

#[test]
fn qwen_xml_streams_the_json_object_incrementally() {
    let mut p = ToolCallParser::new(Q, &weather_tools(), ParserOptions::default());
    let ev = p.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa");
    assert!(matches!(&ev[0], ToolEvent::CallStart { index: 0, name, .. } if name == "get_weather"));
    assert_eq!(
        ev[1],
        ToolEvent::CallArgs {
            index: 0,
            fragment: "{\"city\": \"Pa".into()
        }
    );
    let ev = p.push("ris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>");
    let args: String = ev
        .iter()
        .filter_map(|e| match e {
            ToolEvent::CallArgs { fragment, .. } => Some(fragment.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(args, "ris\", \"days\": 3}");
    assert_eq!(ev.last(), Some(&ToolEvent::CallEnd { index: 0 }));
}

#[test]
fn qwen_xml_multiline_code_with_closing_tags_inside() {
    let tools = vec![tool(
        "write_file",
        json!({"path": {"type": "string"}, "content": {"type": "string"}}),
        &["path"],
    )];
    let content = "fn main() {\n    // a literal </parameter> and </function> and </tool_call>\n    println!(\"}\");\n}\n";
    let input = format!(
        "I'll write it.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>\nDone."
    );
    expect(
        Q,
        &tools,
        false,
        &input,
        "I'll write it.\n\n\nDone.",
        &[(
            "write_file",
            json!({"path": "src/main.rs", "content": content}),
        )],
    );
}

#[test]
fn qwen_xml_several_calls_and_bare_function() {
    let input = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>";
    expect(
        Q,
        &weather_tools(),
        false,
        input,
        "",
        &[
            ("get_time", json!({})),
            ("get_weather", json!({"city": "Oslo", "metric": true})),
            ("get_weather", json!({"city": "Lima"})),
        ],
    );
}

#[test]
fn qwen_xml_accepts_json_inside_tool_call() {
    // afm_adaptive_xml: a Qwen XML model that writes Hermes JSON is still understood.
    let input = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n</tool_call>";
    expect(
        Q,
        &[],
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Bern"}))],
    );
}

#[test]
fn qwen_xml_object_and_array_parameters_are_parsed() {
    let tools = vec![tool(
        "search",
        json!({"filter": {"type": "object"}, "tags": {"type": "array"}, "q": {"type": "string"}}),
        &[],
    )];
    let input = "<tool_call>\n<function=search>\n<parameter=q>\n{\"not\": \"parsed\"}\n</parameter>\n<parameter=filter>\n{\"year\": 2024, \"lang\": \"en\"}\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>";
    expect(
        Q,
        &tools,
        false,
        input,
        "",
        &[(
            "search",
            json!({"q": "{\"not\": \"parsed\"}", "filter": {"year": 2024, "lang": "en"}, "tags": ["a", "b"]}),
        )],
    );
}

#[test]
fn qwen_xml_unterminated_with_and_without_repair() {
    let input = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
    expect(Q, &weather_tools(), false, input, input, &[]);
    expect(
        Q,
        &weather_tools(),
        true,
        input,
        "",
        &[("get_weather", json!({"city": "Par"}))],
    );
}

const MM: ToolCallFormat = ToolCallFormat::MinimaxM2;

#[test]
fn minimax_m2_invokes() {
    let input = "Let me check.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">San Francisco</parameter>\n<parameter name=\"days\">2</parameter>\n</invoke>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>";
    expect(
        MM,
        &weather_tools(),
        false,
        input,
        "Let me check.\n",
        &[
            ("get_weather", json!({"city": "San Francisco", "days": 2})),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn minimax_m2_closing_tag_inside_value() {
    let input = "<minimax:tool_call>\n<invoke name=\"echo\">\n<parameter name=\"text\">say </parameter> then </invoke> ok</parameter>\n</invoke>\n</minimax:tool_call>";
    expect(
        MM,
        &[],
        false,
        input,
        "",
        &[(
            "echo",
            json!({"text": "say </parameter> then </invoke> ok"}),
        )],
    );
}

const DS: ToolCallFormat = ToolCallFormat::DeepSeekV4Dsml;

#[test]
fn dsml_v4_tool_calls() {
    let input = "I will call the tools.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Hangzhou</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n<｜DSML｜parameter name=\"opts\" string=\"false\">{\"hourly\": true, \"fields\": [\"temp\"]}</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    expect(
        DS,
        &[],
        false,
        input,
        "I will call the tools.\n\n",
        &[
            (
                "get_weather",
                json!({"city": "Hangzhou", "days": 3, "opts": {"hourly": true, "fields": ["temp"]}}),
            ),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn dsml_v32_function_calls() {
    let input = "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">rust </｜DSML｜parameter> parsing</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
    expect(
        DS,
        &[],
        false,
        input,
        "",
        &[(
            "search",
            json!({"query": "rust </｜DSML｜parameter> parsing"}),
        )],
    );
}

const G: ToolCallFormat = ToolCallFormat::Glm4;

#[test]
fn glm45_lines() {
    let input = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>";
    // No schema: GLM values that read as JSON are JSON.
    expect(
        G,
        &[],
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Beijing", "days": 2}))],
    );
}

#[test]
fn glm47_inline_and_parallel() {
    let tools = vec![tool(
        "lookup",
        json!({"id": {"type": "string"}, "n": {"type": "integer"}}),
        &["id"],
    )];
    let input = "<tool_call>lookup<arg_key>id</arg_key><arg_value>00123</arg_value><arg_key>n</arg_key><arg_value>5</arg_value></tool_call><tool_call>get_time</tool_call>";
    expect(
        G,
        &tools,
        false,
        input,
        "",
        &[
            ("lookup", json!({"id": "00123", "n": 5})),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn glm_value_with_closing_tag_inside() {
    let input = "<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>a </arg_value> b</arg_value>\n</tool_call>\nSaved.";
    let tools = vec![tool("note", json!({"text": {"type": "string"}}), &[])];
    expect(
        G,
        &tools,
        false,
        input,
        "\nSaved.",
        &[("note", json!({"text": "a </arg_value> b"}))],
    );
}

#[test]
fn glm_unterminated_call() {
    let input = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beij";
    let out = parse_all_ways(G, &[], false, input);
    assert_eq!((out.text.as_str(), out.calls.len()), (input, 0));
    expect(
        G,
        &weather_tools(),
        true,
        input,
        "",
        &[("get_weather", json!({"city": "Beij"}))],
    );
}

#[test]
fn qwen_xml_tags_in_prose_are_text() {
    let input = "\n\nWrite <function=name> then <parameter=key> lines; <tool_call> wraps them.";
    expect(Q, &[], false, input, input, &[]);
    expect(Q, &[], true, input, input, &[]);
}
