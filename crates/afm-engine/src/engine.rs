//! The engine loop: the one thread that owns the scheduler, the KV cache, the model and every
//! sampler. Callers hold an [`EngineHandle`] and talk to it over a channel.
//!
//! One step is three calls, as in nano-vllm: `schedule` → `forward` → `complete_step`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use afm_models::{ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::compute::{ComputeError, Device, KvPool, LayerStateShape, StatePool};
use afm_runtime::kv_store::{KvCache, KvDtype};
use tokio::sync::mpsc as tmpsc;

use crate::api::*;
use crate::constraint::{Constrained, TokenConstraint};
use crate::kv_blocks::BlockManager;
use crate::metrics::EngineMetrics;
use crate::sampling::Sampler;
use crate::scheduler::{Scheduler, SchedulerConfig, SnapshotSave, StepPlan};
use crate::sequence::Sequence;
use crate::state_slots::{StateSlot, StateSlots};

mod device_step;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Longest sequence (prompt + generated); 0 = the model's own limit.
    pub max_context: usize,
    /// Sequences decoded together (`--concurrent`).
    pub concurrent: usize,
    /// Requests allowed to wait for admission before 429.
    pub max_waiting: usize,
    /// Tokens computed per step at most (`--prefill-step-size`).
    pub prefill_step_size: usize,
    /// Bytes for the KV pool; `None` = a share of available memory (of the model's device:
    /// host RAM, or GPU memory left after the weights).
    pub kv_budget_bytes: Option<usize>,
    /// Bytes for the KV pool as a share of the device's available memory (`--kv-memory 0.25`).
    pub kv_budget_fraction: Option<f64>,
    pub block_size: usize,
    pub prefix_caching: bool,
    /// `--kv-bits 8|4`: store K/V quantized; `None` keeps the checkpoint's precision.
    pub kv_bits: Option<u8>,
    /// `AFM_DEBUG=1`: tagged diagnostic lines on stderr.
    pub debug: bool,
    /// On a GPU: decode steps as CUDA graphs with sampling on the device.
    pub device_decode: bool,
    /// With `device_decode`: launch the next decode step from the sampled ids still on the
    /// device, then read them, so the host's work between steps overlaps the device's.
    pub decode_overlap: bool,
    /// `--prewarm y`: capture the decode graphs at start-up instead of on first use.
    pub prewarm: bool,
    /// `--gpu-profile`: every response carries the device profile (else on request).
    pub gpu_profile: bool,
    /// Hybrid models with prefix caching: recurrent-state snapshots kept for cached prefixes;
    /// `None` = as many as a quarter of the KV budget holds (at most an eighth of host memory).
    pub state_snapshots: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_context: 0,
            concurrent: 1,
            max_waiting: 64,
            prefill_step_size: 1024,
            kv_budget_bytes: None,
            kv_budget_fraction: None,
            block_size: 16,
            prefix_caching: true,
            kv_bits: None,
            debug: false,
            device_decode: true,
            decode_overlap: true,
            prewarm: true,
            gpu_profile: false,
            state_snapshots: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("too many requests waiting (limit {limit}); retry later")]
    QueueFull { limit: usize },
    #[error("prompt has {prompt} tokens; this model's context is {limit} tokens")]
    PromptTooLong { prompt: usize, limit: usize },
    #[error("the engine has stopped")]
    Stopped,
    #[error("{0}")]
    Config(String),
}

enum Command {
    Submit {
        id: RequestId,
        req: GenerateRequest,
        tx: tmpsc::UnboundedSender<GenerateEvent>,
        at: Instant,
        constraint: Option<Box<dyn TokenConstraint>>,
    },
    Cancel(RequestId),
    /// Stop: the engine thread drops its state and returns ([`EngineHandle::shutdown`]).
    Shutdown,
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    /// Submitted but not yet admitted: checked here so a full queue is refused synchronously.
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    max_context: usize,
    metrics: Arc<EngineMetrics>,
    profile: Option<Arc<crate::gpu_profile::DeviceProfile>>,
    /// The engine thread, joined by the first [`shutdown`](EngineHandle::shutdown).
    thread: Arc<std::sync::Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl EngineHandle {
    pub fn submit(&self, req: GenerateRequest) -> Result<(RequestId, EventReceiver), EngineError> {
        self.submit_constrained(req, None)
    }

    /// Like [`submit`](Self::submit), with a token constraint (e.g. a grammar) applied to
    /// every sampled token of this request.
    pub fn submit_constrained(
        &self,
        req: GenerateRequest,
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> Result<(RequestId, EventReceiver), EngineError> {
        if req.prompt_tokens.len() >= self.max_context {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt_tokens.len(),
                limit: self.max_context,
            });
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::QueueFull {
                limit: self.max_waiting,
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tmpsc::unbounded_channel();
        let cmd = Command::Submit {
            id,
            req,
            tx,
            at: Instant::now(),
            constraint,
        };
        if self.tx.send(cmd).is_err() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Stopped);
        }
        Ok((id, rx))
    }

