//! The `gemma4` GGUF tokenizer (`tokenizer.ggml.model = "gemma4"`: SentencePiece-style BPE
//! over raw UTF-8, '▁' for spaces, `<0xXX>` byte fallback, split at newline runs) gives
//! llama.cpp's ids and text. The vocabulary is a tiny one in Gemma 4's shape, converted by
//! llama.cpp's convert_hf_to_gguf.py (--vocab-only); the ids and decodes were recorded with
//! llama-cpp-python 0.3.36 over the same strings as the other vocabularies' tests
//! (scripts/gen_tiny_gguf.py writes both files).

use afm_chat::Tokenizer;
use afm_models::weights::GgufFile;
use serde_json::Value;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny/gemma4_gguf")
        .join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn gemma4_gguf_vocabulary_tokenizes_as_llama_cpp() {
    let g = GgufFile::open(&fixture("vocab.gguf")).expect("GGUF opens");
    assert_eq!(
        g.get("tokenizer.ggml.model").and_then(|v| v.as_str()),
        Some("gemma4")
    );
    let tok = Tokenizer::from_gguf(&g).expect("gemma4 tokenizer loads");
    let text = std::fs::read_to_string(fixture("llama_cpp_tokens.json")).expect("reference");
    let reference: Value = serde_json::from_str(&text).expect("reference is JSON");
    assert_eq!(
        tok.vocab_size() as u64,
        reference["n_vocab"].as_u64().unwrap()
    );
    assert_eq!(
        tok.eos_ids(),
        ids(&reference["eog"]).as_slice(),
        "end-of-generation set"
    );
    let mut failures = Vec::new();
    let cases = reference["cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let add = case["add_special"].as_bool().unwrap();
        let parse = case["parse_special"].as_bool().unwrap();
        let (got, want) = (tok.encode(text, add, parse), ids(&case["ids"]));
        if got != want {
            failures.push(format!(
                "encode({text:?}, add_special={add}, parse_special={parse}):\n  got  {got:?}\n  want {want:?}"
            ));
        }
    }
    let decodes = reference["decodes"].as_array().unwrap();
    for case in decodes {
        let skip = case["skip_special"].as_bool().unwrap();
        let got = tok.decode(&ids(&case["ids"]), skip);
        let want = case["text"].as_str().unwrap();
        if got != want {
            failures.push(format!(
                "decode(skip_special={skip}) of {:?}:\n  got  {got:?}\n  want {want:?}",
                case["ids"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len() + decodes.len(),
        failures.join("\n")
    );
}

/// llama.cpp adds BOS to every gemma4 prompt whatever the file says, so a gemma4 vocabulary
/// that names no BOS token is refused with a message saying so.
#[test]
fn gemma4_vocabulary_without_a_bos_token_is_refused() {
    use afm_chat::{VocabModel, VocabSpec};
    let spec = VocabSpec::new(VocabModel::Gemma4, vec!["<bos>".into(), "a".into()]);
    let err = Tokenizer::from_spec(spec).err().expect("refused");
    assert!(err.to_string().contains("bos_token_id"), "{err}");
}
