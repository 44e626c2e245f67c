//! Many requests at once each get the reply the same request gets alone, to the byte: streamed
//! and not, greedy and seeded sampling, prompts that share prefixes (so the requests take each
//! other's blocks from a small prompt cache, and evict them, in whatever order they run), while
//! a client leaves mid-stream and malformed, mistyped and oversized requests arrive among them;
//! and again in a KV pool too small for all at once (requests wait and are preempted). The server batches them (`--parallel`, 4 on the CPU by
//! default): decode tokens and prompt chunks of several requests share each forward pass, and
//! this holds every reply to the bits it has alone.

mod common;

use std::sync::{Arc, Barrier};

use common::{Server, SseStream, metric};
use serde_json::{Value, json};

const QWEN: &str = "qwen3-f32";
const JSON: (&str, &str) = ("Content-Type", "application/json");
const REQUESTS: usize = 24;

/// Words from a seed: distinct text per seed, the same on every run.
fn words(seed: u64, n: usize) -> String {
    const WORDS: &[&str] = &[
        "river", "stone", "light", "cloud", "maple", "north", "quiet", "amber", "field", "glass",
        "ember", "orbit", "delta", "frost", "cedar", "coral",
    ];
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            WORDS[(state % WORDS.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Request `i`: a third start with one shared history, a third with another, each with its own
/// tail; replies of 3 to 11 tokens; every fourth samples (temperature 0.8, top_p 0.9, its own
/// seed); even ones stream.
fn body(i: usize) -> Value {
    let shared = match i % 3 {
        0 => String::new(),
        1 => words(1001, 60),
        _ => words(1002, 45),
    };
    let prompt = format!("{shared} request {i}: {}", words(i as u64, 5 + i % 7));
    let mut body = json!({
        "model": "any",
        "prompt": prompt,
        "max_tokens": 3 + i % 9,
        "ignore_eos": true,
        "temperature": 0,
        "stream": i.is_multiple_of(2),
    });
    if i % 4 == 3 {
        body["temperature"] = json!(0.8);
        body["top_p"] = json!(0.9);
        body["seed"] = json!(7 + i);
    }
    body
}

/// The reply's text and completion tokens, from a stream's chunks or a whole response.
fn reply(addr: &str, body: &Value) -> (String, u64) {
    let bytes = body.to_string();
    let mut stream = SseStream::open(addr, "/v1/completions", &[JSON], bytes.as_bytes())
        .unwrap_or_else(|e| panic!("POST /v1/completions: {e}"));
    assert_eq!(stream.status, 200, "{body}");
    if body["stream"] == true {
        let mut text = String::new();
        let mut tokens = 0;
        for data in stream.collect_data().expect("reading the stream") {
            if data == "[DONE]" {
                continue;
            }
            let event: Value = serde_json::from_str(&data).unwrap();
            assert!(event.get("error").is_none(), "{event}");
            if let Some(t) = event["choices"][0]["text"].as_str() {
                text.push_str(t);
                tokens += 1;
            }
        }
        (text, tokens)
    } else {
        let response: Value = serde_json::from_slice(&stream.read_body().unwrap()).unwrap();
        (
            response["choices"][0]["text"].as_str().unwrap().to_owned(),
            response["usage"]["completion_tokens"].as_u64().unwrap(),
        )
    }
}

/// Bad requests sent among the others: malformed JSON, a wrong type, a prompt past the
/// context. Each gets a 400 naming its problem; the others' replies must not notice.
const BAD: [(&str, &str); 3] = [
    ("{\"prompt\": \"cut off", "JSON"),
    (
        "{\"prompt\": \"hi\", \"max_tokens\": \"many\"}",
        "max_tokens",
    ),
    ("", "context"),
];

/// Every request at once, with a client that leaves after its first chunk and the bad
/// requests, on `server`.
fn together(server: &Server) -> Vec<(String, u64)> {
    let addr = server.addr().to_owned();
    let barrier = Arc::new(Barrier::new(REQUESTS + 1 + BAD.len()));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let (addr, barrier) = (&addr, Arc::clone(&barrier));
                s.spawn(move || {
                    barrier.wait();
                    reply(addr, &body(i))
                })
            })
            .collect();
        // A client that leaves after its first chunk, among the others.
        let (leaver_addr, leaver_barrier) = (&addr, Arc::clone(&barrier));
        s.spawn(move || {
            let mut long = body(REQUESTS);
            long["max_tokens"] = json!(200);
            long["stream"] = json!(true);
            let bytes = long.to_string();
            leaver_barrier.wait();
            let mut stream =
                SseStream::open(leaver_addr, "/v1/completions", &[JSON], bytes.as_bytes()).unwrap();
            assert_eq!(stream.status, 200);
            assert!(stream.next_data().unwrap().is_some());
        });
        for (body, names) in BAD {
            let (addr, barrier) = (&addr, Arc::clone(&barrier));
            s.spawn(move || {
                // The one past the context: 2,000 words for a context of 512.
                let long = json!({"prompt": words(9, 2000), "max_tokens": 4}).to_string();
                let body = if body.is_empty() { long.as_str() } else { body };
                barrier.wait();
                let response =
                    common::request(addr, "POST", "/v1/completions", &[JSON], body.as_bytes())
                        .unwrap();
                let text = String::from_utf8_lossy(&response.body);
                assert_eq!(response.status, 400, "{text}");
                assert!(text.contains(names), "{names}: {text}");
            });
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn concurrent_requests_get_the_replies_they_get_alone() {
    // Together, with the prompt cache (the harness's 64 MiB: it fills and evicts).
    let server = Server::start(QWEN, &["--max-queue", "64"]);
    let together_cached = together(&server);
    // The shared histories came from the cache for some of the requests.
    let metrics = server.metrics();
    let hits = metric(&metrics, "ember_prompt_cache_hits_total").unwrap_or(0.0);
    assert!(hits > 0.0, "no prompt cache hit:\n{metrics}");
    // The batched loop's figures: its passes' tokens (some passes took several requests'),
    // its sequences as of the last step, and preemptions (the pool holds a context each).
    let passes = metric(&metrics, "ember_batch_tokens_count").unwrap_or(0.0);
    let single = metric(&metrics, "ember_batch_tokens_bucket{le=\"1\"}").unwrap_or(0.0);
    assert!(passes > single, "no pass of several tokens:\n{metrics}");
    assert_eq!(
        metric(&metrics, "ember_preemptions_total"),
        Some(0.0),
        "{metrics}"
    );
    assert!(
        metric(&metrics, "ember_sequences_waiting").is_some(),
        "{metrics}"
    );
    let health = server.get("/health").json();
    assert_eq!(health["sequences"]["preemptions_total"], 0, "{health}");
    assert!(health["sequences"]["running"].is_i64(), "{health}");
    drop(server);

    // Together in a pool of one context for all four running (no cache): requests wait for
    // blocks, and the last started is preempted when the others need its blocks.
    let server = Server::start(
        QWEN,
        &[
            "--max-queue",
            "64",
            "--prompt-cache-gib",
            "0",
            "--kv-pool-tokens",
            "512",
        ],
    );
    let together_pooled = together(&server);
    let preemptions = metric(&server.metrics(), "ember_preemptions_total");
    println!("a pool of 512 positions for four: {preemptions:?} preemptions");
    drop(server);

    // Alone, one after another, on a server without a prompt cache.
    let alone_server = Server::start(QWEN, &["--prompt-cache-gib", "0"]);
    for (i, (cached, pooled)) in together_cached.iter().zip(&together_pooled).enumerate() {
        let body = body(i);
        let want = reply(alone_server.addr(), &body);
        assert_eq!(cached, &want, "request {i} ({body}): together vs alone");
        assert_eq!(
            pooled, &want,
            "request {i} ({body}): in a small pool vs alone"
        );
        if body["stream"] == false {
            assert_eq!(cached.1, body["max_tokens"].as_u64().unwrap(), "{body}");
        }
    }
}
