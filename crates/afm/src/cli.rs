//! The command line: `afm serve` (alias `afm mlx`) with every flag of the original AFM, and
//! its translation into server and engine settings. Flags whose feature afm does not have yet
//! are accepted by the parser and then refused with one line saying so, never ignored.

use afm_api::{RequestDefaults, SamplingFields, StopField};
use afm_chat::tool_calls::ToolCallFormat;
use anyhow::{bail, Context, Result};
use clap::builder::TypedValueParser;
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use serde_json::{Map, Value};

#[derive(Parser, Debug)]
#[command(
    name = "afm",
    version,
    about = "An OpenAI-compatible LLM server",
    disable_version_flag = true
)]
pub struct Cli {
    /// Print the version.
    #[arg(long, action = ArgAction::Version)]
    version: Option<bool>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve a model over the OpenAI API, or answer one prompt with -s.
    #[command(visible_alias = "mlx")]
    Serve(Box<ServeArgs>),
    /// Measure prefill, TTFT, decode and latency percentiles for a declared workload.
    Bench(Box<crate::bench::BenchArgs>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Runtime {
    Auto,
    /// The general runtime (AFM's name for it).
    #[value(alias = "general")]
    Mlx,
    Dwarfstar,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// GGUF file, model directory (config.json + safetensors + tokenizer), or Hugging Face id
    /// found in the local HF cache.
    #[arg(short = 'm', long)]
    pub model: String,
    /// Answer this one prompt without a server, print the answer and exit.
    #[arg(short = 's', long = "single-prompt", value_name = "PROMPT")]
    pub single_prompt: Option<String>,
    /// System prompt (instructions) for -s.
    #[arg(short = 'i', long = "instructions", value_name = "SYSTEM")]
    pub instructions: Option<String>,
    #[arg(short = 'p', long, default_value_t = 9999)]
    pub port: u16,
    #[arg(short = 'H', long, default_value = "127.0.0.1")]
    pub hostname: String,
    /// Log requests.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Log more.
    #[arg(short = 'V', long = "very-verbose")]
    pub very_verbose: bool,
    /// Log everything.
    #[arg(long = "vv")]
    pub trace: bool,
    /// No SSE: -s prints the whole answer at the end; the server refuses `stream: true`.
    #[arg(long)]
    pub no_streaming: bool,
    /// No reasoning extraction: the model's text goes to `content` as is.
    #[arg(long)]
    pub raw: bool,
    /// With -s: print the OpenAI chat.completion JSON.
    #[arg(long)]
    pub json: bool,

    #[command(flatten)]
    pub sampling: SamplingFlags,

    /// Default JSON schema (a file, or the JSON itself) for requests that name no
    /// `response_format` and no tools; enforced by the grammar (implies
    /// --enable-grammar-constraints) and turns thinking off.
    #[arg(long, value_name = "SCHEMA")]
    pub guided_json: Option<String>,
    /// Open the built-in WebUI.
    #[arg(short = 'w', long)]
    pub webui: bool,
    /// Quantized KV cache: 8 or 4 bits per value.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["4", "8"])
        .map(|s| s.parse::<u8>().unwrap_or(8)))]
    pub kv_bits: Option<u8>,
    #[arg(long, default_value_t = 1024)]
    pub prefill_step_size: usize,
    /// Prepare kernels at start-up.
    #[arg(long, default_value = "y", value_parser = ["y", "n", "yes", "no"])]
    pub prewarm: String,
    /// On a GPU: launch each decode step from the last one's sampled tokens before the host
    /// reads them, so the host's work between steps overlaps the device's.
    #[arg(long, default_value = "y", value_parser = ["y", "n", "yes", "no"])]
    pub decode_overlap: String,
    #[arg(
        long = "mlx-runtime",
        visible_alias = "runtime",
        value_enum,
        default_value = "auto"
    )]
    pub runtime: Runtime,
    #[arg(long, overrides_with = "disable_prefix_caching")]
    pub enable_prefix_caching: bool,
    #[arg(long)]
    pub disable_prefix_caching: bool,
    #[command(flatten)]
    pub speculative: SpeculativeFlags,
    /// Tool-call dialect (hermes, llama3_json, mistral, qwen3_xml, gemma, glm4, kimi_k2,
    /// minimax_m2, deepseek_v3, deepseek_v4, none); default: the model's own.
    #[arg(long, value_name = "NAME", value_parser = parse_tool_call_parser)]
    pub tool_call_parser: Option<ToolCallFormat>,
    #[arg(long)]
    pub fix_tool_args: bool,
    /// Grammar-constrained decoding for strict `json_schema`, `json_object`, strict tools and
    /// `tool_choice` "required" or a named function.
    #[arg(long)]
    pub enable_grammar_constraints: bool,
    /// Turn thinking off by default (`enable_thinking: false`).
    #[arg(long = "no-think", visible_alias = "no-thinking")]
    pub no_think: bool,
    #[arg(long, value_parser = ["low", "medium", "high", "max"])]
    pub reasoning_effort: Option<String>,
    /// JSON object merged into every request's chat template kwargs.
    #[arg(long, value_name = "JSON")]
    pub default_chat_template_kwargs: Option<String>,
    /// Sequences decoded together (batch scheduler when > 1).
    #[arg(long, default_value_t = 1)]
    pub concurrent: usize,
    /// Requests that may wait for a slot before the server answers 429.
    #[arg(long, default_value_t = 64)]
    pub max_waiting: usize,
    /// Context length in tokens (0: the model's).
    #[arg(long = "max-context", visible_alias = "ctx-size", default_value_t = 0)]
    pub max_context: usize,
    /// Require `Authorization: Bearer <KEY>` on every route but /health (also read from
    /// AFM_API_KEY).
    #[arg(
        long = "api-key",
        env = "AFM_API_KEY",
        value_name = "KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Browser origin allowed to call the API (repeatable; `*` for any). Default: none.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// Memory for the KV cache: bytes with an optional K/M/G suffix (`2G`), or a fraction of
    /// available memory (`0.25`). Default: a quarter of available memory, at most 4 GiB.
    #[arg(long = "kv-memory", value_name = "BYTES|FRACTION", value_parser = parse_kv_memory)]
    pub kv_memory: Option<KvMemory>,
    #[command(flatten)]
    pub limits: LimitFlags,
    /// On a GPU: device memory, prefill/decode rates and bandwidth against the device's peak
    /// in every response (`afm_profile`) and in the log; `X-AFM-Profile: true` asks per request.
    #[arg(long)]
    pub gpu_profile: bool,
    /// Where the model runs: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: afm_runtime::compute::DeviceChoice,
}

