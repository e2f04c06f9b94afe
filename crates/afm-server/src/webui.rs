//! The built-in chat page (`GET /`) and its static assets under `/webui/`, compiled into the
//! binary so the page works offline and always matches the server that serves it.
//!
//! It owns only the serving: the page itself lives in `crates/afm-server/webui/` (plain HTML,
//! CSS and ES modules, no build step) and talks to the public API like any other client.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// One embedded file: its URL path, its content type and its bytes.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

macro_rules! asset {
    ($path:literal, $file:literal, $type:expr) => {
        Asset {
            path: $path,
            content_type: $type,
            body: include_bytes!(concat!("../webui/", $file)),
        }
    };
}

const HTML: &str = "text/html; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const SVG: &str = "image/svg+xml";

static ASSETS: &[Asset] = &[
    asset!("/", "index.html", HTML),
    asset!("/webui/style.css", "style.css", CSS),
    asset!("/webui/app.js", "app.js", JS),
    asset!("/webui/chat.js", "chat.js", JS),
    asset!("/webui/markdown.js", "markdown.js", JS),
    asset!("/webui/metrics.js", "metrics.js", JS),
    asset!("/webui/store.js", "store.js", JS),
    asset!("/favicon.svg", "favicon.svg", SVG),
];

/// The page's routes; merge them into the API router. Generic over the state so they can sit
/// beside any handlers.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS.iter().fold(Router::new(), |router, asset| {
        router.route(asset.path, get(move || async move { respond(asset) }))
    })
}

fn respond(asset: &'static Asset) -> Response {
    let mut resp = asset.body.into_response();
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    // A newer afm binary may serve different assets at the same URLs: always revalidate.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use afm_api::ModelInfo;

    use crate::testing::{FakeGenerator, FakeText};
    use crate::{AppState, ServedModel, ServerConfig};

    /// The full API router (as `afm serve` builds it) on an ephemeral port.
    async fn live_server() -> String {
        let model = ServedModel {
            info: ModelInfo {
                id: "fake-model".into(),
                aliases: Vec::new(),
                vocab_size: 259,
            },
            text: Arc::new(FakeText),
            generator: Arc::new(FakeGenerator::new()),
        };
        let state = AppState::new(model, ServerConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind an ephemeral port");
        let base = format!("http://{}", listener.local_addr().expect("local addr"));
        tokio::spawn(crate::serve(listener, state, std::future::pending()));
        base
    }

    async fn get(base: &str, path: &str) -> (u16, String, String) {
        let resp = reqwest::get(format!("{base}{path}")).await.expect("GET");
        let status = resp.status().as_u16();
        let ctype = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        (status, ctype, resp.text().await.expect("body"))
    }

    #[tokio::test]
    async fn root_serves_the_chat_page_as_html() {
        let base = live_server().await;
        let (status, ctype, body) = get(&base, "/").await;
        assert_eq!(status, 200);
        assert_eq!(ctype, "text/html; charset=utf-8");
        assert!(body.starts_with("<!doctype html>"), "{}", &body[..40]);
        assert!(body.contains(r#"<script type="module" src="/webui/app.js">"#));
    }

    #[tokio::test]
    async fn every_asset_the_page_loads_is_served_with_its_type() {
        let base = live_server().await;
        for (path, ctype) in [
            ("/webui/app.js", "text/javascript; charset=utf-8"),
            ("/webui/markdown.js", "text/javascript; charset=utf-8"),
            ("/webui/style.css", "text/css; charset=utf-8"),
            ("/favicon.svg", "image/svg+xml"),
        ] {
            let (status, got, body) = get(&base, path).await;
            assert_eq!((status, got.as_str()), (200, ctype), "{path}");
            assert!(!body.is_empty(), "{path} is empty");
        }
        // Every module imported by another is in the table (a missing one breaks the page).
        for module in ["chat.js", "markdown.js", "metrics.js", "store.js"] {
            let (status, ..) = get(&base, &format!("/webui/{module}")).await;
            assert_eq!(status, 200, "/webui/{module}");
        }
    }

    #[tokio::test]
    async fn the_page_needs_nothing_from_the_network() {
        let base = live_server().await;
        for path in ["/", "/webui/app.js", "/webui/style.css", "/webui/chat.js"] {
            let (_, _, body) = get(&base, path).await;
            for remote in ["http://", "https://", "//cdn", "@import"] {
                assert!(!body.contains(remote), "{path} references {remote}");
            }
        }
    }

    #[tokio::test]
    async fn api_routes_and_unknown_paths_are_unchanged() {
        let base = live_server().await;
        let (status, ctype, _) = get(&base, "/v1/models").await;
        assert_eq!((status, ctype.as_str()), (200, "application/json"));
        let (status, _, body) = get(&base, "/webui/nope.js").await;
        assert_eq!(status, 404);
        assert!(body.contains("No route for /webui/nope.js"), "{body}");
    }
}
