//! Request bodies as the server receives them: JSON decoding and validation of chat,
//! completions and tokenize requests. Every body must give a valid request or an `ApiError`
//! with a 4xx status, never a panic.
#![no_main]

use afm_api::messages::normalize_messages;
use afm_api::{
    validate_chat, validate_completion, ChatCompletionRequest, CompletionRequest, ModelInfo,
    RequestDefaults, TokenizeRequest,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let defaults = RequestDefaults::default();
    let model = ModelInfo {
        id: "fuzz-model".into(),
        aliases: vec!["models/fuzz.gguf".into()],
        vocab_size: 1000,
    };
    let client_error = |e: &afm_api::ApiError| {
        assert!((400..500).contains(&e.status()), "{e:?} is not a client error");
        let _ = serde_json::to_string(&e.body());
    };
    match ChatCompletionRequest::parse(data) {
        Ok(req) => {
            if let Err(e) = validate_chat(req, &defaults, &model) {
                client_error(&e);
            }
        }
        Err(e) => client_error(&e),
    }
    match CompletionRequest::parse(data) {
        Ok(req) => {
            if let Err(e) = validate_completion(req, &defaults, &model) {
                client_error(&e);
            }
        }
        Err(e) => client_error(&e),
    }
    match afm_api::parse_json::<TokenizeRequest>(data) {
        Ok(req) => {
            if let Some(messages) = &req.messages {
                if let Err(e) = normalize_messages(messages) {
                    client_error(&e);
                }
            }
        }
        Err(e) => client_error(&e),
    }
});
