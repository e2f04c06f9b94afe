//! /v1/chat/completions against a live server with the scripted fake engine: response and
//! chunk shapes, stop strings, reasoning split, n, seeds, logprobs, cancellation, concurrency.

mod common;

use std::time::Duration;

use afm_server::testing::FakeOutcome;
use common::*;
use futures::StreamExt;
use serde_json::{json, Value};

#[tokio::test]
async fn non_streamed_answer_has_openai_shape_usage_and_timings() {
    let s = start().await;
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"model": "fake-model", "messages": user("hi")}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "fake-model");
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000);
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    // Default temperature 1.0 makes the fake append " #N".
    let content = choice["message"]["content"].as_str().unwrap();
    assert!(content.starts_with("Hello! You said: hi #"), "{content}");
    assert!(choice["message"].get("reasoning_content").is_none());
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["logprobs"], Value::Null);
    let u = &body["usage"];
    let prompt = "user: hi\nassistant:".len() as u64;
    assert_eq!(u["prompt_tokens"], prompt);
    assert_eq!(u["completion_tokens"], content.len() as u64);
    assert_eq!(u["total_tokens"], prompt + content.len() as u64);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    for k in [
        "prompt_time",
        "completion_time",
        "total_time",
        "completion_tokens_per_second",
    ] {
        assert!(u[k].is_number(), "usage.{k}");
    }
    assert_eq!(body["timings"]["predicted_n"], content.len() as u64);
    assert_eq!(body["timings"]["prompt_n"], prompt);
}

#[tokio::test]
async fn stream_sends_role_deltas_finish_usage_and_done() {
    let s = start().await;
    let req = json!({"messages": user("hey"), "stream": true, "temperature": 0});
    let data = s.stream("/v1/chat/completions", &req).await;
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(chunks
        .iter()
        .all(|c| c["id"] == id && c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[1..]
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello! You said: hey");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], text.len() as u64);
    assert!(usage["timings"]["predicted_per_second"].is_number());

    // include_usage: false drops the usage chunk.
    let req = json!({"messages": user("hey"), "stream": true,
        "stream_options": {"include_usage": false}});
    let data = s.stream("/v1/chat/completions", &req).await;
    assert!(data.iter().all(|d| !d.contains("\"usage\"")));
}

#[tokio::test]
async fn stop_strings_across_tokens_end_generation_and_are_not_emitted() {
    let s = start().await;
    let req = json!({"messages": user("hi"), "stop": ["said", "zzz"], "temperature": 0});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    assert_eq!(body["choices"][0]["message"]["content"], "Hello! You ");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let outcomes = s.fake.outcomes();
    assert_eq!(outcomes.values().next(), Some(&FakeOutcome::Cancelled));

    let req = json!({"messages": user("hi"), "stop": "You", "stream": true, "temperature": 0});
    let data = s.stream("/v1/chat/completions", &req).await;
    let text: String = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, "Hello! ");
}

#[tokio::test]
async fn max_tokens_gives_length() {
    let s = start().await;
    let req = json!({"messages": user("[long]"), "max_tokens": 7});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 7);
    assert_eq!(body["choices"][0]["message"]["content"], "word wo");
    // max_completion_tokens is the newer name of the same limit.
    let req = json!({"messages": user("[long]"), "max_completion_tokens": 3});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    assert_eq!(body["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn reasoning_is_split_from_content() {
    let s = start().await;
    let req = json!({"messages": user("[think] why?"), "temperature": 0});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    let m = &body["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Let me think.");
    assert_eq!(m["content"], "The answer is 42.");

    // A <think> opened by the template's generation prompt.
    let req = json!({"messages": user("go"), "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": true}});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    let m = &body["choices"][0]["message"];
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some("Plan."), Some("Done."))
    );
    // reasoning_effort turns thinking on; an explicit enable_thinking false wins.
    let req = json!({"messages": user("go"), "reasoning_effort": "high", "temperature": 0});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    assert_eq!(body["choices"][0]["message"]["reasoning_content"], "Plan.");
    let req = json!({"messages": user("go"), "reasoning_effort": "high", "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false}});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Hello! You said: go"
    );
}

#[tokio::test]
async fn streamed_reasoning_opens_eagerly() {
    let s = start().await;
    let req = json!({"messages": user("[think]"), "stream": true, "temperature": 0});
    let data = s.stream("/v1/chat/completions", &req).await;
    let deltas: Vec<Value> = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty()))
        .map(|c| c["choices"][0]["delta"].clone())
        .collect();
    // The chunk right after the role chunk already says "reasoning" (the <think> token alone).
    assert_eq!(deltas[1], json!({"reasoning_content": ""}));
    let reasoning: String = deltas
        .iter()
        .filter_map(|d| d["reasoning_content"].as_str())
        .collect();
    let content: String = deltas[1..]
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("Let me think.", "The answer is 42.")
    );
    let last_reasoning = deltas
        .iter()
        .rposition(|d| d.get("reasoning_content").is_some());
    let first_content = deltas[1..]
        .iter()
        .position(|d| d.get("content").is_some())
        .unwrap()
        + 1;
    assert!(last_reasoning.unwrap() < first_content);
}

