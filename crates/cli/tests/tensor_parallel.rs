//! `ember serve --tensor-parallel 2`: the model split across two ranks (threads on the CPU,
//! each holding its share of the heads, MLP columns and vocabulary). Its greedy replies are the
//! whole model's, many requests at once; and a rank that fails mid-generation fails the
//! requests it was serving with a message naming it, then the server stops, exit status
//! non-zero, instead of hanging or serving from a group whose ranks left their lock-step.

mod common;

use std::time::Duration;

use common::{Server, request};
use serde_json::{Value, json};

const QWEN: &str = "qwen3-f32";

fn body(i: usize) -> Value {
    json!({
        "model": "any",
        "prompt": format!("request {i}: the river runs past the {} stones", 3 + i),
        "max_tokens": 12 + i % 5,
        "ignore_eos": true,
        "temperature": 0,
    })
}

/// Every request at once from its own thread; each reply's status and body.
fn all_at_once(server: &Server, bodies: &[Value]) -> Vec<(u16, Value)> {
    let addr = server.addr();
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                s.spawn(move || {
                    let json = [("Content-Type", "application/json")];
                    let body = b.to_string();
                    let r = request(addr, "POST", "/v1/completions", &json, body.as_bytes())
                        .expect("a reply");
                    (r.status, r.json())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_split_server_gives_the_whole_models_greedy_replies() {
    let whole = Server::start(QWEN, &["--device", "cpu"]);
    let split = Server::start(QWEN, &["--device", "cpu", "--tensor-parallel", "2"]);
    assert!(
        split.log().contains("x 2 ranks (tensor parallel)"),
        "{}",
        split.log()
    );
    let bodies: Vec<Value> = (0..8).map(body).collect();
    let want: Vec<(u16, Value)> = bodies
        .iter()
        .map(|b| whole.post_json("/v1/completions", b))
        .collect();
    for (i, (got, want)) in all_at_once(&split, &bodies).iter().zip(&want).enumerate() {
        assert_eq!((got.0, want.0), (200, 200), "request {i}: {}", got.1);
        assert_eq!(
            got.1["choices"][0]["text"], want.1["choices"][0]["text"],
            "request {i}"
        );
    }
}

#[test]
fn a_lost_rank_fails_its_requests_and_stops_the_server() {
    let mut server = Server::start(
        QWEN,
        &[
            "--device",
            "cpu",
            "--tensor-parallel",
            "2",
            "--fail-rank",
            "1:20",
        ],
    );
    // Three requests decoding together when rank 1's twentieth pass fails.
    let bodies: Vec<Value> = (0..3)
        .map(|i| json!({"prompt": format!("hello {i}"), "max_tokens": 40, "ignore_eos": true}))
        .collect();
    for (status, reply) in all_at_once(&server, &bodies) {
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert_ne!(status, 200, "{reply}");
        assert!(
            message.contains("rank 1") && message.contains("a fault injected for a test"),
            "{status}: {reply}"
        );
    }
    let exit = server.wait_exit(Duration::from_secs(30));
    let status = exit.unwrap_or_else(|| panic!("the server did not stop:\n{}", server.log()));
    assert!(!status.success(), "exit status {status}");
    let log = server.log();
    assert!(
        log.contains("the engine stopped") && log.contains("must be restarted"),
        "{log}"
    );
}
