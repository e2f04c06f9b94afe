//! Text completions (`POST /v1/completions`): prompts as text or token ids, several prompts
//! × `n` choices (choice index = prompt × n + j), `echo`, and the legacy logprobs layout.
//! No chat template and no reasoning split: the model's raw continuation.

use std::convert::Infallible;
use std::time::Instant;

use afm_api::{
    ApiError, Completion, CompletionChoice, CompletionLogprobs, TokenLogprobEntry,
    ValidCompletionRequest, ValidPrompt,
};
use axum::response::sse::Event;
use futures::stream::{self, Stream, StreamExt};
use serde_json::{Map, Value};

use crate::chat::{done_event, json_event, seeded};
use crate::generation::{self, ChoiceEvent, ChoiceSpec, Generation};
use crate::gpu_profile::Profiler;
use crate::usage::{new_id, unix_now, UsageAcc};
use crate::AppState;

pub struct CompletionJob {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub started: Instant,
    pub logprobs: bool,
    pub include_usage: bool,
    /// Per choice: the prompt text to echo before the answer (empty without `echo`).
    pub echoes: Vec<String>,
    pub generation: Generation,
}

pub fn start_completion(
    state: &AppState,
    req: ValidCompletionRequest,
) -> Result<CompletionJob, ApiError> {
    let started = Instant::now();
    let text = &state.model.text;
    let g = &req.generation;
    let mut specs = Vec::with_capacity(req.prompts.len() * g.n);
    let mut echoes = Vec::with_capacity(specs.capacity());
    for (p, prompt) in req.prompts.iter().enumerate() {
        let (tokens, prompt_text) = match prompt {
            ValidPrompt::Text(t) => (text.encode(t, true), t.clone()),
            ValidPrompt::Tokens(ids) => (ids.clone(), text.decode(ids)),
        };
        for j in 0..g.n {
            specs.push(ChoiceSpec {
                index: p * g.n + j,
                prompt_index: p,
                prompt_tokens: tokens.clone(),
                sampling: seeded(&g.sampling, j),
                max_tokens: g.max_tokens,
                stop: g.stop.clone(),
                logprobs: g.logprobs,
                reasoning: None,
                tools: None,
            });
            echoes.push(if req.echo {
                prompt_text.clone()
            } else {
                String::new()
            });
        }
    }
    let id = new_id("cmpl-");
    let registration = state.registry.register(&id);
    let generation = generation::start(
        &state.model.generator,
        &state.model.text,
        specs,
        Vec::new(),
        registration,
    )?;
    Ok(CompletionJob {
        id,
        created: unix_now(),
        model: state.model.info.id.clone(),
        started,
        logprobs: g.logprobs.is_some(),
        include_usage: g.include_usage,
        echoes,
        generation,
    })
}

/// Legacy logprobs for entries following `offset` bytes of already emitted text.
fn legacy_logprobs(entries: &[TokenLogprobEntry], mut offset: usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for e in entries {
        out.tokens.push(e.token.clone());
        out.token_logprobs.push(Some(e.logprob));
        let top: Map<String, Value> = e
            .top_logprobs
            .iter()
            .map(|t| (t.token.clone(), Value::from(t.logprob)))
            .collect();
        out.top_logprobs.push(Some(top));
        out.text_offset.push(offset);
        offset += e.token.len();
    }
    out
}

