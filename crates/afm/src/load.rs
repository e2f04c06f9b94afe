//! From `-m` to a served model: resolve the location, load weights, tokenizer and chat
//! template, start the engine. Every failure is one line naming the file and the reason.

use std::path::Path;
use std::sync::Arc;

use afm_api::ModelInfo;
use afm_chat::template::{SandboxConfig, TemplateSandbox};
use afm_chat::{ChatTemplate, Tokenizer};
use afm_engine::{Engine, EngineConfig, EngineHandle};
use afm_models::source::resolve_model;
use afm_models::{load_model_on, LoadedModel};
use afm_runtime::compute::Device;
use afm_server::text_model::ChatText;
use afm_server::ServedModel;
use anyhow::{anyhow, Context, Result};

use crate::cli::{KvMemory, ServeArgs};

/// The hidden first argument that makes `afm` a chat-template worker (see main.rs).
pub const TEMPLATE_WORKER_ARG: &str = "__template-worker";

/// The model served by `args`, and its engine (to [`shutdown`](EngineHandle::shutdown) before
/// the process exits).
pub fn load(args: &ServeArgs) -> Result<(ServedModel, EngineHandle)> {
    let location = resolve_model(&args.model).map_err(|e| anyhow!("{e}"))?;
    let device =
        Device::open(args.device).with_context(|| format!("opening --device {}", args.device))?;
    let model =
        load_model_on(&location, &device).with_context(|| format!("loading {}", args.model))?;
    let (tokenizer, template) = text_side(&model)?;
    // Picks the tool-call dialect when the template shows no call example.
    let model_arch = model.arch;
    // An HF id is its own best name; a path is named by its file or directory.
    let id = if Path::new(&args.model).exists() {
        model.name.clone()
    } else {
        args.model.clone()
    };
    let info = ModelInfo {
        aliases: vec![args.model.clone(), model.name.clone()],
        id,
        vocab_size: tokenizer.vocab_size(),
    };
    let cfg = EngineConfig {
        max_context: args.max_context,
        concurrent: args.concurrent,
        max_waiting: args.max_waiting,
        prefill_step_size: args.prefill_step_size,
        prefix_caching: args.prefix_caching(),
        kv_bits: args.kv_bits,
        kv_budget_bytes: match args.kv_memory {
            Some(KvMemory::Bytes(b)) => Some(b),
            _ => None,
        },
        kv_budget_fraction: match args.kv_memory {
            Some(KvMemory::Fraction(f)) => Some(f),
            _ => None,
        },
        debug: std::env::var("AFM_DEBUG").is_ok_and(|v| v == "1"),
        prewarm: args.prewarm.starts_with('y'),
        decode_overlap: args.decode_overlap.starts_with('y'),
        gpu_profile: args.gpu_profile,
        ..EngineConfig::default()
    };
    let mut text = ChatText::new(tokenizer, template).with_model_type(model_arch);
    if args.grammar_enabled() {
        let t0 = std::time::Instant::now();
        text = text
            .with_grammars()
            .map_err(|e| anyhow!("--enable-grammar-constraints: {e}"))?;
        eprintln!(
            "[Grammar] token trie for {} tokens built in {:.0} ms",
            info.vocab_size,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    let handle = Engine::spawn(model, cfg).map_err(|e| anyhow!("starting the engine: {e}"))?;
    let served = ServedModel {
        info,
        text: Arc::new(text),
        generator: Arc::new(handle.clone()),
    };
    Ok((served, handle))
}

/// Tokenizer and chat template from the GGUF metadata or the HF directory; a model without
/// a template gets afm-chat's documented fallback.
fn text_side(model: &LoadedModel) -> Result<(Tokenizer, ChatTemplate)> {
    let (tokenizer, template) = if let Some(g) = model.gguf() {
        let tok = Tokenizer::from_gguf(g).context("reading the GGUF tokenizer")?;
        let tpl = ChatTemplate::from_gguf(g, &tok).context("reading the GGUF chat template")?;
        (tok, tpl)
    } else if let Some(dir) = model.hf_dir() {
        let tok = Tokenizer::from_hf_dir(dir)
            .with_context(|| format!("reading the tokenizer in {}", dir.display()))?;
        let tpl = ChatTemplate::from_hf_dir(dir, &tok)
            .with_context(|| format!("reading the chat template in {}", dir.display()))?;
        (tok, tpl)
    } else {
        return Err(anyhow!(
            "the model has neither GGUF metadata nor a directory"
        ));
    };
    let template = template.unwrap_or_else(ChatTemplate::fallback);
    // A template from a model file may build values without bound: render it in worker
    // processes (this binary, `__template-worker`) with memory, CPU and time limits.
    // Linux: /proc/self/exe runs this very binary even after it was replaced on disk (a
    // rebuild while serving), where its path would start another build or nothing.
    let exe = match std::path::PathBuf::from("/proc/self/exe") {
        p if p.exists() => p,
        _ => std::env::current_exe().context("finding the afm binary for the template worker")?,
    };
    let template = template
        .sandboxed(&TemplateSandbox::new(SandboxConfig::new(
            exe,
            &[TEMPLATE_WORKER_ARG],
        )))
        .context("starting the chat template worker")?;
    Ok((tokenizer, template))
}
