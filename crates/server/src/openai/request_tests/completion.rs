//! Request parsing: chat logprobs and template kwargs, completion prompts and options, and
//! what a request leaves out.

use super::*;

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
