//! The SmolLM2 byte-level BPE tokenizer (committed fixture tests/fixtures/tokenizer/smollm2) on
//! arbitrary input. Checked: encoding valid text and decoding it gives the text back (when each
//! of its characters does alone: SmolLM2's vocabulary lacks some byte tokens, so a few
//! characters such as U+5F1F7 lose a byte, in Hugging Face `tokenizers` too); decoding
//! arbitrary ids (in range or not) never panics; `token_bytes` of every id concatenates to
//! what decoding the ids gives.
#![no_main]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use afm_chat::Tokenizer;
use libfuzzer_sys::fuzz_target;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer/smollm2");
        Tokenizer::from_hf_dir(&dir).expect("the committed SmolLM2 tokenizer fixture loads")
    })
}

/// Whether `c` alone survives encode + decode (memoized).
fn representable(tok: &Tokenizer, c: char) -> bool {
    static SEEN: OnceLock<Mutex<HashMap<char, bool>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Mutex::default);
    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
    *seen.entry(c).or_insert_with(|| {
        let s = c.to_string();
        tok.decode(&tok.encode(&s, false, false), false) == s
    })
}

fuzz_target!(|data: &[u8]| {
    let tok = tokenizer();
    if let Ok(text) = std::str::from_utf8(data) {
        let ids = tok.encode(text, false, false);
        if text.chars().all(|c| representable(tok, c)) {
            assert_eq!(tok.decode(&ids, false), text, "decode(encode(text)) != text");
        }
        // With BOS and special-token parsing: no panic on any text.
        let ids = tok.encode(text, true, true);
        let _ = tok.decode(&ids, true);
    }
    // Arbitrary ids, many past the vocabulary.
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0)))
        .collect();
    let decoded = tok.decode(&ids, false);
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
    assert_eq!(decoded, String::from_utf8_lossy(&bytes), "decode != concatenated token bytes");
});
