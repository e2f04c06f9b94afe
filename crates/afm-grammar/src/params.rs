//! Argument values for the dialects that do not write arguments as one JSON object: the
//! XML-like ones (Qwen XML, MiniMax M2, DeepSeek DSML, GLM), one element per parameter, and
//! Gemma's `{key:<|"|>text<|"|>,n:5}`. Each value is written so that afm-chat's parser turns
//! it back into exactly a value the tool's schema accepts:
//!
//! ```text
//!  parser reads the value as      grammar writes
//!  a raw string (XML, `<|"|>`)    text matching the schema's string branch: enum/const,
//!                                 minLength/maxLength, pattern, a few formats; no closer inside
//!  JSON text                      %json {the parameter's schema}
//! ```
//!
//! Which reading applies mirrors the parser's rule (afm-chat `schema::types_of`): for the
//! dialects that mark nothing (Qwen, MiniMax) a value is a string whenever the schema's types
//! include `string` (or are unknown), so such parameters get raw text; the others get JSON.
//! A schema this cannot honour (a top-level `anyOf`, `minProperties`, a non-string `$ref` in a
//! raw-string dialect, ...) is reported, and the request is served best effort.

use afm_api::ToolDef;
use serde_json::{json, Map, Value};

use crate::lark::{lit, not_containing, rx, Lark, Markers};

/// Why a schema cannot be written in a dialect's syntax.
pub type Unsupported = String;

/// Keywords that never constrain a value.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$schema",
    "$id",
    "$anchor",
    "contentMediaType",
    "contentEncoding",
    "$defs",
    "definitions",
    "strict",
];

/// Keywords that constrain only values of other types than strings.
const NON_STRING: &[&str] = &[
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
    "patternProperties",
    "propertyNames",
    "additionalItems",
    "contains",
];

const MAX_DEPTH: usize = 16;

/// One parameter of a tool, in declaration order.
pub struct Param<'a> {
    pub name: &'a str,
    pub schema: &'a Value,
    pub required: bool,
}

/// The parameters of `tool`: its schema must be an object schema described by `properties`
/// (and `required`); nothing else at the top level can be honoured parameter by parameter.
pub fn params(tool: &ToolDef) -> Result<Vec<Param<'_>>, Unsupported> {
    let o = match &tool.parameters {
        // No schema, or `true`: any arguments, so none at all is valid.
        Value::Null | Value::Bool(true) => return Ok(Vec::new()),
        Value::Object(o) => o,
        _ => return Err(format!("{}: parameters is not an object schema", tool.name)),
    };
    if o.get("type").is_some_and(|t| t != "object") {
        return Err(format!(
            "{}: parameters of type {}, not an object",
            tool.name, o["type"]
        ));
    }
    for (k, v) in o {
        let ok = match k.as_str() {
            "type" => v == "object",
            "properties" | "required" | "additionalProperties" => true,
            k => ANNOTATIONS.contains(&k),
        };
        if !ok {
            return Err(format!("{}: top-level `{k}` in parameters", tool.name));
        }
    }
    let required: Vec<&str> = o
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let props = match o.get("properties") {
        Some(Value::Object(p)) => p,
        None if required.is_empty() => return Ok(Vec::new()),
        None => {
            return Err(format!(
                "{}: required parameters without properties",
                tool.name
            ))
        }
        Some(_) => return Err(format!("{}: properties is not an object", tool.name)),
    };
    if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
        return Err(format!(
            "{}: required `{r}` is not in properties",
            tool.name
        ));
    }
    Ok(props
        .iter()
        .map(|(name, schema)| Param {
            name,
            schema,
            required: required.contains(&name.as_str()),
        })
        .collect())
}

/// A name the dialects' tag and key syntax can carry unchanged.
pub fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '$' | '@'))
}

/// How a dialect reads raw string text.
pub struct RawText<'a> {
    /// Markers that would end the value early if they appeared in it.
    pub closers: &'a [&'a str],
    /// The parser trims all surrounding whitespace (MiniMax), so none may be written.
    pub trimmed: bool,
}

/// The JSON types afm-chat's parser sees in a schema: its own reading, so the grammar and the
/// parser cannot drift apart.
pub use afm_chat::tool_calls::{json_type, types_of as parser_types};

/// Schema context: the tool's whole parameters schema, for `$ref`s.
pub struct Ctx<'a> {
    pub root: &'a Value,
    pub markers: &'a Markers,
    /// JSON values sit inside an element whose closer the parser looks for in the raw text
    /// (XML dialects): strings in them must not spell a closing tag.
    pub guard_json: bool,
}

