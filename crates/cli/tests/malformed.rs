//! Hundreds of bad request bodies against the real server: every one must get a 4xx with an
//! OpenAI-shaped JSON error, never a 5xx or a dropped connection, and the server must keep
//! serving afterwards.

mod common;

use common::{Server, error_shape_problem, request};
use serde_json::{Value, json};

const ENDPOINTS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

fn chat_base() -> Value {
    json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 2,
        "temperature": 0,
    })
}

fn completion_base() -> Value {
    json!({"model": "m", "prompt": "Hello there", "max_tokens": 2, "temperature": 0})
}

fn with(base: &Value, key: &str, value: Value) -> Value {
    let mut body = base.clone();
    body[key] = value;
    body
}

/// The bodies, each with a label for failure messages. Deterministic: no randomness.
fn bad_bodies() -> Vec<(String, Vec<u8>)> {
    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |label: String, body: Vec<u8>| cases.push((label, body));
    let chat = chat_base();
    let completion = completion_base();

    // Every truncated prefix of a valid request (the empty body included).
    for base in [&chat, &completion] {
        let text = base.to_string();
        for end in 0..text.len() {
            if text.is_char_boundary(end) {
                add(
                    format!("prefix {end} of {text}"),
                    text.as_bytes()[..end].to_vec(),
                );
            }
        }
    }

    // Wrong types and out-of-range values, field by field. `both` fields go into both bases.
    let both: Vec<(&str, Vec<Value>)> = vec![
        ("model", vec![json!(5), json!(true), json!([]), json!({})]),
        (
            "max_tokens",
            vec![
                json!("2"),
                json!(true),
                json!(1.5),
                json!([]),
                json!({}),
                json!(-1),
                json!(-100),
                json!(0),
                json!(1e300),
                json!(1e20),
                json!(100_000_000),
            ],
        ),
        (
            "max_completion_tokens",
            vec![json!("2"), json!(-1), json!(3)],
        ),
        (
            "temperature",
            vec![
                json!("hot"),
                json!(true),
                json!([]),
                json!({}),
                json!(-1),
                json!(2.5),
                json!(1e20),
            ],
        ),
        (
            "top_p",
            vec![
                json!("x"),
                json!(0),
                json!(-0.5),
                json!(1.5),
                json!(true),
                json!(1e-60),
            ],
        ),
        (
            "top_k",
            vec![json!("x"), json!(1.5), json!(-2), json!(true)],
        ),
        ("min_p", vec![json!("x"), json!(-0.1), json!(1.5)]),
        (
            "seed",
            vec![json!("x"), json!(-1), json!(1.5), json!(1e20), json!(true)],
        ),
        ("stream", vec![json!("yes"), json!(1), json!([]), json!({})]),
        (
            "stop",
            vec![
                json!(5),
                json!(true),
                json!({}),
                json!(""),
                json!([""]),
                json!([5]),
                json!([null]),
                json!(["a", 5]),
                json!(vec!["x"; 17]),
            ],
        ),
        (
            "stream_options",
            vec![json!("x"), json!(5), json!({"include_usage": true})],
        ),
        ("ignore_eos", vec![json!("yes"), json!(1)]),
        (
            "n",
            vec![
                json!(5),
                json!(2),
                json!(0),
                json!(-1),
                json!("2"),
                json!(1.5),
            ],
        ),
        ("best_of", vec![json!(2)]),
        ("frequency_penalty", vec![json!(2.5), json!("x")]),
        ("presence_penalty", vec![json!(-3)]),
        ("repetition_penalty", vec![json!(0), json!(-1), json!("x")]),
        ("repeat_last_n", vec![json!(-2), json!(1.5)]),
        ("logit_bias", vec![json!({"1": 5}), json!("x")]),
        ("tools", vec![json!([{"type": "function"}]), json!("x")]),
        ("tool_choice", vec![json!("required"), json!({})]),
        (
            "response_format",
            vec![
                json!({"type": "xml"}),
                json!({"type": "json_schema"}),
                json!({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
                json!("x"),
            ],
        ),
        ("json_schema", vec![json!("x"), json!({"type": 5})]),
        (
            "grammar",
            vec![json!(5), json!("root ::= missing"), json!("root ::= [z-a]")],
        ),
    ];
    let chat_only: Vec<(&str, Vec<Value>)> = vec![
        (
            "messages",
            vec![
                json!(null),
                json!("hi"),
                json!(5),
                json!({}),
                json!([]),
                json!([5]),
                json!(["hi"]),
                json!([null]),
                json!([{}]),
                json!([[]]),
                json!([{"role": "user"}]),
                json!([{"role": "user", "content": null}]),
                json!([{"role": "user", "content": 5}]),
                json!([{"role": "user", "content": {}}]),
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                json!([{"role": "user", "content": [{"type": "text"}]}]),
                json!([{"role": "user", "content": [{"text": "hi"}]}]),
                json!([{"role": "user", "content": ["hi"]}]),
                json!([{"role": 5, "content": "x"}]),
                json!([{"role": null, "content": "x"}]),
                json!([{"content": "x"}]),
                json!([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]),
                json!([{"role": "user", "content": "x"}, 5]),
            ],
        ),
        ("logprobs", vec![json!(5), json!("yes")]),
        (
            "top_logprobs",
            vec![json!(21), json!(-1), json!("x"), json!(2)],
        ),
        (
            "chat_template_kwargs",
            vec![json!("x"), json!(5), json!([])],
        ),
    ];
    let completion_only: Vec<(&str, Vec<Value>)> = vec![
        (
            "prompt",
            vec![
                json!(null),
                json!(5),
                json!(true),
                json!({}),
                json!([]),
                json!(""),
                json!([""]),
                json!([1.5]),
                json!([-1]),
                json!([[]]),
                json!([["a"]]),
                json!([1, "a"]),
                json!(["a", 1]),
                json!([4_294_967_296_u64]),
                json!([[1], "a"]),
                json!([null]),
                json!([{}]),
                json!([999_999]),
            ],
        ),
        (
            "logprobs",
            vec![json!(true), json!(21), json!(-1), json!("x")],
        ),
        ("echo", vec![json!(true), json!("x")]),
        ("suffix", vec![json!("abc"), json!(5)]),
    ];
    for (bases, fields) in [
        (vec![&chat, &completion], &both),
        (vec![&chat], &chat_only),
        (vec![&completion], &completion_only),
    ] {
        for base in bases {
            for (key, values) in fields.iter() {
                for value in values {
                    let body = with(base, key, value.clone());
                    add(
                        format!("{key}={value} in {base}"),
                        body.to_string().into_bytes(),
                    );
                }
            }
        }
    }
    // top_logprobs without logprobs is covered above (`top_logprobs: 2`); stream_options with
    // stream: true but a bad include_usage:
    for base in [&chat, &completion] {
        let mut body = with(base, "stream", json!(true));
        body["stream_options"] = json!({"include_usage": "yes"});
        add(
            format!("bad include_usage in {body}"),
            body.to_string().into_bytes(),
        );
    }

    // Unknown roles.
    for role in ["wizard", "function", "", "USER", "user ", "ipython"] {
        let body = with(&chat, "messages", json!([{"role": role, "content": "hi"}]));
        add(format!("role {role:?}"), body.to_string().into_bytes());
        let body = with(
            &chat,
            "messages",
            json!([{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}, {"role": role, "content": "x"}]),
        );
        add(
            format!("third role {role:?}"),
            body.to_string().into_bytes(),
        );
    }

    // Numbers JSON cannot hold or that overflow every integer type, written raw.
    for number in [
        "1e400",
        "-1e400",
        "99999999999999999999",
        "-99999999999999999999",
        "1e-400",
        "NaN",
        "Infinity",
        "-Infinity",
        "0x10",
        "+1",
        "01",
        "1.",
        ".5",
        "-",
    ] {
        for key in ["max_tokens", "temperature", "seed", "n", "top_p"] {
            for (name, base) in [("chat", &chat), ("completion", &completion)] {
                // 1e-400 reads as 0, which is a fine temperature or seed; elsewhere it is bad.
                if number == "1e-400" && (key == "temperature" || key == "seed") {
                    continue;
                }
                let marker = "\"__number__\"";
                let text = with(base, key, json!("__number__"))
                    .to_string()
                    .replace(marker, number);
                add(format!("{key}={number} ({name})"), text.into_bytes());
            }
        }
    }

    // Deep nesting, balanced and not.
    for depth in [10_000, 100_000] {
        add(format!("{depth} ["), "[".repeat(depth).into_bytes());
        add(format!("{depth} {{"), "{".repeat(depth).into_bytes());
        add(
            format!("{depth} balanced []"),
            format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes(),
        );
        add(
            format!("prompt nested {depth} deep"),
            format!("{{\"prompt\":{}1{}}}", "[".repeat(depth), "]".repeat(depth)).into_bytes(),
        );
        add(
            format!("messages nested {depth} deep"),
            format!(
                "{{\"messages\":{}{}}}",
                "[".repeat(depth),
                "]".repeat(depth)
            )
            .into_bytes(),
        );
        add(
            format!("objects nested {depth} deep"),
            format!(
                "{{\"prompt\":\"hi\",\"x\":{}1{}}}",
                "{\"a\":".repeat(depth),
                "}".repeat(depth)
            )
            .into_bytes(),
        );
    }

    // Invalid UTF-8 inside strings, in keys and at the end.
    let invalid: [&[u8]; 8] = [
        b"\xff",
        b"\xfe\xff",
        b"\xc3\x28",
        b"\xed\xa0\x80",
        b"\xc0\xaf",
        b"\xe2\x82",
        b"\xf4\x90\x80\x80",
        b"\x80",
    ];
    for (i, bytes) in invalid.iter().enumerate() {
        let splice = |template: &str| {
            let (a, b) = template.split_once("@@").unwrap();
            [a.as_bytes(), bytes, b.as_bytes()].concat()
        };
        add(
            format!("bad utf-8 #{i} in content"),
            splice(r#"{"messages":[{"role":"user","content":"hi @@ there"}],"max_tokens":2}"#),
        );
        add(
            format!("bad utf-8 #{i} in prompt"),
            splice(r#"{"prompt":"hi @@ there","max_tokens":2}"#),
        );
        add(
            format!("bad utf-8 #{i} in model"),
            splice(r#"{"model":"@@","prompt":"hi","max_tokens":2}"#),
        );
        add(
            format!("bad utf-8 #{i} in a key"),
            splice(r#"{"prompt":"hi","@@":1,"max_tokens":2}"#),
        );
        add(
            format!("bad utf-8 #{i} at the end"),
            splice(r#"{"prompt":"hi","max_tokens":2}@@"#),
        );
    }
    // Escapes that are not characters.
    for escape in [
        r"\ud800",
        r"\udc00",
        r"\ud800\u0041",
        r"\u12",
        r"\x41",
        r"\q",
    ] {
        add(
            format!("escape {escape} in prompt"),
            format!(r#"{{"prompt":"a{escape}b","max_tokens":2}}"#).into_bytes(),
        );
        add(
            format!("escape {escape} in content"),
            format!(r#"{{"messages":[{{"role":"user","content":"a{escape}b"}}],"max_tokens":2}}"#)
                .into_bytes(),
        );
    }

    // Not JSON objects, and other broken JSON.
    for raw in [
        "",
        " ",
        "\n",
        "null",
        "true",
        "false",
        "0",
        "-1",
        "\"a string\"",
        "[]",
        "[{}]",
        "{}",
        "[1, 2]",
        "{\"prompt\": \"hi\",}",
        "{'prompt': 'hi'}",
        "{prompt: \"hi\"}",
        "{\"prompt\" \"hi\"}",
        "{\"prompt\": \"hi\" /* comment */}",
        "{\"prompt\": \"hi\"}{\"prompt\": \"hi\"}",
        "{\"prompt\": \"hi\"} x",
        "{\"prompt\": \"unterminated}",
        "{\"prompt\": \"tab\there\"}",
        "\u{feff}{\"prompt\": \"hi\"}",
        "{\"a\":1",
        "]",
        "}",
        ",",
        ":",
        "{\"messages\": null, \"prompt\": null}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 2, \"n\": 5, \"prompt\": [\"a\", 5]}",
    ] {
        add(format!("raw {raw:?}"), raw.as_bytes().to_vec());
    }
    // NUL bytes and control characters outside strings.
    add("NUL".into(), b"\0".to_vec());
    add("NUL in object".into(), b"{\"prompt\":\"hi\"\0}".to_vec());
    cases
}

#[test]
fn every_bad_body_gets_a_json_4xx_and_the_server_survives() {
    let server = Server::start("qwen3-f32", &["--context", "64"]);
    let cases = bad_bodies();
    assert!(cases.len() >= 200, "only {} cases", cases.len());
    eprintln!(
        "{} bad bodies, each to {} endpoints",
        cases.len(),
        ENDPOINTS.len()
    );

    let mut failures = Vec::new();
    for (label, body) in &cases {
        for path in ENDPOINTS {
            let headers = [("Content-Type", "application/json")];
            match request(server.addr(), "POST", path, &headers, body) {
                Err(e) => failures.push(format!("{path} {label}: connection failed: {e}")),
                Ok(response) if !(400..500).contains(&response.status) => failures.push(format!(
                    "{path} {label}: status {}: {}",
                    response.status,
                    response.text().chars().take(300).collect::<String>()
                )),
                Ok(response) => match serde_json::from_slice::<Value>(&response.body) {
                    Ok(json) => {
                        if let Some(problem) = error_shape_problem(&json) {
                            failures.push(format!("{path} {label}: bad error shape: {problem}"));
                        }
                    }
                    Err(e) => failures.push(format!(
                        "{path} {label}: status {} but not JSON ({e}): {:?}",
                        response.status,
                        response.text()
                    )),
                },
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} requests failed:\n{}",
        failures.len(),
        cases.len() * ENDPOINTS.len(),
        failures.join("\n")
    );

    let health = server.get("/health");
    assert_eq!(health.status, 200, "{}", health.text());
    let (status, body) = server.post_json(
        "/v1/completions",
        &json!({"prompt": "Hello there", "max_tokens": 3, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    let (status, body) = server.post_json("/v1/chat/completions", &chat_base());
    assert_eq!(status, 200, "{body}");
}
