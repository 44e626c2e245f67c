//! Structured output and penalties through the real server: replies held to JSON schemas
//! (checked by an independent validator, the `jsonschema` crate), to a GBNF or Lark grammar of
//! one string (exactly it), llama-server's fields and OpenAI's, bad schemas as clear 400s, and
//! the sampling penalties as `ember run` applies them.

mod common;

use common::{Server, SseStream, assert_error_shape, ember_run_args, ok, with};
use serde_json::{Value, json};

const QWEN: &str = "qwen3-f32";

/// A schema with nesting, enums, arrays, `required` and `additionalProperties: false`; every
/// string and array bounded, so a random model's reply ends well within the token limit.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "role": {"enum": ["admin", "user", "guest"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}
                },
                "required": ["city", "zip"],
                "additionalProperties": false
            },
            "active": {"type": "boolean"}
        },
        "required": ["name", "role", "age", "tags", "address", "active"],
        "additionalProperties": false
    })
}

fn chat(content: &str, extra: Value) -> Value {
    let body = json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 400,
        "temperature": 0,
    });
    with(body, extra)
}

fn assert_valid(schema: &Value, text: &str, what: &str) {
    let value: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: {text:?} is not JSON: {e}"));
    let validator = jsonschema::validator_for(schema).expect("the test's schema compiles");
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "{what}: {text} fails its schema: {errors:?}"
    );
}

#[test]
fn replies_parse_and_validate_against_their_schemas() {
    let server = Server::start(QWEN, &["--parallel", "2"]);
    let schema = person_schema();
    let response_format = json!({"type": "json_schema",
        "json_schema": {"name": "person", "strict": true, "schema": schema}});
    for (i, prompt) in ["Describe a user.", "Another one, please.", "x"]
        .iter()
        .enumerate()
    {
        let body = chat(
            prompt,
            json!({"response_format": response_format, "seed": i,
                                        "temperature": if i == 2 { 1.0 } else { 0.0 }}),
        );
        let r = ok(&server, "/v1/chat/completions", &body);
        let choice = &r["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{r}");
        assert_valid(
            &schema,
            choice["message"]["content"].as_str().unwrap(),
            prompt,
        );
    }
    // Streamed: the pieces join into a valid reply.
    let mut body = chat("Stream one.", json!({"response_format": response_format}));
    body["stream"] = json!(true);
    let text: String = server
        .stream_json("/v1/chat/completions", &body)
        .iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            let chunk: Value = serde_json::from_str(d).unwrap();
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_valid(&schema, &text, "streamed");

    // `json_object`: any object. llama-server's `json_schema` on /completion and on the
    // OpenAI text completions.
    let r = ok(
        &server,
        "/v1/chat/completions",
        &chat(
            "Any JSON.",
            json!({"response_format": {"type": "json_object"}}),
        ),
    );
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(text).unwrap().is_object(),
        "{text}"
    );
    let small = json!({"type": "object", "properties": {"ok": {"type": "boolean"},
        "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"], "additionalProperties": false});
    let r = ok(
        &server,
        "/completion",
        &json!({"prompt": "JSON:", "n_predict": 100, "json_schema": small, "temperature": 0}),
    );
    assert_valid(&small, r["content"].as_str().unwrap(), "/completion");
    let r = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "JSON:", "max_tokens": 100, "json_schema": small, "temperature": 0}),
    );
    assert_valid(
        &small,
        r["choices"][0]["text"].as_str().unwrap(),
        "/v1/completions",
    );
}

#[test]
fn a_grammar_of_one_string_yields_exactly_it() {
    // The batched loop and, with one sequence at a time, the serial road.
    for parallel in ["4", "1"] {
        let server = Server::start(QWEN, &["--parallel", parallel]);
        grammar_of_one_string(&server);
    }
}

