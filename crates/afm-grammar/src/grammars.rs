//! Output constraints (afm-api's plain data) as llguidance grammars: a JSON schema for
//! `response_format`, and for tool calls a Lark grammar in the model's dialect (dialects.rs),
//! with JSON-schema sub-grammars for the arguments.
//!
//! ```text
//!  Hermes, tool_choice required, parallel:
//!    start: call ("\n" call)*
//!    call:  "<tool_call>" "\n" %json{anyOf: [{name: const f, arguments: <f's parameters>}, ..]}
//!           "\n" "</tool_call>"
//!  tool_choice auto with strict tools:   start: calls | TEXT   (TEXT: no opener anywhere)
//! ```

use afm_api::{OutputConstraint, ToolDef};
use afm_chat::tool_calls::ToolCallFormat;
use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

use crate::dialects::tool_lark;
use crate::lark::Markers;
use crate::GrammarError;

/// JSON as models write it (`{"a": 1, "b": [2, 3]}`), with no free whitespace: free
/// whitespace lets a small model pad an answer with newlines until `max_tokens`.
pub(crate) fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The grammar for `constraint`, with tool calls written in `format` using the vocabulary's
/// `markers`.
pub fn grammar_for(
    constraint: &OutputConstraint,
    format: ToolCallFormat,
    markers: &Markers,
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
        } => Ok(TopLevelGrammar::from_lark(tool_lark(
            tools, *required, *parallel, format, markers,
        )?)),
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

/// `{"name": <one of the tools>, "<args_key>": <that tool's parameters>}`.
pub(crate) fn call_schema(tools: &[ToolDef], args_key: &str) -> Value {
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
