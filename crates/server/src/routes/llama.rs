//! llama-server's own routes, for the clients written against it: `/tokenize` and
//! `/detokenize`, `/apply-template` (a chat's prompt as the model's template renders it),
//! `/props` (the server's settings), and `/completion` (its native completion). Shapes as
//! llama-server answers them.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ember_engine::GenerateParams;
use serde_json::{Map, Value, json};

use super::completions::{data, next_streamed, sse, token_text};
use super::generation::{Output, off_the_runtime, plan, refuse_certainly_too_long, submit};
use super::{RawBody, engine_error, ready};
use crate::error::ApiError;
use crate::openai::{self, PromptInput};
use crate::server::{AppState, Ready};

type AppResult<T> = Result<T, ApiError>;

fn object(body: &[u8]) -> AppResult<Map<String, Value>> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

fn flag(obj: &Map<String, Value>, name: &str) -> AppResult<bool> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            name,
            format!("`{name}` must be a boolean"),
        )),
    }
}

/// `POST /tokenize {"content", "add_special", "with_pieces"}` → `{"tokens": [...]}`: ids, or
/// `{"id", "piece"}` objects with `with_pieces` (each piece decoded alone: a piece that holds
/// part of a character reads as U+FFFD).
pub(crate) async fn tokenize(
    State(state): State<Arc<AppState>>,
    RawBody(body): RawBody,
) -> AppResult<Json<Value>> {
    let ready = ready(&state)?;
    let obj = object(&body)?;
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::invalid("content", "`content` must be a string")),
        None => return Err(ApiError::invalid("content", "`content` is required")),
    };
    let (add_special, with_pieces) = (flag(&obj, "add_special")?, flag(&obj, "with_pieces")?);
    let tokenizer = Arc::clone(ready.encoder.tokenizer());
    let tokens = off_the_runtime(move || {
        let ids = tokenizer
            .encode(&content, add_special)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        if !with_pieces {
            return Ok(json!(ids));
        }
        let pieces: Vec<Value> = ids
            .iter()
            .map(|&id| json!({"id": id, "piece": tokenizer.decode(&[id], false)}))
            .collect();
        Ok(json!(pieces))
    })
    .await?;
    Ok(Json(json!({ "tokens": tokens })))
}

/// `POST /detokenize {"tokens": [...]}` → `{"content": "..."}`.
pub(crate) async fn detokenize(
    State(state): State<Arc<AppState>>,
    RawBody(body): RawBody,
) -> AppResult<Json<Value>> {
    let ready = ready(&state)?;
    let obj = object(&body)?;
    let vocab = ready.encoder.tokenizer().vocab_size();
    let ids: Vec<u32> = match obj.get("tokens") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                _ => Err(ApiError::invalid(
                    "tokens",
                    format!("`tokens` must hold token ids below the vocabulary's {vocab}, got {v}"),
                )),
            })
            .collect::<AppResult<_>>()?,
        Some(_) => return Err(ApiError::invalid("tokens", "`tokens` must be an array")),
        None => return Err(ApiError::invalid("tokens", "`tokens` is required")),
    };
    let content = ready.encoder.tokenizer().decode(&ids, false);
    Ok(Json(json!({ "content": content })))
}