#[derive(Args, Debug)]
pub struct SamplingFlags {
    #[arg(short = 't', long)]
    pub temperature: Option<f64>,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long, allow_hyphen_values = true)]
    pub top_k: Option<i64>,
    #[arg(long)]
    pub min_p: Option<f64>,
    #[arg(long, allow_hyphen_values = true)]
    pub presence_penalty: Option<f64>,
    #[arg(long, allow_hyphen_values = true)]
    pub frequency_penalty: Option<f64>,
    #[arg(long, visible_alias = "repeat-penalty")]
    pub repetition_penalty: Option<f64>,
    #[arg(long, allow_hyphen_values = true)]
    pub seed: Option<i64>,
    #[arg(long, default_value_t = 8192)]
    pub max_tokens: i64,
    #[arg(long, default_value_t = 20)]
    pub max_logprobs: usize,
    /// Default stop strings, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub stop: Vec<String>,
}

/// What one client may take from the server (afm_server::limits).
#[derive(Args, Debug)]
pub struct LimitFlags {
    /// Open connections at once; more are answered 503 and closed.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Seconds a request may run; past it, it is cancelled and answered with a timeout error
    /// (408 JSON, or an SSE error event); 0: no limit.
    #[arg(long, value_name = "SECS", default_value_t = 1800)]
    pub request_timeout: u64,
    /// Seconds a client may leave the answer unread (writes blocked) before its connection is
    /// closed and its requests cancelled.
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub write_timeout: u64,
    /// Seconds a client has to send a request head (idle keep-alive connections included).
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout: u64,
    /// Seconds a client has to send a request body (408 after).
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout: u64,
    /// Messages in one chat request.
    #[arg(long, default_value_t = 4096)]
    pub max_messages: usize,
    /// Seconds in-flight requests may still run after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub shutdown_timeout: u64,
}

