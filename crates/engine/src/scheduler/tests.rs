use std::collections::HashMap;

use super::*;

const BLOCK: usize = 16;

/// A pool of `blocks` blocks of 16 positions; `cached` says how many positions a sequence
/// finds cached when admitted.
#[derive(Default)]
struct FakePool {
    free: usize,
    held: HashMap<SeqId, usize>,
    cached: HashMap<SeqId, usize>,
    admissions: Vec<SeqId>,
}

impl FakePool {
    fn new(blocks: usize) -> Self {
        FakePool {
            free: blocks,
            ..FakePool::default()
        }
    }

    fn release(&mut self, id: SeqId) {
        self.free += self.held.remove(&id).unwrap_or(0);
    }
}

impl KvBudget for FakePool {
    fn admit(&mut self, id: SeqId) -> Option<usize> {
        assert!(!self.held.contains_key(&id), "{id} admitted twice");
        self.held.insert(id, 0);
        self.admissions.push(id);
        Some(self.cached.get(&id).copied().unwrap_or(0))
    }

    fn reserve(&mut self, id: SeqId, positions: usize) -> bool {
        let held = self
            .held
            .get_mut(&id)
            .expect("reserve for an admitted sequence");
        let needed = positions.div_ceil(BLOCK).saturating_sub(*held);
        if needed > self.free {
            return false;
        }
        self.free -= needed;
        *held += needed;
        true
    }

    fn preempt(&mut self, id: SeqId) {
        self.release(id);
    }
}

fn scheduler(max_running: usize, token_budget: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        max_running,
        token_budget,
    })
}

fn run(id: SeqId, start: usize, tokens: usize, samples: bool) -> Scheduled {
    Scheduled {
        id,
        start,
        tokens,
        samples,
    }
}

/// Runs a step: plans it and marks its runs done.
fn step(s: &mut Scheduler, pool: &mut FakePool) -> StepPlan {
    let plan = s.schedule(pool);
    for r in &plan.runs {
        s.ran(r);
    }
    plan
}

#[test]
fn a_long_prompt_runs_in_chunks_and_samples_after_its_last() {
    let (mut s, mut pool) = (scheduler(4, 32), FakePool::new(100));
    s.add(1, 70);
    assert_eq!(step(&mut s, &mut pool).runs, [run(1, 0, 32, false)]);
    assert_eq!(step(&mut s, &mut pool).runs, [run(1, 32, 32, false)]);
    assert_eq!(step(&mut s, &mut pool).runs, [run(1, 64, 6, true)]);
    // Then one token a step.
    assert_eq!(step(&mut s, &mut pool).runs, [run(1, 70, 1, true)]);
    assert_eq!(step(&mut s, &mut pool).runs, [run(1, 71, 1, true)]);
}

#[test]
fn decode_tokens_go_first_and_a_new_prompt_takes_what_is_left() {
    let (mut s, mut pool) = (scheduler(4, 32), FakePool::new(100));
    s.add(1, 3);
    s.add(2, 5);
    assert_eq!(
        step(&mut s, &mut pool).runs,
        [run(1, 0, 3, true), run(2, 0, 5, true)]
    );
    // A long prompt arrives: the two decode tokens first, then its first chunk.
    s.add(3, 100);
    assert_eq!(
        step(&mut s, &mut pool).runs,
        [run(1, 3, 1, true), run(2, 5, 1, true), run(3, 0, 30, false)]
    );
    // Still decode first, although sequence 3 was admitted before this step's planning.
    assert_eq!(
        step(&mut s, &mut pool).runs,
        [
            run(1, 4, 1, true),
            run(2, 6, 1, true),
            run(3, 30, 30, false)
        ]
    );
}

#[test]
fn admission_is_first_come_first_served_up_to_max_running() {
    let (mut s, mut pool) = (scheduler(2, 64), FakePool::new(100));
    for id in 1..=4 {
        s.add(id, 4);
    }
    let plan = step(&mut s, &mut pool);
    assert_eq!(plan.runs, [run(1, 0, 4, true), run(2, 0, 4, true)]);
    assert_eq!((s.running(), s.waiting()), (2, 2));
    // One finishes: the next in line takes its place.
    s.remove(1);
    pool.release(1);
    let plan = step(&mut s, &mut pool);
    assert_eq!(plan.runs, [run(2, 4, 1, true), run(3, 0, 4, true)]);
    assert_eq!(pool.admissions, [1, 2, 3]);
}

#[test]
fn a_cached_prefix_is_not_computed_again_but_the_last_token_is() {
    let (mut s, mut pool) = (scheduler(4, 64), FakePool::new(100));
    pool.cached.insert(1, 32);
    pool.cached.insert(2, 48);
    s.add(1, 40);
    s.add(2, 48);
    assert_eq!(
        step(&mut s, &mut pool).runs,
        [run(1, 32, 8, true), run(2, 47, 1, true)]
    );
}

