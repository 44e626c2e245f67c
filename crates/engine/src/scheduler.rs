//! Which sequences run in the next forward pass, and how many tokens each computes.
//!
//! After vLLM v1's scheduler: a sequence knows how many of its tokens (prompt, then the
//! tokens sampled so far) are computed, and each step gives it some of the rest under one
//! token budget, so prefill and decode are not phases: a prompt longer than the budget runs in
//! chunks beside other sequences' decode tokens (chunked prefill). Decode tokens go first, so
//! a long prompt arriving never stalls the streams already running; then the running prompts'
//! chunks, then new sequences from the queue, first come first served, while there are
//! fewer than `max_running` and the KV pool can start them. When the pool runs out of blocks
//! for a running sequence, the most recently admitted one is preempted: its blocks go back
//! (its full blocks stay in the prompt cache, so resuming recomputes little) and it waits at
//! the head of the queue to run again from its cached prefix.
//!
//! Pure logic: the KV pool is behind [`KvBudget`], so every decision is tested here without
//! a model.

use std::collections::VecDeque;

/// A sequence's number, unique while it is known to the scheduler.
pub type SeqId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences that may run at once (`--parallel`).
    pub max_running: usize,
    /// Tokens one forward pass computes at most (the backend's batch).
    pub token_budget: usize,
}

/// The KV pool as the scheduler sees it: blocks for a sequence's positions, or not.
pub trait KvBudget {
    /// Starts `id`'s sequence over its tokens; returns how many leading positions a cached
    /// prefix already holds (at most all but its last token), or `None` when the pool cannot
    /// start it now.
    fn admit(&mut self, id: SeqId) -> Option<usize>;
    /// Makes `id`'s blocks cover its first `positions` positions; false, changing nothing,
    /// when the pool has too few free or evictable blocks.
    fn reserve(&mut self, id: SeqId, positions: usize) -> bool;
    /// Gives `id`'s blocks back (its computed full blocks may stay cached): it starts over
    /// with [`KvBudget::admit`] when it runs again.
    fn preempt(&mut self, id: SeqId);
}

/// One sequence's share of a step: compute its tokens `start..start + tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub tokens: usize,
    /// Whether these reach the sequence's last known token, whose logits give its next one.
    pub samples: bool,
}

/// What a step runs, in the order of its rows, and who was preempted to make room.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub runs: Vec<Scheduled>,
    pub preempted: Vec<SeqId>,
}

impl StepPlan {
    pub fn tokens(&self) -> usize {
        self.runs.iter().map(|r| r.tokens).sum()
    }
}

#[derive(Clone, Copy, Debug)]
struct Sequence {
    id: SeqId,
    /// Tokens known: the prompt and those sampled so far.
    tokens: usize,
    /// Of those, the ones whose keys and values are in the sequence's blocks.
    computed: usize,
}

impl Sequence {
    fn pending(&self) -> usize {
        self.tokens - self.computed
    }

