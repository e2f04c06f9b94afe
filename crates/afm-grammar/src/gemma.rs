//! Gemma's call syntax as a grammar: `call:name{key:value,..}` inside `<|tool_call>` ..
//! `<tool_call|>` (Gemma 4) or `<start_function_call>` .. `<end_function_call>` (FunctionGemma),
//! with keys bare and strings between `<|"|>` (or `<escape>`) delimiters, never quoted:
//!
//! ```text
//!  string          <|"|>raw text, no delimiter inside<|"|>
//!  number/bool/null JSON literal (%json of the schema restricted to that type)
//!  object          {key:value,key:value}      required keys always, optional ones maybe
//!  array           [value,value]              within minItems..maxItems
//! ```
//!
//! afm-chat reads top-level strings raw, other top-level values as JSON, and nested objects
//! and arrays with its lenient reader, then coerces values to the schema's types as it sees
//! them (no `$ref`s). A value is offered only in a type that coercion leaves unchanged, so
//! what the model writes is what the client gets.

use afm_api::ToolDef;
use serde_json::Value;

use crate::lark::{lit, Lark, Markers};
use crate::params::{
    fits, json_type, only_type, params, parser_types, plain_name, Ctx, RawText, Unsupported,
};

const MAX_DEPTH: usize = 12;

/// The markers of one Gemma generation.
pub struct Syntax<'a> {
    open: &'static str,
    close: &'static str,
    delim: &'static str,
    markers: &'a Markers,
}

impl<'a> Syntax<'a> {
    /// FunctionGemma when the vocabulary has its call token and not Gemma 4's, else Gemma 4
    /// (also as text, for a model forced to this dialect).
    pub fn for_vocabulary(markers: &'a Markers) -> Self {
        let function_gemma = markers.token("<start_function_call>").is_some()
            && markers.token("<|tool_call>").is_none();
        match function_gemma {
            true => Syntax {
                open: "<start_function_call>",
                close: "<end_function_call>",
                delim: "<escape>",
                markers,
            },
            false => Syntax {
                open: "<|tool_call>",
                close: "<tool_call|>",
                delim: "<|\"|>",
                markers,
            },
        }
    }

    /// One call of `tool`.
    pub fn call(&self, lark: &mut Lark, tool: &ToolDef) -> Result<String, Unsupported> {
        if !plain_name(&tool.name) {
            return Err(format!("tool name {:?} cannot be written", tool.name));
        }
        // Scalars only go through %json here: no string can hide a closer.
        let ctx = Ctx {
            root: &tool.parameters,
            markers: self.markers,
            guard_json: false,
        };
        let mut members = Vec::new();
        for p in params(tool)? {
            let value = self.value(lark, &ctx, p.schema, Some(p.schema), 0)?;
            members.push((self.member(lark, p.name, &value)?, p.required));
        }
        let body = separated(lark, &members, &lit(","));
        let head = self
            .markers
            .seq(&[self.open, &format!("call:{}{{", tool.name)]);
        let tail = self.markers.seq(&["}", self.close]);
        Ok(format!("{head} {body} {tail}"))
    }

    fn member(&self, lark: &mut Lark, key: &str, value: &str) -> Result<String, Unsupported> {
        if !plain_name(key) {
            return Err(format!("key {key:?} cannot be written bare"));
        }
        Ok(lark.rule(&format!("{} {value}", lit(&format!("{key}:")))))
    }

