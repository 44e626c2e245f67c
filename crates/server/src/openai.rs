//! The OpenAI wire format: parsing and validating `/v1/chat/completions` and `/v1/completions`
//! request bodies, and building the response JSON (whole responses, SSE chunks, model list).
//!
//! Bodies are parsed into a [`serde_json::Value`] first and then read field by field, so that
//! every error is a 400 naming the field at fault in `param` (`messages[2].role`, `stop[1]`).
//! Conventions:
//! - `null` means the same as an absent field everywhere (OpenAI's SDKs send either).
//! - Integers may be written as integral floats (`16.0`), as pydantic-based servers accept.
//! - Fields OpenAI has that ember does not implement are rejected when set to anything but
//!   their neutral value (`frequency_penalty: 0`, `tools: []`, `response_format: {"type":
//!   "text"}`): a request is never silently answered as if they had been honoured. Fields ember
//!   does not know at all (`user`, `metadata`, `store`, ...) are ignored.

use ember_engine::chat_template::ChatMessage;
use ember_engine::sampler::{SamplingError, SamplingParams};
use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// The largest `max_tokens` accepted; above it a value is a client bug, not a wish.
pub const MAX_TOKENS_LIMIT: usize = 1 << 24;
/// The most stop strings one request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// The most alternatives `top_logprobs` / completions `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// What a logprob of `-inf` (or a non-finite one) is sent as; JSON has no infinities.
pub const MIN_LOGPROB: f32 = -9999.0;

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

/// Parameters shared by chat and text completions.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonParams {
    /// Any string is tolerated (one model is served); absent is fine.
    pub model: Option<String>,
    /// `max_tokens` or `max_completion_tokens`; `None` leaves the limit to the caller.
    pub max_tokens: Option<usize>,
    /// Temperature defaults to 1.0 as OpenAI's does; `top_k` -1 and 0 both mean off (0).
    pub sampling: SamplingParams,
    /// Non-empty strings, at most [`MAX_STOP_STRINGS`].
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// vLLM's extension: keep generating past the end-of-sequence token.
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub common: CommonParams,
    /// Non-empty; roles are `system` (also for `developer`), `user` or `assistant`.
    pub messages: Vec<ChatMessage>,
    /// Extra variables for the chat template (`enable_thinking`, ...); empty when absent.
    pub chat_template_kwargs: Map<String, Value>,
    pub logprobs: bool,
    /// 0..=[`MAX_TOP_LOGPROBS`]; non-zero only when `logprobs` is true.
    pub top_logprobs: usize,
}

/// One prompt of a text-completion request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub common: CommonParams,
    /// At least one, none empty. Token ids are not checked against the vocabulary here.
    pub prompts: Vec<PromptInput>,
    /// 0..=[`MAX_TOP_LOGPROBS`] alternatives per token; `None` = no logprobs.
    pub logprobs: Option<usize>,
    /// Always false: `echo: true` is rejected.
    pub echo: bool,
}

