//! One model split across ranks ([`ember_models::parallel`]) behind the one [`Runner`] the
//! engine drives: rank 0 runs on the engine's thread, every other rank on a thread of its
//! own, each with its backend, its share of the weights and a KV pool of its heads. Every call
//! goes to every rank in the same order (their collectives meet inside the pass); the engine
//! reads rank 0's logits and picks, which are every rank's (the logits are gathered whole).
//!
//! The ranks' pools are alike block for block, so one [`BlockTable`] serves them all and the
//! engine's block manager stays as it is: a prompt cache copy to or from the host tier goes to
//! every rank.
//!
//! A rank that fails (an error, a panic) stops the group, so no rank waits forever in a
//! collective for it; the call fails with why, and so does every call after: a group whose
//! ranks have left their lock-step cannot be trusted again.

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use ember_models::parallel::GroupAborted;
use ember_models::{BlockTable, KvLayout, KvStore, Logits, ModelConfig, PassInput, SequencePass};
use ember_tensor::BufferOwner;

use super::Runner;
use crate::engine::RankFault;
use crate::error::{Error, Result};

/// Stops the ranks' group: every collective waiting now or later fails with the reason given
/// ([`ember_models::parallel::HostGroup::abort`] on the CPU).
pub(crate) type AbortGroup = Arc<dyn Fn(&str) + Send + Sync>;

/// What rank 0 asks of the other ranks: the calls of [`Runner`] that touch a rank's model or
/// pool, with what they borrow copied.
enum Command {
    Forward {
        seq: BlockTable,
        tokens: Vec<u32>,
        logits: Logits,
    },
    ForwardBatch(Vec<(BlockTable, Vec<u32>, Logits)>),
    ForwardGreedy {
        seq: BlockTable,
        tokens: Vec<u32>,
    },
    /// `None`: the pick of the pass before, fed where it was made.
    ForwardAhead {
        seq: BlockTable,
        tokens: Option<Vec<u32>>,
    },
    ReadPick,
    SaveToHost {
        block: u32,
        slot: u32,
    },
    LoadFromHost {
        slot: u32,
        block: u32,
    },
    ProfilerCapture(bool),
    MeasureBandwidth {
        owner: BufferOwner,
        bytes: usize,
        passes: usize,
    },
}

impl Command {
    /// Whether it runs the model (and meets the other ranks in collectives).
    fn is_pass(&self) -> bool {
        matches!(
            self,
            Command::Forward { .. }
                | Command::ForwardBatch(_)
                | Command::ForwardGreedy { .. }
                | Command::ForwardAhead { .. }
        )
    }
}

/// What a rank answers a command with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    Done,
    /// Its greedy pick.
    Pick(u32),
    /// Its memory's bandwidth, GB/s.
    Rate(f64),
}

/// Why a rank failed a command: its own error, or the group stopped by another (whose reason,
/// naming it, is the story).
#[derive(Debug)]
enum Failure {
    Own(String),
    Stopped(String),
}

impl Failure {
    fn of(e: Error) -> Failure {
        match e {
            Error::Model(ember_models::Error::RankFailed(GroupAborted(why))) => {
                Failure::Stopped(why)
            }
            e => Failure::Own(e.to_string()),
        }
    }
}

type Reply = std::result::Result<Answer, Failure>;

/// A rank other than 0: its thread and the channels to it.
struct RankThread {
    rank: usize,
    commands: Option<Sender<Command>>,
    replies: Receiver<Reply>,
    /// Commands sent whose replies are not yet read.
    outstanding: Cell<usize>,
    thread: Option<JoinHandle<()>>,
}

/// The runner's coordination goes through `&self` (a cell for each count, one for the
/// failure) so that the trait's `&self` calls (a bandwidth probe, a profiler's capture) reach
/// every rank too; the runner is one thread's.
pub(crate) struct TensorParallelRunner {
    lead: Box<dyn Runner>,
    others: Vec<RankThread>,
    abort: AbortGroup,
    /// The whole model's shapes (each rank's runner has its share's).
    config: ModelConfig,
    /// Each rank's pool's geometry (its key-value heads').
    layout: KvLayout,
    weight_bytes_per_token: usize,
    threads: usize,
    /// Each rank's pool's blocks and host tier's slots.
    pool_blocks: (usize, usize),
    /// Why the group stopped, once it has: every later call fails with it.
    failure: RefCell<Option<String>>,
}

