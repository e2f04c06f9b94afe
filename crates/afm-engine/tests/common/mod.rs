//! What the SmolLM2 engine tests share: the model file, a greedy request, and draining a
//! request's events.

use std::path::PathBuf;

use afm_engine::*;

/// models/SmolLM2-135M-Instruct.Q4_1.gguf, which `scripts/fetch_models.sh smollm2` fetches.
pub fn smollm2_path() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch_models.sh smollm2",
        p.display()
    );
    p
}

/// A greedy request for `max_tokens` tokens after `prompt`.
pub fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams::default(),
        max_tokens,
        stop_token_ids: vec![],
        top_logprobs: None,
    }
}

/// Drains a request's events: (tokens, finish reason, stats).
pub async fn collect(mut rx: EventReceiver) -> (Vec<u32>, FinishReason, GenerationStats) {
    let mut toks = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenerateEvent::Token { id, .. } => toks.push(id),
            GenerateEvent::Finished { reason, stats } => return (toks, reason, stats),
            GenerateEvent::Error { message } => panic!("engine error: {message}"),
        }
    }
    panic!("event stream ended without Finished");
}
