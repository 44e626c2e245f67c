//! HTTP routes: the router, authentication, request counting, health and metrics; the
//! OpenAI completions ([`completions`]) over the generation plumbing they share
//! ([`generation`]); llama-server's own routes ([`llama`]).

mod completions;
mod generation;
mod llama;

use completions::{chat_completions, completions};

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::openai;
use crate::server::{AppState, Ready};

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
        .route("/tokenize", post(llama::tokenize))
        .route("/detokenize", post(llama::detokenize))
        .route("/apply-template", post(llama::apply_template))
        .route("/props", get(llama::props))
        .route("/completion", post(llama::completion))
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
