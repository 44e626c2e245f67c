//! Request parsing: max_tokens, the sampling fields and their ranges, stop strings, streaming,
//! n, what is refused by name, penalties and output constraints.

use super::*;

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
