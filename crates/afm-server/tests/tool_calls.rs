//! Tool calls through /v1/chat/completions against a live server with the scripted fake engine
//! (its tool-call scripts are listed in `afm_server::testing`): `message.tool_calls` and
//! streamed `delta.tool_calls`, text around calls, a closing tag inside a string argument,
//! `parallel_tool_calls`, `tool_choice: "none"`, a forced dialect, repair, reasoning, and the
//! history round trip through Qwen2.5's real chat template as transformers rendered it.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use afm_api::ModelInfo;
use afm_chat::tool_calls::ToolCallFormat;
use afm_chat::ChatTemplate;
use afm_server::testing::{FakeGenerator, FakeText};
use afm_server::text_model::ChatText;
use afm_server::tool_calls::ToolCallConfig;
use afm_server::{AppState, Detokenizer, ServedModel, ServerConfig, TextModel};
use common::*;
use serde_json::{json, Map, Value};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"tz": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "echo", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}}}}
    ])
}

fn ask(marker: &str) -> Value {
    json!({"messages": user(marker), "tools": tools(), "temperature": 0})
}

fn args(call: &Value) -> Value {
    let text = call["function"]["arguments"]
        .as_str()
        .expect("arguments is a string");
    serde_json::from_str(text).expect("arguments are JSON")
}

/// Chunks of a streamed answer (without `[DONE]`).
async fn chunks(s: &TestServer, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let data = s.stream("/v1/chat/completions", &body).await;
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk is JSON"))
        .collect()
}

/// What a client rebuilds from a stream: the content, the calls by index, the finish reasons.
struct Streamed {
    content: String,
    calls: Vec<Value>,
    finishes: Vec<String>,
    /// `c` for a content delta, `t` for a tool-call delta, in order.
    order: String,
}

fn reassemble(chunks: &[Value]) -> Streamed {
    let mut out = Streamed {
        content: String::new(),
        calls: Vec::new(),
        finishes: Vec::new(),
        order: String::new(),
    };
    for choice in chunks.iter().filter_map(|c| c["choices"].get(0)) {
        let delta = &choice["delta"];
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            out.content.push_str(text);
            out.order.push('c');
        }
        for d in delta["tool_calls"].as_array().into_iter().flatten() {
            out.order.push('t');
            let i = d["index"]
                .as_u64()
                .expect("every tool-call delta has an index") as usize;
            if i == out.calls.len() {
                // The first chunk of a call: id, type, name and empty arguments.
                assert!(d["id"].as_str().unwrap().starts_with("call_"), "{d}");
                assert_eq!(d["type"], "function", "{d}");
                assert!(d["function"]["name"].is_string(), "{d}");
                assert_eq!(d["function"]["arguments"], "", "{d}");
                out.calls.push(d.clone());
            } else {
                assert!(i < out.calls.len(), "index {i} skips one: {d}");
                // Later chunks: the index and an argument fragment only.
                let mut keys: Vec<&String> = d.as_object().unwrap().keys().collect();
                keys.sort();
                assert_eq!(keys, ["function", "index"], "{d}");
                let frag = d["function"]["arguments"].as_str().unwrap();
                let call = &mut out.calls[i]["function"]["arguments"];
                *call = json!(format!("{}{frag}", call.as_str().unwrap()));
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            out.finishes.push(f.to_string());
        }
    }
    out
}

#[tokio::test]
async fn one_call_non_streamed() {
    let s = start().await;
    let (status, body) = s.post("/v1/chat/completions", &ask("[tool]")).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["content"], Value::Null, "{message}");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(args(&calls[0]), json!({"city": "Paris"}));
}

#[tokio::test]
async fn one_call_streamed() {
    let s = start().await;
    let chunks = chunks(&s, ask("[tool]")).await;
    let out = reassemble(&chunks);
    assert_eq!(out.content, "");
    assert_eq!(out.calls.len(), 1);
    assert_eq!(out.calls[0]["function"]["name"], "get_weather");
    assert_eq!(args(&out.calls[0]), json!({"city": "Paris"}));
    assert_eq!(out.finishes, ["tool_calls"]);
    // The call's syntax never leaks into content.
    assert!(!serde_json::to_string(&chunks)
        .unwrap()
        .contains("<tool_call>"));
}

