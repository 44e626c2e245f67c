//! The OpenAI completion routes: `/v1/chat/completions` and `/v1/completions`, whole or
//! streamed.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::generation::{Output, Piece, off_the_runtime, plan, refuse_certainly_too_long, submit};
use super::{AppResult, RawBody, engine_error, ready};
use crate::error::ApiError;
use crate::openai::{
    self, ChatRequest, CompletionChoice, CompletionLogprobs, PromptInput, ResponseMeta,
    TokenLogprob, Usage,
};
use crate::server::{AppState, Ready};
use crate::text::ReasoningParser;
use crate::tools::{StreamPiece, ToolCall, ToolFormat, ToolStream};

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

pub(super) fn token_text(ready: &Ready, id: u32) -> String {
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
pub(super) fn sse(
    run: impl FnOnce(mpsc::Sender<Result<SseEvent, Infallible>>) -> tokio::task::JoinHandle<()>,
) -> Response {
    let (tx, rx) = mpsc::channel(64);
    run(tx);
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

pub(super) fn data(value: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(value.to_string()))
}

/// A stream's next piece: `Ok(None)` when the output is over, `Err(())` when it failed and its
/// error event was sent — which ends the stream: no `finish_reason` and no `[DONE]` after it,
/// so a client that skips error events never takes a cut reply for a whole one.
pub(super) async fn next_streamed(
    output: &mut Output,
    state: &AppState,
    tx: &mpsc::Sender<Result<SseEvent, Infallible>>,
) -> Result<Option<Piece>, ()> {
    match output.next(state).await {
        Ok(piece) => Ok(piece),
        Err(e) => {
            let _ = tx.send(data(&e.body())).await;
            Err(())
        }
    }
}

fn done() -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data("[DONE]"))
}

