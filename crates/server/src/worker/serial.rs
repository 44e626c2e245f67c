//! One job at a time, each through `Engine::generate_until`: the road of an engine that runs
//! one sequence (CUDA for now), where greedy picks stay on the device.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ember_engine::Engine;
use ember_residency::Keepalive;
use tokio::sync::mpsc;

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
    while let Some(job) = queue.blocking_recv() {
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        let Some(mut stream) = Stream::start(job, &tokenizer, &abort) else {
            continue;
        };
        let _request = keepalive.as_ref().map(|k| k.request());
        stream.committed = Instant::now();
        stream.started = stream.committed;
        metrics.running.fetch_add(1, Ordering::Relaxed);
        metrics
            .prompt_tokens
            .fetch_add(stream.job.prompt.len() as u64, Ordering::Relaxed);
        let (prompt, params) = (stream.job.prompt.clone(), stream.job.params);
        let constraint = stream.job.constraint.take();
        let stop = {
            let (cancel, abort) = (Arc::clone(&stream.job.cancel), Arc::clone(&abort));
            move || cancel.load(Ordering::Relaxed) || abort.load(Ordering::Relaxed)
        };
        let mut announced = false;
        let result = engine.generate_until(&prompt, &params, constraint, &stop, |step| {
            if stop() {
                return ControlFlow::Break(());
            }
            if !announced {
                announced = true;
                if !stream.prompt(step.cached_tokens) {
                    return ControlFlow::Break(());
                }
            }
            // The job's params ask for each step's logits whenever it wants log-probabilities.
            if !stream.token(step.token, step.logits, step.is_eos) {
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        });
        metrics.running.fetch_sub(1, Ordering::Relaxed);
        match result {
            Ok(generation) => stream.finish(&generation, &metrics, &abort),
            // Stopped mid-prefill: the client left (nobody reads) or the server is stopping.
            Err(e) if e.is_cancellation() => stream.fail(Stream::cancellation(&abort), &metrics),
            Err(e) if e.is_fatal() => {
                tracing::error!("the engine cannot serve any more: {e}");
                stream.fail(&e.to_string(), &metrics);
                super::fail_queued(&mut queue, &e.to_string(), &metrics);
                return Some(e);
            }
            Err(e) => {
                tracing::warn!("generation failed: {e}");
                stream.fail(&e.to_string(), &metrics);
            }
        }
    }
    None
}
