//! `--api-key` and `--cors-origin` against a live server: the key guards every route but
//! /health and the page's static files; CORS headers go only to allowed origins.

mod common;

use afm_server::ServerConfig;
use common::*;
use serde_json::json;

async fn keyed() -> TestServer {
    start_with(ServerConfig {
        api_key: Some("s3cret".into()),
        cors_origins: vec!["http://allowed.test".into()],
        ..ServerConfig::default()
    })
    .await
}

#[tokio::test]
async fn api_key_guards_the_api_but_not_health_or_the_page() {
    let s = keyed().await;
    let chat = json!({"messages": user("hi"), "max_tokens": 2});
    let (status, body) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "authentication_error");
    assert_eq!(body["error"]["code"], "invalid_api_key");
    for (path, key, want) in [
        ("/v1/models", None, 401),
        ("/v1/models", Some("wrong"), 401),
        ("/v1/models", Some("s3cret"), 200),
        ("/metrics", None, 401),
        ("/health", None, 200),
        ("/", None, 200),
        ("/webui/app.js", None, 200),
        ("/favicon.svg", None, 200),
    ] {
        let mut req = s.client.get(format!("{}{path}", s.base));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let got = req.send().await.unwrap().status().as_u16();
        assert_eq!(got, want, "GET {path} with key {key:?}");
    }
    let ok = s
        .client
        .post(format!("{}/v1/chat/completions", s.base))
        .bearer_auth("s3cret")
        .json(&chat)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
}

#[tokio::test]
async fn cors_answers_allowed_origins_only_and_is_off_by_default() {
    let preflight = |s: &TestServer, origin: &str| {
        s.client
            .request(
                reqwest::Method::OPTIONS,
                format!("{}/v1/chat/completions", s.base),
            )
            .header("Origin", origin)
            .header("Access-Control-Request-Method", "POST")
            .send()
    };
    let s = keyed().await;
    let r = preflight(&s, "http://allowed.test").await.unwrap();
    assert_eq!(
        r.headers()["access-control-allow-origin"],
        "http://allowed.test"
    );
    let r = preflight(&s, "http://other.test").await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
    let plain = start().await;
    let r = preflight(&plain, "http://allowed.test").await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
}
