//! Strict tool-call grammars, one layout per dialect afm-chat's parser reads. Every layout is
//! the dialect's canonical form (what the model was trained to write), with the exact markers
//! the parser expects:
//!
//! ```text
//!  hermes      <tool_call>\n{"name": f, "arguments": {..}}\n</tool_call>        "\n" between
//!  llama3_json {"name": f, "parameters": {..}}                                  "; " between
//!  mistral     [TOOL_CALLS][{"name": f, "arguments": {..}}, ..]      (v3 vocabularies)
//!              [TOOL_CALLS]f[ARGS]{..}[TOOL_CALLS]g[ARGS]{..}        (with an [ARGS] token)
//!  qwen3_xml   <tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>
//!  minimax_m2  <minimax:tool_call>\n<invoke name="f">\n<parameter name="p">value</parameter>\n
//!              </invoke>\n</minimax:tool_call>
//!  deepseek_v4 <｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="p"
//!              string="true|false">value</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>
//!              (or `tool_calls` for both section tags)
//!  glm4        <tool_call>f\n<arg_key>p</arg_key>\n<arg_value>value</arg_value>\n</tool_call>
//!  kimi_k2     <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
//!              <|tool_call_argument_begin|>{..}<|tool_call_end|><|tool_calls_section_end|>
//!  deepseek_v3 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{..}\n```
//!              <｜tool▁call▁end｜><｜tool▁calls▁end｜>   (or V3.1's f<｜tool▁sep｜>{..})
//!  gemma       <|tool_call>call:f{p:<|"|>text<|"|>,n:5}<tool_call|>     (Gemma 4)
//!              <start_function_call>call:f{p:<escape>text<escape>}<end_function_call>
//! ```
//!
//! Around the calls: `tool_choice` required or named ⇒ calls only; auto ⇒ calls, or text that
//! contains none of the dialect's openers (so the parser never finds a call in it);
//! `parallel_tool_calls: false` ⇒ exactly one call.

use afm_api::ToolDef;
use afm_chat::tool_calls::ToolCallFormat;
use serde_json::{json, Value};

use crate::grammars::{call_schema, json_options};
use crate::lark::{lit, rx, Lark, Markers};
use crate::params::{params, plain_name, Ctx, RawText, Reading};
use crate::GrammarError;

/// How a turn's calls sit together.
struct Turn {
    /// One call (of any tool).
    call: String,
    /// Around all calls: alternatives of (opener, closer) Lark expressions.
    sections: Vec<(String, String)>,
    /// Between calls (a Lark expression, possibly empty).
    sep: String,
}

impl Turn {
    fn new(call: String) -> Self {
        Turn {
            call,
            sections: Vec::new(),
            sep: String::new(),
        }
    }

    fn sep(mut self, sep: String) -> Self {
        self.sep = sep;
        self
    }

    fn section(mut self, open: String, close: String) -> Self {
        self.sections.push((open, close));
        self
    }
}

/// The Lark grammar for strict tool calls in `format`.
pub fn tool_lark(
    tools: &[ToolDef],
    required: bool,
    parallel: bool,
    format: ToolCallFormat,
    markers: &Markers,
) -> Result<String, GrammarError> {
    if tools.is_empty() {
        return Err(GrammarError::Inexpressible {
            dialect: format.name().to_string(),
            reason: "no tools".into(),
        });
    }
    let mut lark = Lark::default();
    let turn = turn(&mut lark, tools, format, markers)?;
    let mut body = match parallel {
        true if turn.sep.is_empty() => format!("{}+", turn.call),
        true => format!("{c} ({} {c})*", turn.sep, c = turn.call),
        false => turn.call.clone(),
    };
    if !turn.sections.is_empty() {
        let alts: Vec<String> = turn
            .sections
            .iter()
            .map(|(open, close)| format!("({open} {body} {close})"))
            .collect();
        body = alts.join(" | ");
    }
    let calls = lark.rule(&body);
    let start = match required {
        true => calls,
        false => format!("{calls} | {}", lark.terminal(&free_text(format))),
    };
    Ok(lark.finish(&start))
}

