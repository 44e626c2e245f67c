//! The batched loop: many requests at once, each step one forward pass over the sequences the
//! [`Scheduler`] picks (decode tokens and prompt chunks together), each sequence sampled with
//! its own parameters and seed.
//!
//! A request's tokens are the same bits as the same request run alone wherever the backend's
//! kernels are batch-invariant (the CPU's: `ember-models`' batch test), so concurrent = alone.
//!
//! With a draft source ([`crate::draft`]), a decoding sequence's run also carries the tokens
//! drafted to follow it: the pass gives a row of logits for each, and each row's token is
//! picked as a decode step would pick it, the drafts standing while they equal the picks
//! (so drafted = undrafted, by the same invariance).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ember_models::{BlockTable, Logits, SequencePass};

use super::Engine;
use super::generate::{FinishReason, GenerateParams, Generation};
use super::picker::Picker;
use crate::constraint::Constraint;
use crate::draft::{Depth, DraftOptions, DraftSource, Proposal};
use crate::error::{Error, Result};
use crate::kv::{BlockManager, Transfer};
use crate::scheduler::{KvBudget, Scheduled, Scheduler, SchedulerConfig, SeqId};

/// Sampling runs in a pass past which no drafts are added: a pass of many rows already reads
/// the weights for several tokens, and drafts only add rows to compute. Measured on 2 cores
/// (Qwen2.5-Coder-1.5B Q4_K_M, code edits that copy, 96 tokens each, cached prompts): drafts
/// gave 1.83x the tokens/s with one request, 1.56x with two, 1.08x with four at once.
pub(crate) const DRAFT_STEP_ASIDE: usize = 4;

/// What a step tells about one request.
pub enum BatchEvent<'a> {
    /// Before its first token: how many prompt tokens came from the prompt cache.
    Prompt { cached_tokens: usize },
    /// A token, with the logits it was sampled from; `None` when they stayed where they were
    /// made (a greedy request without [`GenerateParams::step_logits`], picked on the device).
    Token {
        token: u32,
        logits: Option<&'a [f32]>,
        is_eos: bool,
    },
    /// It ended (its blocks are back in the pool, its prefix in the cache).
    Finished(Generation),
    /// It failed; the others go on.
    Failed(Error),
}

/// One request in the batched loop.
struct Active {
    /// The prompt, then every token sampled.
    tokens: Vec<u32>,
    prompt_len: usize,
    params: GenerateParams,
    picker: Picker,
    table: BlockTable,
    /// The tokens the sequence may make: `max_tokens`, within the context.
    limit: usize,
    /// Prompt tokens its last admission found cached (0 until admitted).
    cached: usize,
    announced: bool,
    submitted: Instant,
    first_token: Option<Instant>,
    /// Drafted tokens at the end of `tokens` for the pass being run (0: none).
    drafted: usize,
    depth: Depth,
    draft_stats: DraftStats,
}

/// Tokens drafted for a request and those its target accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DraftStats {
    pub drafted: usize,
    pub accepted: usize,
}

/// The batched loop's state: the scheduler and its requests.
pub(super) struct Batch {
    scheduler: Scheduler,
    active: HashMap<SeqId, Active>,
    timing: StepTiming,
    draft: DraftOptions,
    drafter: Option<Box<dyn DraftSource>>,
    /// Tokens a pass may take (the backend's batch).
    max_tokens: usize,
    /// Each drafting sequence's proposal this pass (kept for their allocations).
    proposals: Vec<Vec<u32>>,
}

/// Where the batched loop's steps spent their time, summed since the engine was made.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepTiming {
    /// Steps that ran a forward pass.
    pub passes: usize,
    /// Running sequences preempted to free KV blocks (each recomputes its tokens later).
    pub preemptions: usize,
    /// Rows (tokens) those passes computed.
    pub rows: usize,
    /// Scheduling; the forward passes, until their picks or logits are on the host; and
    /// sampling on the host with the events it sends.
    pub schedule: Duration,
    /// Of `schedule`, proposing drafts (a draft model's own passes).
    pub propose: Duration,
    pub pass: Duration,
    pub sample: Duration,
    /// Drafted tokens verified, and those accepted.
    pub drafts: DraftStats,
}