/// `POST /apply-template {"messages": [...]}` → `{"prompt": "..."}`: what a chat completion
/// of those messages would prompt the model with.
pub(crate) async fn apply_template(
    State(state): State<Arc<AppState>>,
    RawBody(body): RawBody,
) -> AppResult<Json<Value>> {
    let ready = ready(&state)?;
    let mut request = openai::parse_chat(&body, &ready.sampling_defaults)?;
    // The tools a chat completion would show the model.
    super::completions::tool_calls_of(ready, &mut request)?;
    let encoder = ready.encoder.clone();
    let prompt = off_the_runtime(move || {
        encoder
            .render_chat_continuing(&request.messages, &request.chat_template_kwargs)
            .map_err(engine_error)
    })
    .await?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// `GET /props`: the model, the context, the slots, and the sampling a request gets for what
/// it leaves out.
pub(crate) async fn props(State(state): State<Arc<AppState>>) -> AppResult<Json<Value>> {
    let ready = ready(&state)?;
    let d = &ready.sampling_defaults;
    Ok(Json(json!({
        "default_generation_settings": {
            "n_ctx": ready.context,
            "params": {
                "temperature": d.temperature,
                "top_k": d.top_k,
                "top_p": d.top_p,
                "min_p": d.min_p,
                "seed": d.seed.map_or(json!(-1), |s| json!(s)),
                "repeat_penalty": d.penalties.repetition,
                "presence_penalty": d.penalties.presence,
                "frequency_penalty": d.penalties.frequency,
                "n_predict": state.default_max_tokens.map_or(json!(-1), |n| json!(n)),
            },
        },
        "total_slots": ready.parallel,
        "model_path": ready.model_path,
        "model_alias": state.model_name,
        "chat_template": ready.encoder.chat_template_source(),
        "build_info": format!("ember {}", env!("CARGO_PKG_VERSION")),
        "system_fingerprint": ready.fingerprint,
        "modalities": {"vision": false, "audio": false},
    })))
}

/// `POST /completion`: llama-server's native completion. The request takes llama-server's
/// fields (`prompt` as text or token ids, `n_predict`, `n_probs`, `stream`, the sampling
/// fields, `stop`, `cache_prompt`, `ignore_eos`); the answer is its shape: `content`,
/// `stop_type`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `timings`,
/// `generation_settings`, and `completion_probabilities` with `n_probs`. Streamed, each event
/// is `{"content", "stop": false}` and the last one the whole summary with `stop: true`
/// (no `[DONE]`, as llama-server).
pub(crate) async fn completion(
    State(state): State<Arc<AppState>>,
    RawBody(body): RawBody,
) -> AppResult<Response> {
    let arrived = Instant::now();
    let ready = ready(&state)?;
    let mut obj = object(&body)?;
    drop(body);
    // `n_probs` is OpenAI's `logprobs` (the alternatives per token) here.
    let n_probs = match obj.remove("n_probs") {
        None | Some(Value::Null) => 0,
        Some(v) => match v.as_u64() {
            Some(n) if n <= openai::MAX_TOP_LOGPROBS as u64 => n as usize,
            _ => {
                return Err(ApiError::invalid(
                    "n_probs",
                    format!(
                        "`n_probs` must be an integer in 0..={}",
                        openai::MAX_TOP_LOGPROBS
                    ),
                ));
            }
        },
    };
    if n_probs > 0 {
        obj.insert("logprobs".into(), json!(n_probs));
    }
    // llama-server counts its penalties over the last 64 tokens unless told otherwise.
    obj.entry("repeat_last_n").or_insert(json!(64));
    let request = openai::parse_completion(
        Value::Object(obj).to_string().as_bytes(),
        &ready.sampling_defaults,
    )?;
    let [prompt] = &request.prompts[..] else {
        return Err(ApiError::invalid(
            "prompt",
            "`/completion` takes one prompt: a string or an array of token ids",
        ));
    };
    let (ids, prompt_text) = match prompt {
        PromptInput::Text(text) => {
            refuse_certainly_too_long(ready, text.len())?;
            let (encoder, owned) = (ready.encoder.clone(), text.clone());
            let ids = off_the_runtime(move || encoder.encode_prompt(&owned).map_err(engine_error))
                .await?;
            (ids, text.clone())
        }
        PromptInput::Tokens(ids) => {
            let vocab = ready.encoder.tokenizer().vocab_size();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            (ids.clone(), ready.encoder.tokenizer().decode(ids, false))
        }
    };
    let params = plan(&state, ready, ids.len(), &request.common)?;
    let settings = generation_settings(&state, ready, &params, &request.common.stop);
    let prompt_tokens = ids.len();
    let grammar = request.common.grammar.clone();
    let submitted = submit(
        &state,
        ready,
        ids,
        params,
        grammar,
        request.logprobs,
        arrived,
    )
    .await?;
    let mut output = Output::new(submitted, request.common.stop.clone(), None, arrived);
    let summary = move |output: &Output, content: String, first: Option<Instant>| {
        let now = Instant::now();
        let first = first.unwrap_or(now);
        let evaluated = prompt_tokens - output.cached_tokens.min(prompt_tokens);
        let (prompt_ms, predicted_ms) = (
            (first - arrived).as_secs_f64() * 1e3,
            (now - first).as_secs_f64() * 1e3,
        );
        let predicted = output.completion_tokens;
        let per = |n: usize, ms: f64| (ms / n.max(1) as f64, n as f64 / (ms / 1e3).max(1e-9));
        let ((prompt_per_token, prompt_per_second), (predicted_per_token, predicted_per_second)) =
            (per(evaluated, prompt_ms), per(predicted, predicted_ms));
        json!({
            "content": content,
            "stop": true,
            "model": settings["model"],
            "tokens_predicted": predicted,
            "tokens_evaluated": prompt_tokens,
            "tokens_cached": output.cached_tokens,
            "generation_settings": settings,
            "prompt": prompt_text,
            "truncated": false,
            "stop_type": output.stop_type(),
            "stopping_word": "",
            "timings": {
                "prompt_n": evaluated,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_per_token,
                "prompt_per_second": prompt_per_second,
                "predicted_n": predicted,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_per_token,
                "predicted_per_second": predicted_per_second,
                "draft_n": output.drafted_tokens,
                "draft_n_accepted": output.accepted_tokens,
            },
        })
    };
    if !request.common.stream {
        let (mut content, mut probabilities, mut first) = (String::new(), Vec::new(), None);
        while let Some(piece) = output.next(&state).await? {
            first.get_or_insert_with(Instant::now);
            content.push_str(&piece.content);
            if n_probs > 0
                && let Some(token) = &piece.token
            {
                probabilities.push(token_probabilities(ready, token));
            }
        }
        let mut body = summary(&output, content, first);
        if n_probs > 0 {
            body["completion_probabilities"] = json!(probabilities);
        }
        return Ok(Json(body).into_response());
    }
    let state_for_task = Arc::clone(&state);
    Ok(sse(move |tx| {
        tokio::spawn(async move {
            let state = state_for_task;
            let Some(ready) = state.ready.get() else {
                return;
            };
            let mut first = None;
            loop {
                let Ok(next) = next_streamed(&mut output, &state, &tx).await else {
                    return;
                };
                let Some(piece) = next else { break };
                first.get_or_insert_with(Instant::now);
                let mut event = json!({"content": piece.content, "stop": false});
                if n_probs > 0
                    && let Some(token) = &piece.token
                {
                    event["completion_probabilities"] = json!([token_probabilities(ready, token)]);
                }
                if piece.content.is_empty() && event.get("completion_probabilities").is_none() {
                    continue;
                }
                if tx.send(data(&event)).await.is_err() {
                    return; // The client left; dropping `output` cancels the job.
                }
            }
            let _ = tx.send(data(&summary(&output, String::new(), first))).await;
        })
    }))
}

/// One token's entry of `completion_probabilities`: its id, text, log-probability and bytes,
/// and its top alternatives the same way (llama-server's current shape).
fn token_probabilities(ready: &Ready, token: &(u32, Option<f32>, Vec<(u32, f32)>)) -> Value {
    let entry = |id: u32, logprob: f32| {
        let text = token_text(ready, id);
        json!({"id": id, "token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let (id, logprob, top) = token;
    let mut value = entry(*id, logprob.unwrap_or(f32::NEG_INFINITY));
    value["top_logprobs"] = json!(
        top.iter()
            .map(|&(id, lp)| entry(id, lp))
            .collect::<Vec<_>>()
    );
    value
}

/// The settings a completion ran with, as llama-server reports them.
fn generation_settings(
    state: &AppState,
    ready: &Ready,
    params: &GenerateParams,
    stop: &[String],
) -> Value {
    let s = &params.sampling;
    json!({
        "model": state.model_name,
        "n_ctx": ready.context,
        "n_predict": params.max_tokens,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "seed": s.seed.map_or(json!(-1), |seed| json!(seed)),
        "repeat_penalty": s.penalties.repetition,
        "repeat_last_n": s.penalties.last_n.map_or(json!(-1), |n| {
            if n == usize::MAX { json!(-1) } else { json!(n) }
        }),
        "presence_penalty": s.penalties.presence,
        "frequency_penalty": s.penalties.frequency,
        "stop": stop,
        "ignore_eos": params.ignore_eos,
        "cache_prompt": params.cache_prompt,
    })
}
