//! afm-chat: the text side of a request. Tokenizers (GGUF vocabularies with llama.cpp's
//! algorithms, HF tokenizer.json), chat templates (minijinja, sandboxed), and incremental
//! detokenization for streaming. It holds no model weights and no engine state.

pub mod detokenize;
pub mod template;
pub mod tokenizer;
pub mod tool_calls;

pub use detokenize::IncrementalDecoder;
pub use template::ChatTemplate;
pub use tokenizer::{Tokenizer, VocabModel, VocabSpec};

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {message}")]
    Json { path: String, message: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("chat template raised: {0}")]
    TemplateRaised(String),
    #[error("chat template output exceeds {limit} bytes")]
    TemplateOutputTooLarge { limit: usize },
    /// The sandboxed renderer ran out of memory (a template that builds huge values).
    #[error(
        "the model's chat template exceeded its memory limit ({limit_mib} MiB) while rendering"
    )]
    TemplateMemoryLimit { limit_mib: u64 },
    #[error("the model's chat template exceeded its time limit ({seconds} s) while rendering")]
    TemplateTimeLimit { seconds: f64 },
    /// The sandboxed renderer could not be started or failed otherwise.
    #[error("chat template renderer: {0}")]
    TemplateRenderer(String),
}
