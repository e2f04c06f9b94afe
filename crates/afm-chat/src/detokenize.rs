//! Streaming detokenization: turns generated ids into text one id at a time, emitting only
//! complete UTF-8 (a multi-byte char split across tokens is held back until it completes).

use crate::Tokenizer;
use std::ops::Deref;

/// Holds the tokenizer as `&Tokenizer` or as an owning handle such as `Arc<Tokenizer>` (for
/// decoders that live in per-request state).
pub struct IncrementalDecoder<T: Deref<Target = Tokenizer>> {
    tok: T,
    pending: Vec<u8>,
    show_special: bool,
    /// SPM models strip the space prefix of the first piece, as `decode` does.
    strip_leading_space: bool,
}

impl<T: Deref<Target = Tokenizer>> IncrementalDecoder<T> {
    /// Special tokens (control/unknown) contribute no text.
    pub fn new(tok: T) -> Self {
        Self {
            tok,
            pending: Vec::new(),
            show_special: false,
            strip_leading_space: false,
        }
    }

    /// Include special tokens' text (e.g. "<|im_end|>") in the output.
    pub fn with_special(mut self, show: bool) -> Self {
        self.show_special = show;
        self
    }

    /// Drop one leading space from the first text (SPM models whose prompt ended in a special
    /// token start their reply with the space prefix).
    pub fn strip_leading_space(mut self, strip: bool) -> Self {
        self.strip_leading_space = strip;
        self
    }

    /// Feeds one id; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        if !self.show_special && self.tok.is_special(id) {
            return String::new();
        }
        let bytes = self.tok.token_bytes(id);
        let bytes = if self.strip_leading_space && bytes.first() == Some(&b' ') {
            &bytes[1..]
        } else {
            &bytes[..]
        };
        if !bytes.is_empty() {
            self.strip_leading_space = false;
        }
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Ends the stream: whatever is held back, with invalid bytes as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Emits the longest prefix of `pending` that is valid UTF-8 or definitely invalid, keeping an
    /// incomplete trailing sequence for the next token.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: the prefix was just validated.
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }
}
