//! Scripted fakes of the two seams, for tests of the HTTP surface without a model
//! (Rust integration tests and the pytest suite's `fake_server` example). Not used in serving.
//!
//! Vocabulary: ids 0–255 are bytes, then `<eos>`, `<think>`, `</think>`. The template renders
//! `role: content` lines and ends with `assistant:` (plus `<think>` when `enable_thinking`
//! is true). The generator's answer depends on markers in the prompt:
//!
//! | marker    | answer                                                                  |
//! |-----------|-------------------------------------------------------------------------|
//! | (none)    | `Hello! You said: <last user line>` then EOS                            |
//! | `[think]` | `<think>Let me think.</think>The answer is 42.` then EOS                |
//! | prompt ends in `<think>` | `Plan.</think>Done.` then EOS                             |
//! | `[long]`  | `word ` forever (ends at max_tokens: `length`)                           |
//! | `[slow]`  | like `[long]`, 20 ms per token (cancellation tests)                      |
//! | `[error]` | one token, then an engine error                                          |
//! | `[busy]`  | refused: queue full                                                      |
//! | `[prefill]` | like `[long]`, after a 1 s "prefill" (cancellation during prefill)     |
//! | `[tool]`  | one Hermes call: `get_weather` with `{"city": "Paris"}`                  |
//! | `[tools]` | text, two Hermes calls (`get_weather`, `get_time`), text                 |
//! | `[tool-tag]` | a Hermes `echo` call whose string argument holds `</tool_call>`       |
//! | `[tool-xml]` | one Qwen XML call: `get_weather`, `city` = `Paris`, `days` = `3`      |
//! | `[think-tool]` | reasoning that mentions a call, then a real `get_weather` call      |
//! | `[tool-fix]` | a Hermes call with malformed arguments (`"days": "3",}`)             |
//!
//! With temperature > 0 the answer ends with ` #N`, N drawn from the seed, so seeded requests
//! repeat and unseeded ones differ.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use afm_engine::{
    EventReceiver, FinishReason, GenerateEvent, GenerateRequest, GenerationStats, RequestId,
    TokenLogprob,
};
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value};
use tokio::sync::mpsc;

use crate::seams::{Detokenizer, Generator, SubmitError, TextModel};

pub const EOS: u32 = 256;
pub const THINK: u32 = 257;
pub const END_THINK: u32 = 258;
const SPECIALS: [(&str, u32); 3] = [("<eos>", EOS), ("<think>", THINK), ("</think>", END_THINK)];

/// Byte-level tokenizer and a line-per-message template.
pub struct FakeText;

impl TextModel for FakeText {
    fn render_chat(
        &self,
        messages: &[Value],
        _tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, String> {
        let mut out = String::new();
        for m in messages {
            let content = m["content"].as_str().unwrap_or_default();
            if content == "[raise]" {
                return Err("Conversation roles must alternate user/assistant".into());
            }
            out.push_str(&format!(
                "{}: {content}\n",
                m["role"].as_str().unwrap_or("?")
            ));
        }
        if add_generation_prompt {
            out.push_str("assistant:");
            if kwargs.get("enable_thinking") == Some(&Value::Bool(true)) {
                out.push_str("<think>");
            }
        }
        Ok(out)
    }

    fn encode(&self, text: &str, _add_special: bool) -> Vec<u32> {
        let bytes = text.as_bytes();
        let mut ids = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            match SPECIALS
                .iter()
                .find(|(s, _)| bytes[i..].starts_with(s.as_bytes()))
            {
                Some((s, id)) => {
                    ids.push(*id);
                    i += s.len();
                }
                None => {
                    ids.push(bytes[i] as u32);
                    i += 1;
                }
            }
        }
        ids
    }

    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn detokenizer(&self) -> Box<dyn Detokenizer> {
        Box::new(ByteDetok(Vec::new()))
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        match id {
            0..=255 => vec![id as u8],
            EOS => Vec::new(),
            _ => SPECIALS
                .iter()
                .find(|s| s.1 == id)
                .map(|s| s.0.as_bytes().to_vec())
                .unwrap_or_default(),
        }
    }

    fn stop_token_ids(&self) -> Vec<u32> {
        vec![EOS]
    }

    fn vocab_size(&self) -> usize {
        259
    }
}

/// Holds bytes until they form complete UTF-8 characters.
struct ByteDetok(Vec<u8>);

impl Detokenizer for ByteDetok {
    fn push(&mut self, id: u32) -> String {
        self.0.extend(FakeText.token_bytes(id));
        let valid = match std::str::from_utf8(&self.0) {
            Ok(_) => self.0.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.0.len(), // invalid bytes: flush them lossily
        };
        let done: Vec<u8> = self.0.drain(..valid).collect();
        String::from_utf8_lossy(&done).into_owned()
    }

    fn finish(&mut self) -> String {
        String::from_utf8_lossy(&std::mem::take(&mut self.0)).into_owned()
    }
}

/// How each request ended, as the fake engine saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeOutcome {
    Running,
    Finished,
    /// `cancel` was called.
    Cancelled,
    /// The receiver was dropped (client gone).
    Dropped,
}

#[derive(Default)]
pub struct FakeGenerator {
    next_id: AtomicU64,
    outcomes: Mutex<HashMap<RequestId, FakeOutcome>>,
    /// Every request as submitted, for assertions on sampling and limits.
    submitted: Mutex<Vec<GenerateRequest>>,
}

