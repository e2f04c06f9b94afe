//! Validation at the edge: wire requests become [`ValidChatRequest`] / [`ValidCompletionRequest`]
//! with every range checked, server defaults applied where the request is silent, and reasoning
//! policy merged into the template kwargs. Inner code only ever sees these types.
//!
//! Model names: a request may omit `model`, send an empty one, or name the served model by its
//! id, by any alias the server registered (the `-m` argument, its file or directory name with or
//! without `.gguf`), case-insensitively. Any other name is a 404 `model_not_found`, as in vLLM:
//! a client pointed at the wrong server should hear so rather than get another model's answer.

use afm_engine::SamplingParams;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::messages::normalize_messages;
use crate::request::{
    ChatCompletionRequest, CompletionRequest, PromptField, SamplingFields, StopField,
};
use crate::structured::{structured_output, OutputConstraint, OutputRequest};

/// Stop strings a request may send at most.
pub const MAX_STOP_STRINGS: usize = 16;

/// Server-wide settings that apply when a request is silent (from the command line).
#[derive(Debug, Clone)]
pub struct RequestDefaults {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub max_logprobs: usize,
    pub stop: Vec<String>,
    /// Most sequences (`n`, or prompts × `n` for completions) one request may ask for.
    pub max_n: usize,
    /// Merged under the request's `chat_template_kwargs` (`--default-chat-template-kwargs`,
    /// `--no-think`, `--reasoning-effort`).
    pub template_kwargs: Map<String, Value>,
    /// `--enable-grammar-constraints`: without it, `strict` requests are served best effort.
    pub grammar_enabled: bool,
    /// `--no-streaming` refuses `stream: true`.
    pub streaming_enabled: bool,
    /// `--guided-json`: the schema of answers whose request names no `response_format`.
    pub guided_json: Option<Value>,
}

impl Default for RequestDefaults {
    fn default() -> Self {
        RequestDefaults {
            // OpenAI's default temperature; `-t` changes it for the whole server.
            sampling: SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            },
            max_tokens: 8192,
            max_logprobs: 20,
            stop: Vec::new(),
            max_n: 8,
            template_kwargs: Map::new(),
            grammar_enabled: false,
            streaming_enabled: true,
            guided_json: None,
        }
    }
}

impl RequestDefaults {
    /// Overlays command-line sampling flags (given as request fields, so the same range
    /// checks and messages apply) onto these defaults.
    pub fn with_flags(mut self, flags: &SamplingFields) -> Result<Self, ApiError> {
        self.sampling = sampling_params(flags, &self, usize::MAX)?;
        if let Some(max) = flags.max_tokens {
            self.max_tokens = positive("max_tokens", max)?;
        }
        if let Some(stop) = &flags.stop {
            self.stop = stop_strings(Some(stop), &[])?;
        }
        Ok(self)
    }
}

/// What the caller must know about the served model to validate a request.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id shown by `/v1/models`.
    pub id: String,
    /// Other names accepted in `model`.
    pub aliases: Vec<String>,
    pub vocab_size: usize,
}

impl ModelInfo {
    /// Accepts an absent or empty name, the id or an alias (see the module doc).
    pub fn check(&self, requested: Option<&str>) -> Result<(), ApiError> {
        let Some(name) = requested.map(str::trim).filter(|n| !n.is_empty()) else {
            return Ok(());
        };
        let norm = |s: &str| {
            let s = s.trim_end_matches('/');
            let base = s.rsplit('/').next().unwrap_or(s);
            base.trim_end_matches(".gguf").to_ascii_lowercase()
        };
        let wanted = norm(name);
        let known = std::iter::once(&self.id).chain(&self.aliases);
        if known
            .clone()
            .any(|k| k.eq_ignore_ascii_case(name) || norm(k) == wanted)
        {
            return Ok(());
        }
        Err(ApiError::ModelNotFound {
            model: name.to_string(),
            served: self.id.clone(),
        })
    }
}

