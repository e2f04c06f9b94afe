//! The generation pipeline after tokenization, shared by chat, completions and `afm -s`:
//! submit one engine request per choice, then turn each one's token events into text deltas
//! (incremental detokenize → stop strings → reasoning split → tool calls) and a final outcome.
//!
//! Everything here is owned by the returned [`Generation`] stream: dropping it (a client that
//! disconnects, a handler future that is dropped) cancels every engine request it holds.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use afm_api::{ApiError, TokenLogprobEntry, TopLogprob};
use afm_engine::{
    EventReceiver, FinishReason, GenerateEvent, GenerateRequest, GenerationStats, RequestId,
    SamplingParams, TokenConstraint, TokenLogprob,
};
use futures::stream::{self, BoxStream, SelectAll, Stream, StreamExt};

use crate::reasoning::{ReasoningSplitter, Split};
use crate::registry::Registration;
use crate::seams::{Detokenizer, Generator, TextModel};
use crate::stop_strings::{StopMatcher, StopOutcome};
use crate::tool_calls::{Piece, ToolCallDelta, ToolSpec, ToolStage};

/// What one choice should generate.
#[derive(Debug, Clone)]
pub struct ChoiceSpec {
    pub index: usize,
    /// Which prompt of the request (completions may batch several); usage counts each once.
    pub prompt_index: usize,
    pub prompt_tokens: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    /// `None`: no reasoning split (`--raw`, completions); `Some(opened_by_template)` otherwise.
    pub reasoning: Option<bool>,
    /// Tool calls to extract from `content`; `None`: all content is text.
    pub tools: Option<ToolSpec>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ChoiceEvent {
    Delta {
        index: usize,
        reasoning: Option<String>,
        content: String,
        logprobs: Vec<TokenLogprobEntry>,
        /// Tool-call pieces, which come after this delta's `content` in the output.
        tool_calls: Vec<ToolCallDelta>,
    },
    Done {
        index: usize,
        finish_reason: &'static str,
        stats: ChoiceStats,
        /// The completed calls (empty without tools).
        tool_calls: Vec<afm_chat::tool_calls::ToolCall>,
    },
    Failed {
        index: usize,
        message: String,
    },
}

/// Counts and times of one finished choice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceStats {
    pub prompt_index: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Prefill seconds (admission to first token).
    pub prompt_time: f64,
    pub completion_time: f64,
}

/// Submits every choice up front, so a full queue is an HTTP 429 before any byte is sent.
pub fn start(
    generator: &Arc<dyn Generator>,
    text: &Arc<dyn TextModel>,
    specs: Vec<ChoiceSpec>,
    constraints: Vec<Box<dyn TokenConstraint>>,
    registration: Registration,
) -> Result<Generation, ApiError> {
    // One per choice, in order, or none (unconstrained).
    let mut constraints = constraints.into_iter();
    let max_context = generator.max_context();
    let eos = text.stop_token_ids();
    let mut streams = Vec::with_capacity(specs.len());
    for spec in specs {
        let prompt_len = spec.prompt_tokens.len();
        if prompt_len >= max_context {
            return Err(ApiError::PromptTooLong {
                prompt_tokens: prompt_len,
                limit: max_context,
            });
        }
        let req = GenerateRequest {
            prompt_tokens: spec.prompt_tokens.clone(),
            sampling: spec.sampling.clone(),
            // The context bounds the answer: finish_reason "length" when it is full.
            max_tokens: spec.max_tokens.min(max_context - prompt_len),
            stop_token_ids: eos.clone(),
            top_logprobs: spec.logprobs,
        };
        // On error, the submissions made so far are dropped here, which cancels them.
        let (id, rx) = generator.submit_constrained(req, constraints.next())?;
        registration.add(id);
        let sub = Submission {
            id,
            rx,
            generator: generator.clone(),
            finished: false,
        };
        streams.push(ChoiceRun::new(spec, sub, text.clone()).into_stream());
    }
    Ok(Generation {
        inner: stream::select_all(streams),
        _registration: registration,
    })
}

