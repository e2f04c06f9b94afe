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
mod tests {
    use super::*;

    /// Stand-in for the model: the next token is a function of the whole sequence, so any
    /// corruption of token state shows up as a different continuation.
    fn next_token(tokens: &[u32]) -> u32 {
        tokens
            .iter()
            .fold(7u32, |h, &t| h.wrapping_mul(31).wrapping_add(t))
            % 97
    }

    /// The engine loop around the scheduler: schedule, "run", complete, finish at max_tokens.
    struct Engine {
        s: Scheduler,
        done: HashMap<u64, Sequence>,
    }

    impl Engine {
        fn new(num_blocks: usize, block_size: usize, cfg: SchedulerConfig) -> Self {
            let blocks = BlockManager::new(num_blocks, block_size, true);
            Self {
                s: Scheduler::new(cfg, blocks),
                done: HashMap::new(),
            }
        }

        fn add(&mut self, id: u64, prompt: Vec<u32>, max_tokens: usize) {
            self.s
                .add(Sequence::new(id, prompt, max_tokens, id))
                .unwrap();
        }

        fn step(&mut self) -> StepPlan {
            let plan = self.s.schedule();
            assert!(plan.num_tokens() <= self.s.config().token_budget);
            let sampled: Vec<(u64, u32)> = plan
                .items
                .iter()
                .filter(|i| i.samples)
                .map(|i| (i.seq_id, next_token(&self.s.get(i.seq_id).unwrap().tokens)))
                .collect();
            self.s.complete_step(&plan, &sampled);
            let ended: Vec<u64> = self
                .s
                .iter()
                .filter(|q| q.reached_max_tokens())
                .map(|q| q.id)
                .collect();
            for id in ended {
                self.done.insert(id, self.s.finish(id).unwrap());
            }
            plan
        }

        fn run_to_end(&mut self) {
            for _ in 0..10_000 {
                if !self.s.has_work() {
                    assert_eq!(
                        self.s.blocks().stats().blocks_used,
                        0,
                        "a finished run holds no block"
                    );
                    return;
                }
                self.step();
            }
            panic!("sequences did not finish");
        }
    }

