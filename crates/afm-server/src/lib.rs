//! afm-server: the OpenAI-compatible HTTP server. It owns the axum routes, SSE streaming,
//! cancellation (client disconnect and `/cancel`), body limits, and the text pipeline between
//! the engine and the client: template → tokenize → engine → incremental detokenize → stop
//! strings → reasoning split → tool-call extraction → response shaping with usage and timings.
//!
//! It does not own sampling or scheduling (afm-engine) nor tokenizers and templates
//! (afm-chat); it reaches them through the [`seams`]. `afm -s` runs the same pipeline
//! without HTTP ([`chat::start_chat`]).

pub mod access;
pub mod chat;
pub mod completions;
pub mod engine_impl;
pub mod generation;
pub mod gpu_profile;
pub mod limits;
pub mod metrics;
pub mod reasoning;
pub mod registry;
pub mod routes;
pub mod seams;
pub mod stop_strings;
pub mod testing;
pub mod text_model;
pub mod tool_calls;
pub mod usage;
pub mod webui;

use std::sync::Arc;

use afm_api::{ModelInfo, RequestDefaults};

pub use routes::router;
pub use seams::{Detokenizer, Generator, SubmitError, TextModel};

/// The one model this server serves.
pub struct ServedModel {
    pub info: ModelInfo,
    pub text: Arc<dyn TextModel>,
    pub generator: Arc<dyn Generator>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub defaults: RequestDefaults,
    /// `--raw`: no reasoning extraction; the model's text goes to `content` as is.
    pub raw: bool,
    /// Larger bodies get 413.
    pub max_body_bytes: usize,
    /// `-v`: one stderr line per request (method, path, status, milliseconds).
    pub log_requests: bool,
    /// `--tool-call-parser`, `--fix-tool-args`, `AFM_DEBUG`.
    pub tool_calls: tool_calls::ToolCallConfig,
    /// `--api-key`: every route but /health and the WebUI's static files needs
    /// `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// `--cors-origin`: browser origins allowed to call the API; none means no CORS headers.
    pub cors_origins: Vec<String>,
    /// Connections, slow clients, request deadline, message count, shutdown grace.
    pub limits: limits::Limits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            defaults: RequestDefaults::default(),
            raw: false,
            max_body_bytes: 16 << 20,
            log_requests: false,
            tool_calls: tool_calls::ToolCallConfig::default(),
            api_key: None,
            cors_origins: Vec::new(),
            limits: limits::Limits::default(),
        }
    }
}

pub struct AppState {
    pub model: ServedModel,
    pub config: ServerConfig,
    pub registry: Arc<registry::Registry>,
    /// Unix time the server started (the model's `created`).
    pub started: u64,
}

impl AppState {
    pub fn new(model: ServedModel, config: ServerConfig) -> Arc<Self> {
        Arc::new(AppState {
            model,
            config,
            registry: Arc::default(),
            started: usage::unix_now(),
        })
    }
}

/// Serves until `shutdown` resolves, within [`limits::Limits`]; see [`limits::serve`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    limits::serve(listener, state, shutdown).await
}