    /// A value of `schema`; `view` is the schema the parser's coercion sees at this place
    /// (None once it has lost track, e.g. behind a `$ref`).
    fn value(
        &self,
        lark: &mut Lark,
        ctx: &Ctx,
        schema: &Value,
        view: Option<&Value>,
        depth: usize,
    ) -> Result<String, Unsupported> {
        if depth > MAX_DEPTH {
            return Err("schema nesting too deep".into());
        }
        let types = view.map(parser_types).unwrap_or_default();
        let ok = |t: &str| fits(t, &types);
        let o = match schema {
            Value::Bool(true) => return self.any_scalar(lark, ctx, &types),
            Value::Object(o) => o,
            _ => return Err(format!("schema {schema} accepts nothing")),
        };
        if let Some(r) = o.get("$ref").and_then(Value::as_str) {
            let target = ctx
                .root
                .pointer(r.trim_start_matches('#'))
                .ok_or_else(|| format!("$ref {r} points nowhere"))?;
            // Coercion does not follow the reference: from here on it sees nothing.
            return self.value(lark, ctx, target, None, depth + 1);
        }
        let members = o.get("enum").and_then(Value::as_array).cloned();
        let members = members.or_else(|| o.get("const").map(|c| vec![c.clone()]));
        if let Some(members) = members {
            let alts: Vec<String> = members
                .iter()
                .filter(|v| ok(json_type(v)))
                .filter_map(|v| match v {
                    Value::String(s) => Some(self.string_literal(s)),
                    Value::Object(_) | Value::Array(_) => None,
                    scalar => Some(lit(&scalar.to_string())),
                })
                .collect();
            return match alts.is_empty() {
                true => Err(format!("no member of {schema} can be written")),
                false => Ok(lark.rule(&alts.join(" | "))),
            };
        }
        for key in ["anyOf", "oneOf"] {
            let Some(alts) = o.get(key).and_then(Value::as_array) else {
                continue;
            };
            if key == "oneOf" && alts.len() > 1 && !distinct_types(alts) && !discriminated(alts) {
                return Err("oneOf whose members may overlap".into());
            }
            let mut out = Vec::new();
            for a in alts {
                // Coercion sees the union's types here, and the member's own below.
                match self.value(lark, ctx, a, view.map(|_| a), depth + 1) {
                    Ok(v) => out.push(v),
                    Err(e) if alts.len() == 1 => return Err(e),
                    Err(_) => {}
                }
            }
            return match out.is_empty() {
                true => Err(format!("no member of {key} can be written")),
                false => Ok(lark.rule(&out.join(" | "))),
            };
        }
        let declared: Vec<&str> = match o.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ if o.contains_key("properties") => vec!["object"],
            _ if o.contains_key("items") => vec!["array"],
            _ => vec!["string", "number", "boolean", "null"],
        };
        let mut out = Vec::new();
        for t in declared.into_iter().filter(|t| ok(t)) {
            out.push(match t {
                "string" => match self.string(lark, ctx, schema)? {
                    Some(s) => s,
                    None => continue,
                },
                "object" => self.object(lark, ctx, o, view, depth)?,
                "array" => self.array(lark, ctx, o, view, depth)?,
                "integer" | "number" | "boolean" | "null" => {
                    ctx.json_value(lark, &only_type(schema, t))?
                }
                other => return Err(format!("type {other:?}")),
            });
        }
        match out.is_empty() {
            true => Err(format!(
                "no type of {schema} survives the parser's coercion"
            )),
            false => Ok(lark.rule(&out.join(" | "))),
        }
    }

    fn any_scalar(
        &self,
        lark: &mut Lark,
        ctx: &Ctx,
        types: &[&str],
    ) -> Result<String, Unsupported> {
        let mut out = Vec::new();
        for t in ["string", "number", "boolean", "null"] {
            if !fits(t, types) {
                continue;
            }
            out.push(match t {
                "string" => self
                    .string(lark, ctx, &Value::Bool(true))?
                    .unwrap_or_default(),
                t => ctx.json_value(lark, &only_type(&Value::Null, t))?,
            });
        }
        Ok(lark.rule(&out.join(" | ")))
    }

    fn string_literal(&self, s: &str) -> String {
        let d = self.markers.atom(self.delim);
        format!("{d} {} {d}", lit(s))
    }

    fn string(
        &self,
        lark: &mut Lark,
        ctx: &Ctx,
        schema: &Value,
    ) -> Result<Option<String>, Unsupported> {
        let raw = RawText {
            closers: &[self.delim],
            trimmed: false,
        };
        let Some(body) = ctx.raw_string(lark, &only_type(schema, "string"), &raw)? else {
            return Ok(None);
        };
        let close = lark.text_then(&body, &[self.delim], self.markers);
        Ok(Some(lark.rule(&format!(
            "{} {close}",
            self.markers.atom(self.delim)
        ))))
    }

    fn object(
        &self,
        lark: &mut Lark,
        ctx: &Ctx,
        o: &serde_json::Map<String, Value>,
        view: Option<&Value>,
        depth: usize,
    ) -> Result<String, Unsupported> {
        for k in [
            "minProperties",
            "maxProperties",
            "patternProperties",
            "propertyNames",
        ] {
            if o.contains_key(k) {
                return Err(format!("`{k}` on a nested object"));
            }
        }
        let required: Vec<&str> = o
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let empty = serde_json::Map::new();
        let props = o
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
            return Err(format!("required `{r}` is not in properties"));
        }
        let mut members = Vec::new();
        for (k, s) in props {
            // Coercion descends through `properties` only.
            let sub_view = view
                .and_then(|v| v.get("properties"))
                .and_then(|p| p.get(k));
            let value = self.value(lark, ctx, s, sub_view, depth + 1)?;
            members.push((
                self.member(lark, k, &value)?,
                required.contains(&k.as_str()),
            ));
        }
        let body = separated(lark, &members, &lit(","));
        Ok(lark.rule(&format!("{} {body} {}", lit("{"), lit("}"))))
    }

    fn array(
        &self,
        lark: &mut Lark,
        ctx: &Ctx,
        o: &serde_json::Map<String, Value>,
        view: Option<&Value>,
        depth: usize,
    ) -> Result<String, Unsupported> {
        for k in ["prefixItems", "uniqueItems", "contains", "additionalItems"] {
            if o.contains_key(k) {
                return Err(format!("`{k}` on an array"));
            }
        }
        let any = Value::Bool(true);
        let items = o.get("items").unwrap_or(&any);
        let sub_view = view.and_then(|v| v.get("items"));
        let item = self.value(lark, ctx, items, sub_view, depth + 1)?;
        let min = o.get("minItems").and_then(Value::as_u64).unwrap_or(0);
        let max = o.get("maxItems").and_then(Value::as_u64);
        if min > 64 || max.is_some_and(|m| m < min) {
            return Err("unusable minItems/maxItems".into());
        }
        let comma = lit(",");
        let more = lark.rule(&format!("{comma} {item}"));
        let tail = match (min, max) {
            (_, Some(0)) => None,
            (0, None) => Some(format!("{item} {more}*")),
            (n, None) => Some(format!("{item} {more}{{{},}}", n - 1)),
            (n, Some(m)) => Some(match m {
                1 => item.clone(),
                m => format!("{item} {more}{{{},{}}}", n.saturating_sub(1), m - 1),
            }),
        };
        let body = match (tail, min) {
            (None, _) => String::new(),
            (Some(t), 0) => format!("({t})?"),
            (Some(t), _) => t,
        };
        Ok(lark.rule(&format!("{} {body} {}", lit("["), lit("]"))))
    }
}

