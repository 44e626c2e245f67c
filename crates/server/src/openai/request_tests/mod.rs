//! Tests of request parsing: every field, its checks and its error. Here the body and the
//! chat messages; [`sampling`] the limits, sampling fields and output constraints;
//! [`completion`] the rest of each route's fields and the defaults.

use axum::http::StatusCode;
use serde_json::json;

use super::*;
use ember_engine::sampler::Penalties;
use ember_engine::{LLAMA_SERVER_DEFAULTS, OPENAI_DEFAULTS};

mod completion;
mod sampling;

fn chat(body: Value) -> Result<ChatRequest, ApiError> {
    parse_chat(body.to_string().as_bytes(), &OPENAI_DEFAULTS)
}

fn comp(body: Value) -> Result<CompletionRequest, ApiError> {
    parse_completion(body.to_string().as_bytes(), &OPENAI_DEFAULTS)
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
        parse_chat(b"{\"messages\": \"\xff\xfe\"}", &OPENAI_DEFAULTS),
        None,
        "the request body is not valid UTF-8",
    );
    assert_invalid(
        parse_completion(b"\xc3", &OPENAI_DEFAULTS),
        None,
        "the request body is not valid UTF-8",
    );
    assert_invalid(
        parse_chat(b"{\"model\": \"m\",\n  \"messages\": [}", &OPENAI_DEFAULTS),
        None,
        "line 2 column",
    );
    assert_invalid(parse_chat(b"", &OPENAI_DEFAULTS), None, "not valid JSON");
    assert_invalid(
        parse_chat(b"[1, 2]", &OPENAI_DEFAULTS),
        None,
        "must be a JSON object, got an array",
    );
    assert_invalid(
        parse_completion(b"\"text\"", &OPENAI_DEFAULTS),
        None,
        "must be a JSON object, got a string",
    );
    assert_invalid(
        parse_chat(b"null", &OPENAI_DEFAULTS),
        None,
        "must be a JSON object, got null",
    );
    // Out of f64 range is a parse error in serde_json.
    assert_invalid(
        parse_chat(
            br#"{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}"#,
            &OPENAI_DEFAULTS,
        ),
        None,
        "not valid JSON",
    );
}

#[test]
fn deep_nesting_is_a_400_not_a_crash() {
    let deep = "[".repeat(100_000);
    assert_invalid(
        parse_chat(deep.as_bytes(), &OPENAI_DEFAULTS),
        None,
        "recursion limit",
    );
    let deep_field = format!("{{\"messages\": {}", "[".repeat(100_000));
    assert_invalid(
        parse_chat(deep_field.as_bytes(), &OPENAI_DEFAULTS),
        None,
        "recursion limit",
    );
    let deep_objects = "{\"a\":".repeat(100_000);
    assert_invalid(
        parse_completion(deep_objects.as_bytes(), &OPENAI_DEFAULTS),
        None,
        "recursion limit",
    );
    // Nesting within the limit is fine where a field is ignored.
    let ok = format!(
        "{{\"prompt\": \"x\", \"metadata\": {}1{}}}",
        "[".repeat(100),
        "]".repeat(100)
    );
    assert!(parse_completion(ok.as_bytes(), &OPENAI_DEFAULTS).is_ok());
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
            seed: None,
            penalties: Penalties::NONE,
        }
    );
    assert!(c.stop.is_empty());
    assert!(!c.stream && !c.include_usage && !c.ignore_eos);
    assert!(
        c.cache_prompt,
        "the prompt cache is on unless a request opts out"
    );
    assert!(c.draft, "drafting is on unless a request opts out");
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
        "cache_prompt": false,
        "draft": false,
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
                reasoning_content: Some("hmm".into()),
                ..ChatMessage::default()
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
            seed: Some(7),
            penalties: Penalties::NONE,
        }
    );
    assert_eq!(c.stop, vec!["\n\n".to_string(), "END".to_string()]);
    assert!(c.stream && c.include_usage && c.ignore_eos && !c.cache_prompt && !c.draft);
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
    let two = |second: Value| chat(json!({"messages": [{"role": "user", "content": "a"}, second]}));
    assert_invalid(
        two(json!({"role": "function", "content": "x"})),
        Some("messages[1].role"),
        "unsupported role `function`",
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
        Some("messages[1].tool_calls[0]"),
        "must be an object",
    );
    // Reasoning on a non-assistant turn is dropped; an assistant may omit content.
    let r = two(json!({"role": "assistant"})).unwrap();
    assert_eq!(r.messages[1], ChatMessage::new("assistant", ""));
    let r = chat(json!({"messages": [{"role": "user", "content": "a", "reasoning_content": "r"}]}))
        .unwrap();
    assert_eq!(r.messages[0].reasoning_content, None);
    let r = chat(json!({"messages": [{"role": "user", "content": []}]})).unwrap();
    assert_eq!(r.messages[0].content, "");
}
