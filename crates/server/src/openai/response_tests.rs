//! Tests of the response shapes against OpenAI's.

use serde_json::json;

use super::*;

fn meta() -> ResponseMeta {
    ResponseMeta {
        id: "chatcmpl-0123456789abcdef0123456789abcdef".into(),
        created: 1_700_000_000,
        model: "qwen".into(),
        system_fingerprint: "fp_0123456789abcdef".into(),
    }
}

#[test]
fn chat_completion_shape() {
    let usage = Usage {
        prompt_tokens: 5,
        completion_tokens: 3,
        cached_tokens: 0,
    };
    let v = chat_completion(&meta(), "Hello", None, None, "stop", &usage);
    assert_eq!(
        v,
        json!({
            "id": "chatcmpl-0123456789abcdef0123456789abcdef",
            "object": "chat.completion",
            "created": 1_700_000_000u64,
            "model": "qwen",
            "system_fingerprint": "fp_0123456789abcdef",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": null,
                "finish_reason": "stop",
            }],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 0}},
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
            "system_fingerprint": m.system_fingerprint,
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
            cached_tokens: 0,
        },
    );
    assert_eq!(
        u,
        json!({
            "id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": "qwen",
            "system_fingerprint": m.system_fingerprint,
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 0}},
        })
    );
}

#[test]
fn completion_shapes() {
    let m = ResponseMeta {
        id: "cmpl-0123456789abcdef0123456789abcdef".into(),
        created: 1,
        model: "qwen".into(),
        system_fingerprint: "fp_0".into(),
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
            cached_tokens: 2,
        },
    );
    assert_eq!(
        v,
        json!({
            "id": m.id, "object": "text_completion", "created": 1, "model": "qwen",
            "system_fingerprint": m.system_fingerprint,
            "choices": [
                {"index": 0, "text": " ba", "finish_reason": "length", "logprobs": {
                    "tokens": [" b", "a"],
                    "token_logprobs": [-0.25, -9999.0],
                    "top_logprobs": [{" b": -0.25, " a": -2.0}, {"a": -0.5}],
                    "text_offset": [0, 2],
                }},
                {"index": 1, "text": "x", "logprobs": null, "finish_reason": "stop"},
            ],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": 2}},
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
            "system_fingerprint": m.system_fingerprint,
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