/// Members in order with `sep` between those present: required ones always, optional ones
/// maybe. Linear in the member count (`first_i` / `rest_i` chains).
fn separated(lark: &mut Lark, members: &[(String, bool)], sep: &str) -> String {
    let empty = lit("");
    let (mut rest, mut first) = (empty.clone(), empty.clone());
    for (m, required) in members.iter().rev() {
        let with_rest = format!("{sep} {m} {rest}");
        let start = format!("{m} {rest}");
        let (r, f) = match required {
            true => (with_rest, start),
            false => (
                format!("({with_rest}) | ({rest})"),
                format!("({start}) | ({first})"),
            ),
        };
        rest = lark.rule(&r);
        first = lark.rule(&f);
    }
    first
}

fn distinct_types(alts: &[Value]) -> bool {
    let mut seen = Vec::new();
    for a in alts {
        let Some(t) = a.get("type").and_then(Value::as_str) else {
            return false;
        };
        if seen.contains(&t) || (t == "integer" && seen.contains(&"number")) {
            return false;
        }
        seen.push(t);
    }
    true
}

/// Objects told apart by one required property whose `const` differs in each (a tagged union,
/// `{"method": {"const": "card"}, ..}`): no value can match two of them.
fn discriminated(alts: &[Value]) -> bool {
    let tag_of = |a: &Value, key: &str| -> Option<Value> {
        let required = a.get("required")?.as_array()?;
        if !required.iter().any(|r| r == key) {
            return None;
        }
        let p = a.get("properties")?.get(key)?;
        match (p.get("const"), p.get("enum").and_then(Value::as_array)) {
            (Some(c), _) => Some(c.clone()),
            (None, Some(e)) if e.len() == 1 => Some(e[0].clone()),
            _ => None,
        }
    };
    let Some(first) = alts.first().and_then(|a| a.get("properties")?.as_object()) else {
        return false;
    };
    first.keys().any(|key| {
        let tags: Vec<Option<Value>> = alts.iter().map(|a| tag_of(a, key)).collect();
        tags.iter().all(Option::is_some)
            && tags.iter().enumerate().all(|(i, t)| !tags[..i].contains(t))
    })
}
