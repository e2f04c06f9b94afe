//! Output cut off at every point, with characters dropped, or read with the wrong format:
//! the parser never panics, chunking never changes the result, and the event stream stays
//! well formed (checked inside `run`).

use serde_json::json;

use super::{cuts, expect, run, split_at_cuts, weather_tools};
use crate::tool_calls::ToolCallFormat as F;

const SAMPLES: &[(F, &str)] = &[
    (F::Hermes, "Hi.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris</tool_call>\", \"days\": 3}}\n</tool_call>\nBye."),
    (F::Llama3Json, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {}}"),
    (F::Mistral, "Ok.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"days\": 2}[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}]"),
    (F::QwenXml, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa</parameter>ris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    (F::Gemma, "<|tool_call>call:get_weather{city:<|\"|>Pa}ris<|\"|>,days:3,x:[1,{a:<|\"|>]<|\"|>}]}<tool_call|>Done"),
    (F::Gemma, "```tool_code\nprint(get_weather(city='Paris', days=2))\n```"),
    (F::Glm4, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
    (F::KimiK2, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>"),
    (F::MinimaxM2, "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n</minimax:tool_call>"),
    (F::DeepSeekV3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    (F::DeepSeekV4Dsml, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
];

const ALL: [F; 11] = [
    F::Hermes,
    F::Llama3Json,
    F::Mistral,
    F::QwenXml,
    F::Gemma,
    F::Glm4,
    F::KimiK2,
    F::MinimaxM2,
    F::DeepSeekV3,
    F::DeepSeekV4Dsml,
    F::None,
];

fn agree(format: F, fix: bool, input: &str) {
    let tools = weather_tools();
    let whole = run(format, &tools, fix, [input]);
    let by_char = run(format, &tools, fix, split_at_cuts(input, &cuts(input)));
    assert_eq!(whole, by_char, "{format:?} fix={fix} on {input:?}");
}

#[test]
fn output_cut_off_anywhere() {
    for (format, sample) in SAMPLES {
        for (at, _) in sample.char_indices() {
            for fix in [false, true] {
                agree(*format, fix, &sample[..at]);
            }
        }
    }
}

#[test]
fn output_with_a_character_missing() {
    for (format, sample) in SAMPLES {
        for (at, c) in sample.char_indices() {
            let mutated = format!("{}{}", &sample[..at], &sample[at + c.len_utf8()..]);
            agree(*format, at % 2 == 0, &mutated);
        }
    }
}

#[test]
fn any_output_in_any_format() {
    for (_, sample) in SAMPLES {
        for format in ALL {
            for fix in [false, true] {
                agree(format, fix, sample);
            }
        }
    }
}

/// Each format's call cut off inside a string argument: text without repair; with repair,
/// a call with the string closed.
#[test]
fn unterminated_call_in_every_format() {
    let cases: &[(F, &str)] = &[
        (F::Hermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"),
        (F::Llama3Json, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Par"),
        (F::Mistral, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Par"),
        (F::Mistral, "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"),
        (F::QwenXml, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
        (F::Gemma, "<|tool_call>call:get_weather{city:<|\"|>Par"),
        (F::Glm4, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
        (F::KimiK2, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Par"),
        (F::MinimaxM2, "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Par"),
        (F::DeepSeekV3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Par"),
        (F::DeepSeekV4Dsml, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Par"),
    ];
    for (format, input) in cases {
        // Llama's bare `{` is a call only at the start of the output.
        let before = if *format == F::Llama3Json {
            ""
        } else {
            "Checking.\n"
        };
        let text = format!("{before}{input}");
        expect(*format, &weather_tools(), false, &text, &text, &[]);
        let call = ("get_weather", json!({"city": "Par"}));
        expect(*format, &weather_tools(), true, &text, before, &[call]);
    }
}
