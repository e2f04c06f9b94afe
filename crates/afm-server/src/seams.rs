//! The two seams the server is written against, so that the whole HTTP surface can be tested
//! with scripted fakes: [`Generator`] (the engine: token ids in, token events out) and
//! [`TextModel`] (template, tokenizer, detokenizer). The real implementations are one small
//! impl each (`engine_impl.rs`, `text_model.rs`).

use afm_api::ApiError;
use afm_api::OutputConstraint;
use afm_chat::tool_calls::ToolCallFormat;
use afm_engine::{EventReceiver, GenerateRequest, RequestId, TokenConstraint};
use serde_json::{Map, Value};

/// Why a submission was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("queue full (limit {limit})")]
    QueueFull { limit: usize },
    #[error("prompt has {prompt} tokens; the context holds {limit}")]
    PromptTooLong { prompt: usize, limit: usize },
    #[error("the engine has stopped")]
    Stopped,
    #[error("{0}")]
    Other(String),
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull { limit } => ApiError::QueueFull { limit },
            SubmitError::PromptTooLong { prompt, limit } => ApiError::PromptTooLong {
                prompt_tokens: prompt,
                limit,
            },
            SubmitError::Stopped => ApiError::Unavailable("the engine has stopped".into()),
            SubmitError::Other(m) => ApiError::Internal(m),
        }
    }
}

/// Runs generations. Dropping the receiver, or `cancel`, stops one.
pub trait Generator: Send + Sync + 'static {
    fn submit(&self, req: GenerateRequest) -> Result<(RequestId, EventReceiver), SubmitError>;
    /// `submit` with a token constraint (a grammar) on every sampled token. Generators that
    /// cannot mask (the scripted fakes) run the request unconstrained.
    fn submit_constrained(
        &self,
        req: GenerateRequest,
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> Result<(RequestId, EventReceiver), SubmitError> {
        drop(constraint);
        self.submit(req)
    }
    fn cancel(&self, id: RequestId);
    /// Longest sequence (prompt + answer) in tokens.
    fn max_context(&self) -> usize;
    /// Live counters for `/metrics`; generators without any report none.
    fn metrics(&self) -> Option<&afm_engine::EngineMetrics> {
        None
    }
    /// The device profile for `afm_profile` (`--gpu-profile`, `X-AFM-Profile`); GPU engines
    /// only.
    fn device_profile(&self) -> Option<&afm_engine::gpu_profile::DeviceProfile> {
        None
    }
}

/// Turns token ids into text as they arrive, never splitting a UTF-8 character.
pub trait Detokenizer: Send {
    /// Text completed by this token (may be empty while a character is incomplete).
    fn push(&mut self, id: u32) -> String;
    /// Whatever is still held at the end.
    fn finish(&mut self) -> String;
}

/// The text side of the served model.
pub trait TextModel: Send + Sync + 'static {
    /// Renders the chat template. Errors are the template's own message (usually a client
    /// mistake such as roles out of order).
    fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, String>;
    /// Token ids of `text`; special-token text is parsed as special tokens.
    fn encode(&self, text: &str, add_special: bool) -> Vec<u32>;
    fn decode(&self, ids: &[u32]) -> String;
    fn detokenizer(&self) -> Box<dyn Detokenizer>;
    /// Like [`detokenizer`](Self::detokenizer), but special tokens keep their text (all but
    /// the stop ids): tool-call markers are special tokens in some vocabularies.
    fn detokenizer_with_special(&self) -> Box<dyn Detokenizer> {
        self.detokenizer()
    }
    /// The tool-call dialect this model writes (from its `model_type` and chat template).
    /// Hermes, the most common one, when a model cannot tell.
    fn tool_call_format(&self) -> afm_chat::tool_calls::ToolCallFormat {
        afm_chat::tool_calls::ToolCallFormat::Hermes
    }
    /// One grammar constraint per choice enforcing `output` (tool calls written in
    /// `format`); `prompt_opens_reasoning` / `reasoning` place the grammar after `</think>`.
    /// `Ok(None)`: this model cannot enforce it, and the request is served best effort.
    /// A schema that does not compile is the client's 400.
    fn output_constraints(
        &self,
        output: &OutputConstraint,
        format: ToolCallFormat,
        choices: usize,
        prompt_opens_reasoning: bool,
        reasoning: bool,
    ) -> Result<Option<Vec<Box<dyn TokenConstraint>>>, ApiError> {
        let _ = (output, format, choices, prompt_opens_reasoning, reasoning);
        Ok(None)
    }
    /// The raw bytes of one token (for logprobs `bytes`).
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    /// End-of-sequence / end-of-turn ids.
    fn stop_token_ids(&self) -> Vec<u32>;
    fn vocab_size(&self) -> usize;
}
