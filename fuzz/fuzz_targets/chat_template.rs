//! Hostile chat templates: a template (from a model file) plus a message, rendered the way the
//! server renders them — in a sandboxed worker process (this binary, re-run with
//! `AFM_TEMPLATE_WORKER=1`) under a memory, CPU and wall-clock limit. Every render must end with
//! text within the output limit or an error; a worker may die only of its memory or time limit
//! (a template that doubles a string in a loop), never of anything else; there are no file or
//! network functions to reach.
//!
//! Input: template source, a NUL byte, then the user message text.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use afm_chat::template::{ChatTemplate, RenderLimits, SandboxConfig, TemplateSandbox};
use afm_chat::ChatError;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map};

const LIMITS: RenderLimits = RenderLimits {
    max_output_bytes: 1 << 20,
    fuel: 200_000,
    max_recursion: 64,
};

const WORKER_ENV: &str = "AFM_TEMPLATE_WORKER";

fn sandbox() -> &'static Arc<TemplateSandbox> {
    static SANDBOX: OnceLock<Arc<TemplateSandbox>> = OnceLock::new();
    SANDBOX.get_or_init(|| {
        let exe = std::env::current_exe().expect("the fuzz target's own path");
        let mut config = SandboxConfig::new(exe, &[]);
        config.env = vec![(WORKER_ENV.into(), "1".into())];
        config.memory_bytes = 512 << 20;
        config.cpu_seconds = 4;
        config.timeout = Duration::from_secs(5);
        config.max_workers = 1;
        TemplateSandbox::new(config)
    })
}

fuzz_target!(
    init: {
        if std::env::var_os(WORKER_ENV).is_some() {
            std::process::exit(afm_chat::template::serve_worker());
        }
    },
    |data: &[u8]| {
        let text = String::from_utf8_lossy(data);
        let (src, content) = text.split_once('\0').unwrap_or((&text, "hi"));
        let Ok(tpl) = ChatTemplate::with_limits(src, "<s>", "</s>", LIMITS) else {
            return;
        };
        let tpl = match tpl.sandboxed(sandbox()) {
            Ok(t) => t,
            Err(e) => return check(e),
        };
        let messages = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": content}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
            ]}),
            json!({"role": "tool", "content": content}),
        ];
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {}}})];
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), json!(true));
        match tpl.render(&messages, Some(&tools), true, &kwargs) {
            Ok(out) => assert!(out.len() <= LIMITS.max_output_bytes, "output past the limit"),
            Err(e) => check(e),
        }
    }
);

/// A template may fail, or hit its memory or time limit; the renderer must not die otherwise.
fn check(e: ChatError) {
    if let ChatError::TemplateRenderer(what) = &e {
        panic!("the template renderer failed: {what}");
    }
}
