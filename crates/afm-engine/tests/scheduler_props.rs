//! Property tests for the scheduler and the KV block manager: random interleavings of add,
//! step (schedule + complete with random sampled tokens), finish and cancel over small pools.
//!
//! A fake KV store stands in for the model: every slot holds a fingerprint of the prefix its
//! token closes, so a step that reads a cached or earlier-computed position through its block
//! table sees exactly the K/V its own tokens would have produced, or the test fails.
//!
//! Half the setups are hybrid models: each sequence also carries a fake recurrent state (the
//! fingerprint of the tokens folded in), snapshots are filled from it when `complete_step`
//! asks, and a chunk must start from its own state or from a restored snapshot holding exactly
//! the tokens before it. No snapshot may outlive its block or be attached twice.

use std::collections::{BTreeSet, HashMap};

use afm_engine::kv_blocks::{BlockId, BlockManager};
use afm_engine::scheduler::{AddError, Scheduler, SchedulerConfig, SnapshotSave, StepPlan};
use afm_engine::sequence::{SeqState, Sequence};
use proptest::prelude::*;

/// Prompts start from one of these so requests share prefixes and hit the cache.
const BASES: [[u32; 12]; 3] = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
];

#[derive(Debug, Clone)]
enum Op {
    Add {
        base: usize,
        shared: usize,
        tail: Vec<u32>,
        max_tokens: usize,
    },
    Step {
        seed: u64,
    },
    /// A stop token: finish the n-th running sequence.
    FinishRunning(usize),
    CancelWaiting(usize),
    CancelRunning(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, prop_oneof![0..=12usize, 6..=12usize], prop::collection::vec(0..4u32, 0..6), 1..8usize)
            .prop_map(|(base, shared, tail, max_tokens)| Op::Add { base, shared, tail, max_tokens }),
        6 => any::<u64>().prop_map(|seed| Op::Step { seed }),
        1 => any::<usize>().prop_map(Op::FinishRunning),
        1 => any::<usize>().prop_map(Op::CancelWaiting),
        1 => any::<usize>().prop_map(Op::CancelRunning),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    num_blocks: usize,
    block_size: usize,
    prefix_caching: bool,
    /// Hybrid model: this many state snapshots.
    snapshots: Option<usize>,
    cfg: SchedulerConfig,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        3..16usize,
        1..5usize,
        any::<bool>(),
        1..5usize,
        1..6usize,
        1..17usize,
        1..9usize,
        prop::option::of(0..5usize),
    )
        .prop_map(
            |(
                num_blocks,
                block_size,
                prefix_caching,
                max_running,
                max_waiting,
                budget,
                chunk,
                snapshots,
            )| {
                Setup {
                    num_blocks,
                    block_size,
                    prefix_caching,
                    snapshots,
                    cfg: SchedulerConfig {
                        max_running,
                        max_waiting,
                        token_budget: budget,
                        max_prefill_chunk: chunk,
                    },
                }
            },
        )
}

/// What the K/V at the last position of `prefix` depends on: the whole prefix.
fn fingerprint(prefix: &[u32]) -> u64 {
    prefix.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ u64::from(t) ^ 0x100).wrapping_mul(0x100_0000_01b3)
    })
}

struct Harness {
    s: Scheduler,
    cfg: SchedulerConfig,
    /// Token state each live sequence must have: its prompt plus what was sampled for it.
    expected: HashMap<u64, Vec<u32>>,
    /// Fake KV: one fingerprint per (block, slot).
    kv: Vec<Option<u64>>,
    next_id: u64,
    /// Hybrid models: each running sequence's fake state (tokens folded in, their fingerprint),
    /// and the snapshot buffers.
    hybrid: bool,
    states: HashMap<u64, (usize, u64)>,
    snapshots: Vec<Option<(usize, u64)>>,
}

impl Harness {
    fn new(st: &Setup) -> Self {
        let mut blocks = BlockManager::new(st.num_blocks, st.block_size, st.prefix_caching);
        if let Some(n) = st.snapshots {
            blocks = blocks.with_state_snapshots(n);
        }
        Self {
            s: Scheduler::new(st.cfg, blocks),
            cfg: st.cfg,
            expected: HashMap::new(),
            kv: vec![None; st.num_blocks * st.block_size],
            next_id: 0,
            hybrid: st.snapshots.is_some(),
            states: HashMap::new(),
            snapshots: vec![None; st.snapshots.unwrap_or(0)],
        }
    }

    fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        let bs = self.s.blocks().block_size();
        table[pos / bs] as usize * bs + pos % bs
    }

    fn add(&mut self, prompt: Vec<u32>, max_tokens: usize) {
        let id = self.next_id;
        self.next_id += 1;
        let capacity = self.s.blocks().num_blocks() * self.s.blocks().block_size();
        let needed = prompt.len() + max_tokens - 1;
        let waiting = self.s.num_waiting();
        match self
            .s
            .add(Sequence::new(id, prompt.clone(), max_tokens, id))
        {
            Ok(()) => {
                assert!(needed <= capacity && waiting < self.cfg.max_waiting);
                self.expected.insert(id, prompt);
            }
            Err(AddError::TooLong {
                tokens,
                capacity: c,
                ..
            }) => {
                assert_eq!((tokens, c), (needed, capacity));
                assert!(needed > capacity);
            }
            Err(AddError::QueueFull { .. }) => assert!(waiting >= self.cfg.max_waiting),
            Err(e) => panic!("unexpected refusal: {e}"),
        }
    }

    fn ids_in(&self, state: SeqState) -> Vec<u64> {
        let ids: BTreeSet<u64> = self
            .s
            .iter()
            .filter(|q| q.state == state)
            .map(|q| q.id)
            .collect();
        ids.into_iter().collect()
    }

    fn finish_nth(&mut self, state: SeqState, n: usize) {
        let ids = self.ids_in(state);
        if ids.is_empty() {
            return;
        }
        let q = self
            .s
            .finish(ids[n % ids.len()])
            .expect("listed ids are live");
        assert_eq!((q.state, q.block_table.len()), (SeqState::Finished, 0));
        assert_eq!(self.expected.remove(&q.id).as_ref(), Some(&q.tokens));
    }

    /// One engine step; returns whether the plan computed anything.
    fn step(&mut self, seed: u64) -> bool {
        let before: HashMap<u64, Vec<u32>> =
            self.s.iter().map(|q| (q.id, q.tokens.clone())).collect();
        let plan = self.s.schedule();
        self.check_plan(&plan, &before);
        for id in &plan.preempted {
            self.states.remove(id);
        }
        self.run_fake_model(&plan);
        if self.hybrid {
            self.run_fake_state(&plan);
        }
        let mut rng = seed;
        let sampled: Vec<(u64, u32)> = plan
            .items
            .iter()
            .filter(|i| i.samples)
            .map(|i| {
                rng = rng
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (i.seq_id, (rng >> 61) as u32)
            })
            .collect();
        let saves = self.s.complete_step(&plan, &sampled);
        self.save_snapshots(&saves);
        for &(id, t) in &sampled {
            self.expected
                .get_mut(&id)
                .expect("sampled sequences are live")
                .push(t);
        }
        // The engine ends a sequence as soon as it has max_tokens tokens.
        let ended: Vec<u64> = self
            .s
            .iter()
            .filter(|q| q.reached_max_tokens())
            .map(|q| q.id)
            .collect();
        for id in ended {
            let q = self.s.finish(id).expect("live");
            assert_eq!(q.num_generated(), q.max_tokens);
            assert_eq!(self.expected.remove(&id), Some(q.tokens));
        }
        !plan.is_empty()
    }

    fn check_plan(&self, plan: &StepPlan, before: &HashMap<u64, Vec<u32>>) {
        assert!(
            plan.num_tokens() <= self.cfg.token_budget,
            "step over budget: {plan:?}"
        );
        let distinct: BTreeSet<u64> = plan.items.iter().map(|i| i.seq_id).collect();
        assert_eq!(
            distinct.len(),
            plan.items.len(),
            "a sequence twice in one step"
        );
        let bs = self.s.blocks().block_size();
        for item in &plan.items {
            let q = self.s.get(item.seq_id).expect("planned sequences are live");
            assert_eq!(q.state, SeqState::Running);
            assert!(item.len >= 1 && item.start == q.num_computed);
            assert_eq!(item.samples, item.start + item.len == q.len());
            assert!(item.block_table.len() * bs >= item.start + item.len);
            assert_eq!(item.block_table, q.block_table);
            // Every block written this step belongs to this sequence alone and is unpublished.
            for b in &item.block_table[item.start / bs..(item.start + item.len).div_ceil(bs)] {
                assert_eq!(
                    self.s.blocks().ref_count(*b),
                    1,
                    "block {b} writable by two"
                );
                assert!(
                    !self.s.blocks().is_published(*b),
                    "published block {b} rewritten"
                );
            }
        }
        for id in &plan.preempted {
            let q = self.s.get(*id).expect("preempted sequences stay live");
            assert_eq!(
                (q.state, q.num_computed, q.block_table.len()),
                (SeqState::Waiting, 0, 0)
            );
            assert_eq!(&q.tokens, &before[id], "preemption keeps every token");
        }
    }

    /// "Attention": every earlier position must hold this sequence's own K/V; then write ours.
    fn run_fake_model(&mut self, plan: &StepPlan) {
        for item in &plan.items {
            let tokens = self.s.get(item.seq_id).expect("live").tokens.clone();
            for p in 0..item.start + item.len {
                let slot = self.slot(&item.block_table, p);
                let want = fingerprint(&tokens[..=p]);
                if p < item.start {
                    assert_eq!(
                        self.kv[slot],
                        Some(want),
                        "seq {} reads wrong K/V at {p}",
                        item.seq_id
                    );
                } else {
                    self.kv[slot] = Some(want);
                }
            }
        }
    }

    /// The recurrent half of a hybrid model: a chunk continues the sequence's own state, or
    /// starts from zero at position 0, or from the snapshot its item names.
    fn run_fake_state(&mut self, plan: &StepPlan) {
        for item in &plan.items {
            let tokens = &self.s.get(item.seq_id).expect("live").tokens;
            let before = (item.start, fingerprint(&tokens[..item.start]));
            let state = match item.restore {
                Some(snap) => self.snapshots[snap as usize].expect("restored snapshot was filled"),
                None if item.start == 0 => before,
                None => *self
                    .states
                    .get(&item.seq_id)
                    .expect("a chunk past 0 continues a state or restores one"),
            };
            assert_eq!(
                state, before,
                "seq {} starts at {} from a state of other tokens (restore {:?})",
                item.seq_id, item.start, item.restore
            );
            let end = item.start + item.len;
            self.states
                .insert(item.seq_id, (end, fingerprint(&tokens[..end])));
        }
    }

    fn save_snapshots(&mut self, saves: &[SnapshotSave]) {
        assert!(
            self.hybrid || saves.is_empty(),
            "snapshots of a plain model"
        );
        let bs = self.s.blocks().block_size();
        for save in saves {
            let state = self.states[&save.seq_id];
            assert!(
                state.0 > 0 && state.0.is_multiple_of(bs),
                "snapshot off a boundary: {state:?}"
            );
            self.snapshots[save.snapshot as usize] = Some(state);
        }
    }

    fn check_invariants(&self) {
        let blocks = self.s.blocks();
        let (n, bs) = (blocks.num_blocks(), blocks.block_size());
        let st = blocks.stats();
        assert_eq!(
            st.blocks_free + st.blocks_cached + st.blocks_used,
            n,
            "leaked block: {st:?}"
        );
        assert_eq!(blocks.num_free(), st.blocks_free + st.blocks_cached);
        let mut holders: HashMap<BlockId, Vec<(usize, usize)>> = HashMap::new();
        for q in self.s.iter() {
            assert_eq!(
                Some(&q.tokens),
                self.expected.get(&q.id),
                "token state of {}",
                q.id
            );
            match q.state {
                SeqState::Waiting => assert!(q.block_table.is_empty() && q.num_computed == 0),
                SeqState::Running => assert!(q.block_table.len() * bs >= q.num_computed),
                SeqState::Finished => panic!("finished sequence {} still scheduled", q.id),
            }
            for (i, &b) in q.block_table.iter().enumerate() {
                holders.entry(b).or_default().push((i, q.num_computed));
            }
        }
        for b in 0..n as BlockId {
            let h = holders.get(&b).map_or(&[][..], Vec::as_slice);
            assert_eq!(
                blocks.ref_count(b) as usize,
                h.len(),
                "ref count of block {b}"
            );
            if h.len() > 1 {
                assert!(blocks.is_published(b), "shared block {b} is not published");
                assert!(
                    h.iter().all(|&(i, computed)| (i + 1) * bs <= computed),
                    "shared block {b} not full"
                );
            }
        }
        assert_eq!(st.blocks_used, holders.len());
        // Every snapshot is free or belongs to exactly one published block.
        let owned: Vec<_> = (0..n as BlockId)
            .filter_map(|b| blocks.snapshot_of(b).map(|s| (b, s)))
            .collect();
        let distinct: BTreeSet<_> = owned.iter().map(|&(_, s)| s).collect();
        assert_eq!(distinct.len(), owned.len(), "a snapshot on two blocks");
        assert_eq!(st.snapshots_held, owned.len(), "leaked snapshot: {st:?}");
        assert!(st.snapshots_held <= st.snapshots_total);
        assert!(owned.iter().all(|&(b, _)| blocks.is_published(b)));
        assert_eq!(self.expected.len(), self.s.iter().count());
        assert!(self.s.num_running() <= self.cfg.max_running);
        // Preempted sequences return to the queue even when it is full.
        assert!(self.s.num_waiting() <= self.cfg.max_waiting + self.cfg.max_running);
    }

    /// Keep stepping: every sequence must finish, and no step may come back empty meanwhile.
    fn drain(&mut self) {
        let mut steps = 0u64;
        while self.s.has_work() {
            assert!(
                self.step(steps),
                "live sequences but an empty step: livelock"
            );
            self.check_invariants();
            steps += 1;
            assert!(steps < 5_000, "sequences never finished");
        }
        let blocks = self.s.blocks();
        assert!((0..blocks.num_blocks() as BlockId).all(|b| blocks.ref_count(b) == 0));
        assert_eq!(blocks.stats().blocks_used, 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_traffic_keeps_blocks_and_tokens_consistent(
        st in setup(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut h = Harness::new(&st);
        for op in ops {
            match op {
                Op::Add { base, shared, tail, max_tokens } => {
                    let mut prompt = BASES[base][..shared].to_vec();
                    prompt.extend(tail);
                    if prompt.is_empty() {
                        prompt.push(0);
                    }
                    h.add(prompt, max_tokens);
                }
                Op::Step { seed } => {
                    h.step(seed);
                }
                Op::FinishRunning(n) | Op::CancelRunning(n) => h.finish_nth(SeqState::Running, n),
                Op::CancelWaiting(n) => h.finish_nth(SeqState::Waiting, n),
            }
            h.check_invariants();
        }
        h.drain();
    }
}
