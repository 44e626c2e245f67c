//! HTTP routes: authentication, request counting, and the OpenAI endpoints.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ember_engine::{FinishReason, GenerateParams};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::ApiError;
use crate::openai::{
    self, CommonParams, CompletionChoice, CompletionLogprobs, PromptInput, ResponseMeta,
    TokenLogprob, Usage,
};
use crate::server::{AppState, Ready};
use crate::text::{ReasoningParser, StopMatcher};
use crate::worker::{CancelOnDrop, Event, Job};

type AppResult<T> = Result<T, ApiError>;

pub(crate) fn router(state: Arc<AppState>) -> Router {
    // The OpenAI routes, and the same without `/v1` (as llama-server and vLLM answer them).
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/chat/completions", post(chat_completions))
        .route("/completions", post(completions))
        .route("/models", get(models))
        // llama-server's own.
        .route("/tokenize", post(crate::llama::tokenize))
        .route("/detokenize", post(crate::llama::detokenize))
        .route("/apply-template", post(crate::llama::apply_template))
        .route("/props", get(crate::llama::props))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            require_api_key,
        ));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            count_requests,
        ))
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            crate::cors::cors,
        ))
        .with_state(state)
}

async fn count_requests(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let endpoint = match request
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
    {
        Some("/v1/chat/completions" | "/chat/completions") => "/v1/chat/completions",
        Some("/v1/completions" | "/completions") => "/v1/completions",
        Some("/v1/models" | "/models") => "/v1/models",
        Some("/health") => "/health",
        Some("/metrics") => "/metrics",
        _ => "other",
    };
    let response = next.run(request).await;
    state
        .metrics
        .count_request(endpoint, response.status().as_u16());
    response
}

/// Checks the bearer token against every key in constant time; keys are never logged.
async fn require_api_key(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    if state.api_keys.is_empty() {
        return next.run(request).await;
    }
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or("");
    let mut matched = false;
    for key in &state.api_keys {
        matched |= constant_time_eq(presented.as_bytes(), key.as_bytes());
    }
    if matched {
        next.run(request).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// Equal-length inputs take the same time whatever their content; the length itself is not
/// secret enough to hide (keys are long and random).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ready.get() {
        Some(ready) => Json(json!({
            "status": "ok",
            "model": state.model_name,
            "context": ready.context,
            "residency": residency_json(ready),
            "prompt_cache": ready.prompt_cache.snapshot(),
            "sequences": sequences_json(&state.metrics),
        }))
        .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading", "model": state.model_name})),
        )
            .into_response(),
    }
}

/// The batched loop's sequences, as of its last step.
fn sequences_json(metrics: &crate::metrics::Metrics) -> Value {
    json!({
        "running": metrics.sequences_running.load(Ordering::Relaxed),
        "waiting": metrics.sequences_waiting.load(Ordering::Relaxed),
        "preemptions_total": metrics.preemptions.load(Ordering::Relaxed),
    })
}

/// The residency set's state and figures, and whether the keepalive is ticking.
fn residency_json(ready: &Ready) -> Value {
    let stats = ready.residency.stats();
    json!({
        "state": stats.state.as_str(),
        "bytes": stats.bytes,
        "device_bytes": stats.device_bytes,
        "buffers": stats.buffers,
        "staged": stats.staged,
        "staged_bytes": stats.staged_bytes,
        "commits": stats.commits,
        "refusals": stats.refusals,
        "keepalive": {
            "enabled": ready.keepalive.is_some(),
            "keep_warm_s": ready.keep_warm.as_secs_f64(),
            "ticks": stats.ticks,
            // Each tick also reads a byte of every held page; pages read so far.
            "warm": ready.keepalive.as_ref().is_some_and(|k| k.warms()),
            "warmed_pages": ready.keepalive.as_ref().map_or(0, |k| k.warmed_pages()),
        },
    })
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let ready = state.ready.get();
    let residency = ready.map(|r| r.residency.stats());
    let cache = ready.map(|r| r.prompt_cache.snapshot());
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(residency, cache),
    )
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(openai::model_list(&state.model_name, state.created))
}

