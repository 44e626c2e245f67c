//! Request bodies: parsed into a [`serde_json::Value`], then read and checked field by field.

use ember_engine::chat_template::ChatMessage;
use ember_engine::constraint::Grammar;
use ember_engine::sampler::{Penalties, SamplingError, SamplingParams};
use serde_json::{Map, Value};

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

/// OpenAI's `tools` (functions only), `tool_choice` and `parallel_tool_calls`.
fn parse_tools(obj: &Map<String, Value>) -> Result<Tools, ApiError> {
    let definitions = match field(obj, "tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(other) => return Err(wrong_type("tools", "an array", other)),
    };
    let mut names = Vec::with_capacity(definitions.len());
    for (i, tool) in definitions.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(t) = tool else {
            return Err(wrong_type(&p, "an object", tool));
        };
        match str_field(field(t, "type"), &format!("{p}.type"))? {
            Some("function") => {}
            other => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    format!("`{p}.type` must be \"function\", got {other:?}"),
                ));
            }
        }
        let q = format!("{p}.function");
        let Some(Value::Object(function)) = field(t, "function") else {
            return Err(ApiError::invalid(&q, format!("`{q}` must be an object")));
        };
        let name = str_field(field(function, "name"), &format!("{q}.name"))?.unwrap_or("");
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(ApiError::invalid(
                format!("{q}.name"),
                format!("`{q}.name` must be 1 to 64 letters, digits, `_` or `-`, got {name:?}"),
            ));
        }
        match field(function, "parameters") {
            None | Some(Value::Object(_)) => {}
            Some(other) => return Err(wrong_type(&format!("{q}.parameters"), "an object", other)),
        }
        names.push(name.to_owned());
    }
    let choice = match field(obj, "tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be none, auto, required or a function, got {other:?}"
                    ),
                ));
            }
        },
        Some(Value::Object(choice)) => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` names a function as {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not among the `tools`"),
                ));
            }
            ToolChoice::Named(name.to_owned())
        }
        Some(other) => return Err(wrong_type("tool_choice", "a string or an object", other)),
    };
    if definitions.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a call but the request has no `tools`",
        ));
    }
    let parallel =
        bool_field(field(obj, "parallel_tool_calls"), "parallel_tool_calls")?.unwrap_or(true);
    Ok(Tools {
        definitions,
        choice,
        parallel,
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
        grammar,
    })
}

/// The output constraint a request asks for, from whichever of OpenAI's and llama.cpp's
/// fields names one (two at once are an error).
fn parse_grammar(obj: &Map<String, Value>) -> Result<Option<(&'static str, Grammar)>, ApiError> {
    let mut found: Vec<(&'static str, Grammar)> = Vec::new();
    match field(obj, "response_format") {
        None | Some(Value::Null) => {}
        Some(Value::Object(format)) => {
            let p = "response_format";
            match str_field(field(format, "type"), "response_format.type")? {
                Some("text") => {}
                // llama-server also takes a `schema` here.
                Some("json_object") => found.push((
                    p,
                    match field(format, "schema") {
                        Some(schema @ Value::Object(_)) => Grammar::JsonSchema(schema.clone()),
                        _ => Grammar::JsonObject,
                    },
                )),
                Some("json_schema") => {
                    let q = "response_format.json_schema";
                    let schema = match field(format, "json_schema") {
                        Some(Value::Object(spec)) => match field(spec, "schema") {
                            Some(schema @ Value::Object(_)) => schema.clone(),
                            // OpenAI's `schema` is optional: without one, any JSON object.
                            None => serde_json::json!({"type": "object"}),
                            Some(other) => {
                                return Err(wrong_type(&format!("{q}.schema"), "an object", other));
                            }
                        },
                        Some(other) => return Err(wrong_type(q, "an object", other)),
                        None => {
                            return Err(ApiError::invalid(
                                q,
                                "`response_format.json_schema` is required when the type is json_schema",
                            ));
                        }
                    };
                    found.push((p, Grammar::JsonSchema(schema)));
                }
                Some(other) => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        format!(
                            "`response_format.type` must be text, json_object or json_schema, got {other:?}"
                        ),
                    ));
                }
                None => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        "`response_format.type` is required",
                    ));
                }
            }
        }
        Some(other) => return Err(wrong_type("response_format", "an object", other)),
    }
    match field(obj, "json_schema") {
        None | Some(Value::Null) => {}
        Some(schema @ Value::Object(_)) => {
            found.push(("json_schema", Grammar::JsonSchema(schema.clone())))
        }
        Some(other) => return Err(wrong_type("json_schema", "an object", other)),
    }
    match field(obj, "grammar") {
        None | Some(Value::Null) => {}
        Some(Value::String(g)) if g.trim().is_empty() => {}
        Some(Value::String(g)) => found.push(("grammar", Grammar::from_llama_grammar(g))),
        Some(other) => return Err(wrong_type("grammar", "a string", other)),
    }
    match &found[..] {
        [] => Ok(None),
        [(a, g)] => Ok(Some((a, g.clone()))),
        [(a, _), (b, _), ..] => Err(ApiError::invalid(
            *b,
            format!("`{a}` and `{b}` both constrain the output; send one of them"),
        )),
    }
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

/// The request's sampling; what it leaves out comes from `defaults` (the model's, see
/// `ember_engine::SamplingDefaults`, with the server's flags over them).
fn parse_sampling(
    obj: &Map<String, Value>,
    defaults: &SamplingParams,
) -> Result<SamplingParams, ApiError> {
    let temperature = match number_field(field(obj, "temperature"), "temperature")? {
        None => f64::from(defaults.temperature),
        Some(t) if (0.0..=2.0).contains(&t) => t,
        Some(t) => {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be between 0 and 2, got {t}"),
            ));
        }
    };
    let top_p = match number_field(field(obj, "top_p"), "top_p")? {
        None => f64::from(defaults.top_p),
        Some(p) if p > 0.0 && p <= 1.0 => p,
        Some(p) => {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {p}"),
            ));
        }
    };
    let top_k = match int_field(field(obj, "top_k"), "top_k")? {
        None => defaults.top_k,
        Some(-1) | Some(0) => 0,
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
        None => f64::from(defaults.min_p),
        Some(p) if (0.0..=1.0).contains(&p) => p,
        Some(p) => {
            return Err(ApiError::invalid(
                "min_p",
                format!("`min_p` must be between 0 and 1, got {p}"),
            ));
        }
    };
    let seed = match int_field(field(obj, "seed"), "seed")? {
        None => defaults.seed,
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
        penalties: parse_penalties(obj, &defaults.penalties)?,
    };
    // The ranges above are at least as strict; this catches what rounding to f32 changes
    // (a top_p of 1e-60 becomes 0).
    sampling.validate().map_err(|e| {
        let param = match e {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::MinP(_) => "min_p",
            SamplingError::RepetitionPenalty(_) => "repetition_penalty",
            SamplingError::PresencePenalty(_) => "presence_penalty",
            SamplingError::FrequencyPenalty(_) => "frequency_penalty",
        };
        ApiError::invalid(param, e.to_string())
    })?;
    Ok(sampling)
}

/// OpenAI's `presence_penalty` and `frequency_penalty`, vLLM's `repetition_penalty` (llama.cpp's
/// `repeat_penalty`) and llama.cpp's `repeat_last_n` (-1: the whole sequence; absent: OpenAI's
/// and vLLM's counting, see [`Penalties::last_n`]).
fn parse_penalties(obj: &Map<String, Value>, defaults: &Penalties) -> Result<Penalties, ApiError> {
    let within = |name: &str, default: f32| -> Result<f32, ApiError> {
        match number_field(field(obj, name), name)? {
            None => Ok(default),
            Some(x) if (-2.0..=2.0).contains(&x) => Ok(x as f32),
            Some(x) => Err(ApiError::invalid(
                name,
                format!("`{name}` must be between -2 and 2, got {x}"),
            )),
        }
    };
    let presence = within("presence_penalty", defaults.presence)?;
    let frequency = within("frequency_penalty", defaults.frequency)?;
    let mut repetition = None;
    for name in ["repetition_penalty", "repeat_penalty"] {
        match (number_field(field(obj, name), name)?, repetition) {
            (None, _) => {}
            (Some(x), _) if !(x > 0.0 && x.is_finite()) => {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be a number > 0 (1 is off), got {x}"),
                ));
            }
            (Some(x), Some((y, first))) if x != y => {
                return Err(ApiError::invalid(
                    name,
                    format!("`{first}` ({y}) and `{name}` ({x}) disagree; send one of them"),
                ));
            }
            (Some(x), _) => repetition = Some((x, name)),
        }
    }
    let last_n = match int_field(field(obj, "repeat_last_n"), "repeat_last_n")? {
        None => defaults.last_n,
        Some(-1) => Some(usize::MAX),
        Some(n) if n >= 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => {
            return Err(ApiError::invalid(
                "repeat_last_n",
                format!("`repeat_last_n` must be -1 (all), 0 (off) or a positive integer, got {n}"),
            ));
        }
    };
    Ok(Penalties {
        repetition: repetition.map_or(defaults.repetition, |(x, _)| x as f32),
        presence,
        frequency,
        last_n,
    })
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

/// An assistant message's `tool_calls` as templates read them: each call's `arguments`, JSON
/// text in the API, parsed into the object transformers hands its templates.
fn parse_tool_calls(p: &str, calls: &[Value]) -> Result<Value, ApiError> {
    let mut out = Vec::with_capacity(calls.len());
    for (i, call) in calls.iter().enumerate() {
        let q = format!("{p}.tool_calls[{i}]");
        let function = call
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::invalid(&q, format!("`{q}.function` must be an object")))?;
        let name = str_field(field(function, "name"), &format!("{q}.function.name"))?
            .ok_or_else(|| ApiError::invalid(&q, format!("`{q}.function.name` is required")))?;
        let arguments = match field(function, "arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(text)) => serde_json::from_str(text).map_err(|e| {
                ApiError::invalid(
                    format!("{q}.function.arguments"),
                    format!("`{q}.function.arguments` is not valid JSON: {e}"),
                )
            })?,
            Some(args @ Value::Object(_)) => args.clone(),
            Some(other) => {
                return Err(wrong_type(
                    &format!("{q}.function.arguments"),
                    "a JSON string",
                    other,
                ));
            }
        };
        let mut entry = serde_json::json!({
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            entry["id"] = id.into();
        }
        out.push(entry);
    }
    Ok(Value::Array(out))
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

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
