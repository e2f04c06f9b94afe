//! HTTP routes: body limits and JSON parsing with OpenAI-shaped errors, then a hand-off to
//! the chat / completions pipelines, plus the small endpoints (models, health, tokenize,
//! count_tokens, cancel). No handler can panic on input; every failure is an [`ApiError`].

use std::sync::Arc;

use afm_api::{
    messages::normalize_messages, validate_chat, validate_completion, ApiError,
    ChatCompletionRequest, CompletionRequest, CountTokensResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse,
};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::chat::{chat_sse, collect_chat, start_chat};
use crate::completions::{collect_completion, completion_sse, start_completion};
use crate::limits::{sse_within_deadline, within_deadline};
use crate::AppState;

type AppRef = State<Arc<AppState>>;
type Body = Result<Bytes, BytesRejection>;

/// An [`ApiError`] as an HTTP response: status, OpenAI error JSON, `Retry-After` when useful.
pub struct HttpError(pub ApiError);

impl From<ApiError> for HttpError {
    fn from(e: ApiError) -> Self {
        HttpError(e)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, Json(self.0.body())).into_response();
        if let Some(secs) = self.0.retry_after() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.max_body_bytes;
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/chat/completions/{id}/cancel", post(cancel))
        .route("/v1/completions", post(completions))
        .route("/v1/completions/{id}/cancel", post(cancel))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model_by_id))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/health", get(health))
        .route("/v1/tokenize", post(tokenize))
        .route("/tokenize", post(tokenize))
        .route("/v1/count_tokens", post(count_tokens))
        .merge(crate::webui::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        // Inside the key check, so an unauthenticated client cannot make us buffer a body.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::limits::read_body_in_time,
        ));
    let router = router.layer(axum::middleware::from_fn_with_state(
        state.clone(),
        crate::access::require_api_key,
    ));
    let router = match crate::access::cors(&state.config.cors_origins) {
        Some(cors) => router.layer(cors),
        None => router,
    };
    let router = if state.config.log_requests {
        router.layer(axum::middleware::from_fn(log_request))
    } else {
        router
    };
    router.with_state(state)
}

async fn log_request(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let start = std::time::Instant::now();
    let resp = next.run(req).await;
    // For streams this is the time to the response head; the body follows.
    eprintln!(
        "afm: {method} {path} {} {:.1} ms",
        resp.status().as_u16(),
        start.elapsed().as_secs_f64() * 1e3
    );
    resp
}

fn body_bytes(state: &AppState, body: Body) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge {
                limit: state.config.max_body_bytes,
            }
        } else {
            ApiError::InvalidJson {
                param: None,
                message: format!("The request body could not be read: {rejection}"),
            }
        }
    })
}

async fn chat_completions(
    State(state): AppRef,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<Response, HttpError> {
    let bytes = body_bytes(&state, body)?;
    let req = ChatCompletionRequest::parse(&bytes)?;
    crate::limits::check_messages(req.messages.len(), &state.config.limits)?;
    let valid = validate_chat(req, &state.config.defaults, &state.model.info)?;
    let stream = valid.generation.stream;
    let job = off_the_runtime(&state, |state| start_chat(state, valid))?;
    let deadline = state.config.limits.request_timeout;
    let downgraded = job.grammar_downgraded;
    let profile = crate::gpu_profile::wanted(&state, &headers);
    let mut resp = if stream {
        let profiler = crate::gpu_profile::Profiler::for_request(&state, &headers);
        Sse::new(sse_within_deadline(chat_sse(job, profiler), deadline)).into_response()
    } else {
        let answer = within_deadline(deadline, collect_chat(job)).await?;
        if profile {
            crate::gpu_profile::with_profile(&state, &answer)
        } else {
            Json(answer).into_response()
        }
    };
    if downgraded {
        resp.headers_mut().insert(
            "x-grammar-constraints",
            HeaderValue::from_static("downgraded"),
        );
    }
    Ok(resp)
}

async fn completions(
    State(state): AppRef,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<Response, HttpError> {
    let bytes = body_bytes(&state, body)?;
    let req = CompletionRequest::parse(&bytes)?;
    let valid = validate_completion(req, &state.config.defaults, &state.model.info)?;
    let stream = valid.generation.stream;
    let job = start_completion(&state, valid)?;
    let deadline = state.config.limits.request_timeout;
    let profile = crate::gpu_profile::wanted(&state, &headers);
    if stream {
        let profiler = crate::gpu_profile::Profiler::for_request(&state, &headers);
        return Ok(
            Sse::new(sse_within_deadline(completion_sse(job, profiler), deadline)).into_response(),
        );
    }
    let answer = within_deadline(deadline, collect_completion(job)).await?;
    Ok(if profile {
        crate::gpu_profile::with_profile(&state, &answer)
    } else {
        Json(answer).into_response()
    })
}

/// Stops a running request; its stream (or response) ends with `finish_reason: "cancelled"`.
async fn cancel(State(state): AppRef, Path(id): Path<String>) -> Result<Response, HttpError> {
    let Some(ids) = state.registry.lookup(&id) else {
        return Err(ApiError::NotFound(format!("No running request has id `{id}`")).into());
    };
    for engine_id in ids {
        state.model.generator.cancel(engine_id);
    }
    Ok(Json(json!({"id": id, "object": "cancellation", "cancelled": true})).into_response())
}

fn model_card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.model.info.id.clone(),
        object: "model".into(),
        created: state.started,
        owned_by: "afm".into(),
        max_model_len: state.model.generator.max_context(),
    }
}