/// The request body as bytes, with a JSON 413 when it passes the limit.
pub(crate) struct RawBody(pub(crate) Bytes);

impl FromRequest<Arc<AppState>> for RawBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        match Bytes::from_request(request, state).await {
            Ok(bytes) => Ok(RawBody(bytes)),
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::payload_too_large(state.max_body_bytes))
            }
            Err(rejection) => Err(ApiError::bad_request(rejection.body_text())),
        }
    }
}

pub(crate) fn ready(state: &AppState) -> AppResult<&Ready> {
    state.ready.get().ok_or_else(|| {
        ApiError::unavailable("the model is still loading; retry when /health answers 200")
    })
}

pub(crate) fn engine_error(e: ember_engine::Error) -> ApiError {
    match e {
        ember_engine::Error::Template(_)
        | ember_engine::Error::NoChatTemplate(_)
        | ember_engine::Error::Tokenizer(_)
        | ember_engine::Error::PrefillNotRendered => ApiError::bad_request(e.to_string()),
        other => ApiError::internal(other.to_string()),
    }
}

/// The generation a request asks for, after checking it fits the context.
fn plan(
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
    })
}

/// Refuses a prompt whose text (`bytes` of it) makes more tokens than the context holds
/// whatever it says, before anything tokenizes it: a prompt of megabytes costs no time and
/// no memory.
fn refuse_certainly_too_long(ready: &Ready, bytes: usize) -> AppResult<()> {
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
struct Submitted {
    events: mpsc::UnboundedReceiver<Event>,
    cancel: CancelOnDrop,
}

async fn submit(
    state: &AppState,
    ready: &Ready,
    prompt: Vec<u32>,
    params: GenerateParams,
    logprobs: Option<usize>,
    arrived: Instant,
) -> AppResult<Submitted> {
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt,
        // Log-probabilities are computed from each step's logits.
        params: GenerateParams {
            step_logits: logprobs.is_some(),
            ..params
        },
        logprobs,
        cancel: Arc::clone(&cancel),
        events: events_tx,
        arrived,
        queued: Instant::now(),
    };
    state.metrics.queued.fetch_add(1, Ordering::Relaxed);
    if ready.queue.try_send(job).is_err() {
        state.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::unavailable(
            "the server is busy: the request queue is full; retry later",
        )
        .with_code("queue_full"));
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
type TokenInfo = (u32, Option<f32>, Vec<(u32, f32)>);

/// Text, reasoning and log-probabilities from one token, after stop strings and reasoning
/// tags are handled.
#[derive(Default)]
struct Piece {
    content: String,
    reasoning: String,
    token: Option<TokenInfo>,
}

/// Turns a job's events into pieces of output, applying stop strings and the reasoning split,
/// and recording latency metrics.
struct Output {
    submitted: Submitted,
    stop: StopMatcher,
    reasoning: Option<ReasoningParser>,
    arrived: Instant,
    last_token: Option<Instant>,
    finished: Option<(&'static str, usize)>,
    completion_tokens: usize,
    /// Prompt tokens the prompt cache supplied (`usage.prompt_tokens_details.cached_tokens`).
    cached_tokens: usize,
}

impl Output {
    fn new(
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
        }
    }

    /// The next piece, or `None` when generation is over (then [`Self::finish_reason`]).
    async fn next(&mut self, state: &AppState) -> AppResult<Option<Piece>> {
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
            }) => {
                self.completion_tokens = completion_tokens;
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

    fn finish_reason(&self) -> &'static str {
        self.finished.map_or("stop", |(reason, _)| reason)
    }
}

