//! Chat completions: template → tokenize → generation, then shaping into OpenAI's
//! `chat.completion` object or its `chat.completion.chunk` stream. `afm -s` uses the same
//! [`start_chat`] and [`ChatAccumulator`].

use std::convert::Infallible;
use std::time::Instant;

use afm_api::{
    ApiError, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatLogprobs,
    ChunkChoice, Delta, ValidChatRequest,
};
use axum::response::sse::Event;
use futures::stream::{self, Stream, StreamExt};

use crate::generation::{self, ChoiceEvent, ChoiceSpec, Generation};
use crate::gpu_profile::Profiler;
use crate::reasoning::ReasoningSplitter;
use crate::tool_calls::{message_tool_calls, ToolSpec};
use crate::usage::{new_id, unix_now, UsageAcc};
use crate::AppState;

/// A started chat request: its identity and its running generation.
pub struct ChatJob {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub n: usize,
    pub logprobs: bool,
    pub include_usage: bool,
    pub grammar_downgraded: bool,
    pub started: Instant,
    pub generation: Generation,
}

pub fn start_chat(state: &AppState, req: ValidChatRequest) -> Result<ChatJob, ApiError> {
    let started = Instant::now();
    let text = &state.model.text;
    let rendered = text
        .render_chat(
            &req.messages,
            req.tools.as_deref(),
            true,
            &req.template_kwargs,
        )
        .map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("The chat template could not render these messages: {e}"),
            )
        })?;
    let prompt_tokens = text.encode(&rendered, true);
    let reasoning =
        (!state.config.raw).then(|| ReasoningSplitter::prompt_opens_reasoning(&rendered));
    let tools = ToolSpec::for_request(
        &state.config.tool_calls,
        text.tool_call_format(),
        req.tools.as_deref(),
        req.parallel_tool_calls,
    );
    let g = &req.generation;
    let (constraints, downgraded) = output_constraints(state, &req, &rendered)?;
    let specs = (0..g.n)
        .map(|i| ChoiceSpec {
            index: i,
            prompt_index: 0,
            prompt_tokens: prompt_tokens.clone(),
            sampling: seeded(&g.sampling, i),
            max_tokens: g.max_tokens,
            stop: g.stop.clone(),
            logprobs: g.logprobs,
            reasoning,
            tools: tools.clone(),
        })
        .collect();
    let id = new_id("chatcmpl-");
    let registration = state.registry.register(&id);
    let generation = generation::start(
        &state.model.generator,
        &state.model.text,
        specs,
        constraints,
        registration,
    )?;
    Ok(ChatJob {
        id,
        created: unix_now(),
        model: state.model.info.id.clone(),
        n: g.n,
        logprobs: g.logprobs.is_some(),
        include_usage: g.include_usage,
        grammar_downgraded: req.grammar_downgraded || downgraded,
        started,
        generation,
    })
}

/// The grammar constraints of a request's choices (`--enable-grammar-constraints`), and
/// whether the request had to be downgraded to best effort (no grammar for this model or
/// tool-call dialect).
fn output_constraints(
    state: &AppState,
    req: &ValidChatRequest,
    rendered: &str,
) -> Result<(Vec<Box<dyn afm_engine::TokenConstraint>>, bool), ApiError> {
    let Some(output) = &req.output else {
        return Ok((Vec::new(), false));
    };
    let text = &state.model.text;
    let format = state
        .config
        .tool_calls
        .format
        .unwrap_or_else(|| text.tool_call_format());
    let opens = !state.config.raw && ReasoningSplitter::prompt_opens_reasoning(rendered);
    match text.output_constraints(output, format, req.generation.n, opens, !state.config.raw)? {
        Some(c) => Ok((c, false)),
        None => Ok((Vec::new(), true)),
    }
}

/// Choice `i` of a seeded request gets seed + i, so n > 1 gives n different samples that
/// are each reproducible.
pub(crate) fn seeded(
    sampling: &afm_engine::SamplingParams,
    i: usize,
) -> afm_engine::SamplingParams {
    let mut s = sampling.clone();
    s.seed = s.seed.map(|seed| seed.wrapping_add(i as u64));
    s
}

/// Collects events into the non-streamed response.
pub struct ChatAccumulator {
    choices: Vec<ChoiceAcc>,
    usage: UsageAcc,
    logprobs: bool,
}

#[derive(Default)]
struct ChoiceAcc {
    content: String,
    reasoning: Option<String>,
    logprobs: Vec<afm_api::TokenLogprobEntry>,
    finish_reason: Option<&'static str>,
    tool_calls: Vec<afm_chat::tool_calls::ToolCall>,
}

impl ChatAccumulator {
    pub fn new(job: &ChatJob) -> Self {
        ChatAccumulator {
            choices: (0..job.n).map(|_| ChoiceAcc::default()).collect(),
            usage: UsageAcc::new(job.started),
            logprobs: job.logprobs,
        }
    }

    pub fn push(&mut self, event: ChoiceEvent) -> Result<(), ApiError> {
        match event {
            ChoiceEvent::Delta {
                index,
                reasoning,
                content,
                logprobs,
                ..
            } => {
                let c = &mut self.choices[index];
                c.content.push_str(&content);
                if let Some(r) = reasoning {
                    c.reasoning.get_or_insert_with(String::new).push_str(&r);
                }
                c.logprobs.extend(logprobs);
            }
            ChoiceEvent::Done {
                index,
                finish_reason,
                stats,
                tool_calls,
            } => {
                self.choices[index].finish_reason = Some(finish_reason);
                self.choices[index].tool_calls = tool_calls;
                self.usage.add(&stats);
            }
            ChoiceEvent::Failed { message, .. } => return Err(ApiError::Internal(message)),
        }
        Ok(())
    }

