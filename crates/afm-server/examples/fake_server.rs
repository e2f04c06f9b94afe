//! The HTTP server on the scripted fake engine (see `afm_server::testing`), for the pytest
//! suite: `fake_server [--port N] [--max-body BYTES] [--no-streaming]`. Prints
//! `LISTENING <port>` once it accepts connections. `GET /debug/fake` reports how each engine
//! request ended and the last request's settings, so tests can see cancellation.

use std::sync::Arc;

use afm_api::{ModelInfo, RequestDefaults};
use afm_server::testing::{FakeGenerator, FakeOutcome, FakeText};
use afm_server::{AppState, ServedModel, ServerConfig};
use axum::routing::get;
use axum::Json;
use serde_json::json;

fn flag_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = flag_value(&args, "--port")
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let max_body = flag_value(&args, "--max-body")
        .and_then(|p| p.parse().ok())
        .unwrap_or(1 << 20);
    let fake = FakeGenerator::new();
    let model = ServedModel {
        info: ModelInfo {
            id: "fake-model".into(),
            aliases: Vec::new(),
            vocab_size: 259,
        },
        text: Arc::new(FakeText),
        generator: Arc::new(fake.clone()),
    };
    let config = ServerConfig {
        defaults: RequestDefaults {
            streaming_enabled: !args.iter().any(|a| a == "--no-streaming"),
            ..RequestDefaults::default()
        },
        max_body_bytes: max_body,
        ..ServerConfig::default()
    };
    let state = AppState::new(model, config);
    let debug = get(move || {
        let fake = fake.clone();
        async move {
            let outcomes = fake.outcomes();
            let count = |o: FakeOutcome| outcomes.values().filter(|&&v| v == o).count();
            let last = fake.submitted().last().map(|r| {
                json!({"temperature": r.sampling.temperature, "top_p": r.sampling.top_p,
                    "top_k": r.sampling.top_k, "seed": r.sampling.seed,
                    "max_tokens": r.max_tokens, "top_logprobs": r.top_logprobs,
                    "prompt_tokens": r.prompt_tokens.len()})
            });
            Json(json!({
                "running": count(FakeOutcome::Running),
                "finished": count(FakeOutcome::Finished),
                "cancelled": count(FakeOutcome::Cancelled) + count(FakeOutcome::Dropped),
                "last": last,
            }))
        }
    });
    let app = afm_server::router(state).route("/debug/fake", debug);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("LISTENING {}", listener.local_addr()?.port());
    axum::serve(listener, app).await
}
