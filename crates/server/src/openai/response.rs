//! Response bodies: whole responses, SSE chunks, the model list.

use serde_json::{Map, Value, json};

use super::MIN_LOGPROB;
use crate::tools::ToolCall;

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

/// What every response object of one request repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseMeta {
    /// `chatcmpl-<32 hex>` or `cmpl-<32 hex>`, made by the caller.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// Which model and build made the reply ([`crate::server`] derives it at load): replies
    /// with the same fingerprint and seed are reproducible.
    pub system_fingerprint: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens the prompt cache supplied.
    pub cached_tokens: usize,
}

/// One sampled token's logprob and the most likely alternatives, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CompletionChoice {
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: String,
}

/// The legacy completions logprobs shape (parallel lists).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token, alternatives most likely first; sent as `{token: logprob}` objects in this
    /// order (a token string repeated within one list keeps its first logprob).
    pub top_logprobs: Vec<Vec<(String, f32)>>,
    /// Byte offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

/// A non-streaming `chat.completion` with one choice.
pub fn chat_completion(
    meta: &ResponseMeta,
    content: &str,
    reasoning: Option<&str>,
    logprobs: Option<&[TokenLogprob]>,
    finish_reason: &str,
    usage: &Usage,
) -> Value {
    chat_completion_with_tools(
        meta,
        Some(content),
        &[],
        reasoning,
        logprobs,
        finish_reason,
        usage,
    )
}

/// [`chat_completion`] of a reply that may call tools: `content` `None` (JSON null) when the
/// reply is only calls, `tool_calls` each with its id.
pub fn chat_completion_with_tools(
    meta: &ResponseMeta,
    content: Option<&str>,
    tool_calls: &[(String, ToolCall)],
    reasoning: Option<&str>,
    logprobs: Option<&[TokenLogprob]>,
    finish_reason: &str,
    usage: &Usage,
) -> Value {
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    message.insert("content".into(), content.map_or(Value::Null, Value::from));
    if let Some(reasoning) = reasoning {
        message.insert("reasoning_content".into(), reasoning.into());
    }
    if !tool_calls.is_empty() {
        let calls: Vec<Value> = tool_calls
            .iter()
            .map(|(id, call)| tool_call_json(None, id, call))
            .collect();
        message.insert("tool_calls".into(), calls.into());
    }
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }],
        "usage": usage_json(usage),
    })
}

/// A call as OpenAI writes it; in a stream's delta also its `index` among the reply's calls.
pub fn tool_call_json(index: Option<usize>, id: &str, call: &ToolCall) -> Value {
    let mut value = json!({
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if let Some(index) = index {
        value["index"] = index.into();
    }
    value
}

/// One `chat.completion.chunk` of a stream; `finish_reason` is `None` until the last one.
pub fn chat_chunk(
    meta: &ResponseMeta,
    delta: Value,
    logprobs: Option<&[TokenLogprob]>,
    finish_reason: Option<&str>,
) -> Value {
    json!({
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{
            "index": 0,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }],
    })
}

/// A chunk's `delta`: `role` only when `role`, the others only when `Some`.
pub fn chat_delta(role: bool, content: Option<&str>, reasoning: Option<&str>) -> Value {
    let mut delta = Map::new();
    if role {
        delta.insert("role".into(), "assistant".into());
    }
    if let Some(content) = content {
        delta.insert("content".into(), content.into());
    }
    if let Some(reasoning) = reasoning {
        delta.insert("reasoning_content".into(), reasoning.into());
    }
    Value::Object(delta)
}

/// The final usage-only chunk of a stream with `include_usage` (`object` is
/// `chat.completion.chunk` or `text_completion`).
pub fn usage_chunk(meta: &ResponseMeta, object: &str, usage: &Usage) -> Value {
    json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.system_fingerprint,
        "choices": [],
        "usage": usage_json(usage),
    })
}

/// A non-streaming `text_completion`; choice `i` gets index `i`.
pub fn completion(meta: &ResponseMeta, choices: &[CompletionChoice], usage: &Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, choice)| {
            json!({
                "index": index,
                "text": choice.text,
                "logprobs": choice.logprobs.as_ref().map(completion_logprobs),
                "finish_reason": choice.finish_reason,
            })
        })
        .collect();
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.system_fingerprint,
        "choices": choices,
        "usage": usage_json(usage),
    })
}

/// One streamed `text_completion` chunk for choice `index`.
pub fn completion_chunk(
    meta: &ResponseMeta,
    index: usize,
    text: &str,
    logprobs: Option<&CompletionLogprobs>,
    finish_reason: Option<&str>,
) -> Value {
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.system_fingerprint,
        "choices": [{
            "index": index,
            "text": text,
            "logprobs": logprobs.map(completion_logprobs),
            "finish_reason": finish_reason,
        }],
    })
}

/// `/v1/models`: the one model served.
pub fn model_list(model: &str, created: u64) -> Value {
    json!({
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "ember"}],
    })
}

fn usage_json(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    })
}

/// A logprob as JSON: non-finite values become [`MIN_LOGPROB`], and the number is written as
/// the shortest decimal that reads back as the same f32 (`-0.1`, not `-0.10000000149011612`).
fn logprob_json(logprob: f32) -> Value {
    let logprob = if logprob.is_finite() {
        logprob
    } else {
        MIN_LOGPROB
    };
    let shortest: f64 = logprob.to_string().parse().unwrap_or(f64::from(logprob));
    json!(shortest)
}

fn chat_logprobs(logprobs: Option<&[TokenLogprob]>) -> Value {
    let Some(logprobs) = logprobs else {
        return Value::Null;
    };
    let content: Vec<Value> = logprobs
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|(token, logprob)| {
                    json!({"token": token, "logprob": logprob_json(*logprob), "bytes": token.as_bytes()})
                })
                .collect();
            json!({
                "token": t.token,
                "logprob": logprob_json(t.logprob),
                "bytes": t.token.as_bytes(),
                "top_logprobs": top,
            })
        })
        .collect();
    json!({ "content": content })
}

fn completion_logprobs(logprobs: &CompletionLogprobs) -> Value {
    let top: Vec<Value> = logprobs
        .top_logprobs
        .iter()
        .map(|alternatives| {
            let mut map = Map::new();
            for (token, logprob) in alternatives {
                map.entry(token.clone())
                    .or_insert_with(|| logprob_json(*logprob));
            }
            Value::Object(map)
        })
        .collect();
    json!({
        "tokens": logprobs.tokens,
        "token_logprobs": logprobs.token_logprobs.iter().map(|lp| logprob_json(*lp)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": logprobs.text_offset,
    })
}

#[cfg(test)]
#[path = "response_tests.rs"]
mod tests;
