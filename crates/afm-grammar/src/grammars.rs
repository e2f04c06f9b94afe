//! Output constraints (afm-api's plain data) as llguidance grammars: a JSON schema for
//! `response_format`, and a Lark grammar with JSON-schema sub-grammars for tool calls in the
//! model's dialect.
//!
//! ```text
//!  Hermes, tool_choice required, parallel:
//!    start: call ("\n" call)*
//!    call:  "<tool_call>\n" %json{anyOf: [{name: const f, arguments: <f's parameters>}, ..]}
//!           "\n</tool_call>"
//!  tool_choice auto with strict tools:   start: calls | /[^<][\s\S]*/   (text or valid calls)
//!  Llama 3 JSON:  call: %json{anyOf: [{name: const f, parameters: ..}, ..]}, "; " between calls
//! ```

use afm_api::{OutputConstraint, ToolDef};
use afm_chat::tool_calls::ToolCallFormat;
use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

use crate::GrammarError;

/// JSON as models write it (`{"a": 1, "b": [2, 3]}`), with no free whitespace: free
/// whitespace lets a small model pad an answer with newlines until `max_tokens`.
fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The grammar for `constraint`, with tool calls written in `format`.
pub fn grammar_for(
    constraint: &OutputConstraint,
    format: ToolCallFormat,
) -> Result<TopLevelGrammar, GrammarError> {
    match constraint {
        OutputConstraint::JsonObject => Ok(json_grammar(json!({"type": "object"}))),
        OutputConstraint::JsonSchema { schema, param } => {
            if !schema.is_object() && !schema.is_boolean() {
                return Err(GrammarError::Schema {
                    param: param.clone(),
                    message: "the schema must be a JSON object".into(),
                });
            }
            Ok(json_grammar(schema.clone()))
        }
        OutputConstraint::ToolCalls {
            tools,
            required,
            parallel,
        } => tool_grammar(tools, *required, *parallel, format),
    }
}

fn json_grammar(schema: Value) -> TopLevelGrammar {
    TopLevelGrammar::from_json_schema(with_options(schema))
}

fn with_options(schema: Value) -> Value {
    match schema {
        Value::Object(mut o) => {
            o.entry("x-guidance").or_insert_with(json_options);
            Value::Object(o)
        }
        // `true` (anything) and `false` (nothing) have no room for options.
        other => other,
    }
}

fn tool_grammar(
    tools: &[ToolDef],
    required: bool,
    parallel: bool,
    format: ToolCallFormat,
) -> Result<TopLevelGrammar, GrammarError> {
    let d = match format {
        ToolCallFormat::Hermes => Dialect {
            open: "<tool_call>\n",
            close: "\n</tool_call>",
            separator: "\n",
            args_key: "arguments",
            text: r"/[^<][\s\S]*/",
        },
        ToolCallFormat::Llama3Json => Dialect {
            open: "",
            close: "",
            separator: "; ",
            args_key: "parameters",
            text: r"/[^{][\s\S]*/",
        },
        other => return Err(GrammarError::UnsupportedFormat(format!("{other:?}"))),
    };
    let (open, close, args_key) = (d.open, d.close, d.args_key);
    let body = call_schema(tools, args_key);
    let body = serde_json::to_string(&body).map_err(|e| GrammarError::Schema {
        param: "tools".into(),
        message: e.to_string(),
    })?;
    let calls = if parallel {
        format!("call ({} call)*", lark_string(d.separator))
    } else {
        "call".to_string()
    };
    // A dialect without markers (Llama's bare JSON) has a call that is just the object.
    let mut call = String::from("body");
    if !open.is_empty() {
        call = format!("{} {call}", lark_string(open));
    }
    if !close.is_empty() {
        call = format!("{call} {}", lark_string(close));
    }
    let mut lark = format!("calls: {calls}\ncall: {call}\nbody: %json {body}\n");
    if required {
        lark.insert_str(0, "start: calls\n");
    } else {
        // Text that does not start a call, or calls: either way no malformed call.
        lark.insert_str(0, &format!("start: calls | TEXT\nTEXT: {}\n", d.text));
    }
    Ok(TopLevelGrammar::from_lark(lark))
}

/// How calls are written in one dialect.
struct Dialect {
    open: &'static str,
    close: &'static str,
    /// Between parallel calls.
    separator: &'static str,
    args_key: &'static str,
    /// Text that cannot be mistaken for the start of a call (a Lark regex).
    text: &'static str,
}

/// `{"name": <one of the tools>, "<args_key>": <that tool's parameters>}`.
fn call_schema(tools: &[ToolDef], args_key: &str) -> Value {
    let one = |i: usize, t: &ToolDef| {
        let prefix = if tools.len() == 1 {
            format!("/properties/{args_key}")
        } else {
            format!("/anyOf/{i}/properties/{args_key}")
        };
        let mut props = Map::new();
        props.insert("name".into(), json!({"const": t.name}));
        props.insert(args_key.into(), rebase_refs(&t.parameters, &prefix));
        json!({"type": "object", "properties": props, "required": ["name", args_key],
               "additionalProperties": false})
    };
    let mut schema = if tools.len() == 1 {
        one(0, &tools[0])
    } else {
        json!({"anyOf": tools.iter().enumerate().map(|(i, t)| one(i, t)).collect::<Vec<_>>()})
    };
    if let Value::Object(o) = &mut schema {
        o.insert("x-guidance".into(), json_options());
    }
    schema
}

/// Local `$ref`s of a schema moved under `prefix` point at the same places.
fn rebase_refs(schema: &Value, prefix: &str) -> Value {
    match schema {
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        ("$ref", Value::String(r)) if r.starts_with('#') => {
                            Value::String(format!("#{prefix}{}", &r[1..]))
                        }
                        _ => rebase_refs(v, prefix),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|v| rebase_refs(v, prefix)).collect()),
        other => other.clone(),
    }
}

/// A Lark string literal.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_follow_the_parameters_into_the_call() {
        let params = json!({"$defs": {"p": {"type": "integer"}},
                            "properties": {"x": {"$ref": "#/$defs/p"}}});
        let tools = [
            ToolDef {
                name: "f".into(),
                parameters: params.clone(),
            },
            ToolDef {
                name: "g".into(),
                parameters: params,
            },
        ];
        let s = call_schema(&tools, "arguments");
        assert_eq!(
            s["anyOf"][1]["properties"]["arguments"]["properties"]["x"]["$ref"],
            "#/anyOf/1/properties/arguments/$defs/p"
        );
    }
}
