//! Per-request token state the scheduler plans with: the tokens so far, how many of them have
//! K/V in the cache, and the block table holding that K/V. No sampling settings, no text.
//!
//! ```text
//!  tokens:  p0 p1 p2 p3 p4 p5 | g0 g1 g2        prompt_len = 6, 3 generated
//!           |<-- num_computed = 8 -->|
//!                                      g2: sampled last step, computed by the next decode
//! ```

use crate::kv_blocks::BlockId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    /// Queued for admission (new, or preempted and waiting to recompute).
    Waiting,
    /// Admitted: holds blocks and is scheduled every step it has tokens to compute.
    Running,
    /// Removed from the scheduler by `finish`.
    Finished,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    pub id: u64,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache (a prefix of `tokens`).
    pub num_computed: usize,
    /// Blocks holding positions `0..num_computed` and room for the current chunk.
    pub block_table: Vec<BlockId>,
    /// Prompt tokens served from the prefix cache at first admission (for `usage`).
    pub cached_prompt_tokens: usize,
    /// Generated tokens allowed (validated >= 1); the engine finishes the sequence when reached.
    pub max_tokens: usize,
    /// Caller's arrival stamp (informational; the scheduler keeps FIFO order itself).
    pub arrival: u64,
    pub state: SeqState,
    /// Times this sequence was preempted and had to recompute.
    pub num_preemptions: u32,
    /// Hybrid models: a block boundary past the prefix hit where the cached K/V chain went on
    /// (set at admission); a chunk ends there so a state snapshot can be kept for later hits.
    pub snapshot_at: Option<usize>,
}

impl Sequence {
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: usize, arrival: u64) -> Self {
        Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            block_table: Vec::new(),
            cached_prompt_tokens: 0,
            max_tokens,
            arrival,
            state: SeqState::Waiting,
            num_preemptions: 0,
            snapshot_at: None,
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Whether `max_tokens` tokens have been generated; such a sequence is not scheduled again.
    pub fn reached_max_tokens(&self) -> bool {
        self.num_generated() >= self.max_tokens
    }

    /// Tokens the next steps must compute: everything not yet in the cache, unless no further
    /// token is wanted (then the last sampled token is never computed).
    pub fn tokens_to_compute(&self) -> usize {
        if self.reached_max_tokens() {
            0
        } else {
            self.tokens.len() - self.num_computed
        }
    }

    /// Most KV slots this sequence can ever occupy: every token but the last generated one.
    pub fn max_kv_tokens(&self) -> usize {
        self.prompt_len + self.max_tokens.max(1) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_tokens() {
        let mut s = Sequence::new(7, vec![1, 2, 3], 2, 0);
        assert_eq!(
            (s.len(), s.num_generated(), s.tokens_to_compute()),
            (3, 0, 3)
        );
        s.num_computed = 3;
        s.tokens.push(9);
        assert_eq!(s.generated(), &[9]);
        assert_eq!(
            s.tokens_to_compute(),
            1,
            "the sampled token is computed by the next decode"
        );
        s.num_computed = 4;
        s.tokens.push(10);
        assert!(s.reached_max_tokens());
        assert_eq!(s.tokens_to_compute(), 0, "no token wanted after max_tokens");
        assert_eq!(s.max_kv_tokens(), 4);
    }
}
