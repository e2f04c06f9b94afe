//! Grammar masking inside the real engine: two requests with different grammars decoded in one
//! batch each come out valid under their own grammar — on the tiny random-weight Qwen3 fixture
//! (always; random weights would otherwise write anything) and on SmolLM2-135M with two JSON
//! schemas (when models/ has it).

use std::path::{Path, PathBuf};

use afm_api::OutputConstraint;
use afm_chat::tool_calls::ToolCallFormat;
use afm_chat::Tokenizer;
use afm_engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, GenerateEvent, GenerateRequest,
    SamplingParams, TokenConstraint,
};
use afm_grammar::Grammars;
use afm_models::source::ModelLocation;
use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn start(path: &Path, concurrent: usize) -> (EngineHandle, Tokenizer) {
    let model = afm_models::load_model(&ModelLocation::Gguf(path.to_path_buf())).expect("loads");
    let tokenizer = Tokenizer::from_gguf(model.gguf().expect("gguf")).expect("tokenizer");
    let cfg = EngineConfig {
        concurrent,
        kv_budget_bytes: Some(64 << 20),
        max_context: 1024,
        ..EngineConfig::default()
    };
    (Engine::spawn(model, cfg).expect("engine"), tokenizer)
}

/// The tokens' bytes as text, with no decoder rules (SPM's leading-space removal) applied.
fn bytes_text(tok: &Tokenizer, ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().flat_map(|&t| tok.token_bytes(t)).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn request(prompt: Vec<u32>, seed: u64, max_tokens: usize, eos: &[u32]) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        max_tokens,
        stop_token_ids: eos.to_vec(),
        top_logprobs: None,
    }
}

/// Submits every request before reading any, so they share decode steps; returns each one's
/// tokens and finish reason.
async fn run_batch(
    engine: &EngineHandle,
    reqs: Vec<(GenerateRequest, Box<dyn TokenConstraint>)>,
) -> Vec<(Vec<u32>, FinishReason)> {
    let mut rxs = Vec::new();
    for (req, c) in reqs {
        rxs.push(
            engine
                .submit_constrained(req, Some(c))
                .expect("submitted")
                .1,
        );
    }
    let mut out = Vec::new();
    for mut rx in rxs {
        let mut tokens = Vec::new();
        let reason = loop {
            match rx.recv().await.expect("engine answers") {
                GenerateEvent::Token { id, .. } => tokens.push(id),
                GenerateEvent::Finished { reason, .. } => break reason,
                GenerateEvent::Error { message } => panic!("engine error: {message}"),
            }
        };
        out.push((tokens, reason));
    }
    out
}

#[tokio::test]
async fn two_grammars_in_one_batch_on_random_weights() {
    let (engine, tok) = start(&root().join("tests/fixtures/tiny/qwen3/model-f32.gguf"), 2);
    let grammars = Grammars::new(&tok).expect("trie");
    // The fixture's vocabulary is words and letters (random weights favour short pieces);
    // each grammar picks a different language.
    let a = grammars
        .compile_lark(r#"start: " the" (" brown" | " lazy"){1,3} " fox""#)
        .expect("grammar a");
    let b = grammars
        .compile_lark(r#"start: " crab" (" keep" | " honest" | " tokens"){2,4}"#)
        .expect("grammar b");
    let prompt = tok.encode("the quick brown fox", true, false);
    let eos = tok.eos_ids().to_vec();
    for seed in 0..3 {
        let out = run_batch(
            &engine,
            vec![
                (
                    request(prompt.clone(), seed, 48, &eos),
                    a.constraint(false, false),
                ),
                (
                    request(prompt.clone(), seed + 100, 48, &eos),
                    b.constraint(false, false),
                ),
            ],
        )
        .await;
        let text = |i: usize| bytes_text(&tok, &out[i].0);
        let (ta, tb) = (text(0), text(1));
        assert!(ta.starts_with(" the") && ta.ends_with(" fox"), "{ta:?}");
        assert!(
            ta[4..ta.len() - 4]
                .split(' ')
                .skip(1)
                .all(|w| w == "brown" || w == "lazy"),
            "{ta:?}"
        );
        // Both grammars are finite: each answer ends where its grammar does, never at the limit.
        assert_eq!(out[0].1, FinishReason::Stop, "{ta:?}");
        assert_eq!(out[1].1, FinishReason::Stop, "{tb:?}");
        let words: Vec<&str> = tb.split(' ').skip(1).collect();
        assert_eq!(words[0], "crab", "{tb:?}");
        assert!((3..=5).contains(&words.len()), "{tb:?}");
        assert!(
            words[1..]
                .iter()
                .all(|w| ["keep", "honest", "tokens"].contains(w)),
            "{tb:?}"
        );
    }
}

#[tokio::test]
async fn two_json_schemas_in_one_batch_on_smollm2() {
    let path = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("skipped: {} not fetched", path.display());
        return;
    }
    let (engine, tok) = start(&path, 2);
    let grammars = Grammars::new(&tok).expect("trie");
    let person = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": false});
    let colors = json!({"type": "array", "items": {"enum": ["red", "green", "blue"]},
        "minItems": 2, "maxItems": 3});
    let compile = |schema: &Value| {
        grammars
            .compile(
                &OutputConstraint::JsonSchema {
                    schema: schema.clone(),
                    param: "schema".into(),
                },
                ToolCallFormat::Hermes,
            )
            .expect("compiles")
    };
    let (p, c) = (compile(&person), compile(&colors));
    let prompt = tok.encode(
        "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n",
        false,
        true,
    );
    let eos = tok.eos_ids().to_vec();
    for seed in 0..2 {
        let out = run_batch(
            &engine,
            vec![
                (
                    request(prompt.clone(), seed, 96, &eos),
                    p.constraint(false, false),
                ),
                (
                    request(prompt.clone(), seed, 96, &eos),
                    c.constraint(false, false),
                ),
            ],
        )
        .await;
        let person: Value = serde_json::from_str(&bytes_text(&tok, &out[0].0)).expect("json");
        assert!(person["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 20));
        assert!(person["age"].as_u64().is_some_and(|a| a <= 120));
        assert_eq!(person.as_object().map(|o| o.len()), Some(2));
        let colors: Value = serde_json::from_str(&bytes_text(&tok, &out[1].0)).expect("json");
        let list = colors.as_array().expect("an array");
        assert!((2..=3).contains(&list.len()), "{colors}");
        assert!(list
            .iter()
            .all(|c| ["red", "green", "blue"].contains(&c.as_str().unwrap_or(""))));
        assert!(out.iter().all(|o| o.1 == FinishReason::Stop));
    }
}
