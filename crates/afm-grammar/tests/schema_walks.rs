//! Issue #6 item 6 on a "tiny model": every schema of tests/fixtures/schemas, sent as a strict
//! `response_format` json_schema, constrains random walks on SmolLM2's real vocabulary (a
//! random-weight model with that tokenizer, in effect: uniform picks among the allowed tokens,
//! steered toward closing what is open). Every walk that ends must be one JSON value; with
//! `AFM_WALKS_OUT=<file>` each is recorded there as a JSON line, and
//! tests/python/test_schema_walks.py validates them with the `jsonschema` package.

use std::path::PathBuf;

use afm_api::structured::{structured_output, OutputRequest};
use afm_api::ResponseFormat;
use afm_chat::tool_calls::ToolCallFormat;
use afm_grammar::Grammars;
use serde_json::{json, Value};

mod common;
use common::{root, smollm2, Rng, Walker};

const WALKS: usize = 8;

fn schema_paths() -> Vec<PathBuf> {
    let dir = root().join("tests/fixtures/schemas");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("schemas")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
}

/// With `AFM_WALKS_OUT=<file>`, appends one JSON line per walk.
fn record(schema: &str, output: &Value, text: &str) {
    let Some(path) = std::env::var_os("AFM_WALKS_OUT") else {
        return;
    };
    use std::io::Write;
    let line = json!({"schema": schema, "output": output, "text": text});
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("walks file");
    f.write_all(format!("{line}\n").as_bytes())
        .expect("written");
}

#[test]
fn every_fixture_schema_walked_on_smollm2_is_one_json_value() {
    let tok = smollm2();
    let g = Grammars::new(&tok).expect("trie");
    let walker = Walker::new(&tok);
    let paths = schema_paths();
    assert!(paths.len() >= 20, "{} schemas", paths.len());
    for (i, p) in paths.iter().enumerate() {
        let name = p
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a file name")
            .to_string();
        let schema: Value =
            serde_json::from_str(&std::fs::read_to_string(p).expect("read")).expect("json");
        // The request path: a strict json_schema response format, grammar constraints on.
        let format: ResponseFormat = serde_json::from_value(json!({"type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": true}}))
        .expect("a response_format");
        let out = structured_output(OutputRequest {
            tools: None,
            tool_choice: None,
            parallel_tool_calls: true,
            response_format: Some(&format),
            grammar_enabled: true,
            default_schema: None,
        })
        .expect("a valid request");
        let constraint = out.constraint.expect("strict schemas are constrained");
        let compiled = g
            .compile(&constraint, ToolCallFormat::None)
            .unwrap_or_else(|e| panic!("{name} compiles: {e}"));
        let mut rng = Rng(0x5eed_0000 + i as u64);
        let mut ended = 0;
        for _ in 0..WALKS {
            let Some(text) = walker.walk_once(&compiled, &mut rng, &name) else {
                continue;
            };
            ended += 1;
            let value: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {text:?}"));
            record(&name, &value, &text);
        }
        assert_eq!(ended, WALKS, "{name}: only {ended}/{WALKS} walks ended");
    }
}
