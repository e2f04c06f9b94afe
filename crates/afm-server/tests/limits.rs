//! Server limits through a live server on the fake engine: connection cap, slow clients
//! (head and body), the per-request deadline, message count, and graceful shutdown.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use afm_api::ModelInfo;
use afm_server::limits::Limits;
use afm_server::testing::{FakeGenerator, FakeText};
use afm_server::{AppState, ServedModel, ServerConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn with_limits(limits: Limits) -> ServerConfig {
    ServerConfig {
        limits,
        ..ServerConfig::default()
    }
}

/// Reads until the peer closes (or `within` passes): what the server sent.
async fn read_all(stream: &mut TcpStream, within: Duration) -> (String, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

fn json_body(response: &str) -> Value {
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or(Value::Null)
}

#[tokio::test]
async fn connections_past_the_cap_get_503_json() {
    let s = common::start_with(with_limits(Limits {
        max_connections: 2,
        ..Limits::default()
    }))
    .await;
    let addr = s.base.trim_start_matches("http://").to_string();
    let held = [
        TcpStream::connect(&addr).await.unwrap(),
        TcpStream::connect(&addr).await.unwrap(),
    ];
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = TcpStream::connect(&addr).await.unwrap();
    third
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let (resp, closed) = read_all(&mut third, Duration::from_secs(3)).await;
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    assert!(closed, "the refused connection stays open");
    let body = json_body(&resp);
    assert_eq!(body["error"]["code"], "too_many_connections", "{resp}");
    assert!(body["error"]["message"].as_str().unwrap().contains('2'));

    // A slot frees when a connection closes.
    drop(held);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, _) = s.get("/v1/models").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_head_is_disconnected() {
    let s = common::start_with(with_limits(Limits {
        header_timeout: Duration::from_millis(300),
        ..Limits::default()
    }))
    .await;
    let addr = s.base.trim_start_matches("http://");
    let start = Instant::now();
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let (_, closed) = read_all(&mut slow, Duration::from_secs(5)).await;
    assert!(closed, "a half-sent head holds the connection");
    assert!(start.elapsed() < Duration::from_secs(3));
    // An idle connection that sends nothing at all is closed too.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let (_, closed) = read_all(&mut idle, Duration::from_secs(5)).await;
    assert!(closed, "an idle connection is held forever");
}

#[tokio::test]
async fn a_body_that_trickles_past_the_deadline_gets_408_json() {
    let s = common::start_with(with_limits(Limits {
        body_timeout: Duration::from_millis(300),
        ..Limits::default()
    }))
    .await;
    let addr = s.base.trim_start_matches("http://");
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"messages\":",
    )
    .await
    .unwrap();
    let (resp, _) = read_all(&mut slow, Duration::from_secs(3)).await;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert_eq!(json_body(&resp)["error"]["code"], "timeout", "{resp}");
}

#[tokio::test]
async fn a_request_past_its_deadline_gets_a_timeout_error() {
    let s = common::start_with(with_limits(Limits {
        request_timeout: Some(Duration::from_millis(300)),
        ..Limits::default()
    }))
    .await;
    // `[slow]` writes a token every 20 ms forever.
    let start = Instant::now();
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": common::user("[slow]"), "max_tokens": 10000}),
        )
        .await;
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["code"], "timeout", "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("0.3 s") && msg.contains("--request-timeout"),
        "{msg}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));

    for (path, request) in [
        (
            "/v1/completions",
            json!({"prompt": "[slow]", "max_tokens": 10000, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": common::user("[slow]"), "max_tokens": 10000, "stream": true}),
        ),
    ] {
        let events = s.stream(path, &request).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{path}");
        let chunks: Vec<Value> = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .collect();
        // Text arrived, no choice claims to have finished, and the last event is the error.
        assert!(chunks.len() > 3, "{path}: {events:?}");
        assert!(
            chunks
                .iter()
                .all(|c| c["choices"][0]["finish_reason"].is_null()),
            "{path}: {events:?}"
        );
        let error = &chunks.last().unwrap()["error"];
        assert_eq!(error["code"], "timeout", "{path}: {events:?}");
        assert!(error["message"]
            .as_str()
            .unwrap()
            .contains("--request-timeout"));
    }
    // Nothing is left running.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(s.state.registry.is_empty());
    // A request that finishes in time is unaffected.
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": common::user("hi")}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn a_client_that_stops_reading_is_dropped_and_its_request_cancelled() {
    let s = common::start_with(with_limits(Limits {
        write_timeout: Duration::from_millis(500),
        ..Limits::default()
    }))
    .await;
    let addr: std::net::SocketAddr = s.base.trim_start_matches("http://").parse().unwrap();
    // A small receive window, so the server's writes block soon.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stuck = socket.connect(addr).await.unwrap();
    // Four choices of 4000 tokens with 20 alternatives each: ~30 MB of events, more than any
    // socket buffer holds.
    let body = json!({"messages": common::user("[long]"), "max_tokens": 4000, "n": 4,
                      "logprobs": true, "top_logprobs": 20, "stream": true})
    .to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    stuck.write_all(head.as_bytes()).await.unwrap();
    stuck.write_all(body.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!s.state.registry.is_empty(), "the request never started");
    // `[long]` writes tokens as fast as it can; the client reads none of them.
    let start = Instant::now();
    while !s.state.registry.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the request is still running though its client stopped reading"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The connection was closed: reading drains what was buffered, then ends.
    let (_, closed) = read_all(&mut stuck, Duration::from_secs(5)).await;
    assert!(
        closed,
        "the connection of a client that stopped reading stays open"
    );
    // A client that reads gets its whole answer, however slowly it is produced.
    let events = s
        .stream(
            "/v1/completions",
            &json!({"prompt": "[slow]", "max_tokens": 40, "stream": true}),
        )
        .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

#[tokio::test]
async fn too_many_messages_are_refused_naming_the_limit() {
    let s = common::start_with(with_limits(Limits {
        max_messages: 3,
        ..Limits::default()
    }))
    .await;
    let messages: Vec<Value> = (0..4)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"}))
        .collect();
    let (status, body) = s
        .post("/v1/chat/completions", &json!({ "messages": messages }))
        .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "messages");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("4 messages") && msg.contains("limit is 3"),
        "{msg}"
    );
    let (status, _) = s
        .post("/v1/chat/completions", &json!({"messages": &messages[..3]}))
        .await;
    assert_eq!(status, 200);
}

/// A server whose shutdown the test triggers; returns (base URL, trigger, serve's task).
async fn start_stoppable(
    limits: Limits,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let model = ServedModel {
        info: ModelInfo {
            id: "fake-model".into(),
            aliases: vec![],
            vocab_size: 259,
        },
        text: Arc::new(FakeText),
        generator: Arc::new(FakeGenerator::new()),
    };
    let state = AppState::new(model, with_limits(limits));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(afm_server::serve(listener, state, async {
        let _ = rx.await;
    }));
    (base, tx, task)
}

#[tokio::test]
async fn shutdown_lets_answers_in_flight_finish_then_stops_accepting() {
    let (base, stop, server) = start_stoppable(Limits::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/chat/completions");
    // 15 tokens at 20 ms: still running when shutdown starts.
    let answer = tokio::spawn(
        client
            .post(&url)
            .json(&json!({"messages": common::user("[slow]"), "max_tokens": 15}))
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    let resp = answer.await.unwrap().unwrap();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let done = tokio::time::timeout(Duration::from_secs(3), server).await;
    assert!(matches!(done, Ok(Ok(Ok(())))), "serve did not return Ok");
    assert!(reqwest::get(format!("{base}/health")).await.is_err());
}

#[tokio::test]
async fn shutdown_cancels_what_outlives_its_deadline() {
    let (base, stop, server) = start_stoppable(Limits {
        shutdown_timeout: Duration::from_millis(300),
        ..Limits::default()
    })
    .await;
    let url = format!("{base}/v1/chat/completions");
    let answer = tokio::spawn(
        reqwest::Client::new()
            .post(&url)
            .json(&json!({"messages": common::user("[slow]"), "max_tokens": 100000}))
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = Instant::now();
    stop.send(()).unwrap();
    let done = tokio::time::timeout(Duration::from_secs(3), server).await;
    assert!(matches!(done, Ok(Ok(Ok(())))), "serve did not return Ok");
    assert!(start.elapsed() < Duration::from_secs(2));
    answer.abort();
}
