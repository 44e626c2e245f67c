//! What the completion routes share: checking a request against the context, tokenizing off
//! the async runtime, queuing the job, and turning its events into pieces of output (stop
//! strings, the reasoning split, latency metrics).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ember_engine::constraint::Grammar;
use ember_engine::{FinishReason, GenerateParams};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

use super::AppResult;
use crate::error::ApiError;
use crate::openai::CommonParams;
use crate::server::{AppState, Ready};
use crate::text::{ReasoningParser, StopMatcher};
use crate::worker::{CancelOnDrop, Event, Job};

/// The generation a request asks for, after checking it fits the context.
pub(super) fn plan(
    state: &AppState,
    ready: &Ready,
    prompt_tokens: usize,
    common: &CommonParams,
) -> AppResult<GenerateParams> {
    let context = ready.context;
    if prompt_tokens == 0 {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    if prompt_tokens >= context {
        return Err(ApiError::bad_request(format!(
            "this model's maximum context length is {context} tokens; the prompt has {prompt_tokens}, leaving no room to generate"
        ))
        .with_code("context_length_exceeded"));
    }
    let room = context - prompt_tokens;
    let max_tokens = match common.max_tokens {
        Some(requested) if requested > room => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "this model's maximum context length is {context} tokens; you requested {} tokens ({prompt_tokens} in the prompt, {requested} for the completion)",
                    prompt_tokens + requested
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Some(requested) => requested,
        // The server's default (`--n-predict`), within the context.
        None => state.default_max_tokens.map_or(room, |n| n.min(room)),
    };
    Ok(GenerateParams {
        max_tokens,
        sampling: common.sampling,
        ignore_eos: common.ignore_eos,
        step_logits: false,
        cache_prompt: common.cache_prompt,
        draft: common.draft,
    })
}

/// Refuses a prompt whose text (`bytes` of it) makes more tokens than the context holds
/// whatever it says, before anything tokenizes it: a prompt of megabytes costs no time and
/// no memory.
pub(super) fn refuse_certainly_too_long(ready: &Ready, bytes: usize) -> AppResult<()> {
    let at_least = ready.encoder.tokenizer().min_tokens_of_bytes(bytes);
    let context = ready.context;
    if at_least >= context {
        return Err(ApiError::bad_request(format!(
            "this model's maximum context length is {context} tokens; the prompt's {bytes} bytes \
             make at least {at_least}"
        ))
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// Runs `work` (templating, tokenizing: milliseconds to seconds for long prompts) on the
/// blocking pool, so that the runtime's threads keep answering other requests and `/health`.
pub(crate) async fn off_the_runtime<T: Send + 'static>(
    work: impl FnOnce() -> AppResult<T> + Send + 'static,
) -> AppResult<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))?
}

/// A queued job and the receiving end of its events.
pub(super) struct Submitted {
    events: mpsc::UnboundedReceiver<Event>,
    cancel: CancelOnDrop,
}

/// Queues a generation of `prompt`, its output held to `grammar` (with the request field that
/// named it, for errors) when given.
pub(super) async fn submit(
    state: &AppState,
    ready: &Ready,
    prompt: Vec<u32>,
    params: GenerateParams,
    grammar: Option<(&'static str, Grammar)>,
    logprobs: Option<usize>,
    arrived: Instant,
) -> AppResult<Submitted> {
    // Compiled before queuing, off the runtime (the first one builds the token trie): a bad
    // schema is a 400, never a failed stream.
    let constraint = match grammar {
        None => None,
        Some((param, grammar)) => {
            let compiler = Arc::clone(&ready.constraints);
            Some(
                off_the_runtime(move || {
                    compiler
                        .compile(&grammar)
                        .map_err(|e| ApiError::invalid(param, format!("`{param}`: {e}")))
                })
                .await?,
            )
        }
    };
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt,
        // Log-probabilities are computed from each step's logits.
        params: GenerateParams {
            step_logits: logprobs.is_some(),
            ..params
        },
        constraint,
        logprobs,
        cancel: Arc::clone(&cancel),
        events: events_tx,
        arrived,
        queued: Instant::now(),
    };
    state.metrics.queued.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = ready.queue.try_send(job) {
        state.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        return Err(match e {
            TrySendError::Full(_) => {
                ApiError::unavailable("the server is busy: the request queue is full; retry later")
                    .with_code("queue_full")
            }
            // The engine thread has ended (a fatal engine error): the server is stopping.
            TrySendError::Closed(_) => {
                ApiError::unavailable("the engine has stopped: the server is shutting down")
            }
        });
    }
    let cancel = CancelOnDrop(cancel);
    // Wait until the engine takes the job, so failures before the first token are HTTP errors.
    match events.recv().await {
        Some(Event::Started) => Ok(Submitted { events, cancel }),
        Some(Event::Failed(message)) => Err(ApiError::unavailable(message)),
        _ => Err(ApiError::internal(
            "the engine stopped before taking the request",
        )),
    }
}

