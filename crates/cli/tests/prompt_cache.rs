//! The prompt cache through the real server: a chat's next turn reuses the previous turn's
//! prompt and reply (`usage.prompt_tokens_details.cached_tokens`), gives the same text as a
//! server without a cache, honours `"cache_prompt": false`, and shows in `/metrics` and
//! `/health`; a budget that does not fit the residency bound is named in the load line.

mod common;

use common::{Server, metric};
use serde_json::{Value, json};

const QWEN: &str = "qwen3-f32";

fn chat(messages: &Value, extra: Value) -> Value {
    let mut body = json!({
        "model": "any",
        "messages": messages,
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": true,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn post(server: &Server, body: &Value) -> Value {
    let (status, response) = server.post_json("/v1/chat/completions", body);
    assert_eq!(status, 200, "{response}");
    response
}

fn cached(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {response}"))
}

fn content(response: &Value) -> String {
    response["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn a_chats_next_turn_comes_from_the_cache_with_the_same_text() {
    let warm = Server::start(QWEN, &["--prompt-cache-gib", "0.05"]);
    let cold = Server::start(QWEN, &["--prompt-cache-gib", "0"]);
    let health = warm.get("/health").json();
    assert_eq!(health["prompt_cache"]["enabled"], true, "{health}");
    assert!(health["prompt_cache"]["budget_bytes"].as_u64().unwrap() > 0);
    let off = cold.get("/health").json();
    assert_eq!(off["prompt_cache"]["enabled"], false, "{off}");

    let mut messages = json!([
        {"role": "system", "content": "You are a careful assistant who answers at length."},
        {"role": "user", "content": "Tell me about foxes, their dens and what they eat."},
    ]);
    let first = post(&warm, &chat(&messages, json!({})));
    assert_eq!(cached(&first), 0, "nothing cached yet: {first}");
    let first_text = content(&first);
    assert_eq!(
        first_text,
        content(&post(&cold, &chat(&messages, json!({}))))
    );

    messages
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": first_text}));
    messages
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "And their cubs?"}));
    let second = post(&warm, &chat(&messages, json!({})));
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // The first turn's prompt at least (its reply too, as far as the template repeats it), in
    // whole blocks of 16.
    assert!(
        cached(&second) >= first_prompt / 16 * 16 && cached(&second) < prompt_tokens,
        "{second}"
    );
    let cold_second = post(&cold, &chat(&messages, json!({})));
    assert_eq!(cached(&cold_second), 0);
    assert_eq!(
        content(&second),
        content(&cold_second),
        "resumed against cold"
    );

    // Opting out: nothing read, the same text.
    let opted_out = post(&warm, &chat(&messages, json!({"cache_prompt": false})));
    assert_eq!(cached(&opted_out), 0, "{opted_out}");
    assert_eq!(content(&opted_out), content(&second));

    let metrics = warm.metrics();
    let get = |series: &str| metric(&metrics, series).unwrap_or_else(|| panic!("{series}"));
    assert_eq!(get("ember_prompt_cache_hits_total"), 1.0, "{metrics}");
    assert_eq!(get("ember_prompt_cache_misses_total"), 1.0);
    assert_eq!(
        get("ember_prompt_cache_hit_tokens_total"),
        cached(&second) as f64
    );
    assert!(get("ember_prompt_cache_blocks") > 0.0);
    assert_eq!(
        get("ember_prompt_cache_bytes"),
        warm.get("/health").json()["prompt_cache"]["bytes"]
            .as_f64()
            .unwrap()
    );
    for series in [
        "ember_prompt_cache_evictions_total",
        "ember_prompt_cache_host_bytes",
        "ember_prompt_cache_host_evictions_total",
    ] {
        assert!(metric(&metrics, series).is_some(), "{series} missing");
    }
}

/// A cache that passes the residency bound: the one load line names the flags to lower.
#[test]
fn a_cache_over_the_bound_is_named_in_the_load_line() {
    let server = Server::start(
        QWEN,
        &["--prompt-cache-gib", "0.5", "--load-limit-gib", "2.2"],
    );
    let log = server.log();
    let line = log
        .lines()
        .find(|l| l.contains("residency: none"))
        .unwrap_or_else(|| panic!("no refusal line:\n{log}"));
    assert!(line.contains("--prompt-cache-gib"), "{line}");
    // serve runs 4 sequences on the CPU, each holding a context of the pool: that flag too.
    assert!(line.contains("--parallel"), "{line}");
    // It still serves, without the set.
    let response = post(
        &server,
        &chat(&json!([{"role": "user", "content": "hi"}]), json!({})),
    );
    assert_eq!(cached(&response), 0);
}