/// The merged events of all choices of one request.
pub struct Generation {
    inner: SelectAll<BoxStream<'static, ChoiceEvent>>,
    _registration: Registration,
}

impl Stream for Generation {
    type Item = ChoiceEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ChoiceEvent>> {
        self.inner.poll_next_unpin(cx)
    }
}

/// One engine request; cancelled on drop unless it finished.
struct Submission {
    id: RequestId,
    rx: EventReceiver,
    generator: Arc<dyn Generator>,
    finished: bool,
}

impl Drop for Submission {
    fn drop(&mut self) {
        if !self.finished {
            self.generator.cancel(self.id);
        }
    }
}

/// Per-choice text state between engine events and deltas.
struct ChoiceRun {
    spec: ChoiceSpec,
    sub: Submission,
    text: Arc<dyn TextModel>,
    detok: Box<dyn Detokenizer>,
    stops: StopMatcher,
    reasoning: Option<ReasoningSplitter>,
    tools: Option<ToolStage>,
    outbox: VecDeque<ChoiceEvent>,
    tokens: usize,
    submitted: Instant,
    first_token: Option<Instant>,
    /// A stop string ended the text; waiting for the engine to confirm the cancel.
    stopped_by_string: bool,
    done: bool,
}

impl ChoiceRun {
    fn new(spec: ChoiceSpec, sub: Submission, text: Arc<dyn TextModel>) -> Self {
        ChoiceRun {
            // Tool-call markers are special tokens in some vocabularies (`[TOOL_CALLS]`).
            detok: match spec.tools {
                Some(_) => text.detokenizer_with_special(),
                None => text.detokenizer(),
            },
            stops: StopMatcher::new(spec.stop.clone()),
            reasoning: spec.reasoning.map(ReasoningSplitter::new),
            tools: spec.tools.as_ref().map(ToolStage::new),
            spec,
            sub,
            text,
            outbox: VecDeque::new(),
            tokens: 0,
            submitted: Instant::now(),
            first_token: None,
            stopped_by_string: false,
            done: false,
        }
    }