#[test]
fn when_blocks_run_out_the_last_admitted_is_preempted_and_resumes_first() {
    // 4 blocks: two sequences of 30 positions fit (2 blocks each) until one grows past 32.
    let (mut s, mut pool) = (scheduler(4, 64), FakePool::new(4));
    s.add(1, 31);
    s.add(2, 30);
    s.add(3, 5);
    let plan = step(&mut s, &mut pool);
    // Sequence 3 finds no blocks: it waits (admitted and given back).
    assert_eq!(plan.runs, [run(1, 0, 31, true), run(2, 0, 30, true)]);
    assert_eq!(s.waiting(), 1);
    step(&mut s, &mut pool); // 1 at 32 positions, 2 at 31
    // Sequence 1's 33rd position needs a fifth block: sequence 2 (admitted last) makes way,
    // and no one new is admitted in a step that preempted.
    let plan = step(&mut s, &mut pool);
    assert_eq!(plan.runs, [run(1, 32, 1, true)]);
    assert_eq!(plan.preempted, [2]);
    assert_eq!((s.running(), s.waiting()), (1, 2));
    // When sequence 1 ends, sequence 2 runs again before 3, over its prompt and the two
    // tokens it had sampled, from what its cached prefix kept (here, one block).
    s.remove(1);
    pool.release(1);
    pool.cached.insert(2, 16);
    let plan = step(&mut s, &mut pool);
    assert_eq!(plan.runs, [run(2, 16, 16, true), run(3, 0, 5, true)]);
}

#[test]
fn a_sequence_that_cannot_grow_alone_preempts_itself() {
    let (mut s, mut pool) = (scheduler(4, 64), FakePool::new(1));
    s.add(1, 16);
    assert_eq!(step(&mut s, &mut pool).runs, [run(1, 0, 16, true)]);
    let plan = step(&mut s, &mut pool);
    assert_eq!(plan.runs, []);
    assert_eq!(plan.preempted, [1]);
    // The engine sees a step with nothing to run and a queue: the head cannot fit alone.
    assert!(!s.is_idle());
}

#[test]
fn removing_forgets_a_sequence_running_or_waiting() {
    let (mut s, mut pool) = (scheduler(1, 8), FakePool::new(10));
    s.add(1, 4);
    s.add(2, 4);
    step(&mut s, &mut pool);
    assert!(s.remove(2) && !s.contains(2));
    assert!(s.remove(1) && s.is_idle());
    assert!(!s.remove(1));
}

/// Many sequences arriving over time, with small pools and budgets: every step keeps the
/// limits, every run continues where its sequence stopped, and every sequence finishes.
#[test]
fn every_sequence_finishes_within_the_limits() {
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n) as usize
    };
    for case in 0..200 {
        let (max_running, budget) = (1 + next(6), 1 + next(64));
        let pool_blocks = 8 + next(24);
        let mut s = scheduler(max_running, budget);
        let mut pool = FakePool::new(pool_blocks);
        // id -> (prompt, tokens to generate, generated, computed by our count)
        let mut seqs: HashMap<SeqId, (usize, usize, usize, usize)> = HashMap::new();
        let total = 1 + next(12);
        let mut added = 0;
        let mut finished = false;
        for step_index in 0..10_000 {
            if added < total && next(3) == 0 {
                added += 1;
                let id = added as SeqId;
                let prompt = 1 + next(80);
                let want = 1 + next(20);
                s.add(id, prompt);
                seqs.insert(id, (prompt, want, 0, 0));
            }
            let plan = s.schedule(&mut pool);
            assert!(plan.tokens() <= budget, "case {case}: over the budget");
            assert!(s.running() <= max_running, "case {case}: too many running");
            for &id in &plan.preempted {
                seqs.get_mut(&id).unwrap().3 = 0;
            }
            for r in &plan.runs {
                let (prompt, want, generated, computed) = seqs.get_mut(&r.id).unwrap();
                // A preempted sequence restarts from its cache (none here): from 0.
                assert_eq!(
                    r.start, *computed,
                    "case {case}: run of {} not where it was",
                    r.id
                );
                *computed += r.tokens;
                assert_eq!(r.samples, *computed == *prompt + *generated);
                s.ran(r);
                if r.samples {
                    *generated += 1;
                    if generated == want {
                        s.remove(r.id);
                        pool.release(r.id);
                    }
                }
            }
            // Every sequence fits the pool alone (at most 100 positions: 7 blocks), so a
            // step with work always runs something.
            assert!(
                !plan.runs.is_empty() || s.is_idle(),
                "case {case}: step {step_index} ran nothing"
            );
            if added == total && s.is_idle() {
                assert!(seqs.values().all(|v| v.2 == v.1), "case {case}: unfinished");
                finished = true;
                break;
            }
        }
        assert!(finished, "case {case}: still running after 10,000 steps");
    }
}
