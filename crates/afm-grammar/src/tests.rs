//! The constraint on a small hand-made vocabulary (one token per printable ASCII character, a
//! few words, and `<think>`/`</think>`/`</s>` control tokens), driven by a fixed token policy
//! instead of a model: what comes out must parse and satisfy the schema, EOS is allowed only
//! where the grammar accepts, and the reasoning gate lets a `<think>` block through unmasked.

use afm_api::{OutputConstraint, ToolDef};
use afm_chat::tool_calls::ToolCallFormat;
use afm_chat::{Tokenizer, VocabModel, VocabSpec};
use afm_engine::TokenConstraint;
use serde_json::{json, Value};

use crate::{GrammarError, Grammars};

const CONTROL: [&str; 5] = ["<unk>", "<s>", "</s>", "<think>", "</think>"];
const WORDS: [&str; 4] = ["\"name\"", "true", "false", "null"];

fn tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = CONTROL.iter().map(|s| s.to_string()).collect();
    tokens.extend(WORDS.iter().map(|s| s.to_string()));
    tokens.extend((0x21u8..0x7f).map(|b| (b as char).to_string()));
    tokens.push("\u{2581}".into()); // space
    tokens.push("\n".into());
    let mut types = vec![2, 3, 3, 3, 3];
    types.resize(tokens.len(), 1);
    let mut spec = VocabSpec::new(VocabModel::Spm, tokens);
    spec.token_types = types;
    spec.unk = Some(0);
    spec.bos = Some(1);
    spec.eos = Some(2);
    Tokenizer::from_spec(spec).expect("a valid vocabulary")
}

fn allowed_ids(c: &mut dyn TokenConstraint, n: usize) -> Option<Vec<u32>> {
    let mut bits = vec![0u32; n.div_ceil(32)];
    if !c.allowed(&mut bits).expect("mask") {
        return None;
    }
    Some(
        (0..n as u32)
            .filter(|&i| bits[i as usize / 32] & (1 << (i % 32)) != 0)
            .collect(),
    )
}

/// Drives `c` with a policy that closes things early (quotes, brackets, short literals), so
/// every grammar here ends; returns the text and whether EOS was ever offered too early.
fn drive(tok: &Tokenizer, c: &mut dyn TokenConstraint) -> String {
    const PREFER: [&str; 12] = [
        "}", "]", "\"", "true", "0", ",", ":", "\"name\"", "{", "[", "a", "f",
    ];
    let n = tok.vocab_size();
    let mut out = Vec::new();
    for _ in 0..400 {
        let ids = allowed_ids(c, n).expect("constrained");
        assert!(
            !ids.is_empty(),
            "a dead end after {:?}",
            String::from_utf8_lossy(&out)
        );
        let eos_offered = ids.contains(&2);
        let pick = PREFER
            .iter()
            .filter_map(|p| tok.token_id(p).filter(|id| ids.contains(id)))
            .next()
            .unwrap_or_else(|| *ids.iter().find(|&&i| i != 2).unwrap_or(&ids[0]));
        c.commit(pick).expect("commit");
        if pick == 2 {
            assert!(eos_offered);
            break;
        }
        out.extend(tok.token_bytes(pick));
        if c.is_finished() {
            break;
        }
    }
    assert!(
        c.is_finished(),
        "not finished: {}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8(out).expect("utf-8")
}

fn schema(s: Value) -> OutputConstraint {
    OutputConstraint::JsonSchema {
        schema: s,
        param: "response_format.json_schema.schema".into(),
    }
}

#[test]
fn schema_output_parses_and_satisfies_the_schema() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).expect("trie");
    let s = json!({"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2}},
        "required": ["ok", "n", "tags"], "additionalProperties": false});
    let compiled = g
        .compile(&schema(s), ToolCallFormat::Hermes)
        .expect("compiles");
    let text = drive(&tok, compiled.constraint(false, false).as_mut());
    let v: Value = serde_json::from_str(&text).expect(&text);
    assert_eq!(v["ok"], json!(true), "{text}");
    assert!(v["n"].as_u64().is_some_and(|n| n <= 9), "{text}");
    assert_eq!(v["tags"].as_array().map(Vec::len), Some(2), "{text}");
    assert_eq!(
        text.find(": "),
        Some(5),
        "JSON written with ': ' separators: {text}"
    );
}

