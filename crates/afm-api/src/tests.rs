//! Validation behaviour a client would notice: defaults, ranges and their messages.

use serde_json::json;

use crate::*;

fn model() -> ModelInfo {
    ModelInfo {
        id: "SmolLM2-135M-Instruct".into(),
        aliases: vec!["models/SmolLM2-135M-Instruct.Q4_1.gguf".into()],
        vocab_size: 1000,
    }
}

fn chat(body: serde_json::Value) -> Result<ValidChatRequest, ApiError> {
    let req = ChatCompletionRequest::parse(body.to_string().as_bytes())?;
    validate_chat(req, &RequestDefaults::default(), &model())
}

fn hi() -> serde_json::Value {
    json!([{"role": "user", "content": "hi"}])
}

#[test]
fn defaults_apply_when_silent() {
    let v = chat(json!({"messages": hi()})).unwrap();
    let g = &v.generation;
    assert_eq!(g.max_tokens, 8192);
    assert_eq!(g.n, 1);
    assert!(!g.stream);
    assert!(g.include_usage);
    assert_eq!(g.sampling.temperature, 1.0);
    assert_eq!(g.logprobs, None);
    assert_eq!(v.messages, vec![json!({"role": "user", "content": "hi"})]);
}

#[test]
fn server_flags_are_defaults_and_requests_override() {
    let flags = SamplingFields {
        temperature: Some(0.0),
        max_tokens: Some(64),
        stop: Some(StopField::One("END".into())),
        ..Default::default()
    };
    let defaults = RequestDefaults::default().with_flags(&flags).unwrap();
    let body = json!({"messages": hi(), "temperature": 0.5}).to_string();
    let req = ChatCompletionRequest::parse(body.as_bytes()).unwrap();
    let v = validate_chat(req, &defaults, &model()).unwrap();
    assert_eq!(v.generation.sampling.temperature, 0.5);
    assert_eq!(v.generation.max_tokens, 64);
    assert_eq!(v.generation.stop, vec!["END".to_string()]);
    let bad = SamplingFields {
        top_p: Some(0.0),
        ..Default::default()
    };
    assert!(RequestDefaults::default().with_flags(&bad).is_err());
}

#[test]
fn ranges_are_checked_with_named_limits() {
    let cases = [
        (json!({"temperature": -0.1}), "temperature", "[0, 2]"),
        (json!({"temperature": 2.5}), "temperature", "[0, 2]"),
        (json!({"top_p": 0.0}), "top_p", "(0, 1]"),
        (json!({"top_p": 1.5}), "top_p", "(0, 1]"),
        (json!({"max_tokens": 0}), "max_tokens", "at least 1"),
        (
            json!({"max_completion_tokens": -3}),
            "max_tokens",
            "at least 1",
        ),
        (json!({"n": 9}), "n", "between 1 and 8"),
        (json!({"n": 0}), "n", "between 1 and 8"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "between 0 and 20",
        ),
        (
            json!({"logit_bias": {"5000": 1}}),
            "logit_bias",
            "size 1000",
        ),
        (
            json!({"logit_bias": {"5": 101}}),
            "logit_bias",
            "[-100, 100]",
        ),
        (
            json!({"presence_penalty": 3}),
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            json!({"reasoning_effort": "extreme"}),
            "reasoning_effort",
            "none, minimal",
        ),
    ];
    for (extra, param, limit) in cases {
        let mut body = json!({"messages": hi()});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let err = chat(body.clone()).unwrap_err();
        assert_eq!(err.status(), 400, "{body}");
        let e = err.body().error;
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        assert!(e.message.contains(limit), "{body}: {}", e.message);
    }
}

#[test]
fn empty_messages_and_wrong_types_are_400() {
    let err = chat(json!({"messages": []})).unwrap_err();
    assert_eq!(
        (err.status(), err.body().error.param.as_deref()),
        (400, Some("messages"))
    );
    let err = chat(json!({"messages": hi(), "temperature": "hot"})).unwrap_err();
    assert_eq!(err.status(), 400);
    assert!(err.to_string().contains("temperature"), "{err}");
    let err = chat(json!({"messages": [{"role": "wizard", "content": "x"}]})).unwrap_err();
    assert!(err.to_string().contains("messages[0].role"), "{err}");
    let err = chat(json!({"messages": hi(), "n": 1.5})).unwrap_err();
    assert!(err.to_string().contains("`n`"), "{err}");
}

