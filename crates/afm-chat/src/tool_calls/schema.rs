//! The request's tool definitions as the parser needs them: each tool's parameter schema,
//! type coercion of argument values to that schema, and mapping of misnamed arguments (and
//! tool names) to the declared ones. Only the JSON Schema subset tools use is understood:
//! `type` (string or list), `anyOf`/`oneOf`, `enum`, `properties`, `items`, `required`.

use serde_json::{Map, Value};

/// name → parameters schema, from OpenAI tool definitions
/// (`{"type":"function","function":{"name":..,"parameters":{..}}}`, or the bare function).
#[derive(Debug, Default)]
pub(crate) struct Schemas {
    tools: Vec<(String, Value)>,
}

impl Schemas {
    pub(crate) fn new(tools: &[Value]) -> Self {
        let tools = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function").unwrap_or(t);
                let name = f.get("name")?.as_str()?.to_string();
                let params = f.get("parameters").cloned().unwrap_or(Value::Null);
                Some((name, params))
            })
            .collect();
        Self { tools }
    }

    pub(crate) fn params(&self, tool: &str) -> Option<&Value> {
        self.tools.iter().find(|(n, _)| n == tool).map(|(_, p)| p)
    }

    pub(crate) fn knows(&self, tool: &str) -> bool {
        self.params(tool).is_some()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// A declared tool whose name matches `name` up to case, `_`, `-` and spaces.
    pub(crate) fn map_tool_name(&self, name: &str) -> Option<&str> {
        let names: Vec<&str> = self.tools.iter().map(|(n, _)| n.as_str()).collect();
        close_match(name, &names)
    }
}

/// The schema of property `key` in an object schema.
pub(crate) fn property<'a>(params: &'a Value, key: &str) -> Option<&'a Value> {
    params.get("properties")?.get(key)
}

/// Names in the schema's `required` list that `keys` lacks.
pub(crate) fn missing_required(params: &Value, keys: &[String]) -> Vec<String> {
    let Some(req) = params.get("required").and_then(Value::as_array) else {
        return Vec::new();
    };
    req.iter()
        .filter_map(Value::as_str)
        .filter(|r| !keys.iter().any(|k| k == r))
        .map(str::to_string)
        .collect()
}

/// The declared property that `key` most plausibly meant: equal up to case, `_`, `-` and
/// spaces, else the unique one within edit distance 2 (on that normal form). None if `key`
/// is declared, or the match is ambiguous.
pub(crate) fn map_key(params: &Value, key: &str) -> Option<String> {
    let props = params.get("properties")?.as_object()?;
    if props.contains_key(key) {
        return None;
    }
    let names: Vec<&str> = props.keys().map(String::as_str).collect();
    close_match(key, &names).map(str::to_string)
}

fn close_match<'a>(key: &str, names: &[&'a str]) -> Option<&'a str> {
    if names.contains(&key) {
        return None;
    }
    let norm = |s: &str| -> String {
        s.chars()
            .filter(|c| !matches!(c, '_' | '-' | ' '))
            .flat_map(char::to_lowercase)
            .collect()
    };
    let k = norm(key);
    let exact: Vec<&str> = names.iter().copied().filter(|n| norm(n) == k).collect();
    if exact.len() == 1 {
        return Some(exact[0]);
    }
    if !exact.is_empty() || k.chars().count() < 4 {
        return None;
    }
    let near: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| edit_distance(&norm(n), &k) <= 2)
        .collect();
    (near.len() == 1).then(|| near[0])
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The JSON types a schema allows (empty: anything): `type`, then `anyOf`/`oneOf` members;
/// failing those, `object` for `properties` or the first `enum` member's type. No `$ref`
/// resolution. afm-grammar types the values it lets a model write by this same reading.
pub fn types_of(schema: &Value) -> Vec<&str> {
    let mut out = Vec::new();
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t.as_str()),
        Some(Value::Array(ts)) => out.extend(ts.iter().filter_map(Value::as_str)),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(alts) = schema.get(key).and_then(Value::as_array) {
            alts.iter().for_each(|a| out.extend(types_of(a)));
        }
    }
    if out.is_empty() {
        if schema.get("properties").is_some() {
            out.push("object");
        } else if let Some(first) = schema.get("enum").and_then(|e| e.get(0)) {
            out.push(json_type(first));
        }
    }
    out
}

/// Is the schema exactly "a string" (so a value can stream as string text)?
pub(crate) fn is_plain_string(schema: &Value) -> bool {
    types_of(schema) == ["string"]
}

/// The JSON type name of a value (`integer` for whole numbers).
pub fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn fits(v: &Value, ty: &str) -> bool {
    let t = json_type(v);
    t == ty || (ty == "number" && t == "integer")
}