/// Parses and validates a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let obj = parse_object(body)?;
    let messages = parse_messages(field(&obj, "messages"))?;
    let common = parse_common(&obj)?;
    let chat_template_kwargs = match field(&obj, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(other) => return Err(wrong_type("chat_template_kwargs", "an object", other)),
    };
    let logprobs = bool_field(field(&obj, "logprobs"), "logprobs")?.unwrap_or(false);
    let top_logprobs = match int_field(field(&obj, "top_logprobs"), "top_logprobs")? {
        None => 0,
        Some(n) if (0..=MAX_TOP_LOGPROBS as i128).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            ));
        }
    };
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` requires `logprobs` to be true",
        ));
    }
    Ok(ChatRequest {
        common,
        messages,
        chat_template_kwargs,
        logprobs,
        top_logprobs,
    })
}

/// Parses and validates a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let obj = parse_object(body)?;
    let prompts = parse_prompt(field(&obj, "prompt"))?;
    let common = parse_common(&obj)?;
    match field(&obj, "suffix") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(_)) => return Err(unsupported("suffix")),
        Some(other) => return Err(wrong_type("suffix", "a string", other)),
    }
    if bool_field(field(&obj, "echo"), "echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported yet"));
    }
    let logprobs = match int_field(field(&obj, "logprobs"), "logprobs")? {
        None => None,
        Some(n) if (0..=MAX_TOP_LOGPROBS as i128).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            ));
        }
    };
    Ok(CompletionRequest {
        common,
        prompts,
        logprobs,
        echo: false,
    })
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("the request body is not valid UTF-8"))?;
    // serde_json stops at 128 levels of nesting with an error, so deep input cannot overflow
    // the stack, and a `Value` it returns is shallow enough to drop recursively.
    let value: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, got {}",
            type_name(&other)
        ))),
    }
}

fn parse_common(obj: &Map<String, Value>) -> Result<CommonParams, ApiError> {
    let model = str_field(field(obj, "model"), "model")?.map(str::to_owned);

    let max_tokens = max_tokens_field(obj, "max_tokens")?;
    let max_completion_tokens = max_tokens_field(obj, "max_completion_tokens")?;
    let max_tokens = match (max_tokens, max_completion_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::invalid(
                "max_completion_tokens",
                format!(
                    "`max_tokens` ({a}) and `max_completion_tokens` ({b}) disagree; send one of them"
                ),
            ));
        }
        (a, b) => a.or(b),
    };

    let sampling = parse_sampling(obj)?;
    let stop = parse_stop(field(obj, "stop"))?;

    let stream = bool_field(field(obj, "stream"), "stream")?.unwrap_or(false);
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(options)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "`stream_options` is only allowed when `stream` is true",
                ));
            }
            bool_field(
                field(options, "include_usage"),
                "stream_options.include_usage",
            )?
            .unwrap_or(false)
        }
        Some(other) => return Err(wrong_type("stream_options", "an object", other)),
    };
    let ignore_eos = bool_field(field(obj, "ignore_eos"), "ignore_eos")?.unwrap_or(false);

    for name in ["n", "best_of"] {
        match int_field(field(obj, name), name)? {
            None | Some(1) => {}
            Some(n) if n > 1 => {
                return Err(ApiError::invalid(
                    name,
                    format!("{name} > 1 is not supported yet"),
                ));
            }
            Some(n) => {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be >= 1, got {n}"),
                ));
            }
        }
    }
    reject_unsupported(obj)?;

    Ok(CommonParams {
        model,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        ignore_eos,
    })
}

fn max_tokens_field(obj: &Map<String, Value>, name: &str) -> Result<Option<usize>, ApiError> {
    match int_field(field(obj, name), name)? {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid(
            name,
            format!("`{name}` must be >= 1, got {n}"),
        )),
        Some(n) if n > MAX_TOKENS_LIMIT as i128 => Err(ApiError::invalid(
            name,
            format!("`{name}` must be at most {MAX_TOKENS_LIMIT}, got {n}"),
        )),
        Some(n) => Ok(Some(n as usize)),
    }
}

fn parse_sampling(obj: &Map<String, Value>) -> Result<SamplingParams, ApiError> {
    let temperature = match number_field(field(obj, "temperature"), "temperature")? {
        None => 1.0,
        Some(t) if (0.0..=2.0).contains(&t) => t,
        Some(t) => {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be between 0 and 2, got {t}"),
            ));
        }
    };
    let top_p = match number_field(field(obj, "top_p"), "top_p")? {
        None => 1.0,
        Some(p) if p > 0.0 && p <= 1.0 => p,
        Some(p) => {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {p}"),
            ));
        }
    };
    let top_k = match int_field(field(obj, "top_k"), "top_k")? {
        None | Some(-1) | Some(0) => 0,
        // Larger than any vocabulary means off too; the sampler handles that.
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1, 0 (both mean off) or a positive integer, got {k}"),
            ));
        }
    };
    let min_p = match number_field(field(obj, "min_p"), "min_p")? {
        None => 0.0,
        Some(p) if (0.0..=1.0).contains(&p) => p,
        Some(p) => {
            return Err(ApiError::invalid(
                "min_p",
                format!("`min_p` must be between 0 and 1, got {p}"),
            ));
        }
    };
    let seed = match int_field(field(obj, "seed"), "seed")? {
        None => None,
        Some(s) => Some(u64::try_from(s).map_err(|_| {
            ApiError::invalid(
                "seed",
                format!("`seed` must be an integer in 0..={}, got {s}", u64::MAX),
            )
        })?),
    };
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        seed,
    };
    // The ranges above are at least as strict; this catches what rounding to f32 changes
    // (a top_p of 1e-60 becomes 0).
    sampling.validate().map_err(|e| {
        let param = match e {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::MinP(_) => "min_p",
        };
        ApiError::invalid(param, e.to_string())
    })?;
    Ok(sampling)
}

fn parse_stop(value: Option<&Value>) -> Result<Vec<String>, ApiError> {
    match value {
        None => Ok(Vec::new()),
        Some(Value::String(s)) if s.is_empty() => Err(ApiError::invalid(
            "stop",
            "`stop` must not be an empty string",
        )),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_STRINGS {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let param = format!("stop[{i}]");
                    match item {
                        Value::String(s) if s.is_empty() => Err(ApiError::invalid(
                            &param,
                            format!("`{param}` must not be an empty string"),
                        )),
                        Value::String(s) => Ok(s.clone()),
                        other => Err(wrong_type(&param, "a string", other)),
                    }
                })
                .collect()
        }
        Some(other) => Err(wrong_type("stop", "a string or an array of strings", other)),
    }
}

/// OpenAI parameters ember does not implement: an error unless neutral.
fn reject_unsupported(obj: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, neutral) in [
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ] {
        if let Some(x) = number_field(field(obj, name), name)?
            && x != neutral
        {
            return Err(unsupported(name));
        }
    }
    match field(obj, "logit_bias") {
        None => {}
        Some(Value::Object(map)) if map.is_empty() => {}
        Some(Value::Object(_)) => return Err(unsupported("logit_bias")),
        Some(other) => return Err(wrong_type("logit_bias", "an object", other)),
    }
    for name in ["tools", "functions"] {
        match field(obj, name) {
            None => {}
            Some(Value::Array(items)) if items.is_empty() => {}
            Some(Value::Array(_)) => return Err(unsupported(name)),
            Some(other) => return Err(wrong_type(name, "an array", other)),
        }
    }
    // With no tools, "none" and "auto" both mean a plain answer.
    for name in ["tool_choice", "function_call"] {
        match field(obj, name) {
            None => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(_) => return Err(unsupported(name)),
        }
    }
    match field(obj, "response_format") {
        None => {}
        Some(Value::Object(map)) if map.get("type").and_then(Value::as_str) == Some("text") => {}
        Some(Value::Object(_)) => {
            return Err(ApiError::invalid(
                "response_format",
                "`response_format` is not supported (only {\"type\": \"text\"} is)",
            ));
        }
        Some(other) => return Err(wrong_type("response_format", "an object", other)),
    }
    Ok(())
}

fn parse_messages(value: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match value {
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type("messages", "an array of messages", other)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| parse_message(i, item))
        .collect()
}

fn parse_message(index: usize, value: &Value) -> Result<ChatMessage, ApiError> {
    let p = format!("messages[{index}]");
    let Value::Object(obj) = value else {
        return Err(wrong_type(&p, "an object", value));
    };
    let role_param = format!("{p}.role");
    let given_role = match str_field(field(obj, "role"), &role_param)? {
        Some(role) => role,
        None => {
            return Err(ApiError::invalid(
                &role_param,
                format!("`{role_param}` is required"),
            ));
        }
    };
    let role = match given_role {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(ApiError::invalid(
                &role_param,
                format!(
                    "unsupported role `{other}` in `{role_param}` (expected system, developer, user or assistant)"
                ),
            ));
        }
    };
    let assistant = role == "assistant";

    let content_param = format!("{p}.content");
    let content = match field(obj, "content") {
        None if assistant => String::new(),
        None => {
            return Err(ApiError::invalid(
                &content_param,
                format!("`{content_param}` is required for a {given_role} message"),
            ));
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                text.push_str(content_part(&format!("{content_param}[{j}]"), part)?);
            }
            text
        }
        Some(other) => {
            return Err(wrong_type(
                &content_param,
                "a string or an array of content parts",
                other,
            ));
        }
    };

    match field(obj, "tool_calls") {
        None => {}
        Some(Value::Array(calls)) if calls.is_empty() => {}
        Some(_) => return Err(unsupported(&format!("{p}.tool_calls"))),
    }

    let reasoning_param = format!("{p}.reasoning_content");
    let reasoning_content = str_field(field(obj, "reasoning_content"), &reasoning_param)?;
    Ok(ChatMessage {
        role: role.to_owned(),
        content,
        // Only an assistant's turn has reasoning; on other roles it is ignored.
        reasoning_content: reasoning_content.filter(|_| assistant).map(str::to_owned),
    })
}

fn content_part<'a>(param: &str, part: &'a Value) -> Result<&'a str, ApiError> {
    let Value::Object(obj) = part else {
        return Err(wrong_type(param, "an object", part));
    };
    let type_param = format!("{param}.type");
    match str_field(field(obj, "type"), &type_param)? {
        Some("text") => {}
        Some(other) => {
            return Err(ApiError::invalid(
                &type_param,
                format!("only text content is supported (`{type_param}` is `{other}`)"),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                &type_param,
                format!("`{type_param}` is required"),
            ));
        }
    }
    let text_param = format!("{param}.text");
    match str_field(field(obj, "text"), &text_param)? {
        Some(text) => Ok(text),
        None => Err(ApiError::invalid(
            &text_param,
            format!("`{text_param}` is required"),
        )),
    }
}

fn parse_prompt(value: Option<&Value>) -> Result<Vec<PromptInput>, ApiError> {
    const EXPECTED: &str =
        "a string, an array of strings, an array of token ids or an array of arrays of token ids";
    let items = match value {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) if s.is_empty() => return Err(prompt_empty("prompt")),
        Some(Value::String(s)) => return Ok(vec![PromptInput::Text(s.clone())]),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type("prompt", EXPECTED, other)),
    };
    let Some(first) = items.first() else {
        return Err(prompt_empty("prompt"));
    };
    match first {
        Value::String(_) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let param = format!("prompt[{i}]");
                match item {
                    Value::String(s) if s.is_empty() => Err(prompt_empty(&param)),
                    Value::String(s) => Ok(PromptInput::Text(s.clone())),
                    other => Err(wrong_type(
                        &param,
                        "a string, like the first element of `prompt`",
                        other,
                    )),
                }
            })
            .collect(),
        Value::Number(_) => Ok(vec![PromptInput::Tokens(token_ids(items, "prompt")?)]),
        Value::Array(_) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let param = format!("prompt[{i}]");
                match item {
                    Value::Array(ids) if ids.is_empty() => Err(prompt_empty(&param)),
                    Value::Array(ids) => Ok(PromptInput::Tokens(token_ids(ids, &param)?)),
                    other => Err(wrong_type(
                        &param,
                        "an array of token ids, like the first element of `prompt`",
                        other,
                    )),
                }
            })
            .collect(),
        other => Err(wrong_type("prompt[0]", EXPECTED, other)),
    }
}

fn prompt_empty(param: &str) -> ApiError {
    ApiError::invalid(param, "prompt is empty")
}

fn token_ids(items: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(j, item)| {
            as_integer(item)
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    let param = format!("{param}[{j}]");
                    ApiError::invalid(
                        &param,
                        format!(
                            "`{param}` must be a token id (an integer in 0..={}), got {item}",
                            u32::MAX
                        ),
                    )
                })
        })
        .collect()
}

// Field readers. Each takes the value (None when absent or null) and the param to blame.

/// The field `key` of `obj`, with `null` read as absent.
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!("`{param}` must be {expected}, got {}", type_name(got)),
    )
}

fn unsupported(param: &str) -> ApiError {
    ApiError::invalid(param, format!("`{param}` is not supported"))
}

fn bool_field(value: Option<&Value>, param: &str) -> Result<Option<bool>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong_type(param, "a boolean", other)),
    }
}

fn str_field<'a>(value: Option<&'a Value>, param: &str) -> Result<Option<&'a str>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong_type(param, "a string", other)),
    }
}

fn number_field(value: Option<&Value>, param: &str) -> Result<Option<f64>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(other) => Err(wrong_type(param, "a number", other)),
    }
}

fn int_field(value: Option<&Value>, param: &str) -> Result<Option<i128>, ApiError> {
    match value {
        None => Ok(None),
        Some(v @ Value::Number(_)) => match as_integer(v) {
            Some(n) => Ok(Some(n)),
            None => Err(ApiError::invalid(
                param,
                format!("`{param}` must be an integer, got {v}"),
            )),
        },
        Some(other) => Err(wrong_type(param, "an integer", other)),
    }
}

/// A JSON number that is an integer (`16` or `16.0`), widened so no range check overflows.
fn as_integer(value: &Value) -> Option<i128> {
    if let Some(i) = value.as_i64() {
        return Some(i.into());
    }
    if let Some(u) = value.as_u64() {
        return Some(u.into());
    }
    let f = value.as_f64()?;
    (f.fract() == 0.0 && f.abs() < 1e30).then_some(f as i128)
}

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
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
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    message.insert("content".into(), content.into());
    if let Some(reasoning) = reasoning {
        message.insert("reasoning_content".into(), reasoning.into());
    }
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }],
        "usage": usage_json(usage),
    })
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
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn chat(body: Value) -> Result<ChatRequest, ApiError> {
        parse_chat(body.to_string().as_bytes())
    }

    fn comp(body: Value) -> Result<CompletionRequest, ApiError> {
        parse_completion(body.to_string().as_bytes())
    }

    /// A valid chat body with `extra` fields merged in.
    fn chat_with(extra: Value) -> Value {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    fn comp_with(extra: Value) -> Value {
        let mut body = json!({"model": "m", "prompt": "hello"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    /// Asserts a 400 invalid_request_error naming `param` whose message contains `needle`.
    #[track_caller]
    fn assert_invalid<T: std::fmt::Debug>(
        result: Result<T, ApiError>,
        param: Option<&str>,
        needle: &str,
    ) {
        let e = result.expect_err("expected an error");
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{e:?}");
        assert_eq!(e.kind, "invalid_request_error");
        assert_eq!(e.param.as_deref(), param, "{e:?}");
        assert!(
            e.message.contains(needle),
            "message {:?} lacks {needle:?}",
            e.message
        );
    }

    #[test]
    fn body_must_be_utf8_json_object() {
        assert_invalid(
            parse_chat(b"{\"messages\": \"\xff\xfe\"}"),
            None,
            "the request body is not valid UTF-8",
        );
        assert_invalid(
            parse_completion(b"\xc3"),
            None,
            "the request body is not valid UTF-8",
        );
        assert_invalid(
            parse_chat(b"{\"model\": \"m\",\n  \"messages\": [}"),
            None,
            "line 2 column",
        );
        assert_invalid(parse_chat(b""), None, "not valid JSON");
        assert_invalid(
            parse_chat(b"[1, 2]"),
            None,
            "must be a JSON object, got an array",
        );
        assert_invalid(
            parse_completion(b"\"text\""),
            None,
            "must be a JSON object, got a string",
        );
        assert_invalid(parse_chat(b"null"), None, "must be a JSON object, got null");
        // Out of f64 range is a parse error in serde_json.
        assert_invalid(
            parse_chat(
                br#"{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}"#,
            ),
            None,
            "not valid JSON",
        );
    }

    #[test]
    fn deep_nesting_is_a_400_not_a_crash() {
        let deep = "[".repeat(100_000);
        assert_invalid(parse_chat(deep.as_bytes()), None, "recursion limit");
        let deep_field = format!("{{\"messages\": {}", "[".repeat(100_000));
        assert_invalid(parse_chat(deep_field.as_bytes()), None, "recursion limit");
        let deep_objects = "{\"a\":".repeat(100_000);
        assert_invalid(
            parse_completion(deep_objects.as_bytes()),
            None,
            "recursion limit",
        );
        // Nesting within the limit is fine where a field is ignored.
        let ok = format!(
            "{{\"prompt\": \"x\", \"metadata\": {}1{}}}",
            "[".repeat(100),
            "]".repeat(100)
        );
        assert!(parse_completion(ok.as_bytes()).is_ok());
    }

    #[test]
    fn minimal_chat_gets_openai_defaults() {
        let r = chat(json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert_eq!(r.messages, vec![ChatMessage::new("user", "hi")]);
        let c = &r.common;
        assert_eq!(c.model, None);
        assert_eq!(c.max_tokens, None);
        assert_eq!(
            c.sampling,
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: None
            }
        );
        assert!(c.stop.is_empty());
        assert!(!c.stream && !c.include_usage && !c.ignore_eos);
        assert!(r.chat_template_kwargs.is_empty());
        assert!(!r.logprobs);
        assert_eq!(r.top_logprobs, 0);
    }

    #[test]
    fn full_chat_request() {
        let r = chat(json!({
            "model": "anything/at-all",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "reasoning_content": "hmm"},
                {"role": "assistant", "content": "ok", "tool_calls": []},
                {"role": "user", "content": "c", "name": "bob"},
            ],
            "max_completion_tokens": 64,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "stop": ["\n\n", "END"],
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
            "n": 1,
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "logit_bias": {},
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "chat_template_kwargs": {"enable_thinking": false},
            "logprobs": true,
            "top_logprobs": 5,
            "user": "u-1",
            "metadata": {"a": "b"},
            "store": false,
        }))
        .unwrap();
        assert_eq!(
            r.messages,
            vec![
                ChatMessage::new("system", "be brief"),
                ChatMessage::new("user", "ab"),
                ChatMessage {
                    role: "assistant".into(),
                    content: String::new(),
                    reasoning_content: Some("hmm".into())
                },
                ChatMessage::new("assistant", "ok"),
                ChatMessage::new("user", "c"),
            ]
        );
        let c = &r.common;
        assert_eq!(c.model.as_deref(), Some("anything/at-all"));
        assert_eq!(c.max_tokens, Some(64));
        assert_eq!(
            c.sampling,
            SamplingParams {
                temperature: 0.0,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                seed: Some(7)
            }
        );
        assert_eq!(c.stop, vec!["\n\n".to_string(), "END".to_string()]);
        assert!(c.stream && c.include_usage && c.ignore_eos);
        assert_eq!(r.chat_template_kwargs["enable_thinking"], json!(false));
        assert!(r.logprobs);
        assert_eq!(r.top_logprobs, 5);
    }

    #[test]
    fn nulls_read_as_absent() {
        let r = chat(chat_with(json!({
            "model": null, "max_tokens": null, "temperature": null, "top_p": null, "top_k": null,
            "min_p": null, "seed": null, "stop": null, "stream": null, "stream_options": null,
            "n": null, "tools": null, "tool_choice": null, "response_format": null,
            "logit_bias": null, "chat_template_kwargs": null, "logprobs": null, "top_logprobs": null,
        })))
        .unwrap();
        assert_eq!(r.common.sampling.temperature, 1.0);
        assert_eq!(r.common.model, None);
    }

    #[test]
    fn messages_are_validated() {
        assert_invalid(
            chat(json!({"model": "m"})),
            Some("messages"),
            "`messages` is required",
        );
        assert_invalid(
            chat(json!({"messages": []})),
            Some("messages"),
            "must not be empty",
        );
        assert_invalid(
            chat(json!({"messages": "hi"})),
            Some("messages"),
            "must be an array",
        );
        assert_invalid(
            chat(json!({"messages": [1]})),
            Some("messages[0]"),
            "must be an object",
        );
        let two =
            |second: Value| chat(json!({"messages": [{"role": "user", "content": "a"}, second]}));
        assert_invalid(
            two(json!({"role": "tool", "content": "x"})),
            Some("messages[1].role"),
            "unsupported role `tool`",
        );
        assert_invalid(
            two(json!({"content": "x"})),
            Some("messages[1].role"),
            "is required",
        );
        assert_invalid(
            two(json!({"role": 3, "content": "x"})),
            Some("messages[1].role"),
            "must be a string, got a number",
        );
        assert_invalid(
            two(json!({"role": "user", "content": null})),
            Some("messages[1].content"),
            "is required for a user message",
        );
        assert_invalid(
            two(json!({"role": "system"})),
            Some("messages[1].content"),
            "is required",
        );
        assert_invalid(
            two(json!({"role": "user", "content": 5})),
            Some("messages[1].content"),
            "a string or an array of content parts",
        );
        assert_invalid(
            two(
                json!({"role": "user", "content": [{"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "http://x"}}]}),
            ),
            Some("messages[1].content[1].type"),
            "only text content is supported",
        );
        assert_invalid(
            two(json!({"role": "user", "content": ["a"]})),
            Some("messages[1].content[0]"),
            "must be an object",
        );
        assert_invalid(
            two(json!({"role": "user", "content": [{"text": "a"}]})),
            Some("messages[1].content[0].type"),
            "is required",
        );
        assert_invalid(
            two(json!({"role": "user", "content": [{"type": "text", "text": 1}]})),
            Some("messages[1].content[0].text"),
            "must be a string",
        );
        assert_invalid(
            two(json!({"role": "user", "content": [{"type": "text"}]})),
            Some("messages[1].content[0].text"),
            "is required",
        );
        assert_invalid(
            two(json!({"role": "assistant", "content": "x", "reasoning_content": 1})),
            Some("messages[1].reasoning_content"),
            "must be a string",
        );
        assert_invalid(
            two(json!({"role": "assistant", "content": null,
                "tool_calls": [{"id": "1", "type": "function"}]})),
            Some("messages[1].tool_calls"),
            "is not supported",
        );
        // Reasoning on a non-assistant turn is dropped; an assistant may omit content.
        let r = two(json!({"role": "assistant"})).unwrap();
        assert_eq!(r.messages[1], ChatMessage::new("assistant", ""));
        let r =
            chat(json!({"messages": [{"role": "user", "content": "a", "reasoning_content": "r"}]}))
                .unwrap();
        assert_eq!(r.messages[0].reasoning_content, None);
        let r = chat(json!({"messages": [{"role": "user", "content": []}]})).unwrap();
        assert_eq!(r.messages[0].content, "");
    }

    #[test]
    fn max_tokens_rules() {
        let mt = |extra: Value| chat(chat_with(extra)).map(|r| r.common.max_tokens);
        assert_eq!(mt(json!({"max_tokens": 16})).unwrap(), Some(16));
        assert_eq!(mt(json!({"max_tokens": 16.0})).unwrap(), Some(16));
        assert_eq!(mt(json!({"max_completion_tokens": 9})).unwrap(), Some(9));
        assert_eq!(
            mt(json!({"max_tokens": 9, "max_completion_tokens": 9})).unwrap(),
            Some(9)
        );
        assert_eq!(mt(json!({"max_tokens": 1 << 24})).unwrap(), Some(1 << 24));
        assert_invalid(
            mt(json!({"max_tokens": 9, "max_completion_tokens": 10})),
            Some("max_completion_tokens"),
            "disagree",
        );
        assert_invalid(mt(json!({"max_tokens": 0})), Some("max_tokens"), ">= 1");
        assert_invalid(mt(json!({"max_tokens": -5})), Some("max_tokens"), ">= 1");
        assert_invalid(
            mt(json!({"max_tokens": (1u64 << 24) + 1})),
            Some("max_tokens"),
            "at most 16777216",
        );
        assert_invalid(
            mt(json!({"max_tokens": 1e20})),
            Some("max_tokens"),
            "at most",
        );
        assert_invalid(
            mt(json!({"max_tokens": u64::MAX})),
            Some("max_tokens"),
            "at most",
        );
        assert_invalid(
            mt(json!({"max_tokens": 1.5})),
            Some("max_tokens"),
            "must be an integer",
        );
        assert_invalid(
            mt(json!({"max_tokens": "16"})),
            Some("max_tokens"),
            "must be an integer, got a string",
        );
        assert_invalid(
            mt(json!({"max_completion_tokens": 0})),
            Some("max_completion_tokens"),
            ">= 1",
        );
    }

    #[test]
    fn sampling_ranges() {
        let s = |extra: Value| chat(chat_with(extra)).map(|r| r.common.sampling);
        assert_eq!(s(json!({"temperature": 2})).unwrap().temperature, 2.0);
        assert_eq!(s(json!({"temperature": 0.7})).unwrap().temperature, 0.7);
        assert_invalid(
            s(json!({"temperature": 2.01})),
            Some("temperature"),
            "between 0 and 2",
        );
        assert_invalid(
            s(json!({"temperature": -0.1})),
            Some("temperature"),
            "between 0 and 2",
        );
        assert_invalid(
            s(json!({"temperature": 1e30})),
            Some("temperature"),
            "between 0 and 2",
        );
        assert_invalid(
            s(json!({"temperature": "hot"})),
            Some("temperature"),
            "must be a number, got a string",
        );
        assert_invalid(s(json!({"top_p": 0})), Some("top_p"), "(0, 1]");
        assert_invalid(s(json!({"top_p": 1.5})), Some("top_p"), "(0, 1]");
        // Positive in f64 but zero as f32.
        assert_invalid(s(json!({"top_p": 1e-60})), Some("top_p"), "top_p");
        assert_eq!(s(json!({"top_k": -1})).unwrap().top_k, 0);
        assert_eq!(s(json!({"top_k": 0})).unwrap().top_k, 0);
        assert_eq!(s(json!({"top_k": 1})).unwrap().top_k, 1);
        assert_eq!(s(json!({"top_k": 1e20})).unwrap().top_k, usize::MAX);
        assert_invalid(s(json!({"top_k": -2})), Some("top_k"), "-1, 0");
        assert_invalid(
            s(json!({"top_k": 2.5})),
            Some("top_k"),
            "must be an integer",
        );
        assert_invalid(s(json!({"top_k": true})), Some("top_k"), "got a boolean");
        assert_eq!(s(json!({"min_p": 1})).unwrap().min_p, 1.0);
        assert_invalid(s(json!({"min_p": 1.5})), Some("min_p"), "between 0 and 1");
        assert_invalid(s(json!({"min_p": -0.5})), Some("min_p"), "between 0 and 1");
        assert_eq!(s(json!({"seed": 0})).unwrap().seed, Some(0));
        assert_eq!(s(json!({"seed": u64::MAX})).unwrap().seed, Some(u64::MAX));
        assert_invalid(
            s(json!({"seed": -1})),
            Some("seed"),
            "0..=18446744073709551615",
        );
        assert_invalid(
            parse_chat(
                br#"{"messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616}"#,
            ),
            Some("seed"),
            "0..=",
        );
        assert_invalid(s(json!({"seed": 0.5})), Some("seed"), "must be an integer");
        assert_invalid(s(json!({"seed": "1"})), Some("seed"), "got a string");
    }

    #[test]
    fn stop_strings() {
        let stop = |v: Value| chat(chat_with(json!({"stop": v}))).map(|r| r.common.stop);
        assert_eq!(stop(json!("x")).unwrap(), vec!["x".to_string()]);
        assert_eq!(
            stop(json!(["a", "b"])).unwrap(),
            vec!["a".to_string(), "b".to_string()]
        );
        assert!(stop(json!([])).unwrap().is_empty());
        assert!(stop(Value::Null).unwrap().is_empty());
        assert_eq!(stop(json!(vec!["s"; 16])).unwrap().len(), 16);
        assert_invalid(
            stop(json!(vec!["s"; 17])),
            Some("stop"),
            "at most 16 strings, got 17",
        );
        assert_invalid(stop(json!("")), Some("stop"), "must not be an empty string");
        assert_invalid(
            stop(json!(["a", 1])),
            Some("stop[1]"),
            "must be a string, got a number",
        );
        assert_invalid(
            stop(json!(["a", "b", ""])),
            Some("stop[2]"),
            "must not be an empty",
        );
        assert_invalid(
            stop(json!(5)),
            Some("stop"),
            "a string or an array of strings",
        );
    }

    #[test]
    fn streaming_flags() {
        let c = |extra: Value| chat(chat_with(extra)).map(|r| r.common);
        let r = c(json!({"stream": true})).unwrap();
        assert!(r.stream && !r.include_usage);
        let r = c(json!({"stream": true, "stream_options": {}})).unwrap();
        assert!(!r.include_usage);
        let r = c(json!({"stream": true, "stream_options": {"include_usage": false}})).unwrap();
        assert!(!r.include_usage);
        assert_invalid(
            c(json!({"stream_options": {"include_usage": true}})),
            Some("stream_options"),
            "only allowed when `stream` is true",
        );
        assert_invalid(
            c(json!({"stream": false, "stream_options": {}})),
            Some("stream_options"),
            "only allowed",
        );
        assert_invalid(
            c(json!({"stream": true, "stream_options": {"include_usage": "yes"}})),
            Some("stream_options.include_usage"),
            "must be a boolean",
        );
        assert_invalid(
            c(json!({"stream": true, "stream_options": true})),
            Some("stream_options"),
            "must be an object",
        );
        assert_invalid(
            c(json!({"stream": 1})),
            Some("stream"),
            "must be a boolean, got a number",
        );
        assert_invalid(
            c(json!({"ignore_eos": "no"})),
            Some("ignore_eos"),
            "must be a boolean",
        );
        assert_invalid(c(json!({"model": 1})), Some("model"), "must be a string");
    }

    #[test]
    fn n_and_best_of() {
        let c = |extra: Value| chat(chat_with(extra));
        assert!(c(json!({"n": 1})).is_ok());
        assert!(c(json!({"n": 1.0, "best_of": 1})).is_ok());
        assert_invalid(c(json!({"n": 2})), Some("n"), "n > 1 is not supported yet");
        assert_invalid(c(json!({"n": 0})), Some("n"), "must be >= 1");
        assert_invalid(c(json!({"n": -3})), Some("n"), "must be >= 1");
        assert_invalid(c(json!({"n": 1.5})), Some("n"), "must be an integer");
        assert_invalid(
            c(json!({"n": "1"})),
            Some("n"),
            "must be an integer, got a string",
        );
        assert_invalid(
            comp(comp_with(json!({"best_of": 3}))),
            Some("best_of"),
            "best_of > 1 is not supported",
        );
        assert_invalid(
            comp(comp_with(json!({"n": 4}))),
            Some("n"),
            "not supported yet",
        );
    }

    #[test]
    fn unsupported_features_are_rejected_not_ignored() {
        let c = |extra: Value| chat(chat_with(extra));
        for (extra, param) in [
            (json!({"frequency_penalty": 0.5}), "frequency_penalty"),
            (json!({"presence_penalty": -1}), "presence_penalty"),
            (json!({"repetition_penalty": 1.1}), "repetition_penalty"),
            (json!({"logit_bias": {"50256": -100}}), "logit_bias"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
                "tools",
            ),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "tool_choice",
            ),
            (json!({"function_call": {"name": "f"}}), "function_call"),
        ] {
            assert_invalid(
                c(extra),
                Some(param),
                &format!("`{param}` is not supported"),
            );
        }
        assert_invalid(
            c(json!({"response_format": {"type": "json_object"}})),
            Some("response_format"),
            "`response_format` is not supported",
        );
        assert_invalid(
            c(json!({"response_format": {"type": "json_schema", "json_schema": {}}})),
            Some("response_format"),
            "not supported",
        );
        assert_invalid(
            c(json!({"response_format": "json"})),
            Some("response_format"),
            "must be an object",
        );
        assert_invalid(
            c(json!({"frequency_penalty": "0"})),
            Some("frequency_penalty"),
            "must be a number",
        );
        assert_invalid(
            c(json!({"logit_bias": []})),
            Some("logit_bias"),
            "must be an object",
        );
        assert_invalid(c(json!({"tools": {}})), Some("tools"), "must be an array");
        // Neutral values and unknown fields pass.
        assert!(
            c(
                json!({"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1,
                "logit_bias": {}, "tools": [], "functions": [], "tool_choice": "auto",
                "function_call": "none", "response_format": {"type": "text"},
                "parallel_tool_calls": true, "user": "x", "metadata": {"k": "v"}, "store": true,
                "service_tier": "auto", "some_future_field": [1, 2, 3]})
            )
            .is_ok()
        );
        assert_invalid(
            comp(comp_with(json!({"presence_penalty": 2}))),
            Some("presence_penalty"),
            "is not supported",
        );
    }

    #[test]
    fn chat_logprobs_and_kwargs() {
        let c = |extra: Value| chat(chat_with(extra));
        let r = c(json!({"logprobs": true})).unwrap();
        assert!(r.logprobs);
        assert_eq!(r.top_logprobs, 0);
        assert_eq!(
            c(json!({"logprobs": true, "top_logprobs": 20}))
                .unwrap()
                .top_logprobs,
            20
        );
        assert!(c(json!({"logprobs": false, "top_logprobs": 0})).is_ok());
        assert_invalid(
            c(json!({"top_logprobs": 3})),
            Some("top_logprobs"),
            "requires `logprobs` to be true",
        );
        assert_invalid(
            c(json!({"logprobs": true, "top_logprobs": 21})),
            Some("top_logprobs"),
            "between 0 and 20",
        );
        assert_invalid(
            c(json!({"logprobs": true, "top_logprobs": -1})),
            Some("top_logprobs"),
            "between 0 and 20",
        );
        assert_invalid(
            c(json!({"logprobs": 1})),
            Some("logprobs"),
            "must be a boolean",
        );
        assert_invalid(
            c(json!({"chat_template_kwargs": [1]})),
            Some("chat_template_kwargs"),
            "must be an object, got an array",
        );
        // enable_thinking is only read inside chat_template_kwargs.
        let r = c(json!({"enable_thinking": false})).unwrap();
        assert!(r.chat_template_kwargs.is_empty());
    }

    #[test]
    fn completion_prompts() {
        let p = |v: Value| comp(json!({"prompt": v})).map(|r| r.prompts);
        assert_eq!(
            p(json!("hi")).unwrap(),
            vec![PromptInput::Text("hi".into())]
        );
        assert_eq!(
            p(json!(["a", "b"])).unwrap(),
            vec![PromptInput::Text("a".into()), PromptInput::Text("b".into())]
        );
        assert_eq!(
            p(json!([1, 2, 4294967295u32])).unwrap(),
            vec![PromptInput::Tokens(vec![1, 2, u32::MAX])]
        );
        assert_eq!(
            p(json!([[1, 2], [3]])).unwrap(),
            vec![
                PromptInput::Tokens(vec![1, 2]),
                PromptInput::Tokens(vec![3])
            ]
        );
        assert_invalid(comp(json!({})), Some("prompt"), "`prompt` is required");
        assert_invalid(p(Value::Null), Some("prompt"), "`prompt` is required");
        assert_invalid(p(json!("")), Some("prompt"), "prompt is empty");
        assert_invalid(p(json!([])), Some("prompt"), "prompt is empty");
        assert_invalid(p(json!(["a", ""])), Some("prompt[1]"), "prompt is empty");
        assert_invalid(p(json!([[1], []])), Some("prompt[1]"), "prompt is empty");
        assert_invalid(p(json!(["a", 1])), Some("prompt[1]"), "must be a string");
        assert_invalid(p(json!([1, "a"])), Some("prompt[1]"), "must be a token id");
        assert_invalid(p(json!([1, -1])), Some("prompt[1]"), "must be a token id");
        assert_invalid(
            p(json!([4294967296u64])),
            Some("prompt[0]"),
            "must be a token id",
        );
        assert_invalid(
            p(json!([[1], [2, 1.5]])),
            Some("prompt[1][1]"),
            "must be a token id",
        );
        assert_invalid(
            p(json!([[1], 2])),
            Some("prompt[1]"),
            "an array of token ids",
        );
        assert_invalid(
            p(json!([{"a": 1}])),
            Some("prompt[0]"),
            "must be a string, an array",
        );
        assert_invalid(p(json!(5)), Some("prompt"), "got a number");
    }

    #[test]
    fn completion_options() {
        let r = comp(comp_with(
            json!({"max_tokens": 5, "stop": "x", "temperature": 0.5,
            "suffix": "", "echo": false, "logprobs": 3, "stream": true,
            "stream_options": {"include_usage": true}}),
        ))
        .unwrap();
        assert_eq!(r.common.max_tokens, Some(5));
        assert_eq!(r.common.stop, vec!["x".to_string()]);
        assert_eq!(r.common.sampling.temperature, 0.5);
        assert!(r.common.include_usage);
        assert_eq!(r.logprobs, Some(3));
        assert!(!r.echo);
        let r = comp(comp_with(json!({"logprobs": 0}))).unwrap();
        assert_eq!(r.logprobs, Some(0));
        assert_eq!(comp(comp_with(json!({}))).unwrap().logprobs, None);
        assert_eq!(
            comp(comp_with(json!({})))
                .unwrap()
                .common
                .sampling
                .temperature,
            1.0
        );
        assert_invalid(
            comp(comp_with(json!({"suffix": "tail"}))),
            Some("suffix"),
            "`suffix` is not supported",
        );
        assert_invalid(
            comp(comp_with(json!({"suffix": 1}))),
            Some("suffix"),
            "must be a string",
        );
        assert_invalid(
            comp(comp_with(json!({"echo": true}))),
            Some("echo"),
            "echo is not supported yet",
        );
        assert_invalid(
            comp(comp_with(json!({"echo": "no"}))),
            Some("echo"),
            "must be a boolean",
        );
        assert_invalid(
            comp(comp_with(json!({"logprobs": 21}))),
            Some("logprobs"),
            "between 0 and 20",
        );
        assert_invalid(
            comp(comp_with(json!({"logprobs": true}))),
            Some("logprobs"),
            "must be an integer, got a boolean",
        );
        assert_invalid(
            comp(comp_with(json!({"max_tokens": 0}))),
            Some("max_tokens"),
            ">= 1",
        );
    }

    fn meta() -> ResponseMeta {
        ResponseMeta {
            id: "chatcmpl-0123456789abcdef0123456789abcdef".into(),
            created: 1_700_000_000,
            model: "qwen".into(),
        }
    }

    #[test]
    fn chat_completion_shape() {
        let usage = Usage {
            prompt_tokens: 5,
            completion_tokens: 3,
        };
        let v = chat_completion(&meta(), "Hello", None, None, "stop", &usage);
        assert_eq!(
            v,
            json!({
                "id": "chatcmpl-0123456789abcdef0123456789abcdef",
                "object": "chat.completion",
                "created": 1_700_000_000u64,
                "model": "qwen",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello"},
                    "logprobs": null,
                    "finish_reason": "stop",
                }],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            })
        );
        let lps = [TokenLogprob {
            token: "é".into(),
            logprob: -0.1,
            top: vec![("é".into(), -0.1), ("e".into(), f32::NEG_INFINITY)],
        }];
        let v = chat_completion(&meta(), "é", Some("think"), Some(&lps), "length", &usage);
        assert_eq!(
            v["choices"][0]["message"],
            json!({"role": "assistant", "content": "é", "reasoning_content": "think"})
        );
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(
            v["choices"][0]["logprobs"],
            json!({"content": [{
                "token": "é", "logprob": -0.1, "bytes": [195, 169],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.1, "bytes": [195, 169]},
                    {"token": "e", "logprob": -9999.0, "bytes": [101]},
                ],
            }]})
        );
        // The shortest f32 decimal goes on the wire.
        assert!(v.to_string().contains("\"logprob\":-0.1,"), "{v}");
        // Message keys in OpenAI's order.
        let keys: Vec<&String> = v["choices"][0]["message"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys, ["role", "content", "reasoning_content"]);
    }

    #[test]
    fn chat_chunk_shapes() {
        let m = meta();
        assert_eq!(
            chat_delta(true, Some(""), None),
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(chat_delta(false, Some("a"), None), json!({"content": "a"}));
        assert_eq!(
            chat_delta(false, None, Some("r")),
            json!({"reasoning_content": "r"})
        );
        assert_eq!(
            chat_delta(false, Some("a"), Some("r")),
            json!({"content": "a", "reasoning_content": "r"})
        );
        assert_eq!(chat_delta(false, None, None), json!({}));
        let v = chat_chunk(&m, chat_delta(false, Some("Hi"), None), None, None);
        assert_eq!(
            v,
            json!({
                "id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": "qwen",
                "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": null,
                    "finish_reason": null}],
            })
        );
        let lps = [TokenLogprob {
            token: "Hi".into(),
            logprob: -0.5,
            top: vec![],
        }];
        let v = chat_chunk(&m, json!({}), Some(&lps), Some("stop"));
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            v["choices"][0]["logprobs"],
            json!({"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]})
        );
        let u = usage_chunk(
            &m,
            "chat.completion.chunk",
            &Usage {
                prompt_tokens: 1,
                completion_tokens: 2,
            },
        );
        assert_eq!(
            u,
            json!({
                "id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": "qwen",
                "choices": [],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            })
        );
    }

    #[test]
    fn completion_shapes() {
        let m = ResponseMeta {
            id: "cmpl-0123456789abcdef0123456789abcdef".into(),
            created: 1,
            model: "qwen".into(),
        };
        let lp = CompletionLogprobs {
            tokens: vec![" b".into(), "a".into()],
            token_logprobs: vec![-0.25, f32::NEG_INFINITY],
            top_logprobs: vec![
                vec![
                    (" b".into(), -0.25),
                    (" a".into(), -2.0),
                    (" b".into(), -3.0),
                ],
                vec![("a".into(), -0.5)],
            ],
            text_offset: vec![0, 2],
        };
        let choices = [
            CompletionChoice {
                text: " ba".into(),
                logprobs: Some(lp.clone()),
                finish_reason: "length".into(),
            },
            CompletionChoice {
                text: "x".into(),
                logprobs: None,
                finish_reason: "stop".into(),
            },
        ];
        let v = completion(
            &m,
            &choices,
            &Usage {
                prompt_tokens: 4,
                completion_tokens: 3,
            },
        );
        assert_eq!(
            v,
            json!({
                "id": m.id, "object": "text_completion", "created": 1, "model": "qwen",
                "choices": [
                    {"index": 0, "text": " ba", "finish_reason": "length", "logprobs": {
                        "tokens": [" b", "a"],
                        "token_logprobs": [-0.25, -9999.0],
                        "top_logprobs": [{" b": -0.25, " a": -2.0}, {"a": -0.5}],
                        "text_offset": [0, 2],
                    }},
                    {"index": 1, "text": "x", "logprobs": null, "finish_reason": "stop"},
                ],
                "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
            })
        );
        // Alternatives keep their order (most likely first), not sorted by key.
        let top0: Vec<&String> = v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(top0, [" b", " a"]);
        let c = completion_chunk(&m, 2, "tok", None, None);
        assert_eq!(
            c,
            json!({
                "id": m.id, "object": "text_completion", "created": 1, "model": "qwen",
                "choices": [{"index": 2, "text": "tok", "logprobs": null, "finish_reason": null}],
            })
        );
        let c = completion_chunk(&m, 0, "", Some(&lp), Some("stop"));
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        assert_eq!(c["choices"][0]["logprobs"]["text_offset"], json!([0, 2]));
    }

    #[test]
    fn model_list_shape() {
        assert_eq!(
            model_list("qwen3-0.6b", 42),
            json!({"object": "list", "data": [
                {"id": "qwen3-0.6b", "object": "model", "created": 42, "owned_by": "ember"}
            ]})
        );
    }
}