    fn cfg(max_running: usize, token_budget: usize, max_prefill_chunk: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_running,
            max_waiting: 64,
            token_budget,
            max_prefill_chunk,
        }
    }

    fn ids(plan: &StepPlan) -> Vec<(u64, usize, usize)> {
        plan.items
            .iter()
            .map(|i| (i.seq_id, i.start, i.len))
            .collect()
    }

    #[test]
    fn admits_in_fifo_order_up_to_max_running() {
        let mut e = Engine::new(64, 4, cfg(2, 100, 100));
        for id in 1..=3 {
            e.add(id, vec![id as u32; 4], 10);
        }
        assert_eq!(ids(&e.step()), vec![(1, 0, 4), (2, 0, 4)]);
        assert_eq!((e.s.num_running(), e.s.num_waiting()), (2, 1));
        e.s.finish(1).unwrap();
        assert_eq!(
            ids(&e.step()),
            vec![(2, 4, 1), (3, 0, 4)],
            "decode first, then admission"
        );
    }

    #[test]
    fn full_queue_is_refused_with_its_limit() {
        let mut e = Engine::new(
            64,
            4,
            SchedulerConfig {
                max_waiting: 2,
                ..cfg(1, 100, 100)
            },
        );
        e.add(1, vec![1], 5);
        e.add(2, vec![2], 5);
        let err = e.s.add(Sequence::new(3, vec![3], 5, 3)).unwrap_err();
        assert_eq!(
            err,
            AddError::QueueFull {
                waiting: 2,
                max_waiting: 2
            }
        );
        assert!(err.to_string().contains("max_waiting = 2"));
        e.step(); // admits 1, freeing a queue place
        e.add(3, vec![3], 5);
    }

    #[test]
    fn requests_larger_than_the_pool_are_refused_not_hung() {
        let mut e = Engine::new(4, 4, cfg(4, 100, 100));
        let err = e.s.add(Sequence::new(1, vec![0; 10], 8, 0)).unwrap_err();
        assert_eq!(
            err,
            AddError::TooLong {
                id: 1,
                tokens: 17,
                capacity: 16
            }
        );
        assert!(err.to_string().contains("17") && err.to_string().contains("16"));
        e.add(2, vec![0; 10], 7); // 16 slots: the last sampled token needs none
        let bad = |s: &mut Scheduler, q| s.add(q).unwrap_err();
        assert_eq!(
            bad(&mut e.s, Sequence::new(3, vec![], 1, 0)),
            AddError::EmptyPrompt { id: 3 }
        );
        assert_eq!(
            bad(&mut e.s, Sequence::new(3, vec![1], 0, 0)),
            AddError::ZeroMaxTokens { id: 3 }
        );
        assert_eq!(
            bad(&mut e.s, Sequence::new(2, vec![1], 1, 0)),
            AddError::DuplicateId { id: 2 }
        );
        e.run_to_end();
        assert_eq!(e.done[&2].num_generated(), 7);
    }

    #[test]
    fn long_prefill_is_chunked_and_short_requests_run_beside_it() {
        let mut e = Engine::new(64, 4, cfg(4, 8, 4));
        e.add(1, vec![1, 2, 3], 50);
        assert_eq!(ids(&e.step()), vec![(1, 0, 3)]);
        e.add(2, (0..20).collect(), 5);
        assert_eq!(ids(&e.step()), vec![(1, 3, 1), (2, 0, 4)]);
        e.add(3, vec![9, 9, 9], 5);
        let plan = e.step();
        assert_eq!(ids(&plan), vec![(1, 4, 1), (2, 4, 4), (3, 0, 3)]);
        assert!(
            plan.items[2].samples,
            "the short request gets its first token now"
        );
        assert!(
            !plan.items[1].samples,
            "the long prompt is still being prefilled"
        );
        assert_eq!(e.s.get(3).unwrap().num_generated(), 1);
        e.run_to_end();
    }

    #[test]
    fn budget_caps_the_step_below_the_chunk_size() {
        let mut e = Engine::new(64, 4, cfg(4, 3, 100));
        e.add(1, (0..10).collect(), 2);
        e.add(2, vec![5], 2);
        assert_eq!(
            ids(&e.step()),
            vec![(1, 0, 3)],
            "FIFO: the second request waits"
        );
        assert_eq!(
            ids(&e.step()),
            vec![(1, 3, 3)],
            "no admission without budget"
        );
    }

    #[test]
    fn admission_reuses_the_cached_prefix() {
        let mut e = Engine::new(64, 4, cfg(4, 100, 100));
        let prompt: Vec<u32> = (1..=10).collect();
        e.add(1, prompt.clone(), 20);
        e.step();
        let mut shared = prompt[..8].to_vec();
        shared.extend([50, 51]);
        e.add(2, shared, 3);
        e.add(3, prompt[..8].to_vec(), 3);
        let plan = e.step();
        assert_eq!(
            ids(&plan)[1..],
            [(2, 8, 2), (3, 4, 4)],
            "a fully cached prompt still computes"
        );
        assert_eq!(e.s.get(2).unwrap().cached_prompt_tokens, 8);
        assert_eq!(
            plan.items[1].block_table[..2],
            plan.items[0].block_table[..2]
        );
        assert_eq!(e.s.blocks().stats().hit_tokens, 12);
    }

    /// Runs `prompts` in a pool of `num_blocks` blocks; returns each sequence's final tokens.
    fn outputs(num_blocks: usize, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
        let mut e = Engine::new(num_blocks, 2, cfg(8, 16, 16));
        for (id, p) in prompts.iter().enumerate() {
            e.add(id as u64, p.clone(), max_tokens);
        }
        e.run_to_end();
        (0..prompts.len() as u64)
            .map(|id| e.done[&id].tokens.clone())
            .collect()
    }

    #[test]
    fn preemption_recomputes_and_keeps_identical_tokens() {
        let prompts = vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8], vec![1, 2, 9]];
        let mut e = Engine::new(6, 2, cfg(8, 16, 16));
        for (id, p) in prompts.iter().enumerate() {
            e.add(id as u64, p.clone(), 8);
        }
        let mut seen_preemption = false;
        while e.s.has_work() {
            let before: HashMap<u64, Vec<u32>> =
                e.s.iter().map(|q| (q.id, q.tokens.clone())).collect();
            let plan = e.step();
            for id in &plan.preempted {
                seen_preemption = true;
                let q = e.s.get(*id).unwrap();
                assert_eq!(
                    (q.state, q.num_computed, q.block_table.len()),
                    (SeqState::Waiting, 0, 0)
                );
                assert_eq!(q.tokens, before[id], "generated tokens survive preemption");
                assert!(q.num_generated() > 0);
                assert!(!plan.items.iter().any(|i| i.seq_id == *id));
            }
        }
        assert!(
            seen_preemption,
            "6 blocks of 2 cannot hold three 11-token sequences"
        );
        let tight: Vec<Vec<u32>> = (0..3).map(|id| e.done[&id].tokens.clone()).collect();
        assert_eq!(
            tight,
            outputs(64, &prompts, 8),
            "same tokens as with room to spare"
        );
        for (id, p) in prompts.iter().enumerate() {
            assert_eq!(
                tight[id],
                outputs(64, std::slice::from_ref(p), 8)[0],
                "same as alone"
            );
        }
    }

    #[test]
    fn a_step_without_the_sampled_token_samples_again() {
        let mut e = Engine::new(16, 4, cfg(4, 100, 100));
        e.add(1, vec![1, 2, 3], 4);
        let plan = e.s.schedule();
        e.s.complete_step(&plan, &[]);
        let q = e.s.get(1).unwrap();
        assert_eq!((q.num_computed, q.num_generated()), (2, 0));
        assert_eq!(ids(&e.step()), vec![(1, 2, 1)]);
        assert_eq!(e.s.get(1).unwrap().num_generated(), 1);
    }

    #[test]
    fn cancel_releases_blocks_of_running_and_waiting_requests() {
        let mut e = Engine::new(16, 4, cfg(1, 100, 100));
        e.add(1, (0..9).collect(), 4);
        e.add(2, vec![1], 4);
        e.step();
        assert_eq!(e.s.blocks().stats().blocks_used, 3);
        let waiting = e.s.finish(2).unwrap();
        assert_eq!(waiting.state, SeqState::Finished);
        let running = e.s.finish(1).unwrap();
        assert_eq!(
            (running.state, running.block_table.len()),
            (SeqState::Finished, 0)
        );
        assert_eq!(e.s.blocks().stats().blocks_used, 0);
        assert!(!e.s.has_work() && e.s.finish(1).is_none());
        assert!(e.s.schedule().is_empty());
    }

    #[test]
    fn hybrid_chunks_end_where_snapshots_are_wanted_and_hits_restore_them() {
        let blocks = BlockManager::new(32, 4, true).with_state_snapshots(4);
        let mut s = Scheduler::new(cfg(4, 100, 100), blocks);
        let run = |s: &mut Scheduler, sampled: u32| {
            let plan = s.schedule();
            let picks: Vec<(u64, u32)> = plan
                .items
                .iter()
                .filter(|i| i.samples)
                .map(|i| (i.seq_id, sampled))
                .collect();
            let saves = s.complete_step(&plan, &picks);
            (plan, saves)
        };
        let prompt: Vec<u32> = (1..=10).collect();
        s.add(Sequence::new(1, prompt.clone(), 2, 1)).unwrap();
        // The prompt's last boundary (8) ends a chunk, and its state is kept there.
        let (plan, saves) = run(&mut s, 50);
        assert_eq!((ids(&plan), plan.items[0].restore), (vec![(1, 0, 8)], None));
        assert_eq!(
            saves,
            vec![SnapshotSave {
                seq_id: 1,
                snapshot: 0
            }]
        );
        let (plan, saves) = run(&mut s, 50);
        assert_eq!((ids(&plan), saves), (vec![(1, 8, 2)], vec![]));
        s.finish(1).unwrap();
        // The same prompt resumes from that snapshot.
        s.add(Sequence::new(2, prompt.clone(), 1, 2)).unwrap();
        let (plan, _) = run(&mut s, 50);
        assert_eq!(
            (ids(&plan), plan.items[0].restore),
            (vec![(2, 8, 2)], Some(0))
        );
        assert_eq!(s.get(2).unwrap().cached_prompt_tokens, 8);
        s.finish(2).unwrap();
        // Parting from the chain at 6: K/V matches to 4 with no snapshot there, so it computes
        // from 0, ends a chunk at 4 (and at 8, its own last boundary) and keeps both.
        let mut other = prompt[..6].to_vec();
        other.extend([70, 71, 72, 73]);
        s.add(Sequence::new(3, other.clone(), 1, 3)).unwrap();
        let (plan, saves) = run(&mut s, 50);
        assert_eq!((ids(&plan), plan.items[0].restore), (vec![(3, 0, 4)], None));
        assert_eq!(
            saves,
            vec![SnapshotSave {
                seq_id: 3,
                snapshot: 1
            }]
        );
        assert_eq!(ids(&run(&mut s, 50).0), vec![(3, 4, 4)]);
        s.finish(3).unwrap();
        s.add(Sequence::new(4, other[..7].to_vec(), 1, 4)).unwrap();
        let (plan, _) = run(&mut s, 50);
        assert_eq!(
            (ids(&plan), plan.items[0].restore),
            (vec![(4, 4, 3)], Some(1))
        );
    }
}