    pub fn finish(self, job_id: &str, created: u64, model: &str) -> ChatCompletion {
        let usage = self.usage.usage();
        let logprobs = self.logprobs;
        let choices = self
            .choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| ChatChoice {
                index,
                message: AssistantMessage {
                    role: "assistant".into(),
                    // Only the calls: whitespace around them is not an answer.
                    content: (c.tool_calls.is_empty() || !c.content.trim().is_empty())
                        .then_some(c.content),
                    reasoning_content: c.reasoning,
                    tool_calls: (!c.tool_calls.is_empty())
                        .then(|| message_tool_calls(&c.tool_calls)),
                },
                logprobs: logprobs.then_some(ChatLogprobs {
                    content: c.logprobs,
                }),
                finish_reason: c.finish_reason.unwrap_or("stop").to_string(),
            })
            .collect();
        ChatCompletion {
            id: job_id.to_string(),
            object: "chat.completion".into(),
            created,
            model: model.to_string(),
            choices,
            timings: usage.timings(),
            usage,
        }
    }
}

/// Runs a job to the end and returns the `chat.completion` object.
pub async fn collect_chat(mut job: ChatJob) -> Result<ChatCompletion, ApiError> {
    let mut acc = ChatAccumulator::new(&job);
    while let Some(event) = job.generation.next().await {
        acc.push(event)?;
    }
    Ok(acc.finish(&job.id, job.created, &job.model))
}

/// The SSE body: a role chunk per choice, content deltas, a finish chunk per choice, the usage
/// chunk (unless `include_usage` is false), then `[DONE]`.
pub fn chat_sse(
    job: ChatJob,
    profile: Option<Profiler>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let shape = ChunkShape {
        id: job.id,
        created: job.created,
        model: job.model,
    };
    let head: Vec<Event> = (0..job.n)
        .map(|index| {
            let delta = Delta {
                role: Some("assistant".into()),
                content: Some(String::new()),
                reasoning_content: None,
                tool_calls: None,
            };
            shape.chunk(index, delta, None, None)
        })
        .collect();
    let state = SseState {
        usage: UsageAcc::new(job.started),
        generation: job.generation,
        include_usage: job.include_usage,
        logprobs: job.logprobs,
        shape,
        profile,
    };
    let body = stream::unfold(Some(state), |state| async move {
        let mut st = state?;
        match st.generation.next().await {
            Some(ChoiceEvent::Failed { message, .. }) => {
                let err = ApiError::Internal(message).body();
                Some((vec![json_event(&err), done_event()], None))
            }
            Some(event) => {
                let events = st.on_event(event);
                Some((events, Some(st)))
            }
            None => Some((st.tail(), None)),
        }
    })
    .flat_map(stream::iter);
    stream::iter(head).chain(body).map(Ok)
}

struct ChunkShape {
    id: String,
    created: u64,
    model: String,
}

impl ChunkShape {
    fn chunk(
        &self,
        index: usize,
        delta: Delta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<&str>,
    ) -> Event {
        json_event(&ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: finish.map(str::to_string),
            }],
            usage: None,
            timings: None,
        })
    }
}

struct SseState {
    generation: Generation,
    usage: UsageAcc,
    include_usage: bool,
    logprobs: bool,
    shape: ChunkShape,
    profile: Option<Profiler>,
}

impl SseState {
    fn on_event(&mut self, event: ChoiceEvent) -> Vec<Event> {
        match event {
            ChoiceEvent::Delta {
                index,
                reasoning,
                content,
                logprobs,
                tool_calls,
            } => {
                let calls = (!tool_calls.is_empty())
                    .then(|| tool_calls.iter().map(|d| d.to_json()).collect());
                let delta = Delta {
                    role: None,
                    content: (!content.is_empty() || (reasoning.is_none() && calls.is_none()))
                        .then_some(content),
                    reasoning_content: reasoning,
                    tool_calls: calls,
                };
                let lp = self.logprobs.then_some(ChatLogprobs { content: logprobs });
                vec![self.shape.chunk(index, delta, lp, None)]
            }
            ChoiceEvent::Done {
                index,
                finish_reason,
                stats,
                ..
            } => {
                self.usage.add(&stats);
                vec![self
                    .shape
                    .chunk(index, Delta::default(), None, Some(finish_reason))]
            }
            ChoiceEvent::Failed { .. } => Vec::new(), // handled by the caller
        }
    }

    fn tail(&self) -> Vec<Event> {
        let mut events = Vec::with_capacity(2);
        if self.include_usage || self.profile.is_some() {
            let usage = self.usage.usage();
            let chunk = ChatCompletionChunk {
                id: self.shape.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.shape.created,
                model: self.shape.model.clone(),
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

pub(crate) fn json_event<T: serde::Serialize>(value: &T) -> Event {
    // Serializing these plain structs cannot fail; an empty event is the harmless fallback.
    Event::default().data(serde_json::to_string(value).unwrap_or_default())
}

pub(crate) fn done_event() -> Event {
    Event::default().data("[DONE]")
}
