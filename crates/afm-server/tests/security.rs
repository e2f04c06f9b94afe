//! No request field makes the server read a file: paths in `model`, in content parts, in the
//! model route, and `include`/`import` in a chat template all fail without touching the disk.

mod common;

use afm_chat::ChatTemplate;
use serde_json::{json, Map};

const SECRET: &str = "/etc/passwd";

#[tokio::test]
async fn paths_in_requests_are_names_not_files() {
    let s = common::start().await;
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"model": SECRET, "messages": common::user("hi")}),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert!(!body.to_string().contains("root:"));

    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": format!("file://{SECRET}")}}
            ]}]}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "unsupported");

    let (status, body) = s.get("/v1/models/..%2F..%2Fetc%2Fpasswd").await;
    assert_eq!(status, 404, "{body}");
    assert!(!body.to_string().contains("root:"));

    // A prompt that looks like a path is text to tokenize, nothing more.
    let (status, body) = s.post("/v1/tokenize", &json!({"prompt": SECRET})).await;
    assert_eq!(status, 200);
    assert_eq!(body["count"], SECRET.len());
}

#[test]
fn templates_cannot_include_or_import_files() {
    for src in [
        format!("{{% include '{SECRET}' %}}"),
        format!("{{% import '{SECRET}' as x %}}{{{{ x }}}}"),
        format!("{{% extends '{SECRET}' %}}"),
        format!("{{% from '{SECRET}' import y %}}"),
        // minijinja 2.24 panicked compiling an import into something that is not a name.
        format!("{{% import '{SECRET}' as 2 %}}"),
    ] {
        let out = ChatTemplate::from_source(&src, "<s>", "</s>").and_then(|tpl| {
            tpl.render(
                &[json!({"role": "user", "content": "hi"})],
                None,
                true,
                &Map::new(),
            )
        });
        let err = out.expect_err(&src).to_string();
        assert!(!err.contains("root:"), "{err}");
    }
}
