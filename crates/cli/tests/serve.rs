//! `ember serve` as a client sees it: the real binary on a loopback port, spoken to over
//! plain HTTP/1.1. Each test starts its own server on port 0.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::{
    Server, SseStream, TempFile, assert_error_shape, ember_run, ember_run_args, expected, fixture,
    ids, mentions_word, metric, ok, with,
};
use ember_engine::tokenizer::Tokenizer;
use serde_json::{Value, json};

const QWEN: &str = "qwen3-f32";
const LLAMA: &str = "llama-f32";
const JSON: (&str, &str) = ("Content-Type", "application/json");

/// Transformers' greedy text for completion `case` of a fixture.
fn golden_text(model: &str, case: usize) -> String {
    let expected = expected(model);
    let generated = ids(&expected["completions"][case]["generated_ids"]);
    Tokenizer::from_dir(&fixture(model))
        .unwrap()
        .decode(&generated, true)
}

fn golden_prompt(model: &str, case: usize) -> (String, Vec<u32>) {
    let expected = expected(model);
    let case = &expected["completions"][case];
    (
        case["prompt"].as_str().unwrap().to_owned(),
        ids(&case["input_ids"]),
    )
}

/// A greedy, fixed-length completion request.
fn greedy_completion(prompt: Value, max_tokens: usize) -> Value {
    json!({
        "model": "anything",
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": true,
    })
}

fn greedy_chat(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": "anything",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": true,
    })
}

fn error(server: &Server, path: &str, body: &Value, want: u16) -> Value {
    let (status, response) = server.post_json(path, body);
    assert_eq!(status, want, "{path} {body}: {response}");
    assert_error_shape(&response);
    response["error"].clone()
}

/// Parses SSE payloads: every one but the last is a JSON chunk, the last is `[DONE]`.
fn parse_chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "the stream ends with [DONE]: {data:?}"
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("chunk {d:?}: {e}")))
        .collect()
}

fn chat_content(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|choice| choice["delta"]["content"].as_str())
        .collect()
}

fn completion_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|choice| choice["text"].as_str())
        .collect()
}

/// The finish reason of the last chunk that has a choice.
fn last_finish_reason(chunks: &[Value]) -> Value {
    chunks
        .iter()
        .rev()
        .find_map(|c| c["choices"].get(0))
        .map(|choice| choice["finish_reason"].clone())
        .unwrap_or(Value::Null)
}

/// A stop string taken from the middle of `text`: two ASCII non-space characters when there
/// are any, else any two characters; and the text before its first occurrence.
fn pick_stop(text: &str) -> (String, String) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(chars.len() >= 6, "text too short to cut: {text:?}");
    let good = |i: usize| {
        chars[i..i + 2].iter().all(|(_, c)| c.is_ascii_graphic())
            && text
                .find(&text[chars[i].0..chars[i].0 + 2])
                .is_some_and(|at| at > 0)
    };
    let middle = chars.len() / 2;
    let start = (middle..chars.len() - 1)
        .chain(1..middle)
        .find(|&i| good(i))
        .unwrap_or(middle);
    let from = chars[start].0;
    let to = chars.get(start + 2).map_or(text.len(), |(at, _)| *at);
    let stop = text[from..to].to_owned();
    let prefix = text[..text.find(&stop).unwrap()].to_owned();
    (stop, prefix)
}

#[test]
fn health_is_ok_once_ready_and_models_lists_the_model() {
    let mut server = Server::spawn(QWEN, &[]);
    // The fixture loads in milliseconds, so the loading state is rarely seen; when it is, it
    // must be a 503.
    let early = server.get("/health");
    eprintln!(
        "/health right after bind: {} {}",
        early.status,
        early.text()
    );
    assert!(
        early.status == 200 || early.status == 503,
        "{}",
        early.status
    );
    if early.status == 503 {
        assert_eq!(early.json()["status"], "loading");
        let (status, body) =
            server.post_json("/v1/completions", &greedy_completion(json!("Hi"), 2));
        eprintln!("a completion while loading: {status} {body}");
        // Loading may have finished in between.
        if status != 200 {
            assert_eq!(status, 503, "{body}");
            assert_error_shape(&body);
        }
    }
    server.wait_ready();

    let health = server.get("/health");
    assert_eq!(health.status, 200, "{}", health.text());
    assert!(
        health
            .header("content-type")
            .is_some_and(|t| t.contains("json"))
    );
    assert_eq!(health.json()["status"], "ok");

    let models = server.get("/v1/models");
    assert_eq!(models.status, 200);
    let models = models.json();
    assert_eq!(models["object"], "list");
    let names: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(names, [QWEN]);
    assert_eq!(models["data"][0]["object"], "model");
}

/// A client (or script) that waits for the `ready: serving` log line must not then get 503.
/// The race is short, so a few servers are started to give it a chance to show.
#[test]
fn health_is_ok_as_soon_as_ready_is_logged() {
    let mut seen = Vec::new();
    for _ in 0..5 {
        let server = Server::start(LLAMA, &[]);
        seen.extend(server.health_at_ready_line);
    }
    assert!(
        seen.iter().all(|&s| s == 200),
        "/health right after the `ready: serving` line: {seen:?} (503 = the line is logged before the server is ready)"
    );
}

#[test]
fn served_model_name_is_echoed_whatever_the_request_says() {
    let server = Server::start(QWEN, &["--served-model-name", "foo"]);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "foo");
    assert_eq!(models["data"].as_array().unwrap().len(), 1);

    let (prompt, _) = golden_prompt(QWEN, 0);
    let body = with(
        greedy_completion(json!(prompt), 2),
        json!({"model": "gpt-4"}),
    );
    assert_eq!(ok(&server, "/v1/completions", &body)["model"], "foo");
    let chat = with(greedy_chat("hi", 2), json!({"model": "bar"}));
    assert_eq!(ok(&server, "/v1/chat/completions", &chat)["model"], "foo");
    let data = server.stream_json("/v1/chat/completions", &with(chat, json!({"stream": true})));
    for chunk in parse_chunks(&data) {
        assert_eq!(chunk["model"], "foo", "{chunk}");
    }
}

