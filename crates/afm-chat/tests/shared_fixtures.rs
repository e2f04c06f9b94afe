//! Cross-check against the project's shared fixtures (recorded independently of this crate):
//! tests/fixtures/llamacpp/<model>.json (llama.cpp ids and detokenized text per GGUF) and
//! tests/fixtures/tokenizer/smollm2 (a transformers tokenizer directory with reference ids).
//! Skipped with a note where a fixture or model is absent.

use afm_chat::{ChatTemplate, Tokenizer};
use afm_models::weights::GgufFile;
use serde_json::{Map, Value};
use std::path::PathBuf;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &PathBuf) -> Option<Value> {
    match std::fs::read_to_string(path) {
        Ok(s) => Some(serde_json::from_str(&s).expect("fixture is JSON")),
        Err(_) => {
            eprintln!("note: {} is absent; skipping", path.display());
            None
        }
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn gguf_ids_equal_shared_llamacpp_fixtures() {
    for name in ["smollm2", "qwen05", "gemma3"] {
        let Some(f) = read(&repo().join(format!("tests/fixtures/llamacpp/{name}.json"))) else {
            continue;
        };
        let model = repo()
            .join("models")
            .join(f["model"]["file"].as_str().unwrap());
        if !model.exists() {
            eprintln!("note: {} is absent; skipping", model.display());
            continue;
        }
        let tok = Tokenizer::from_gguf(&GgufFile::open(&model).unwrap()).unwrap();
        let mut failures = Vec::new();
        for case in f["tokenize"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            for (key, want) in case["ids"].as_object().unwrap() {
                let add = key.contains("add_bos=true");
                let special = key.contains("special=true");
                let got = tok.encode(text, add, special);
                if got != ids(want) {
                    failures.push(format!("{name} {key} {text:?}: got {got:?} want {want}"));
                }
            }
            for special in [true, false] {
                let Some(d) = case.get(format!("detokenize_special={special}")) else {
                    continue;
                };
                let key = format!("add_bos=false,special={special}");
                let got = tok.decode(&ids(&case["ids"][&key]), !special);
                if got != d["text"].as_str().unwrap() {
                    failures.push(format!(
                        "{name} detokenize special={special} {text:?}: got {got:?} want {}",
                        d["text"]
                    ));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

#[test]
fn hf_dir_equals_shared_transformers_fixture() {
    let dir = repo().join("tests/fixtures/tokenizer/smollm2");
    let Some(reference) = read(&dir.join("reference.json")) else {
        return;
    };
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    for s in reference["strings"].as_array().unwrap() {
        let text = s["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false, true), ids(&s["ids"]), "{text:?}");
        assert_eq!(
            tok.decode(&ids(&s["ids"]), false),
            s["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
    let t = ChatTemplate::from_hf_dir(&dir, &tok)
        .unwrap()
        .expect("chat_template.jinja");
    let msgs = [serde_json::json!({"role": "user", "content": "Hi"})];
    let out = t.render(&msgs, None, true, &Map::new()).unwrap();
    assert!(
        out.starts_with("<|im_start|>system\n")
            && out.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{out}"
    );
}
