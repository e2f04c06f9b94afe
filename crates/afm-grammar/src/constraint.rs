//! One sequence's grammar state: an llguidance `Matcher` behind afm-engine's
//! [`TokenConstraint`], plus the reasoning gate (the grammar applies only after `</think>`).
//!
//! The next mask is computed right after each commit, so the engine can end the request the
//! moment nothing but EOS is left (no extra forward pass), and `allowed` usually only copies.

use afm_engine::{ConstraintError, TokenConstraint};
use llguidance::toktrie::{SimpleVob, TokEnv, TokTrie};
use llguidance::Matcher;

/// Where generation starts relative to a reasoning block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reasoning {
    /// No reasoning block: the grammar applies from the first token.
    None,
    /// The prompt opened `<think>`: free text until `</think>`.
    Open,
    /// The model may open `<think>` (token id given) as its first token.
    MayOpen(u32),
}

const CLOSE: &[u8] = b"</think>";

pub struct GrammarConstraint {
    matcher: Matcher,
    env: TokEnv,
    reasoning: Reasoning,
    /// Last bytes of the reasoning text, to see `</think>` across token boundaries.
    tail: Vec<u8>,
    next_mask: Option<SimpleVob>,
    finished: bool,
}

impl GrammarConstraint {
    pub(crate) fn new(matcher: Matcher, env: TokEnv, reasoning: Reasoning) -> Self {
        GrammarConstraint {
            matcher,
            env,
            reasoning,
            tail: Vec::new(),
            next_mask: None,
            finished: false,
        }
    }

    fn trie(&self) -> &TokTrie {
        self.env.tok_trie()
    }

    /// The next mask. End-of-generation ids are allowed only where the grammar accepts:
    /// some are also ordinary text (Qwen's EOG set holds the plain token `</s>`), and the
    /// trie walk would offer them inside a string, where the engine would stop mid-call.
    fn compute_mask(&mut self) -> Result<SimpleVob, ConstraintError> {
        let mut mask = self
            .matcher
            .compute_mask()
            .map_err(|e| ConstraintError(e.to_string()))?;
        let accepting = self
            .matcher
            .is_accepting()
            .map_err(|e| ConstraintError(e.to_string()))?;
        if !accepting {
            for &t in self.env.tok_trie().eos_tokens() {
                mask.disallow_token(t);
            }
        }
        Ok(mask)
    }

    /// Inside reasoning: watch for the closing tag.
    fn reasoning_token(&mut self, token: u32) {
        let bytes = self.env.tok_trie().token(token);
        let bytes = match bytes.first() {
            Some(&TokTrie::SPECIAL_TOKEN_MARKER) => &bytes[1..],
            _ => bytes,
        };
        self.tail.extend_from_slice(bytes);
        if self.tail.windows(CLOSE.len()).any(|w| w == CLOSE) {
            self.reasoning = Reasoning::None;
            self.tail.clear();
        } else if self.tail.len() > 64 {
            self.tail.drain(..self.tail.len() - CLOSE.len());
        }
    }
}

impl TokenConstraint for GrammarConstraint {
    fn allowed(&mut self, allowed: &mut [u32]) -> Result<bool, ConstraintError> {
        if self.reasoning == Reasoning::Open {
            return Ok(false);
        }
        let mask = match self.next_mask.take() {
            Some(m) => m,
            None => self.compute_mask()?,
        };
        let vocab = self.trie().vocab_size();
        for (i, (out, &word)) in allowed.iter_mut().zip(mask.as_slice()).enumerate() {
            // Bits past the tokenizer's vocabulary (padding rows of the model) stay off.
            let valid = match vocab.saturating_sub(i * 32) {
                0 => 0,
                n if n >= 32 => u32::MAX,
                n => (1u32 << n) - 1,
            };
            *out = word & valid;
        }
        if let Reasoning::MayOpen(think) = self.reasoning {
            let t = think as usize;
            if let Some(w) = allowed.get_mut(t / 32) {
                *w |= 1 << (t % 32);
            }
        }
        self.next_mask = Some(mask);
        Ok(true)
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        match self.reasoning {
            Reasoning::Open => {
                self.reasoning_token(token);
                return Ok(());
            }
            Reasoning::MayOpen(think) if token == think => {
                self.reasoning = Reasoning::Open;
                self.next_mask = None;
                return Ok(());
            }
            Reasoning::MayOpen(_) => self.reasoning = Reasoning::None,
            Reasoning::None => {}
        }
        self.next_mask = None;
        if self.trie().eos_tokens().contains(&token) {
            // Only allowed where the grammar accepts.
            self.finished = true;
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError(e.to_string()))?;
        if self.matcher.is_stopped() {
            self.finished = true;
            return Ok(());
        }
        let mask = self.compute_mask()?;
        let eos = self
            .trie()
            .eos_tokens()
            .iter()
            .filter(|&&t| mask.is_allowed(t))
            .count();
        if mask.num_set() == 0 {
            // Not even EOS: llguidance gave up (e.g. its lexer ran out of fuel). Ending here
            // would hand the parser a cut-off call, so it is an error instead.
            return Err(ConstraintError(
                "the grammar allows no token after this one".into(),
            ));
        }
        // Nothing but EOS may follow: the output is complete.
        self.finished = mask.num_set() == eos;
        self.next_mask = Some(mask);
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.finished
    }
}