/// The dialect's call, section and separator.
fn turn(
    lark: &mut Lark,
    tools: &[ToolDef],
    format: ToolCallFormat,
    m: &Markers,
) -> Result<Turn, GrammarError> {
    let xml = |r: Result<String, String>| {
        r.map_err(|reason| GrammarError::Inexpressible {
            dialect: format.name().to_string(),
            reason,
        })
    };
    let nl = || lit("\n");
    Ok(match format {
        ToolCallFormat::Hermes => {
            let (open, close) = (["<tool_call>", "\n"], ["\n", "</tool_call>"]);
            Turn::new(json_call(lark, tools, "arguments", &open, &close, m)?).sep(nl())
        }
        ToolCallFormat::Llama3Json => {
            Turn::new(json_call(lark, tools, "parameters", &[], &[], m)?).sep(lit("; "))
        }
        ToolCallFormat::Mistral if m.token("[ARGS]").is_some() => {
            Turn::new(each(lark, tools, |l, t| mistral_call(l, t, m))?)
        }
        ToolCallFormat::Mistral => Turn::new(json_call(lark, tools, "arguments", &[], &[], m)?)
            .section(m.seq(&["[TOOL_CALLS]", "["]), lit("]"))
            .sep(lit(", ")),
        ToolCallFormat::KimiK2 => {
            let index = lark.terminal(&rx("[0-9]{1,3}"));
            Turn::new(each(lark, tools, |l, t| kimi_call(l, t, m, &index))?).section(
                m.atom("<|tool_calls_section_begin|>"),
                m.atom("<|tool_calls_section_end|>"),
            )
        }
        ToolCallFormat::DeepSeekV3 => Turn::new(each(lark, tools, |l, t| deepseek_call(l, t, m))?)
            .section(
                m.atom("<｜tool▁calls▁begin｜>"),
                m.atom("<｜tool▁calls▁end｜>"),
            )
            .sep(format!("{}?", nl())),
        ToolCallFormat::QwenXml => {
            Turn::new(each(lark, tools, |l, t| xml(qwen_call(l, t, m)))?).sep(nl())
        }
        ToolCallFormat::MinimaxM2 => {
            Turn::new(each(lark, tools, |l, t| xml(minimax_call(l, t, m)))?)
                .section(
                    m.seq(&["<minimax:tool_call>", "\n"]),
                    m.seq(&["\n", "</minimax:tool_call>"]),
                )
                .sep(nl())
        }
        ToolCallFormat::DeepSeekV4Dsml => {
            let tag = |open: &str, tag: &str| match open {
                "" => m.seq(&["\n", &format!("</｜DSML｜{tag}>")]),
                _ => m.seq(&[&format!("<｜DSML｜{tag}>"), "\n"]),
            };
            Turn::new(each(lark, tools, |l, t| xml(dsml_call(l, t, m)))?)
                .section(tag("o", "function_calls"), tag("", "function_calls"))
                .section(tag("o", "tool_calls"), tag("", "tool_calls"))
                .sep(nl())
        }
        ToolCallFormat::Glm4 => {
            Turn::new(each(lark, tools, |l, t| xml(glm_call(l, t, m)))?).sep(nl())
        }
        ToolCallFormat::Gemma => {
            let g = crate::gemma::Syntax::for_vocabulary(m);
            Turn::new(each(lark, tools, |l, t| xml(g.call(l, t)))?)
        }
        ToolCallFormat::None => return Err(GrammarError::UnsupportedFormat("none".into())),
    })
}

/// One call of any of `tools`: a rule with one alternative per tool.
fn each(
    lark: &mut Lark,
    tools: &[ToolDef],
    mut call: impl FnMut(&mut Lark, &ToolDef) -> Result<String, GrammarError>,
) -> Result<String, GrammarError> {
    let mut alts = Vec::with_capacity(tools.len());
    for t in tools {
        alts.push(call(lark, t)?);
    }
    Ok(lark.rule(&alts.join(" | ")))
}

/// Mistral v11+: `[TOOL_CALLS]name[ARGS]{..}`, each call with its own `[TOOL_CALLS]`.
fn mistral_call(lark: &mut Lark, t: &ToolDef, m: &Markers) -> Result<String, GrammarError> {
    let args = args_json(lark, t)?;
    Ok(format!(
        "{} {args}",
        m.seq(&["[TOOL_CALLS]", &t.name, "[ARGS]"])
    ))
}

fn kimi_call(
    lark: &mut Lark,
    t: &ToolDef,
    m: &Markers,
    index: &str,
) -> Result<String, GrammarError> {
    let args = args_json(lark, t)?;
    let head = m.seq(&["<|tool_call_begin|>", &format!("functions.{}:", t.name)]);
    let mid = m.atom("<|tool_call_argument_begin|>");
    Ok(format!(
        "{head} {index} {mid} {args} {}",
        m.atom("<|tool_call_end|>")
    ))
}

