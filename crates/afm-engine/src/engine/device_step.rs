//! Decode steps on a GPU: the forward through a CUDA graph of the batch's bucket (captured at
//! start-up with `--prewarm y`, else on first use) and sampling on the device, so only token
//! ids cross to the host. Steps this path does not serve fall back to the host path in
//! `engine.rs`: prefill or mixed chunks, more sequences than the largest bucket, a request with
//! a token constraint (grammar). Requests that need host-only processing (log-probabilities)
//! are sampled on the host from their downloaded row, inside the same step.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use afm_models::{ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::attention::AttnSeq;
use afm_runtime::compute::{ComputeError, DeviceLogits, DeviceSample, KvPool};
use afm_runtime::compute::{SampledIds, StepTokens};

use super::{Engine, EngineConfig};
use crate::api::{GenerateEvent, TokenLogprob};
use crate::scheduler::StepPlan;

/// The model's forward as a decode graph calls it.
fn forward_fn<'m>(
    model: &'m LoadedModel,
) -> impl for<'a> FnMut(&[u32], &[AttnSeq<'a>], &mut KvPool) -> Result<Vec<f32>, ComputeError> + 'm
{
    move |tokens, seqs, kv| {
        let chunks: Vec<SeqChunk> = seqs
            .iter()
            .map(|s| SeqChunk {
                state_slot: None,
                len: s.len,
                pos0: s.pos0,
                block_table: s.block_table,
                logits: true,
            })
            .collect();
        model.model.forward(
            &ForwardBatch {
                tokens,
                seqs: &chunks,
            },
            kv,
        )
    }
}

/// Turns device decoding on when the model's device supports graphs and the config asks for
/// it; with `--prewarm y`, captures every graph now and logs how long that took.
pub(super) fn prepare(
    model: &LoadedModel,
    kv: &mut KvPool,
    cfg: &EngineConfig,
    max_context: usize,
) -> bool {
    let dev = &model.device;
    if !cfg.device_decode || !dev.supports_graphs() {
        return false;
    }
    let vocab = model.model.vocab_size();
    if let Err(e) = dev.enable_graphs(cfg.concurrent, max_context, vocab, cfg.block_size) {
        eprintln!("[CUDA] decode graphs off: {e}");
        return false;
    }
    if cfg.prewarm {
        let t = Instant::now();
        match dev.prewarm_graphs(kv, &mut forward_fn(model)) {
            Ok((n, _)) => eprintln!(
                "[Prewarm] {n} CUDA graphs captured (decode batches up to {}, context up to {max_context}) in {:.0} ms",
                cfg.concurrent.min(64),
                t.elapsed().as_secs_f64() * 1e3
            ),
            Err(e) => {
                eprintln!("[CUDA] graph prewarm failed ({e}); decode steps run without graphs");
                return false;
            }
        }
    }
    true
}

/// A device decode step launched with its sampling, whose ids are still on their way to the
/// host (the decode overlap): the engine launches the step after it, then reads them.
pub(super) struct InFlight {
    plan: StepPlan,
    ids: SampledIds,
}

impl Engine {
    /// Runs `plan` as a device decode step if it is one; `false` leaves it to the host path.
    /// With the decode overlap, a step whose rows all sample on the device is left in flight:
    /// the next `step` continues from it.
    pub(super) fn step_on_device(&mut self, plan: &StepPlan) -> bool {
        if !self.device_decode
            || plan.items.is_empty()
            || plan.items.iter().any(|i| i.len != 1 || !i.samples)
            || plan.items.iter().any(|i| self.host_only(i.seq_id))
        {
            return false;
        }
        let mut tokens = Vec::with_capacity(plan.items.len());
        for item in &plan.items {
            let Some(seq) = self.scheduler.get(item.seq_id) else {
                return false;
            };
            tokens.push(seq.tokens[item.start]);
        }
        let logits = match self.graph_step(plan, StepTokens::Host(&tokens)) {
            Ok(Some(l)) => {
                self.metrics.device_decode_steps.fetch_add(1, Relaxed);
                l
            }
            Ok(None) => return false,
            Err(e) => {
                self.fail_step(plan, &e);
                return true;
            }
        };
        if self.overlappable(plan) {
            match self.start_sampling(plan, &logits) {
                Ok(ids) => {
                    self.in_flight = Some(InFlight {
                        plan: plan.clone(),
                        ids,
                    });
                }
                Err(e) => self.fail_step(plan, &e),
            }
            return true;
        }
        match self.sample_on_device(plan, &logits) {
            Ok(chosen) => self.publish(plan, chosen),
            Err(e) => self.fail_step(plan, &e),
        }
        true
    }