async fn models(State(state): AppRef) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![model_card(&state)],
    })
}

async fn model_by_id(State(state): AppRef, Path(id): Path<String>) -> Result<Response, HttpError> {
    state.model.info.check(Some(&id))?;
    Ok(Json(model_card(&state)).into_response())
}

async fn metrics(State(state): AppRef) -> Response {
    let body = crate::metrics::render(state.model.generator.metrics());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn health(State(state): AppRef) -> Response {
    Json(json!({"status": "ok", "model": state.model.info.id})).into_response()
}

/// Runs `work` (template rendering, tokenizing) so that it holds no runtime thread: a template
/// that takes its full time or memory budget must not stop other requests and `/health`.
/// `block_in_place` moves the runtime's other tasks to another thread while this one blocks,
/// and this request goes on right after on the same thread. A current-thread runtime (tests)
/// cannot do that; there the work runs inline.
fn off_the_runtime<T>(
    state: &AppState,
    work: impl FnOnce(&AppState) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    match tokio::runtime::Handle::current().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(|| work(state)),
        _ => work(state),
    }
}

/// Token ids of a text, or of chat messages rendered through the template.
fn tokenize_body(state: &AppState, body: Body) -> Result<(TokenizeRequest, Vec<u32>), ApiError> {
    let bytes = body_bytes(state, body)?;
    let req: TokenizeRequest = afm_api::parse_json(&bytes)?;
    state.model.info.check(req.model.as_deref())?;
    let text = &state.model.text;
    let tokens = match (&req.prompt, &req.messages) {
        (_, Some(messages)) => {
            crate::limits::check_messages(messages.len(), &state.config.limits)?;
            let messages = normalize_messages(messages)?;
            let kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
            let rendered = text
                .render_chat(
                    &messages,
                    req.tools.as_deref(),
                    req.add_generation_prompt.unwrap_or(true),
                    &kwargs,
                )
                .map_err(|e| {
                    ApiError::invalid("messages", format!("The chat template failed: {e}"))
                })?;
            text.encode(&rendered, true)
        }
        (Some(prompt), None) => text.encode(prompt, req.add_special_tokens.unwrap_or(true)),
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "Send `prompt` (text) or `messages` (chat) to tokenize",
            ))
        }
    };
    Ok((req, tokens))
}

async fn tokenize(State(state): AppRef, body: Body) -> Result<Json<TokenizeResponse>, HttpError> {
    let (req, tokens) = off_the_runtime(&state, |state| tokenize_body(state, body))?;
    let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| String::from_utf8_lossy(&state.model.text.token_bytes(id)).into_owned())
            .collect()
    });
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.model.generator.max_context(),
        tokens,
        token_strs,
    }))
}

async fn count_tokens(
    State(state): AppRef,
    body: Body,
) -> Result<Json<CountTokensResponse>, HttpError> {
    let (_, tokens) = off_the_runtime(&state, |state| tokenize_body(state, body))?;
    Ok(Json(CountTokensResponse {
        count: tokens.len(),
        input_tokens: tokens.len(),
        max_model_len: state.model.generator.max_context(),
    }))
}

async fn not_found(uri: axum::http::Uri) -> HttpError {
    HttpError(ApiError::NotFound(format!("No route for {}", uri.path())))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> HttpError {
    HttpError(ApiError::MethodNotAllowed(format!(
        "{method} is not allowed on {}",
        uri.path()
    )))
}
