//! Plain data crossing the engine boundary: what a caller submits and what it gets back.

use tokio::sync::mpsc;

/// Sampling settings of one request, already validated at the edge.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// In [0, 1); 0 disables.
    pub min_p: f32,
    /// 1 disables.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Same seed and request ⇒ same output.
    pub seed: Option<u64>,
    /// Added to the logit of a token id before sampling.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

/// One generation: a tokenized prompt and how to continue it.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_tokens: Vec<u32>,
    pub sampling: SamplingParams,
    /// Tokens to generate at most (validated ≥ 1).
    pub max_tokens: usize,
    /// Token ids that end the generation (EOS / end-of-turn); not emitted as text.
    pub stop_token_ids: Vec<u32>,
    /// Return this many top alternatives with each token (`None`: no logprobs at all).
    pub top_logprobs: Option<usize>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The caller cancelled (disconnect, /cancel, stop string found by the caller).
    Cancelled,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// (token id, logprob), best first.
    pub top: Vec<(u32, f32)>,
}

/// Counters and timings reported when a generation ends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Seconds waiting for admission.
    pub queue_time: f64,
    /// Seconds from admission to the first generated token.
    pub prompt_time: f64,
    /// Seconds from the first generated token to the end.
    pub completion_time: f64,
}

/// What the engine sends back for one request, in order: tokens, then exactly one `Finished`
/// or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerateEvent {
    Token {
        id: u32,
        logprob: Option<TokenLogprob>,
    },
    Finished {
        reason: FinishReason,
        stats: GenerationStats,
    },
    Error {
        message: String,
    },
}

/// Identifies a submitted request for cancellation.
pub type RequestId = u64;

/// The receiving half handed to the caller of `submit`.
pub type EventReceiver = mpsc::UnboundedReceiver<GenerateEvent>;
