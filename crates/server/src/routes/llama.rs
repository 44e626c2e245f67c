//! llama-server's own routes, for the clients written against it: `/tokenize` and
//! `/detokenize`, `/apply-template` (a chat's prompt as the model's template renders it), and
//! `/props` (the server's settings). Shapes as llama-server answers them.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde_json::{Map, Value, json};

use super::generation::off_the_runtime;
use super::{RawBody, engine_error, ready};
use crate::error::ApiError;
use crate::openai;
use crate::server::AppState;

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
    let request = openai::parse_chat(&body, &ready.sampling_defaults)?;
    let encoder = ready.encoder.clone();
    let prompt = off_the_runtime(move || {
        encoder
            .render_chat(&request.messages, &request.chat_template_kwargs)
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