impl StepTiming {
    /// What went on since `before` (an earlier reading of the same engine).
    pub fn since(&self, before: &StepTiming) -> StepTiming {
        StepTiming {
            passes: self.passes - before.passes,
            preemptions: self.preemptions - before.preemptions,
            rows: self.rows - before.rows,
            schedule: self.schedule - before.schedule,
            propose: self.propose - before.propose,
            pass: self.pass - before.pass,
            sample: self.sample - before.sample,
            drafts: DraftStats {
                drafted: self.drafts.drafted - before.drafts.drafted,
                accepted: self.drafts.accepted - before.drafts.accepted,
            },
        }
    }
}

impl Batch {
    /// `drafter`: the source `draft` names ([`DraftOptions::source`], or a loaded draft model).
    pub(super) fn new(
        max_running: usize,
        token_budget: usize,
        draft: DraftOptions,
        drafter: Option<Box<dyn DraftSource>>,
    ) -> Self {
        Batch {
            scheduler: Scheduler::new(SchedulerConfig {
                max_running,
                token_budget,
            }),
            active: HashMap::new(),
            timing: StepTiming::default(),
            draft,
            drafter,
            max_tokens: token_budget,
            proposals: Vec::new(),
        }
    }

    /// Whether the loop drafts tokens for its requests.
    pub(super) fn drafts(&self) -> bool {
        self.drafter.is_some()
    }
}

/// The scheduler's view of the pool: the block manager over the requests' tables.
struct Pool<'a> {
    blocks: &'a mut BlockManager,
    active: &'a mut HashMap<SeqId, Active>,
    transfers: &'a mut Vec<Transfer>,
    cache_enabled: bool,
}

impl KvBudget for Pool<'_> {
    fn admit(&mut self, id: SeqId) -> Option<usize> {
        let a = self
            .active
            .get_mut(&id)
            .expect("admitted requests are active");
        let cache = a.params.cache_prompt && self.cache_enabled;
        // A host-tier hit that the pool cannot take back now waits like a full pool.
        let table = self.blocks.start(&a.tokens, cache, self.transfers).ok()?;
        a.table = table;
        if !a.announced {
            a.cached = a.table.len();
        }
        Some(a.table.len())
    }

    fn reserve(&mut self, id: SeqId, positions: usize) -> bool {
        let a = self
            .active
            .get_mut(&id)
            .expect("running requests are active");
        self.blocks
            .reserve(&mut a.table, positions, self.transfers)
            .is_ok()
    }

    fn preempt(&mut self, id: SeqId) {
        let a = self
            .active
            .get_mut(&id)
            .expect("running requests are active");
        release(self.blocks, self.cache_enabled, a, true);
    }
}

impl Engine {
    /// Queues a request for the batched loop under `id` (unique among those not finished);
    /// [`Self::step_batch`] runs it, its output held to `constraint` when given. Fails,
    /// queuing nothing, on an empty prompt, one that leaves no room in the context,
    /// `max_tokens` 0, or bad sampling parameters.
    pub fn submit(
        &mut self,
        id: SeqId,
        prompt: &[u32],
        params: GenerateParams,
        constraint: Option<Constraint>,
    ) -> Result<()> {
        params.sampling.validate()?;
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if params.max_tokens == 0 {
            return Err(Error::NothingToGenerate);
        }
        if prompt.len() >= self.context() {
            return Err(Error::PromptTooLong {
                prompt_tokens: prompt.len(),
                context: self.context(),
            });
        }
        assert!(
            !self.batch.active.contains_key(&id),
            "request {id} is already running"
        );
        let limit = params.max_tokens.min(self.context() - prompt.len());
        let mut tokens = Vec::with_capacity(prompt.len() + limit);
        tokens.extend_from_slice(prompt);
        self.batch.active.insert(
            id,
            Active {
                tokens,
                prompt_len: prompt.len(),
                params,
                picker: Picker::new(params.sampling, constraint),
                table: BlockTable::new(),
                limit,
                cached: 0,
                announced: false,
                submitted: Instant::now(),
                first_token: None,
                drafted: 0,
                depth: Depth::new(&self.batch.draft),
                draft_stats: DraftStats::default(),
            },
        );
        self.batch.scheduler.add(id, prompt.len());
        Ok(())
    }

