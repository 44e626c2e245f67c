//! Many jobs at once through the engine's batched loop: each step takes the jobs that have
//! arrived, drops the cancelled, runs one forward pass over what the scheduler picks, and
//! routes each request's tokens to its stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ember_engine::{BatchEvent, Engine, StepTiming};
use ember_residency::Keepalive;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;

use super::{Job, Stream};
use crate::metrics::Metrics;

pub(super) fn run(
    mut engine: Engine,
    mut queue: mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    keepalive: Option<Arc<Keepalive>>,
    abort: Arc<AtomicBool>,
) -> Option<ember_engine::Error> {
    let tokenizer = engine.tokenizer().clone();
    let parallel = engine.parallel();
    let mut streams: HashMap<u64, Stream> = HashMap::new();
    let mut next_id = 0u64;
    // Held while any job runs: the keepalive neither ticks nor leaves staged buffers
    // uncommitted under a request.
    let mut request = None;
    let mut open = true;
    while open || !streams.is_empty() {
        // New jobs: wait for one when idle, else take what has arrived, up to `--parallel`
        // running; the rest wait in the queue, whose bound (`--max-queue`) turns more away.
        let mut arrived = Vec::new();
        if streams.is_empty() {
            match queue.blocking_recv() {
                Some(job) => arrived.push(job),
                None => break,
            }
        }
        while open && streams.len() + arrived.len() < parallel {
            match queue.try_recv() {
                Ok(job) => arrived.push(job),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        for job in arrived {
            metrics.queued.fetch_sub(1, Ordering::Relaxed);
            let Some(mut stream) = Stream::start(job, &tokenizer, &abort) else {
                continue;
            };
            if request.is_none() {
                request = keepalive.as_ref().map(|k| k.request());
            }
            stream.committed = Instant::now();
            stream.started = stream.committed;
            let constraint = stream.job.constraint.take();
            let (prompt, params) = (&stream.job.prompt, stream.job.params);
            if let Err(e) = engine.submit(next_id, prompt, params, constraint) {
                stream.fail(&e.to_string(), &metrics);
                continue;
            }
            metrics
                .prompt_tokens
                .fetch_add(prompt.len() as u64, Ordering::Relaxed);
            // Counted from here until its last event, which a client may answer at once.
            metrics.running.fetch_add(1, Ordering::Relaxed);
            streams.insert(next_id, stream);
            next_id += 1;
        }
        // Clients gone, or the server stopping: their sequences end before the next pass.
        let cancelled: Vec<u64> = streams
            .iter()
            .filter(|(_, s)| s.cancelled(&abort))
            .map(|(&id, _)| id)
            .collect();
        for id in cancelled {
            engine.cancel(id);
            if let Some(stream) = streams.remove(&id) {
                metrics.running.fetch_sub(1, Ordering::Relaxed);
                stream.fail(Stream::cancellation(&abort), &metrics);
            }
        }
        if streams.is_empty() {
            request = None;
            continue;
        }
        let before = engine.step_timing();
        let result = engine.step_batch(&mut |id, event| {
            let Some(stream) = streams.get_mut(&id) else {
                return;
            };
            match event {
                BatchEvent::Prompt { cached_tokens } => {
                    stream.prompt(cached_tokens);
                }
                BatchEvent::Token {
                    token,
                    logits,
                    is_eos,
                } => {
                    stream.token(token, logits, is_eos);
                }
                BatchEvent::Finished(generation) => {
                    if let Some(stream) = streams.remove(&id) {
                        metrics.running.fetch_sub(1, Ordering::Relaxed);
                        stream.finish(&generation, &metrics, &abort);
                    }
                }
                BatchEvent::Failed(e) => {
                    tracing::warn!("generation failed: {e}");
                    if let Some(stream) = streams.remove(&id) {
                        metrics.running.fetch_sub(1, Ordering::Relaxed);
                        stream.fail(&e.to_string(), &metrics);
                    }
                }
            }
        });
        if let Err(e) = result {
            if e.is_fatal() {
                tracing::error!("the engine cannot serve any more: {e}");
                let message = e.to_string();
                for (_, stream) in streams.drain() {
                    metrics.running.fetch_sub(1, Ordering::Relaxed);
                    stream.fail(&message, &metrics);
                }
                super::fail_queued(&mut queue, &message, &metrics);
                return Some(e);
            }
            // Its requests have failed with it (their Failed events); the rest go on.
            tracing::warn!("a batched step failed: {e}");
        }
        record_step(&metrics, &engine, before);
        if streams.is_empty() {
            // Idle: the keepalive ticks again.
            request = None;
        }
    }
    drop(request);
    None
}

/// The batched loop's figures after a step: its sequences, its preemptions, and the tokens of
/// its pass (none when it ran none); at trace level, where the step's time went.
fn record_step(metrics: &Metrics, engine: &Engine, before: StepTiming) {
    let after = engine.step_timing();
    let (running, waiting) = engine.sequences();
    metrics
        .sequences_running
        .store(running as i64, Ordering::Relaxed);
    metrics
        .sequences_waiting
        .store(waiting as i64, Ordering::Relaxed);
    let step = after.since(&before);
    metrics
        .preemptions
        .fetch_add(step.preemptions as u64, Ordering::Relaxed);
    if step.passes > 0 {
        metrics.batch_tokens.observe(step.rows as f64);
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::trace!(
            "step of {} rows: schedule {:.2} ms (drafts {:.2} ms), pass {:.2} ms, sample {:.2} ms",
            step.rows,
            ms(step.schedule),
            ms(step.propose),
            ms(step.pass),
            ms(step.sample),
        );
    }
}