impl LimitFlags {
    pub fn limits(&self) -> afm_server::limits::Limits {
        use std::time::Duration;
        afm_server::limits::Limits {
            max_connections: self.max_connections as usize,
            header_timeout: Duration::from_secs(self.header_timeout),
            body_timeout: Duration::from_secs(self.body_timeout),
            write_timeout: Duration::from_secs(self.write_timeout),
            request_timeout: (self.request_timeout > 0)
                .then(|| Duration::from_secs(self.request_timeout)),
            max_messages: self.max_messages,
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout),
        }
    }
}

#[derive(Args, Debug)]
pub struct SpeculativeFlags {
    /// MTP speculative decoding.
    #[arg(long)]
    pub mtp: bool,
    #[arg(long, value_name = "DIR")]
    pub eagle3: Option<String>,
    #[arg(long, value_name = "GGUF")]
    pub dspark_support: Option<String>,
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub dspark_draft_tokens: u32,
    #[arg(long, default_value_t = 0.7)]
    pub dspark_confidence: f64,
    #[arg(long)]
    pub dspark_strict: bool,
}

fn parse_tool_call_parser(name: &str) -> Result<ToolCallFormat, String> {
    ToolCallFormat::from_name(name).ok_or_else(|| {
        format!(
            "'{name}' is not a tool-call parser; use hermes, llama3_json, mistral, qwen3_xml, \
             gemma, glm4, kimi_k2, minimax_m2, deepseek_v3, deepseek_v4 or none"
        )
    })
}

impl ServeArgs {
    /// Refuses flags whose feature does not exist yet (each would change what the user gets).
    pub fn refuse_unavailable(&self) -> Result<()> {
        let spec = &self.speculative;
        let unavailable = [
            (spec.mtp, "--mtp (MTP speculative decoding)"),
            (
                spec.eagle3.is_some(),
                "--eagle3 (EAGLE3 speculative decoding)",
            ),
            (
                spec.dspark_support.is_some() || spec.dspark_strict,
                "--dspark-* (DSpark drafting)",
            ),
            (
                self.runtime == Runtime::Dwarfstar,
                "--mlx-runtime dwarfstar",
            ),
        ];
        if let Some((_, what)) = unavailable.iter().find(|(set, _)| *set) {
            bail!("{what} is not available yet in afm");
        }
        if !(0.0..=1.0).contains(&spec.dspark_confidence) {
            bail!(
                "--dspark-confidence {} is out of range; it must be in [0, 1]",
                spec.dspark_confidence
            );
        }
        if self.concurrent == 0 {
            bail!("--concurrent 0 is out of range; it must be at least 1");
        }
        Ok(())
    }

    /// Server-wide request defaults from the sampling and reasoning flags.
    pub fn request_defaults(&self) -> Result<RequestDefaults> {
        let s = &self.sampling;
        let fields = SamplingFields {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            stop: (!s.stop.is_empty()).then(|| StopField::Many(s.stop.clone())),
            max_tokens: Some(s.max_tokens),
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            repetition_penalty: s.repetition_penalty,
            ..SamplingFields::default()
        };
        let mut defaults = RequestDefaults {
            max_logprobs: s.max_logprobs,
            streaming_enabled: !self.no_streaming || self.single_prompt.is_some(),
            template_kwargs: self.template_kwargs()?,
            ..RequestDefaults::default()
        }
        .with_flags(&fields)
        // Same checks and messages as a request's, with the flag's name in place of the field.
        .map_err(|e| anyhow::anyhow!("{}", e.to_string().replace('_', "-")))?;
        defaults.grammar_enabled = self.grammar_enabled();
        defaults.guided_json = self.guided_json_schema()?;
        Ok(defaults)
    }

    /// `--enable-grammar-constraints`, or implied by `--guided-json`.
    pub fn grammar_enabled(&self) -> bool {
        self.enable_grammar_constraints || self.guided_json.is_some()
    }

    /// `--guided-json`: JSON text when it starts with `{` (or is `true`), else a file of it.
    fn guided_json_schema(&self) -> Result<Option<Value>> {
        let Some(arg) = &self.guided_json else {
            return Ok(None);
        };
        let trimmed = arg.trim_start();
        let text = if trimmed.starts_with('{') || trimmed == "true" {
            arg.clone()
        } else {
            std::fs::read_to_string(arg)
                .with_context(|| format!("--guided-json: reading the schema file {arg}"))?
        };
        let schema: Value = serde_json::from_str(&text)
            .with_context(|| format!("--guided-json: {arg} is not valid JSON"))?;
        if !schema.is_object() && !schema.is_boolean() {
            bail!("--guided-json must be a JSON schema object");
        }
        Ok(Some(schema))
    }