#[tokio::test]
async fn n_choices_with_seeds_are_distinct_and_reproducible() {
    let s = start().await;
    let req = json!({"messages": user("hi"), "n": 3, "seed": 42, "temperature": 0.8});
    let (_, a) = s.post("/v1/chat/completions", &req).await;
    let (_, b) = s.post("/v1/chat/completions", &req).await;
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&a), texts(&b));
    let t = texts(&a);
    assert!(t[0] != t[1] && t[1] != t[2], "{t:?}");
    let indices: Vec<u64> = a["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, vec![0, 1, 2]);
    // Prompt counted once, completions summed.
    let completion: usize = t.iter().map(String::len).sum();
    assert_eq!(a["usage"]["completion_tokens"], completion as u64);
    assert_eq!(
        a["usage"]["prompt_tokens"],
        "user: hi\nassistant:".len() as u64
    );

    let req = json!({"messages": user("hi"), "n": 2, "stream": true, "temperature": 0});
    let data = s.stream("/v1/chat/completions", &req).await;
    let mut per_choice = [String::new(), String::new()];
    let mut finishes = 0;
    for c in data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
    {
        if let Some(ch) = c["choices"].as_array().and_then(|a| a.first()) {
            let i = ch["index"].as_u64().unwrap() as usize;
            per_choice[i] += ch["delta"]["content"].as_str().unwrap_or("");
            finishes += ch["finish_reason"].is_string() as usize;
        }
    }
    assert_eq!(per_choice, ["Hello! You said: hi", "Hello! You said: hi"]);
    assert_eq!(finishes, 2);
}

#[tokio::test]
async fn logprobs_per_token() {
    let s = start().await;
    let req =
        json!({"messages": user("ok"), "logprobs": true, "top_logprobs": 2, "temperature": 0});
    let (_, body) = s.post("/v1/chat/completions", &req).await;
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), "Hello! You said: ok".len());
    assert_eq!(content[0]["token"], "H");
    assert_eq!(content[0]["bytes"], json!([72]));
    assert_eq!(content[0]["logprob"], -0.25);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(s.fake.submitted()[0].top_logprobs, Some(2));
}

#[tokio::test]
async fn client_disconnect_cancels_the_engine_request() {
    let s = start().await;
    let resp = s
        .client
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": user("[slow]"), "stream": true, "max_tokens": 1000}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let _first = body.next().await.unwrap().unwrap();
    let _second = body.next().await.unwrap().unwrap();
    drop(body);
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if s.fake
            .outcomes()
            .values()
            .all(|o| *o != FakeOutcome::Running)
        {
            break;
        }
    }
    let outcome = *s.fake.outcomes().values().next().unwrap();
    assert!(
        matches!(outcome, FakeOutcome::Cancelled | FakeOutcome::Dropped),
        "{outcome:?}"
    );
    assert!(s.state.registry.is_empty(), "the request left the registry");
}

#[tokio::test]
async fn cancel_endpoint_stops_a_running_stream() {
    let s = start().await;
    let resp = s
        .client
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": user("[slow]"), "stream": true, "max_tokens": 1000}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let first = String::from_utf8(body.next().await.unwrap().unwrap().to_vec()).unwrap();
    let chunk: Value = serde_json::from_str(&sse_data(&first)[0]).unwrap();
    let id = chunk["id"].as_str().unwrap().to_string();
    let (status, ack) = s
        .post(&format!("/v1/chat/completions/{id}/cancel"), &json!({}))
        .await;
    assert_eq!((status, ack["cancelled"].as_bool()), (200, Some(true)));
    let mut rest = String::new();
    while let Some(Ok(bytes)) = body.next().await {
        rest += &String::from_utf8_lossy(&bytes);
    }
    assert!(rest.contains("\"finish_reason\":\"cancelled\""), "{rest}");
    assert!(rest.trim_end().ends_with("data: [DONE]"));
    let (status, err) = s
        .post(&format!("/v1/chat/completions/{id}/cancel"), &json!({}))
        .await;
    assert_eq!(status, 404, "{err}");
}

#[tokio::test]
async fn concurrent_requests_never_interleave() {
    let s = std::sync::Arc::new(start().await);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                let stream = i % 2 == 0;
                let req = json!({"messages": user(&format!("request {i}")), "temperature": 0,
                    "stream": stream});
                let text = if stream {
                    s.stream("/v1/chat/completions", &req)
                        .await
                        .iter()
                        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                        .filter_map(|c| {
                            c["choices"][0]["delta"]["content"]
                                .as_str()
                                .map(str::to_string)
                        })
                        .collect::<String>()
                } else {
                    let (_, body) = s.post("/v1/chat/completions", &req).await;
                    body["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap()
                        .to_string()
                };
                assert_eq!(text, format!("Hello! You said: request {i}"));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn strict_schema_without_grammar_says_downgraded() {
    let s = start().await;
    let req = json!({"messages": user("hi"), "response_format": {"type": "json_schema",
        "json_schema": {"name": "x", "strict": true, "schema": {"type": "object"}}}});
    let resp = s
        .post_raw("/v1/chat/completions", req.to_string().into_bytes())
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-grammar-constraints"], "downgraded");
}

#[tokio::test]
async fn disconnect_during_prefill_cancels_before_the_first_token() {
    let s = start().await;
    let resp = s
        .client
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": user("[prefill]"), "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let _role_chunk = body.next().await.unwrap().unwrap();
    drop(body);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The fake "prefill" lasts 1 s: the cancel must have arrived while it was still running.
    let outcome = *s.fake.outcomes().values().next().unwrap();
    assert_eq!(outcome, FakeOutcome::Cancelled);
}

#[tokio::test]
async fn abandoned_non_streamed_request_is_cancelled() {
    let s = start().await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    let sent = client
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": user("[prefill]")}))
        .send()
        .await;
    assert!(sent.is_err(), "the client gave up");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let outcome = *s.fake.outcomes().values().next().unwrap();
    assert_eq!(outcome, FakeOutcome::Cancelled);
}