#[test]
fn eos_is_offered_only_where_the_grammar_accepts() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).expect("trie");
    let compiled = g
        .compile(&schema(json!({"type": "array"})), ToolCallFormat::Hermes)
        .expect("compiles");
    let mut c = compiled.constraint(false, false);
    let n = tok.vocab_size();
    assert!(!allowed_ids(c.as_mut(), n).unwrap().contains(&2));
    c.commit(tok.token_id("[").unwrap()).unwrap();
    assert!(!allowed_ids(c.as_mut(), n).unwrap().contains(&2));
    c.commit(tok.token_id("]").unwrap()).unwrap();
    assert!(c.is_finished(), "nothing can follow a complete array");
}

#[test]
fn reasoning_is_free_until_the_block_closes() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).expect("trie");
    let compiled = g
        .compile(&OutputConstraint::JsonObject, ToolCallFormat::Hermes)
        .unwrap();
    let n = tok.vocab_size();
    // Opened by the template: anything goes, `</think>` spelled in pieces closes it.
    let mut c = compiled.constraint(true, true);
    for ch in "hm</think>".chars() {
        assert!(
            allowed_ids(c.as_mut(), n).is_none(),
            "free inside reasoning"
        );
        c.commit(tok.token_id(&ch.to_string()).unwrap()).unwrap();
    }
    let after = allowed_ids(c.as_mut(), n).expect("constrained after </think>");
    assert_eq!(after, vec![tok.token_id("{").unwrap()]);
    // The model may open the block itself as its first token.
    let mut c = compiled.constraint(false, true);
    let first = allowed_ids(c.as_mut(), n).unwrap();
    assert!(first.contains(&3) && first.contains(&tok.token_id("{").unwrap()));
    c.commit(3).unwrap();
    assert!(allowed_ids(c.as_mut(), n).is_none());
    c.commit(4).unwrap(); // the `</think>` control token
    assert_eq!(
        allowed_ids(c.as_mut(), n).unwrap(),
        vec![tok.token_id("{").unwrap()]
    );
}

#[test]
fn hermes_tool_call_names_an_allowed_tool_with_valid_arguments() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).expect("trie");
    let tools = vec![ToolDef {
        name: "f".into(),
        parameters: json!({"type": "object", "properties": {"x": {"type": "boolean"}},
                           "required": ["x"], "additionalProperties": false}),
    }];
    let c = OutputConstraint::ToolCalls {
        tools,
        required: true,
        parallel: false,
    };
    let compiled = g.compile(&c, ToolCallFormat::Hermes).expect("compiles");
    let text = drive(&tok, compiled.constraint(false, false).as_mut());
    let body = text
        .strip_prefix("<tool_call>\n")
        .and_then(|t| t.strip_suffix("\n</tool_call>"))
        .expect(&text);
    let call: Value = serde_json::from_str(body).expect(body);
    assert_eq!(call, json!({"name": "f", "arguments": {"x": true}}));
}

#[test]
fn bad_schemas_and_the_none_dialect_are_reported() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).expect("trie");
    let bad = schema(json!({"type": "string", "pattern": "(["}));
    match g.compile(&bad, ToolCallFormat::Hermes) {
        Err(GrammarError::Schema { param, .. }) => {
            assert_eq!(param, "response_format.json_schema.schema")
        }
        other => panic!("expected a schema error, got {:?}", other.err()),
    }
    let tools = OutputConstraint::ToolCalls {
        tools: vec![ToolDef {
            name: "f".into(),
            parameters: json!({}),
        }],
        required: true,
        parallel: true,
    };
    assert!(matches!(
        g.compile(&tools, ToolCallFormat::None),
        Err(GrammarError::UnsupportedFormat(_))
    ));
}
