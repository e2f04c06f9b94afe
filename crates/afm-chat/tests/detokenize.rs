//! Decoding: round trips through real vocabularies, and streaming that never emits a broken
//! UTF-8 char when a char's bytes are spread over several tokens.

use afm_chat::{IncrementalDecoder, Tokenizer, VocabModel, VocabSpec};
use afm_models::weights::GgufFile;
use std::path::PathBuf;

const TEXT: &str =
    "Hello, 世界! 👨\u{200d}👩\u{200d}👧 café ünïcode ∑ 😀🎉\n\tcode: fn main() {}  ";

fn gguf_tokenizer(file: &str) -> Option<Tokenizer> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    if !path.exists() {
        eprintln!(
            "note: {} is absent (run scripts/fetch_models.sh); skipping",
            path.display()
        );
        return None;
    }
    Some(
        Tokenizer::from_gguf(&GgufFile::open(&path).expect("GGUF opens")).expect("tokenizer loads"),
    )
}

fn stream(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut dec = IncrementalDecoder::new(tok);
    let mut pieces: Vec<String> = ids.iter().map(|&id| dec.push(id)).collect();
    pieces.push(dec.finish());
    pieces
}

#[test]
fn round_trip_and_streaming_on_real_vocabularies() {
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ] {
        let Some(tok) = gguf_tokenizer(file) else {
            continue;
        };
        let ids = tok.encode(TEXT, false, false);
        assert_eq!(
            tok.decode(&ids, false),
            TEXT,
            "{file}: decode(encode(text)) == text"
        );
        let pieces = stream(&tok, &ids);
        assert_eq!(
            pieces.concat(),
            TEXT,
            "{file}: streamed text equals the whole text"
        );
        assert!(
            pieces.iter().all(|p| !p.contains('\u{FFFD}')),
            "{file}: no replacement chars while streaming"
        );
        // Some emoji are spelled by byte tokens in every one of these vocabularies.
        assert!(
            pieces.iter().any(String::is_empty),
            "{file}: some tokens end inside a char and are held back"
        );
    }
}

#[test]
fn special_tokens_are_hidden_unless_asked() {
    let Some(tok) = gguf_tokenizer("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>", false, true);
    assert_eq!(stream(&tok, &ids).concat(), "assistant\nHi");
    let mut dec = IncrementalDecoder::new(&tok).with_special(true);
    let shown: String = ids.iter().map(|&id| dec.push(id)).collect();
    assert_eq!(shown, "<|im_start|>assistant\nHi<|im_end|>");
    assert!(tok.eos_ids().contains(&ids[ids.len() - 1]));
    assert_eq!(tok.token_id("<|im_end|>"), Some(ids[ids.len() - 1]));
}

#[test]
fn split_multibyte_char_is_held_until_complete() {
    // SPM vocabulary with byte tokens only for "é" (C3 A9) and "😀" (F0 9F 98 80).
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into(), "a".into()];
    let mut types = vec![2, 3, 3, 1];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let mut spec = VocabSpec::new(VocabModel::Spm, tokens);
    spec.token_types = types;
    spec.add_space_prefix = Some(false);
    spec.bos = Some(1);
    spec.eos = Some(2);
    let tok = Tokenizer::from_spec(spec).expect("valid spec");
    let byte = |b: u8| 4 + b as u32;
    let ids = tok.encode("aé😀", false, false);
    assert_eq!(
        ids,
        vec![
            3,
            byte(0xC3),
            byte(0xA9),
            byte(0xF0),
            byte(0x9F),
            byte(0x98),
            byte(0x80)
        ]
    );
    assert_eq!(stream(&tok, &ids), ["a", "", "é", "", "", "", "😀", ""]);
    // A stream cut inside a char ends with U+FFFD for the incomplete bytes.
    let mut dec = IncrementalDecoder::new(&tok);
    assert_eq!(dec.push(byte(0xF0)), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
    // An invalid byte in the middle does not stall the stream.
    let mut dec = IncrementalDecoder::new(&tok);
    assert_eq!(dec.push(byte(0xFF)), "\u{FFFD}");
    assert_eq!(dec.push(3), "a");
}

#[test]
fn shared_types_are_thread_safe_and_decoder_can_own_its_tokenizer() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<afm_chat::ChatTemplate>();
    let mut spec = VocabSpec::new(
        VocabModel::Spm,
        vec![
            "<unk>".into(),
            "<s>".into(),
            "</s>".into(),
            "\u{2581}hi".into(),
        ],
    );
    spec.bos = Some(1);
    spec.eos = Some(2);
    let tok = std::sync::Arc::new(Tokenizer::from_spec(spec).unwrap());
    let mut dec = IncrementalDecoder::new(tok.clone());
    assert_eq!(dec.push(3), " hi");
}