impl Ctx<'_> {
    /// The schema a local `$ref` points at.
    fn resolve<'v>(&'v self, r: &str) -> Result<&'v Value, Unsupported> {
        let pointer = r
            .strip_prefix('#')
            .ok_or_else(|| format!("non-local $ref {r}"))?;
        self.root
            .pointer(pointer)
            .ok_or_else(|| format!("$ref {r} points nowhere"))
    }

    /// A `%json` rule for `schema`, with the root's definitions carried along so its local
    /// `$ref`s still resolve.
    pub fn json_value(&self, lark: &mut Lark, schema: &Value) -> Result<String, Unsupported> {
        let mut s = match schema {
            Value::Object(o) => o.clone(),
            Value::Bool(true) => Map::new(),
            _ => return Err("a parameter schema that accepts nothing".into()),
        };
        for defs in ["$defs", "definitions"] {
            if let Some(d) = self.root.get(defs) {
                s.entry(defs).or_insert_with(|| d.clone());
            }
        }
        let mut s = Value::Object(s);
        if self.guard_json {
            s = guard_strings(&s, 0);
        }
        if let Value::Object(o) = &mut s {
            o.insert("x-guidance".into(), crate::grammars::json_options());
        }
        let text = serde_json::to_string(&s).map_err(|e| e.to_string())?;
        Ok(lark.rule(&format!("%json {text}")))
    }

    /// A terminal expression for the raw text of a string `schema` accepts, or None if it
    /// accepts no string.
    pub fn raw_string(
        &self,
        lark: &mut Lark,
        schema: &Value,
        raw: &RawText,
    ) -> Result<Option<String>, Unsupported> {
        let Some(body) = self.string_expr(lark, schema, 0)? else {
            return Ok(None);
        };
        let mut conj = vec![lark.terminal(&body)];
        conj.extend(not_containing(raw.closers));
        if raw.trimmed {
            conj.push(rx(r"(?:\S(?:\s*\S)*)?"));
        }
        Ok(Some(conj.join(" & ")))
    }

    fn string_expr(
        &self,
        lark: &mut Lark,
        schema: &Value,
        depth: usize,
    ) -> Result<Option<String>, Unsupported> {
        if depth > MAX_DEPTH {
            return Err("schema nesting too deep".into());
        }
        let o = match schema {
            Value::Bool(b) => return Ok(b.then(any_text)),
            Value::Object(o) => o,
            _ => return Err(format!("schema {schema} is not an object")),
        };
        if let Some(r) = o.get("$ref").and_then(Value::as_str) {
            only_annotations(o, &["$ref"])?;
            return self.string_expr(lark, self.resolve(r)?, depth + 1);
        }
        if let Some(c) = o.get("const") {
            return Ok(c.as_str().map(lit));
        }
        if let Some(e) = o.get("enum").and_then(Value::as_array) {
            let alts: Vec<String> = e.iter().filter_map(Value::as_str).map(lit).collect();
            return Ok((!alts.is_empty()).then(|| alts.join(" | ")));
        }
        for key in ["anyOf", "oneOf"] {
            let Some(alts) = o.get(key).and_then(Value::as_array) else {
                continue;
            };
            only_annotations(o, &[key])?;
            let mut exprs = Vec::new();
            for a in alts {
                if let Some(e) = self.string_expr(lark, a, depth + 1)? {
                    exprs.push(lark.terminal(&e));
                }
            }
            if key == "oneOf" && exprs.len() > 1 {
                return Err("oneOf with several string members".into());
            }
            return Ok((!exprs.is_empty()).then(|| exprs.join(" | ")));
        }
        match o.get("type") {
            Some(Value::String(t)) if t != "string" => return Ok(None),
            Some(Value::Array(ts)) if !ts.iter().any(|t| t == "string") => return Ok(None),
            _ => {}
        }
        let mut conj = Vec::new();
        for (k, v) in o {
            match k.as_str() {
                "type" => {}
                "minLength" | "maxLength" => {}
                "pattern" => conj.push(pattern(v.as_str().unwrap_or_default())?),
                "format" => conj.push(format(v.as_str().unwrap_or_default())?),
                k if ANNOTATIONS.contains(&k) || NON_STRING.contains(&k) => {}
                k => return Err(format!("`{k}` on a string parameter")),
            }
        }
        let min = o.get("minLength").and_then(Value::as_u64);
        let max = o.get("maxLength").and_then(Value::as_u64);
        if min.is_some() || max.is_some() {
            let min = min.unwrap_or(0);
            let max = max.map_or(String::new(), |m| m.to_string());
            conj.push(rx(&format!("(?s:.{{{min},{max}}})")));
        }
        if conj.is_empty() {
            conj.push(any_text());
        }
        Ok(Some(conj.join(" & ")))
    }
}

fn any_text() -> String {
    rx("(?s:.*)")
}

fn only_annotations(o: &Map<String, Value>, allowed: &[&str]) -> Result<(), Unsupported> {
    match o
        .keys()
        .find(|k| !allowed.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()))
    {
        Some(k) => Err(format!("`{k}` beside {}", allowed.join("/"))),
        None => Ok(()),
    }
}

/// A JSON Schema `pattern` (unanchored search) as a Lark regex over the whole value.
fn pattern(p: &str) -> Result<String, Unsupported> {
    let mut body = p;
    let start = body.strip_prefix('^');
    body = start.unwrap_or(body);
    let end = body.strip_suffix('$').filter(|b| !b.ends_with('\\'));
    body = end.unwrap_or(body);
    if has_bare_anchor(body) {
        return Err(format!("pattern {p:?} has anchors inside it"));
    }
    let body = llguidance::regex_to_lark(body, "dw");
    let head = if start.is_some() { "" } else { "(?s:.*)" };
    let tail = if end.is_some() { "" } else { "(?s:.*)" };
    Ok(rx(&format!("{head}(?:{body}){tail}")))
}

