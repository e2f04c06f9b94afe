//! Structured output: what `response_format`, `tools[].function.strict`, `tool_choice` and
//! `parallel_tool_calls` ask of an answer, checked once here and handed on as plain data
//! ([`OutputConstraint`]) for the grammar (afm-grammar) to compile.
//!
//! With `--enable-grammar-constraints` the answer is masked token by token for a strict
//! `json_schema`, `json_object`, any strict tool, and `tool_choice: "required"` or a named
//! function (a non-strict `json_schema` stays best effort, as in AFM). Without the switch, a
//! request that needs a guarantee is served best effort and marked downgraded.

use serde_json::Value;

use crate::error::ApiError;
use crate::request::ResponseFormat;

/// `tool_choice`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    /// Tools are not shown to the model.
    None,
    /// At least one call.
    Required,
    /// Exactly this function (one call, or several of it with `parallel_tool_calls`).
    Named(String),
}

/// A function the answer may call, with the JSON schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub parameters: Value,
}

/// The shape a chat answer must take, to be enforced by grammar-constrained decoding.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// `{"type": "json_object"}`: one JSON object.
    JsonObject,
    /// One JSON value valid under `schema`; `param` names where it came from, for errors.
    JsonSchema { schema: Value, param: String },
    /// Tool calls in the model's dialect. `required`: the answer is calls only; otherwise it
    /// is either text or calls, and any call is a valid call of one of `tools`.
    ToolCalls {
        tools: Vec<ToolDef>,
        required: bool,
        /// `parallel_tool_calls`: false allows exactly one call.
        parallel: bool,
    },
}

/// What validation decided about a chat request's output.
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredOutput {
    /// Enforced by the grammar (`None` without `--enable-grammar-constraints`).
    pub constraint: Option<OutputConstraint>,
    /// Tools for the template: `None` for `tool_choice: "none"`, only the named one for a
    /// named choice.
    pub tools: Option<Vec<Value>>,
    /// A guarantee was asked for but constraints are off (`X-Grammar-Constraints: downgraded`).
    pub downgraded: bool,
    /// The server's `--guided-json` schema applies (the request named no format).
    pub default_schema: bool,
}

/// The request's parts that bear on its output.
pub struct OutputRequest<'a> {
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<&'a Value>,
    pub parallel_tool_calls: bool,
    pub response_format: Option<&'a ResponseFormat>,
    /// `--enable-grammar-constraints`.
    pub grammar_enabled: bool,
    /// `--guided-json`.
    pub default_schema: Option<&'a Value>,
}

pub fn structured_output(r: OutputRequest<'_>) -> Result<StructuredOutput, ApiError> {
    let choice = parse_tool_choice(r.tool_choice)?;
    let all_tools = r.tools.filter(|t| !t.is_empty());
    let strict_tool = match &all_tools {
        Some(tools) => check_tools(tools)?,
        None => false,
    };
    let strict_schema = strict_schema(r.response_format)?;
    let tools = match (&choice, all_tools) {
        (ToolChoice::None, _) => None,
        (ToolChoice::Required | ToolChoice::Named(_), None) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice requires a tool call but the request has no `tools`",
            ))
        }
        (ToolChoice::Named(name), Some(tools)) => {
            let named: Vec<Value> = tools
                .into_iter()
                .filter(|t| function_name(t) == Some(name.as_str()))
                .collect();
            if named.is_empty() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names function `{name}`, which is not in `tools`"),
                ));
            }
            Some(named)
        }
        (_, tools) => tools,
    };
    let forced = matches!(choice, ToolChoice::Required | ToolChoice::Named(_));
    // `tool_choice: "none"` with strict tools keeps its downgrade mark: the tools were sent.
    let downgraded = (strict_tool || strict_schema || forced) && !r.grammar_enabled;
    let default_schema = r.response_format.is_none() && tools.is_none();
    let default_schema = default_schema && r.default_schema.is_some();
    let constraint = if !r.grammar_enabled {
        None
    } else if let Some(t) = tools.as_ref().filter(|_| forced || strict_tool) {
        Some(OutputConstraint::ToolCalls {
            tools: t.iter().map(tool_def).collect(),
            required: forced,
            parallel: r.parallel_tool_calls,
        })
    } else if let Some(format) = r.response_format {
        format_constraint(format)
    } else {
        r.default_schema
            .filter(|_| default_schema)
            .map(|s| OutputConstraint::JsonSchema {
                schema: s.clone(),
                param: "--guided-json".into(),
            })
    };
    Ok(StructuredOutput {
        constraint,
        tools,
        downgraded,
        default_schema,
    })
}

fn format_constraint(format: &ResponseFormat) -> Option<OutputConstraint> {
    match format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some(OutputConstraint::JsonObject),
        ResponseFormat::JsonSchema { json_schema } if json_schema.strict != Some(true) => None,
        ResponseFormat::JsonSchema { json_schema } => match &json_schema.schema {
            None => Some(OutputConstraint::JsonObject),
            Some(schema) => Some(OutputConstraint::JsonSchema {
                schema: schema.clone(),
                param: "response_format.json_schema.schema".into(),
            }),
        },
    }
}

