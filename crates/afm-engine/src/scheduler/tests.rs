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
        let before: HashMap<u64, Vec<u32>> = e.s.iter().map(|q| (q.id, q.tokens.clone())).collect();
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

/// The engine loop with decode overlap (device decode steps): a decode step stays "in flight"
/// while the next is planned with `plan_continuation`, then completes; `sampled` is what the
/// model would have produced. Returns each sequence's tokens and how many steps continued.
fn outputs_overlapped(
    num_blocks: usize,
    max_running: usize,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, usize) {
    let mut e = Engine::new(num_blocks, 2, cfg(max_running, 16, 16));
    for (id, p) in prompts.iter().enumerate() {
        e.add(id as u64, p.clone(), max_tokens);
    }
    let complete = |e: &mut Engine, plan: &StepPlan| {
        let sampled: Vec<(u64, u32)> = plan
            .items
            .iter()
            .filter(|i| i.samples)
            .filter_map(|i| e.s.get(i.seq_id).map(|q| (i.seq_id, next_token(&q.tokens))))
            .collect();
        e.s.complete_step(plan, &sampled);
        let ended: Vec<u64> =
            e.s.iter()
                .filter(|q| q.reached_max_tokens())
                .map(|q| q.id)
                .collect();
        for id in ended {
            e.done.insert(id, e.s.finish(id).unwrap());
        }
    };
    let mut in_flight: Option<StepPlan> = None;
    let mut continued = 0;
    for _ in 0..10_000 {
        if let Some(prev) = in_flight.take() {
            let next = e.s.plan_continuation(&prev);
            if let Some(next) = &next {
                continued += 1;
                for (a, b) in prev.items.iter().zip(&next.items) {
                    assert_eq!((a.seq_id, a.start + 1, b.len), (b.seq_id, b.start, 1));
                    assert!(
                        b.block_table.len() * 2 > b.start,
                        "room for the new position"
                    );
                }
            }
            complete(&mut e, &prev);
            in_flight = next;
            continue;
        }
        if !e.s.has_work() {
            assert_eq!(
                e.s.blocks().stats().blocks_used,
                0,
                "a finished run holds no block"
            );
            let out = (0..prompts.len() as u64).map(|id| e.done[&id].tokens.clone());
            return (out.collect(), continued);
        }
        let plan = e.s.schedule();
        let decode = !plan.items.is_empty() && plan.items.iter().all(|i| i.len == 1 && i.samples);
        if decode {
            in_flight = Some(plan);
        } else {
            complete(&mut e, &plan);
        }
    }
    panic!("sequences did not finish");
}

#[test]
fn continued_decode_steps_give_the_tokens_of_plain_steps() {
    let prompts = vec![vec![1, 2, 3], vec![4, 5, 6, 7, 8], vec![9]];
    let (out, continued) = outputs_overlapped(64, 8, &prompts, 9);
    assert_eq!(out, outputs(64, &prompts, 9));
    assert!(continued >= 5, "decode steps continued: {continued}");
    // One running at a time: the others wait for the slot while the first continues, and
    // each request is still served to its end.
    let (one, continued_one) = outputs_overlapped(64, 1, &prompts, 9);
    assert_eq!(one, out);
    assert!(
        continued_one > 0,
        "the last request runs alone and continues"
    );
    // A pool too small for all three: continuation stops where blocks run out, the plain
    // schedule preempts, the tokens stay the same.
    let (tight, _) = outputs_overlapped(8, 8, &prompts, 9);
    assert_eq!(tight, out);
}

#[test]
fn no_continuation_at_the_token_limit_or_with_a_request_to_admit() {
    let mut e = Engine::new(64, 2, cfg(1, 16, 16));
    e.add(1, vec![1, 2, 3], 2);
    e.step(); // prefill, samples the first token
    let decode = e.s.schedule();
    assert_eq!(ids(&decode), vec![(1, 3, 1)]);
    assert!(
        e.s.plan_continuation(&decode).is_none(),
        "its token is the last: no step after it"
    );
    e.s.complete_step(&decode, &[(1, 5)]);
    let mut e = Engine::new(64, 2, cfg(1, 16, 16));
    e.add(1, vec![1, 2, 3], 8);
    e.step();
    let decode = e.s.schedule();
    e.add(2, vec![4], 8);
    let plan = e.s.plan_continuation(&decode);
    let plan = plan.expect("the one slot is busy: request 2 waits anyway");
    assert_eq!(ids(&plan), vec![(1, 4, 1)]);
    let mut e = Engine::new(64, 2, cfg(2, 16, 16));
    e.add(1, vec![1, 2, 3], 8);
    e.step();
    let decode = e.s.schedule();
    let used = e.s.blocks().stats().blocks_used;
    e.add(2, vec![4], 8);
    let refused = e.s.plan_continuation(&decode).is_none();
    assert!(refused, "request 2 could be admitted now");
    assert_eq!(
        e.s.blocks().stats().blocks_used,
        used,
        "a refused continuation takes no block"
    );
}
