//! The engine thread: takes jobs off a bounded queue, in order, and streams token events back.
//!
//! The engine is not `Sync` and a forward pass takes milliseconds to seconds, so it lives on a
//! thread of its own rather than in the async runtime. Routes talk to it through [`Job`]s and
//! per-job event channels; a job is cancelled (at its next token) when its cancel flag is set
//! or nobody listens to its events any more.

mod batched;
mod serial;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ember_engine::constraint::Constraint;
use ember_engine::detokenizer::StreamDecoder;
use ember_engine::sampler::{logprob_of, top_logprobs};
use ember_engine::tokenizer::Tokenizer;
use ember_engine::{Engine, FinishReason, GenerateParams, Generation};
use ember_residency::Keepalive;
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// One generation request, tokenized and validated.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
    /// What the output must match, compiled before the job was queued.
    pub constraint: Option<Constraint>,
    /// Report each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    pub cancel: Arc<AtomicBool>,
    pub events: mpsc::UnboundedSender<Event>,
    /// When the HTTP request arrived, and when the job was queued (after parsing, the chat
    /// template and tokenizing): the debug line `request done` splits the first token's time
    /// into these steps.
    pub arrived: Instant,
    pub queued: Instant,
}

#[derive(Debug)]
pub enum Event {
    /// The job left the queue and generation began.
    Started,
    Token(TokenEvent),
    /// Text the detokenizer held back until the end.
    Tail(String),
    /// Before the first token: how many prompt tokens came from the prompt cache.
    Prompt {
        cached_tokens: usize,
    },
    Finished {
        finish_reason: FinishReason,
        completion_tokens: usize,
        /// Tokens drafted for the request and verified, and those accepted.
        drafted_tokens: usize,
        accepted_tokens: usize,
    },
    /// The engine failed; the message is for the client.
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub id: u32,
    /// New text, complete UTF-8; empty for special tokens and held-back partial characters.
    pub text: String,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Sets a job's cancel flag when dropped: a client that goes away stops its generation.
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs jobs until the queue closes: many at once through the engine's batched loop when it
/// runs more than one sequence or drafts ([`batched`]), else one after another ([`serial`], which keeps
/// a GPU's greedy picks on the device until its passes serve several sequences). `abort`
/// cancels the running jobs and fails queued ones (a shutdown past its grace period). Jobs run
/// inside a keepalive request: ticking pauses and staged residency changes are committed
/// before their first forward pass. Returns the error that stopped the engine for good, if
/// one did ([`ember_engine::Error::is_fatal`]: a tensor-parallel rank lost); every job running
/// or queued then has failed with it, and the queue is closed.
pub fn run(
    engine: Engine,
    queue: mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    keepalive: Option<Arc<Keepalive>>,
    abort: Arc<AtomicBool>,
) -> Option<ember_engine::Error> {
    // Drafts are verified in the batched loop's passes, one sequence or many.
    if engine.parallel() > 1 || engine.drafts() {
        batched::run(engine, queue, metrics, keepalive, abort)
    } else {
        serial::run(engine, queue, metrics, keepalive, abort)
    }
}

/// After a fatal engine error: no job is taken any more, and those waiting fail with
/// `message`.
fn fail_queued(queue: &mut mpsc::Receiver<Job>, message: &str, metrics: &Metrics) {
    queue.close();
    while let Ok(job) = queue.try_recv() {
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        let _ = job.events.send(Event::Failed(message.into()));
    }
}

/// A job the engine has taken: its stream of events and what its debug line reports.
struct Stream {
    job: Job,
    decoder: StreamDecoder,
    picked: Instant,
    committed: Instant,
    started: Instant,
    first_sent: Option<Instant>,
    /// Tokens made for it so far (counted in the metrics however it ends).
    made: u64,
}

impl Stream {
    /// Takes `job` off the queue: `None` (the job dropped) when it was cancelled or its
    /// client is gone, or, failed, when the server is stopping.
    fn start(job: Job, tokenizer: &Arc<Tokenizer>, abort: &AtomicBool) -> Option<Stream> {
        if abort.load(Ordering::Relaxed) {
            let _ = job
                .events
                .send(Event::Failed("the server is shutting down".into()));
            return None;
        }
        if job.cancel.load(Ordering::Relaxed) || job.events.send(Event::Started).is_err() {
            return None;
        }
        let now = Instant::now();
        Some(Stream {
            job,
            decoder: StreamDecoder::new(Arc::clone(tokenizer)),
            picked: now,
            committed: now,
            started: now,
            first_sent: None,
            made: 0,
        })
    }

