//! Hermes (`<tool_call>` JSON, as Qwen 2.5/3's chat template asks), Llama 3.1 JSON (the
//! `llama3_json` template's bare object, `<|python_tag|>`) and Mistral (`[TOOL_CALLS]`, v3
//! array and v11 `name[ARGS]` forms).

use serde_json::json;

use super::{expect, parse_all_ways, run, weather_tools};
use crate::tool_calls::{ParserOptions, ToolCallFormat, ToolCallParser, ToolEvent};

const H: ToolCallFormat = ToolCallFormat::Hermes;

#[test]
fn hermes_call_with_text_before() {
    let input = "Let me check the weather.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";
    let out = expect(
        H,
        &[],
        false,
        input,
        "Let me check the weather.\n",
        &[("get_weather", json!({"city": "Paris", "days": 3}))],
    );
    // Without repair the arguments are passed on exactly as the model wrote them.
    assert_eq!(out.calls[0].1, r#"{"city": "Paris", "days": 3}"#);
}

#[test]
fn hermes_call_in_a_json_fence_as_small_qwen_coders_write_it() {
    let input = "I'll look it up.\n```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```";
    expect(
        H,
        &[],
        false,
        input,
        "I'll look it up.\n",
        &[("get_weather", json!({"city": "Paris"}))],
    );
}

#[test]
fn hermes_json_fence_that_is_not_a_call_stays_text() {
    let input = "Here is the data:\n```json\n{\"answer\": 42, \"name\": \"x\"}\n```\nDone.";
    expect(H, &[], false, input, input, &[]);
}

#[test]
fn hermes_parallel_calls_get_their_own_indices() {
    let input = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    expect(
        H,
        &[],
        false,
        input,
        "",
        &[
            ("get_weather", json!({"city": "Paris"})),
            ("get_weather", json!({"city": "Tokyo"})),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn hermes_closing_tag_and_braces_inside_string_arguments() {
    let input = r#"<tool_call>
{"name": "write_file", "arguments": {"path": "notes.md", "content": "End a call with </tool_call>; braces } { and \"quotes\" \\ stay.\n"}}
</tool_call>
After."#;
    expect(
        H,
        &[],
        false,
        input,
        "\nAfter.",
        &[(
            "write_file",
            json!({"path": "notes.md", "content": "End a call with </tool_call>; braces } { and \"quotes\" \\ stay.\n"}),
        )],
    );
}

#[test]
fn hermes_streams_name_before_arguments_and_arguments_in_pieces() {
    let mut p = ToolCallParser::new(H, &[], ParserOptions::default());
    let mut ev = p.push("Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci");
    assert_eq!(ev.remove(0), ToolEvent::Text("Sure.".into()));
    assert!(matches!(&ev[0], ToolEvent::CallStart { index: 0, name, .. } if name == "get_weather"));
    assert_eq!(
        ev[1],
        ToolEvent::CallArgs {
            index: 0,
            fragment: "{\"ci".into()
        }
    );
    let ev = p.push("ty\": \"Paris\"}}\n</tool_call>");
    assert_eq!(
        ev,
        vec![
            ToolEvent::CallArgs {
                index: 0,
                fragment: "ty\": \"Paris\"}".into()
            },
            ToolEvent::CallEnd { index: 0 },
        ]
    );
}

#[test]
fn hermes_text_is_released_as_soon_as_no_marker_can_start() {
    let mut p = ToolCallParser::new(H, &[], ParserOptions::default());
    assert_eq!(p.push("Hello <to"), vec![ToolEvent::Text("Hello ".into())]);
    assert_eq!(p.push("ad>"), vec![ToolEvent::Text("<toad>".into())]);
    assert_eq!(p.finish(), vec![]);
}

#[test]
fn hermes_arguments_given_as_a_json_string_are_unwrapped() {
    let input = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}\n</tool_call>";
    expect(
        H,
        &[],
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Paris"}))],
    );
}

#[test]
fn hermes_block_may_hold_qwen_xml() {
    let input = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
    expect(
        H,
        &weather_tools(),
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Paris"}))],
    );
}

#[test]
fn hermes_unterminated_call_is_text_without_repair_and_salvaged_with_it() {
    let input =
        "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par";
    expect(H, &[], false, input, input, &[]);
    expect(
        H,
        &[],
        true,
        input,
        "Checking.\n",
        &[("get_weather", json!({"city": "Par"}))],
    );
}

#[test]
fn hermes_unterminated_before_the_name_is_text_even_with_repair() {
    let input = "<tool_call>\n{\"na";
    expect(H, &[], true, input, input, &[]);
}

#[test]
fn hermes_closer_cutting_the_arguments_short() {
    let input =
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"</tool_call> ok";
    // Without repair the broken call stays text; repair closes it at the closer.
    let out = parse_all_ways(H, &[], false, input);
    assert_eq!((out.text.as_str(), out.calls.len()), (input, 0));
    expect(
        H,
        &[],
        true,
        input,
        " ok",
        &[("get_weather", json!({"city": "Paris"}))],
    );
}

#[test]
fn hermes_missing_outer_brace_still_closes_the_call() {
    let input = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}\n</tool_call>";
    expect(H, &[], false, input, "", &[("get_time", json!({}))]);
}

#[test]
fn hermes_plain_text_mentioning_the_tag() {
    let input = "Use <tool_call> tags like <tool_call>this</tool_call>.";
    expect(H, &[], false, input, input, &[]);
}

#[test]
fn hermes_openai_style_nested_function_object() {
    let input = r#"<tool_call>{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}</tool_call>"#;
    expect(
        H,
        &[],
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Oslo"}))],
    );
}

const L: ToolCallFormat = ToolCallFormat::Llama3Json;

#[test]
fn llama3_bare_json_call() {
    let input =
        r#"{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "metric": true}}"#;
    expect(
        L,
        &[],
        false,
        input,
        "",
        &[(
            "get_weather",
            json!({"city": "San Francisco, CA", "metric": true}),
        )],
    );
}

#[test]
fn llama3_python_tag_with_several_calls() {
    let input = r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}"#;
    expect(
        L,
        &[],
        false,
        input,
        "",
        &[
            ("get_weather", json!({"city": "Paris"})),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn llama3_json_answer_that_is_not_a_call_stays_text() {
    let input = "{\"answer\": 42, \"name\": \"x\"}";
    expect(L, &[], false, input, input, &[]);
    let input = "The JSON is {\"name\": \"get_time\", \"parameters\": {}}";
    expect(L, &[], false, input, input, &[]);
}

#[test]
fn llama3_call_then_text_after() {
    let input =
        "\n{\"name\": \"get_time\", \"parameters\": {\"tz\": \"UTC\"}}\n\nI asked for the time.";
    expect(
        L,
        &[],
        false,
        input,
        "\n\nI asked for the time.",
        &[("get_time", json!({"tz": "UTC"}))],
    );
}

const M: ToolCallFormat = ToolCallFormat::Mistral;

#[test]
fn mistral_v3_array_of_calls() {
    let input = r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, {"name": "get_time", "arguments": {}, "id": "f5g6h7i8j"}]"#;
    expect(
        M,
        &[],
        false,
        input,
        "",
        &[
            ("get_weather", json!({"city": "Paris"})),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn mistral_v11_name_args_calls() {
    let input = r#"I'll look both up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "note": "[ARGS] } in text"}[TOOL_CALLS]get_time[ARGS]{}"#;
    expect(
        M,
        &[],
        false,
        input,
        "I'll look both up.",
        &[
            (
                "get_weather",
                json!({"city": "Paris", "note": "[ARGS] } in text"}),
            ),
            ("get_time", json!({})),
        ],
    );
}

#[test]
fn mistral_call_id_between_name_and_args() {
    let input = r#"[TOOL_CALLS]get_weather[CALL_ID]Ab3De6Gh9[ARGS]{"city": "Rome"}"#;
    expect(
        M,
        &[],
        false,
        input,
        "",
        &[("get_weather", json!({"city": "Rome"}))],
    );
}

#[test]
fn mistral_args_cut_by_next_call() {
    let input = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"[TOOL_CALLS]get_time[ARGS]{}"#;
    expect(
        M,
        &[],
        true,
        input,
        "",
        &[
            ("get_weather", json!({"city": "Rome"})),
            ("get_time", json!({})),
        ],
    );
    let out = run(M, &[], false, [input]);
    assert_eq!(out.calls, vec![("get_time".to_string(), "{}".to_string())]);
}

#[test]
fn whitespace_between_calls_is_dropped_but_kept_around_text() {
    let call = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let input = format!("\n\n{call}\n\n{call}\n");
    expect(
        H,
        &[],
        false,
        &input,
        "",
        &[("get_time", json!({})), ("get_time", json!({}))],
    );
    let input = format!("\n\n{call}\n\nThen: {call}\n");
    expect(
        H,
        &[],
        false,
        &input,
        "\n\nThen: ",
        &[("get_time", json!({})), ("get_time", json!({}))],
    );
    // A marker that turns out not to be a call keeps the whitespace before it.
    expect(
        H,
        &[],
        false,
        "\n\n<tool_call> is a tag",
        "\n\n<tool_call> is a tag",
        &[],
    );
}

#[test]
fn mistral_second_marker_inside_a_name_gives_the_same_result_in_any_chunking() {
    // fuzz/seeds/tool_calls/regress_mistral_abandon: `[TOOL_CALLS]` inside a JSON string, then broken
    // calls; it used to parse as a call whole and as text in pieces. No call is well formed.
    let input = "[TOOL_CALLS];[{\"n[TOOL_CALLS]\u{fffd}\"[TOOL_CALLS][{][";
    let out = parse_all_ways(M, &weather_tools(), false, input);
    assert_eq!(out.text, input);
    assert!(out.calls.is_empty(), "{out:?}");
}

#[test]
fn mistral_marker_inside_string_arguments_cuts_the_call() {
    // The marker is a control token: it opens the next call even inside a string.
    let input = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Ro[TOOL_CALLS]get_time[ARGS]{}"#;
    expect(
        M,
        &[],
        false,
        input,
        r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Ro"#,
        &[("get_time", json!({}))],
    );
}

#[test]
fn an_abandoned_call_holding_another_opener_parses_the_same_in_any_chunking() {
    // fuzz/seeds/tool_calls/regress_hermes_abandon: a broken call whose arguments hold a second
    // `<tool_call>`. Whole, the body gave up before consuming it and the second call parsed;
    // in pieces it had consumed it, and everything came out as text.
    let input =
        "\u{0}ur\u{0}\u{1}S\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{0}\u{4}S\u{fffd}ure.\
                 <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"cnts\"\u{4}Sure.\
                 <tool_call>\n{\"name\": \"ge\",!\u{fffd}\u{13};\u{1}> doneall>\n\
                 {\"name\": \"getys\": 2}}\n</tool_call> d";
    let out = parse_all_ways(ToolCallFormat::Hermes, &weather_tools(), false, input);
    assert_eq!(out.calls, vec![("ge".to_string(), "{}".to_string())]);
}
