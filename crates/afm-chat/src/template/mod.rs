//! Chat templates (placeholder while the tokenizer lands).
pub struct ChatTemplate;
