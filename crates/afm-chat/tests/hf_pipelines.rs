//! HF pipeline pieces the real models here do not exercise (Metaspace with prepend "first",
//! Prepend/Replace normalizers with byte fallback and a Strip decoder, Split behaviours,
//! contiguous Digits, lstrip/rstrip added tokens): ids and decodes equal HF `tokenizers` on small
//! trained vocabularies (fixtures/record_hf_pipelines.py).

use afm_chat::Tokenizer;
use serde_json::Value;
use std::path::PathBuf;

#[test]
fn pipelines_equal_hf_tokenizers() {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let f: Value = serde_json::from_str(
        &std::fs::read_to_string(here.join("tests/fixtures/hf_pipelines.json")).unwrap(),
    )
    .unwrap();
    let mut failures = Vec::new();
    for (name, case) in f.as_object().unwrap() {
        let dir = std::env::temp_dir().join(format!("afm-chat-pipe-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), case["tokenizer"].to_string()).unwrap();
        let tok = Tokenizer::from_hf_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let _ = std::fs::remove_dir_all(&dir);
        for c in case["cases"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            let want: Vec<u32> = c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(text, false, true);
            if got != want {
                failures.push(format!(
                    "{name} encode {text:?}:\n  got  {got:?}\n  want {want:?}"
                ));
                continue;
            }
            for (skip, key) in [(false, "decoded"), (true, "decoded_skip")] {
                let got = tok.decode(&want, skip);
                if got != c[key].as_str().unwrap() {
                    failures.push(format!(
                        "{name} decode(skip={skip}) {text:?}:\n  got  {got:?}\n  want {:?}",
                        c[key]
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
