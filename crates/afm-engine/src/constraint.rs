//! Per-request token constraints (grammar-constrained decoding) as seen by the engine: a small
//! trait the caller implements (afm-grammar does, with llguidance) and the logits step that
//! applies it. The engine knows nothing of grammars; it only asks, for each sampled row, which
//! token ids may come next, and tells the constraint which one was chosen.
//!
//! ```text
//!  logits row ─► Constrained::apply: allowed bits from the constraint, others set to -inf
//!             ─► Sampler (bias, penalties, temperature, top-k/p, min-p, draw)
//!             ─► Constrained::commit(token) ─► finished? the engine ends the request (Stop)
//! ```
//!
//! Each sequence owns its constraint, so a batch mixes constrained and free sequences, and a
//! preempted sequence keeps its state (its generated tokens are kept and never re-sampled).

use std::time::{Duration, Instant};

/// Why a constraint could not go on; the engine ends the request with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// What a request's output must satisfy, token by token.
pub trait TokenConstraint: Send {
    /// Sets the bit of every token id that may come next (`allowed` is zeroed by the caller;
    /// bit `i % 32` of word `i / 32`). Returns `false` when this step is unconstrained (e.g.
    /// still inside a reasoning block); `allowed` is then ignored.
    fn allowed(&mut self, allowed: &mut [u32]) -> Result<bool, ConstraintError>;
    /// The token that was sampled (always one `allowed` let through, when constrained).
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;
    /// The constrained output is complete: the request ends here.
    fn is_finished(&self) -> bool;
}

/// A request's constraint with its mask buffer and timing, owned by the engine loop.
pub(crate) struct Constrained {
    inner: Box<dyn TokenConstraint>,
    bits: Vec<u32>,
    /// Time spent in `allowed` and `commit` (for `AFM_DEBUG` and the benchmark).
    pub spent: Duration,
    pub masks: u32,
}

impl Constrained {
    pub fn new(inner: Box<dyn TokenConstraint>) -> Self {
        Constrained {
            inner,
            bits: Vec::new(),
            spent: Duration::ZERO,
            masks: 0,
        }
    }

    /// Sets the logits of tokens the constraint forbids to -inf.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        let t0 = Instant::now();
        self.bits.clear();
        self.bits.resize(logits.len().div_ceil(32), 0);
        let constrained = self.inner.allowed(&mut self.bits)?;
        if constrained {
            let mut any = false;
            for (i, l) in logits.iter_mut().enumerate() {
                if self.bits[i / 32] & (1 << (i % 32)) == 0 {
                    *l = f32::NEG_INFINITY;
                } else {
                    any |= l.is_finite();
                }
            }
            if !any {
                return Err(ConstraintError(
                    "the grammar allows no token of this model's vocabulary here".into(),
                ));
            }
            self.masks += 1;
        }
        self.spent += t0.elapsed();
        Ok(())
    }

    pub fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        let t0 = Instant::now();
        let r = self.inner.commit(token);
        self.spent += t0.elapsed();
        r
    }

    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows only `next` tokens, in order; finished after the last.
    struct Script {
        next: Vec<u32>,
    }

    impl TokenConstraint for Script {
        fn allowed(&mut self, allowed: &mut [u32]) -> Result<bool, ConstraintError> {
            let t = self.next[0] as usize;
            allowed[t / 32] |= 1 << (t % 32);
            Ok(true)
        }
        fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
            if token != self.next.remove(0) {
                return Err(ConstraintError("wrong token".into()));
            }
            Ok(())
        }
        fn is_finished(&self) -> bool {
            self.next.is_empty()
        }
    }

    #[test]
    fn forbidden_tokens_get_minus_infinity() {
        let mut c = Constrained::new(Box::new(Script { next: vec![40, 2] }));
        let mut logits = vec![1.0f32; 50];
        c.apply(&mut logits).unwrap();
        assert_eq!(logits[40], 1.0);
        assert_eq!(
            logits.iter().filter(|l| l.is_finite()).count(),
            1,
            "only token 40 is left"
        );
        c.commit(40).unwrap();
        assert!(!c.is_finished());
        c.commit(2).unwrap();
        assert!(c.is_finished());
    }

    #[test]
    fn a_mask_outside_the_vocabulary_is_an_error() {
        let mut c = Constrained::new(Box::new(Script { next: vec![60] }));
        let mut logits = vec![0.0f32; 50];
        assert!(c.apply(&mut logits).is_err());
    }
}
