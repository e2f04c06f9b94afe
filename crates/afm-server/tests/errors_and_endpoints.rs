//! Client mistakes get OpenAI error JSON with the right status and a message naming the field
//! and the limit; and the small endpoints (completions, models, health, tokenize, count_tokens).

mod common;

use common::*;
use serde_json::{json, Value};

async fn expect_error(s: &TestServer, body: Vec<u8>, status: u16, param: Option<&str>, says: &str) {
    let resp = s.post_raw("/v1/chat/completions", body).await;
    assert_eq!(resp.status().as_u16(), status);
    let v: Value = resp.json().await.unwrap();
    let e = &v["error"];
    assert!(e["message"].as_str().unwrap().contains(says), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert!(e.get("code").is_some(), "{v}");
}

#[tokio::test]
async fn each_client_mistake_has_its_status_and_message() {
    let s = start().await;
    let msgs = user("hi");
    let with = |extra: Value| {
        let mut b = json!({"messages": msgs});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b.to_string().into_bytes()
    };
    expect_error(
        &s,
        b"{\"messages\": [".to_vec(),
        400,
        None,
        "not valid JSON",
    )
    .await;
    expect_error(&s, b"[1]".to_vec(), 400, None, "JSON object").await;
    expect_error(&s, Vec::new(), 400, None, "empty").await;
    expect_error(
        &s,
        with(json!({"temperature": "warm"})),
        400,
        Some("temperature"),
        "temperature",
    )
    .await;
    expect_error(
        &s,
        with(json!({"model": "gpt-4o"})),
        404,
        Some("model"),
        "gpt-4o",
    )
    .await;
    expect_error(
        &s,
        json!({"messages": []}).to_string().into_bytes(),
        400,
        Some("messages"),
        "at least one",
    )
    .await;
    expect_error(&s, b"{}".to_vec(), 400, None, "messages").await;
    expect_error(
        &s,
        with(json!({"max_tokens": 0})),
        400,
        Some("max_tokens"),
        "at least 1",
    )
    .await;
    expect_error(
        &s,
        with(json!({"temperature": -1})),
        400,
        Some("temperature"),
        "[0, 2]",
    )
    .await;
    expect_error(
        &s,
        with(json!({"temperature": 2.5})),
        400,
        Some("temperature"),
        "[0, 2]",
    )
    .await;
    expect_error(&s, with(json!({"top_p": 0})), 400, Some("top_p"), "(0, 1]").await;
    expect_error(
        &s,
        with(json!({"top_p": 1.01})),
        400,
        Some("top_p"),
        "(0, 1]",
    )
    .await;
    expect_error(&s, with(json!({"n": 9})), 400, Some("n"), "between 1 and 8").await;
    expect_error(
        &s,
        with(json!({"logprobs": true, "top_logprobs": 50})),
        400,
        Some("top_logprobs"),
        "20",
    )
    .await;
    let raise = json!({"messages": user("[raise]")})
        .to_string()
        .into_bytes();
    expect_error(&s, raise, 400, Some("messages"), "roles must alternate").await;
    let image = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]});
    expect_error(
        &s,
        image.to_string().into_bytes(),
        400,
        Some("messages[0].content[0].type"),
        "only text",
    )
    .await;
}

#[tokio::test]
async fn prompt_longer_than_context_is_400() {
    let s = start().await;
    let long = "x".repeat(5000);
    let body = json!({"messages": user(&long)}).to_string().into_bytes();
    expect_error(
        &s,
        body,
        400,
        Some("messages"),
        "maximum context length is 4096",
    )
    .await;
    // Room left in the context bounds max_tokens instead of failing.
    let body = json!({"messages": user(&"y".repeat(4000)), "max_tokens": 5000, "temperature": 0});
    let (status, _) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let max = s.fake.submitted().last().unwrap().max_tokens;
    assert_eq!(max, 4096 - "user: \nassistant:".len() - 4000);
}

#[tokio::test]
async fn oversized_body_is_413() {
    let s = start().await;
    let body = json!({"messages": user(&"z".repeat(200_000))})
        .to_string()
        .into_bytes();
    expect_error(&s, body, 413, None, "100000 bytes").await;
}