impl TensorParallelRunner {
    /// Drives `ranks` (rank 0 first, each loaded with its shard of `config` and joined to
    /// the group that `abort` stops) as one runner.
    pub(crate) fn new(
        ranks: Vec<Box<dyn Runner>>,
        config: ModelConfig,
        abort: AbortGroup,
        fault: Option<RankFault>,
    ) -> Result<TensorParallelRunner> {
        let mut ranks = ranks.into_iter();
        let mut lead = ranks.next().expect("a group has a rank 0");
        let pool_blocks = (lead.kv().blocks(), lead.kv().host_blocks());
        let mut weight_bytes_per_token = lead.weight_bytes_per_token();
        let mut threads = lead.threads();
        let mut others = Vec::new();
        for (i, runner) in ranks.enumerate() {
            let rank = i + 1;
            weight_bytes_per_token += runner.weight_bytes_per_token();
            threads += runner.threads();
            let (commands, inbox) = channel();
            let (outbox, replies) = channel();
            let abort = Arc::clone(&abort);
            let fail_at = fault.filter(|f| f.rank == rank).map(|f| f.pass);
            let thread = std::thread::Builder::new()
                .name(format!("ember-rank-{rank}"))
                .spawn(move || serve_rank(rank, runner, inbox, outbox, abort, fail_at))?;
            others.push(RankThread {
                rank,
                commands: Some(commands),
                replies,
                outstanding: Cell::new(0),
                thread: Some(thread),
            });
        }
        Ok(TensorParallelRunner {
            layout: lead.kv_layout(),
            lead,
            others,
            abort,
            config,
            weight_bytes_per_token,
            threads,
            pool_blocks,
            failure: RefCell::new(None),
        })
    }

    pub(crate) fn ranks(&self) -> usize {
        1 + self.others.len()
    }

    /// Runs `lead` on rank 0 while every other rank runs `command`, then waits for them all;
    /// the picks they made must be rank 0's.
    fn together<T>(
        &mut self,
        command: impl Fn() -> Command,
        lead: impl FnOnce(&mut dyn Runner) -> Result<T>,
        pick: impl Fn(&T) -> Option<u32>,
    ) -> Result<T> {
        self.send(command)?;
        let result = lead(self.lead.as_mut());
        self.lead_done(result.as_ref().err());
        let answers = self.collect();
        match (result, answers) {
            (Err(_), _) => Err(self.stopped()),
            (Ok(_), Err(e)) => Err(e),
            (Ok(out), Ok(answers)) => {
                let ours = pick(&out);
                for (rank, answer) in answers {
                    let theirs = match answer {
                        Answer::Pick(p) => Some(p),
                        _ => None,
                    };
                    if theirs != ours {
                        return Err(self.fail(format!(
                            "the ranks picked different tokens (rank 0 {ours:?}, rank {rank} \
                             {theirs:?})"
                        )));
                    }
                }
                Ok(out)
            }
        }
    }

    /// After rank 0's part of a call: where it failed, the others may be waiting in a
    /// collective it will never reach, so the group stops. Where rank 0 failed because
    /// another stopped the group, that rank's reason is the story.
    fn lead_done(&self, error: Option<&Error>) {
        let Some(e) = error else { return };
        let why = match e {
            Error::Model(ember_models::Error::RankFailed(GroupAborted(why))) => why.clone(),
            e => format!("rank 0: {e}"),
        };
        (self.abort)(&why);
        self.failure.borrow_mut().get_or_insert(why);
    }

    /// The error of a group that has stopped.
    fn stopped(&self) -> Error {
        let why = self.failure.borrow().clone();
        Error::GroupFailed(why.unwrap_or_else(|| "it was stopped".into()))
    }

    /// Sends `command` to every rank but 0, not waiting for them.
    fn send(&self, command: impl Fn() -> Command) -> Result<()> {
        if self.failure.borrow().is_some() {
            return Err(self.stopped());
        }
        for other in &self.others {
            let sent = other
                .commands
                .as_ref()
                .is_some_and(|c| c.send(command()).is_ok());
            if !sent {
                let why = format!("rank {}: its thread has stopped", other.rank);
                return Err(self.fail(why));
            }
            other.outstanding.set(other.outstanding.get() + 1);
        }
        Ok(())
    }

    /// Every rank's replies to the commands sent so far, the answers to the last ones; the
    /// first failure (by rank) fails the group.
    fn collect(&self) -> Result<Vec<(usize, Answer)>> {
        let mut answers = Vec::with_capacity(self.others.len());
        // A rank's own failure (the first, by rank) before the others', which only say the
        // group stopped.
        let (mut own, mut stopped) = (None, None);
        for other in &self.others {
            let mut last = Answer::Done;
            while other.outstanding.get() > 0 {
                other.outstanding.set(other.outstanding.get() - 1);
                match other.replies.recv() {
                    Ok(Ok(answer)) => last = answer,
                    Ok(Err(Failure::Own(why))) => {
                        own.get_or_insert(format!("rank {}: {why}", other.rank));
                    }
                    Ok(Err(Failure::Stopped(why))) => {
                        stopped.get_or_insert(why);
                    }
                    Err(_) => {
                        own.get_or_insert(format!("rank {}: its thread has stopped", other.rank));
                        other.outstanding.set(0);
                    }
                }
            }
            answers.push((other.rank, last));
        }
        match own.or(stopped) {
            Some(why) => Err(self.fail(why)),
            None => Ok(answers),
        }
    }

