//! `ember serve --tensor-parallel 2`: the model split across two ranks (threads on the CPU,
//! each holding its share of the heads, MLP columns and vocabulary). Its greedy replies are the
//! whole model's, many requests at once; and a rank that fails mid-generation fails the
//! requests it was serving with a message naming it, then the server stops, exit status
//! non-zero, instead of hanging or serving from a group whose ranks left their lock-step.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{Server, ember_run_args, fixture, request};
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

/// Every request at once from its own thread; each reply's status and body, or `None` where
/// the connection was refused or cut (a server that has stopped).
fn all_at_once(server: &Server, bodies: &[Value]) -> Vec<Option<(u16, Value)>> {
    let addr = server.addr();
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                s.spawn(move || {
                    let json = [("Content-Type", "application/json")];
                    let body = b.to_string();
                    let r = request(addr, "POST", "/v1/completions", &json, body.as_bytes());
                    r.ok().map(|r| (r.status, r.json()))
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
    let got = all_at_once(&split, &bodies)
        .into_iter()
        .map(|r| r.expect("a reply"));
    for (i, (got, want)) in got.zip(&want).enumerate() {
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
    // Those the engine took fail with the rank's reason; one that comes after the engine
    // stopped is turned away saying so, or finds the server gone.
    let mut named = 0;
    for (status, reply) in all_at_once(&server, &bodies).into_iter().flatten() {
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert_ne!(status, 200, "{reply}");
        if message.contains("rank 1: a fault injected for a test") {
            named += 1;
        } else {
            assert!(
                message.contains("the engine has stopped"),
                "{status}: {reply}"
            );
        }
    }
    assert!(named > 0, "no reply named the failed rank");
    let exit = server.wait_exit(Duration::from_secs(30));
    let status = exit.unwrap_or_else(|| panic!("the server did not stop:\n{}", server.log()));
    assert!(!status.success(), "exit status {status}");
    let log = server.log();
    assert!(
        log.contains("the engine stopped") && log.contains("must be restarted"),
        "{log}"
    );
}

/// `ember run` split by experts gives the whole model's text; splits that cannot run are
/// refused at load with the reason.
#[test]
fn splits_run_or_say_why_not() {
    let args = [
        "--prompt",
        "hello",
        "-n",
        "12",
        "--ignore-eos",
        "--device",
        "cpu",
    ];
    let whole = ember_run_args("qwen3moe-f32", &args);
    let split = [&args[..], &["--tensor-parallel", "2", "--expert-parallel"]].concat();
    assert_eq!(ember_run_args("qwen3moe-f32", &split), whole);
    for (model, extra, why) in [
        (
            "qwen2-f32",
            &["--tensor-parallel", "3"][..],
            "2 key-value heads across 3 ranks",
        ),
        (
            "qwen2-f32",
            &["--tensor-parallel", "4"],
            "6 attention heads across 4 ranks",
        ),
        (
            "qwen3-f32",
            &["--tensor-parallel", "2", "--expert-parallel"],
            "the model has no experts",
        ),
        ("qwen3moe-f32", &["--expert-parallel"], "it needs N > 1"),
        (
            "qwen3-f32",
            &["--tensor-parallel", "2", "--fail-rank", "2:1"],
            "rank 2",
        ),
        (
            "qwen3-f32",
            &["--tensor-parallel", "2", "--collectives", "gloo"],
            "expected nccl or host",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(["run", "--model"])
            .arg(fixture(model))
            .args(["--prompt", "hello", "-n", "4"])
            .args(extra)
            .args(
                ["--device", "cpu"]
                    .iter()
                    .filter(|_| !extra.contains(&"--device")),
            )
            .env("EMBER_LOG", "warn")
            .output()
            .expect("running ember run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{model} {extra:?}: ran");
        assert!(stderr.contains(why), "{model} {extra:?}: {stderr}");
    }
}
