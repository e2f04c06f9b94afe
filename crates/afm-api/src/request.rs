//! OpenAI request bodies as they arrive on the wire, before validation. Every field is
//! optional where OpenAI's is, so that range checks (with messages naming the limit) happen in
//! `validate`, not as serde errors. Unknown fields are ignored, as OpenAI does.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::{from_value, parse_object, ApiError};

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// Filled by [`ChatCompletionRequest::parse`] from the same object (serde's `flatten`
    /// would lose the field name in type errors).
    #[serde(skip)]
    pub sampling: SamplingFields,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<ResponseFormat>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub reasoning_effort: Option<String>,
}

impl ChatCompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value = parse_object(body)?;
        let mut req: Self = from_value(&value)?;
        req.sampling = from_value(&value)?;
        Ok(req)
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value = parse_object(body)?;
        let mut req: Self = from_value(&value)?;
        req.sampling = from_value(&value)?;
        Ok(req)
    }
}

/// Fields shared by chat and text completions.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub max_tokens: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    #[serde(alias = "repeat_penalty")]
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role the chat template sees: `developer` is OpenAI's new name for `system`.
    pub fn template_name(self) -> &'static str {
        match self {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<Value>>,
    pub tool_call_id: Option<String>,
    /// Earlier reasoning sent back by a client; some templates render or drop it.
    pub reasoning_content: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptField,
    /// Filled by [`CompletionRequest::parse`], as for chat.
    #[serde(skip)]
    pub sampling: SamplingFields,
    /// Legacy logprobs: how many alternatives per token (0 = the sampled token only).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

/// A prompt as text or token ids, one or a batch.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenBatches(Vec<Vec<u32>>),
}

/// `POST /v1/tokenize` and `POST /v1/count_tokens`: text (under any of the names peers use)
/// or chat messages rendered through the template.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    #[serde(alias = "content", alias = "text", alias = "input")]
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    pub tools: Option<Vec<Value>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(alias = "with_pieces")]
    pub return_token_strs: Option<bool>,
}