    /// A copy between a pool and its host tier on every rank: sent to the others, not waited
    /// for (a failure there fails the next pass).
    fn copy_everywhere(
        &mut self,
        command: impl Fn() -> Command,
        lead: impl FnOnce(&mut dyn KvStore) -> ember_models::Result<()>,
    ) -> ember_models::Result<()> {
        let stopped = |e: Error| ember_models::Error::RankFailed(GroupAborted(e.to_string()));
        self.send(command).map_err(stopped)?;
        lead(self.lead.kv()).map_err(|e| stopped(self.fail(format!("rank 0: {e}"))))
    }

    /// Stops the group for good with `why`, and the error that says so.
    fn fail(&self, why: String) -> Error {
        (self.abort)(&why);
        self.failure.borrow_mut().get_or_insert(why);
        self.stopped()
    }
}

/// A rank's thread: runs each command on its `runner` in order and answers it, until the
/// channel closes or a command fails (which stops the group first). Its forward pass number
/// `fail_at` fails on purpose ([`RankFault`]).
fn serve_rank(
    rank: usize,
    mut runner: Box<dyn Runner>,
    commands: Receiver<Command>,
    replies: Sender<Reply>,
    abort: AbortGroup,
    fail_at: Option<usize>,
) {
    let mut passes = 0;
    for command in commands {
        if command.is_pass() {
            passes += 1;
        }
        let reply = if fail_at == Some(passes) && command.is_pass() {
            let why = format!("a fault injected for a test (pass {passes})");
            Err(Failure::Own(why))
        } else {
            catch_unwind(AssertUnwindSafe(|| run(runner.as_mut(), command))).unwrap_or_else(
                |panic| {
                    Err(Failure::Own(format!(
                        "panicked: {}",
                        panic_message(&*panic)
                    )))
                },
            )
        };
        let failed = reply.is_err();
        if let Err(Failure::Own(why)) = &reply {
            abort(&format!("rank {rank}: {why}"));
        }
        if replies.send(reply).is_err() || failed {
            return;
        }
    }
}

fn run(runner: &mut dyn Runner, command: Command) -> Reply {
    let done = |r: Result<()>| r.map(|()| Answer::Done).map_err(Failure::of);
    match command {
        Command::Forward {
            mut seq,
            tokens,
            logits,
        } => done(runner.forward(&mut seq, &tokens, logits).map(drop)),
        Command::ForwardBatch(mut seqs) => {
            let mut passes: Vec<SequencePass<'_, '_>> = seqs
                .iter_mut()
                .map(|(seq, tokens, logits)| SequencePass {
                    seq,
                    tokens,
                    logits: *logits,
                })
                .collect();
            done(runner.forward_batch(&mut passes).map(drop))
        }
        Command::ForwardGreedy { mut seq, tokens } => runner
            .forward_greedy(&mut seq, &tokens)
            .map(Answer::Pick)
            .map_err(Failure::of),
        Command::ForwardAhead { mut seq, tokens } => {
            let input = match &tokens {
                Some(tokens) => PassInput::Tokens(tokens),
                None => PassInput::Fed,
            };
            done(runner.forward_ahead(&mut seq, input))
        }
        Command::ReadPick => runner.read_pick().map(Answer::Pick).map_err(Failure::of),
        Command::MeasureBandwidth {
            owner,
            bytes,
            passes,
        } => runner
            .measure_bandwidth(&owner, bytes, passes)
            .map(Answer::Rate)
            .map_err(Failure::of),
        Command::SaveToHost { block, slot } => {
            done(runner.kv().save_to_host(block, slot).map_err(Error::from))
        }
        Command::LoadFromHost { slot, block } => {
            done(runner.kv().load_from_host(slot, block).map_err(Error::from))
        }
        Command::ProfilerCapture(on) => done(runner.profiler_capture(on)),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".into(),
    }
}

