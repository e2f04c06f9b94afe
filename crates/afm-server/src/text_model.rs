//! The real [`TextModel`]: afm-chat's tokenizer and chat template, and afm-grammar's
//! compiler when grammar constraints are on.

use std::sync::Arc;

use afm_api::{ApiError, OutputConstraint};
use afm_chat::tool_calls::ToolCallFormat;
use afm_chat::{ChatTemplate, IncrementalDecoder, Tokenizer};
use afm_engine::TokenConstraint;
use afm_grammar::{GrammarError, Grammars};
use serde_json::{Map, Value};

use crate::seams::{Detokenizer, TextModel};

pub struct ChatText {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    /// The BOS token's text, to avoid a second BOS when the template already wrote one.
    bos_text: Option<String>,
    /// Detected once: from the template's call examples, else the `model_type`.
    tool_format: ToolCallFormat,
    /// `--enable-grammar-constraints`: the vocabulary as llguidance's token trie.
    grammars: Option<Grammars>,
}

impl ChatText {
    pub fn new(tokenizer: Tokenizer, template: ChatTemplate) -> Self {
        let bos_text = tokenizer
            .bos_id()
            .filter(|_| tokenizer.adds_bos())
            .map(|id| String::from_utf8_lossy(&tokenizer.token_bytes(id)).into_owned())
            .filter(|t| !t.is_empty());
        let tool_format = ToolCallFormat::detect("", Some(template.source()));
        ChatText {
            tokenizer: Arc::new(tokenizer),
            template,
            bos_text,
            tool_format,
            grammars: None,
        }
    }

    /// Turns grammar-constrained decoding on (builds the token trie once).
    pub fn with_grammars(mut self) -> Result<Self, GrammarError> {
        self.grammars = Some(Grammars::new(&self.tokenizer)?);
        Ok(self)
    }

    /// The HF `model_type` (e.g. `qwen3_coder`), for the tool-call dialect when the template
    /// shows no call example.
    pub fn with_model_type(mut self, model_type: &str) -> Self {
        self.tool_format = ToolCallFormat::detect(model_type, Some(self.template.source()));
        self
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

impl TextModel for ChatText {
    fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, String> {
        self.template
            .render(messages, tools, add_generation_prompt, kwargs)
            .map_err(|e| e.to_string())
    }

    /// `add_special` follows the model's BOS rule (as llama.cpp does), except that a text
    /// already starting with the BOS token (templates often write it) gets no second one.
    fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        let has_bos = self
            .bos_text
            .as_deref()
            .is_some_and(|b| text.starts_with(b));
        self.tokenizer.encode(text, add_special && !has_bos, true)
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false)
    }

    fn detokenizer(&self) -> Box<dyn Detokenizer> {
        Box::new(IncrementalDecoder::new(self.tokenizer.clone()))
    }

    fn detokenizer_with_special(&self) -> Box<dyn Detokenizer> {
        Box::new(SpecialsShown {
            inner: IncrementalDecoder::new(self.tokenizer.clone()).with_special(true),
            tokenizer: self.tokenizer.clone(),
        })
    }

    fn tool_call_format(&self) -> ToolCallFormat {
        self.tool_format
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.tokenizer.token_bytes(id)
    }

    fn output_constraints(
        &self,
        output: &OutputConstraint,
        format: ToolCallFormat,
        choices: usize,
        prompt_opens_reasoning: bool,
        reasoning: bool,
    ) -> Result<Option<Vec<Box<dyn TokenConstraint>>>, ApiError> {
        let Some(grammars) = &self.grammars else {
            return Ok(None);
        };
        let compiled = match grammars.compile(output, format) {
            Ok(c) => c,
            // No grammar for this dialect or these tools: best effort, marked downgraded.
            Err(e @ (GrammarError::UnsupportedFormat(_) | GrammarError::Inexpressible { .. })) => {
                if std::env::var("AFM_DEBUG").is_ok_and(|v| v == "1") {
                    eprintln!("[Grammar] downgraded: {e}");
                }
                return Ok(None);
            }
            Err(GrammarError::Schema { param, message }) => {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param} cannot be enforced as a grammar: {message}"),
                ))
            }
            Err(e) => return Err(ApiError::Internal(e.to_string())),
        };
        Ok(Some(
            (0..choices)
                .map(|_| compiled.constraint(prompt_opens_reasoning, reasoning))
                .collect(),
        ))
    }

    fn stop_token_ids(&self) -> Vec<u32> {
        self.tokenizer.eos_ids().to_vec()
    }

    fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }
}

/// afm-chat's decoder, owning its tokenizer: control tokens give no text, incomplete UTF-8
/// waits for the next token.
impl Detokenizer for IncrementalDecoder<Arc<Tokenizer>> {
    fn push(&mut self, id: u32) -> String {
        IncrementalDecoder::push(self, id)
    }

    fn finish(&mut self) -> String {
        IncrementalDecoder::finish(self)
    }
}

/// Shows special tokens' text (tool-call markers are often special tokens) but never the stop
/// ids that end the answer.
struct SpecialsShown {
    inner: IncrementalDecoder<Arc<Tokenizer>>,
    tokenizer: Arc<Tokenizer>,
}

impl Detokenizer for SpecialsShown {
    fn push(&mut self, id: u32) -> String {
        if self.tokenizer.eos_ids().contains(&id) {
            return String::new();
        }
        self.inner.push(id)
    }

    fn finish(&mut self) -> String {
        self.inner.finish()
    }
}