fn grammar_of_one_string(server: &Server) {
    let want = "The answer is 42.";
    for grammar in [
        format!("root ::= \"{want}\""),
        "root ::= greeting\ngreeting ::= \"The answer\" \" is \" [4] \"2.\"\n".to_string(),
        format!("%llguidance {{}}\nstart: \"{want}\"\n"),
    ] {
        let r = ok(
            server,
            "/completion",
            &json!({"prompt": "Q:", "n_predict": 50, "grammar": grammar}),
        );
        assert_eq!(r["content"], want, "{grammar}");
        assert_eq!(r["stop_type"], "eos", "{grammar}: {r}");
        let r = ok(
            server,
            "/v1/chat/completions",
            &chat(
                "Q?",
                json!({"grammar": grammar, "temperature": 1.0, "seed": 3}),
            ),
        );
        assert_eq!(r["choices"][0]["message"]["content"], want, "{grammar}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn bad_schemas_and_grammars_are_400s_naming_the_field() {
    let server = Server::start(QWEN, &[]);
    for (extra, param, words) in [
        (
            json!({"response_format": {"type": "json_schema",
                   "json_schema": {"schema": {"type": "no-such-type"}}}}),
            "response_format",
            "response_format",
        ),
        (
            json!({"grammar": "root ::= missing-rule"}),
            "grammar",
            "missing-rule",
        ),
        (json!({"grammar": "start = \"a\""}), "grammar", "::="),
        (
            json!({"json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}),
            "grammar",
            "both constrain",
        ),
    ] {
        let (status, body) = server.post_json("/v1/chat/completions", &chat("hi", extra.clone()));
        assert_eq!(status, 400, "{extra}: {body}");
        assert_error_shape(&body);
        assert_eq!(body["error"]["param"], param, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(words), "{extra}: {message}");
    }
    // The server goes on serving, constrained or not.
    let r = ok(
        &server,
        "/v1/chat/completions",
        &chat("hi", json!({"max_tokens": 4})),
    );
    assert_eq!(r["choices"][0]["finish_reason"], "length");
}

#[test]
fn a_constrained_request_leaves_a_concurrent_ones_tokens_alone() {
    let server = Server::start(QWEN, &["--parallel", "4"]);
    let plain = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                       "ignore_eos": true});
    let alone = ok(&server, "/v1/completions", &plain)["choices"][0]["text"].clone();
    let constrained = chat(
        "Describe a user.",
        json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "p", "schema": person_schema()}}, "stream": true}),
    );
    // The constrained stream is open (and decoding) while the plain request runs.
    let mut stream = SseStream::open(
        server.addr(),
        "/v1/chat/completions",
        &[("Content-Type", "application/json")],
        constrained.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(stream.status, 200);
    let first = stream.next_data().unwrap();
    assert!(first.is_some());
    let together = ok(&server, "/v1/completions", &plain)["choices"][0]["text"].clone();
    assert_eq!(
        together, alone,
        "a concurrent constrained request changed a plain reply"
    );
    let rest = stream.collect_data().unwrap();
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"));
}

#[test]
fn penalties_apply_as_ember_run_applies_them() {
    let server = Server::start(QWEN, &[]);
    let prompt = "the the the the";
    let completion = |extra: Value| {
        let body = with(
            json!({"prompt": prompt, "max_tokens": 24, "temperature": 0,
                              "ignore_eos": true}),
            extra,
        );
        ok(&server, "/v1/completions", &body)["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let plain = completion(json!({}));
    for (extra, flags) in [
        (
            json!({"repetition_penalty": 1.5}),
            vec!["--repeat-penalty", "1.5"],
        ),
        (
            json!({"presence_penalty": 1.5}),
            vec!["--presence-penalty", "1.5"],
        ),
        (
            json!({"frequency_penalty": 2}),
            vec!["--frequency-penalty", "2"],
        ),
    ] {
        let served = completion(extra.clone());
        let mut args = vec!["--prompt", prompt, "-n", "24", "--ignore-eos"];
        args.extend(flags);
        assert_eq!(served, ember_run_args(QWEN, &args), "{extra}");
        // The penalties take back what the plain greedy reply repeats.
        assert_ne!(served, plain, "{extra} changed nothing");
    }
    // llama.cpp's window: only the last n tokens count.
    let windowed = completion(json!({"repeat_penalty": 1.5, "repeat_last_n": 4}));
    let whole = completion(json!({"repeat_penalty": 1.5, "repeat_last_n": -1}));
    assert_ne!(windowed, plain);
    assert_ne!(whole, plain);
}

#[test]
fn penalty_flags_are_defaults_a_request_overrides() {
    let flagged = Server::start(
        QWEN,
        &["--repeat-penalty", "1.5", "--presence-penalty", "0.5"],
    );
    let props = flagged.get("/props").json();
    let params = &props["default_generation_settings"]["params"];
    assert_eq!(
        (
            params["repeat_penalty"].as_f64(),
            params["presence_penalty"].as_f64()
        ),
        (Some(1.5), Some(0.5))
    );
    let text = |server: &Server, extra: Value| {
        let body = with(
            json!({"prompt": "the the the the", "max_tokens": 16, "temperature": 0,
                              "ignore_eos": true}),
            extra,
        );
        ok(server, "/v1/completions", &body)["choices"][0]["text"].clone()
    };
    let plain = Server::start(QWEN, &[]);
    assert_eq!(
        text(&flagged, json!({})),
        text(
            &plain,
            json!({"repetition_penalty": 1.5, "presence_penalty": 0.5})
        )
    );
    // A request's own fields win over the flags.
    assert_eq!(
        text(
            &flagged,
            json!({"repetition_penalty": 1, "presence_penalty": 0})
        ),
        text(&plain, json!({}))
    );
    assert!(
        flagged
            .log()
            .contains("repetition_penalty 1.5, presence_penalty 0.5"),
        "{}",
        flagged.log()
    );
}