    fn into_stream(self) -> BoxStream<'static, ChoiceEvent> {
        stream::unfold(self, |mut run| async move {
            let event = run.next_event().await?;
            Some((event, run))
        })
        .boxed()
    }

    async fn next_event(&mut self) -> Option<ChoiceEvent> {
        loop {
            if let Some(e) = self.outbox.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            match self.sub.rx.recv().await {
                Some(GenerateEvent::Token { id, logprob }) => self.on_token(id, logprob),
                Some(GenerateEvent::Finished { reason, stats }) => self.on_finished(reason, &stats),
                Some(GenerateEvent::Error { message }) => self.fail(message),
                None => self.on_closed(),
            }
        }
    }

    fn on_token(&mut self, id: u32, logprob: Option<TokenLogprob>) {
        if self.stopped_by_string {
            return; // generated after the stop string, before the cancel took effect
        }
        self.tokens += 1;
        self.first_token.get_or_insert_with(Instant::now);
        let piece = self.detok.push(id);
        let logprobs = match logprob {
            Some(lp) if self.spec.logprobs.is_some() => vec![self.logprob_entry(id, &lp)],
            _ => Vec::new(),
        };
        match self.stops.push(&piece) {
            StopOutcome::Emit(t) => self.emit(&t, logprobs, false),
            StopOutcome::Stopped(t) => {
                self.emit(&t, logprobs, true);
                self.stopped_by_string = true;
                self.sub.generator.cancel(self.sub.id);
            }
        }
    }

    fn on_finished(&mut self, reason: FinishReason, stats: &GenerationStats) {
        self.sub.finished = true;
        self.done = true;
        let finish_reason = if self.stopped_by_string {
            "stop"
        } else {
            let tail = self.detok.finish();
            let (text, hit) = match self.stops.push(&tail) {
                StopOutcome::Emit(t) => (t + &self.stops.finish(), false),
                StopOutcome::Stopped(t) => (t, true),
            };
            self.emit(&text, Vec::new(), true);
            match reason {
                _ if hit => "stop",
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
                FinishReason::Cancelled => "cancelled",
            }
        };
        let tool_calls = self
            .tools
            .as_ref()
            .map(ToolStage::calls)
            .unwrap_or_default();
        let finish_reason = match finish_reason {
            "stop" | "length" if !tool_calls.is_empty() => "tool_calls",
            other => other,
        };
        let stats = ChoiceStats {
            prompt_index: self.spec.prompt_index,
            prompt_tokens: self.spec.prompt_tokens.len(),
            cached_tokens: stats.cached_tokens,
            completion_tokens: self.tokens,
            prompt_time: stats.prompt_time,
            completion_time: stats.completion_time,
        };
        self.outbox.push_back(ChoiceEvent::Done {
            index: self.spec.index,
            finish_reason,
            stats,
            tool_calls,
        });
    }

    /// The engine dropped the channel without a final event: after our own cancel that is a
    /// normal end; otherwise it is an engine failure.
    fn on_closed(&mut self) {
        if !self.stopped_by_string {
            return self.fail("the engine ended the request without finishing it".into());
        }
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let stats = GenerationStats {
            prompt_tokens: self.spec.prompt_tokens.len(),
            prompt_time: (first - self.submitted).as_secs_f64(),
            completion_time: (now - first).as_secs_f64(),
            ..Default::default()
        };
        self.on_finished(FinishReason::Stop, &stats);
    }

    fn fail(&mut self, message: String) {
        self.sub.finished = true;
        self.done = true;
        self.outbox.push_back(ChoiceEvent::Failed {
            index: self.spec.index,
            message,
        });
    }

    /// Queues deltas for `text` (after the reasoning split and tool-call extraction);
    /// `last` flushes both.
    fn emit(&mut self, text: &str, logprobs: Vec<TokenLogprobEntry>, last: bool) {
        let mut split = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => Split {
                content: text.to_string(),
                ..Split::default()
            },
        };
        if last {
            if let Some(r) = &mut self.reasoning {
                let tail = r.finish();
                split.reasoning.push_str(&tail.reasoning);
                split.content.push_str(&tail.content);
            }
        }
        let has_reasoning = split.opened || !split.reasoning.is_empty();
        let mut reasoning = has_reasoning.then_some(split.reasoning);
        let mut logprobs = Some(logprobs);
        let pieces = match &mut self.tools {
            Some(t) => t.push(&split.content, last),
            None => vec![Piece::Text(split.content)],
        };
        // Reasoning and logprobs ride on the first delta; pieces keep their order.
        for piece in pieces {
            let (content, tool_calls) = match piece {
                Piece::Text(t) => (t, Vec::new()),
                Piece::Calls(c) => (String::new(), c),
            };
            let logprobs = logprobs.take().unwrap_or_default();
            self.push_delta(reasoning.take(), content, tool_calls, logprobs);
        }
        if let Some(logprobs) = logprobs {
            self.push_delta(reasoning, String::new(), Vec::new(), logprobs);
        }
    }

    fn push_delta(
        &mut self,
        reasoning: Option<String>,
        content: String,
        tool_calls: Vec<ToolCallDelta>,
        logprobs: Vec<TokenLogprobEntry>,
    ) {
        if reasoning.is_none() && content.is_empty() && tool_calls.is_empty() && logprobs.is_empty()
        {
            return;
        }
        self.outbox.push_back(ChoiceEvent::Delta {
            index: self.spec.index,
            reasoning,
            content,
            logprobs,
            tool_calls,
        });
    }

    fn logprob_entry(&self, id: u32, lp: &TokenLogprob) -> TokenLogprobEntry {
        let top = |(tid, logprob): &(u32, f32)| {
            let bytes = self.text.token_bytes(*tid);
            TopLogprob {
                token: String::from_utf8_lossy(&bytes).into_owned(),
                logprob: *logprob,
                bytes,
            }
        };
        let bytes = self.text.token_bytes(id);
        TokenLogprobEntry {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            logprob: lp.logprob,
            bytes,
            top_logprobs: lp
                .top
                .iter()
                .take(self.spec.logprobs.unwrap_or(0))
                .map(top)
                .collect(),
        }
    }
}