    /// The step after `prev` from `prev`'s sampled ids, its forward launched before reading
    /// them (when the scheduler can plan it: see `Scheduler::plan_continuation`), then `prev`
    /// completed, then the step's sampling queued behind its forward. So while the host
    /// publishes `prev`'s tokens the device already computes the next step, and the sampling
    /// still sees every token before it (penalties). A row whose request ends with `prev`'s
    /// token computes one position for nothing.
    pub(super) fn continue_device_decode(&mut self, prev: InFlight) {
        let next = if self.overlappable(&prev.plan) {
            self.scheduler.plan_continuation(&prev.plan)
        } else {
            None
        };
        // Launched (Ok(Some)), not served by a graph (Ok(None): the plan's grown tables stay
        // with their sequences and the next schedule plans the same positions), or failed
        // (reported after `prev` is complete, which it is not part of).
        let launched = next.map(|plan| {
            let ran = self.graph_step(&plan, StepTokens::Sampled(&prev.ids));
            (plan, ran)
        });
        match self.model.device.sampled_ids(&prev.ids) {
            Ok(ids) => {
                let chosen = ids.into_iter().map(|t| (t, None)).collect::<Vec<_>>();
                for (item, (tok, _)) in prev.plan.items.iter().zip(&chosen) {
                    if let Some(a) = self.active.get_mut(&item.seq_id) {
                        a.sampler.accept(*tok);
                    }
                }
                self.publish(&prev.plan, chosen);
            }
            Err(e) => self.fail_step(&prev.plan, &e),
        }
        let (plan, logits) = match launched {
            Some((plan, Ok(Some(logits)))) => (plan, logits),
            Some((plan, Err(e))) => return self.fail_step(&plan, &e),
            Some((_, Ok(None))) | None => return,
        };
        match self.start_sampling(&plan, &logits) {
            Ok(ids) => {
                self.metrics.device_decode_steps.fetch_add(1, Relaxed);
                self.metrics.overlapped_decode_steps.fetch_add(1, Relaxed);
                self.in_flight = Some(InFlight { plan, ids });
            }
            Err(e) => self.fail_step(&plan, &e),
        }
    }

    /// Whether the step after `plan` may be launched before `plan`'s tokens are read: the
    /// overlap is on and every row samples on the device (no log-probabilities, no grammar).
    fn overlappable(&self, plan: &StepPlan) -> bool {
        self.decode_overlap
            && plan.items.iter().all(|i| {
                self.active
                    .get(&i.seq_id)
                    .is_some_and(|a| a.constraint.is_none() && a.req.top_logprobs.is_none())
            })
    }

    /// `plan` through its decode graph, the logits left on the device; `None`: no graph
    /// serves it.
    fn graph_step(
        &mut self,
        plan: &StepPlan,
        tokens: StepTokens,
    ) -> Result<Option<DeviceLogits>, ComputeError> {
        let seqs: Vec<AttnSeq> = plan
            .items
            .iter()
            .enumerate()
            .map(|(i, item)| AttnSeq {
                row0: i,
                len: 1,
                pos0: item.start,
                block_table: &item.block_table,
            })
            .collect();
        let dev = self.model.device.clone();
        let mut forward = forward_fn(&self.model);
        dev.graph_decode(tokens, &seqs, &mut self.kv, &mut forward)
    }

