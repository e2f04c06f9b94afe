//! Chat messages and tools turned into the plain JSON that HF chat templates read:
//! `developer` becomes `system`, text parts are joined, and tool-call `arguments` sent as a
//! JSON string become an object (templates index into them).

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::request::{ChatMessage, MessageContent, Role};

pub fn normalize_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages must contain at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| normalize(i, m))
        .collect()
}

fn normalize(i: usize, m: &ChatMessage) -> Result<Value, ApiError> {
    let content = match &m.content {
        None => None,
        Some(MessageContent::Text(t)) => Some(t.clone()),
        Some(MessageContent::Parts(parts)) => Some(join_parts(i, parts)?),
    };
    let has_calls = m.tool_calls.as_ref().is_some_and(|c| !c.is_empty());
    if content.is_none() && !(m.role == Role::Assistant) {
        return Err(ApiError::invalid(
            format!("messages[{i}].content"),
            format!(
                "messages[{i}].content is required for role `{}`",
                m.role.template_name()
            ),
        ));
    }
    let mut out = Map::new();
    out.insert("role".into(), json!(m.role.template_name()));
    // Templates test `message.content is string`; an assistant turn with only tool calls gets "".
    out.insert("content".into(), json!(content.unwrap_or_default()));
    if let Some(name) = &m.name {
        out.insert("name".into(), json!(name));
    }
    if has_calls {
        let calls = m.tool_calls.as_deref().unwrap_or_default();
        let calls = calls
            .iter()
            .enumerate()
            .map(|(j, c)| normalize_call(i, j, c))
            .collect::<Result<Vec<_>, _>>()?;
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), json!(id));
    }
    if let Some(r) = &m.reasoning_content {
        out.insert("reasoning_content".into(), json!(r));
    }
    Ok(Value::Object(out))
}

fn join_parts(i: usize, parts: &[crate::request::ContentPart]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        match (part.kind.as_str(), &part.text) {
            ("text", Some(t)) => texts.push(t.as_str()),
            ("text", None) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].content[{j}].text"),
                    format!("messages[{i}].content[{j}] has type text but no `text`"),
                ))
            }
            (other, _) => {
                return Err(ApiError::unsupported(
                    format!("messages[{i}].content[{j}].type"),
                    format!(
                        "messages[{i}].content[{j}] has type `{other}`; only text content is \
                         supported"
                    ),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

fn normalize_call(i: usize, j: usize, call: &Value) -> Result<Value, ApiError> {
    let param = format!("messages[{i}].tool_calls[{j}]");
    let Some(obj) = call.as_object() else {
        return Err(ApiError::invalid(
            &param,
            format!("{param} must be an object"),
        ));
    };
    let mut obj = obj.clone();
    let Some(function) = obj.get_mut("function").and_then(Value::as_object_mut) else {
        return Err(ApiError::invalid(
            &param,
            format!("{param} has no `function` object"),
        ));
    };
    if !function.get("name").is_some_and(Value::is_string) {
        return Err(ApiError::invalid(
            &param,
            format!("{param}.function has no `name`"),
        ));
    }
    if let Some(Value::String(args)) = function.get("arguments") {
        if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(args) {
            function.insert("arguments".into(), parsed);
        }
    }
    Ok(Value::Object(obj))
}
