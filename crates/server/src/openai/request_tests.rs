//! Tests of request parsing: every field, its checks and its error.

use axum::http::StatusCode;
use serde_json::json;

use super::*;
use ember_engine::sampler::Penalties;
use ember_engine::{LLAMA_SERVER_DEFAULTS, OPENAI_DEFAULTS};

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
    // llama.cpp's name, where -1 means no limit.
    assert_eq!(mt(json!({"n_predict": 5})).unwrap(), Some(5));
    assert_eq!(mt(json!({"n_predict": -1})).unwrap(), None);
    assert_eq!(
        mt(json!({"n_predict": 5, "max_tokens": 5})).unwrap(),
        Some(5)
    );
    assert_eq!(
        mt(json!({"n_predict": -1, "max_tokens": 7})).unwrap(),
        Some(7)
    );
    assert_invalid(
        mt(json!({"max_tokens": 9, "n_predict": 4})),
        Some("n_predict"),
        "`max_tokens` (9) and `n_predict` (4) disagree",
    );
    assert_invalid(mt(json!({"n_predict": -2})), Some("n_predict"), ">= 1");
    assert_invalid(
        mt(json!({"n_predict": "5"})),
        Some("n_predict"),
        "must be an integer",
    );
    assert_eq!(
        comp(comp_with(json!({"n_predict": 3})))
            .unwrap()
            .common
            .max_tokens,
        Some(3)
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
            &OPENAI_DEFAULTS,
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
    assert_invalid(
        c(json!({"cache_prompt": 0})),
        Some("cache_prompt"),
        "must be a boolean",
    );
    assert_invalid(
        c(json!({"draft": "no"})),
        Some("draft"),
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
        (json!({"logit_bias": {"50256": -100}}), "logit_bias"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"function_call": {"name": "f"}}), "function_call"),
        // llama.cpp's samplers.
        (json!({"mirostat": 2}), "mirostat"),
        (json!({"typical_p": 0.5}), "typical_p"),
        (json!({"tfs_z": 0.9}), "tfs_z"),
        (json!({"dry_multiplier": 0.8}), "dry_multiplier"),
        (json!({"xtc_probability": 0.5}), "xtc_probability"),
        (json!({"dynatemp_range": 0.5}), "dynatemp_range"),
        (json!({"top_n_sigma": 1.0}), "top_n_sigma"),
        (json!({"n_probs": 3}), "n_probs"),
        (json!({"samplers": ["top_k"]}), "samplers"),
    ] {
        assert_invalid(
            c(extra),
            Some(param),
            &format!("`{param}` is not supported"),
        );
    }
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
            "service_tier": "auto", "some_future_field": [1, 2, 3], "repeat_penalty": 1.0,
            "mirostat": 0, "typical_p": 1, "tfs_z": 1.0, "dry_multiplier": 0, "n_probs": 0,
            "xtc_probability": 0, "dynatemp_range": 0, "top_n_sigma": -1, "grammar": "",
            "json_schema": null, "samplers": null})
        )
        .is_ok()
    );
    assert_invalid(
        comp(comp_with(json!({"presence_penalty": 2.5}))),
        Some("presence_penalty"),
        "between -2 and 2",
    );
}