impl FakeGenerator {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn outcomes(&self) -> HashMap<RequestId, FakeOutcome> {
        self.outcomes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn submitted(&self) -> Vec<GenerateRequest> {
        self.submitted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set(&self, id: RequestId, outcome: FakeOutcome) {
        let mut map = self.outcomes.lock().unwrap_or_else(PoisonError::into_inner);
        // A cancel recorded first is not overwritten by the task noticing it.
        let entry = map.entry(id).or_insert(outcome);
        if *entry == FakeOutcome::Running {
            *entry = outcome;
        }
    }

    fn outcome(&self, id: RequestId) -> FakeOutcome {
        self.outcomes()
            .get(&id)
            .copied()
            .unwrap_or(FakeOutcome::Running)
    }
}

/// Tool-call answers, by prompt marker (longest markers first: `[tool]` is in none of them).
const TOOL_SCRIPTS: [(&str, &str); 6] = [
    (
        "[tool-fix]",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \
         \"days\": \"3\",}}\n</tool_call>",
    ),
    (
        "[think-tool]",
        "<think>I could answer <tool_call>{\"name\": \"guess\", \"arguments\": {}}</tool_call> \
         but better ask.</think><tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
         {\"city\": \"Paris\"}}\n</tool_call>",
    ),
    (
        "[tool-tag]",
        "<tool_call>\n{\"name\": \"echo\", \"arguments\": {\"text\": \"a </tool_call> b\"}}\n\
         </tool_call>",
    ),
    (
        "[tool-xml]",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
         <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    ),
    (
        "[tools]",
        "Checking both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
         {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \
         \"arguments\": {\"tz\": \"Europe/Paris\"}}\n</tool_call>\nOne moment.",
    ),
    (
        "[tool]",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
         </tool_call>",
    ),
];

/// The script for one prompt: answer tokens, whether it ends with EOS, delay per token.
fn script(req: &GenerateRequest) -> (Vec<u32>, bool, Duration, bool) {
    let prompt = FakeText.decode(&req.prompt_tokens);
    let ms = |n| Duration::from_millis(n);
    let ends = !["[long]", "[slow]", "[prefill]"]
        .iter()
        .any(|m| prompt.contains(m));
    let tool = TOOL_SCRIPTS.iter().find(|(m, _)| prompt.contains(m));
    let mut answer = if let Some((_, text)) = tool {
        text.to_string()
    } else if prompt.ends_with("<think>") {
        "Plan.</think>Done.".to_string()
    } else if prompt.contains("[think]") {
        "<think>Let me think.</think>The answer is 42.".to_string()
    } else if !ends {
        "word ".repeat(req.max_tokens.div_ceil(5) + 1)
    } else {
        let last = prompt
            .lines()
            .rev()
            .find(|l| l.starts_with("user: "))
            .unwrap_or("user: ");
        format!("Hello! You said: {}", &last[6..])
    };
    if req.sampling.temperature > 0.0 {
        let mut rng = match req.sampling.seed {
            Some(s) => rand_chacha::ChaCha8Rng::seed_from_u64(s),
            None => rand_chacha::ChaCha8Rng::from_entropy(),
        };
        answer.push_str(&format!(" #{}", rng.gen_range(0..1_000_000)));
    }
    let delay = if prompt.contains("[slow]") {
        ms(20)
    } else {
        ms(0)
    };
    (
        FakeText.encode(&answer, false),
        ends,
        delay,
        prompt.contains("[error]"),
    )
}

impl Generator for Arc<FakeGenerator> {
    fn submit(&self, req: GenerateRequest) -> Result<(RequestId, EventReceiver), SubmitError> {
        if FakeText.decode(&req.prompt_tokens).contains("[busy]") {
            return Err(SubmitError::QueueFull { limit: 4 });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.set(id, FakeOutcome::Running);
        self.submitted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(req.clone());
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run_fake(self.clone(), id, req, tx));
        Ok((id, rx))
    }

    fn cancel(&self, id: RequestId) {
        self.set(id, FakeOutcome::Cancelled);
    }

    fn max_context(&self) -> usize {
        4096
    }
}

async fn run_fake(
    fake: Arc<FakeGenerator>,
    id: RequestId,
    req: GenerateRequest,
    tx: mpsc::UnboundedSender<GenerateEvent>,
) {
    let (answer, ends, delay, error) = script(&req);
    if FakeText.decode(&req.prompt_tokens).contains("[prefill]") {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let mut sent = 0;
    let reason = loop {
        if fake.outcome(id) == FakeOutcome::Cancelled {
            break FinishReason::Cancelled;
        }
        if error && sent == 1 {
            let _ = tx.send(GenerateEvent::Error {
                message: "scripted engine failure".into(),
            });
            fake.set(id, FakeOutcome::Finished);
            return;
        }
        if sent == req.max_tokens {
            break FinishReason::Length;
        }
        let token = match answer.get(sent) {
            Some(&t) => t,
            None if ends => break FinishReason::Stop,
            None => b' ' as u32,
        };
        let logprob = req.top_logprobs.map(|k| TokenLogprob {
            logprob: -0.25,
            top: (0..k as u32)
                .map(|i| (token.saturating_add(i) % 256, -0.25 - i as f32))
                .collect(),
        });
        if tx
            .send(GenerateEvent::Token { id: token, logprob })
            .is_err()
        {
            fake.set(id, FakeOutcome::Dropped);
            return;
        }
        sent += 1;
        if delay.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(delay).await;
        }
    };
    fake.set(id, FakeOutcome::Finished);
    let stats = GenerationStats {
        prompt_tokens: req.prompt_tokens.len(),
        cached_tokens: 0,
        completion_tokens: sent,
        queue_time: 0.0,
        prompt_time: 0.001,
        completion_time: 0.001 * sent as f64,
    };
    let _ = tx.send(GenerateEvent::Finished { reason, stats });
}
