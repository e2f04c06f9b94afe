//! The server on the real engine and tokenizer, with the tiny random-weight Qwen3 fixture
//! (tests/fixtures/tiny/qwen3): what the fake cannot show — the engine's own tokens, finish
//! reasons, logprobs and batching behind the same HTTP surface.

use std::path::PathBuf;
use std::sync::Arc;

use afm_api::ModelInfo;
use afm_chat::{ChatTemplate, Tokenizer};
use afm_engine::{Engine, EngineConfig};
use afm_models::source::ModelLocation;
use afm_server::text_model::ChatText;
use afm_server::{AppState, ServedModel, ServerConfig};
use serde_json::{json, Value};

struct Tiny {
    base: String,
    client: reqwest::Client,
}

async fn start() -> Tiny {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny/qwen3/model-f32.gguf");
    let model = afm_models::load_model(&ModelLocation::Gguf(path)).expect("tiny fixture loads");
    let gguf = model.gguf().expect("a GGUF model");
    let tokenizer = Tokenizer::from_gguf(gguf).expect("tiny tokenizer");
    let template = ChatTemplate::from_gguf(gguf, &tokenizer)
        .expect("template")
        .unwrap_or_else(ChatTemplate::fallback);
    let info = ModelInfo {
        id: "tiny".into(),
        aliases: Vec::new(),
        vocab_size: tokenizer.vocab_size(),
    };
    let cfg = EngineConfig {
        concurrent: 4,
        kv_budget_bytes: Some(8 << 20),
        ..EngineConfig::default()
    };
    let handle = Engine::spawn(model, cfg).expect("engine starts");
    let served = ServedModel {
        info,
        text: Arc::new(ChatText::new(tokenizer, template)),
        generator: Arc::new(handle),
    };
    let state = AppState::new(served, ServerConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(afm_server::serve(listener, state, std::future::pending()));
    Tiny {
        base,
        client: reqwest::Client::new(),
    }
}

impl Tiny {
    async fn chat(&self, body: Value) -> (u16, Value) {
        let resp = self
            .client
            .post(format!("{}/v1/chat/completions", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    async fn stream_text(&self, mut body: Value) -> (String, Value) {
        body["stream"] = json!(true);
        let resp = self
            .client
            .post(format!("{}/v1/chat/completions", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let text = resp.text().await.unwrap();
        let chunks: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect();
        let content = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        (content, chunks.last().cloned().unwrap_or_default())
    }
}

fn ask(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Bans EOS ("</s>", id 2) so random weights cannot end early.
fn no_eos() -> Value {
    json!({"2": -100})
}

#[tokio::test]
async fn greedy_is_deterministic_and_streams_the_same_text() {
    let t = start().await;
    let req = json!({"messages": ask("the test"), "temperature": 0, "max_tokens": 12,
        "logit_bias": no_eos()});
    let (status, a) = t.chat(req.clone()).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = t.chat(req.clone()).await;
    let text = a["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        text,
        b["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 12);
    let (streamed, usage_chunk) = t.stream_text(req).await;
    assert_eq!(streamed, text);
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 12);
}

#[tokio::test]
async fn logprobs_agree_with_greedy_choice() {
    let t = start().await;
    let req = json!({"messages": ask("on the"), "temperature": 0, "max_tokens": 6,
        "logprobs": true, "top_logprobs": 3, "logit_bias": no_eos()});
    let (_, body) = t.chat(req).await;
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 6);
    for entry in content {
        let lp = entry["logprob"].as_f64().unwrap();
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert!(lp <= 0.0);
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-4,
            "{entry}"
        );
    }
}

#[tokio::test]
async fn seeds_repeat_and_n_gives_n_choices() {
    let t = start().await;
    let req = json!({"messages": ask("the"), "temperature": 1.0, "seed": 11, "n": 3,
        "max_tokens": 10, "logit_bias": no_eos()});
    let (_, a) = t.chat(req.clone()).await;
    let (_, b) = t.chat(req).await;
    let texts = |v: &Value| -> Vec<String> {
        (0..3)
            .map(|i| {
                v["choices"][i]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    assert_eq!(texts(&a), texts(&b));
    assert_eq!(a["usage"]["completion_tokens"], 30);
}

#[tokio::test]
async fn prompt_beyond_the_context_is_refused() {
    let t = start().await;
    let (status, body) = t.chat(json!({"messages": ask(&"the ".repeat(400))})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    // The context (256) also bounds max_tokens: the answer ends with "length" at the limit.
    let (status, body) = t
        .chat(
            json!({"messages": ask("the"), "max_tokens": 100000, "temperature": 0,
            "logit_bias": no_eos()}),
        )
        .await;
    assert_eq!(status, 200);
    let u = &body["usage"];
    assert_eq!(u["total_tokens"], 256, "{u}");
}

#[tokio::test]
async fn concurrent_greedy_answers_equal_solo_answers() {
    let t = Arc::new(start().await);
    let prompts = ["the test", "on the", "it is", "we the"];
    let mut solo = Vec::new();
    for p in prompts {
        let req = json!({"messages": ask(p), "temperature": 0, "max_tokens": 16,
            "logit_bias": no_eos()});
        solo.push(t.chat(req).await.1["choices"][0]["message"]["content"].clone());
    }
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let t = t.clone();
            let req = json!({"messages": ask(p), "temperature": 0, "max_tokens": 16,
                "logit_bias": no_eos()});
            tokio::spawn(
                async move { t.chat(req).await.1["choices"][0]["message"]["content"].clone() },
            )
        })
        .collect();
    for (task, expected) in tasks.into_iter().zip(solo) {
        assert_eq!(task.await.unwrap(), expected);
    }
}
