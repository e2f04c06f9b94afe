//! Chat templates: Jinja from `tokenizer_config.json`, `chat_template.jinja` or GGUF
//! `tokenizer.chat_template`, rendered with minijinja the way transformers' `apply_chat_template`
//! renders them (trim_blocks + lstrip_blocks, loop controls, `raise_exception`, Python-style
//! `tojson`, `strftime_now`, `namespace`, Python string/dict methods).
//!
//! Templates come from model files and may be hostile, so rendering is sandboxed: minijinja has no
//! file or network access, every render runs on a fuel budget (instructions) and a recursion limit,
//! and output past a byte limit aborts the render. Memory a template builds in variables (a string
//! doubled in a loop) has no bound in-process; a server renders through [`ChatTemplate::sandboxed`],
//! in worker processes with a memory, CPU and wall-clock limit (`sandbox.rs`).

mod pyjson;
pub mod sandbox;
mod strftime;

pub use sandbox::{serve_worker, SandboxConfig, TemplateSandbox};

use crate::tokenizer::hf::{dir_json, token_content};
use crate::{ChatError, Tokenizer};
use afm_models::weights::{GgufFile, GgufValue};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};
use std::path::Path;
use std::sync::Arc;

const RAISE_PREFIX: &str = "raise_exception: ";

/// Limits on one render.
#[derive(Clone, Copy, Debug)]
pub struct RenderLimits {
    /// Output bytes; rendering stops with an error past this.
    pub max_output_bytes: usize,
    /// minijinja instructions per render.
    pub fuel: u64,
    /// Nesting depth of macro calls, includes and loops.
    pub max_recursion: usize,
}

impl Default for RenderLimits {
    fn default() -> Self {
        Self {
            max_output_bytes: 16 << 20,
            fuel: 10_000_000,
            max_recursion: 64,
        }
    }
}

/// Documented plain format for models without a template (e.g. Gemma 3 270M base):
///
/// ```text
/// {system content}\n\n            (system messages: the content alone)
/// User: {content}\n\n
/// Assistant: {content}\n\n
/// {Role}: {content}\n\n            (any other role, capitalized)
/// Assistant:                       (when add_generation_prompt)
/// ```
/// BOS is not part of the text: the tokenizer adds it per the model's rules.
pub const FALLBACK_TEMPLATE: &str = "{%- for message in messages -%}\
{%- if message.role == 'system' -%}{{ message.content }}\
{%- elif message.role == 'user' -%}{{ 'User: ' ~ message.content }}\
{%- elif message.role == 'assistant' -%}{{ 'Assistant: ' ~ message.content }}\
{%- else -%}{{ message.role | capitalize ~ ': ' ~ message.content }}\
{%- endif -%}{{ '\\n\\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}Assistant:{%- endif -%}";

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    limits: RenderLimits,
    /// Set by [`ChatTemplate::sandboxed`]: renders go to worker processes.
    sandbox: Option<sandbox::Sandboxed>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .finish()
    }
}

fn template_err(e: Error) -> ChatError {
    if e.kind() == ErrorKind::InvalidOperation {
        if let Some(msg) = e.detail().and_then(|d| d.strip_prefix(RAISE_PREFIX)) {
            return ChatError::TemplateRaised(msg.to_string());
        }
    }
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    ChatError::Template(msg)
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISE_PREFIX}{msg}"),
    ))
}

fn strftime_now(fmt: String) -> String {
    strftime::format(&strftime::now_utc(), &fmt)
}

impl ChatTemplate {
    /// Compiles `src`; `bos_token`/`eos_token` are the texts templates see under those names.
    pub fn from_source(src: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        Self::with_limits(src, bos_token, eos_token, RenderLimits::default())
    }