/// DeepSeek V3/R1 (`function<｜tool▁sep｜>name` and a json fence) or V3.1 (`name<｜tool▁sep｜>`
/// and bare JSON): either form, as the model was trained.
fn deepseek_call(lark: &mut Lark, t: &ToolDef, m: &Markers) -> Result<String, GrammarError> {
    let args = args_json(lark, t)?;
    let head = m.seq(&[
        "function",
        "<｜tool▁sep｜>",
        &format!("{}\n```json\n", t.name),
    ]);
    let v3 = format!("{head} {args} {}", lit("\n```"));
    let v31 = format!("{} {args}", m.seq(&[&t.name, "<｜tool▁sep｜>"]));
    // A tool named `function` would read as V3's header.
    let body = match t.name.as_str() {
        "function" => v3,
        _ => format!("({v3}) | ({v31})"),
    };
    let (open, close) = (
        m.atom("<｜tool▁call▁begin｜>"),
        m.atom("<｜tool▁call▁end｜>"),
    );
    Ok(format!("{open} ({body}) {close}"))
}

/// Text the parser reads as text only: none of the dialect's openers anywhere (afm-chat's
/// opener table), and for Llama no `{` first.
fn free_text(format: ToolCallFormat) -> String {
    let openers: &[&str] = match format {
        ToolCallFormat::Hermes => &["<tool_call>", "```json"],
        ToolCallFormat::Llama3Json => &["<|python_tag|>"],
        ToolCallFormat::Mistral => &["[TOOL_CALLS]"],
        ToolCallFormat::QwenXml => &["<tool_call>", "<function="],
        ToolCallFormat::Gemma => &["<|tool_call>", "<start_function_call>", "```tool_code"],
        ToolCallFormat::Glm4 => &["<tool_call>"],
        ToolCallFormat::KimiK2 => &[
            "<|tool_calls_section_begin|>",
            "<|tool_call_section_begin|>",
            "<|tool_call_begin|>",
        ],
        ToolCallFormat::MinimaxM2 => &["<minimax:tool_call>", "<invoke name="],
        ToolCallFormat::DeepSeekV3 => &["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"],
        ToolCallFormat::DeepSeekV4Dsml => &[
            "<｜DSML｜tool_calls>",
            "<｜DSML｜function_calls>",
            "<｜DSML｜invoke name=",
        ],
        ToolCallFormat::None => &[],
    };
    let mut t = rx("(?s:.+)");
    if let Some(not) = crate::lark::not_containing(openers) {
        t = format!("{t} & {not}");
    }
    if format == ToolCallFormat::Llama3Json {
        t = format!("{t} & ~{}", rx(r"(?s:\s*\{.*)"));
    }
    t
}

/// A JSON call object `{"name": .., "<args_key>": ..}` between `open` and `close` markers.
fn json_call(
    lark: &mut Lark,
    tools: &[ToolDef],
    args_key: &str,
    open: &[&str],
    close: &[&str],
    m: &Markers,
) -> Result<String, GrammarError> {
    let body =
        serde_json::to_string(&call_schema(tools, args_key)).map_err(|e| GrammarError::Schema {
            param: "tools".into(),
            message: e.to_string(),
        })?;
    let body = lark.rule(&format!("%json {body}"));
    Ok(lark.rule(&format!("{} {body} {}", m.seq(open), m.seq(close))))
}

/// A `%json` rule for a tool's arguments object.
fn args_json(lark: &mut Lark, tool: &ToolDef) -> Result<String, GrammarError> {
    let mut schema = match &tool.parameters {
        Value::Object(o) => o.clone(),
        _ => json!({"type": "object", "additionalProperties": false})
            .as_object()
            .cloned()
            .unwrap_or_default(),
    };
    schema.insert("x-guidance".into(), json_options());
    let text = serde_json::to_string(&schema).map_err(|e| GrammarError::Schema {
        param: "tools".into(),
        message: e.to_string(),
    })?;
    Ok(lark.rule(&format!("%json {text}")))
}

fn check_names(tool: &ToolDef) -> Result<(), String> {
    if !plain_name(&tool.name) {
        return Err(format!(
            "tool name {:?} cannot be written in a tag",
            tool.name
        ));
    }
    Ok(())
}

