//! `ember bench serve` against ember's own server: one JSON line per setting (a concurrency
//! sweep, a Poisson rate), every reply as long as asked, the server's prompt counts, ordered
//! percentiles; bad settings and an unreachable server are refused with a message.

mod common;

use std::process::{Command, Output};

use common::Server;
use serde_json::Value;

const QWEN: &str = "qwen3-f32";

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["bench", "serve"])
        .args(args)
        .output()
        .expect("running ember bench serve")
}

fn lines(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "bench serve failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each stdout line is JSON"))
        .collect()
}

fn check_setting(line: &Value, requests: u64, max_tokens: u64) {
    assert_eq!(line["requests"], requests, "{line}");
    // ignore_eos: every reply is exactly max_tokens long, by the server's own count.
    assert_eq!(line["output_tokens"], requests * max_tokens, "{line}");
    assert!(
        line["mean_prompt_tokens"].as_f64().unwrap() > 10.0,
        "{line}"
    );
    for name in ["ttft", "itl", "latency"] {
        let p = |q: u32| {
            line[format!("{name}_p{q}_s")]
                .as_f64()
                .expect("a percentile")
        };
        assert!(
            0.0 <= p(50) && p(50) <= p(90) && p(90) <= p(99),
            "{name}: {line}"
        );
    }
    assert!(line["ttft_p50_s"].as_f64().unwrap() > 0.0, "{line}");
    let per_s = line["output_tokens_per_s"].as_f64().unwrap();
    let duration = line["duration_s"].as_f64().unwrap();
    assert!(
        (per_s * duration - (requests * max_tokens) as f64).abs() < 1.0,
        "{line}"
    );
}

#[test]
fn sweeps_concurrency_and_rate_against_a_server() {
    // Not waited for: the bench waits for /health itself (503 while the model loads).
    let server = Server::spawn(QWEN, &[]);
    let api = server.base_url();
    let out = bench(&[
        "--api",
        &api,
        "--concurrency",
        "1,3",
        "--requests",
        "5",
        "--prompt-words",
        "12",
        "--max-tokens",
        "4",
    ]);
    let settings = lines(&out);
    assert_eq!(settings.len(), 2);
    assert_eq!(settings[0]["concurrency"], 1);
    assert_eq!(settings[1]["concurrency"], 3);
    for line in &settings {
        check_setting(line, 5, 4);
    }

    let out = bench(&[
        "--api",
        &format!("{api}/v1"),
        "--rate",
        "50",
        "--requests",
        "4",
        "--prompt-words",
        "8",
        "--prompt-words-max",
        "30",
        "--max-tokens",
        "3",
    ]);
    let settings = lines(&out);
    assert_eq!(settings.len(), 1);
    assert_eq!(settings[0]["rate"], 50.0);
    check_setting(&settings[0], 4, 3);
}

#[test]
fn bad_settings_and_an_unreachable_server_are_refused() {
    for (args, message) in [
        (
            &["--api", "http://127.0.0.1:9", "--concurrency", "0"][..],
            "--concurrency",
        ),
        (&["--api", "http://127.0.0.1:9", "--rate=0"][..], "--rate"),
        (
            &["--api", "http://127.0.0.1:9", "--max-tokens", "0"][..],
            "--max-tokens",
        ),
        (
            &[
                "--api",
                "http://127.0.0.1:9",
                "--prompt-words",
                "9",
                "--prompt-words-max",
                "3",
            ][..],
            "--prompt-words-max",
        ),
        (&["--api", "https://example.com"][..], "https"),
        (&["--api", "http://127.0.0.1:9"][..], "127.0.0.1:9"),
    ] {
        let out = bench(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}