    pub fn with_limits(
        src: &str,
        bos_token: &str,
        eos_token: &str,
        limits: RenderLimits,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(limits.fuel));
        env.set_recursion_limit(limits.max_recursion);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(pyjson::py_formatter);
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_function("dict", minijinja::functions::dict);
        if let Some(at) = import_tag(src) {
            return Err(ChatError::Template(format!(
                "the template imports another template (byte {at}); templates cannot load files here"
            )));
        }
        // Backstop: the compiler is not to panic on any source, but minijinja has had such bugs.
        let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            env.add_template_owned("chat", src.to_string())
        }))
        .map_err(|_| ChatError::Template("the template crashed its compiler".into()))?;
        compiled.map_err(template_err)?;
        Ok(Self {
            env,
            source: src.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            limits,
            sandbox: None,
        })
    }

    /// From now on renders run in `sandbox`'s worker processes, each bounded in memory, CPU
    /// and wall-clock time; one worker is started (and the template loaded) here.
    pub fn sandboxed(mut self, sandbox: &Arc<TemplateSandbox>) -> Result<Self, ChatError> {
        self.sandbox = Some(sandbox.adopt(&self)?);
        Ok(self)
    }

    /// The GGUF's `tokenizer.chat_template`, if it has one.
    pub fn from_gguf(g: &GgufFile, tok: &Tokenizer) -> Result<Option<Self>, ChatError> {
        let Some(src) = g.get("tokenizer.chat_template").and_then(GgufValue::as_str) else {
            return Ok(None);
        };
        let (bos, eos) = special_texts(tok);
        Self::from_source(src, &bos, &eos).map(Some)
    }

    /// `chat_template.jinja`, else tokenizer_config.json's `chat_template` (a string, or a list of
    /// named templates of which "default" is used).
    pub fn from_hf_dir(dir: &Path, tok: &Tokenizer) -> Result<Option<Self>, ChatError> {
        let cfg = dir_json(dir, "tokenizer_config.json")?.unwrap_or(Json::Null);
        let (mut bos, mut eos) = special_texts(tok);
        if let Some(b) = token_content(cfg.get("bos_token")) {
            bos = b;
        }
        if let Some(e) = token_content(cfg.get("eos_token")) {
            eos = e;
        }
        let jinja = dir.join("chat_template.jinja");
        let src = match std::fs::read_to_string(&jinja) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match cfg.get("chat_template") {
                Some(Json::String(s)) => Some(s.clone()),
                Some(Json::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .or_else(|| named.first())
                    .and_then(|t| t.get("template").and_then(Json::as_str))
                    .map(str::to_string),
                _ => None,
            },
            Err(e) => {
                return Err(ChatError::Io {
                    path: jinja.display().to_string(),
                    source: e,
                })
            }
        };
        src.map(|s| Self::from_source(&s, &bos, &eos)).transpose()
    }

    /// The plain format in [`FALLBACK_TEMPLATE`].
    pub fn fallback() -> Self {
        Self::from_source(FALLBACK_TEMPLATE, "", "").expect("the fallback template compiles")
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation. `messages` are OpenAI-shaped (role, content as a string or parts,
    /// tool_calls, tool_call_id, name); `tools` OpenAI tool JSON; `kwargs` extra variables
    /// (enable_thinking, reasoning_effort, ...), which cannot override the standard ones.
    ///
    /// Messages are adapted as HF templates expect: text-only content parts are joined with "\n"
    /// into a string, tool-call `arguments` given as a JSON string become an object, and
    /// `reasoning_content` / `reasoning` / `thinking` are all provided (transformers' aliasing).
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String, ChatError> {
        if let Some(sandbox) = &self.sandbox {
            return sandbox.render(messages, tools, add_generation_prompt, kwargs);
        }
        let messages: Vec<Json> = messages.iter().map(adapt_message).collect();
        let mut ctx: std::collections::BTreeMap<String, Value> = kwargs
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        ctx.insert("messages".into(), Value::from_serialize(&messages));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::from(()), Value::from_serialize),
        );
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Value::from(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.clone()));
        let tmpl = self.env.get_template("chat").map_err(template_err)?;
        let mut out = LimitedWriter {
            buf: Vec::new(),
            limit: self.limits.max_output_bytes,
            exceeded: false,
        };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tmpl.render_captured_to(Value::from_serialize(&ctx), &mut out)
                .map(|_| ())
        }))
        .map_err(|_| ChatError::Template("the template crashed while rendering".into()))?;
        if out.exceeded {
            return Err(ChatError::TemplateOutputTooLarge {
                limit: self.limits.max_output_bytes,
            });
        }
        result.map_err(template_err)?;
        String::from_utf8(out.buf)
            .map_err(|e| ChatError::Template(format!("output is not UTF-8: {e}")))
    }
}

/// Where a `{% import .. %}` tag starts, if the template has one. There is no loader, so such a
/// tag could never render; and minijinja 2.24 panics compiling `import x as <not a name>`.
fn import_tag(src: &str) -> Option<usize> {
    src.match_indices("{%").find_map(|(at, _)| {
        let rest = src[at + 2..]
            .trim_start_matches(['-', '+', '~'])
            .trim_start();
        let word = rest.strip_prefix("import")?;
        let ends = word
            .chars()
            .next()
            .is_none_or(|c| !c.is_alphanumeric() && c != '_');
        ends.then_some(at)
    })
}

/// bos/eos texts for templates, from the tokenizer.
fn special_texts(tok: &Tokenizer) -> (String, String) {
    let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
    (text(tok.bos_id()), text(tok.eos_id()))
}

struct LimitedWriter {
    buf: Vec<u8>,
    limit: usize,
    exceeded: bool,
}

impl std::io::Write for LimitedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.limit {
            self.exceeded = true;
            return Err(std::io::Error::other("chat template output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// OpenAI message -> the shape HF templates read (see [`ChatTemplate::render`]).
fn adapt_message(m: &Json) -> Json {
    let Some(obj) = m.as_object() else {
        return m.clone();
    };
    let mut out = obj.clone();
    if let Some(Json::Array(parts)) = obj.get("content") {
        let texts: Option<Vec<&str>> = parts
            .iter()
            .map(|p| match p {
                Json::String(s) => Some(s.as_str()),
                p if p.get("type").and_then(Json::as_str) == Some("text") => {
                    p.get("text").and_then(Json::as_str)
                }
                _ => None,
            })
            .collect();
        if let Some(texts) = texts {
            out.insert("content".into(), Json::String(texts.join("\n")));
        }
    }
    if let Some(Json::Array(calls)) = obj.get("tool_calls") {
        let calls = calls
            .iter()
            .map(|c| {
                let mut c = c.clone();
                if let Some(Json::String(args)) = c.pointer("/function/arguments") {
                    if let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(args) {
                        c["function"]["arguments"] = parsed;
                    }
                }
                c
            })
            .collect();
        out.insert("tool_calls".into(), Json::Array(calls));
    }
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| obj.get(*k).filter(|v| !v.is_null()).cloned());
    if let Some(r) = reasoning {
        out.entry("thinking").or_insert_with(|| r.clone());
        out.insert("reasoning_content".into(), r);
    }
    Json::Object(out)
}

#[cfg(test)]
mod tests;