#[test]
fn model_names() {
    let m = model();
    for ok in [
        None,
        Some(""),
        Some("SmolLM2-135M-Instruct"),
        Some("smollm2-135m-instruct"),
    ] {
        assert!(m.check(ok).is_ok(), "{ok:?}");
    }
    assert!(m.check(Some("SmolLM2-135M-Instruct.Q4_1.gguf")).is_ok());
    let err = m.check(Some("gpt-4o")).unwrap_err();
    assert_eq!(err.status(), 404);
    assert_eq!(err.body().error.code.as_deref(), Some("model_not_found"));
}

#[test]
fn messages_are_normalized_for_templates() {
    let v = chat(json!({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]}))
    .unwrap();
    assert_eq!(
        v.messages[0],
        json!({"role": "system", "content": "be\nbrief"})
    );
    assert_eq!(
        v.messages[1]["tool_calls"][0]["function"]["arguments"],
        json!({"x": 1})
    );
    assert_eq!(v.messages[1]["content"], json!(""));
    assert_eq!(v.messages[2]["tool_call_id"], json!("c1"));
    let err = chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
        .unwrap_err();
    assert!(err.to_string().contains("only text"), "{err}");
    let err = chat(json!({"messages": [{"role": "user"}]})).unwrap_err();
    assert_eq!(
        err.body().error.param.as_deref(),
        Some("messages[0].content")
    );
}

#[test]
fn reasoning_policy_merges_and_explicit_false_wins() {
    let v = chat(json!({"messages": hi(), "reasoning_effort": "high"})).unwrap();
    assert_eq!(v.template_kwargs["enable_thinking"], json!(true));
    assert_eq!(v.template_kwargs["reasoning_effort"], json!("high"));
    let v = chat(json!({"messages": hi(), "reasoning_effort": "high",
        "chat_template_kwargs": {"enable_thinking": false}}))
    .unwrap();
    assert_eq!(v.template_kwargs["enable_thinking"], json!(false));
    let mut defaults = RequestDefaults::default();
    defaults
        .template_kwargs
        .insert("enable_thinking".into(), json!(false));
    let req =
        ChatCompletionRequest::parse(json!({"messages": hi()}).to_string().as_bytes()).unwrap();
    let v = validate_chat(req, &defaults, &model()).unwrap();
    assert_eq!(v.template_kwargs["enable_thinking"], json!(false));
}

#[test]
fn strict_without_grammar_is_downgraded() {
    let v = chat(
        json!({"messages": hi(), "response_format": {"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}),
    )
    .unwrap();
    assert!(v.grammar_downgraded);
    let v = chat(json!({"messages": hi(), "response_format": {"type": "json_object"}})).unwrap();
    assert!(!v.grammar_downgraded);
    let tools = json!([{"type": "function", "function": {"name": "f", "strict": true}}]);
    let v = chat(json!({"messages": hi(), "tools": tools, "tool_choice": "none"})).unwrap();
    assert!(v.tools.is_none());
    assert!(v.grammar_downgraded);
}

#[test]
fn stop_logprobs_seed_and_aliases() {
    let v = chat(
        json!({"messages": hi(), "stop": ["a", "b"], "logprobs": true, "top_logprobs": 3,
        "seed": 7, "repeat_penalty": 1.1, "top_k": -1}),
    )
    .unwrap();
    let g = v.generation;
    assert_eq!(g.stop, vec!["a", "b"]);
    assert_eq!(g.logprobs, Some(3));
    assert_eq!(g.sampling.seed, Some(7));
    assert!((g.sampling.repetition_penalty - 1.1).abs() < 1e-6);
    assert_eq!(g.sampling.top_k, 0);
    let err = chat(json!({"messages": hi(), "top_logprobs": 2})).unwrap_err();
    assert!(err.to_string().contains("logprobs = true"));
}

#[test]
fn completion_prompts() {
    let parse = |b: serde_json::Value| {
        let req = CompletionRequest::parse(b.to_string().as_bytes())?;
        validate_completion(req, &RequestDefaults::default(), &model())
    };
    let v = parse(json!({"prompt": "Once"})).unwrap();
    assert_eq!(v.prompts, vec![ValidPrompt::Text("Once".into())]);
    let v = parse(json!({"prompt": [1, 2, 3]})).unwrap();
    assert_eq!(v.prompts, vec![ValidPrompt::Tokens(vec![1, 2, 3])]);
    let v = parse(json!({"prompt": ["a", "b"], "n": 2})).unwrap();
    assert_eq!(v.prompts.len(), 2);
    assert!(parse(json!({"prompt": ["a", "b", "c"], "n": 3})).is_err());
    assert!(parse(json!({"prompt": [5000]}))
        .unwrap_err()
        .to_string()
        .contains("vocabulary"));
    assert!(parse(json!({"prompt": "x", "echo": true, "logprobs": 1})).is_err());
    assert!(parse(json!({"prompt": ""})).is_err());
}
