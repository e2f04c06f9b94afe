//! Format selection (`--tool-call-parser` names, detection from `model_type` and the chat
//! template) and the `none` format.

use super::expect;
use crate::tool_calls::ToolCallFormat as F;

#[test]
fn parser_names_map_to_formats() {
    let table = [
        ("hermes", F::Hermes),
        ("json", F::Hermes),
        ("llama3_json", F::Llama3Json),
        ("mistral", F::Mistral),
        ("qwen3_xml", F::QwenXml),
        ("xml_function", F::QwenXml),
        ("afm_adaptive_xml", F::QwenXml),
        ("gemma", F::Gemma),
        ("gemma4", F::Gemma),
        ("glm4", F::Glm4),
        ("kimi_k2", F::KimiK2),
        ("minimax_m2", F::MinimaxM2),
        ("deepseek_v3", F::DeepSeekV3),
        ("deepseek_v4", F::DeepSeekV4Dsml),
        ("none", F::None),
        (" Hermes ", F::Hermes),
    ];
    for (name, f) in table {
        assert_eq!(F::from_name(name), Some(f), "{name}");
        assert_eq!(F::from_name(f.name()), Some(f));
    }
    assert_eq!(F::from_name("pythonic"), None);
}

#[test]
fn template_markers_beat_model_type() {
    // Qwen3-Coder reports qwen3_moe but its template shows XML calls.
    let coder = "{%- if tools %}<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>{% endif %}";
    assert_eq!(F::detect("qwen3_moe", Some(coder)), F::QwenXml);
    let qwen3 = "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    assert_eq!(F::detect("qwen3_moe", Some(qwen3)), F::Hermes);
    let glm = "<tool_call>{{ tc.name }}\n{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>\n{% endfor %}</tool_call>";
    assert_eq!(F::detect("glm4_moe", Some(glm)), F::Glm4);
    let kimi = "<|tool_calls_section_begin|>{% for tc in tool_calls %}<|tool_call_begin|>";
    assert_eq!(F::detect("kimi_k2", Some(kimi)), F::KimiK2);
    let ds = "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>";
    assert_eq!(F::detect("deepseek_v3", Some(ds)), F::DeepSeekV3);
    let mistral = "{%- if message.tool_calls %}[TOOL_CALLS]{{ tc.name }}[ARGS]{{ tc.arguments }}";
    assert_eq!(F::detect("mistral3", Some(mistral)), F::Mistral);
    let gemma4 = "<|tool_call>call:{{ name }}{<tool_call|>";
    assert_eq!(F::detect("gemma4", Some(gemma4)), F::Gemma);
}

#[test]
fn model_type_decides_without_markers() {
    let table = [
        ("qwen2", F::Hermes),
        ("qwen3", F::Hermes),
        ("qwen3_5_moe", F::QwenXml),
        ("qwen3_next", F::QwenXml),
        ("llama", F::Llama3Json),
        ("mistral", F::Mistral),
        ("gemma3_text", F::Gemma),
        ("gemma4", F::Gemma),
        ("glm4_moe", F::Glm4),
        ("kimi_k2", F::KimiK2),
        ("minimax_m2", F::MinimaxM2),
        ("deepseek_v3", F::DeepSeekV3),
        ("deepseek_v4", F::DeepSeekV4Dsml),
        ("something_new", F::Hermes),
    ];
    for (mt, f) in table {
        assert_eq!(F::detect(mt, Some("{{ messages }}")), f, "{mt}");
        assert_eq!(F::detect(mt, None), f, "{mt}");
    }
}

#[test]
fn none_format_is_all_text() {
    let input = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    expect(F::None, &[], false, input, input, &[]);
}

#[test]
fn text_only_output_is_unchanged_in_every_format() {
    let input = "  Plain answer: 3 < 4, {braces} [brackets] and `code`.\n";
    for f in [
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
    ] {
        expect(f, &[], false, input, input, &[]);
    }
}

#[test]
fn parser_can_move_between_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<crate::tool_calls::ToolCallParser>();
}