/// Generation settings shared by chat and text completions.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidGeneration {
    pub sampling: SamplingParams,
    /// Tokens to generate at most; the server lowers it to what the context leaves.
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// Alternatives per token; `None`: no logprobs.
    pub logprobs: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct ValidChatRequest {
    /// Messages as the chat template expects them (roles normalized, text parts joined).
    pub messages: Vec<Value>,
    /// Tools for the template; `None` when absent or `tool_choice` is `none`.
    pub tools: Option<Vec<Value>>,
    /// `parallel_tool_calls` (default true); false keeps only the first call of a turn.
    pub parallel_tool_calls: bool,
    pub template_kwargs: Map<String, Value>,
    pub generation: ValidGeneration,
    /// A `strict` schema or tool was asked for but grammar constraints are off: served best
    /// effort, and the response says so (`X-Grammar-Constraints: downgraded`).
    pub grammar_downgraded: bool,
    /// What the grammar must enforce (only with `--enable-grammar-constraints`).
    pub output: Option<OutputConstraint>,
}

/// One prompt of a completion request, as text or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum ValidPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct ValidCompletionRequest {
    pub prompts: Vec<ValidPrompt>,
    pub echo: bool,
    pub generation: ValidGeneration,
}

pub fn validate_chat(
    req: ChatCompletionRequest,
    defaults: &RequestDefaults,
    model: &ModelInfo,
) -> Result<ValidChatRequest, ApiError> {
    model.check(req.model.as_deref())?;
    let messages = normalize_messages(&req.messages)?;
    let mut fields = req.sampling.clone();
    if let Some(max) = req.max_completion_tokens {
        fields.max_tokens = Some(max);
        // Both given: the newer name wins, as in OpenAI.
    }
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (true, top) => Some(bounded(
            "top_logprobs",
            top.unwrap_or(0),
            defaults.max_logprobs,
        )?),
        (false, Some(top)) if top > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("top_logprobs = {top} requires logprobs = true"),
            ))
        }
        (false, _) => None,
    };
    let generation = generation(&fields, logprobs, defaults, model.vocab_size)?;
    let parallel_tool_calls = req.parallel_tool_calls.unwrap_or(true);
    let output = structured_output(OutputRequest {
        tools: req.tools,
        tool_choice: req.tool_choice.as_ref(),
        parallel_tool_calls,
        response_format: req.response_format.as_ref(),
        grammar_enabled: defaults.grammar_enabled,
        default_schema: defaults.guided_json.as_ref(),
    })?;
    let mut template_kwargs = template_kwargs(
        defaults,
        req.reasoning_effort.as_deref(),
        req.chat_template_kwargs,
    )?;
    if output.default_schema && output.constraint.is_some() {
        // `--guided-json` answers are the JSON itself, so thinking is off unless asked for.
        template_kwargs
            .entry("enable_thinking")
            .or_insert(Value::Bool(false));
    }
    Ok(ValidChatRequest {
        messages,
        tools: output.tools,
        parallel_tool_calls,
        template_kwargs,
        generation,
        grammar_downgraded: output.downgraded,
        output: output.constraint,
    })
}

