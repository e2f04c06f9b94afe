//! afm-api: the OpenAI wire format. It owns the request and response types (serde), the
//! validation that turns a request into `ValidChatRequest` / `ValidCompletionRequest`, and the
//! single mapping from errors to HTTP status and OpenAI error JSON. It does no I/O: the server
//! and the `-s` command line both go through it.

pub mod error;
pub mod messages;
pub mod request;
pub mod response;
pub mod structured;
pub mod validate;

#[cfg(test)]
mod tests;

pub use error::{from_value, parse_json, parse_object, ApiError, ErrorBody};
pub use request::*;
pub use response::*;
pub use structured::{OutputConstraint, ToolChoice, ToolDef};
pub use validate::*;