impl Drop for TensorParallelRunner {
    fn drop(&mut self) {
        // Closing the channels ends each rank's loop; the abort frees any rank still inside
        // a collective (none is, unless the group already failed).
        for other in &mut self.others {
            other.commands = None;
        }
        (self.abort)("the engine stopped");
        for other in &mut self.others {
            if let Some(thread) = other.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

impl Runner for TensorParallelRunner {
    fn forward(&mut self, seq: &mut BlockTable, tokens: &[u32], logits: Logits) -> Result<&[f32]> {
        let table = seq.clone();
        let rows = self.together(
            || Command::Forward {
                seq: table.clone(),
                tokens: tokens.to_vec(),
                logits,
            },
            |lead| {
                lead.forward_batch(&mut [SequencePass {
                    seq,
                    tokens,
                    logits,
                }])
            },
            |_| None,
        )?;
        // The pass's logits as rank 0 left them: what its own `forward` returns.
        match rows {
            0 => Ok(&[]),
            rows => self.lead.logits(rows),
        }
    }

    fn forward_batch(&mut self, seqs: &mut [SequencePass<'_, '_>]) -> Result<usize> {
        let copies: Vec<_> = seqs
            .iter()
            .map(|p| (p.seq.clone(), p.tokens.to_vec(), p.logits))
            .collect();
        self.together(
            || Command::ForwardBatch(copies.clone()),
            |lead| lead.forward_batch(seqs),
            |_| None,
        )
    }

    fn logits(&mut self, rows: usize) -> Result<&[f32]> {
        self.lead.logits(rows)
    }

    fn greedy_tokens(&mut self, rows: usize) -> Result<Vec<u32>> {
        self.lead.greedy_tokens(rows)
    }

    fn forward_greedy(&mut self, seq: &mut BlockTable, tokens: &[u32]) -> Result<u32> {
        let table = seq.clone();
        self.together(
            || Command::ForwardGreedy {
                seq: table.clone(),
                tokens: tokens.to_vec(),
            },
            |lead| lead.forward_greedy(seq, tokens),
            |pick| Some(*pick),
        )
    }

    fn forward_ahead(&mut self, seq: &mut BlockTable, input: PassInput<'_>) -> Result<()> {
        let table = seq.clone();
        let tokens = match input {
            PassInput::Tokens(tokens) => Some(tokens.to_vec()),
            PassInput::Fed => None,
        };
        self.together(
            || Command::ForwardAhead {
                seq: table.clone(),
                tokens: tokens.clone(),
            },
            |lead| lead.forward_ahead(seq, input),
            |_| None,
        )
    }

    fn read_pick(&mut self) -> Result<u32> {
        // Every rank reads its own: each keeps its picks where it made them, and the next
        // fed pass takes its own.
        self.together(|| Command::ReadPick, |lead| lead.read_pick(), |p| Some(*p))
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn max_batch(&self) -> usize {
        self.lead.max_batch()
    }

    fn logit_rows(&self) -> usize {
        self.lead.logit_rows()
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn kv(&mut self) -> &mut dyn KvStore {
        self
    }

    fn context(&self) -> usize {
        self.lead.context()
    }

    /// Every rank's bytes: what one token reads in all.
    fn weight_bytes_per_token(&self) -> usize {
        self.weight_bytes_per_token
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn device_label(&self) -> String {
        format!(
            "{} x {} ranks (tensor parallel)",
            self.lead.device_label(),
            self.ranks()
        )
    }

    /// Every rank's memory measured at once, the rates added: with [`Self::weight_bytes_per_token`]
    /// (every rank's bytes) the bound of ranks that read their shares side by side, whether
    /// they share one memory (CPU threads) or each has its own (GPUs).
    fn measure_bandwidth(&self, owner: &BufferOwner, bytes: usize, passes: usize) -> Result<f64> {
        self.send(|| Command::MeasureBandwidth {
            owner: owner.clone(),
            bytes,
            passes,
        })?;
        let ours = self.lead.measure_bandwidth(owner, bytes, passes);
        self.lead_done(ours.as_ref().err());
        let answers = self.collect();
        let ours = ours.map_err(|_| self.stopped())?;
        let rates = answers?.into_iter().map(|(_, answer)| match answer {
            Answer::Rate(rate) => rate,
            _ => 0.0,
        });
        Ok(ours + rates.sum::<f64>())
    }

    fn profiler_capture(&self, on: bool) -> Result<()> {
        // Capture is a device's: the other ranks' are asked too, not waited for.
        self.send(|| Command::ProfilerCapture(on))?;
        self.lead.profiler_capture(on)
    }
}

/// The ranks' pools as one: a copy to or from the host tier happens on every rank, in the
/// order sent (a rank runs its commands in order, so a copy lands before the pass after it).
impl KvStore for TensorParallelRunner {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn blocks(&self) -> usize {
        self.pool_blocks.0
    }

    fn host_blocks(&self) -> usize {
        self.pool_blocks.1
    }

    fn save_to_host(&mut self, block: u32, slot: u32) -> ember_models::Result<()> {
        self.copy_everywhere(
            || Command::SaveToHost { block, slot },
            |kv| kv.save_to_host(block, slot),
        )
    }

    fn load_from_host(&mut self, slot: u32, block: u32) -> ember_models::Result<()> {
        self.copy_everywhere(
            || Command::LoadFromHost { slot, block },
            |kv| kv.load_from_host(slot, block),
        )
    }
}

#[cfg(test)]
mod tests;