    /// Stops a request wherever it is; its `Finished { Cancelled }` event follows.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.send(Command::Cancel(id));
    }

    /// Stops the engine and waits for its thread: requests still running end (their event
    /// streams close) and the model, KV pool and device buffers are freed on that thread
    /// before this returns. Call it before the process exits: a thread still tearing down CUDA
    /// state while `exit` unloads the driver's libraries crashed gpu_bench at exit (2 runs in
    /// 8 on the H200). Later calls, and calls from clones, return at once.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// The device profile (`--gpu-profile`, `X-AFM-Profile`); `None` on the CPU.
    pub fn device_profile(&self) -> Option<&crate::gpu_profile::DeviceProfile> {
        self.profile.as_deref()
    }
}

/// Per-request state the engine keeps beside the scheduler's token state.
struct Active {
    tx: tmpsc::UnboundedSender<GenerateEvent>,
    sampler: Sampler,
    req: GenerateRequest,
    arrived: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    generated: usize,
    /// The request's token constraint (grammar), if any.
    constraint: Option<Constrained>,
    /// Recurrent-state slot (hybrid models) while running; dropping it frees the slot.
    state_slot: Option<StateSlot>,
}

pub struct Engine {
    model: LoadedModel,
    kv: KvPool,
    scheduler: Scheduler,
    active: HashMap<RequestId, Active>,
    rx: mpsc::Receiver<Command>,
    waiting: Arc<AtomicUsize>,
    metrics: Arc<EngineMetrics>,
    max_context: usize,
    debug: bool,
    /// Slot ids of the KV pool's recurrent state, for models that have one.
    state_slots: Option<StateSlots>,
    /// Decode steps run through `device_step` (a GPU with graphs enabled).
    device_decode: bool,
    /// `EngineConfig::decode_overlap`, and the device decode step whose sampled ids are still
    /// on their way to the host.
    decode_overlap: bool,
    in_flight: Option<device_step::InFlight>,
}

