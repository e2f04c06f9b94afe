//! Decode steps on a GPU: the forward through a CUDA graph of the batch's bucket (captured at
//! start-up with `--prewarm y`, else on first use) and sampling on the device, so only token
//! ids cross to the host. Steps this path does not serve fall back to the host path in
//! `engine.rs`: prefill or mixed chunks, more sequences than the largest bucket, a request with
//! a token constraint (grammar). Requests that need host-only processing (log-probabilities)
//! are sampled on the host from their downloaded row, inside the same step.

use std::time::Instant;

use afm_models::{ForwardBatch, LoadedModel, SeqChunk};
use afm_runtime::attention::AttnSeq;
use afm_runtime::compute::{ComputeError, DeviceSample, KvPool};

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

impl Engine {
    /// Runs `plan` as a device decode step if it is one; `false` leaves it to the host path.
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
        let ran = dev.graph_decode(&tokens, &seqs, &mut self.kv, &mut forward);
        drop(forward);
        let logits = match ran {
            Ok(Some(l)) => l,
            Ok(None) => return false,
            Err(e) => {
                self.fail_step(plan, &e);
                return true;
            }
        };
        match self.sample_on_device(plan, &logits) {
            Ok(chosen) => self.publish(plan, chosen),
            Err(e) => self.fail_step(plan, &e),
        }
        true
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
        logits: &afm_runtime::compute::DeviceLogits,
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
