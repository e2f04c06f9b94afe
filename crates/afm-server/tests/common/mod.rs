//! A live server on an ephemeral port, backed by the scripted fakes, and small client helpers.

#![allow(dead_code)]

use std::sync::Arc;

use afm_api::ModelInfo;
use afm_server::testing::{FakeGenerator, FakeText};
use afm_server::{AppState, ServedModel, ServerConfig};
use serde_json::Value;

pub struct TestServer {
    pub base: String,
    pub fake: Arc<FakeGenerator>,
    pub state: Arc<AppState>,
    pub client: reqwest::Client,
}

pub async fn start() -> TestServer {
    start_with(ServerConfig {
        max_body_bytes: 100_000,
        ..ServerConfig::default()
    })
    .await
}

pub async fn start_with(config: ServerConfig) -> TestServer {
    let fake = FakeGenerator::new();
    let model = ServedModel {
        info: ModelInfo {
            id: "fake-model".into(),
            aliases: vec!["/models/fake-model.gguf".into()],
            vocab_size: 259,
        },
        text: Arc::new(FakeText),
        generator: Arc::new(fake.clone()),
    };
    let state = AppState::new(model, config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let s = state.clone();
    tokio::spawn(async move { afm_server::serve(listener, s, std::future::pending()).await });
    TestServer {
        base,
        fake,
        state,
        client: reqwest::Client::new(),
    }
}

impl TestServer {
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let resp = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    /// A streamed request read to the end: every `data:` payload, `[DONE]` included.
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        sse_data(&resp.text().await.unwrap())
    }
}

pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

pub fn user(text: &str) -> Value {
    serde_json::json!([{"role": "user", "content": text}])
}
