//! Every error a client can see, and the one place that maps each to an HTTP status and
//! OpenAI's error JSON `{"error":{"message","type","param","code"}}`.
//!
//! Client mistakes are 4xx with a message naming the field, the value and the limit; only
//! failures of the server itself are 5xx.

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON, or a field has the wrong type (serde's message, with the path).
    #[error("{message}")]
    InvalidJson {
        param: Option<String>,
        message: String,
    },
    /// A field is present and well typed but its value is out of range or inconsistent.
    #[error("{message}")]
    InvalidField { param: String, message: String },
    /// A feature the request asks for that afm does not have yet: refused, never ignored.
    #[error("{message}")]
    Unsupported { param: String, message: String },
    #[error("The model `{model}` does not exist; this server serves `{served}`")]
    ModelNotFound { model: String, served: String },
    #[error(
        "This model's maximum context length is {limit} tokens, but the prompt has \
         {prompt_tokens} tokens (at least one token must remain for the answer)"
    )]
    PromptTooLong { prompt_tokens: usize, limit: usize },
    #[error("The request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("The server is busy: {limit} requests are already waiting; retry later")]
    QueueFull { limit: usize },
    #[error("Invalid or missing API key: send `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("The engine is not running: {0}")]
    Unavailable(String),
    /// A client too slow to send its request (`--header-timeout`, `--body-timeout`).
    #[error("{0}")]
    Timeout(String),
    /// More open connections than `--max-connections`.
    #[error("The server has {limit} open connections, its limit; retry later")]
    Overloaded { limit: usize },
    #[error("Internal error: {0}")]
    Internal(String),
}

/// `{"error": {...}}` as OpenAI sends it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidField {
            param: param.into(),
            message: message.into(),
        }
    }

    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Unsupported {
            param: param.into(),
            message: message.into(),
        }
    }

    /// The HTTP status code of this error.
    pub fn status(&self) -> u16 {
        match self {
            ApiError::InvalidJson { .. }
            | ApiError::InvalidField { .. }
            | ApiError::Unsupported { .. }
            | ApiError::PromptTooLong { .. } => 400,
            ApiError::Unauthorized => 401,
            ApiError::ModelNotFound { .. } | ApiError::NotFound(_) => 404,
            ApiError::MethodNotAllowed(_) => 405,
            ApiError::Timeout(_) => 408,
            ApiError::BodyTooLarge { .. } => 413,
            ApiError::QueueFull { .. } => 429,
            ApiError::Internal(_) => 500,
            ApiError::Unavailable(_) | ApiError::Overloaded { .. } => 503,
        }
    }

    /// Seconds a client should wait before retrying, for the `Retry-After` header.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::QueueFull { .. } => Some(1),
            ApiError::Unavailable(_) => Some(5),
            ApiError::Overloaded { .. } => Some(1),
            _ => None,
        }
    }

    fn kind_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self {
            ApiError::InvalidJson { .. } => ("invalid_request_error", Some("invalid_json")),
            ApiError::InvalidField { .. } => ("invalid_request_error", Some("invalid_value")),
            ApiError::Unsupported { .. } => ("invalid_request_error", Some("unsupported")),
            ApiError::ModelNotFound { .. } => ("invalid_request_error", Some("model_not_found")),
            ApiError::PromptTooLong { .. } => {
                ("invalid_request_error", Some("context_length_exceeded"))
            }
            ApiError::BodyTooLarge { .. } => ("invalid_request_error", Some("body_too_large")),
            ApiError::QueueFull { .. } => ("rate_limit_error", Some("queue_full")),
            ApiError::Unauthorized => ("authentication_error", Some("invalid_api_key")),
            ApiError::NotFound(_) => ("not_found_error", None),
            ApiError::MethodNotAllowed(_) => ("invalid_request_error", Some("method_not_allowed")),
            ApiError::Unavailable(_) => ("server_error", Some("unavailable")),
            ApiError::Timeout(_) => ("invalid_request_error", Some("timeout")),
            ApiError::Overloaded { .. } => ("server_error", Some("too_many_connections")),
            ApiError::Internal(_) => ("server_error", None),
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidJson { param, .. } => param.clone(),
            ApiError::InvalidField { param, .. } | ApiError::Unsupported { param, .. } => {
                Some(param.clone())
            }
            ApiError::ModelNotFound { .. } => Some("model".into()),
            ApiError::PromptTooLong { .. } => Some("messages".into()),
            _ => None,
        }
    }

    /// The JSON body sent with [`ApiError::status`].
    pub fn body(&self) -> ErrorBody {
        let (kind, code) = self.kind_and_code();
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: kind.to_string(),
                param: self.param(),
                code: code.map(str::to_string),
            },
        }
    }
}

/// Parses a request body, naming the offending field on a type error
/// (e.g. `temperature: invalid type: string "hot", expected f64`).
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    from_value(&parse_object(body)?)
}

/// The body as a JSON object: syntax errors and non-objects are reported here.
pub fn parse_object(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::InvalidJson {
            param: None,
            message: "The request body is empty; expected a JSON object".into(),
        });
    }
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| json_error(None, e))?;
    if !value.is_object() {
        return Err(ApiError::InvalidJson {
            param: None,
            message: "The request body must be a JSON object".into(),
        });
    }
    Ok(value)
}

/// Deserializes a parsed body (or a view of it), naming the field on a type error.
pub fn from_value<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        let param = (path != "." && !path.is_empty()).then_some(path);
        json_error(param, err.into_inner())
    })
}

fn json_error(param: Option<String>, inner: serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    let message = match (&param, inner.classify()) {
        (_, Category::Syntax | Category::Eof) => {
            format!("The request body is not valid JSON: {inner}")
        }
        (Some(p), _) => format!("Invalid field `{p}`: {inner}"),
        (None, _) => format!("Invalid request: {inner}"),
    };
    ApiError::InvalidJson { param, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Req {
        temperature: Option<f64>,
        messages: Vec<String>,
    }

    #[test]
    fn type_errors_name_the_field() {
        let err = parse_json::<Req>(br#"{"messages":[],"temperature":"hot"}"#).unwrap_err();
        assert_eq!(err.status(), 400);
        let body = err.body();
        assert_eq!(body.error.param.as_deref(), Some("temperature"));
        assert!(
            body.error.message.contains("temperature"),
            "{}",
            body.error.message
        );
    }

    #[test]
    fn syntax_errors_are_400() {
        let err = parse_json::<Req>(b"{not json").unwrap_err();
        assert_eq!(err.status(), 400);
        assert!(err.to_string().contains("not valid JSON"));
        assert_eq!(parse_json::<Req>(b"  ").unwrap_err().status(), 400);
    }

    #[test]
    fn missing_fields_are_named() {
        let err = parse_json::<Req>(b"{}").unwrap_err();
        assert!(err.to_string().contains("messages"), "{err}");
    }

    #[test]
    fn queue_full_is_429_with_retry_after() {
        let err = ApiError::QueueFull { limit: 4 };
        assert_eq!(err.status(), 429);
        assert_eq!(err.retry_after(), Some(1));
        assert_eq!(err.body().error.kind, "rate_limit_error");
    }
}