pub async fn collect_completion(mut job: CompletionJob) -> Result<Completion, ApiError> {
    let mut usage = UsageAcc::new(job.started);
    let n = job.echoes.len();
    let mut texts: Vec<String> = job.echoes.clone();
    let mut entries: Vec<Vec<TokenLogprobEntry>> = vec![Vec::new(); n];
    let mut finish: Vec<&'static str> = vec!["stop"; n];
    while let Some(event) = job.generation.next().await {
        match event {
            ChoiceEvent::Delta {
                index,
                content,
                logprobs,
                ..
            } => {
                texts[index].push_str(&content);
                entries[index].extend(logprobs);
            }
            ChoiceEvent::Done {
                index,
                finish_reason,
                stats,
                ..
            } => {
                finish[index] = finish_reason;
                usage.add(&stats);
            }
            ChoiceEvent::Failed { message, .. } => return Err(ApiError::Internal(message)),
        }
    }
    let choices = (0..n)
        .map(|i| CompletionChoice {
            index: i,
            text: std::mem::take(&mut texts[i]),
            logprobs: job
                .logprobs
                .then(|| legacy_logprobs(&entries[i], job.echoes[i].len())),
            finish_reason: Some(finish[i].to_string()),
        })
        .collect();
    let usage = usage.usage();
    Ok(Completion {
        id: job.id,
        object: "text_completion".into(),
        created: job.created,
        model: job.model,
        choices,
        timings: Some(usage.timings()),
        usage: Some(usage),
    })
}

/// SSE: the echo (if any) first, then text deltas, a finish chunk per choice, usage, `[DONE]`.
pub fn completion_sse(
    job: CompletionJob,
    profile: Option<Profiler>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let st = CompletionSse {
        offsets: job.echoes.iter().map(String::len).collect(),
        usage: UsageAcc::new(job.started),
        id: job.id,
        created: job.created,
        model: job.model,
        logprobs: job.logprobs,
        include_usage: job.include_usage,
        profile,
    };
    let head: Vec<Event> = job
        .echoes
        .iter()
        .enumerate()
        .filter(|(_, e)| !e.is_empty())
        .map(|(i, e)| st.chunk(i, e.clone(), None, None))
        .collect();
    let generation = job.generation;
    let body = stream::unfold(Some((st, generation)), |state| async move {
        let (mut st, mut generation) = state?;
        match generation.next().await {
            Some(ChoiceEvent::Failed { message, .. }) => {
                let err = ApiError::Internal(message).body();
                Some((vec![json_event(&err), done_event()], None))
            }
            Some(event) => {
                let events = st.on_event(event);
                Some((events, Some((st, generation))))
            }
            None => Some((st.tail(), None)),
        }
    })
    .flat_map(stream::iter);
    stream::iter(head).chain(body).map(Ok)
}

struct CompletionSse {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
    offsets: Vec<usize>,
    usage: UsageAcc,
    profile: Option<Profiler>,
}

impl CompletionSse {
    fn chunk(
        &self,
        index: usize,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish: Option<&str>,
    ) -> Event {
        json_event(&Completion {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices: vec![CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason: finish.map(str::to_string),
            }],
            usage: None,
            timings: None,
        })
    }

    fn on_event(&mut self, event: ChoiceEvent) -> Vec<Event> {
        match event {
            ChoiceEvent::Delta {
                index,
                content,
                logprobs,
                ..
            } => {
                let lp = self
                    .logprobs
                    .then(|| legacy_logprobs(&logprobs, self.offsets[index]));
                self.offsets[index] += content.len();
                vec![self.chunk(index, content, lp, None)]
            }
            ChoiceEvent::Done {
                index,
                finish_reason,
                stats,
                ..
            } => {
                self.usage.add(&stats);
                vec![self.chunk(index, String::new(), None, Some(finish_reason))]
            }
            ChoiceEvent::Failed { .. } => Vec::new(),
        }
    }

    fn tail(&self) -> Vec<Event> {
        let mut events = Vec::with_capacity(2);
        if self.include_usage || self.profile.is_some() {
            let usage = self.usage.usage();
            let chunk = Completion {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                timings: self.include_usage.then(|| usage.timings()),
                usage: self.include_usage.then(|| usage.clone()),
            };
            events.push(match &self.profile {
                Some(p) => json_event(&p.chunk(&chunk, &usage)),
                None => json_event(&chunk),
            });
        }
        events.push(done_event());
        events
    }
}
