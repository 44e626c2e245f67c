//! Request bodies: parsed into a [`serde_json::Value`], then read and checked field by field.

use ember_engine::chat_template::ChatMessage;
use ember_engine::constraint::Grammar;
use ember_engine::sampler::SamplingParams;
use serde_json::{Map, Value};

use super::fields::{
    as_integer, bool_field, field, int_field, number_field, str_field, type_name, unsupported,
    wrong_type,
};
use super::sampling_fields::{parse_grammar, parse_sampling};
use super::tool_fields::{parse_tool_calls, parse_tools};
use super::{MAX_STOP_STRINGS, MAX_TOKENS_LIMIT, MAX_TOP_LOGPROBS};
use crate::error::ApiError;
use crate::tools::{ToolChoice, Tools};

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
    /// llama.cpp's extension: reuse the longest cached prefix of the prompt and leave this
    /// request's blocks to the prompt cache (default true; the output is the same bits either
    /// way).
    pub cache_prompt: bool,
    /// ember's extension: `"draft": false` keeps speculative decoding off for this request
    /// (default true; drafting never changes the output, only how many passes it takes).
    pub draft: bool,
    /// What the output must match: OpenAI's `response_format` (`json_object`, `json_schema`),
    /// or llama.cpp's `json_schema` or `grammar` (GBNF, or Lark after `%llguidance`), with the
    /// field that named it.
    pub grammar: Option<(&'static str, Grammar)>,
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
    /// `tools`, `tool_choice` and `parallel_tool_calls`.
    pub tools: Tools,
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
pub fn parse_chat(body: &[u8], defaults: &SamplingParams) -> Result<ChatRequest, ApiError> {
    let obj = parse_object(body)?;
    let messages = parse_messages(field(&obj, "messages"))?;
    let common = parse_common(&obj, defaults)?;
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
    let tools = parse_tools(&obj)?;
    if tools.active() && common.grammar.is_some() && tools.choice != ToolChoice::Auto {
        return Err(ApiError::invalid(
            "tool_choice",
            "a required or named tool call and an output format both constrain the reply; send one of them",
        ));
    }
    Ok(ChatRequest {
        common,
        messages,
        chat_template_kwargs,
        logprobs,
        top_logprobs,
        tools,
    })
}

/// Parses and validates a `/v1/completions` body.
pub fn parse_completion(
    body: &[u8],
    defaults: &SamplingParams,
) -> Result<CompletionRequest, ApiError> {
    let obj = parse_object(body)?;
    let prompts = parse_prompt(field(&obj, "prompt"))?;
    let common = parse_common(&obj, defaults)?;
    // Text completions have no tools to call: only the neutral values pass.
    match field(&obj, "tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) if items.is_empty() => {}
        Some(_) => return Err(unsupported("tools")),
    }
    match field(&obj, "tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "none" || s == "auto" => {}
        Some(_) => return Err(unsupported("tool_choice")),
    }
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

fn parse_common(
    obj: &Map<String, Value>,
    defaults: &SamplingParams,
) -> Result<CommonParams, ApiError> {
    let model = str_field(field(obj, "model"), "model")?.map(str::to_owned);

    // OpenAI's two names and llama.cpp's `n_predict` (where -1 means no limit) for one limit.
    let mut max_tokens = None;
    for name in ["max_tokens", "max_completion_tokens", "n_predict"] {
        let limit = match (name, int_field(field(obj, name), name)?) {
            ("n_predict", Some(-1)) => None,
            _ => max_tokens_field(obj, name)?,
        };
        match (max_tokens, limit) {
            (Some((a, first)), Some(b)) if a != b => {
                return Err(ApiError::invalid(
                    name,
                    format!("`{first}` ({a}) and `{name}` ({b}) disagree; send one of them"),
                ));
            }
            (None, Some(b)) => max_tokens = Some((b, name)),
            _ => {}
        }
    }
    let max_tokens = max_tokens.map(|(n, _)| n);

    let sampling = parse_sampling(obj, defaults)?;
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
    let cache_prompt = bool_field(field(obj, "cache_prompt"), "cache_prompt")?.unwrap_or(true);
    let draft = bool_field(field(obj, "draft"), "draft")?.unwrap_or(true);

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
    let grammar = parse_grammar(obj)?;

    Ok(CommonParams {
        model,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        ignore_eos,
        cache_prompt,
        draft,
        grammar,
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

/// Parameters ember does not implement (OpenAI's, vLLM's and llama.cpp's that change the
/// output): an error naming the field unless its value is the neutral one.
fn reject_unsupported(obj: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, neutral) in [
        ("mirostat", 0.0),
        ("typical_p", 1.0),
        ("tfs_z", 1.0),
        ("dry_multiplier", 0.0),
        ("xtc_probability", 0.0),
        ("dynatemp_range", 0.0),
        ("top_n_sigma", -1.0),
        ("n_probs", 0.0),
    ] {
        if let Some(x) = number_field(field(obj, name), name)?
            && x != neutral
        {
            return Err(unsupported(name));
        }
    }
    // llama.cpp's sampler order: nothing ember can honour yet.
    match field(obj, "samplers") {
        None | Some(Value::Null) => {}
        Some(_) => return Err(unsupported("samplers")),
    }
    match field(obj, "logit_bias") {
        None => {}
        Some(Value::Object(map)) if map.is_empty() => {}
        Some(Value::Object(_)) => return Err(unsupported("logit_bias")),
        Some(other) => return Err(wrong_type("logit_bias", "an object", other)),
    }
    // OpenAI's deprecated function calling: `tools` replaced it.
    match field(obj, "functions") {
        None => {}
        Some(Value::Array(items)) if items.is_empty() => {}
        Some(Value::Array(_)) => return Err(unsupported("functions")),
        Some(other) => return Err(wrong_type("functions", "an array", other)),
    }
    match field(obj, "function_call") {
        None => {}
        Some(Value::String(s)) if s == "none" || s == "auto" => {}
        Some(_) => return Err(unsupported("function_call")),
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
        "tool" => "tool",
        other => {
            return Err(ApiError::invalid(
                &role_param,
                format!(
                    "unsupported role `{other}` in `{role_param}` (expected system, developer, user, assistant or tool)"
                ),
            ));
        }
    };
    let assistant = role == "assistant";

    let content_param = format!("{p}.content");
    let content = match field(obj, "content") {
        // An assistant's turn that only calls tools has no content.
        None | Some(Value::Null) if assistant => String::new(),
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

    let tool_calls = match field(obj, "tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(calls)) if calls.is_empty() => None,
        Some(Value::Array(calls)) if assistant => Some(parse_tool_calls(&p, calls)?),
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                format!("{p}.tool_calls"),
                format!("only an assistant message has `tool_calls`, not a {given_role} message"),
            ));
        }
        Some(other) => return Err(wrong_type(&format!("{p}.tool_calls"), "an array", other)),
    };
    let tool_call_id = str_field(field(obj, "tool_call_id"), &format!("{p}.tool_call_id"))?
        .filter(|_| role == "tool")
        .map(str::to_owned);

    let reasoning_param = format!("{p}.reasoning_content");
    let reasoning_content = str_field(field(obj, "reasoning_content"), &reasoning_param)?;
    Ok(ChatMessage {
        role: role.to_owned(),
        content,
        // Only an assistant's turn has reasoning; on other roles it is ignored.
        reasoning_content: reasoning_content.filter(|_| assistant).map(str::to_owned),
        tool_calls,
        tool_call_id,
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

#[cfg(test)]
#[path = "request_tests/mod.rs"]
mod tests;