/// Coerces `v` to `schema`: strings holding numbers, booleans, null or JSON become those
/// values; scalars become strings where a string is wanted. With `repair`, object keys are
/// also mapped to declared names, strings are parsed leniently, and a lone value becomes a
/// one-item array where an array is wanted. `notes` collects what changed, for debug lines.
pub(crate) fn coerce(v: Value, schema: &Value, repair: bool, notes: &mut Vec<String>) -> Value {
    let types = types_of(schema);
    if types.is_empty() || types.iter().any(|t| fits(&v, t)) {
        return descend(v, schema, repair, notes);
    }
    for ty in &types {
        if let Some(c) = convert(&v, ty, repair) {
            notes.push(format!("{} -> {ty}", short(&v)));
            return descend(c, schema, repair, notes);
        }
    }
    v
}

/// Recurses into objects (properties, key mapping) and arrays (items).
fn descend(v: Value, schema: &Value, repair: bool, notes: &mut Vec<String>) -> Value {
    match v {
        Value::Object(map) if schema.get("properties").is_some() => {
            let mut out = Map::new();
            for (k, val) in map {
                let key = match repair.then(|| map_key(schema, &k)).flatten() {
                    Some(mapped) if !out.contains_key(&mapped) => {
                        notes.push(format!("argument '{k}' -> '{mapped}'"));
                        mapped
                    }
                    _ => k,
                };
                let val = match property(schema, &key) {
                    Some(s) => coerce(val, s, repair, notes),
                    None => val,
                };
                out.insert(key, val);
            }
            Value::Object(out)
        }
        Value::Array(items) => match schema.get("items") {
            Some(s) => Value::Array(
                items
                    .into_iter()
                    .map(|i| coerce(i, s, repair, notes))
                    .collect(),
            ),
            None => Value::Array(items),
        },
        other => other,
    }
}

fn convert(v: &Value, ty: &str, repair: bool) -> Option<Value> {
    if let Value::String(s) = v {
        let t = s.trim();
        return match ty {
            "integer" | "number" | "boolean" | "null" => {
                let parsed = super::lenient::scalar(t);
                fits(&parsed, ty).then_some(parsed).or_else(|| {
                    let f: f64 = t.parse().ok()?;
                    (ty == "integer" && f.fract() == 0.0 && f.abs() < 9.0e15)
                        .then(|| Value::from(f as i64))
                })
            }
            "object" | "array" => {
                let parsed = match repair {
                    true => super::lenient::parse_any(t),
                    false => serde_json::from_str(t).ok(),
                };
                match parsed.filter(|p| fits(p, ty)) {
                    Some(p) => Some(p),
                    None if repair && ty == "array" => Some(Value::Array(vec![v.clone()])),
                    None => None,
                }
            }
            _ => None,
        };
    }
    match (ty, v) {
        ("string", Value::Number(_) | Value::Bool(_)) => Some(Value::String(v.to_string())),
        ("string", Value::Object(_) | Value::Array(_)) if repair => {
            Some(Value::String(v.to_string()))
        }
        ("integer", Value::Number(n)) => n
            .as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
            .map(|f| Value::from(f as i64)),
        ("array", other) if repair && !other.is_null() => Some(Value::Array(vec![other.clone()])),
        _ => None,
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "filter": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "max_results": {"type": ["integer", "null"]}
        }, "required": ["city", "days"]})
    }

    #[test]
    fn coerces_strings_to_declared_types() {
        let mut notes = Vec::new();
        let v = json!({"city": 7, "days": "5", "metric": "true", "filter": "{\"a\": 1}",
                       "tags": ["x", 2], "max_results": "null"});
        let got = coerce(v, &schema(), false, &mut notes);
        assert_eq!(
            got,
            json!({"city": "7", "days": 5, "metric": true, "filter": {"a": 1},
                   "tags": ["x", "2"], "max_results": null})
        );
    }

    #[test]
    fn repair_maps_misnamed_keys_uniquely() {
        let mut notes = Vec::new();
        let v = json!({"City": "Paris", "Max-Results": "3", "dayz": 2, "zzz": 1});
        let got = coerce(v, &schema(), true, &mut notes);
        assert_eq!(
            got,
            json!({"city": "Paris", "max_results": 3, "days": 2, "zzz": 1})
        );
        assert!(notes.iter().any(|n| n.contains("'City' -> 'city'")));
    }

    #[test]
    fn missing_required_lists_absent_names() {
        let keys = vec!["city".to_string()];
        assert_eq!(missing_required(&schema(), &keys), vec!["days".to_string()]);
    }
}