pub fn parse_tool_choice(choice: Option<&Value>) -> Result<ToolChoice, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) if s == "auto" => Ok(ToolChoice::Auto),
        Some(Value::String(s)) if s == "none" => Ok(ToolChoice::None),
        Some(Value::String(s)) if s == "required" => Ok(ToolChoice::Required),
        Some(Value::Object(o)) => match o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
        {
            Some(name) => Ok(ToolChoice::Named(name.to_string())),
            None => Err(bad_choice(choice)),
        },
        Some(_) => Err(bad_choice(choice)),
    }
}

fn bad_choice(choice: Option<&Value>) -> ApiError {
    let shown = choice.map(Value::to_string).unwrap_or_default();
    ApiError::invalid(
        "tool_choice",
        format!(
            "tool_choice {shown} is not one of \"auto\", \"none\", \"required\" or \
             {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
        ),
    )
}

/// Checks each tool's shape; returns whether any asks for `strict` arguments.
pub fn check_tools(tools: &[Value]) -> Result<bool, ApiError> {
    let mut strict = false;
    for (i, tool) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        let function = tool.get("function").and_then(Value::as_object);
        let kind = tool
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("function");
        let Some(function) = function.filter(|_| kind == "function") else {
            return Err(ApiError::invalid(
                &param,
                format!("{param} must be {{\"type\": \"function\", \"function\": {{...}}}}"),
            ));
        };
        if !function.get("name").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(
                &param,
                format!("{param}.function has no `name`"),
            ));
        }
        if let Some(p) = function.get("parameters") {
            if !p.is_object() && !p.is_boolean() && !p.is_null() {
                return Err(ApiError::invalid(
                    format!("{param}.function.parameters"),
                    format!("{param}.function.parameters must be a JSON schema object"),
                ));
            }
        }
        strict |= function.get("strict") == Some(&Value::Bool(true));
    }
    Ok(strict)
}

fn function_name(tool: &Value) -> Option<&str> {
    tool.get("function")?.get("name")?.as_str()
}

/// A checked tool as name and arguments schema (any object when it gives none).
fn tool_def(tool: &Value) -> ToolDef {
    let parameters = tool
        .get("function")
        .and_then(|f| f.get("parameters"))
        .filter(|p| !p.is_null())
        .cloned()
        .unwrap_or_else(|| serde_json::json!({"type": "object"}));
    ToolDef {
        name: function_name(tool).unwrap_or_default().to_string(),
        parameters,
    }
}

fn strict_schema(format: Option<&ResponseFormat>) -> Result<bool, ApiError> {
    match format {
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            if json_schema
                .schema
                .as_ref()
                .is_some_and(|s| !s.is_object() && !s.is_boolean())
            {
                return Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "the schema must be a JSON object",
                ));
            }
            Ok(json_schema.strict.unwrap_or(false))
        }
        _ => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "f",
                   "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}),
            json!({"type": "function", "function": {"name": "g"}}),
        ]
    }

    fn run(choice: Value, enabled: bool) -> Result<StructuredOutput, ApiError> {
        structured_output(OutputRequest {
            tools: Some(tools()),
            tool_choice: Some(&choice),
            parallel_tool_calls: false,
            response_format: None,
            grammar_enabled: enabled,
            default_schema: None,
        })
    }

    #[test]
    fn named_choice_keeps_only_that_tool_and_forces_a_call() {
        let out = run(json!({"type": "function", "function": {"name": "g"}}), true).unwrap();
        assert_eq!(out.tools.as_ref().map(Vec::len), Some(1));
        let Some(OutputConstraint::ToolCalls {
            tools,
            required,
            parallel,
        }) = out.constraint
        else {
            panic!("expected tool calls, got {:?}", out.constraint)
        };
        assert_eq!(tools[0].name, "g");
        assert_eq!(tools[0].parameters, json!({"type": "object"}));
        assert!(required && !parallel);
        assert!(!out.downgraded);
    }

    #[test]
    fn required_without_constraints_is_downgraded() {
        let out = run(json!("required"), false).unwrap();
        assert!(out.constraint.is_none());
        assert!(out.downgraded);
        assert_eq!(out.tools.map(|t| t.len()), Some(2));
        let auto = run(json!("auto"), true).unwrap();
        assert!(
            auto.constraint.is_none(),
            "auto without strict tools is free"
        );
    }

    #[test]
    fn unknown_named_function_and_missing_tools_are_400() {
        let err = run(json!({"type": "function", "function": {"name": "h"}}), true).unwrap_err();
        assert_eq!(err.status(), 400);
        assert!(err.to_string().contains("`h`"), "{err}");
        let err = structured_output(OutputRequest {
            tools: None,
            tool_choice: Some(&json!("required")),
            parallel_tool_calls: true,
            response_format: None,
            grammar_enabled: true,
            default_schema: None,
        })
        .unwrap_err();
        assert_eq!(err.body().error.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn default_schema_applies_only_when_the_request_names_no_format() {
        let schema = json!({"type": "object"});
        let req = |format: Option<&ResponseFormat>| {
            structured_output(OutputRequest {
                tools: None,
                tool_choice: None,
                parallel_tool_calls: true,
                response_format: format,
                grammar_enabled: true,
                default_schema: Some(&schema),
            })
            .unwrap()
        };
        let out = req(None);
        assert!(out.default_schema);
        assert!(matches!(
            out.constraint,
            Some(OutputConstraint::JsonSchema { .. })
        ));
        let out = req(Some(&ResponseFormat::Text));
        assert!(!out.default_schema && out.constraint.is_none());
    }
}
