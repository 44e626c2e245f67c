//! The engine thread: takes jobs off a bounded queue, in order, and streams token events back.
//!
//! The engine is not `Sync` and a forward pass takes milliseconds to seconds, so it lives on a
//! thread of its own rather than in the async runtime. Routes talk to it through [`Job`]s and
//! per-job event channels; a job is cancelled (at its next token) when its cancel flag is set
//! or nobody listens to its events any more.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ember_engine::detokenizer::StreamDecoder;
use ember_engine::sampler::{logprob_of, top_logprobs};
use ember_engine::{Engine, FinishReason, GenerateParams};
use ember_residency::Keepalive;
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// One generation request, tokenized and validated.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
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

/// Runs jobs until the queue closes. `abort` cancels the running job and fails queued ones
/// (a shutdown past its grace period). Each job runs inside a keepalive request: ticking pauses
/// and staged residency changes are committed before its first forward pass.
pub fn run(
    mut engine: Engine,
    mut queue: mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    keepalive: Option<Arc<Keepalive>>,
    abort: Arc<AtomicBool>,
) {
    let tokenizer = engine.tokenizer().clone();
    while let Some(job) = queue.blocking_recv() {
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        if abort.load(Ordering::Relaxed) {
            let _ = job
                .events
                .send(Event::Failed("the server is shutting down".into()));
            continue;
        }
        if job.cancel.load(Ordering::Relaxed) || job.events.send(Event::Started).is_err() {
            continue;
        }
        let picked = Instant::now();
        let _request = keepalive.as_ref().map(|k| k.request());
        let committed = Instant::now();
        metrics.running.fetch_add(1, Ordering::Relaxed);
        metrics
            .prompt_tokens
            .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        let mut decoder = StreamDecoder::new(tokenizer.clone());
        let ignore_eos = job.params.ignore_eos;
        let started = Instant::now();
        let mut first_sent = None;
        let stop = || job.cancel.load(Ordering::Relaxed) || abort.load(Ordering::Relaxed);
        let result = engine.generate_until(&job.prompt, &job.params, &stop, |step| {
            if stop() {
                return ControlFlow::Break(());
            }
            if first_sent.is_none() {
                let cached_tokens = step.cached_tokens;
                if job.events.send(Event::Prompt { cached_tokens }).is_err() {
                    job.cancel.store(true, Ordering::Relaxed);
                    return ControlFlow::Break(());
                }
            }
            let text = if step.is_eos && !ignore_eos {
                String::new()
            } else {
                decoder.push(step.token).unwrap_or_default()
            };
            // The job's params ask for each step's logits whenever it wants log-probabilities.
            let (logprob, top) = match (job.logprobs, step.logits) {
                (Some(n), Some(logits)) => (
                    Some(logprob_of(logits, step.token)),
                    top_logprobs(logits, n),
                ),
                _ => (None, Vec::new()),
            };
            let event = Event::Token(TokenEvent {
                id: step.token,
                text,
                logprob,
                top_logprobs: top,
            });
            if job.events.send(event).is_err() {
                job.cancel.store(true, Ordering::Relaxed);
                return ControlFlow::Break(());
            }
            first_sent.get_or_insert_with(Instant::now);
            ControlFlow::Continue(())
        });
        metrics.running.fetch_sub(1, Ordering::Relaxed);
        match result {
            // A generation cut short by shutdown must not look finished to its client.
            Ok(_) if abort.load(Ordering::Relaxed) => {
                let _ = job.events.send(Event::Failed(
                    "the server shut down before the request finished".into(),
                ));
            }
            Ok(generation) => {
                metrics
                    .generation_tokens
                    .fetch_add(generation.tokens.len() as u64, Ordering::Relaxed);
                if let Some(tail) = decoder.flush() {
                    let _ = job.events.send(Event::Tail(tail));
                }
                let _ = job.events.send(Event::Finished {
                    finish_reason: generation.finish_reason,
                    completion_tokens: generation.tokens.len(),
                });
                let ms = |from: Instant, to: Instant| (to - from).as_secs_f64() * 1e3;
                let first_sent = first_sent.unwrap_or(started);
                // The first token's time from the request's arrival, step by step: parsing,
                // template and tokenizer; the queue; the residency commit; the prefill (and
                // sampling) to the first token; handing it to the HTTP side.
                tracing::debug!(
                    prompt_tokens = generation.prompt_tokens,
                    cached_tokens = generation.cached_tokens,
                    completion_tokens = generation.tokens.len(),
                    seconds = started.elapsed().as_secs_f64(),
                    first_token_ms = ms(job.arrived, first_sent),
                    prepare_ms = ms(job.arrived, job.queued),
                    queue_ms = ms(job.queued, picked),
                    commit_ms = ms(picked, committed),
                    prefill_ms = generation.prefill_time.as_secs_f64() * 1e3,
                    "request done"
                );
            }
            // Stopped mid-prefill: the client left (nobody reads) or the server is stopping.
            Err(e) if e.is_cancellation() => {
                let message = if abort.load(Ordering::Relaxed) {
                    "the server shut down before the request finished"
                } else {
                    "the request was cancelled"
                };
                let _ = job.events.send(Event::Failed(message.into()));
            }
            Err(e) => {
                tracing::warn!("generation failed: {e}");
                let _ = job.events.send(Event::Failed(e.to_string()));
            }
        }
    }
}
