//! Token ids and decoded text equal llama.cpp's (recorded by fixtures/record_llamacpp.py with
//! llama-cpp-python) for the three GGUF vocabularies: GPT-2-style BPE (SmolLM2, Qwen2.5) and
//! SentencePiece (Gemma 3), over tricky strings with and without special-token parsing.

use afm_chat::Tokenizer;
use afm_models::weights::GgufFile;
use serde_json::Value;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Loads the model's tokenizer and its reference, or `None` (with a note) if the GGUF is absent.
fn load(name: &str) -> Option<(Tokenizer, Value)> {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/llamacpp_{name}.json"));
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(&fixture).expect("fixture exists"))
            .expect("fixture is JSON");
    let file = reference["model_file"].as_str().expect("model_file");
    let path = root().join("models").join(file);
    if !path.exists() {
        eprintln!(
            "note: {} is absent (run scripts/fetch_models.sh); skipping {name}",
            path.display()
        );
        return None;
    }
    let g = GgufFile::open(&path).expect("GGUF opens");
    Some((
        Tokenizer::from_gguf(&g).expect("tokenizer loads"),
        reference,
    ))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn check_model(name: &str) {
    let Some((tok, reference)) = load(name) else {
        return;
    };
    assert_eq!(
        tok.vocab_size() as u64,
        reference["n_vocab"].as_u64().unwrap()
    );
    assert_eq!(
        tok.eos_ids(),
        ids(&reference["eog"]).as_slice(),
        "{name}: end-of-generation set"
    );
    let mut failures = Vec::new();
    let cases = reference["cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let (add, parse) = (
            case["add_special"].as_bool().unwrap(),
            case["parse_special"].as_bool().unwrap(),
        );
        let want = ids(&case["ids"]);
        let got = tok.encode(text, add, parse);
        if got != want {
            failures.push(format!("encode({text:?}, add_special={add}, parse_special={parse}):\n  got  {got:?}\n  want {want:?}"));
        }
    }
    for case in reference["decodes"].as_array().unwrap() {
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
        "{name}: {} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_ids_equal_llamacpp() {
    check_model("smollm2");
}

#[test]
fn qwen25_ids_equal_llamacpp() {
    check_model("qwen25");
}

#[test]
fn gemma3_ids_equal_llamacpp() {
    check_model("gemma3");
}