/// Writes one parameter's element: (grammar, schema context, name, schema) -> Lark.
type Element<'e> = dyn FnMut(&mut Lark, &Ctx, &str, &Value) -> Result<String, String> + 'e;

/// One element per parameter, in declaration order, optional ones optional.
fn elements(
    lark: &mut Lark,
    tool: &ToolDef,
    m: &Markers,
    element: &mut Element,
) -> Result<String, String> {
    check_names(tool)?;
    let ctx = Ctx {
        root: &tool.parameters,
        markers: m,
        guard_json: true,
    };
    let mut out = Vec::new();
    for p in params(tool)? {
        if !plain_name(p.name) {
            return Err(format!(
                "parameter name {:?} cannot be written in a tag",
                p.name
            ));
        }
        let e = element(lark, &ctx, p.name, p.schema)?;
        let rule = lark.rule(&e);
        out.push(if p.required { rule } else { format!("{rule}?") });
    }
    Ok(out.join(" "))
}

fn qwen_call(lark: &mut Lark, tool: &ToolDef, m: &Markers) -> Result<String, String> {
    let raw = RawText {
        closers: &["</parameter>", "</function>"],
        trimmed: false,
    };
    let params = elements(lark, tool, m, &mut |lark, ctx, name, schema| {
        let head = ctx.markers.atom(&format!("<parameter={name}>\n"));
        let closer = ["\n</parameter>\n"];
        let (_, value) = ctx.element(lark, schema, Reading::Unmarked, &raw, &closer)?;
        Ok(format!("{head} {value}"))
    })?;
    let open = m.seq(&["<tool_call>", &format!("\n<function={}>\n", tool.name)]);
    let close = m.seq(&["</function>\n", "</tool_call>"]);
    Ok(format!("{open} {params} {close}"))
}

fn minimax_call(lark: &mut Lark, tool: &ToolDef, m: &Markers) -> Result<String, String> {
    let raw = RawText {
        closers: &["</parameter>", "</invoke>"],
        trimmed: true,
    };
    let params = elements(lark, tool, m, &mut |lark, ctx, name, schema| {
        let head = ctx.markers.atom(&format!("<parameter name=\"{name}\">"));
        let closer = ["</parameter>\n"];
        let (_, value) = ctx.element(lark, schema, Reading::Unmarked, &raw, &closer)?;
        Ok(format!("{head} {value}"))
    })?;
    let open = m.atom(&format!("<invoke name=\"{}\">\n", tool.name));
    Ok(format!("{open} {params} {}", m.atom("</invoke>")))
}

fn dsml_call(lark: &mut Lark, tool: &ToolDef, m: &Markers) -> Result<String, String> {
    let raw = RawText {
        closers: &["</｜DSML｜parameter>", "</｜DSML｜invoke>"],
        trimmed: false,
    };
    let params = elements(lark, tool, m, &mut |lark, ctx, name, schema| {
        let closer = ["</｜DSML｜parameter>", "\n"];
        let (is_raw, value) = ctx.element(lark, schema, Reading::PlainOrJson, &raw, &closer)?;
        let head = format!("<｜DSML｜parameter name=\"{name}\" string=\"{is_raw}\">");
        Ok(format!("{} {value}", ctx.markers.atom(&head)))
    })?;
    let open = m.atom(&format!("<｜DSML｜invoke name=\"{}\">\n", tool.name));
    Ok(format!("{open} {params} {}", m.atom("</｜DSML｜invoke>")))
}

fn glm_call(lark: &mut Lark, tool: &ToolDef, m: &Markers) -> Result<String, String> {
    let raw = RawText {
        closers: &["</arg_value>", "</tool_call>"],
        trimmed: false,
    };
    let params = elements(lark, tool, m, &mut |lark, ctx, name, schema| {
        let head = ctx
            .markers
            .seq(&["<arg_key>", name, "</arg_key>", "\n", "<arg_value>"]);
        let closer = ["</arg_value>", "\n"];
        let (_, value) = ctx.element(lark, schema, Reading::PlainOrJson, &raw, &closer)?;
        Ok(format!("{head} {value}"))
    })?;
    let open = m.seq(&["<tool_call>", &format!("{}\n", tool.name)]);
    Ok(format!("{open} {params} {}", m.atom("</tool_call>")))
}
