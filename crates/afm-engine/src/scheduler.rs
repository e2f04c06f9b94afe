//! The token-counting scheduler: owns every live [`Sequence`] and the [`BlockManager`], and
//! plans each step as "compute these token ranges of these sequences" under a token budget.
//! There are no prefill or decode phases: a sequence simply has tokens not yet in the cache,
//! so decode, chunked prefill, prefix-cache hits and recompute after preemption are one path.
//! It runs no model and samples nothing; the engine loop does, then calls `complete_step`.
//!
//! ```text
//!  one step, token_budget = 8, max_prefill_chunk = 4:
//!   running A (decoding)      [A]                        1 token, samples
//!   running B (prefilling)       [B B B B]               chunk of a long prompt, no sample
//!   waiting C (new, short)                [C C C]        admitted, reaches its end: samples
//!  order: decodes, then continuing prefills, then FIFO admissions; oldest first within each.
//! ```
//!
//! Priority is admission order (FIFO rank). When blocks run out, the newest running sequence is
//! preempted by recompute: its blocks are released and it goes back to the front of the waiting
//! queue with its tokens (prompt and generated) intact. The oldest running sequence can always
//! grow, because `add` refuses sequences larger than the whole pool, so every sequence finishes.
//!
//! Hybrid models (recurrent state, see `kv_blocks`) resume a hit only from a state snapshot,
//! and the state exists only at the end of a chunk. So a chunk is cut short at the block
//! boundaries where a snapshot is wanted, and `complete_step` names the snapshots to fill:
//!
//! ```text
//!  prompt of 40, block 16:  [0 ........ 32) [32 .. 40)   snapshot at 32, the prompt's last
//!                                                        boundary (a resent or extended
//!                                                        prompt resumes there)
//!  hit of 16 whose cached
//!  K/V chain went on to 48: restore@16 [16 .. 48) [48 ..)   snapshot at 48, where the chain
//!                                                        parted (the next request resumes there)
//! ```

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::kv_blocks::{BlockId, BlockManager, SnapshotId};
use crate::sequence::{SeqState, Sequence};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences holding KV at once (`--concurrent`).
    pub max_running: usize,
    /// Requests queued for admission; beyond it `add` answers `QueueFull` (HTTP 429).
    pub max_waiting: usize,
    /// Tokens computed per step, all sequences together (`--prefill-step-size`).
    pub token_budget: usize,
    /// Most tokens one sequence computes per step, so a long prompt leaves room for others.
    pub max_prefill_chunk: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_running: 8,
            max_waiting: 256,
            token_budget: 1024,
            max_prefill_chunk: 512,
        }
    }
}

/// Why `add` refused a sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error(
        "waiting queue is full: {waiting} requests waiting, limit max_waiting = {max_waiting}"
    )]
    QueueFull { waiting: usize, max_waiting: usize },
    #[error(
        "request {id} needs up to {tokens} KV tokens (prompt + max_tokens - 1), \
         but the KV cache holds {capacity} tokens in all"
    )]
    TooLong {
        id: u64,
        tokens: usize,
        capacity: usize,
    },
    #[error("request {id}: prompt_tokens is empty; at least 1 token is required")]
    EmptyPrompt { id: u64 },
    #[error("request {id}: max_tokens = 0; at least 1 is required")]
    ZeroMaxTokens { id: u64 },
    #[error("request {id} is already scheduled")]
    DuplicateId { id: u64 },
}

/// One sequence's share of a step: compute positions `start..start + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepItem {
    pub seq_id: u64,
    /// First position computed this step (= the sequence's `num_computed`).
    pub start: usize,
    pub len: usize,
    /// Covers positions `0..start + len`; valid for this step only.
    pub block_table: Vec<BlockId>,
    /// This chunk reaches the last known token, so the runner samples a next token.
    pub samples: bool,
    /// Hybrid models: load the sequence's recurrent state from this snapshot before the chunk
    /// (a prefix hit; the snapshot holds the state after `start` tokens).
    pub restore: Option<SnapshotId>,
}

/// A state snapshot to fill from a sequence's state right after the step that planned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotSave {
    pub seq_id: u64,
    pub snapshot: SnapshotId,
}

/// The plain data the engine loop hands to the model runner.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub items: Vec<StepItem>,
    /// Sequences preempted while planning (blocks released, back in the waiting queue).
    pub preempted: Vec<u64>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// A plan under construction and the budget it has left.