/// A generated token with its log-probability and the top alternatives, when asked for.
pub(super) type TokenInfo = (u32, Option<f32>, Vec<(u32, f32)>);

/// Text, reasoning and log-probabilities from one token, after stop strings and reasoning
/// tags are handled.
#[derive(Default)]
pub(super) struct Piece {
    pub(super) content: String,
    pub(super) reasoning: String,
    pub(super) token: Option<TokenInfo>,
}

/// Turns a job's events into pieces of output, applying stop strings and the reasoning split,
/// and recording latency metrics.
pub(super) struct Output {
    submitted: Submitted,
    stop: StopMatcher,
    pub(super) reasoning: Option<ReasoningParser>,
    arrived: Instant,
    last_token: Option<Instant>,
    finished: Option<(&'static str, usize)>,
    pub(super) completion_tokens: usize,
    /// Prompt tokens the prompt cache supplied (`usage.prompt_tokens_details.cached_tokens`).
    pub(super) cached_tokens: usize,
    /// Tokens drafted for the request and verified, and those accepted (`timings.draft_n`,
    /// `draft_n_accepted` on `/completion`, as llama-server reports them).
    pub(super) drafted_tokens: usize,
    pub(super) accepted_tokens: usize,
    /// Whether a stop string ended the output (rather than end-of-sequence or the limit).
    by_stop_string: bool,
}

impl Output {
    pub(super) fn new(
        submitted: Submitted,
        stops: Vec<String>,
        reasoning: Option<ReasoningParser>,
        arrived: Instant,
    ) -> Self {
        Output {
            submitted,
            stop: StopMatcher::new(stops),
            reasoning,
            arrived,
            last_token: None,
            finished: None,
            completion_tokens: 0,
            cached_tokens: 0,
            drafted_tokens: 0,
            accepted_tokens: 0,
            by_stop_string: false,
        }
    }

    /// The next piece, or `None` when generation is over (then [`Self::finish_reason`]).
    pub(super) async fn next(&mut self, state: &AppState) -> AppResult<Option<Piece>> {
        if self.finished.is_some() {
            return Ok(None);
        }
        let mut event = self.submitted.events.recv().await;
        while let Some(Event::Prompt { cached_tokens }) = event {
            self.cached_tokens = cached_tokens;
            event = self.submitted.events.recv().await;
        }
        let (text, token) = match event {
            Some(Event::Token(t)) => {
                let now = Instant::now();
                match self.last_token {
                    None => state
                        .metrics
                        .time_to_first_token
                        .observe((now - self.arrived).as_secs_f64()),
                    Some(last) => state
                        .metrics
                        .inter_token_latency
                        .observe((now - last).as_secs_f64()),
                }
                self.last_token = Some(now);
                self.completion_tokens += 1;
                (t.text, Some((t.id, t.logprob, t.top_logprobs)))
            }
            Some(Event::Tail(text)) => (text, None),
            Some(Event::Finished {
                finish_reason,
                completion_tokens,
                drafted_tokens,
                accepted_tokens,
            }) => {
                self.completion_tokens = completion_tokens;
                self.drafted_tokens = drafted_tokens;
                self.accepted_tokens = accepted_tokens;
                let reason = match finish_reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                };
                let tail = self.stop.finish();
                let mut piece = self.split(tail);
                self.flush_reasoning(&mut piece);
                self.finished = Some((reason, completion_tokens));
                return Ok(Some(piece));
            }
            Some(Event::Failed(message)) => return Err(ApiError::internal(message)),
            Some(Event::Started | Event::Prompt { .. }) | None => {
                return Err(ApiError::internal("the engine stopped mid-request"));
            }
        };
        let out = self.stop.push(&text);
        let mut piece = self.split(out.emit);
        piece.token = token;
        if out.stopped {
            self.by_stop_string = true;
            // Stop at once: the engine sees the flag at its next token.
            self.submitted.cancel.0.store(true, Ordering::Relaxed);
            self.flush_reasoning(&mut piece);
            self.finished = Some(("stop", self.completion_tokens));
        }
        Ok(Some(piece))
    }

    fn split(&mut self, text: String) -> Piece {
        match &mut self.reasoning {
            Some(parser) => {
                let (reasoning, content) = parser.push(&text);
                Piece {
                    content,
                    reasoning,
                    token: None,
                }
            }
            None => Piece {
                content: text,
                ..Piece::default()
            },
        }
    }

    fn flush_reasoning(&mut self, piece: &mut Piece) {
        if let Some(parser) = &mut self.reasoning {
            let (reasoning, content) = parser.finish();
            piece.reasoning.push_str(&reasoning);
            piece.content.push_str(&content);
        }
    }

    /// llama-server's `stop_type`: `word` (a stop string), `eos` or `limit`.
    pub(super) fn stop_type(&self) -> &'static str {
        match self.finish_reason() {
            "length" => "limit",
            _ if self.by_stop_string => "word",
            _ => "eos",
        }
    }

    pub(super) fn finish_reason(&self) -> &'static str {
        self.finished.map_or("stop", |(reason, _)| reason)
    }
}
