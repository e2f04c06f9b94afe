//! The HF tokenizer.json path gives transformers' ids and decodes (recorded by
//! fixtures/record_hf.py). SmolLM2 (with the published Digits + ByteLevel pre-tokenizer) and
//! Qwen2.5 directories are rebuilt from the GGUF vocabulary plus a committed skeleton; Gemma 3's
//! converted tokenizer.json is used where fixtures/record_hf.py has written models/hf/gemma3.

use afm_chat::Tokenizer;
use afm_models::weights::{GgufFile, GgufValue};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(here().join("tests/fixtures").join(name)).expect("fixture exists"),
    )
    .expect("fixture is JSON")
}

fn strings(g: &GgufFile, key: &str) -> Vec<String> {
    g.get(key)
        .and_then(GgufValue::as_array)
        .expect(key)
        .iter()
        .map(|v| v.as_str().expect("string").to_string())
        .collect()
}

/// Writes tokenizer.json + tokenizer_config.json for `name` into a fresh temp dir.
fn rebuild(name: &str, gguf: &str) -> Option<PathBuf> {
    let path = here().join("../../models").join(gguf);
    if !path.exists() {
        eprintln!(
            "note: {} is absent (run scripts/fetch_models.sh); skipping {name}",
            path.display()
        );
        return None;
    }
    let g = GgufFile::open(&path).expect("GGUF opens");
    let tokens = strings(&g, "tokenizer.ggml.tokens");
    let types: Vec<i64> = g
        .get("tokenizer.ggml.token_type")
        .and_then(GgufValue::as_array)
        .expect("types")
        .iter()
        .map(|v| v.as_i64().expect("int"))
        .collect();
    let mut tj = fixture(&format!("hf_{name}.skeleton.json"));
    let vocab: Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|&(i, _)| types[i] == 3 || types[i] == 4)
        .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": types[i] == 3}))
        .collect();
    tj["model"]["vocab"] = Value::Object(vocab);
    tj["model"]["merges"] = json!(strings(&g, "tokenizer.ggml.merges"));
    tj["added_tokens"] = json!(added);
    let dir = std::env::temp_dir().join(format!("afm-chat-hf-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).expect("write tokenizer.json");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        fixture(&format!("hf_{name}.config.json")).to_string(),
    )
    .expect("write config");
    Some(dir)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn check(name: &str, dir: &Path) {
    let tok = Tokenizer::from_hf_dir(dir).expect("tokenizer.json loads");
    let reference = fixture(&format!("hf_{name}.json"));
    let mut failures = Vec::new();
    let cases = reference["cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let add = case["add_special"].as_bool().unwrap();
        let (want, got) = (ids(&case["ids"]), tok.encode(text, add, true));
        if got != want {
            failures.push(format!(
                "encode({text:?}, add_special={add}):\n  got  {got:?}\n  want {want:?}"
            ));
        }
    }
    for case in reference["decodes"].as_array().unwrap() {
        let skip = case["skip_special"].as_bool().unwrap();
        let (got, want) = (
            tok.decode(&ids(&case["ids"]), skip),
            case["text"].as_str().unwrap(),
        );
        if got != want {
            failures.push(format!(
                "decode(skip_special={skip}) of {:?}:\n  got  {got:?}\n  want {want:?}",
                case["ids"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} differences from transformers:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_tokenizer_json_equals_transformers() {
    if let Some(dir) = rebuild("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") {
        check("smollm2", &dir);
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn qwen25_tokenizer_json_equals_transformers() {
    if let Some(dir) = rebuild("qwen25", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") {
        check("qwen25", &dir);
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn gemma3_tokenizer_json_equals_transformers() {
    let dir = here().join("../../models/hf/gemma3");
    if !dir.join("tokenizer.json").exists() {
        eprintln!("note: {} is absent (python3 crates/afm-chat/tests/fixtures/record_hf.py makes it); skipping", dir.display());
        return;
    }
    check("gemma3", &dir);
}