struct Step {
    plan: StepPlan,
    budget: usize,
}

/// (FIFO rank, sequence id): ordering by it puts the oldest admitted request first.
type Ranked = (u64, u64);

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    seqs: HashMap<u64, Sequence>,
    waiting: VecDeque<Ranked>,
    running: BTreeSet<Ranked>,
    next_rank: u64,
}

impl Scheduler {
    /// Limits are validated at the CLI; zeros are raised to 1 so the scheduler always progresses.
    pub fn new(cfg: SchedulerConfig, blocks: BlockManager) -> Self {
        let cfg = SchedulerConfig {
            max_running: cfg.max_running.max(1),
            max_waiting: cfg.max_waiting.max(1),
            token_budget: cfg.token_budget.max(1),
            max_prefill_chunk: cfg.max_prefill_chunk.max(1),
        };
        Self {
            cfg,
            blocks,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: BTreeSet::new(),
            next_rank: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queue `seq` for admission (FIFO). Refuses sequences that could never fit the pool.
    pub fn add(&mut self, mut seq: Sequence) -> Result<(), AddError> {
        let id = seq.id;
        if seq.tokens.is_empty() {
            return Err(AddError::EmptyPrompt { id });
        }
        if seq.max_tokens == 0 {
            return Err(AddError::ZeroMaxTokens { id });
        }
        if self.seqs.contains_key(&id) {
            return Err(AddError::DuplicateId { id });
        }
        let tokens = seq.max_kv_tokens().max(seq.len());
        let capacity = self.blocks.num_blocks() * self.blocks.block_size();
        if tokens > capacity {
            return Err(AddError::TooLong {
                id,
                tokens,
                capacity,
            });
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            let (waiting, max_waiting) = (self.waiting.len(), self.cfg.max_waiting);
            return Err(AddError::QueueFull {
                waiting,
                max_waiting,
            });
        }
        // A table the caller filled refers to no references we hold.
        seq.block_table.clear();
        seq.num_computed = 0;
        seq.state = SeqState::Waiting;
        self.waiting.push_back((self.next_rank, id));
        self.next_rank += 1;
        self.seqs.insert(id, seq);
        Ok(())
    }

    /// Plan one step: decodes of running sequences, then their prefill chunks, then FIFO
    /// admissions, all under `token_budget`. Preempts (newest first) when blocks run out.
    pub fn schedule(&mut self) -> StepPlan {
        let mut step = Step {
            plan: StepPlan::default(),
            budget: self.cfg.token_budget,
        };
        let order: Vec<u64> = self.running.iter().map(|&(_, id)| id).collect();
        let remaining = |s: &Self, id: &u64| s.seqs.get(id).map_or(0, Sequence::tokens_to_compute);
        for id in &order {
            if remaining(self, id) == 1 {
                self.schedule_running(*id, &mut step);
            }
        }
        for id in &order {
            if remaining(self, id) > 1 {
                self.schedule_running(*id, &mut step);
            }
        }
        self.admit_waiting(&mut step);
        step.plan
    }

    /// Give running sequence `id` its next chunk, shrinking it to the free blocks, or preempting
    /// newer sequences when not even one token fits. The newest one just waits with its blocks.
    fn schedule_running(&mut self, id: u64, step: &mut Step) {
        loop {
            let Some(seq) = self.seqs.get(&id).filter(|s| s.state == SeqState::Running) else {
                return;
            };
            let want = seq
                .tokens_to_compute()
                .min(self.cfg.max_prefill_chunk)
                .min(step.budget);
            if want == 0 {
                return;
            }
            let slots = (seq.block_table.len() + self.blocks.num_free()) * self.blocks.block_size();
            let fit = slots.saturating_sub(seq.num_computed);
            if fit > 0 {
                self.grow_and_plan(id, want.min(fit), step, None);
                return;
            }
            match self.running.last() {
                Some(&(_, newest)) if newest != id => self.preempt(newest, step),
                _ => return,
            }
        }
    }

    /// Grow `id`'s table for up to `len` more tokens (the caller checked they fit) and add its
    /// item, cut at a wanted snapshot boundary.
    fn grow_and_plan(&mut self, id: u64, len: usize, step: &mut Step, restore: Option<SnapshotId>) {
        let seq = self.seqs.get_mut(&id).expect("caller found this sequence");
        let len = snapshot_cut(&self.blocks, seq, len);
        let end = seq.num_computed + len;
        self.blocks
            .grow(&mut seq.block_table, end)
            .expect("caller checked the blocks fit");
        step.budget -= len;
        step.plan.items.push(StepItem {
            seq_id: id,
            start: seq.num_computed,
            len,
            block_table: seq.block_table.clone(),
            samples: end == seq.len(),
            restore,
        });
    }

    /// Recompute-preemption: release `id`'s blocks and requeue it at the front, tokens kept.
    fn preempt(&mut self, id: u64, step: &mut Step) {
        let Some(key) = self.running.iter().copied().find(|&(_, r)| r == id) else {
            return;
        };
        self.running.remove(&key);
        let seq = self
            .seqs
            .get_mut(&id)
            .expect("running ids are live sequences");
        self.blocks.release(&mut seq.block_table);
        seq.num_computed = 0;
        seq.state = SeqState::Waiting;
        seq.num_preemptions += 1;
        self.waiting.push_front(key);
        // Its chunk may already be planned this step; the budget comes back.
        if let Some(pos) = step.plan.items.iter().position(|it| it.seq_id == id) {
            step.budget += step.plan.items.remove(pos).len;
        }
        step.plan.preempted.push(id);
    }

    /// Admit waiting sequences in FIFO order while slots, budget and blocks allow; the first one
    /// that does not fit stops admission so nobody overtakes it.
    fn admit_waiting(&mut self, step: &mut Step) {
        while step.budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(&(rank, id)) = self.waiting.front() else {
                return;
            };
            // Re-admitting a victim in the step that preempted it would undo the preemption.
            if step.plan.preempted.contains(&id) {
                return;
            }
            let seq = &self.seqs[&id];
            let hit = self.blocks.find_prefix(&seq.tokens);
            let len = (seq.len() - hit.tokens)
                .min(self.cfg.max_prefill_chunk)
                .min(step.budget);
            let new_blocks = self.blocks.blocks_for(hit.tokens + len) - hit.blocks.len();
            let done = seq.reached_max_tokens();
            if !done && new_blocks + hit.idle_blocks > self.blocks.num_free() {
                return;
            }
            self.waiting.pop_front();
            self.running.insert((rank, id));
            let seq = self
                .seqs
                .get_mut(&id)
                .expect("waiting ids are live sequences");
            seq.state = SeqState::Running;
            if done {
                // Nothing to compute; it only waits for the engine's `finish`.
                continue;
            }
            let hit = self.blocks.acquire_prefix(&seq.tokens);
            seq.block_table = hit.blocks;
            seq.num_computed = hit.tokens;
            seq.snapshot_at = (hit.kv_tokens > hit.tokens).then_some(hit.kv_tokens);
            if seq.num_preemptions == 0 {
                seq.cached_prompt_tokens = hit.tokens.min(seq.prompt_len);
            }
            self.grow_and_plan(id, len, step, hit.snapshot);
        }
    }

    /// Apply a finished step: advance `num_computed` by each item's length, publish newly full
    /// blocks, append each sampled token. Items of sequences finished meanwhile are skipped.
    /// Returns the state snapshots to fill now, before the next step moves the states on.
    pub fn complete_step(&mut self, plan: &StepPlan, sampled: &[(u64, u32)]) -> Vec<SnapshotSave> {
        let mut saves = Vec::new();
        for item in &plan.items {
            let Some(seq) = self.seqs.get_mut(&item.seq_id) else {
                continue;
            };
            if seq.state != SeqState::Running || seq.num_computed != item.start {
                continue;
            }
            let end = (item.start + item.len).min(seq.len());
            let token = sampled
                .iter()
                .find(|(id, _)| *id == item.seq_id)
                .map(|&(_, t)| t);
            let token = token.filter(|_| item.samples);
            // Without a sampled token the last position is computed again next step, which
            // samples again, instead of leaving the sequence with nothing to compute.
            seq.num_computed = if item.samples && token.is_none() {
                end - 1
            } else {
                end
            };
            self.blocks
                .publish_full_blocks(&seq.block_table, &seq.tokens, seq.num_computed);
            // The model's state holds the whole chunk; a recomputed last position does not count.
            let in_state = item.start + item.len;
            if seq.num_computed == in_state && snapshot_wanted(&self.blocks, seq, in_state) {
                if let Some(snapshot) = self.blocks.attach_snapshot(&seq.block_table, in_state) {
                    saves.push(SnapshotSave {
                        seq_id: seq.id,
                        snapshot,
                    });
                }
            }
            if let Some(t) = token {
                seq.tokens.push(t);
            }
        }
        saves
    }

    /// The decode step after `prev` while `prev`'s sampled tokens are still on the device (the
    /// engine's decode overlap): every item one position further, its table grown to hold it.
    /// The caller completes `prev` before this plan; an item whose sequence finished with
    /// `prev`'s token is then skipped by `complete_step`, its computed position discarded.
    ///
    /// `None`, changing nothing, unless: nobody waiting could be admitted now (a slot is free
    /// and someone waits: they would wait a step longer; with every slot busy they wait
    /// anyway); every item of `prev` is a one-token decode that samples, of a sequence still
    /// running and not completed past it; none reaches its token limit with `prev`'s token;
    /// the new blocks fit without preempting; and no state snapshots are kept (hybrid models).
    pub fn plan_continuation(&mut self, prev: &StepPlan) -> Option<StepPlan> {
        let admissible = !self.waiting.is_empty() && self.running.len() < self.cfg.max_running;
        if admissible
            || prev.items.is_empty()
            || prev.items.len() > self.cfg.token_budget
            || self.blocks.needs_snapshots()
        {
            return None;
        }
        let mut needed = 0;
        for item in &prev.items {
            let seq = self.seqs.get(&item.seq_id)?;
            let decodes = item.len == 1 && item.samples && seq.len() == item.start + 1;
            if seq.state != SeqState::Running
                || !decodes
                || seq.num_computed != item.start
                || seq.num_generated() + 1 >= seq.max_tokens
            {
                return None;
            }
            needed += self
                .blocks
                .blocks_for(item.start + 2)
                .saturating_sub(seq.block_table.len());
        }
        if needed > self.blocks.num_free() {
            return None;
        }
        let mut plan = StepPlan::default();
        for item in &prev.items {
            let seq = self.seqs.get_mut(&item.seq_id).expect("checked above");
            self.blocks
                .grow(&mut seq.block_table, item.start + 2)
                .expect("counted above");
            plan.items.push(StepItem {
                seq_id: item.seq_id,
                start: item.start + 1,
                len: 1,
                block_table: seq.block_table.clone(),
                samples: true,
                restore: None,
            });
        }
        Some(plan)
    }

    /// Frees a snapshot that `complete_step` named but whose state could not be saved.
    pub fn discard_snapshot(&mut self, snapshot: SnapshotId) {
        self.blocks.discard_snapshot(snapshot);
    }

    /// Remove `id` (waiting or running), release its blocks and return it marked `Finished`.
    /// Also the path for cancel and abort.
    pub fn finish(&mut self, id: u64) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&id)?;
        self.waiting.retain(|&(_, w)| w != id);
        self.running.retain(|&(_, r)| r != id);
        self.blocks.release(&mut seq.block_table);
        seq.state = SeqState::Finished;
        Some(seq)
    }

    pub fn get(&self, id: u64) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    /// Every live sequence, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.values()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }
}

/// Block boundaries of `seq` where its state is worth a snapshot: the end of the prompt's last
/// full block, and where the cached K/V chain found at admission parted from it.
fn snapshot_boundaries(blocks: &BlockManager, seq: &Sequence) -> [Option<usize>; 2] {
    let bs = blocks.block_size();
    let prompt_end = Some(seq.prompt_len / bs * bs).filter(|&b| b > 0);
    [prompt_end, seq.snapshot_at]
}

fn snapshot_wanted(blocks: &BlockManager, seq: &Sequence, at: usize) -> bool {
    blocks.needs_snapshots() && snapshot_boundaries(blocks, seq).contains(&Some(at))
}

/// `len` shortened so the chunk ends at the first wanted snapshot boundary inside it, since a
/// recurrent state exists only at a chunk's end. Unchanged without snapshots.
fn snapshot_cut(blocks: &BlockManager, seq: &Sequence, len: usize) -> usize {
    if !blocks.needs_snapshots() {
        return len;
    }
    let start = seq.num_computed;
    snapshot_boundaries(blocks, seq)
        .into_iter()
        .flatten()
        .filter(|&b| b > start && b < start + len)
        .min()
        .map_or(len, |b| b - start)
}

#[cfg(test)]
mod tests;
