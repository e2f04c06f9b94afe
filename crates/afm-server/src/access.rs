//! Who may call the server: the `--api-key` check and the `--cors-origin` allow-list.
//! The server binds 127.0.0.1 by default; these matter once it listens wider.

use std::sync::Arc;

use afm_api::ApiError;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::routes::HttpError;
use crate::AppState;

/// Routes open without a key: the health probe, and the WebUI's static files (they hold no data;
/// the page's API calls still need the key).
fn is_public(path: &str) -> bool {
    matches!(path, "/health" | "/" | "/favicon.svg") || path.starts_with("/webui/")
}

pub async fn require_api_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(key) = &state.config.api_key else {
        return next.run(req).await;
    };
    // Preflight requests carry no credentials by design; CORS decides them.
    if is_public(req.uri().path()) || req.method() == Method::OPTIONS {
        return next.run(req).await;
    }
    let sent = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(sent.as_bytes(), key.as_bytes()) {
        next.run(req).await
    } else {
        HttpError(ApiError::Unauthorized).into_response()
    }
}

/// Equal-length comparison that does not stop at the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A CORS layer allowing exactly `origins` (`*` allows any); `None` when the list is empty, so
/// browsers on other origins are refused by default.
pub fn cors(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_whole() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"secret"));
    }
}
