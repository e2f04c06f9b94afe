//! The one forward contract every architecture implements.
//!
//! A step carries any number of new tokens per sequence, so prefill, chunked prefill, decode and
//! speculative verification are the same call:
//!
//! ```text
//! tokens: [ a0 a1 a2 a3 | b7 | c3 c4 ]      concatenated, one span per sequence
//! seqs:   [ {len 4, pos0 0}, {len 1, pos0 7}, {len 2, pos0 3} ]
//! logits: one row per sequence with `logits: true`, for its last new token
//! ```
//!
//! [`StatePool`]: afm_runtime::compute::StatePool

use afm_runtime::attention::AttnSeq;
use afm_runtime::compute::{ComputeError, KvPool, LayerStateShape};
use afm_runtime::kv_store::LayerKvShape;

#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub len: usize,
    /// Position of the first new token (= tokens already in the cache).
    pub pos0: usize,
    /// Block ids covering positions `0..pos0 + len`.
    pub block_table: &'a [u32],
    /// Return logits for this sequence's last new token.
    pub logits: bool,
    /// The sequence's recurrent-state slot in the pool's [`StatePool`], for models with
    /// recurrent layers (`state_shapes` not empty); `None` for attention-only models. The slot
    /// must hold exactly `pos0` tokens of this sequence (zeroed when `pos0` is 0).
    pub state_slot: Option<u32>,
}

#[derive(Debug, Clone, Copy)]
pub struct ForwardBatch<'a> {
    pub tokens: &'a [u32],
    pub seqs: &'a [SeqChunk<'a>],
}

impl ForwardBatch<'_> {
    /// Position of every token, in order.
    pub fn positions(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .flat_map(|s| s.pos0..s.pos0 + s.len)
            .collect()
    }

    /// Each sequence's rows, first position and block table, for attention.
    pub fn attn_seqs(&self) -> Vec<AttnSeq<'_>> {
        let mut row0 = 0;
        self.seqs
            .iter()
            .map(|s| {
                let a = AttnSeq {
                    row0,
                    len: s.len,
                    pos0: s.pos0,
                    block_table: s.block_table,
                };
                row0 += s.len;
                a
            })
            .collect()
    }

    /// Row indices (into `tokens`) whose logits are wanted.
    pub fn logit_rows(&self) -> Vec<usize> {
        let mut row = 0;
        let mut rows = Vec::new();
        for s in self.seqs {
            row += s.len;
            if s.logits {
                rows.push(row - 1);
            }
        }
        rows
    }
}

/// A causal language model: weights only, on one device (the loader's); the KV cache is the
/// engine's, made on that device, and comes in as an input.
pub trait CausalLm: Send + Sync {
    /// Writes the new tokens' K/V into `kv` and returns `[logit rows][vocab]` logits, in host
    /// memory. Fails only on a device error or a batch that does not fit `kv` (block ids,
    /// table lengths, positions beyond the model's context on a GPU).
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvPool) -> Result<Vec<f32>, ComputeError>;
    /// Cache shape of each layer.
    fn kv_shapes(&self) -> Vec<LayerKvShape>;
    fn vocab_size(&self) -> usize;
    /// Recurrent state each sequence carries, per recurrent layer (Gated DeltaNet's conv
    /// window and state matrix). Empty for attention-only models; otherwise the engine attaches
    /// a [`StatePool`] to the KV pool and gives every sequence a slot.
    fn state_shapes(&self) -> Vec<LayerStateShape> {
        Vec::new()
    }
}