    /// Stops request `id` (a client gone): its blocks go back, its computed prefix stays in the
    /// cache. Returns whether it was running or queued.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        let known = self.batch.scheduler.remove(id);
        if let Some(mut a) = self.batch.active.remove(&id) {
            self.release(id, &mut a, true);
        }
        known
    }

    /// Requests the batched loop runs at once (`--parallel`).
    pub fn parallel(&self) -> usize {
        self.batch.scheduler.max_running()
    }

    /// Requests submitted and not yet finished.
    pub fn pending_requests(&self) -> usize {
        self.batch.active.len()
    }

    /// Where the batched loop's steps have spent their time so far.
    pub fn step_timing(&self) -> StepTiming {
        self.batch.timing
    }

    /// Whether the batched loop drafts tokens (speculative decoding).
    pub fn drafts(&self) -> bool {
        self.batch.drafts()
    }

    /// Drafts from `source` from now on, up to `max` tokens a pass and none shorter than `min`
    /// (in place of the one `--draft` loaded, if any): an embedder's own draft source, or a
    /// test's. Requests already submitted keep their depth. A pass never gives more rows of
    /// logits than the engine was loaded for (`EngineOptions::draft`'s `max`, when drafting).
    pub fn set_draft_source(&mut self, source: Box<dyn DraftSource>, max: usize, min: usize) {
        self.batch.draft.max = max;
        self.batch.draft.min = min;
        self.batch.drafter = Some(source);
    }

    /// Requests of the batched loop running now (holding KV blocks), and waiting to start.
    pub fn sequences(&self) -> (usize, usize) {
        let s = &self.batch.scheduler;
        (s.running(), s.waiting())
    }

    /// Runs one step of the batched loop: one forward pass over what the scheduler picks,
    /// then a token for each sequence whose prompt (or last token) it completed. `on_event`
    /// hears each request's news in order. Returns false when nothing is left to run.
    pub fn step_batch(&mut self, on_event: &mut dyn FnMut(SeqId, BatchEvent<'_>)) -> Result<bool> {
        if self.batch.scheduler.is_idle() {
            return Ok(false);
        }
        let started = Instant::now();
        let plan = {
            let Engine {
                blocks,
                batch,
                transfers,
                cache_enabled,
                ..
            } = self;
            let mut pool = Pool {
                blocks,
                active: &mut batch.active,
                transfers,
                cache_enabled: *cache_enabled,
            };
            batch.scheduler.schedule(&mut pool)
        };
        let mut plan = plan;
        let drafting = Instant::now();
        self.add_drafts(&mut plan.runs);
        self.batch.timing.propose += drafting.elapsed();
        self.run_transfers()?;
        self.batch.timing.schedule += started.elapsed();
        self.batch.timing.preemptions += plan.preempted.len();
        if !plan.preempted.is_empty() {
            tracing::debug!(
                "preempted {:?}: the KV pool ran out of blocks (--kv-pool-tokens)",
                plan.preempted
            );
        }
        if plan.runs.is_empty() {
            // Nothing fits beside nothing: the pool cannot hold the head of the queue alone.
            self.fail_unfittable(on_event);
            return Ok(!self.batch.scheduler.is_idle());
        }
        for run in &plan.runs {
            let a = self.batch.active.get_mut(&run.id).expect("scheduled");
            if !a.announced {
                a.announced = true;
                if a.params.cache_prompt && self.cache_enabled {
                    self.cache_stats.record_lookup(a.cached);
                }
                let cached_tokens = a.cached;
                on_event(run.id, BatchEvent::Prompt { cached_tokens });
            }
        }
        if let Err(e) = self.run_pass(&plan.runs, on_event) {
            // A failed pass may have written anything into its sequences' blocks: they all
            // end, caching nothing.
            let message = e.to_string();
            for run in &plan.runs {
                self.batch.scheduler.remove(run.id);
                if let Some(mut a) = self.batch.active.remove(&run.id) {
                    self.release(run.id, &mut a, false);
                    let error = Error::BatchFailed(message.clone());
                    on_event(run.id, BatchEvent::Failed(error));
                }
            }
            self.publish_cache_stats();
            return Err(e);
        }
        self.publish_cache_stats();
        Ok(!self.batch.scheduler.is_idle())
    }

    /// The forward pass of `runs` and the tokens it gives: greedy picks made where the logits
    /// are, and the logits brought to the host only when a request samples from them or
    /// asks for them.
    fn run_pass(
        &mut self,
        runs: &[Scheduled],
        on_event: &mut dyn FnMut(SeqId, BatchEvent<'_>),
    ) -> Result<()> {
        let vocab = self.config().vocab_size;
        let Engine {
            runner,
            batch,
            blocks,
            eos_ids,
            cache_enabled,
            ..
        } = self;
        let started = Instant::now();
        // The tables travel with the pass and come back after it.
        let mut tables: Vec<BlockTable> = runs
            .iter()
            .map(|r| std::mem::take(&mut batch.active.get_mut(&r.id).expect("run").table))
            .collect();
        // Constrained requests about to sample compute their next masks beside the pass.
        let mut constraints: Vec<(SeqId, Constraint)> = runs
            .iter()
            .filter(|r| r.samples)
            .filter_map(|r| {
                let a = batch.active.get_mut(&r.id).expect("run");
                a.picker.take_constraint().map(|c| (r.id, c))
            })
            .collect();
        let result = std::thread::scope(|scope| {
            if !constraints.is_empty() {
                scope.spawn(|| constraints.iter_mut().for_each(|(_, c)| c.prepare()));
            }
            let active = &batch.active;
            let mut passes: Vec<SequencePass<'_, '_>> = runs
                .iter()
                .zip(tables.iter_mut())
                .map(|(r, seq)| SequencePass {
                    seq,
                    tokens: &active[&r.id].tokens[r.start..r.start + r.tokens],
                    logits: match (r.samples, active[&r.id].drafted) {
                        (false, _) => Logits::None,
                        (true, 0) => Logits::Last,
                        // A row for the last token and one for each draft.
                        (true, _) => Logits::All,
                    },
                })
                .collect();
            runner.forward_batch(&mut passes)
        });
        for (r, table) in runs.iter().zip(tables) {
            batch.active.get_mut(&r.id).expect("run").table = table;
        }
        for (id, c) in constraints {
            let a = batch.active.get_mut(&id).expect("run");
            a.picker.restore_constraint(Some(c));
        }
        let rows = result?;
        let needs_logits = |r: &Scheduled| {
            let a = &batch.active[&r.id];
            !a.picker.is_plain_greedy() || a.params.step_logits
        };
        let sampling = || runs.iter().filter(|r| r.samples);
        let greedy = match sampling().all(needs_logits) {
            true => None,
            false => Some(runner.greedy_tokens(rows)?),
        };
        let logits = match sampling().any(needs_logits) {
            true => Some(runner.logits(rows)?),
            false => None,
        };
        // The pass's time: until its picks or logits are on the host (a device runs it
        // asynchronously).
        batch.timing.pass += started.elapsed();
        batch.timing.passes += 1;
        batch.timing.rows += runs.iter().map(|r| r.tokens).sum::<usize>();
        let started = Instant::now();
        let mut row = 0;
        for run in runs {
            if !run.samples {
                batch.scheduler.ran(run);
                continue;
            }
            let a = batch.active.get_mut(&run.id).expect("run");
            // The drafts ride at the end of the tokens for the pass only.
            let drafts = a.tokens.split_off(a.tokens.len() - a.drafted);
            a.drafted = 0;
            if drafts.is_empty() {
                batch.scheduler.ran(run);
            }
            let first_row = row;
            row += 1 + drafts.len();
            // The run's positions that hold its sequence's own tokens: the rest held drafts,
            // and those past the accepted ones are dropped.
            let real = run.start + run.tokens - drafts.len();
            // Row `j` follows the last token and the first `j` drafts: its pick counts while
            // every draft before it stood.
            let mut accepted = 0;
            let mut ended = false;
            for j in 0..=drafts.len() {
                let at = first_row + j;
                let step_logits = logits.map(|l| &l[at * vocab..(at + 1) * vocab]);
                let picked = match (&greedy, step_logits) {
                    (Some(picks), _) if a.picker.is_plain_greedy() && !a.params.step_logits => {
                        Ok((picks[at], None))
                    }
                    (_, Some(l)) => a
                        .picker
                        .pick(l, &a.tokens, a.prompt_len)
                        .map(|token| (token, Some(l))),
                    (_, None) => {
                        unreachable!("logits are on the host for every request that needs them")
                    }
                };
                let (token, step_logits) =
                    match picked.and_then(|(t, l)| a.picker.accept(t).map(|()| (t, l))) {
                        Ok(picked) => picked,
                        Err(e) => {
                            // Its constraint failed: this request ends, the others go on.
                            batch.scheduler.remove(run.id);
                            let mut a = batch.active.remove(&run.id).expect("run");
                            a.table.truncate(real + accepted);
                            release(blocks, *cache_enabled, &mut a, true);
                            on_event(run.id, BatchEvent::Failed(e));
                            ended = true;
                            break;
                        }
                    };
                let is_eos = eos_ids.contains(&token);
                a.first_token.get_or_insert_with(Instant::now);
                a.tokens.push(token);
                on_event(
                    run.id,
                    BatchEvent::Token {
                        token,
                        logits: step_logits,
                        is_eos,
                    },
                );
                let made = a.tokens.len() - a.prompt_len;
                // A complete grammar ends the reply as an end-of-sequence token would.
                let finish = if (is_eos && !a.params.ignore_eos) || a.picker.is_complete() {
                    Some(FinishReason::Stop)
                } else if made >= a.limit {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                if let Some(reason) = finish {
                    batch.scheduler.remove(run.id);
                    let mut a = batch.active.remove(&run.id).expect("run");
                    a.table.truncate(real + accepted);
                    a.draft_stats.drafted += drafts.len();
                    a.draft_stats.accepted += accepted;
                    release(blocks, *cache_enabled, &mut a, true);
                    on_event(run.id, BatchEvent::Finished(a.generation(reason)));
                    ended = true;
                    break;
                }
                if drafts.get(j) != Some(&token) {
                    break;
                }
                accepted += 1;
            }
            batch.timing.drafts.drafted += drafts.len();
            batch.timing.drafts.accepted += accepted;
            if ended {
                if let Some(drafter) = &mut batch.drafter {
                    drafter.finish(run.id);
                }
            } else if !drafts.is_empty() {
                let a = batch.active.get_mut(&run.id).expect("run");
                a.table.truncate(real + accepted);
                a.depth.update(drafts.len(), accepted);
                a.draft_stats.drafted += drafts.len();
                a.draft_stats.accepted += accepted;
                batch.scheduler.ran_drafted(run.id, accepted);
            }
        }
        batch.timing.sample += started.elapsed();
        Ok(())
    }

    /// Gives the plan's decoding runs the tokens the draft source proposes for them, each
    /// a row more to verify in the same pass: within the pass's tokens and rows of logits,
    /// blocks the pool has free (a draft never preempts), and what the request may still
    /// make; for a request held to a grammar, the drafts it allows (each row's pick is then
    /// masked as the tokens before it leave the grammar). Requests that opted out
    /// (`"draft": false`) are not drafted for, nor are any in a pass of more than
    /// [`DRAFT_STEP_ASIDE`] sampling runs.
    fn add_drafts(&mut self, runs: &mut [Scheduled]) {
        let Engine {
            batch,
            blocks,
            transfers,
            runner,
            ..
        } = self;
        let Some(drafter) = batch.drafter.as_mut() else {
            return;
        };
        let sampling = runs.iter().filter(|r| r.samples).count();
        if sampling == 0 || sampling > DRAFT_STEP_ASIDE {
            return;
        }
        let mut token_room = batch.max_tokens - runs.iter().map(|r| r.tokens).sum::<usize>();
        let mut logit_room = runner.logit_rows().saturating_sub(sampling);
        // Who drafts this pass and how far, room taken as if each got all it asks for; then
        // every proposal at once (a draft model's steps shared across the sequences).
        let mut asking = Vec::new();
        for (i, run) in runs.iter().enumerate() {
            if !(run.samples && run.tokens == 1) {
                continue;
            }
            let a = batch.active.get_mut(&run.id).expect("scheduled");
            if !a.params.draft {
                continue;
            }
            debug_assert_eq!(a.tokens.len(), run.start + 1);
            // What the request may make after this pass's own token.
            let left = a.limit - (a.tokens.len() - a.prompt_len) - 1;
            let want = a.depth.get().min(left).min(token_room).min(logit_room);
            if want < a.depth.min() || !a.depth.take_turn() {
                continue;
            }
            asking.push((i, want));
            token_room -= want;
            logit_room -= want;
        }
        if asking.is_empty() {
            return;
        }
        let asks: Vec<Proposal<'_>> = asking
            .iter()
            .map(|&(i, max)| Proposal {
                id: runs[i].id,
                tokens: &batch.active[&runs[i].id].tokens,
                max,
            })
            .collect();
        batch.proposals.resize_with(asks.len(), Vec::new);
        drafter.propose_all(&asks, &mut batch.proposals[..asks.len()]);
        drop(asks);
        for (&(i, want), proposal) in asking.iter().zip(&batch.proposals) {
            let run = &mut runs[i];
            let a = batch.active.get_mut(&run.id).expect("scheduled");
            let k = proposal.len().min(want);
            let k = a.picker.allowed_drafts(&proposal[..k]);
            if k < a.depth.min() {
                continue;
            }
            if blocks
                .reserve(&mut a.table, run.start + 1 + k, transfers)
                .is_err()
            {
                continue;
            }
            a.tokens.extend_from_slice(&proposal[..k]);
            a.drafted = k;
            run.tokens += k;
        }
    }

    /// Ends the request at the head of the queue, which cannot run even alone.
    fn fail_unfittable(&mut self, on_event: &mut dyn FnMut(SeqId, BatchEvent<'_>)) {
        let Some(id) = self.batch.scheduler.first_waiting() else {
            return;
        };
        self.batch.scheduler.remove(id);
        if let Some(mut a) = self.batch.active.remove(&id) {
            self.release(id, &mut a, false);
            let positions = a.tokens.len();
            on_event(id, BatchEvent::Failed(Error::PoolTooSmall { positions }));
        }
    }

    /// Request `id` ends: [`release`] of the engine's pool, and the draft source forgets it.
    fn release(&mut self, id: SeqId, a: &mut Active, cache: bool) {
        release(&mut self.blocks, self.cache_enabled, a, cache);
        if let Some(drafter) = &mut self.batch.drafter {
            drafter.finish(id);
        }
    }
}

/// Gives a request's blocks back; with `cache` (and its `cache_prompt`, and a cache), its
/// filled full blocks stay in the prompt cache.
fn release(blocks: &mut BlockManager, cache_enabled: bool, a: &mut Active, cache: bool) {
    let keep = cache && a.params.cache_prompt && cache_enabled;
    let filled = a.table.len().min(a.tokens.len());
    blocks.finish(&mut a.table, &a.tokens[..filled], keep);
}

impl Active {
    fn generation(&self, finish_reason: FinishReason) -> Generation {
        let first = self.first_token.unwrap_or_else(Instant::now);
        Generation {
            tokens: self.tokens[self.prompt_len..].to_vec(),
            finish_reason,
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached,
            prefill_time: first - self.submitted,
            decode_time: first.elapsed(),
            drafted_tokens: self.draft_stats.drafted,
            accepted_tokens: self.draft_stats.accepted,
        }
    }
}