fn meta(state: &AppState, ready: &Ready, prefix: &str) -> ResponseMeta {
    ResponseMeta {
        id: format!("{prefix}-{}", random_hex()),
        created: unix_now(),
        model: state.model_name.clone(),
        system_fingerprint: ready.fingerprint.clone(),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// 32 hex digits for response ids: unique enough, and no RNG crate needed.
fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut out = String::with_capacity(32);
    for _ in 0..2 {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        out.push_str(&format!("{:016x}", hasher.finish()));
    }
    out
}

fn token_text(ready: &Ready, id: u32) -> String {
    ready.encoder.tokenizer().decode(&[id], false)
}

fn chat_logprob(
    ready: &Ready,
    token: &(u32, Option<f32>, Vec<(u32, f32)>),
) -> Option<TokenLogprob> {
    let (id, logprob, top) = token;
    Some(TokenLogprob {
        token: token_text(ready, *id),
        logprob: (*logprob)?,
        top: top
            .iter()
            .map(|(t, lp)| (token_text(ready, *t), *lp))
            .collect(),
    })
}

/// An SSE response fed by a task; the task ends (and cancels its job) when the client leaves.
fn sse(
    run: impl FnOnce(mpsc::Sender<Result<SseEvent, Infallible>>) -> tokio::task::JoinHandle<()>,
) -> Response {
    let (tx, rx) = mpsc::channel(64);
    run(tx);
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn data(value: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(value.to_string()))
}

fn done() -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data("[DONE]"))
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    RawBody(body): RawBody,
) -> AppResult<Response> {
    let arrived = Instant::now();
    let ready = ready(&state)?;
    let mut request = openai::parse_chat(&body, &ready.sampling_defaults)?;
    drop(body);
    let text_bytes: usize = request
        .messages
        .iter()
        .map(|m| m.content.len() + m.reasoning_content.as_ref().map_or(0, String::len))
        .sum();
    refuse_certainly_too_long(ready, text_bytes)?;
    let encoder = ready.encoder.clone();
    let (messages, kwargs) = (
        std::mem::take(&mut request.messages),
        std::mem::take(&mut request.chat_template_kwargs),
    );
    let (rendered, prompt) = off_the_runtime(move || {
        let rendered = encoder
            .render_chat(&messages, &kwargs)
            .map_err(engine_error)?;
        let prompt = encoder
            .tokenizer()
            .encode(&rendered, false)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok((rendered, prompt))
    })
    .await?;
    let encoder = &ready.encoder;
    let params = plan(&state, ready, prompt.len(), &request.common)?;
    // Templates that know `<think>` get their reasoning split out; a prompt that ends inside
    // an open `<think>` means the reply starts in reasoning.
    let reasoning = encoder
        .chat_template_source()
        .is_some_and(|t| t.contains("<think>"))
        .then(|| {
            let open = rendered.rfind("<think>");
            let close = rendered.rfind("</think>");
            ReasoningParser::new(matches!((open, close), (Some(o), c) if c.is_none_or(|c| c < o)))
        });
    let logprobs = request.logprobs.then_some(request.top_logprobs);
    let prompt_tokens = prompt.len();
    let submitted = submit(&state, ready, prompt, params, logprobs, arrived).await?;
    let mut output = Output::new(submitted, request.common.stop.clone(), reasoning, arrived);
    let meta = meta(&state, ready, "chatcmpl");

    if !request.common.stream {
        let (mut content, mut reasoning_text, mut logprob_list) =
            (String::new(), String::new(), Vec::new());
        while let Some(piece) = output.next(&state).await? {
            content.push_str(&piece.content);
            reasoning_text.push_str(&piece.reasoning);
            if let Some(lp) = piece.token.as_ref().and_then(|t| chat_logprob(ready, t)) {
                logprob_list.push(lp);
            }
        }
        let usage = Usage {
            prompt_tokens,
            completion_tokens: output.completion_tokens,
            cached_tokens: output.cached_tokens,
        };
        let reasoning_out = output
            .reasoning
            .as_ref()
            .map(|_| reasoning_text.as_str())
            .filter(|r| !r.is_empty());
        let body = openai::chat_completion(
            &meta,
            &content,
            reasoning_out,
            logprobs.map(|_| logprob_list.as_slice()),
            output.finish_reason(),
            &usage,
        );
        return Ok(Json(body).into_response());
    }

    let include_usage = request.common.include_usage;
    let state_for_task = Arc::clone(&state);
    let stream = sse(move |tx| {
        tokio::spawn(async move {
            let state = state_for_task;
            let Some(ready) = state.ready.get() else {
                return;
            };
            if tx
                .send(data(&openai::chat_chunk(
                    &meta,
                    openai::chat_delta(true, Some(""), None),
                    None,
                    None,
                )))
                .await
                .is_err()
            {
                return;
            }
            loop {
                let piece = match output.next(&state).await {
                    Ok(Some(piece)) => piece,
                    Ok(None) => break,
                    Err(e) => {
                        // The error ends the stream: no finish_reason and no [DONE] after it,
                        // so a client that skips error events never takes a cut reply as whole.
                        let _ = tx.send(data(&e.body())).await;
                        return;
                    }
                };
                let lp: Option<Vec<TokenLogprob>> = logprobs.map(|_| {
                    piece
                        .token
                        .as_ref()
                        .and_then(|t| chat_logprob(ready, t))
                        .into_iter()
                        .collect()
                });
                if piece.content.is_empty()
                    && piece.reasoning.is_empty()
                    && lp.as_ref().is_none_or(|l| l.is_empty())
                {
                    continue;
                }
                let delta = openai::chat_delta(
                    false,
                    (!piece.content.is_empty()).then_some(piece.content.as_str()),
                    (!piece.reasoning.is_empty()).then_some(piece.reasoning.as_str()),
                );
                if tx
                    .send(data(&openai::chat_chunk(&meta, delta, lp.as_deref(), None)))
                    .await
                    .is_err()
                {
                    return; // The client left; dropping `output` cancels the job.
                }
            }
            let _ = tx
                .send(data(&openai::chat_chunk(
                    &meta,
                    json!({}),
                    None,
                    Some(output.finish_reason()),
                )))
                .await;
            if include_usage {
                let usage = Usage {
                    prompt_tokens,
                    completion_tokens: output.completion_tokens,
                    cached_tokens: output.cached_tokens,
                };
                let _ = tx
                    .send(data(&openai::usage_chunk(
                        &meta,
                        "chat.completion.chunk",
                        &usage,
                    )))
                    .await;
            }
            let _ = tx.send(done()).await;
        })
    });
    Ok(stream)
}

