//! afm-grammar: grammar-constrained decoding with llguidance. It turns a request's
//! [`OutputConstraint`] (afm-api's plain data: a JSON schema, `json_object`, or tool calls in
//! the model's dialect) into one [`TokenConstraint`] per sequence for afm-engine, which masks
//! the logits with it before sampling.
//!
//! A crate of its own so that llguidance (and its compile time) stays out of afm-chat and
//! afm-engine: the engine sees only the small trait, the tokenizer only gives its bytes.
//!
//! ```text
//!  Grammars::new(tokenizer)            once per model: token trie + llguidance's slicer
//!  Grammars::compile(constraint, fmt)  once per request: the grammar, checked (400 if bad)
//!  Compiled::constraint(reasoning)     once per choice: its own matcher
//! ```
//!
//! Files: grammars.rs (response formats, dispatch), dialects.rs (one tool-call layout per
//! dialect), params.rs (argument values for the XML-like dialects), gemma.rs (Gemma's value
//! syntax), lark.rs (Lark text and the vocabulary's markers), constraint.rs, vocab.rs.

mod constraint;
mod dialects;
mod gemma;
mod grammars;
mod lark;
mod params;
#[cfg(test)]
mod tests;
mod vocab;

use afm_api::OutputConstraint;
use afm_chat::tool_calls::ToolCallFormat;
use afm_chat::Tokenizer;
use afm_engine::TokenConstraint;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv};
use llguidance::{Matcher, ParserFactory};

pub use constraint::{GrammarConstraint, Reasoning};
pub use grammars::grammar_for;
pub use lark::Markers;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer cannot back a grammar.
    #[error("grammar vocabulary: {0}")]
    Vocabulary(String),
    /// The schema or grammar does not compile; `param` names the request field it came from.
    #[error("{param}: {message}")]
    Schema { param: String, message: String },
    /// Strict tool calls in this dialect have no grammar (served best effort).
    #[error("no tool-call grammar for the {0} dialect")]
    UnsupportedFormat(String),
    /// A tool's schema cannot be written in the dialect's argument syntax (served best
    /// effort), e.g. a top-level `anyOf` where the dialect writes one element per parameter.
    #[error("tools cannot be enforced in the {dialect} dialect: {reason}")]
    Inexpressible { dialect: String, reason: String },
}

/// The model's grammar compiler: shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    env: TokEnv,
    think: Option<u32>,
    markers: Markers,
}

impl Grammars {
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let env = vocab::tok_env(tokenizer)?;
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Grammars {
            factory,
            env,
            think: tokenizer.token_id("<think>"),
            markers: Markers::from_tokenizer(tokenizer),
        })
    }

    /// Compiles `constraint`; tool calls are written in `format`.
    pub fn compile(
        &self,
        constraint: &OutputConstraint,
        format: ToolCallFormat,
    ) -> Result<Compiled, GrammarError> {
        let param = match constraint {
            OutputConstraint::JsonSchema { param, .. } => param.clone(),
            OutputConstraint::JsonObject => "response_format".into(),
            OutputConstraint::ToolCalls { .. } => "tools".into(),
        };
        self.build(grammar_for(constraint, format, &self.markers)?, param)
    }

    /// Compiles a grammar in llguidance's Lark dialect.
    pub fn compile_lark(&self, lark: &str) -> Result<Compiled, GrammarError> {
        self.build(
            TopLevelGrammar::from_lark(lark.to_string()),
            "grammar".into(),
        )
    }

    fn build(&self, grammar: TopLevelGrammar, param: String) -> Result<Compiled, GrammarError> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Schema {
                param: param.clone(),
                message: first_line(&e.to_string()),
            })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Schema {
                param,
                message: first_line(&e),
            });
        }
        Ok(Compiled {
            matcher,
            env: self.env.clone(),
            think: self.think,
        })
    }
}

/// A compiled grammar, ready to constrain any number of sequences.
pub struct Compiled {
    matcher: Matcher,
    env: TokEnv,
    think: Option<u32>,
}

impl Compiled {
    /// A fresh constraint for one sequence. `prompt_opens_reasoning`: the chat template left
    /// the model inside `<think>`; `reasoning`: the model may open one itself.
    pub fn constraint(
        &self,
        prompt_opens_reasoning: bool,
        reasoning: bool,
    ) -> Box<dyn TokenConstraint> {
        let gate = match (prompt_opens_reasoning, reasoning, self.think) {
            (true, _, _) => Reasoning::Open,
            (false, true, Some(think)) => Reasoning::MayOpen(think),
            _ => Reasoning::None,
        };
        Box::new(GrammarConstraint::new(
            self.matcher.deep_clone(),
            self.env.clone(),
            gate,
        ))
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).to_string()
}