#[tokio::test]
async fn several_calls_with_text_before_and_after() {
    let s = start().await;
    let (_, body) = s.post("/v1/chat/completions", &ask("[tools]")).await;
    let message = &body["choices"][0]["message"];
    let content = message["content"].as_str().unwrap();
    assert!(content.starts_with("Checking both."), "{content:?}");
    assert!(content.trim_end().ends_with("One moment."), "{content:?}");
    assert!(!content.contains("tool_call"), "{content:?}");
    let calls = message["tool_calls"].as_array().unwrap();
    let names: Vec<&str> = calls
        .iter()
        .map(|c| c["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["get_weather", "get_time"]);
    assert_eq!(args(&calls[1]), json!({"tz": "Europe/Paris"}));
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");

    let out = reassemble(&chunks(&s, ask("[tools]")).await);
    assert_eq!(out.content, content);
    assert_eq!(out.calls.len(), 2);
    assert_eq!(args(&out.calls[0]), json!({"city": "Paris"}));
    assert_eq!(args(&out.calls[1]), json!({"tz": "Europe/Paris"}));
    // Text before the calls comes before them in the stream, text after them after.
    let order = out.order;
    assert!(order.starts_with('c') && order.ends_with('c'), "{order}");
    assert_eq!(
        order
            .trim_matches('c')
            .chars()
            .filter(|&c| c == 'c')
            .count(),
        0
    );
    assert_eq!(out.finishes, ["tool_calls"]);
}

#[tokio::test]
async fn closing_tag_inside_a_string_argument_does_not_end_the_call() {
    let s = start().await;
    let (_, body) = s.post("/v1/chat/completions", &ask("[tool-tag]")).await;
    let calls = &body["choices"][0]["message"]["tool_calls"];
    assert_eq!(args(&calls[0]), json!({"text": "a </tool_call> b"}));
    assert_eq!(body["choices"][0]["message"]["content"], Value::Null);

    let out = reassemble(&chunks(&s, ask("[tool-tag]")).await);
    assert_eq!(args(&out.calls[0]), json!({"text": "a </tool_call> b"}));
    assert_eq!(out.content, "");
}

#[tokio::test]
async fn parallel_tool_calls_false_keeps_the_first_call() {
    let s = start().await;
    let mut req = ask("[tools]");
    req["parallel_tool_calls"] = json!(false);
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    let calls = body["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["function"]["name"], "get_weather");

    let out = reassemble(&chunks(&s, req).await);
    assert_eq!(out.calls.len(), 1);
    assert_eq!(out.calls[0]["function"]["name"], "get_weather");
    assert_eq!(out.finishes, ["tool_calls"]);
}

#[tokio::test]
async fn tool_choice_none_or_no_tools_leaves_the_text_alone() {
    let s = start().await;
    let mut none = ask("[tool]");
    none["tool_choice"] = json!("none");
    let no_tools = json!({"messages": user("[tool]"), "temperature": 0});
    for req in [none, no_tools] {
        let (_, body) = s.post("/v1/chat/completions", &req).await;
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "stop");
        assert!(choice["message"].get("tool_calls").is_none(), "{choice}");
        let content = choice["message"]["content"].as_str().unwrap();
        assert!(content.starts_with("<tool_call>"), "{content}");

        let out = reassemble(&chunks(&s, req).await);
        assert_eq!(out.content, content);
        assert!(out.calls.is_empty());
        assert_eq!(out.finishes, ["stop"]);
    }
}

#[tokio::test]
async fn forced_qwen_xml_dialect_types_values_by_schema() {
    let s = start_with(ServerConfig {
        tool_calls: ToolCallConfig {
            format: Some(ToolCallFormat::QwenXml),
            ..ToolCallConfig::default()
        },
        ..ServerConfig::default()
    })
    .await;
    let (_, body) = s.post("/v1/chat/completions", &ask("[tool-xml]")).await;
    let calls = &body["choices"][0]["message"]["tool_calls"];
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    // `days` is an integer in the tool's schema, so `3` is a number, not "3".
    assert_eq!(args(&calls[0]), json!({"city": "Paris", "days": 3}));
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");

    let out = reassemble(&chunks(&s, ask("[tool-xml]")).await);
    assert_eq!(args(&out.calls[0]), json!({"city": "Paris", "days": 3}));
    assert_eq!(out.finishes, ["tool_calls"]);
}

#[tokio::test]
async fn fix_tool_args_repairs_malformed_arguments() {
    let config = |fix_args| ServerConfig {
        tool_calls: ToolCallConfig {
            fix_args,
            ..ToolCallConfig::default()
        },
        ..ServerConfig::default()
    };
    let s = start_with(config(true)).await;
    let (_, body) = s.post("/v1/chat/completions", &ask("[tool-fix]")).await;
    let calls = &body["choices"][0]["message"]["tool_calls"];
    // Trailing comma dropped, "3" coerced to the schema's integer.
    assert_eq!(args(&calls[0]), json!({"city": "Paris", "days": 3}));
    let out = reassemble(&chunks(&s, ask("[tool-fix]")).await);
    assert_eq!(args(&out.calls[0]), json!({"city": "Paris", "days": 3}));

    // Without repair the model's text is passed on as it was written.
    let s = start_with(config(false)).await;
    let (_, body) = s.post("/v1/chat/completions", &ask("[tool-fix]")).await;
    let raw = &body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"];
    assert!(raw.as_str().unwrap().contains("\"3\","), "{raw}");
}

#[tokio::test]
async fn calls_are_parsed_from_content_not_from_reasoning() {
    let s = start().await;
    let (_, body) = s.post("/v1/chat/completions", &ask("[think-tool]")).await;
    let message = &body["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().unwrap();
    assert!(reasoning.contains("<tool_call>"), "{reasoning}");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(message["content"], Value::Null);

    let chunks = chunks(&s, ask("[think-tool]")).await;
    let streamed_reasoning: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(streamed_reasoning, reasoning);
    let out = reassemble(&chunks);
    assert_eq!(out.calls.len(), 1);
    assert_eq!(out.finishes, ["tool_calls"]);
}

#[tokio::test]
async fn every_choice_parses_its_own_calls() {
    let s = start().await;
    let mut req = ask("[tools]");
    req["n"] = json!(2);
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    for choice in body["choices"].as_array().unwrap() {
        assert_eq!(choice["message"]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(choice["finish_reason"], "tool_calls");
    }
}

/// Qwen2.5's own chat template over the fake's byte tokens.
struct QwenTemplateText(ChatTemplate);

impl TextModel for QwenTemplateText {
    fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, String> {
        self.0
            .render(messages, tools, add_generation_prompt, kwargs)
            .map_err(|e| e.to_string())
    }
    fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        FakeText.encode(text, add_special)
    }
    fn decode(&self, ids: &[u32]) -> String {
        FakeText.decode(ids)
    }
    fn detokenizer(&self) -> Box<dyn Detokenizer> {
        FakeText.detokenizer()
    }
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        FakeText.token_bytes(id)
    }
    fn stop_token_ids(&self) -> Vec<u32> {
        FakeText.stop_token_ids()
    }
    fn vocab_size(&self) -> usize {
        FakeText.vocab_size()
    }
    fn tool_call_format(&self) -> ToolCallFormat {
        ToolCallFormat::detect("qwen2", Some(self.0.source()))
    }
}

/// transformers' renderings of Qwen2.5's template (afm-chat's fixture).
fn recorded_templates() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../afm-chat/tests/fixtures/templates.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture exists")).expect("JSON")
}

async fn start_qwen_template() -> (TestServer, Value) {
    let f = recorded_templates();
    let src = f["templates"]["qwen25"].as_str().expect("qwen25 template");
    let template = ChatTemplate::from_source(src, "", "<|im_end|>").expect("template parses");
    let fake = FakeGenerator::new();
    let model = ServedModel {
        info: ModelInfo {
            id: "fake-model".into(),
            aliases: Vec::new(),
            vocab_size: 259,
        },
        text: Arc::new(QwenTemplateText(template)),
        generator: Arc::new(fake.clone()),
    };
    let state = AppState::new(model, ServerConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let st = state.clone();
    tokio::spawn(async move { afm_server::serve(listener, st, std::future::pending()).await });
    let server = TestServer {
        base,
        fake,
        state,
        client: reqwest::Client::new(),
    };
    (server, f)
}

/// The prompt the server renders for `body` (messages, tools), as text.
async fn rendered(s: &TestServer, mut body: Value) -> String {
    body["return_token_strs"] = json!(false);
    let (status, resp) = s.post("/v1/tokenize", &body).await;
    assert_eq!(status, 200, "{resp}");
    let ids: Vec<u32> = resp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    FakeText.decode(&ids)
}

#[tokio::test]
async fn history_with_calls_and_results_renders_as_transformers_does() {
    let (s, f) = start_qwen_template().await;
    let mut checked = 0;
    for case in f["cases"].as_array().unwrap() {
        let has_calls = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m.get("tool_calls").is_some());
        if case["template"] != "qwen25" || !has_calls {
            continue;
        }
        let body = json!({
            "messages": case["messages"], "tools": case["tools"],
            "add_generation_prompt": case["add_generation_prompt"],
        });
        assert_eq!(rendered(&s, body).await, case["output"], "{}", case["case"]);
        checked += 1;
    }
    assert!(checked >= 2, "the fixture holds tool-call histories");
}

#[tokio::test]
async fn an_answer_with_calls_goes_back_into_the_history_as_the_model_wrote_it() {
    let (s, _) = start_qwen_template().await;
    let first = json!([{"role": "user", "content": "[tool] Weather in Paris?"}]);
    let (_, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": first, "tools": tools(), "temperature": 0}),
        )
        .await;
    let message = body["choices"][0]["message"].clone();
    let id = message["tool_calls"][0]["id"].clone();
    let mut history = first.as_array().unwrap().clone();
    history.push(message);
    history.push(json!({"role": "tool", "tool_call_id": id, "content": "{\"temp\": 21}"}));
    let prompt = rendered(&s, json!({"messages": history, "tools": tools()})).await;
    let turn = "<|im_start|>assistant\n<tool_call>\n\
                {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
                </tool_call><|im_end|>\n\
                <|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n\
                <|im_start|>assistant\n";
    assert!(prompt.ends_with(turn), "{prompt}");
}

#[test]
fn the_real_text_model_detects_the_dialect_from_template_then_model_type() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny/qwen3/model-f32.gguf");
    let model = afm_models::load_model(&afm_models::source::ModelLocation::Gguf(path))
        .expect("tiny fixture loads");
    let gguf = model.gguf().expect("a GGUF model");
    let tokenizer = || afm_chat::Tokenizer::from_gguf(gguf).expect("tiny tokenizer");
    // No call example in the fallback template: the model type decides.
    let plain = ChatText::new(tokenizer(), ChatTemplate::fallback());
    assert_eq!(plain.tool_call_format(), ToolCallFormat::Hermes);
    let coder = ChatText::new(tokenizer(), ChatTemplate::fallback()).with_model_type("qwen3_coder");
    assert_eq!(coder.tool_call_format(), ToolCallFormat::QwenXml);
    let f = recorded_templates();
    let src = f["templates"]["qwen25"].as_str().unwrap();
    let qwen = ChatText::new(
        tokenizer(),
        ChatTemplate::from_source(src, "", "<|im_end|>").unwrap(),
    )
    .with_model_type("qwen3_coder");
    // The template's own `<tool_call>` example beats the model type.
    assert_eq!(qwen.tool_call_format(), ToolCallFormat::Hermes);
}
