//! `ember bench quality`: against ember on a fixture model every equality check passes; against
//! a deliberately wrong stub server the checks it breaks fail, and the suite exits non-zero.

mod common;
// In a folder of its own, so cargo does not take it for a test of its own.
#[path = "bench_quality/stub.rs"]
mod stub;

use std::process::{Command, Output};

use common::Server;
use serde_json::Value;

const QWEN: &str = "qwen3-f32";

/// Every check, in the order the suite runs them.
const CHECKS: [&str; 9] = [
    "drafts",
    "concurrent",
    "streaming",
    "multiturn",
    "stop",
    "thinking",
    "copy",
    "max-tokens",
    "soak",
];

/// The checks that hold whatever the model: the server's own equalities.
const EQUALITIES: [&str; 7] = [
    "drafts",
    "concurrent",
    "streaming",
    "multiturn",
    "stop",
    "max-tokens",
    "soak",
];

fn quality(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["bench", "quality", "--timeout-s", "120"])
        .args(args)
        .output()
        .expect("running ember bench quality")
}

/// The report's lines by check name, in order; the exit status must say whether all passed.
fn report(out: &Output) -> Vec<(String, Value)> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<(String, Value)> = String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| {
            let line: Value = serde_json::from_str(l).expect("each stdout line is JSON");
            (
                line["check"].as_str().expect("a check name").to_owned(),
                line,
            )
        })
        .collect();
    let all_ok = lines.iter().all(|(_, l)| l["ok"] == true);
    assert_eq!(
        out.status.code(),
        Some(if all_ok { 0 } else { 1 }),
        "the exit status says whether every check passed: {lines:?}\n{stderr}"
    );
    for (_, line) in &lines {
        let (passed, total) = (line["passed"].as_u64(), line["total"].as_u64());
        assert!(passed <= total && total.is_some(), "{line}");
        // A failure always says what failed first.
        assert_eq!(line["first_failure"].is_string(), passed != total, "{line}");
    }
    lines
}

fn names(lines: &[(String, Value)]) -> Vec<&str> {
    lines.iter().map(|(name, _)| name.as_str()).collect()
}

fn line<'a>(lines: &'a [(String, Value)], check: &str) -> &'a Value {
    &lines.iter().find(|(name, _)| name == check).unwrap().1
}

#[test]
fn ember_keeps_every_equality() {
    // A context past the fixture's 512 trained positions, for the long document and the copy
    // passage (a random model's quality is no concern here). Not waited for: the suite waits
    // for /health itself.
    let server = Server::spawn(QWEN, &["--context", "4096"]);
    let out = quality(&[
        "--api",
        &format!("{}/v1/", server.base_url()),
        "--soak-turns",
        "3",
        "--max-tokens",
        "16",
    ]);
    let lines = report(&out);
    assert_eq!(names(&lines), CHECKS);
    for check in EQUALITIES {
        let line = line(&lines, check);
        assert!(
            line["ok"] == true && line["passed"].as_u64() > Some(0),
            "{line}"
        );
    }
    // Three chats of three turns, and the long stream at least once.
    assert!(line(&lines, "soak")["total"].as_u64() >= Some(10));
    assert!(line(&lines, "concurrent")["total"].as_u64() >= Some(12));
    // copy and thinking depend on the model: reported, whatever they say.
    assert_eq!(line(&lines, "copy")["total"], 1);
    assert_eq!(line(&lines, "thinking")["total"], 2);
}

#[test]
fn a_wrong_server_fails_what_it_breaks() {
    let api = stub::start();
    let out = quality(&["--api", &api, "--soak-turns", "2", "--max-tokens", "8"]);
    let lines = report(&out);
    assert_eq!(names(&lines), CHECKS);
    assert_eq!(out.status.code(), Some(1));
    // Its replies depend on the prompt alone, so these hold.
    for check in ["drafts", "multiturn"] {
        assert_eq!(line(&lines, check)["ok"], true, "{check}");
    }
    // No reasoning, no template at /props, the same reply with thinking on and off.
    assert_eq!(line(&lines, "thinking")["applicable"], false);
    assert_eq!(line(&lines, "thinking")["ok"], true);
    for (check, why) in [
        ("streaming", "streamed"),
        ("concurrent", "crowded"),
        ("soak", "crowded"),
        ("stop", "content differs"),
        ("max-tokens", "completion_tokens 12"),
        ("copy", "departs from the passage"),
    ] {
        let line = line(&lines, check);
        assert_eq!(line["ok"], false, "{line}");
        let first = line["first_failure"].as_str().unwrap();
        assert!(first.contains(why), "{check}: {first}");
    }
    // Every comparison of these fails, not just one.
    for check in ["streaming", "max-tokens", "stop"] {
        assert_eq!(line(&lines, check)["passed"], 0, "{check}");
    }

    // A subset that holds exits 0 and reports only itself.
    let out = quality(&["--api", &api, "--checks", "drafts,multiturn"]);
    let lines = report(&out);
    assert_eq!(names(&lines), ["drafts", "multiturn"]);
    assert!(out.status.success());
}

#[test]
fn bad_settings_and_an_unreachable_server_are_refused() {
    for (args, message) in [
        (
            &["--api", "http://127.0.0.1:9", "--checks", "speed"][..],
            "soak",
        ),
        (
            &["--api", "http://127.0.0.1:9", "--max-tokens", "0"][..],
            "--max-tokens",
        ),
        (
            &["--api", "http://127.0.0.1:9", "--soak-turns", "0"][..],
            "--soak-turns",
        ),
        (&["--api", "https://example.com"][..], "https"),
        (&["--api", "http://127.0.0.1:9"][..], "127.0.0.1:9"),
    ] {
        let out = quality(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(out.stdout.is_empty(), "{args:?}: no check ran");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}
