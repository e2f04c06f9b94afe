//! Chat templates render exactly as transformers' `apply_chat_template` renders them (recorded by
//! fixtures/record_templates.py): SmolLM2's ChatML template, Qwen2.5's tools template, and a
//! template exercising the HF helpers. Also: GGUF templates load, Gemma 3 base gets the fallback.

use afm_chat::{ChatTemplate, Tokenizer};
use afm_models::weights::GgufFile;
use serde_json::{Map, Value};
use std::path::PathBuf;

fn fixture() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("fixture exists"))
        .expect("fixture is JSON")
}

#[test]
fn renderings_equal_transformers() {
    let f = fixture();
    let mut failures = Vec::new();
    for case in f["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let src = f["templates"][name].as_str().unwrap();
        let t = ChatTemplate::from_source(src, "<s>", "</s>")
            .unwrap_or_else(|e| panic!("{name} compiles: {e}"));
        let tools: Option<Vec<Value>> = case["tools"].as_array().cloned();
        let kwargs: Map<String, Value> = case["kwargs"].as_object().cloned().unwrap_or_default();
        let got = t.render(
            case["messages"].as_array().unwrap(),
            tools.as_deref(),
            case["add_generation_prompt"].as_bool().unwrap(),
            &kwargs,
        );
        let want = case["output"].as_str().unwrap();
        match got {
            Ok(got) if got == want => {}
            Ok(got) => failures.push(format!(
                "{name}/{}:\n--- got\n{got}\n--- want\n{want}",
                case["case"]
            )),
            Err(e) => failures.push(format!("{name}/{}: error {e}", case["case"])),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

fn gguf(file: &str) -> Option<GgufFile> {
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
    Some(GgufFile::open(&path).expect("GGUF opens"))
}

#[test]
fn gguf_templates_load_and_gemma_base_has_none() {
    let f = fixture();
    for (name, file) in [
        ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("qwen25", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ] {
        let Some(g) = gguf(file) else { continue };
        let tok = Tokenizer::from_gguf(&g).unwrap();
        let t = ChatTemplate::from_gguf(&g, &tok)
            .unwrap()
            .expect("has a template");
        assert_eq!(t.source(), f["templates"][name].as_str().unwrap());
    }
    if let Some(g) = gguf("gemma-3-270m-q4_k_m.gguf") {
        let tok = Tokenizer::from_gguf(&g).unwrap();
        assert!(ChatTemplate::from_gguf(&g, &tok).unwrap().is_none());
        // The fallback's text, tokenized with the model's BOS rule, starts with <bos>.
        let msgs = [serde_json::json!({"role": "user", "content": "Hi"})];
        let text = ChatTemplate::fallback()
            .render(&msgs, None, true, &Map::new())
            .unwrap();
        assert_eq!(text, "User: Hi\n\nAssistant:");
        assert_eq!(tok.encode(&text, true, true)[0], tok.bos_id().unwrap());
    }
}

#[test]
fn hf_dir_template_loads() {
    // models/hf/qwen25 is written by fixtures/record_hf.py; it carries chat_template.jinja.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/hf/qwen25");
    if !dir.join("tokenizer.json").exists() {
        eprintln!("note: {} is absent; skipping", dir.display());
        return;
    }
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    let t = ChatTemplate::from_hf_dir(&dir, &tok)
        .unwrap()
        .expect("has a template");
    assert!(t.source().contains("<|im_start|>"));
    let msgs = [serde_json::json!({"role": "user", "content": "Hi"})];
    let out = t.render(&msgs, None, true, &Map::new()).unwrap();
    assert!(
        out.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{out}"
    );
}