pub fn validate_completion(
    req: CompletionRequest,
    defaults: &RequestDefaults,
    model: &ModelInfo,
) -> Result<ValidCompletionRequest, ApiError> {
    model.check(req.model.as_deref())?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "suffix (insertion) is not available yet",
        ));
    }
    let prompts = prompts(req.prompt, model.vocab_size)?;
    let n = req.sampling.n.unwrap_or(1);
    if let Some(best_of) = req.best_of.filter(|&b| b != n) {
        return Err(ApiError::unsupported(
            "best_of",
            format!("best_of = {best_of} different from n = {n} is not supported"),
        ));
    }
    let echo = req.echo.unwrap_or(false);
    let logprobs = req
        .logprobs
        .map(|k| bounded("logprobs", k, defaults.max_logprobs))
        .transpose()?;
    if echo && logprobs.is_some() {
        return Err(ApiError::unsupported(
            "echo",
            "echo together with logprobs needs prompt logprobs, which are not available yet",
        ));
    }
    let generation = generation(&req.sampling, logprobs, defaults, model.vocab_size)?;
    if prompts.len() * generation.n > defaults.max_n {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts × n = {} asks for {} sequences; the limit is {}",
                prompts.len(),
                generation.n,
                prompts.len() * generation.n,
                defaults.max_n
            ),
        ));
    }
    Ok(ValidCompletionRequest {
        prompts,
        echo,
        generation,
    })
}

fn prompts(prompt: PromptField, vocab_size: usize) -> Result<Vec<ValidPrompt>, ApiError> {
    let prompts: Vec<ValidPrompt> = match prompt {
        PromptField::Text(t) => vec![ValidPrompt::Text(t)],
        PromptField::Texts(ts) => ts.into_iter().map(ValidPrompt::Text).collect(),
        PromptField::Tokens(ids) => vec![ValidPrompt::Tokens(ids)],
        PromptField::TokenBatches(b) => b.into_iter().map(ValidPrompt::Tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "prompt must not be an empty list",
        ));
    }
    for p in &prompts {
        match p {
            ValidPrompt::Text(t) if t.is_empty() => {
                return Err(ApiError::invalid("prompt", "prompt must not be empty"))
            }
            ValidPrompt::Tokens(ids) if ids.is_empty() => {
                return Err(ApiError::invalid("prompt", "prompt must not be empty"))
            }
            ValidPrompt::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!("token id {bad} is outside the vocabulary (size {vocab_size})"),
                    ));
                }
            }
            ValidPrompt::Text(_) => {}
        }
    }
    Ok(prompts)
}

fn generation(
    fields: &SamplingFields,
    logprobs: Option<usize>,
    defaults: &RequestDefaults,
    vocab_size: usize,
) -> Result<ValidGeneration, ApiError> {
    let n = match fields.n {
        Some(n) if n < 1 || n as usize > defaults.max_n => {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "n = {n} is out of range; it must be between 1 and {}",
                    defaults.max_n
                ),
            ))
        }
        Some(n) => n as usize,
        None => 1,
    };
    let stream = fields.stream.unwrap_or(false);
    if stream && !defaults.streaming_enabled {
        return Err(ApiError::unsupported(
            "stream",
            "streaming is disabled on this server (--no-streaming)",
        ));
    }
    Ok(ValidGeneration {
        sampling: sampling_params(fields, defaults, vocab_size)?,
        max_tokens: match fields.max_tokens {
            Some(m) => positive("max_tokens", m)?,
            None => defaults.max_tokens,
        },
        stop: stop_strings(fields.stop.as_ref(), &defaults.stop)?,
        n,
        stream,
        include_usage: fields
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(true),
        logprobs,
    })
}