#[test]
fn penalties_take_openais_vllms_and_llama_cpps_names() {
    let c = |extra: Value| chat(chat_with(extra)).map(|r| r.common.sampling.penalties);
    let p = c(json!({"presence_penalty": 0.5, "frequency_penalty": -0.25})).unwrap();
    assert_eq!(
        (p.presence, p.frequency, p.repetition, p.last_n),
        (0.5, -0.25, 1.0, None)
    );
    assert_eq!(
        c(json!({"repetition_penalty": 1.1})).unwrap().repetition,
        1.1
    );
    let p = c(json!({"repeat_penalty": 1.2, "repeat_last_n": 64})).unwrap();
    assert_eq!((p.repetition, p.last_n), (1.2, Some(64)));
    assert_eq!(
        c(json!({"repeat_last_n": -1})).unwrap().last_n,
        Some(usize::MAX)
    );
    assert_invalid(
        chat(chat_with(
            json!({"repetition_penalty": 1.1, "repeat_penalty": 1.3}),
        )),
        Some("repeat_penalty"),
        "disagree",
    );
    assert_invalid(
        chat(chat_with(json!({"repetition_penalty": 0}))),
        Some("repetition_penalty"),
        "must be a number > 0",
    );
    assert_invalid(
        chat(chat_with(json!({"frequency_penalty": -3}))),
        Some("frequency_penalty"),
        "between -2 and 2",
    );
    assert_invalid(
        chat(chat_with(json!({"repeat_last_n": -2}))),
        Some("repeat_last_n"),
        "must be -1",
    );
}

#[test]
fn output_constraints_come_from_one_field() {
    let g = |extra: Value| chat(chat_with(extra)).map(|r| r.common.grammar);
    assert_eq!(
        g(json!({"response_format": {"type": "json_object"}})).unwrap(),
        Some(("response_format", Grammar::JsonObject))
    );
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        g(json!({"response_format": {"type": "json_schema",
                 "json_schema": {"name": "x", "strict": true, "schema": schema}}}))
        .unwrap(),
        Some(("response_format", Grammar::JsonSchema(schema.clone())))
    );
    // llama-server's variant of json_object with a schema, and its own fields.
    assert_eq!(
        g(json!({"response_format": {"type": "json_object", "schema": schema}})).unwrap(),
        Some(("response_format", Grammar::JsonSchema(schema.clone())))
    );
    assert_eq!(
        g(json!({"json_schema": schema})).unwrap(),
        Some(("json_schema", Grammar::JsonSchema(schema.clone())))
    );
    assert_eq!(
        g(json!({"grammar": "root ::= \"a\""})).unwrap(),
        Some(("grammar", Grammar::Gbnf("root ::= \"a\"".into())))
    );
    assert_eq!(
        g(json!({"response_format": {"type": "text"}, "grammar": ""})).unwrap(),
        None
    );
    assert_invalid(
        chat(chat_with(
            json!({"json_schema": schema, "grammar": "root ::= \"a\""}),
        )),
        Some("grammar"),
        "both constrain the output",
    );
    assert_invalid(
        chat(chat_with(
            json!({"response_format": {"type": "json_schema"}}),
        )),
        Some("response_format.json_schema"),
        "is required",
    );
    assert_invalid(
        chat(chat_with(json!({"response_format": {"type": "xml"}}))),
        Some("response_format.type"),
        "must be text, json_object or json_schema",
    );
    assert_invalid(
        chat(chat_with(json!({"grammar": 3}))),
        Some("grammar"),
        "must be a string",
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

#[test]
fn what_a_request_leaves_out_comes_from_the_defaults() {
    let with = |defaults: &SamplingParams, extra: Value| {
        parse_chat(chat_with(extra).to_string().as_bytes(), defaults)
            .unwrap()
            .common
            .sampling
    };
    // llama-server's defaults for a field left out; a request's own fields win.
    let s = with(&LLAMA_SERVER_DEFAULTS, json!({}));
    assert_eq!(s, LLAMA_SERVER_DEFAULTS);
    let s = with(
        &LLAMA_SERVER_DEFAULTS,
        json!({"temperature": 0, "top_k": -1}),
    );
    assert_eq!((s.temperature, s.top_k, s.top_p), (0.0, 0, 0.95));
    let seeded = SamplingParams {
        seed: Some(7),
        ..OPENAI_DEFAULTS
    };
    assert_eq!(with(&seeded, json!({})).seed, Some(7));
    assert_eq!(with(&seeded, json!({"seed": 9})).seed, Some(9));
    // The OpenAI API's own defaults: temperature 1, nothing cut.
    assert_eq!(with(&OPENAI_DEFAULTS, json!({})), OPENAI_DEFAULTS);
}