impl Engine {
    /// Sizes the KV pool, starts the engine thread and returns its handle.
    pub fn spawn(model: LoadedModel, cfg: EngineConfig) -> Result<EngineHandle, EngineError> {
        let model_ctx = model.config.max_position;
        let max_context = if cfg.max_context == 0 {
            model_ctx
        } else {
            cfg.max_context
        };
        let shapes = model.model.kv_shapes();
        let state_shapes = model.model.state_shapes();
        let kv_dtype = match cfg.kv_bits {
            None => model.kv_dtype,
            Some(8) => KvDtype::Q8,
            Some(4) => KvDtype::Q4,
            Some(b) => {
                return Err(EngineError::Config(format!(
                    "--kv-bits must be 4 or 8, got {b}"
                )))
            }
        };
        let per_block = KvCache::bytes_per_block(&shapes, cfg.block_size, kv_dtype);
        let used_with_weights = match model.device.memory() {
            Ok(Some((free, total))) => total.saturating_sub(free),
            _ => 0,
        };
        let memory_err =
            |e: ComputeError| EngineError::Config(format!("reading device memory: {e}"));
        let budget = match (cfg.kv_budget_bytes, cfg.kv_budget_fraction) {
            (Some(b), _) => b,
            (None, Some(f)) => {
                (memory_for_kv(&model.device).map_err(memory_err)? as f64 * f) as usize
            }
            (None, None) => default_kv_budget(&model.device).map_err(memory_err)?,
        };
        let num_blocks = budget / per_block.max(1);
        let snapshots = state_snapshot_count(&cfg, &state_shapes, budget, num_blocks);
        // A cached prefix of a hybrid model resumes only from a state snapshot: none, no hits.
        let cfg = EngineConfig {
            prefix_caching: cfg.prefix_caching && (state_shapes.is_empty() || snapshots > 0),
            ..cfg
        };
        let per_seq = max_context.div_ceil(cfg.block_size);
        if num_blocks < per_seq {
            return Err(EngineError::Config(format!(
                "KV budget of {budget} bytes holds {} tokens; context {max_context} needs {} bytes (lower --max-context or raise --kv-memory)",
                num_blocks * cfg.block_size,
                per_seq * per_block
            )));
        }
        eprintln!(
            "[KVCache] {num_blocks} blocks × {} tokens, {kv_dtype:?} ({:.1} MiB, {} KiB/block) on {}, context {max_context}, prefix caching {}",
            cfg.block_size,
            (num_blocks * per_block) as f64 / (1 << 20) as f64,
            per_block / 1024,
            model.device.describe(),
            if cfg.prefix_caching { "on" } else { "off" }
        );
        let mut kv = model
            .device
            .kv_pool(&shapes, num_blocks, cfg.block_size, kv_dtype)
            .map_err(|e| EngineError::Config(format!("creating the KV cache: {e}")))?;
        let state_slots =
            attach_state_pool(&mut kv, &state_shapes, cfg.concurrent.max(1), snapshots);
        // Decode graphs replay attention-only steps; recurrent state takes the general path.
        let device_decode =
            state_slots.is_none() && device_step::prepare(&model, &mut kv, &cfg, max_context);
        let profile = crate::gpu_profile::DeviceProfile::new(
            &model.device,
            used_with_weights,
            per_block / cfg.block_size.max(1),
            cfg.gpu_profile,
        )
        .map(Arc::new);
        if let (true, Some(p)) = (cfg.gpu_profile, &profile) {
            eprintln!("{}", p.startup_line());
        }
        let mut blocks = BlockManager::new(num_blocks, cfg.block_size, cfg.prefix_caching);
        if !state_shapes.is_empty() {
            blocks = blocks.with_state_snapshots(snapshots);
        }
        let sched_cfg = SchedulerConfig {
            max_running: cfg.concurrent.max(1),
            max_waiting: usize::MAX,
            token_budget: cfg.prefill_step_size.max(1),
            // Half the budget per prefill chunk, so a request arriving behind a long prefill is
            // admitted in the same step instead of waiting for the whole prompt.
            max_prefill_chunk: (cfg.prefill_step_size / 2).max(1),
        };
        let (tx, rx) = mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(EngineMetrics::default());
        metrics
            .kv_blocks_total
            .store(num_blocks as u64, Ordering::Relaxed);
        metrics
            .kv_blocks_free
            .store(num_blocks as u64, Ordering::Relaxed);
        let engine = Engine {
            model,
            kv,
            scheduler: Scheduler::new(sched_cfg, blocks),
            active: HashMap::new(),
            rx,
            waiting: waiting.clone(),
            metrics: metrics.clone(),
            max_context,
            debug: cfg.debug,
            state_slots,
            device_decode,
            decode_overlap: cfg.decode_overlap,
            in_flight: None,
        };
        let thread = std::thread::Builder::new()
            .name("afm-engine".into())
            .spawn(move || engine.run())
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineHandle {
            thread: Arc::new(std::sync::Mutex::new(Some(thread))),
            tx,
            next_id: Arc::new(AtomicU64::new(1)),
            waiting,
            max_waiting: cfg.max_waiting,
            max_context,
            metrics,
            profile,
        })
    }

    fn run(mut self) {
        loop {
            if !self.scheduler.has_work() && self.in_flight.is_none() {
                // Idle: block until a command arrives; exit when every handle is gone.
                match self.rx.recv() {
                    Ok(Command::Shutdown) | Err(_) => return,
                    Ok(cmd) => self.handle(cmd),
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                if matches!(cmd, Command::Shutdown) {
                    return;
                }
                self.handle(cmd);
            }
            if self.scheduler.has_work() || self.in_flight.is_some() {
                self.step();
            }
            self.publish_gauges();
        }
    }

    fn publish_gauges(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let m = &self.metrics;
        m.num_running
            .store(self.scheduler.num_running() as u64, Relaxed);
        m.num_waiting
            .store(self.scheduler.num_waiting() as u64, Relaxed);
        m.batch_size_peak
            .fetch_max(self.scheduler.num_running() as u64, Relaxed);
        let blocks = self.scheduler.blocks();
        m.kv_blocks_total.store(blocks.num_blocks() as u64, Relaxed);
        m.kv_blocks_free.store(blocks.num_free() as u64, Relaxed);
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                id,
                req,
                tx,
                at,
                constraint,
            } => {
                let max_tokens = req
                    .max_tokens
                    .min(self.max_context - req.prompt_tokens.len());
                let seq = Sequence::new(id, req.prompt_tokens.clone(), max_tokens, id);
                if let Err(e) = self.scheduler.add(seq) {
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    let _ = tx.send(GenerateEvent::Error {
                        message: e.to_string(),
                    });
                    return;
                }
                let sampler = Sampler::new(req.sampling.clone());
                self.active.insert(
                    id,
                    Active {
                        tx,
                        sampler,
                        req,
                        arrived: at,
                        admitted: None,
                        first_token: None,
                        generated: 0,
                        constraint: constraint.map(Constrained::new),
                        state_slot: None,
                    },
                );
            }
            Command::Cancel(id) => self.finish(id, FinishReason::Cancelled),
            Command::Shutdown => {} // taken by `run` before it gets here
        }
    }

    fn step(&mut self) {
        if let Some(prev) = self.in_flight.take() {
            return self.continue_device_decode(prev);
        }
        let plan = self.scheduler.schedule();
        for id in &plan.preempted {
            // Recomputed from its first token later, into a fresh slot.
            if let Some(a) = self.active.get_mut(id) {
                a.state_slot = None;
            }
            self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
            if self.debug {
                eprintln!(
                    "[BatchScheduler] preempted request {id} (KV blocks exhausted; will recompute)"
                );
            }
        }
        if plan.items.is_empty() {
            return;
        }
        self.note_admissions(&plan);
        if self.step_on_device(&plan) {
            return;
        }
        let mut logits = match self.forward(&plan) {
            Ok(l) => l,
            Err(e) => return self.fail_step(&plan, &e),
        };
        let vocab = self.model.model.vocab_size();
        let mut sampled = Vec::new();
        let mut failed = Vec::new();
        for (row, item) in plan.items.iter().filter(|i| i.samples).enumerate() {
            let logits_row = &mut logits[row * vocab..(row + 1) * vocab];
            let Some(seq) = self.scheduler.get(item.seq_id) else {
                continue;
            };
            let Some(a) = self.active.get_mut(&item.seq_id) else {
                continue;
            };
            if let Some(c) = &mut a.constraint {
                if let Err(e) = c.apply(logits_row) {
                    failed.push((item.seq_id, e));
                    continue;
                }
            }
            let (tok, lp) = a
                .sampler
                .sample(logits_row, &seq.tokens, a.req.top_logprobs);
            if let Some(Err(e)) = a.constraint.as_mut().map(|c| c.commit(tok)) {
                failed.push((item.seq_id, e));
                continue;
            }
            sampled.push((item.seq_id, tok));
            a.first_token.get_or_insert_with(Instant::now);
            a.generated += 1;
            // A failed send means the caller went away; check_finished cancels it.
            let _ = a.tx.send(GenerateEvent::Token {
                id: tok,
                logprob: lp,
            });
        }
        let saves = self.scheduler.complete_step(&plan, &sampled);
        self.save_snapshots(&saves);
        for (id, e) in failed {
            self.fail_constraint(id, e);
        }
        for (id, tok) in sampled {
            self.check_finished(id, tok);
        }
    }

    fn note_admissions(&mut self, plan: &StepPlan) {
        for item in &plan.items {
            if let Some(a) = self.active.get_mut(&item.seq_id) {
                if a.admitted.is_none() {
                    a.admitted = Some(Instant::now());
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    if self.debug {
                        let cached = self
                            .scheduler
                            .get(item.seq_id)
                            .map_or(0, |s| s.cached_prompt_tokens);
                        eprintln!(
                            "[KVCache] request {}: prefix hit {cached}/{} tokens",
                            item.seq_id,
                            a.req.prompt_tokens.len()
                        );
                    }
                }
            }
        }
    }

    /// A forward that failed (a device error, or a step the cache cannot hold) ends the
    /// step's requests with the error; nothing of the step was published to the prefix cache.
    fn fail_step(&mut self, plan: &StepPlan, e: &ComputeError) {
        let message = format!("forward pass failed: {e}");
        eprintln!("[Engine] {message}");
        for item in &plan.items {
            self.scheduler.finish(item.seq_id);
            if let Some(a) = self.active.remove(&item.seq_id) {
                let _ = a.tx.send(GenerateEvent::Error {
                    message: message.clone(),
                });
            }
        }
    }

    fn forward(&mut self, plan: &StepPlan) -> Result<Vec<f32>, ComputeError> {
        let mut tokens = Vec::new();
        let mut chunks = Vec::with_capacity(plan.items.len());
        for item in &plan.items {
            let seq = self
                .scheduler
                .get(item.seq_id)
                .expect("planned sequences are live");
            tokens.extend_from_slice(&seq.tokens[item.start..item.start + item.len]);
        }
        let slots = self.state_slots_for(plan)?;
        for (item, state_slot) in plan.items.iter().zip(slots) {
            chunks.push(SeqChunk {
                len: item.len,
                pos0: item.start,
                block_table: &item.block_table,
                logits: item.samples,
                state_slot,
            });
        }
        let batch = ForwardBatch {
            tokens: &tokens,
            seqs: &chunks,
        };
        // On a pool thread, with the other workers kept polling: a decode step is dozens of
        // short matmuls, each shorter than waking a sleeping worker.
        let (model, kv) = (&self.model.model, &mut self.kv);
        afm_runtime::threads::install(|| model.forward(&batch, kv))
    }

    /// Each planned sequence's recurrent-state slot (hybrid models only): the one it holds, or a
    /// zeroed one for a sequence starting (or restarting after preemption).
    fn state_slots_for(&mut self, plan: &StepPlan) -> Result<Vec<Option<u32>>, ComputeError> {
        let Some(free) = &mut self.state_slots else {
            return Ok(vec![None; plan.items.len()]);
        };
        let mut ids = Vec::with_capacity(plan.items.len());
        for item in &plan.items {
            let Some(a) = self.active.get_mut(&item.seq_id) else {
                ids.push(None);
                continue;
            };
            if a.state_slot.is_none() {
                let slot = free.acquire().ok_or(ComputeError::Shape {
                    what: "free recurrent-state slots (one per running sequence)",
                    got: 0,
                    want: 1,
                })?;
                if let Some(states) = self.kv.states_mut() {
                    states.reset(slot.id())?;
                }
                a.state_slot = Some(slot);
            }
            let id = a.state_slot.as_ref().map(StateSlot::id);
            if let (Some(snap), Some(slot), Some(states)) = (item.restore, id, self.kv.states_mut())
            {
                // A prefix hit resumes from the state at its last block; the model checks
                // that the restored state holds exactly the chunk's first position.
                states.restore_snapshot(snap, slot)?;
                self.metrics.state_restores.fetch_add(1, Ordering::Relaxed);
            }
            ids.push(id);
        }
        Ok(ids)
    }

    /// Fills the snapshots `complete_step` attached to newly cached blocks from the states
    /// that just reached those blocks' ends; one that cannot be filled is given back unused.
    fn save_snapshots(&mut self, saves: &[SnapshotSave]) {
        for save in saves {
            let slot = self
                .active
                .get(&save.seq_id)
                .and_then(|a| a.state_slot.as_ref())
                .map(StateSlot::id);
            let saved = match (slot, self.kv.states_mut()) {
                (Some(slot), Some(states)) => states.save_snapshot(slot, save.snapshot),
                _ => Err(ComputeError::Shape {
                    what: "state slot of a sequence whose snapshot is due",
                    got: 0,
                    want: 1,
                }),
            };
            if let Err(e) = saved {
                eprintln!("[StateCache] snapshot {} not kept: {e}", save.snapshot);
                self.scheduler.discard_snapshot(save.snapshot);
            }
        }
    }

    /// A constraint that failed ends its request with an error event.
    fn fail_constraint(&mut self, id: RequestId, e: crate::constraint::ConstraintError) {
        self.scheduler.finish(id);
        if let Some(a) = self.active.remove(&id) {
            let _ = a.tx.send(GenerateEvent::Error {
                message: format!("grammar constraint: {e}"),
            });
        }
    }

    fn check_finished(&mut self, id: RequestId, tok: u32) {
        let Some(a) = self.active.get(&id) else {
            return;
        };
        if a.tx.is_closed() {
            return self.finish(id, FinishReason::Cancelled);
        }
        let grammar_done = a.constraint.as_ref().is_some_and(Constrained::is_finished);
        if a.req.stop_token_ids.contains(&tok) || grammar_done {
            self.finish(id, FinishReason::Stop);
        } else if let Some(seq) = self.scheduler.get(id) {
            if a.generated >= seq.max_tokens || seq.tokens.len() >= self.max_context {
                self.finish(id, FinishReason::Length);
            }
        }
    }

    /// Ends a request: frees its blocks, reports its stats. Unknown ids are ignored (already done).
    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let seq = self.scheduler.finish(id);
        let Some(a) = self.active.remove(&id) else {
            return;
        };
        if a.admitted.is_none() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        let now = Instant::now();
        let admitted = a.admitted.unwrap_or(now);
        let first = a.first_token.unwrap_or(now);
        let stats = GenerationStats {
            prompt_tokens: a.req.prompt_tokens.len(),
            cached_tokens: seq.map_or(0, |s| s.cached_prompt_tokens),
            completion_tokens: a.generated,
            queue_time: (admitted - a.arrived).as_secs_f64(),
            prompt_time: (first - admitted).as_secs_f64(),
            completion_time: (now - first).as_secs_f64(),
        };
        self.metrics.record(&stats);
        if let (true, Some(c)) = (self.debug, &a.constraint) {
            eprintln!(
                "[Grammar] request {id}: {} masks, {:.1} µs per token (mask + commit)",
                c.masks,
                c.spent.as_secs_f64() * 1e6 / (a.generated.max(1) as f64)
            );
        }
        if self.debug {
            let tps = if stats.completion_time > 0.0 {
                stats.completion_tokens as f64 / stats.completion_time
            } else {
                0.0
            };
            eprintln!(
                "[BatchScheduler] request {id} finished ({reason:?}): {} prompt ({} cached), {} generated, TTFT {:.1} ms, decode {tps:.1} tok/s",
                stats.prompt_tokens,
                stats.cached_tokens,
                stats.completion_tokens,
                (stats.queue_time + stats.prompt_time) * 1e3
            );
        }
        let _ = a.tx.send(GenerateEvent::Finished { reason, stats });
    }
}