    /// Queues the sampling of every row of an overlappable `plan` on the device, from each
    /// request's tokens so far.
    fn start_sampling(
        &mut self,
        plan: &StepPlan,
        logits: &DeviceLogits,
    ) -> Result<SampledIds, ComputeError> {
        let mut rows = Vec::with_capacity(plan.items.len());
        for item in &plan.items {
            let seq = self.scheduler.get(item.seq_id);
            let a = self.active.get_mut(&item.seq_id);
            let row = match (seq, a) {
                (Some(seq), Some(a)) => a.sampler.device_sample(&seq.tokens, None),
                _ => None,
            };
            rows.push(row.unwrap_or_default());
        }
        self.model.device.sample_device_start(logits, &rows)
    }

    /// A request whose every token needs the host path (a token constraint masks logits there).
    fn host_only(&self, id: crate::api::RequestId) -> bool {
        self.active.get(&id).is_some_and(|a| a.constraint.is_some())
    }

    /// One token per planned row: device sampling where the sampler allows, the host's
    /// sampler on the downloaded row where it does not.
    fn sample_on_device(
        &mut self,
        plan: &StepPlan,
        logits: &DeviceLogits,
    ) -> Result<Vec<(u32, Option<TokenLogprob>)>, ComputeError> {
        let dev = self.model.device.clone();
        let mut rows = Vec::with_capacity(plan.items.len());
        let mut host = Vec::new();
        for (i, item) in plan.items.iter().enumerate() {
            let seq = self.scheduler.get(item.seq_id);
            let a = self.active.get_mut(&item.seq_id);
            let row = match (seq, a) {
                (Some(seq), Some(a)) => a.sampler.device_sample(&seq.tokens, a.req.top_logprobs),
                _ => Some(DeviceSample::default()),
            };
            match row {
                Some(r) => rows.push(r),
                None => {
                    // Read before device sampling adjusts the logits in place.
                    host.push((i, dev.device_logits_row(logits, i)?));
                    rows.push(DeviceSample::default());
                }
            }
        }
        let ids = if host.len() < rows.len() {
            dev.sample_device(logits, &rows)?
        } else {
            vec![0; rows.len()]
        };
        let mut chosen: Vec<(u32, Option<TokenLogprob>)> =
            ids.into_iter().map(|t| (t, None)).collect();
        for (i, item) in plan.items.iter().enumerate() {
            if let Some(a) = self.active.get_mut(&item.seq_id) {
                if !host.iter().any(|(h, _)| *h == i) {
                    a.sampler.accept(chosen[i].0);
                }
            }
        }
        for (i, mut row) in host {
            let item = &plan.items[i];
            let (Some(seq), Some(a)) = (
                self.scheduler.get(item.seq_id),
                self.active.get_mut(&item.seq_id),
            ) else {
                continue;
            };
            chosen[i] = a.sampler.sample(&mut row, &seq.tokens, a.req.top_logprobs);
        }
        Ok(chosen)
    }

    /// Sends each row's token to its request and completes the step, as the host path does.
    fn publish(&mut self, plan: &StepPlan, chosen: Vec<(u32, Option<TokenLogprob>)>) {
        let mut sampled = Vec::with_capacity(chosen.len());
        for (item, (tok, lp)) in plan.items.iter().zip(chosen) {
            let Some(a) = self.active.get_mut(&item.seq_id) else {
                continue;
            };
            sampled.push((item.seq_id, tok));
            a.first_token.get_or_insert_with(Instant::now);
            a.generated += 1;
            // A failed send means the caller went away; check_finished cancels it.
            let _ = a.tx.send(GenerateEvent::Token {
                id: tok,
                logprob: lp,
            });
        }
        // Graph decode serves attention-only models, which keep no state snapshots.
        let saves = self.scheduler.complete_step(plan, &sampled);
        self.save_snapshots(&saves);
        for (id, tok) in sampled {
            self.check_finished(id, tok);
        }
    }
}