#[test]
fn greedy_completion_equals_ember_run_and_transformers() {
    for model in [QWEN, LLAMA] {
        let server = Server::start(model, &[]);
        let (prompt, input_ids) = golden_prompt(model, 0);
        let response = ok(
            &server,
            "/v1/completions",
            &greedy_completion(json!(prompt), 12),
        );

        let text = response["choices"][0]["text"].as_str().unwrap().to_owned();
        assert_eq!(
            text,
            ember_run(model, &prompt, 12),
            "{model}: server vs ember run"
        );
        // llama-server's and vLLM's route without `/v1`, and llama.cpp's `n_predict`.
        let bare = ok(
            &server,
            "/completions",
            &json!({"prompt": prompt, "n_predict": 12, "temperature": 0}),
        );
        assert_eq!(bare["choices"][0]["text"], text, "{model}: /completions");
        // The same model and build: the same fingerprint, as OpenAI's replies carry it.
        let fingerprint = response["system_fingerprint"].as_str().unwrap();
        assert!(fingerprint.starts_with("fp_"), "{response}");
        assert_eq!(bare["system_fingerprint"], fingerprint, "{bare}");
        assert_eq!(bare["usage"]["completion_tokens"], 12, "{bare}");
        let models = server.get("/models").json();
        assert_eq!(models["data"][0]["id"], model, "{models}");
        assert_eq!(
            text,
            golden_text(model, 0),
            "{model}: server vs transformers"
        );

        assert!(
            response["id"].as_str().unwrap().starts_with("cmpl-"),
            "{response}"
        );
        assert_eq!(response["object"], "text_completion");
        assert!(response["created"].as_u64().unwrap() > 1_600_000_000);
        assert_eq!(response["model"], model);
        let choices = response["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1);
        assert_eq!(choices[0]["index"], 0);
        assert_eq!(choices[0]["finish_reason"], "length");
        assert!(
            choices[0].get("logprobs").is_some_and(Value::is_null),
            "{response}"
        );
        let usage = &response["usage"];
        assert_eq!(usage["prompt_tokens"], input_ids.len(), "{model}: {usage}");
        assert_eq!(usage["completion_tokens"], 12);
        assert_eq!(usage["total_tokens"], input_ids.len() + 12);
    }
}

#[test]
fn prompts_as_token_ids_and_as_several_strings() {
    let server = Server::start(QWEN, &[]);
    let (_, input_ids) = golden_prompt(QWEN, 0);
    let want = golden_text(QWEN, 0);

    let response = ok(
        &server,
        "/v1/completions",
        &greedy_completion(json!(input_ids), 12),
    );
    assert_eq!(response["choices"][0]["text"], want.as_str());
    assert_eq!(response["usage"]["prompt_tokens"], input_ids.len());
    let response = ok(
        &server,
        "/v1/completions",
        &greedy_completion(json!([input_ids]), 12),
    );
    assert_eq!(response["choices"][0]["text"], want.as_str());

    let (first, first_ids) = golden_prompt(QWEN, 0);
    let (second, second_ids) = golden_prompt(QWEN, 1);
    let response = ok(
        &server,
        "/v1/completions",
        &greedy_completion(json!([first, second]), 12),
    );
    let choices = response["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{response}");
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["text"], golden_text(QWEN, i).as_str(), "choice {i}");
        assert_eq!(choice["finish_reason"], "length");
    }
    assert_eq!(
        response["usage"]["prompt_tokens"],
        first_ids.len() + second_ids.len()
    );
    assert_eq!(response["usage"]["completion_tokens"], 24);

    // Streaming two prompts: each chunk says which choice it belongs to.
    let data = server.stream_json(
        "/v1/completions",
        &with(
            greedy_completion(json!([first, second]), 12),
            json!({"stream": true}),
        ),
    );
    let chunks = parse_chunks(&data);
    for i in 0..2 {
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .filter(|c| c["index"] == i)
            .filter_map(|c| c["text"].as_str())
            .collect();
        assert_eq!(text, golden_text(QWEN, i), "streamed choice {i}");
    }
}

