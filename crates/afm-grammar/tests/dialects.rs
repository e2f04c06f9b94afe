//! Strict tool calls in every dialect afm parses, checked the way a client sees them: random
//! walks through the grammar's allowed tokens (uniform picks, steered toward closing what is
//! open so walks end) on real vocabularies (SmolLM2's, Qwen 2.5's when models/ has it) and on
//! a vocabulary whose dialect markers are special tokens; every walk's text goes through
//! afm-chat's streaming parser for that dialect in random chunks, and must come out as calls of
//! the declared tools (exactly one without parallel calls) whose arguments satisfy the tool's
//! schema. With `tool_choice: auto` the text is either such calls or plain text.

use std::path::{Path, PathBuf};

use afm_api::{OutputConstraint, ToolDef};
use afm_chat::tool_calls::{ParserOptions, ToolCallFormat, ToolCallParser, ToolEvent};
use afm_chat::{Tokenizer, VocabModel, VocabSpec};
use afm_grammar::{GrammarError, Grammars};
use serde_json::{json, Value};

mod common;
use common::{root, smollm2, Rng, Walker};

const DIALECTS: [ToolCallFormat; 10] = ToolCallFormat::DIALECTS;

/// Tools whose schemas cover what tool definitions use (tests/python/test_grammar_walks.py
/// keeps a copy to validate against): bounded and unbounded strings,
/// enums, a pattern, a format, bounded numbers, booleans, nullable values, arrays, a nested
/// object, a tagged union, optional parameters and a tool without parameters.
fn tools() -> Vec<Value> {
    let f = |name: &str, parameters: Value| json!({"type": "function", "function": {"name": name, "parameters": parameters}});
    vec![
        f(
            "get_weather",
            json!({"type": "object", "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["city", "unit"], "additionalProperties": false}),
        ),
        f(
            "search",
            json!({"type": "object", "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 40},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                         "maxItems": 3},
                "filters": {"type": "object", "properties": {
                    "lang": {"enum": ["en", "fr"]}, "safe": {"type": "boolean"}},
                    "required": ["safe"], "additionalProperties": false},
                "limit": {"type": ["integer", "null"], "minimum": 1, "maximum": 50}},
                "required": ["query"], "additionalProperties": false}),
        ),
        f(
            "set_code",
            json!({"type": "object", "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "when": {"type": "string", "format": "date"},
                "note": {"type": ["string", "null"]},
                "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
                "required": ["code", "ratio"], "additionalProperties": false}),
        ),
        f("ping", json!({"type": "object", "properties": {}})),
        f(
            "pay",
            json!({"type": "object", "properties": {"payment": {"oneOf": [
                {"type": "object", "properties": {"method": {"const": "card"},
                    "last4": {"type": "string", "pattern": "^[0-9]{4}$"}},
                 "required": ["method", "last4"], "additionalProperties": false},
                {"type": "object", "properties": {"method": {"const": "cash"},
                    "amount": {"type": "integer", "minimum": 1, "maximum": 1000}},
                 "required": ["method", "amount"], "additionalProperties": false}]}},
                "required": ["payment"], "additionalProperties": false}),
        ),
    ]
}

fn tool_defs(tools: &[Value]) -> Vec<ToolDef> {
    tools
        .iter()
        .map(|t| ToolDef {
            name: t["function"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            parameters: t["function"]["parameters"].clone(),
        })
        .collect()
}

/// A char-level vocabulary whose dialect markers are control tokens, as in the models that
/// use each dialect (Kimi's and DeepSeek's section tokens, Gemma 4's `<|"|>`, Mistral's
/// `[ARGS]`, ...); `<｜DSML｜` alone is one, so DSML tags are a token followed by text.
fn special_vocabulary() -> Tokenizer {
    const MARKERS: [&str; 24] = [
        "<|tool_call>",
        "<tool_call|>",
        "<|\"|>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        "<｜DSML｜",
        "</｜DSML｜function_calls>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<|python_tag|>",
    ];
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    tokens.extend(MARKERS.iter().map(|s| s.to_string()));
    let mut types = vec![2, 3, 3];
    types.resize(tokens.len(), 3);
    tokens.extend((0x21u8..0x7f).map(|b| (b as char).to_string()));
    tokens.extend(
        [
            "\u{2581}",
            "\n",
            "｜",
            "é",
            "parameter",
            "function",
            "celsius",
        ]
        .map(String::from),
    );
    types.resize(tokens.len(), 1);
    let mut spec = VocabSpec::new(VocabModel::Spm, tokens);
    spec.token_types = types;
    spec.unk = Some(0);
    spec.bos = Some(1);
    spec.eos = Some(2);
    Tokenizer::from_spec(spec).expect("a valid vocabulary")
}

/// The parser's reading of `text`, fed in random chunks: (plain text, calls as (name, args)).
fn parse(
    format: ToolCallFormat,
    tools: &[Value],
    text: &str,
    rng: &mut Rng,
) -> (String, Vec<(String, String)>) {
    let mut p = ToolCallParser::new(format, tools, ParserOptions::default());
    let mut events = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = (1 + rng.below(12)).min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        events.extend(p.push(&rest[..cut]));
        rest = &rest[cut..];
    }
    events.extend(p.finish());
    let mut plain = String::new();
    let mut streamed: Vec<String> = Vec::new();
    for e in events {
        match e {
            ToolEvent::Text(t) => plain.push_str(&t),
            ToolEvent::CallStart { index, .. } => {
                streamed.resize(streamed.len().max(index + 1), String::new())
            }
            ToolEvent::CallArgs { index, fragment } => streamed[index].push_str(&fragment),
            ToolEvent::CallEnd { .. } => {}
        }
    }
    let calls: Vec<(String, String)> = p
        .calls()
        .iter()
        .map(|c| (c.name.clone(), c.arguments.clone()))
        .collect();
    let whole: Vec<&String> = calls.iter().map(|c| &c.1).collect();
    assert_eq!(
        streamed.iter().collect::<Vec<_>>(),
        whole,
        "streamed = whole: {text:?}"
    );
    (plain, calls)
}

/// The JSON Schema subset the tools above use; returns the first violation (the jsonschema
/// package checks the same calls in tests/python/test_grammar_walks.py).
fn violation(v: &Value, s: &Value, path: &str) -> Option<String> {
    let bad = |what: &str| Some(format!("{path}: {what} (value {v})"));
    if s.get("const").is_some_and(|c| c != v) {
        return bad("not the const");
    }
    for (key, exactly_one) in [("oneOf", true), ("anyOf", false)] {
        if let Some(alts) = s.get(key).and_then(Value::as_array) {
            let ok = alts
                .iter()
                .filter(|a| violation(v, a, path).is_none())
                .count();
            if ok == 0 || (exactly_one && ok > 1) {
                return bad(&format!("{ok} of {key} match"));
            }
        }
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return bad("not in enum");
        }
    }
    if let Some(t) = s.get("type") {
        let types: Vec<&str> = match t {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let is = |t: &str| match t {
            "string" => v.is_string(),
            "integer" => v.is_i64() || v.is_u64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            "object" => v.is_object(),
            "array" => v.is_array(),
            _ => false,
        };
        if !types.iter().any(|t| is(t)) {
            return bad(&format!("not of type {t}"));
        }
    }
    let num = |k: &str| s.get(k).and_then(Value::as_f64);
    if let Some(x) = v.as_f64() {
        if num("minimum").is_some_and(|m| x < m) || num("maximum").is_some_and(|m| x > m) {
            return bad("out of bounds");
        }
    }
    if let Some(text) = v.as_str() {
        let chars = text.chars().count() as f64;
        if num("minLength").is_some_and(|m| chars < m)
            || num("maxLength").is_some_and(|m| chars > m)
        {
            return bad("length out of bounds");
        }
        if let Some(p) = s.get("pattern").and_then(Value::as_str) {
            let re = fancy_regex::Regex::new(p).expect("pattern");
            if !re.is_match(text).unwrap_or(false) {
                return bad("does not match the pattern");
            }
        }
        if s.get("format").and_then(Value::as_str) == Some("date") {
            let re = fancy_regex::Regex::new(r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$");
            if !re.expect("date").is_match(text).unwrap_or(false) {
                return bad("not a date");
            }
        }
    }
    if let Some(items) = v.as_array() {
        if num("maxItems").is_some_and(|m| items.len() as f64 > m) {
            return bad("too many items");
        }
        if let Some(is) = s.get("items") {
            if let Some(e) = items
                .iter()
                .find_map(|i| violation(i, is, &format!("{path}[]")))
            {
                return Some(e);
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if !r.as_str().is_some_and(|r| o.contains_key(r)) {
                return bad(&format!("missing {r}"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => {
                    if let Some(e) = violation(x, ps, &format!("{path}.{k}")) {
                        return Some(e);
                    }
                }
                None if s.get("additionalProperties") == Some(&json!(false)) => {
                    return bad(&format!("undeclared {k}"))
                }
                None => {}
            }
        }
    }
    None
}

fn check_calls(format: ToolCallFormat, tools: &[Value], calls: &[(String, String)], text: &str) {
    for (name, args) in calls {
        let tool = tools
            .iter()
            .find(|t| t["function"]["name"] == name.as_str())
            .unwrap_or_else(|| panic!("{format:?}: undeclared tool {name} in {text:?}"));
        let v: Value = serde_json::from_str(args).unwrap_or_else(|e| {
            panic!("{format:?}: arguments {args:?} are not JSON ({e}): {text:?}")
        });
        assert!(v.is_object(), "{format:?}: {args} in {text:?}");
        if let Some(e) = violation(&v, &tool["function"]["parameters"], name) {
            panic!("{format:?}: {e}\n{text:?}");
        }
        record(format, name, &v, text);
    }
}

/// With `AFM_WALKS_OUT=<file>`, every call is also appended there as a JSON line, so that
/// tests/python/test_grammar_walks.py can check it with the `jsonschema` package.
fn record(format: ToolCallFormat, name: &str, arguments: &Value, text: &str) {
    let Some(path) = std::env::var_os("AFM_WALKS_OUT") else {
        return;
    };
    use std::io::Write;
    // The tests run on several threads: one whole line per write, one writer at a time.
    static FILE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let line = json!({"dialect": format.name(), "name": name, "arguments": arguments,
                      "text": text});
    let _one = FILE.lock().unwrap_or_else(|e| e.into_inner());
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("walks file");
    f.write_all(format!("{line}\n").as_bytes())
        .expect("written");
}

/// `walks` walks per mode; returns how many ended (all that end must be valid).
fn run(tok: &Tokenizer, format: ToolCallFormat, walks: usize, seed: u64) {
    let g = Grammars::new(tok).expect("trie");
    let tools = tools();
    let walker = Walker::new(tok);
    let mut rng = Rng(seed);
    for (required, parallel) in [(true, true), (true, false), (false, true)] {
        let c = OutputConstraint::ToolCalls {
            tools: tool_defs(&tools),
            required,
            parallel,
        };
        let compiled = g
            .compile(&c, format)
            .unwrap_or_else(|e| panic!("{format:?} compiles: {e}"));
        let mut ended = 0;
        for _ in 0..walks {
            let Some(text) = walker.walk_once(&compiled, &mut rng, &format!("{format:?}")) else {
                continue;
            };
            ended += 1;
            let (plain, calls) = parse(format, &tools, &text, &mut rng);
            if required || !calls.is_empty() {
                assert!(!calls.is_empty(), "{format:?}: no call in {text:?}");
                assert!(
                    plain.trim().is_empty(),
                    "{format:?}: text {plain:?} around calls in {text:?}"
                );
            } else {
                assert_eq!(plain, text, "{format:?}: auto text read as text");
            }
            if !parallel {
                assert_eq!(calls.len(), 1, "{format:?}: one call: {text:?}");
            }
            check_calls(format, &tools, &calls, &text);
        }
        assert!(
            ended * 10 >= walks * 9,
            "{format:?}: only {ended}/{walks} walks ended"
        );
    }
}

#[test]
fn every_dialect_on_smollm2_text_markers() {
    let tok = smollm2();
    for (i, f) in DIALECTS.into_iter().enumerate() {
        run(&tok, f, 16, 0x9e37_79b9 + i as u64);
    }
}

#[test]
fn every_dialect_with_special_token_markers() {
    let tok = special_vocabulary();
    for (i, f) in DIALECTS.into_iter().enumerate() {
        run(&tok, f, 16, 0x51_7cc1 + i as u64);
    }
}

#[test]
fn qwen_xml_and_glm_on_qwen25() {
    let dir = root().join("models/hf/qwen25");
    if !Path::new(&dir).join("tokenizer.json").exists() {
        eprintln!("skipped: {} not fetched", dir.display());
        return;
    }
    let tok = Tokenizer::from_hf_dir(&dir).expect("tokenizer");
    for (i, f) in [
        ToolCallFormat::QwenXml,
        ToolCallFormat::Hermes,
        ToolCallFormat::Glm4,
    ]
    .into_iter()
    .enumerate()
    {
        run(&tok, f, 16, 77 + i as u64);
    }
}

#[test]
fn schemas_a_dialect_cannot_honour_are_served_best_effort() {
    let tok = smollm2();
    let g = Grammars::new(&tok).expect("trie");
    let tool = |parameters: Value| OutputConstraint::ToolCalls {
        tools: vec![ToolDef {
            name: "f".into(),
            parameters,
        }],
        required: true,
        parallel: false,
    };
    // A top-level union has no element-per-parameter form; JSON dialects take it as is.
    let union = tool(json!({"anyOf": [{"type": "object"}, {"type": "null"}]}));
    assert!(matches!(
        g.compile(&union, ToolCallFormat::QwenXml),
        Err(GrammarError::Inexpressible { .. })
    ));
    assert!(g.compile(&union, ToolCallFormat::KimiK2).is_ok());
    // Qwen reads an untyped `$ref` value as a string: an object behind it cannot be written.
    let hidden = tool(json!({"$defs": {"o": {"type": "object"}},
                             "properties": {"x": {"$ref": "#/$defs/o"}}, "required": ["x"]}));
    assert!(matches!(
        g.compile(&hidden, ToolCallFormat::QwenXml),
        Err(GrammarError::Inexpressible { .. })
    ));
    assert!(g.compile(&hidden, ToolCallFormat::Glm4).is_ok());
    assert!(matches!(
        g.compile(&tool(json!({})), ToolCallFormat::None),
        Err(GrammarError::UnsupportedFormat(_))
    ));
}

/// Every schema of the response-format suite, as one tool's parameters, compiles in every
/// dialect or is reported as one it cannot honour (served best effort): a tool that works in
/// one dialect is never a 400 in another.
#[test]
fn every_fixture_schema_compiles_or_is_served_best_effort_in_every_dialect() {
    let tok = smollm2();
    let g = Grammars::new(&tok).expect("trie");
    let dir = root().join("tests/fixtures/schemas");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("schemas")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 20);
    for f in DIALECTS {
        let mut compiled = 0;
        for p in &paths {
            let schema: Value =
                serde_json::from_str(&std::fs::read_to_string(p).expect("read")).expect("json");
            let c = OutputConstraint::ToolCalls {
                tools: vec![ToolDef {
                    name: "record".into(),
                    parameters: schema,
                }],
                required: true,
                parallel: false,
            };
            match g.compile(&c, f) {
                Ok(_) => compiled += 1,
                Err(GrammarError::Inexpressible { .. }) => {}
                Err(e) => panic!("{f:?} {}: {e}", p.display()),
            }
        }
        // Element-per-parameter dialects refuse a few top-level shapes; most schemas fit.
        assert!(
            compiled * 4 >= paths.len() * 3,
            "{f:?}: {compiled}/{}",
            paths.len()
        );
    }
}