/// Recurrent-state slots for hybrid models, one per sequence that can run at once, and the
/// prefix cache's state snapshots.
fn attach_state_pool(
    kv: &mut KvPool,
    shapes: &[LayerStateShape],
    slots: usize,
    snapshots: usize,
) -> Option<StateSlots> {
    if shapes.is_empty() {
        return None;
    }
    kv.attach_states(StatePool::with_snapshots(shapes, slots, snapshots));
    let mib = StatePool::bytes_per_slot(shapes) as f64 / (1 << 20) as f64;
    eprintln!(
        "[StateCache] {slots} recurrent-state slots × {mib:.1} MiB ({} recurrent layers, host memory)",
        shapes.len()
    );
    if snapshots > 0 {
        eprintln!(
            "[StateCache] {snapshots} prefix-cache state snapshots × {mib:.1} MiB ({:.1} MiB): a cached prefix resumes at the last block boundary holding one",
            snapshots as f64 * mib
        );
    } else {
        eprintln!("[StateCache] prefix caching off: no memory for a recurrent-state snapshot, and a cached prefix cannot resume without one");
    }
    Some(StateSlots::new(slots))
}

/// Snapshots for a hybrid model's prefix cache (0 for other models or without caching): the
/// configured count, else what a quarter of the KV budget (at most an eighth of host memory)
/// holds, never more than one per KV block (each belongs to a cached block).
fn state_snapshot_count(
    cfg: &EngineConfig,
    shapes: &[LayerStateShape],
    kv_budget: usize,
    num_blocks: usize,
) -> usize {
    if shapes.is_empty() || !cfg.prefix_caching {
        return 0;
    }
    let per = StatePool::bytes_per_slot(shapes).max(1);
    let auto = || (kv_budget / 4).min(available_memory() / 8) / per;
    cfg.state_snapshots.unwrap_or_else(auto).min(num_blocks)
}

/// On a GPU: 90% of the memory free after the weights, less 1 GiB for activations and
/// kernel scratch. On the CPU: a quarter of available memory, at most 4 GiB (pages are touched
/// only when used).
fn default_kv_budget(device: &Device) -> Result<usize, ComputeError> {
    if let Some((free, _total)) = device.memory()? {
        return Ok(free.saturating_sub(1 << 30) / 10 * 9);
    }
    Ok((available_memory() / 4).min(4 << 30))
}

/// Memory the KV pool may take a share of (`--kv-memory 0.25`): free device memory less 1 GiB
/// of kernel scratch on a GPU, `MemAvailable` on the CPU.
fn memory_for_kv(device: &Device) -> Result<usize, ComputeError> {
    Ok(match device.memory()? {
        Some((free, _total)) => free.saturating_sub(1 << 30),
        None => available_memory(),
    })
}

/// `MemAvailable` from /proc/meminfo (8 GiB where it cannot be read).
fn available_memory() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map_or(8 << 30, |kb| kb * 1024)
}