    fn cancelled(&self, abort: &AtomicBool) -> bool {
        self.job.cancel.load(Ordering::Relaxed) || abort.load(Ordering::Relaxed)
    }

    /// Before the first token: how many prompt tokens the cache gave. False when the
    /// client is gone (the job is then marked cancelled).
    fn prompt(&mut self, cached_tokens: usize) -> bool {
        self.send(Event::Prompt { cached_tokens })
    }

    /// One token, its text, and its log-probabilities when the job asks for them (`logits`
    /// must then be given). False when the client is gone.
    fn token(&mut self, token: u32, logits: Option<&[f32]>, is_eos: bool) -> bool {
        self.made += 1;
        let text = if is_eos && !self.job.params.ignore_eos {
            String::new()
        } else {
            self.decoder.push(token).unwrap_or_default()
        };
        let (logprob, top_logprobs) = match (self.job.logprobs, logits) {
            (Some(n), Some(logits)) => (Some(logprob_of(logits, token)), top_logprobs(logits, n)),
            _ => (None, Vec::new()),
        };
        let sent = self.send(Event::Token(TokenEvent {
            id: token,
            text,
            logprob,
            top_logprobs,
        }));
        self.first_sent.get_or_insert_with(Instant::now);
        sent
    }

    fn send(&mut self, event: Event) -> bool {
        if self.job.events.send(event).is_err() {
            self.job.cancel.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The end of a generation: the held-back text, the finish, the counters and the
    /// request's debug line.
    fn finish(mut self, generation: &Generation, metrics: &Metrics, abort: &AtomicBool) {
        // A generation cut short by shutdown must not look finished to its client.
        if abort.load(Ordering::Relaxed) {
            self.fail("the server shut down before the request finished", metrics);
            return;
        }
        metrics
            .generation_tokens
            .fetch_add(self.made, Ordering::Relaxed);
        metrics
            .draft_tokens
            .fetch_add(generation.drafted_tokens as u64, Ordering::Relaxed);
        metrics
            .draft_accepted_tokens
            .fetch_add(generation.accepted_tokens as u64, Ordering::Relaxed);
        if let Some(tail) = self.decoder.flush() {
            self.send(Event::Tail(tail));
        }
        self.send(Event::Finished {
            finish_reason: generation.finish_reason,
            completion_tokens: generation.tokens.len(),
            drafted_tokens: generation.drafted_tokens,
            accepted_tokens: generation.accepted_tokens,
        });
        let ms = |from: Instant, to: Instant| (to - from).as_secs_f64() * 1e3;
        let first_sent = self.first_sent.unwrap_or(self.started);
        let job = &self.job;
        // The first token's time from the request's arrival, step by step: parsing,
        // template and tokenizer; the queue; the residency commit; the prefill (and
        // sampling) to the first token; handing it to the HTTP side.
        tracing::debug!(
            prompt_tokens = generation.prompt_tokens,
            cached_tokens = generation.cached_tokens,
            completion_tokens = generation.tokens.len(),
            drafted_tokens = generation.drafted_tokens,
            accepted_tokens = generation.accepted_tokens,
            seconds = self.started.elapsed().as_secs_f64(),
            first_token_ms = ms(job.arrived, first_sent),
            prepare_ms = ms(job.arrived, job.queued),
            queue_ms = ms(job.queued, self.picked),
            commit_ms = ms(self.picked, self.committed),
            prefill_ms = generation.prefill_time.as_secs_f64() * 1e3,
            "request done"
        );
    }

    /// Ends the job with a message for its client: a cancellation (the client left, or the
    /// server is stopping) or an engine error.
    fn fail(mut self, message: &str, metrics: &Metrics) {
        metrics
            .generation_tokens
            .fetch_add(self.made, Ordering::Relaxed);
        self.send(Event::Failed(message.into()));
    }

    /// Why a job stopped before its end: the server stopping or its client gone.
    fn cancellation(abort: &AtomicBool) -> &'static str {
        if abort.load(Ordering::Relaxed) {
            "the server shut down before the request finished"
        } else {
            "the request was cancelled"
        }
    }
}
