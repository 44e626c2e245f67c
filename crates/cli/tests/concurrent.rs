//! Many requests at once each get the reply the same request gets alone, to the byte: streamed
//! and not, greedy and seeded sampling, prompts that share prefixes (so the requests take each
//! other's blocks from a small prompt cache, and evict them, in whatever order they run), while
//! a client leaves mid-stream. The server batches them (`--parallel`, 4 on the CPU by
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

#[test]
fn concurrent_requests_get_the_replies_they_get_alone() {
    // Together, with the prompt cache (the harness's 64 MiB: it fills and evicts).
    let server = Server::start(QWEN, &["--max-queue", "64"]);
    let addr = server.addr().to_owned();
    let barrier = Arc::new(Barrier::new(REQUESTS + 1));
    let together: Vec<(String, u64)> = std::thread::scope(|s| {
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
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The shared histories came from the cache for some of the requests.
    let metrics = server.metrics();
    let hits = metric(&metrics, "ember_prompt_cache_hits_total").unwrap_or(0.0);
    assert!(hits > 0.0, "no prompt cache hit:\n{metrics}");
    drop(server);

    // Alone, one after another, on a server without a prompt cache.
    let alone_server = Server::start(QWEN, &["--prompt-cache-gib", "0"]);
    for (i, got) in together.iter().enumerate() {
        let body = body(i);
        let want = reply(alone_server.addr(), &body);
        assert_eq!(got, &want, "request {i} ({body}): together vs alone");
        if body["stream"] == false {
            assert_eq!(got.1, body["max_tokens"].as_u64().unwrap(), "{body}");
        }
    }
}