fn sampling_params(
    f: &SamplingFields,
    defaults: &RequestDefaults,
    vocab_size: usize,
) -> Result<SamplingParams, ApiError> {
    let d = &defaults.sampling;
    let temperature = in_range("temperature", f.temperature, 0.0, 2.0, d.temperature)?;
    let top_p = match f.top_p {
        Some(p) if !(p > 0.0 && p <= 1.0) => {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p = {p} is out of range; it must be in (0, 1]"),
            ))
        }
        Some(p) => p as f32,
        None => d.top_p,
    };
    let top_k = match f.top_k {
        // -1 is vLLM's and llama.cpp's spelling of "disabled".
        Some(-1) | Some(0) => 0,
        Some(k) if k < 0 => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k = {k} is out of range; it must be ≥ 0 (or -1 to disable)"),
            ))
        }
        Some(k) => k as usize,
        None => d.top_k,
    };
    let repetition_penalty = match f.repetition_penalty {
        Some(r) if !(r > 0.0 && r <= 10.0) => {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("repetition_penalty = {r} is out of range; it must be in (0, 10]"),
            ))
        }
        Some(r) => r as f32,
        None => d.repetition_penalty,
    };
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p: in_range("min_p", f.min_p, 0.0, 1.0, d.min_p)?,
        repetition_penalty,
        presence_penalty: in_range(
            "presence_penalty",
            f.presence_penalty,
            -2.0,
            2.0,
            d.presence_penalty,
        )?,
        frequency_penalty: in_range(
            "frequency_penalty",
            f.frequency_penalty,
            -2.0,
            2.0,
            d.frequency_penalty,
        )?,
        // A negative seed means "random", as in llama.cpp.
        seed: match f.seed {
            Some(s) if s >= 0 => Some(s as u64),
            Some(_) => None,
            None => d.seed,
        },
        logit_bias: logit_bias(f, vocab_size)?,
    })
}

fn logit_bias(f: &SamplingFields, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = &f.logit_bias else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, &bias) in map {
        let id: u32 = key.trim().parse().map_err(|_| {
            ApiError::invalid(
                "logit_bias",
                format!("logit_bias key `{key}` is not a token id"),
            )
        })?;
        if id as usize >= vocab_size {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias token id {id} is outside the vocabulary (size {vocab_size})"),
            ));
        }
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias[{id}] = {bias} is out of range; it must be in [-100, 100]"),
            ));
        }
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

fn in_range(name: &str, v: Option<f64>, lo: f64, hi: f64, default: f32) -> Result<f32, ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(
            name,
            format!("{name} = {x} is out of range; it must be in [{lo}, {hi}]"),
        )),
        Some(x) => Ok(x as f32),
        None => Ok(default),
    }
}

fn positive(name: &str, v: i64) -> Result<usize, ApiError> {
    if v < 1 {
        return Err(ApiError::invalid(
            name,
            format!("{name} = {v} is out of range; it must be at least 1"),
        ));
    }
    Ok(v as usize)
}

fn bounded(name: &str, v: i64, max: usize) -> Result<usize, ApiError> {
    if v < 0 || v as usize > max {
        return Err(ApiError::invalid(
            name,
            format!("{name} = {v} is out of range; it must be between 0 and {max}"),
        ));
    }
    Ok(v as usize)
}

fn stop_strings(stop: Option<&StopField>, default: &[String]) -> Result<Vec<String>, ApiError> {
    let list = match stop {
        None => return Ok(default.to_vec()),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "{} stop strings given; the limit is {MAX_STOP_STRINGS}",
                list.len()
            ),
        ));
    }
    // An empty string would stop before the first token: drop it rather than fail.
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

/// Server defaults, then the request's `reasoning_effort`, then its `chat_template_kwargs`:
/// an explicit `enable_thinking` in the request always wins.
fn template_kwargs(
    defaults: &RequestDefaults,
    effort: Option<&str>,
    request: Option<Map<String, Value>>,
) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = defaults.template_kwargs.clone();
    if let Some(effort) = effort {
        let effort = effort.trim().to_ascii_lowercase();
        match effort.as_str() {
            "none" => {
                kwargs.insert("enable_thinking".into(), Value::Bool(false));
            }
            "minimal" | "low" | "medium" | "high" | "max" | "xhigh" => {
                kwargs.insert("enable_thinking".into(), Value::Bool(true));
                kwargs.insert("reasoning_effort".into(), Value::String(effort));
            }
            other => {
                return Err(ApiError::invalid(
                    "reasoning_effort",
                    format!(
                        "reasoning_effort `{other}` is not one of none, minimal, low, medium, \
                         high, max"
                    ),
                ))
            }
        }
    }
    kwargs.extend(request.unwrap_or_default());
    Ok(kwargs)
}