    fn template_kwargs(&self) -> Result<Map<String, Value>> {
        let mut kwargs = match &self.default_chat_template_kwargs {
            Some(text) => match serde_json::from_str::<Value>(text)
                .context("--default-chat-template-kwargs is not valid JSON")?
            {
                Value::Object(map) => map,
                _ => bail!("--default-chat-template-kwargs must be a JSON object"),
            },
            None => Map::new(),
        };
        if let Some(effort) = &self.reasoning_effort {
            kwargs.insert("reasoning_effort".into(), Value::String(effort.clone()));
            kwargs.insert("enable_thinking".into(), Value::Bool(true));
        }
        if self.no_think {
            kwargs.insert("enable_thinking".into(), Value::Bool(false));
        }
        Ok(kwargs)
    }

    pub fn prefix_caching(&self) -> bool {
        !self.disable_prefix_caching
    }

    /// 0 quiet, 1 `-v`, 2 `-V`, 3 `--vv`.
    pub fn log_level(&self) -> u8 {
        if self.trace {
            3
        } else if self.very_verbose {
            2
        } else {
            self.verbose as u8
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<ServeArgs> {
        let cli = Cli::try_parse_from(args)?;
        match cli.command {
            Command::Serve(a) => Ok(*a),
            Command::Bench(_) => anyhow::bail!("expected serve"),
        }
    }

    #[test]
    fn mlx_is_an_alias_and_defaults_match_afm() {
        let a = parse(&["afm", "mlx", "-m", "x.gguf"]).unwrap();
        assert_eq!((a.port, a.hostname.as_str()), (9999, "127.0.0.1"));
        assert_eq!(a.sampling.max_tokens, 8192);
        assert_eq!(a.sampling.max_logprobs, 20);
        assert_eq!(a.prefill_step_size, 1024);
        assert!(a.prefix_caching());
        let d = a.request_defaults().unwrap();
        assert_eq!(d.max_tokens, 8192);
        assert_eq!(d.sampling.temperature, 1.0);
    }

    #[test]
    fn sampling_flags_become_defaults() {
        let a = parse(&[
            "afm",
            "serve",
            "-m",
            "m",
            "-t",
            "0",
            "--top-k",
            "40",
            "--seed",
            "7",
            "--stop",
            "a,b",
            "--no-think",
            "--repeat-penalty",
            "1.1",
        ])
        .unwrap();
        let d = a.request_defaults().unwrap();
        assert_eq!(d.sampling.temperature, 0.0);
        assert_eq!(d.sampling.top_k, 40);
        assert_eq!(d.sampling.seed, Some(7));
        assert_eq!(d.stop, vec!["a", "b"]);
        assert_eq!(d.template_kwargs["enable_thinking"], Value::Bool(false));
        let a = parse(&["afm", "serve", "-m", "m", "--top-p", "0"]).unwrap();
        let err = a.request_defaults().unwrap_err().to_string();
        assert!(err.contains("top-p") && err.contains("(0, 1]"), "{err}");
    }

    #[test]
    fn limit_flags_have_defaults_and_zero_means_no_deadline() {
        let a = parse(&["afm", "serve", "-m", "m"]).unwrap();
        let l = a.limits.limits();
        assert_eq!(l, afm_server::limits::Limits::default());
        let a = parse(&[
            "afm",
            "serve",
            "-m",
            "m",
            "--max-connections",
            "8",
            "--request-timeout",
            "0",
            "--shutdown-timeout",
            "3",
            "--write-timeout",
            "5",
        ])
        .unwrap();
        let l = a.limits.limits();
        assert_eq!(l.max_connections, 8);
        assert_eq!(l.write_timeout.as_secs(), 5);
        assert!(parse(&["afm", "serve", "-m", "m", "--write-timeout", "0"]).is_err());
        assert_eq!(l.request_timeout, None);
        assert_eq!(l.shutdown_timeout.as_secs(), 3);
        assert!(parse(&["afm", "serve", "-m", "m", "--max-connections", "0"]).is_err());
    }

    #[test]
    fn tool_call_flags_are_parsed_and_checked() {
        let a = parse(&[
            "afm",
            "mlx",
            "-m",
            "m",
            "--tool-call-parser",
            "qwen3_coder",
            "--fix-tool-args",
        ])
        .unwrap();
        assert_eq!(a.tool_call_parser, Some(ToolCallFormat::QwenXml));
        assert!(a.fix_tool_args);
        assert!(a.refuse_unavailable().is_ok());
        let err = parse(&["afm", "mlx", "-m", "m", "--tool-call-parser", "hermes2"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("'hermes2' is not a tool-call parser"), "{err}");
    }

    #[test]
    fn guided_json_is_json_or_a_file_and_turns_the_grammar_on() {
        let args = parse(&[
            "afm",
            "mlx",
            "-m",
            "m",
            "--guided-json",
            r#"{"type": "object"}"#,
        ]);
        let args = args.unwrap();
        assert!(args.grammar_enabled());
        let schema = args.request_defaults().unwrap().guided_json;
        assert_eq!(schema, Some(serde_json::json!({"type": "object"})));
        let path = std::env::temp_dir().join(format!("afm-guided-{}.json", std::process::id()));
        std::fs::write(&path, r#"{"type": "array"}"#).unwrap();
        let file = path.to_string_lossy().into_owned();
        let args = parse(&["afm", "mlx", "-m", "m", "--guided-json", &file]).unwrap();
        let schema = args.request_defaults().unwrap().guided_json;
        std::fs::remove_file(&path).ok();
        assert_eq!(schema, Some(serde_json::json!({"type": "array"})));
        let args = parse(&[
            "afm",
            "mlx",
            "-m",
            "m",
            "--guided-json",
            "/nonexistent/s.json",
        ]);
        let err = args.unwrap().request_defaults().unwrap_err();
        assert!(format!("{err:#}").contains("--guided-json"), "{err:#}");
        assert!(!parse(&["afm", "mlx", "-m", "m"]).unwrap().grammar_enabled());
    }

    #[test]
    fn unavailable_features_are_refused_not_ignored() {
        for flag in [&["--eagle3", "d"][..], &["--mtp"]] {
            let mut args = vec!["afm", "mlx", "-m", "m"];
            args.extend_from_slice(flag);
            let err = parse(&args)
                .unwrap()
                .refuse_unavailable()
                .unwrap_err()
                .to_string();
            assert!(err.contains("not available yet"), "{err}");
        }
        let ok = parse(&[
            "afm",
            "mlx",
            "-m",
            "m",
            "--prewarm",
            "n",
            "--concurrent",
            "4",
            "-w",
        ])
        .unwrap();
        assert!(ok.refuse_unavailable().is_ok());
    }
}

/// `--kv-memory`: an absolute size or a share of what the machine has available.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvMemory {
    Bytes(usize),
    Fraction(f64),
}

fn parse_kv_memory(v: &str) -> std::result::Result<KvMemory, String> {
    let bad = || format!("'{v}' is neither a size (e.g. 512M, 2G) nor a fraction in (0, 1]");
    if v.contains('.') {
        let f: f64 = v.parse().map_err(|_| bad())?;
        return if f > 0.0 && f <= 1.0 {
            Ok(KvMemory::Fraction(f))
        } else {
            Err(bad())
        };
    }
    let (digits, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len()));
    let n: usize = digits.parse().map_err(|_| bad())?;
    let mult: usize = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(mult)
        .filter(|b| *b > 0)
        .map(KvMemory::Bytes)
        .ok_or_else(bad)
}

#[cfg(test)]
mod kv_memory_tests {
    use super::*;

    #[test]
    fn sizes_and_fractions_parse_and_nonsense_is_refused() {
        assert_eq!(parse_kv_memory("2G"), Ok(KvMemory::Bytes(2 << 30)));
        assert_eq!(parse_kv_memory("512m"), Ok(KvMemory::Bytes(512 << 20)));
        assert_eq!(parse_kv_memory("0.25"), Ok(KvMemory::Fraction(0.25)));
        for bad in ["", "0", "1.5", "-1", "3X", "0.0", "G"] {
            assert!(parse_kv_memory(bad).is_err(), "{bad} accepted");
        }
    }
}