    /// Its next `tokens` tokens, as a step's run.
    fn run(&self, tokens: usize) -> Scheduled {
        Scheduled {
            id: self.id,
            start: self.computed,
            tokens,
            samples: self.computed + tokens == self.tokens,
        }
    }
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: VecDeque<Sequence>,
    /// In the order they were admitted: the last is the first preempted.
    running: Vec<Sequence>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        assert!(
            config.max_running > 0 && config.token_budget > 0,
            "a scheduler runs at least one sequence and one token a step"
        );
        Scheduler {
            config,
            waiting: VecDeque::new(),
            running: Vec::with_capacity(config.max_running),
        }
    }

    /// Queues a sequence of `prompt_tokens` tokens (at least one).
    pub fn add(&mut self, id: SeqId, prompt_tokens: usize) {
        assert!(prompt_tokens > 0, "a sequence starts with a token");
        debug_assert!(!self.contains(id), "sequence {id} is already scheduled");
        self.waiting.push_back(Sequence {
            id,
            tokens: prompt_tokens,
            computed: 0,
        });
    }

    /// Forgets `id`, running or waiting (finished, cancelled or failed); the caller gives its
    /// blocks back. Returns whether it was known.
    pub fn remove(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i);
            true
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            true
        } else {
            false
        }
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.running.iter().chain(&self.waiting).any(|s| s.id == id)
    }

    /// Sequences that may run at once.
    pub fn max_running(&self) -> usize {
        self.config.max_running
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The sequence first in the queue.
    pub fn first_waiting(&self) -> Option<SeqId> {
        self.waiting.front().map(|s| s.id)
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// After a step ran `run`: its tokens are computed, and when it sampled, the sequence has
    /// one more token to compute next.
    pub fn ran(&mut self, run: &Scheduled) {
        let s = self
            .running
            .iter_mut()
            .find(|s| s.id == run.id)
            .expect("a run of a running sequence");
        debug_assert_eq!(s.computed, run.start);
        s.computed += run.tokens;
        if run.samples {
            s.tokens += 1;
        }
    }

    /// Records a decode run of `id` that also verified drafted tokens: the last token's
    /// position and the `accepted` drafts' are computed, and the token picked after them is
    /// the one pending. (The run's rejected drafts' positions are dropped by the caller.)
    pub fn ran_drafted(&mut self, id: SeqId, accepted: usize) {
        let s = self
            .running
            .iter_mut()
            .find(|s| s.id == id)
            .expect("a run of a running sequence");
        debug_assert_eq!(s.pending(), 1, "drafts follow a sequence's last token");
        s.computed += 1 + accepted;
        s.tokens += 1 + accepted;
    }

    /// Plans the next step.
    pub fn schedule(&mut self, kv: &mut dyn KvBudget) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.token_budget;
        // Decode tokens first, then the running prompts' chunks.
        for decode in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let s = self.running[i];
                if (s.pending() == 1) != decode || plan.runs.iter().any(|r| r.id == s.id) {
                    i += 1;
                    continue;
                }
                let tokens = s.pending().min(budget);
                if self.reserve_or_preempt(kv, i, s.computed + tokens, &mut plan, &mut budget) {
                    plan.runs.push(s.run(tokens));
                    budget -= tokens;
                    i += 1;
                }
                // Else `s` itself was preempted: the same index now holds the next one.
            }
        }
        // New sequences, first come first served; none in a step that had to preempt.
        while plan.preempted.is_empty()
            && budget > 0
            && self.running.len() < self.config.max_running
        {
            let Some(mut s) = self.waiting.front().copied() else {
                break;
            };
            let Some(cached) = kv.admit(s.id) else { break };
            s.computed = cached.min(s.tokens - 1);
            let tokens = s.pending().min(budget);
            if !kv.reserve(s.id, s.computed + tokens) {
                kv.preempt(s.id);
                break;
            }
            self.waiting.pop_front();
            self.running.push(s);
            plan.runs.push(s.run(tokens));
            budget -= tokens;
        }
        plan
    }

    /// Reserves blocks for running sequence `i` up to `positions`, preempting the most
    /// recently admitted running sequences until they fit. Returns false when `i` itself
    /// was preempted (it is no longer at `i`).
    fn reserve_or_preempt(
        &mut self,
        kv: &mut dyn KvBudget,
        i: usize,
        positions: usize,
        plan: &mut StepPlan,
        budget: &mut usize,
    ) -> bool {
        let id = self.running[i].id;
        loop {
            if kv.reserve(id, positions) {
                return true;
            }
            let victim = self.running.len() - 1;
            let preempted = self.running.remove(victim);
            kv.preempt(preempted.id);
            // A victim already planned this step gives its tokens back.
            if let Some(at) = plan.runs.iter().position(|r| r.id == preempted.id) {
                *budget += plan.runs.remove(at).tokens;
            }
            plan.preempted.push(preempted.id);
            // It runs again first, from whatever its cached prefix keeps.
            self.waiting.push_front(Sequence {
                computed: 0,
                ..preempted
            });
            if victim == i {
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests;
