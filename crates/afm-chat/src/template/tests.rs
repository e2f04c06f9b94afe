//! Template unit tests: helpers, sandbox limits, fallback.
use super::*;
use serde_json::json;

fn render(src: &str, messages: Json) -> Result<String, ChatError> {
    let t = ChatTemplate::from_source(src, "<s>", "</s>")?;
    t.render(messages.as_array().expect("array"), None, true, &Map::new())
}

#[test]
fn fallback_format() {
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
    let out = ChatTemplate::fallback()
        .render(msgs.as_array().unwrap(), None, true, &Map::new())
        .unwrap();
    assert_eq!(
        out,
        "Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: a\nb\n\nAssistant:"
    );
}

#[test]
fn raise_exception_is_reported() {
    let err = render("{{ raise_exception('no system role') }}", json!([])).unwrap_err();
    assert!(
        matches!(err, ChatError::TemplateRaised(ref m) if m == "no system role"),
        "{err}"
    );
}

#[test]
fn infinite_loop_runs_out_of_fuel_quickly() {
    let start = std::time::Instant::now();
    let err = render(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        json!([]),
    )
    .unwrap_err();
    assert!(matches!(err, ChatError::Template(_)), "{err}");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn huge_output_is_cut_off() {
    let t = ChatTemplate::with_limits(
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "",
        "",
        RenderLimits {
            max_output_bytes: 1 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let err = t.render(&[], None, false, &Map::new()).unwrap_err();
    assert!(
        matches!(err, ChatError::TemplateOutputTooLarge { limit } if limit == 1 << 20),
        "{err}"
    );
}

#[test]
fn deep_recursion_errors() {
    let err = render(
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        json!([]),
    )
    .unwrap_err();
    assert!(matches!(err, ChatError::Template(_)), "{err}");
}

#[test]
fn python_string_methods_and_namespace() {
    let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.content.strip().upper() }}|{{ m.content.split(',') | length }}|{{ m.content.startswith(' a') }}{% if loop.index == 1 %}{% continue %}{% endif %}{% break %}{% endfor %}={{ ns.n }}";
    let out = render(src, json!([{"role": "user", "content": " a,b "}, {"role": "user", "content": "c"}, {"role": "user", "content": "d"}])).unwrap();
    assert_eq!(out, "A,B|2|TrueC|1|False=2");
}

#[test]
fn kwargs_reach_the_template_but_cannot_override() {
    let t = ChatTemplate::from_source("{{ enable_thinking }} {{ add_generation_prompt }}", "", "")
        .unwrap();
    let kw: Map<String, Json> = [
        ("enable_thinking".to_string(), json!(false)),
        ("add_generation_prompt".to_string(), json!("x")),
    ]
    .into_iter()
    .collect();
    assert_eq!(t.render(&[], None, true, &kw).unwrap(), "False True");
}

#[test]
fn tool_call_arguments_become_objects() {
    let src = "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}";
    let msgs = json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1, \"y\": [true, null]}"}}]}]);
    assert_eq!(render(src, msgs).unwrap(), r#"{"x": 1, "y": [true, null]}"#);
}

#[test]
fn python_style_scalars() {
    let src = "{{ none }}|{{ true }}|{{ 1.0 }}|{{ 2.5e-7 }}|{{ 1e20 }}|{{ [1, 'a', none, 1.5] }}|{{ {'k': none} }}|{{ undefined_var }}|{{ [\"it's\", 'tab\\t', '\\u200b'] }}";
    let out = render(src, json!([])).unwrap();
    assert_eq!(out, "None|True|1.0|2.5e-07|1e+20|[1, 'a', None, 1.5]|{'k': None}||[\"it's\", 'tab\\t', '\\u200b']");
}
