//! The model's vocabulary as llguidance sees it: one byte string per token id, built once per
//! model from afm-chat's tokenizer. Control tokens are marked with llguidance's 0xFF prefix so
//! that grammar text can never match them (they are reachable only as `<name>` in Lark);
//! user-defined added tokens such as Qwen's `<tool_call>` stay plain text, so a grammar's
//! literal `"<tool_call>"` can be written with that one token.

use std::sync::Arc;

use afm_chat::Tokenizer;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::GrammarError;

/// llguidance's tokenizer environment for `tokenizer`, its end-of-generation ids as EOS.
pub fn tok_env(tokenizer: &Tokenizer) -> Result<TokEnv, GrammarError> {
    let n = tokenizer.vocab_size();
    let words: Vec<Vec<u8>> = (0..n as u32)
        .map(|id| {
            let bytes = tokenizer.token_bytes(id);
            if tokenizer.is_special(id) && !bytes.is_empty() {
                let mut marked = Vec::with_capacity(bytes.len() + 1);
                marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
                marked.extend_from_slice(&bytes);
                marked
            } else {
                bytes
            }
        })
        .collect();
    let eos: Vec<u32> = tokenizer
        .eos_ids()
        .iter()
        .copied()
        .filter(|&id| (id as usize) < n)
        .collect();
    let Some(&first) = eos.first() else {
        return Err(GrammarError::Vocabulary(
            "the tokenizer has no end-of-generation token, so a grammar could never end".into(),
        ));
    };
    let info = TokRxInfo {
        vocab_size: n as u32,
        tok_eos: first,
        tok_bos: tokenizer.bos_id(),
        tok_pad: None,
        tok_unk: None,
        tok_end_of_turn: None,
    };
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    // Greedy tokenization is enough: it is used only for forced tokens, which afm does not use.
    Ok(Arc::new(ApproximateTokEnv::new(trie)))
}