async fn completions(
    State(state): State<Arc<AppState>>,
    RawBody(body): RawBody,
) -> AppResult<Response> {
    let arrived = Instant::now();
    let ready = ready(&state)?;
    let request = openai::parse_completion(&body, &ready.sampling_defaults)?;
    drop(body);
    let mut prompts = Vec::with_capacity(request.prompts.len());
    for prompt in &request.prompts {
        let ids = match prompt {
            PromptInput::Text(text) => {
                refuse_certainly_too_long(ready, text.len())?;
                let (encoder, text) = (ready.encoder.clone(), text.clone());
                off_the_runtime(move || encoder.encode_prompt(&text).map_err(engine_error)).await?
            }
            PromptInput::Tokens(ids) => {
                let vocab = ready.encoder.tokenizer().vocab_size();
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                    ));
                }
                ids.clone()
            }
        };
        let params = plan(&state, ready, ids.len(), &request.common)?;
        prompts.push((ids, params));
    }
    let meta = meta(&state, ready, "cmpl");
    let logprobs = request.logprobs;

    if !request.common.stream {
        let mut choices = Vec::new();
        let mut usage = Usage::default();
        for (ids, params) in prompts {
            usage.prompt_tokens += ids.len();
            let submitted = submit(&state, ready, ids, params, logprobs, arrived).await?;
            let mut output = Output::new(submitted, request.common.stop.clone(), None, arrived);
            let mut text = String::new();
            let mut lp = CompletionLogprobs::default();
            while let Some(piece) = output.next(&state).await? {
                if let Some(token) = &piece.token {
                    push_completion_logprob(ready, &mut lp, token, text.len());
                }
                text.push_str(&piece.content);
            }
            usage.completion_tokens += output.completion_tokens;
            usage.cached_tokens += output.cached_tokens;
            choices.push(CompletionChoice {
                text,
                logprobs: logprobs.map(|_| lp),
                finish_reason: output.finish_reason().into(),
            });
        }
        return Ok(Json(openai::completion(&meta, &choices, &usage)).into_response());
    }

    // Streaming: prompts run one after another; each chunk carries its choice index.
    let mut first = None;
    if let Some((ids, params)) = prompts.first() {
        first = Some(submit(&state, ready, ids.clone(), *params, logprobs, arrived).await?);
    }
    let include_usage = request.common.include_usage;
    let stops = request.common.stop.clone();
    let state_for_task = Arc::clone(&state);
    let stream = sse(move |tx| {
        tokio::spawn(async move {
            let state = state_for_task;
            let Some(ready) = state.ready.get() else {
                return;
            };
            let mut usage = Usage::default();
            for (index, (ids, params)) in prompts.into_iter().enumerate() {
                usage.prompt_tokens += ids.len();
                let submitted = match first.take() {
                    Some(submitted) => submitted,
                    None => match submit(&state, ready, ids, params, logprobs, arrived).await {
                        Ok(submitted) => submitted,
                        Err(e) => {
                            let _ = tx.send(data(&e.body())).await;
                            break;
                        }
                    },
                };
                let mut output = Output::new(submitted, stops.clone(), None, arrived);
                let mut offset = 0;
                loop {
                    let piece = match output.next(&state).await {
                        Ok(Some(piece)) => piece,
                        Ok(None) => break,
                        Err(e) => {
                            let _ = tx.send(data(&e.body())).await;
                            return;
                        }
                    };
                    let lp = logprobs.map(|_| {
                        let mut lp = CompletionLogprobs::default();
                        if let Some(token) = &piece.token {
                            push_completion_logprob(ready, &mut lp, token, offset);
                        }
                        lp
                    });
                    offset += piece.content.len();
                    if piece.content.is_empty() && lp.as_ref().is_none_or(|l| l.tokens.is_empty()) {
                        continue;
                    }
                    if tx
                        .send(data(&openai::completion_chunk(
                            &meta,
                            index,
                            &piece.content,
                            lp.as_ref(),
                            None,
                        )))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                usage.completion_tokens += output.completion_tokens;
                usage.cached_tokens += output.cached_tokens;
                if tx
                    .send(data(&openai::completion_chunk(
                        &meta,
                        index,
                        "",
                        None,
                        Some(output.finish_reason()),
                    )))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            if include_usage {
                let _ = tx
                    .send(data(&openai::usage_chunk(&meta, "text_completion", &usage)))
                    .await;
            }
            let _ = tx.send(done()).await;
        })
    });
    Ok(stream)
}

fn push_completion_logprob(
    ready: &Ready,
    lp: &mut CompletionLogprobs,
    token: &(u32, Option<f32>, Vec<(u32, f32)>),
    offset: usize,
) {
    let (id, logprob, top) = token;
    lp.tokens.push(token_text(ready, *id));
    lp.token_logprobs.push(logprob.unwrap_or(f32::NAN));
    lp.top_logprobs.push(
        top.iter()
            .map(|(t, l)| (token_text(ready, *t), *l))
            .collect(),
    );
    lp.text_offset.push(offset);
}