#[tokio::test]
async fn queue_full_is_429_with_retry_after() {
    let s = start().await;
    let resp = s
        .post_raw(
            "/v1/chat/completions",
            json!({"messages": user("[busy]")}).to_string().into_bytes(),
        )
        .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
}

#[tokio::test]
async fn engine_failure_is_500_or_an_error_event() {
    let s = start().await;
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": user("[error]")}),
        )
        .await;
    assert_eq!(status, 500, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scripted engine failure"));
    let data = s
        .stream(
            "/v1/chat/completions",
            &json!({"messages": user("[error]"), "stream": true}),
        )
        .await;
    assert!(data[data.len() - 2].contains("scripted engine failure"));
    assert_eq!(data.last().unwrap(), "[DONE]");
}

#[tokio::test]
async fn unknown_routes_and_methods_are_json_errors() {
    let s = start().await;
    let (status, body) = s.get("/v1/nothing").await;
    assert_eq!(status, 404);
    assert!(body["error"]["message"].is_string());
    let (status, body) = s.get("/v1/chat/completions").await;
    assert_eq!(status, 405);
    assert!(body["error"]["message"].as_str().unwrap().contains("GET"));
}

#[tokio::test]
async fn completions_text_tokens_echo_n_and_logprobs() {
    let s = start().await;
    let (status, body) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "user: abc", "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], "Hello! You said: abc");
    assert_eq!(body["usage"]["prompt_tokens"], 9);

    let ids: Vec<u32> = "user: q".bytes().map(u32::from).collect();
    let req = json!({"prompt": ids, "echo": true, "n": 2, "temperature": 0});
    let (_, body) = s.post("/v1/completions", &req).await;
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    assert_eq!(body["choices"][1]["text"], "user: qHello! You said: q");

    let req =
        json!({"prompt": ["user: a", "user: b"], "max_tokens": 3, "logprobs": 1, "temperature": 0});
    let (_, body) = s.post("/v1/completions", &req).await;
    let c = &body["choices"];
    assert_eq!(
        (c[0]["text"].as_str(), c[1]["text"].as_str()),
        (Some("Hel"), Some("Hel"))
    );
    assert_eq!(c[1]["finish_reason"], "length");
    let lp = &c[0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["H", "e", "l"]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    assert_eq!(lp["top_logprobs"][0]["H"], -0.25);
    assert_eq!(body["usage"]["prompt_tokens"], 14);

    let data = s
        .stream(
            "/v1/completions",
            &json!({"prompt": "user: s", "stream": true, "temperature": 0}),
        )
        .await;
    let text: String = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "Hello! You said: s");
    assert_eq!(data.last().unwrap(), "[DONE]");
    let (status, _) = s.post("/v1/completions", &json!({"prompt": [999]})).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn models_health_tokenize_count() {
    let s = start().await;
    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["id"], "fake-model");
    assert_eq!(body["data"][0]["object"], "model");
    assert_eq!(body["data"][0]["max_model_len"], 4096);
    assert_eq!(s.get("/v1/models/fake-model").await.0, 200);
    assert_eq!(s.get("/v1/models/other").await.0, 404);
    let (status, body) = s.get("/health").await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));

    let (status, body) = s
        .post("/v1/tokenize", &json!({"prompt": "hi<think>"}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["tokens"], json!([104, 105, 257]));
    assert_eq!(body["count"], 3);
    let (_, body) = s
        .post(
            "/v1/tokenize",
            &json!({"content": "é", "return_token_strs": true}),
        )
        .await;
    assert_eq!(body["tokens"], json!([195, 169]));
    let (_, body) = s
        .post("/v1/count_tokens", &json!({"messages": user("hi")}))
        .await;
    assert_eq!(body["count"], "user: hi\nassistant:".len());
    assert_eq!(body["input_tokens"], body["count"]);
    let (status, _) = s.post("/v1/count_tokens", &json!({})).await;
    assert_eq!(status, 400);
}