/// `^` or `$` outside a character class and not escaped.
fn has_bare_anchor(p: &str) -> bool {
    let (mut escaped, mut class) = (false, false);
    for c in p.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '[' => class = true,
            ']' => class = false,
            '^' | '$' if !class => return true,
            _ => {}
        }
    }
    false
}

/// The formats afm writes in raw text (others are refused: best effort).
fn format(f: &str) -> Result<String, Unsupported> {
    // Days per month, and 29 February only in leap years (RFC 3339 full-date).
    const DATE: &str = "(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|\
                        (?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))|\
                        (?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|\
                        (?:[02468][048]|[13579][26])00)-02-29)";
    const TIME: &str = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?\
                        (?:Z|[+\\-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
    let r = match f {
        "date" => DATE.to_string(),
        "time" => TIME.to_string(),
        "date-time" => format!("{DATE}T{TIME}"),
        "uuid" => "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}".to_string(),
        other => return Err(format!("string format {other:?} in raw text")),
    };
    Ok(rx(&r))
}

/// Whether a value of JSON type `t` survives the parser's coercion to `types` unchanged.
pub fn fits(t: &str, types: &[&str]) -> bool {
    types.is_empty() || types.contains(&t) || (t == "integer" && types.contains(&"number"))
}

/// The schema restricted to one JSON type, for `%json`: `type` replaced, enum/const kept.
pub fn only_type(schema: &Value, t: &str) -> Value {
    let mut s = match schema {
        Value::Object(o) => o.clone(),
        _ => Map::new(),
    };
    s.insert("type".into(), json!(t));
    Value::Object(s)
}

/// How a dialect's parser reads an element value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// As a string unless the schema's types exclude strings (Qwen XML, MiniMax).
    Unmarked,
    /// Raw for a plain-string schema, else as JSON (GLM's auto values, DSML's `string=`).
    PlainOrJson,
}

impl Ctx<'_> {
    /// One element value followed by `closer`: `(raw, lark)`, `raw` telling whether it is
    /// written as raw text (DSML says so in its `string=` attribute).
    pub fn element(
        &self,
        lark: &mut Lark,
        schema: &Value,
        reading: Reading,
        raw: &RawText,
        closer: &[&str],
    ) -> Result<(bool, String), Unsupported> {
        let types = parser_types(schema);
        let as_raw = match reading {
            Reading::Unmarked => types.is_empty() || types.contains(&"string"),
            Reading::PlainOrJson => types == ["string"],
        };
        if as_raw {
            let body = self.raw_string(lark, schema, raw)?.ok_or_else(|| {
                format!("the parser reads {schema} as a string, which it rejects")
            })?;
            return Ok((true, lark.text_then(&body, closer, self.markers)));
        }
        let value = self.json_value(lark, schema)?;
        Ok((false, format!("{value} {}", self.markers.seq(closer))))
    }
}

/// Strings with no `</` in them: a JSON value inside an XML element then never holds a closing
/// tag the parser could take for the element's end (GLM ends a call at any `</tool_call>`).
const NO_CLOSING_TAG: &str = "^(?:[^<]|<+[^</])*<*$";

/// `schema` with every string it admits (at any depth, `$defs` included) limited to
/// [`NO_CLOSING_TAG`]; an existing `pattern` is kept beside it under `allOf`.
fn guard_strings(schema: &Value, depth: usize) -> Value {
    let Value::Object(o) = schema else {
        return schema.clone();
    };
    if depth > MAX_DEPTH {
        return schema.clone();
    }
    let each = |v: &Value| guard_strings(v, depth + 1);
    let mut out = Map::new();
    for (k, v) in o {
        let g = match (k.as_str(), v) {
            ("properties" | "$defs" | "definitions" | "patternProperties", Value::Object(m)) => {
                Value::Object(m.iter().map(|(k, v)| (k.clone(), each(v))).collect())
            }
            ("items" | "additionalProperties" | "additionalItems" | "contains", _) => each(v),
            ("prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(a)) => {
                Value::Array(a.iter().map(each).collect())
            }
            _ => v.clone(),
        };
        out.insert(k.clone(), g);
    }
    let typed_string = match o.get("type") {
        None => !["$ref", "enum", "const", "anyOf", "oneOf", "allOf"]
            .iter()
            .any(|k| o.contains_key(*k)),
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "string"),
        Some(_) => false,
    };
    if !typed_string || o.contains_key("enum") || o.contains_key("const") {
        return Value::Object(out);
    }
    if o.contains_key("pattern") {
        return json!({"allOf": [Value::Object(out), {"pattern": NO_CLOSING_TAG}]});
    }
    out.insert("pattern".into(), json!(NO_CLOSING_TAG));
    Value::Object(out)
}