#[test]
fn chat_streams_the_same_text_it_returns_whole() {
    let server = Server::start(LLAMA, &[]);
    let body = greedy_chat("Tell me a story about a fox.", 16);
    let whole = ok(&server, "/v1/chat/completions", &body);
    assert!(
        whole["id"].as_str().unwrap().starts_with("chatcmpl-"),
        "{whole}"
    );
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["model"], LLAMA);
    let choice = &whole["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["message"]["content"].as_str().unwrap().to_owned();
    assert!(!content.is_empty());
    let run = ember_run_args(
        LLAMA,
        &[
            "--chat",
            "-p",
            "Tell me a story about a fox.",
            "-n",
            "16",
            "--ignore-eos",
        ],
    );
    assert_eq!(content, run, "server chat vs ember run --chat");
    let usage = &whole["usage"];
    assert_eq!(usage["completion_tokens"], 16);
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 5);
    assert_eq!(usage["total_tokens"], prompt_tokens + 16);

    let data = server.stream_json(
        "/v1/chat/completions",
        &with(body.clone(), json!({"stream": true})),
    );
    let chunks = parse_chunks(&data);
    assert!(chunks.len() >= 3, "{data:?}");
    assert_eq!(
        chunks[0]["choices"][0]["delta"]["role"], "assistant",
        "{}",
        chunks[0]
    );
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        assert_eq!(chunk["id"], id, "one id per stream");
        assert!(
            chunk.get("usage").is_none_or(Value::is_null),
            "no usage unless asked: {chunk}"
        );
        assert_eq!(chunk["choices"].as_array().unwrap().len(), 1, "{chunk}");
    }
    for chunk in &chunks[..chunks.len() - 1] {
        assert!(chunk["choices"][0]["finish_reason"].is_null(), "{chunk}");
    }
    assert_eq!(last_finish_reason(&chunks), "length");
    assert_eq!(
        chat_content(&chunks),
        content,
        "streamed deltas vs the whole answer"
    );

    // include_usage: one more chunk, with no choices and the usage.
    let data = server.stream_json(
        "/v1/chat/completions",
        &with(
            body.clone(),
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    let chunks = parse_chunks(&data);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]), "{last}");
    assert_eq!(last["object"], "chat.completion.chunk");
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][field], usage[field], "{last}");
    }
    // The same prompt again: its prefix comes from the prompt cache.
    let cached = &last["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert!(cached.as_u64().is_some_and(|c| c > 0), "{last}");
    assert_eq!(last_finish_reason(&chunks), "length");
    assert_eq!(chat_content(&chunks), content);

    // Without ignore_eos, the model may end on its own.
    let free = with(body, json!({"ignore_eos": false, "max_tokens": 200}));
    let response = ok(&server, "/v1/chat/completions", &free);
    let reason = response["choices"][0]["finish_reason"].as_str().unwrap();
    let tokens = response["usage"]["completion_tokens"].as_u64().unwrap();
    eprintln!("chat without ignore_eos: finish_reason {reason} after {tokens} tokens");
    match reason {
        "length" => assert_eq!(tokens, 200),
        "stop" => assert!(tokens <= 200),
        other => panic!("finish_reason {other}"),
    }
    let data = server.stream_json("/v1/chat/completions", &with(free, json!({"stream": true})));
    let chunks = parse_chunks(&data);
    assert_eq!(last_finish_reason(&chunks), reason);
    assert_eq!(
        chat_content(&chunks),
        response["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
    );
}

#[test]
fn completion_stream_matches_the_whole_answer() {
    let server = Server::start(QWEN, &[]);
    let (prompt, input_ids) = golden_prompt(QWEN, 3);
    let body = greedy_completion(json!(prompt), 12);
    let data = server.stream_json(
        "/v1/completions",
        &with(
            body,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    let chunks = parse_chunks(&data);
    for chunk in &chunks {
        assert_eq!(chunk["object"], "text_completion", "{chunk}");
        assert!(chunk["id"].as_str().unwrap().starts_with("cmpl-"));
    }
    assert_eq!(completion_text(&chunks), golden_text(QWEN, 3));
    assert_eq!(last_finish_reason(&chunks), "length");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["prompt_tokens"], input_ids.len());
    assert_eq!(last["usage"]["completion_tokens"], 12);
}

#[test]
fn stop_strings_cut_the_text_before_them() {
    let server = Server::start(QWEN, &[]);
    let (prompt, _) = golden_prompt(QWEN, 3);
    let body = greedy_completion(json!(prompt), 24);
    let full = ok(&server, "/v1/completions", &body)["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let (stop, prefix) = pick_stop(&full);
    eprintln!("completion {full:?}: stop at {stop:?} -> {prefix:?}");

    let stopped = with(body.clone(), json!({"stop": [stop]}));
    let response = ok(&server, "/v1/completions", &stopped);
    assert_eq!(
        response["choices"][0]["text"],
        prefix.as_str(),
        "{response}"
    );
    assert_eq!(response["choices"][0]["finish_reason"], "stop");

    // A single string works as well as a list.
    let response = ok(
        &server,
        "/v1/completions",
        &with(body, json!({"stop": stop})),
    );
    assert_eq!(
        response["choices"][0]["text"],
        prefix.as_str(),
        "{response}"
    );

    let data = server.stream_json("/v1/completions", &with(stopped, json!({"stream": true})));
    let chunks = parse_chunks(&data);
    assert_eq!(
        completion_text(&chunks),
        prefix,
        "streamed text before the stop string"
    );
    for chunk in &chunks {
        let text = chunk["choices"][0]["text"].as_str().unwrap_or("");
        assert!(
            !text.contains(&stop),
            "a chunk holds the stop string: {chunk}"
        );
    }
    assert_eq!(last_finish_reason(&chunks), "stop");
}

#[test]
fn chat_stop_strings_cut_the_content_before_them() {
    let server = Server::start(LLAMA, &[]);
    let body = greedy_chat("Tell me a story about a fox.", 24);
    let full = ok(&server, "/v1/chat/completions", &body)["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let (stop, prefix) = pick_stop(&full);
    eprintln!("chat {full:?}: stop at {stop:?} -> {prefix:?}");

    let stopped = with(body, json!({"stop": [stop, "\u{1F98A}never"]}));
    let response = ok(&server, "/v1/chat/completions", &stopped);
    assert_eq!(
        response["choices"][0]["message"]["content"],
        prefix.as_str(),
        "{response}"
    );
    assert_eq!(response["choices"][0]["finish_reason"], "stop");

    let data = server.stream_json(
        "/v1/chat/completions",
        &with(stopped, json!({"stream": true})),
    );
    let chunks = parse_chunks(&data);
    assert_eq!(chat_content(&chunks), prefix);
    for chunk in &chunks {
        let text = chunk["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("");
        assert!(
            !text.contains(&stop),
            "a chunk holds the stop string: {chunk}"
        );
    }
    assert_eq!(last_finish_reason(&chunks), "stop");
}

#[test]
fn completion_logprobs_match_the_top_lists_and_transformers() {
    let server = Server::start(QWEN, &[]);
    let (prompt, _) = golden_prompt(QWEN, 0);
    let response = ok(
        &server,
        "/v1/completions",
        &with(greedy_completion(json!(prompt), 12), json!({"logprobs": 3})),
    );
    let choice = &response["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert_eq!(text, golden_text(QWEN, 0));
    let logprobs = &choice["logprobs"];
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(
            logprobs[key].as_array().map(Vec::len),
            Some(12),
            "{key}: {logprobs}"
        );
    }
    let golden = expected(QWEN)["completions"][0]["top_logprobs"].clone();
    let tokenizer = Tokenizer::from_dir(&fixture(QWEN)).unwrap();
    let mut last_offset = 0;
    let mut collapsed = Vec::new();
    for i in 0..12 {
        let top = logprobs["top_logprobs"][i].as_object().unwrap();
        // Keys are token texts, so alternatives that decode alike (byte tokens that are not a
        // whole character all read "\u{FFFD}") share one key: 3 keys unless they collide.
        let texts: Vec<String> = (0..3)
            .map(|k| tokenizer.decode(&[golden[i][k][0].as_u64().unwrap() as u32], false))
            .collect();
        let mut distinct = texts.clone();
        distinct.sort();
        distinct.dedup();
        let mut keys: Vec<String> = top.keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys, distinct,
            "token {i}: top_logprobs {top:?}, transformers' top 3 read {texts:?}"
        );
        if distinct.len() < 3 {
            collapsed.push((i, texts.clone()));
        }
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        let chosen = logprobs["token_logprobs"][i].as_f64().unwrap();
        assert!(
            (chosen - best).abs() < 1e-6,
            "token {i}: greedy logprob {chosen} is not the top {best}"
        );
        let want = golden[i][0][1].as_f64().unwrap();
        assert!(
            (chosen - want).abs() < 1e-3,
            "token {i}: logprob {chosen}, transformers {want}"
        );
        assert_eq!(logprobs["tokens"][i], texts[0].as_str(), "token {i}");
        let offset = logprobs["text_offset"][i].as_u64().unwrap() as usize;
        assert!(
            offset >= last_offset && offset <= text.len(),
            "text_offset {offset}"
        );
        last_offset = offset;
    }
    if !collapsed.is_empty() {
        eprintln!(
            "top_logprobs with fewer than 3 keys (alternatives with the same text): {collapsed:?}"
        );
    }
    assert_eq!(logprobs["text_offset"][0], 0);
}

#[test]
fn chat_logprobs_list_each_token_and_its_alternatives() {
    let server = Server::start(LLAMA, &[]);
    let body = with(
        greedy_chat("Hello!", 12),
        json!({"logprobs": true, "top_logprobs": 2}),
    );
    let response = ok(&server, "/v1/chat/completions", &body);
    let content = response["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("{response}"));
    assert_eq!(content.len(), 12, "{response}");
    for entry in content {
        assert!(entry["token"].is_string(), "{entry}");
        let logprob = entry["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0);
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2, "{entry}");
        for alternative in top {
            assert!(
                alternative["token"].is_string() && alternative["logprob"].is_number(),
                "{alternative}"
            );
        }
        let best = top
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert!(
            (logprob - best).abs() < 1e-6,
            "greedy logprob {logprob} is not the top {best}: {entry}"
        );
        assert!(
            top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64(),
            "most likely first: {entry}"
        );
    }

    // Streamed, the entries arrive spread over the chunks, the same ones in the same order.
    let data = server.stream_json("/v1/chat/completions", &with(body, json!({"stream": true})));
    let streamed: Vec<Value> = parse_chunks(&data)
        .iter()
        .filter_map(|c| {
            c["choices"].get(0)?["logprobs"]["content"]
                .as_array()
                .cloned()
        })
        .flatten()
        .collect();
    assert_eq!(&streamed, content);

    // Without `logprobs`, none.
    let response = ok(&server, "/v1/chat/completions", &greedy_chat("Hello!", 4));
    assert!(response["choices"][0]["logprobs"].is_null(), "{response}");
}

#[test]
fn the_same_seed_samples_the_same_text() {
    let server = Server::start(LLAMA, &[]);
    let body = |seed: u64| json!({"prompt": "Once upon", "temperature": 1, "seed": seed, "max_tokens": 16, "ignore_eos": true});
    let text = |seed: u64| {
        ok(&server, "/v1/completions", &body(seed))["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let first = text(42);
    assert_eq!(first, text(42));
    assert_ne!(
        first,
        text(43),
        "different seeds should (almost surely) differ over 16 sampled tokens"
    );
    let data = server.stream_json("/v1/completions", &with(body(42), json!({"stream": true})));
    assert_eq!(
        completion_text(&parse_chunks(&data)),
        first,
        "streaming samples the same tokens"
    );

    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 1, "seed": 7, "max_tokens": 16, "ignore_eos": true});
    let content = |body: &Value| {
        ok(&server, "/v1/chat/completions", body)["choices"][0]["message"]["content"].clone()
    };
    assert_eq!(content(&chat), content(&chat));
}

#[test]
fn qwen3_thinking_can_be_switched_off() {
    let server = Server::start(QWEN, &[]);
    let thinking = greedy_chat("What is 2+2?", 32);
    let no_thinking = with(
        thinking.clone(),
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
    );

    let on = ok(&server, "/v1/chat/completions", &thinking);
    let off = ok(&server, "/v1/chat/completions", &no_thinking);
    for (name, response) in [("default", &on), ("enable_thinking=false", &off)] {
        let message = &response["choices"][0]["message"];
        eprintln!(
            "qwen3 {name}: content {:?}, reasoning_content {}",
            message["content"],
            message
                .get("reasoning_content")
                .map_or("absent".to_string(), Value::to_string)
        );
        assert_eq!(message["role"], "assistant");
        assert!(message["content"].is_string());
    }
    // The kwarg reaches the template: it adds an empty `<think></think>` block to the prompt.
    assert!(
        off["usage"]["prompt_tokens"].as_u64() > on["usage"]["prompt_tokens"].as_u64(),
        "enable_thinking=false should lengthen the prompt: {} vs {}",
        off["usage"],
        on["usage"]
    );

    // Streamed, content and reasoning add up to the same as the whole answers.
    for (body, whole) in [(&thinking, &on), (&no_thinking, &off)] {
        let data = server.stream_json(
            "/v1/chat/completions",
            &with(body.clone(), json!({"stream": true})),
        );
        let chunks = parse_chunks(&data);
        let message = &whole["choices"][0]["message"];
        assert_eq!(chat_content(&chunks), message["content"].as_str().unwrap());
        let reasoning: String = chunks
            .iter()
            .filter_map(|c| {
                c["choices"].get(0)?["delta"]["reasoning_content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(
            reasoning,
            message["reasoning_content"].as_str().unwrap_or("")
        );
    }
}

#[test]
fn bad_requests_get_openai_shaped_errors() {
    let server = Server::start(LLAMA, &["--context", "64", "--max-body-bytes", "4096"]);
    let chat = greedy_chat("Hi", 4);
    let completion = greedy_completion(json!("Hi"), 4);

    for (path, body) in [
        ("/v1/chat/completions", &chat),
        ("/v1/completions", &completion),
    ] {
        let e = error(&server, path, &with(body.clone(), json!({"n": 2})), 400);
        let message = e["message"].as_str().unwrap();
        assert!(e["param"] == "n" && mentions_word(message, "n"), "{e}");

        let e = error(
            &server,
            path,
            &with(body.clone(), json!({"max_tokens": -1})),
            400,
        );
        assert_eq!(e["param"], "max_tokens", "{e}");

        let e = error(
            &server,
            path,
            &with(body.clone(), json!({"max_tokens": 1000})),
            400,
        );
        let message = e["message"].as_str().unwrap();
        assert!(message.contains("64") && message.contains("1000"), "{e}");

        let e = error(
            &server,
            path,
            &with(body.clone(), json!({"temperature": "hot"})),
            400,
        );
        assert_eq!(e["param"], "temperature", "{e}");

        error(
            &server,
            path,
            &with(
                body.clone(),
                json!({"stream_options": {"include_usage": true}}),
            ),
            400,
        );

        // Malformed JSON, invalid UTF-8, a body that is not an object, an empty body.
        for raw in [
            &b"{\"messages\": ["[..],
            b"{\"prompt\": \"\xff\xfe\"}",
            b"[1, 2]",
            b"",
        ] {
            let response = server.request("POST", path, &[JSON], raw);
            assert_eq!(response.status, 400, "{path} {raw:?}: {}", response.text());
            assert_error_shape(&response.json());
        }

        // Larger than --max-body-bytes 4096.
        let big = with(body.clone(), json!({"padding": "x".repeat(5000)})).to_string();
        let response = server.request("POST", path, &[JSON], big.as_bytes());
        assert_eq!(response.status, 413, "{}", response.text());
        assert_error_shape(&response.json());

        // A prompt longer than the context.
        let long = "word ".repeat(200);
        let long_body = match path {
            "/v1/completions" => greedy_completion(json!(long), 4),
            _ => greedy_chat(&long, 4),
        };
        let e = error(&server, path, &long_body, 400);
        assert!(e["message"].as_str().unwrap().contains("64"), "{e}");
    }

    let e = error(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "boo"}], "max_tokens": 2}),
        400,
    );
    assert!(e["message"].as_str().unwrap().contains("wizard"), "{e}");
    assert_eq!(e["param"], "messages[1].role");

    let e = error(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [], "max_tokens": 2}),
        400,
    );
    assert_eq!(e["param"], "messages");
    error(
        &server,
        "/v1/chat/completions",
        &json!({"max_tokens": 2}),
        400,
    );
    error(&server, "/v1/completions", &json!({"max_tokens": 2}), 400);
    let e = error(
        &server,
        "/v1/completions",
        &json!({"prompt": [999_999], "max_tokens": 2}),
        400,
    );
    assert!(e["message"].as_str().unwrap().contains("999999"), "{e}");

    for (method, path) in [
        ("GET", "/nope"),
        ("POST", "/v1/nope"),
        ("GET", "/v1/chat/completions/x"),
    ] {
        let response = server.request(method, path, &[], b"");
        assert_eq!(response.status, 404, "{method} {path}");
        assert_error_shape(&response.json());
    }
    let response = server.request("GET", "/v1/completions", &[], b"");
    assert!(
        (400..500).contains(&response.status),
        "GET /v1/completions: {}",
        response.status
    );
    assert_error_shape(&response.json());

    // And after all that, it still works.
    let response = ok(&server, "/v1/completions", &completion);
    assert_eq!(response["usage"]["completion_tokens"], 4);

    // Without max_tokens, generation runs to the end of the context.
    let mut unbounded = completion.clone();
    unbounded.as_object_mut().unwrap().remove("max_tokens");
    let response = ok(&server, "/v1/completions", &unbounded);
    assert_eq!(
        response["choices"][0]["finish_reason"], "length",
        "{response}"
    );
    let total = response["usage"]["total_tokens"].as_u64().unwrap();
    assert!((60..=64).contains(&total), "{response}");
}

#[test]
fn api_keys_guard_v1_but_not_health() {
    let keys = TempFile::new("keys", "# ember keys\nsk-first-key\n\n  sk-second-key  \n");
    let server = Server::start(LLAMA, &["--api-keys-file", keys.path().to_str().unwrap()]);
    let body = greedy_completion(json!("Hi"), 2).to_string();
    let post = |auth: Option<&str>| {
        let mut headers = vec![JSON];
        let value;
        if let Some(key) = auth {
            value = format!("Bearer {key}");
            headers.push(("Authorization", value.as_str()));
        }
        server.request("POST", "/v1/completions", &headers, body.as_bytes())
    };
    let get_models =
        |auth: &str| server.request("GET", "/v1/models", &[("Authorization", auth)], b"");

    for response in [
        post(None),
        post(Some("sk-wrong")),
        post(Some("sk-first-ke")),
        post(Some("")),
        get_models("sk-first-key"),
    ] {
        assert_eq!(response.status, 401, "{}", response.text());
        let body = response.json();
        assert_error_shape(&body);
    }
    assert_eq!(server.get("/v1/models").status, 401);
    // The routes without `/v1` are the same routes, keys included.
    assert_eq!(server.get("/models").status, 401);
    let bare = server.request("POST", "/completions", &[JSON], body.as_bytes());
    assert_eq!(bare.status, 401, "{}", bare.text());
    for key in ["sk-first-key", "sk-second-key"] {
        let response = post(Some(key));
        assert_eq!(response.status, 200, "{key}: {}", response.text());
        assert_eq!(get_models(&format!("Bearer {key}")).status, 200);
    }
    let chat = server.request(
        "POST",
        "/v1/chat/completions",
        &[JSON, ("Authorization", "Bearer sk-second-key")],
        greedy_chat("hi", 2).to_string().as_bytes(),
    );
    assert_eq!(chat.status, 200, "{}", chat.text());

    assert_eq!(server.get("/health").status, 200);
    eprintln!(
        "/metrics without a key when keys are set: {}",
        server.get("/metrics").status
    );
}

#[test]
fn metrics_count_requests_and_tokens() {
    let server = Server::start(QWEN, &[]);
    let before = server.metrics();
    for name in [
        "ember_requests_total",
        "ember_prompt_tokens_total",
        "ember_generation_tokens_total",
        "ember_time_to_first_token_seconds_bucket",
        "ember_inter_token_latency_seconds_bucket",
        "ember_requests_running",
        "ember_requests_queued",
    ] {
        assert!(before.contains(name), "{name} missing from:\n{before}");
    }
    let response = server.get("/metrics");
    assert!(
        response
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/plain")),
        "{:?}",
        response.header("content-type")
    );

    let (prompt, input_ids) = golden_prompt(QWEN, 0);
    ok(
        &server,
        "/v1/completions",
        &greedy_completion(json!(prompt), 12),
    );
    error(&server, "/v1/completions", &json!({"prompt": 5}), 400);
    let after = server.metrics();

    let delta = |series: &str| {
        metric(&after, series).unwrap_or(0.0) - metric(&before, series).unwrap_or(0.0)
    };
    assert_eq!(
        delta("ember_prompt_tokens_total"),
        input_ids.len() as f64,
        "{after}"
    );
    assert_eq!(delta("ember_generation_tokens_total"), 12.0, "{after}");
    assert_eq!(
        delta("ember_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"),
        1.0,
        "{after}"
    );
    assert_eq!(
        delta("ember_requests_total{endpoint=\"/v1/completions\",status=\"400\"}"),
        1.0,
        "{after}"
    );
    assert_eq!(
        delta("ember_time_to_first_token_seconds_count"),
        1.0,
        "{after}"
    );
    assert_eq!(
        delta("ember_time_to_first_token_seconds_bucket{le=\"+Inf\"}"),
        1.0,
        "{after}"
    );
    assert_eq!(
        delta("ember_inter_token_latency_seconds_count"),
        11.0,
        "{after}"
    );
    assert_eq!(
        metric(&after, "ember_requests_running"),
        Some(0.0),
        "{after}"
    );
    assert_eq!(
        metric(&after, "ember_requests_queued"),
        Some(0.0),
        "{after}"
    );
}

#[test]
fn a_full_queue_answers_503_and_the_server_recovers() {
    let server = Server::start(LLAMA, &["--context", "4096", "--max-queue", "1"]);
    let addr = server.addr().to_owned();
    let body = greedy_completion(json!("Once upon a time"), 3000);
    let body = with(body, json!({"stream": true})).to_string();
    let requests = 6;
    let barrier = Arc::new(Barrier::new(requests));
    let threads: Vec<_> = (0..requests)
        .map(|_| {
            let (addr, body, barrier) = (addr.clone(), body.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                let mut stream =
                    SseStream::open(&addr, "/v1/completions", &[JSON], body.as_bytes()).unwrap();
                if stream.status == 200 {
                    // Hold the slot a moment, then leave (which cancels the generation).
                    let first = stream.next_data().unwrap();
                    assert!(first.is_some());
                    std::thread::sleep(Duration::from_millis(500));
                    (200, Value::Null)
                } else {
                    let body = stream.read_body().unwrap();
                    (stream.status, serde_json::from_slice(&body).unwrap())
                }
            })
        })
        .collect();
    let results: Vec<(u16, Value)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let statuses: Vec<u16> = results.iter().map(|(s, _)| *s).collect();
    eprintln!("statuses with --max-queue 1: {statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    assert!(statuses.contains(&200), "{statuses:?}");
    let rejected: Vec<&Value> = results
        .iter()
        .filter(|(s, _)| *s == 503)
        .map(|(_, b)| b)
        .collect();
    assert!(
        !rejected.is_empty(),
        "no request was turned away: {statuses:?}"
    );
    for body in rejected {
        assert_error_shape(body);
        assert_eq!(body["error"]["code"], "queue_full", "{body}");
    }

    let response = ok(
        &server,
        "/v1/completions",
        &greedy_completion(json!("Hi"), 4),
    );
    assert_eq!(response["usage"]["completion_tokens"], 4);
}

#[test]
fn a_client_that_leaves_cancels_its_generation() {
    let server = Server::start(LLAMA, &["--context", "4096"]);
    let body = with(
        greedy_completion(json!("Once upon a time"), 2000),
        json!({"stream": true}),
    );
    let mut stream = SseStream::open(
        server.addr(),
        "/v1/completions",
        &[JSON],
        body.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(stream.status, 200);
    for _ in 0..2 {
        assert!(stream.next_data().unwrap().is_some());
    }
    drop(stream);

    let start = Instant::now();
    let response = ok(
        &server,
        "/v1/completions",
        &greedy_completion(json!("Hi"), 4),
    );
    assert_eq!(response["usage"]["completion_tokens"], 4);
    let waited = start.elapsed();
    eprintln!("a request after a client left took {waited:?}");
    assert!(
        waited < Duration::from_secs(5),
        "{waited:?}: was the abandoned generation cancelled?"
    );

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = server.metrics();
        if metric(&metrics, "ember_requests_running") == Some(0.0) {
            let generated = metric(&metrics, "ember_generation_tokens_total").unwrap();
            eprintln!("tokens generated in all after the client left: {generated}");
            assert!(
                generated < 2000.0,
                "the abandoned generation ran to its end: {generated} tokens"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "requests still running:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The same for a non-streaming request: the client gives up waiting and closes the socket.
#[test]
fn a_client_that_leaves_before_a_whole_response_cancels_it() {
    let server = Server::start(LLAMA, &["--context", "4096"]);
    let before = metric(&server.metrics(), "ember_generation_tokens_total").unwrap();
    let body = greedy_completion(json!("Once upon a time"), 3000).to_string();
    let addr = server.addr().to_owned();
    let client = std::thread::spawn(move || {
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        std::io::Write::write_all(&mut stream, head.as_bytes()).unwrap();
        std::io::Write::write_all(&mut stream, body.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        // Dropping the stream closes the connection without reading the answer.
    });
    client.join().unwrap();

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = server.metrics();
        let running = metric(&metrics, "ember_requests_running");
        let generated = metric(&metrics, "ember_generation_tokens_total").unwrap() - before;
        if running == Some(0.0) && generated > 0.0 {
            eprintln!("a whole-response request whose client left generated {generated} tokens");
            assert!(
                generated < 3000.0,
                "the abandoned generation ran to its end"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still generating for a client that left ({generated} tokens so far):\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_stops_an_idle_server_cleanly() {
    let mut server = Server::start(QWEN, &[]);
    assert_eq!(server.get("/health").status, 200);
    let start = Instant::now();
    server.sigterm();
    let status = server
        .wait_exit(Duration::from_secs(3))
        .unwrap_or_else(|| panic!("still running 3 s after SIGTERM:\n{}", server.log()));
    assert!(status.success(), "{status:?}\n{}", server.log());
    eprintln!("idle shutdown took {:?}", start.elapsed());
}

#[test]
fn sigterm_during_a_stream_ends_it_with_the_error_and_nothing_after() {
    for (path, body) in [
        (
            "/v1/completions",
            with(
                greedy_completion(json!("Once upon a time"), 4000),
                json!({"stream": true}),
            ),
        ),
        (
            "/v1/chat/completions",
            with(
                greedy_chat("Tell a long story.", 4000),
                json!({"stream": true}),
            ),
        ),
    ] {
        sigterm_during_a_stream(path, &body);
    }
}

/// Stops a server (SIGTERM, `--shutdown-timeout 0`: in-flight requests are cut at once) while
/// it streams `body` to `path`: the stream ends with the error event, with no `finish_reason`
/// chunk or `[DONE]` after it (a client that ignores error events must not take a cut reply
/// for a whole one).
fn sigterm_during_a_stream(path: &str, body: &Value) {
    let mut server = Server::start(LLAMA, &["--context", "4096", "--shutdown-timeout", "0"]);
    let mut stream =
        SseStream::open(server.addr(), path, &[JSON], body.to_string().as_bytes()).unwrap();
    assert_eq!(stream.status, 200);
    for _ in 0..2 {
        assert!(stream.next_data().unwrap().is_some());
    }
    let start = Instant::now();
    server.sigterm();

    let reader = std::thread::spawn(move || {
        let mut data = Vec::new();
        let result = loop {
            match stream.next_data() {
                Ok(Some(d)) => data.push(d),
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        (data, result, start.elapsed())
    });
    let status = server
        .wait_exit(Duration::from_secs(4))
        .unwrap_or_else(|| panic!("still running 4 s after SIGTERM:\n{}", server.log()));
    let exited = start.elapsed();
    assert!(status.success(), "{status:?}\n{}", server.log());
    let (data, result, ended) = reader.join().unwrap();
    let tail: Vec<String> = data
        .iter()
        .rev()
        .take(2)
        .rev()
        .map(|d| d.chars().take(300).collect())
        .collect();
    eprintln!(
        "{path}: shutdown mid-stream: exit after {exited:?}, stream ended after {ended:?} with {:?}, {} more events, last two {tail:?}",
        result.as_ref().err(),
        data.len(),
    );
    assert!(
        ended < Duration::from_secs(4),
        "{path}: the stream outlived the shutdown: {ended:?}"
    );
    let at = data
        .iter()
        .position(|d| d.contains("\"error\""))
        .unwrap_or_else(|| panic!("{path}: the stream was not cut: {tail:?}"));
    assert_eq!(
        at + 1,
        data.len(),
        "{path}: events after the error: {tail:?}"
    );
}

#[test]
fn a_request_without_a_limit_stops_at_the_server_default() {
    let server = Server::start(LLAMA, &["--n-predict", "3"]);
    let body = json!({"prompt": "Once upon a time", "temperature": 0, "ignore_eos": true});
    let response = ok(&server, "/v1/completions", &body);
    assert_eq!(response["usage"]["completion_tokens"], 3, "{response}");
    assert_eq!(response["choices"][0]["finish_reason"], "length");
    // A request's own limit wins, past the default too.
    let response = ok(
        &server,
        "/v1/completions",
        &with(body, json!({"max_tokens": 5})),
    );
    assert_eq!(response["usage"]["completion_tokens"], 5, "{response}");
}

#[test]
fn cors_preflights_are_answered_for_allowed_origins_only() {
    let keys = TempFile::new("keys", "sk-key\n");
    let page = "http://localhost:5173";
    let server = Server::start(
        LLAMA,
        &[
            "--cors-origin",
            page,
            "--api-keys-file",
            keys.path().to_str().unwrap(),
        ],
    );
    let preflight = |origin: &str| {
        server.request(
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization, content-type",
                ),
            ],
            b"",
        )
    };
    // Before authentication: a browser sends no credentials with a preflight.
    let ok = preflight(page);
    assert_eq!(ok.status, 204, "{}", ok.text());
    assert_eq!(ok.header("access-control-allow-origin"), Some(page));
    assert_eq!(
        ok.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    assert!(
        ok.header("access-control-allow-methods")
            .unwrap()
            .contains("POST")
    );
    let refused = preflight("https://elsewhere.example");
    assert_eq!(refused.status, 403, "{}", refused.text());
    assert_error_shape(&refused.json());
    assert!(
        refused.text().contains("--cors-origin"),
        "{}",
        refused.text()
    );
    // The request itself carries the header for an allowed origin, not for others.
    let body = greedy_completion(json!("Hi"), 2).to_string();
    let post = |origin: &str| {
        server.request(
            "POST",
            "/v1/completions",
            &[JSON, ("Origin", origin), ("Authorization", "Bearer sk-key")],
            body.as_bytes(),
        )
    };
    let response = post(page);
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(response.header("access-control-allow-origin"), Some(page));
    let other = post("https://elsewhere.example");
    assert_eq!(other.status, 200);
    assert_eq!(other.header("access-control-allow-origin"), None);
    drop(server);

    // Off by default: preflights are refused, naming the flag; a plain OPTIONS says what is
    // allowed.
    let server = Server::start(LLAMA, &[]);
    let refused = server.request(
        "OPTIONS",
        "/v1/models",
        &[("Origin", page), ("Access-Control-Request-Method", "GET")],
        b"",
    );
    assert_eq!(refused.status, 403, "{}", refused.text());
    let plain = server.request("OPTIONS", "/v1/models", &[], b"");
    assert_eq!(plain.status, 204);
    assert!(plain.header("allow").unwrap().contains("GET"));
}

#[test]
fn a_prompt_of_megabytes_is_refused_before_it_is_tokenized() {
    let server = Server::start(LLAMA, &[]);
    let huge = "lorem ipsum dolor sit amet ".repeat(120_000); // 3.2 MB, under the body limit
    for (path, body) in [
        ("/v1/completions", json!({"prompt": huge, "max_tokens": 4})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 4}),
        ),
    ] {
        let (status, error) = server.post_json(path, &body);
        assert_eq!(status, 400, "{path}: {error}");
        assert_error_shape(&error);
        assert_eq!(error["error"]["code"], "context_length_exceeded", "{error}");
        // The early check's message: counted from the bytes, never tokenized.
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("bytes"), "{path}: {message}");
    }
    assert_eq!(server.get("/health").status, 200);
    // A prompt under the bound but over the context is still refused, after tokenizing.
    let (status, error) = server.post_json(
        "/v1/completions",
        &json!({"prompt": "lorem ipsum ".repeat(600), "max_tokens": 4}),
    );
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["code"], "context_length_exceeded", "{error}");
}

#[test]
fn sampling_defaults_come_from_generation_config_and_the_flags() {
    // A copy of the fixture whose generation_config.json turns sampling off.
    let dir = std::env::temp_dir().join(format!("ember-defaults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(common::fixture(LLAMA)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let config_path = dir.join("generation_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["do_sample"] = json!(false);
    std::fs::write(&config_path, config.to_string()).unwrap();

    let no_sampling_fields = json!({"prompt": "Once upon a time", "max_tokens": 12});
    let greedy = with(no_sampling_fields.clone(), json!({"temperature": 0}));
    let reference = Server::start(LLAMA, &[]);
    let want = ok(&reference, "/v1/completions", &greedy)["choices"][0]["text"].clone();
    drop(reference);

    let server = Server::start(dir.to_str().unwrap(), &[]);
    let got = ok(&server, "/v1/completions", &no_sampling_fields);
    assert_eq!(
        got["choices"][0]["text"], want,
        "generation_config's do_sample: false"
    );
    assert!(
        server.log().contains("generation_config.json"),
        "{}",
        server.log()
    );
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();

    // The flags over the model's defaults; a request's own fields over both.
    let server = Server::start(LLAMA, &["--temp", "0"]);
    let got = ok(&server, "/v1/completions", &no_sampling_fields);
    assert_eq!(got["choices"][0]["text"], want, "--temp 0");
    let sampled = with(no_sampling_fields, json!({"temperature": 1.5, "seed": 3}));
    let a = ok(&server, "/v1/completions", &sampled)["choices"][0]["text"].clone();
    assert_ne!(a, want, "a request's temperature wins over --temp");
}

#[test]
fn a_chat_ending_with_the_assistants_words_continues_them() {
    let server = Server::start(LLAMA, &[]);
    let user = json!({"role": "user", "content": "Tell me a story."});
    let prefill = json!({"role": "assistant", "content": "Once upon a time"});
    let ask = |messages: Value| {
        ok(
            &server,
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 6, "temperature": 0}),
        )
    };
    let new_turn = ask(json!([user]));
    let continued = ask(json!([user, prefill]));
    // The prompt is the chat up to the reply plus the prefill, not a closed turn and a new one.
    let prompt = |r: &Value| r["usage"]["prompt_tokens"].as_u64().unwrap();
    let prefill_tokens = prompt(&continued) - prompt(&new_turn);
    // Exactly the prefill's own tokens: no end-of-turn and new header after it. (A raw
    // prompt's count has Llama's BOS besides.)
    let alone = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 1}),
    );
    assert_eq!(prefill_tokens + 1, prompt(&alone), "{continued}");
    assert_eq!(continued["choices"][0]["finish_reason"], "length");
}

#[test]
fn llama_server_routes_tokenize_detokenize_apply_template_and_props() {
    let server = Server::start(LLAMA, &["--n-predict", "77", "--temp", "0.5"]);
    let text = "Hello world, héllo 🙂";
    let (status, tokens) = server.post_json("/tokenize", &json!({"content": text}));
    assert_eq!(status, 200, "{tokens}");
    let ids = tokens["tokens"].as_array().unwrap().clone();
    assert!(!ids.is_empty(), "{tokens}");
    let (status, back) = server.post_json("/detokenize", &json!({"tokens": ids}));
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["content"], text, "the round trip");
    // With Llama's BOS, and with pieces.
    let (_, special) =
        server.post_json("/tokenize", &json!({"content": text, "add_special": true}));
    assert_eq!(special["tokens"].as_array().unwrap().len(), ids.len() + 1);
    let (_, pieces) = server.post_json(
        "/tokenize",
        &json!({"content": "Hello", "with_pieces": true}),
    );
    let joined: String = pieces["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["piece"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(joined, "Hello", "{pieces}");
    let (status, bad) = server.post_json("/detokenize", &json!({"tokens": [1_000_000]}));
    assert_eq!(status, 400, "{bad}");
    assert_error_shape(&bad);

    // The template's prompt is the one a chat completion runs.
    let messages = json!([{"role": "user", "content": "Tell me a story."}]);
    let (status, applied) = server.post_json("/apply-template", &json!({"messages": messages}));
    assert_eq!(status, 200, "{applied}");
    let prompt = applied["prompt"].as_str().unwrap();
    let (_, prompt_ids) = server.post_json("/tokenize", &json!({"content": prompt}));
    let chat = ok(
        &server,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    );
    assert_eq!(
        chat["usage"]["prompt_tokens"],
        prompt_ids["tokens"].as_array().unwrap().len(),
        "{prompt:?}"
    );

    let props = server.get("/props").json();
    let settings = &props["default_generation_settings"];
    assert_eq!(settings["params"]["n_predict"], 77, "{props}");
    assert_eq!(settings["params"]["temperature"], 0.5, "{props}");
    assert!(settings["n_ctx"].as_u64().unwrap() > 0, "{props}");
    assert!(props["total_slots"].as_u64().unwrap() >= 1, "{props}");
    assert!(props["chat_template"].is_string(), "{props}");
}

#[test]
fn llama_servers_completion_route_answers_in_its_shape() {
    let server = Server::start(LLAMA, &[]);
    let body = json!({"prompt": "Once upon a time", "n_predict": 6, "temperature": 0,
                      "ignore_eos": true, "n_probs": 2});
    let (status, whole) = server.post_json("/completion", &body);
    assert_eq!(status, 200, "{whole}");
    // The same text as the OpenAI route, and llama-server's fields around it.
    let openai = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                "ignore_eos": true}),
    );
    assert_eq!(whole["content"], openai["choices"][0]["text"], "{whole}");
    assert_eq!(whole["stop"], true);
    assert_eq!(whole["stop_type"], "limit");
    assert_eq!(whole["tokens_predicted"], 6);
    assert_eq!(whole["tokens_evaluated"], openai["usage"]["prompt_tokens"]);
    assert_eq!(whole["timings"]["predicted_n"], 6, "{whole}");
    assert_eq!(whole["generation_settings"]["n_predict"], 6, "{whole}");
    let probabilities = whole["completion_probabilities"].as_array().unwrap();
    assert_eq!(probabilities.len(), 6, "{whole}");
    assert_eq!(
        probabilities[0]["top_logprobs"].as_array().unwrap().len(),
        2
    );
    // Greedy: each token is its own best alternative.
    assert_eq!(
        probabilities[0]["id"], probabilities[0]["top_logprobs"][0]["id"],
        "{whole}"
    );

    // Streamed: pieces with stop false, then the summary with stop true, no [DONE].
    let events = server.stream_json("/completion", &with(body, json!({"stream": true})));
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["stop"], true, "{events:?}");
    assert_eq!(last["tokens_predicted"], 6);
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            assert_eq!(v["stop"], false, "{v}");
            v["content"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, whole["content"].as_str().unwrap());

    // Token ids as the prompt, and llama-server's errors in the API's shape.
    let (status, by_ids) = server.post_json(
        "/completion",
        &json!({"prompt": [1, 2, 3], "n_predict": 2, "temperature": 0}),
    );
    assert_eq!(status, 200, "{by_ids}");
    assert_eq!(by_ids["tokens_evaluated"], 3);
    let (status, bad) = server.post_json("/completion", &json!({"prompt": "x", "n_probs": -1}));
    assert_eq!(status, 400, "{bad}");
    assert_error_shape(&bad);
}