pub(super) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    RawBody(body): RawBody,
) -> AppResult<Response> {
    let arrived = Instant::now();
    let ready = ready(&state)?;
    let mut request = openai::parse_chat(&body, &ready.sampling_defaults)?;
    drop(body);
    let tool_format = tool_calls_of(ready, &mut request)?;
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
            .render_chat_continuing(&messages, &kwargs)
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
    let grammar = request.common.grammar.clone();
    let submitted = submit(&state, ready, prompt, params, grammar, logprobs, arrived).await?;
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
        let (content, calls) = match tool_format {
            Some(format) => match format.split(&content) {
                (_, calls) if calls.is_empty() => (Some(content), calls),
                (rest, calls) => (rest, calls),
            },
            None => (Some(content), Vec::new()),
        };
        let calls: Vec<(String, ToolCall)> = calls.into_iter().map(|c| (call_id(), c)).collect();
        let body = openai::chat_completion_with_tools(
            &meta,
            content.as_deref(),
            &calls,
            reasoning_out,
            logprobs.map(|_| logprob_list.as_slice()),
            finish_reason(&output, calls.len()),
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
            let mut tools = tool_format.map(ToolStream::new);
            loop {
                let Ok(next) = next_streamed(&mut output, &state, &tx).await else {
                    return;
                };
                let Some(mut piece) = next else { break };
                // With tools, content passes through the call reader: text that may open a
                // call waits, and whole calls go out as `tool_calls` deltas, in order.
                if let Some(stream) = &mut tools {
                    let pieces = stream.push(&piece.content);
                    let Some(rest) = send_pieces(&tx, &meta, stream, pieces).await else {
                        return;
                    };
                    piece.content = rest;
                }
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
            if let Some(stream) = &mut tools {
                let pieces = stream.finish();
                let Some(rest) = send_pieces(&tx, &meta, stream, pieces).await else {
                    return;
                };
                if !rest.is_empty() {
                    let delta = openai::chat_delta(false, Some(&rest), None);
                    let chunk = openai::chat_chunk(&meta, delta, None, None);
                    if tx.send(data(&chunk)).await.is_err() {
                        return;
                    }
                }
            }
            let calls = tools.as_ref().map_or(0, ToolStream::calls);
            let _ = tx
                .send(data(&openai::chat_chunk(
                    &meta,
                    json!({}),
                    None,
                    Some(finish_reason(&output, calls)),
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

/// The tool-call format of a request that offers tools (a 400 when the model's template shows
/// none ember reads); its tools go to the template, and a required or named call becomes the
/// request's output constraint.
pub(super) fn tool_calls_of(
    ready: &Ready,
    request: &mut ChatRequest,
) -> AppResult<Option<ToolFormat>> {
    if !request.tools.active() {
        return Ok(None);
    }
    let template = ready.encoder.chat_template_source().unwrap_or_default();
    let format = ToolFormat::detect(template).ok_or_else(|| {
        ApiError::invalid(
            "tools",
            "this model's chat template shows no tool-call format ember reads (Hermes \
             `<tool_call>` blocks, as Qwen's, or Llama 3's JSON); send the request without `tools`",
        )
    })?;
    request.chat_template_kwargs.insert(
        "tools".into(),
        Value::Array(request.tools.definitions.clone()),
    );
    if let Some(grammar) = format.constraint(&request.tools) {
        request.common.grammar = Some(("tool_choice", grammar));
    }
    Ok(Some(format))
}

/// OpenAI's `call_` ids.
fn call_id() -> String {
    format!("call_{}", &random_hex()[..24])
}

/// A reply that called tools ends with `tool_calls`, as OpenAI's do.
fn finish_reason(output: &Output, calls: usize) -> &'static str {
    match output.finish_reason() {
        "stop" if calls > 0 => "tool_calls",
        other => other,
    }
}

/// Sends a call reader's pieces in order up to its last call (content before a call as its
/// own delta, each call as a `tool_calls` delta numbered after those sent before), and returns
/// the content after the last call, for the caller's delta; `None` when the client is gone.
async fn send_pieces(
    tx: &mpsc::Sender<Result<SseEvent, Infallible>>,
    meta: &ResponseMeta,
    stream: &ToolStream,
    pieces: Vec<StreamPiece>,
) -> Option<String> {
    let new_calls = pieces
        .iter()
        .filter(|p| matches!(p, StreamPiece::Call(_)))
        .count();
    let mut index = stream.calls() - new_calls;
    let mut content = String::new();
    for piece in pieces {
        let call = match piece {
            StreamPiece::Content(c) => {
                content.push_str(&c);
                continue;
            }
            StreamPiece::Call(call) => call,
        };
        if !content.is_empty() {
            let before = openai::chat_delta(false, Some(&content), None);
            let chunk = openai::chat_chunk(meta, before, None, None);
            tx.send(data(&chunk)).await.ok()?;
            content.clear();
        }
        let delta = json!({"tool_calls": [openai::tool_call_json(Some(index), &call_id(), &call)]});
        tx.send(data(&openai::chat_chunk(meta, delta, None, None)))
            .await
            .ok()?;
        index += 1;
    }
    Some(content)
}

pub(super) async fn completions(
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
            let grammar = request.common.grammar.clone();
            let submitted = submit(&state, ready, ids, params, grammar, logprobs, arrived).await?;
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
        let grammar = request.common.grammar.clone();
        first = Some(
            submit(
                &state,
                ready,
                ids.clone(),
                *params,
                grammar,
                logprobs,
                arrived,
            )
            .await?,
        );
    }
    let include_usage = request.common.include_usage;
    let stops = request.common.stop.clone();
    let grammar = request.common.grammar.clone();
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
                    None => match submit(
                        &state,
                        ready,
                        ids,
                        params,
                        grammar.clone(),
                        logprobs,
                        arrived,
                    )
                    .await
                    {
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
                    let Ok(next) = next_streamed(&mut output, &state, &tx).await else {
                        return;
                    };
                    let Some(piece) = next else { break };
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
