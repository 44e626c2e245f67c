//! Residency on the real server: what it holds (read back from the kernel), the one load line,
//! the idle keepalive's ticks (only while idle, only for `--keep-warm`), shutdown mid-idle, and
//! that holding memory changes no output.

mod common;

use std::time::{Duration, Instant};

use common::{Server, SseStream, metric};
use serde_json::{Value, json};

const QWEN: &str = "qwen3-f32";
const LLAMA: &str = "llama-f32";
const JSON: (&str, &str) = ("Content-Type", "application/json");

/// `VmLck` of a process in bytes: the memory it holds locked.
fn vm_locked(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmLck line");
    kib * 1024
}

fn ticks(server: &Server) -> u64 {
    metric(&server.metrics(), "ember_keepalive_ticks_total").expect("the ticks counter") as u64
}

fn residency(server: &Server) -> Value {
    server.get("/health").json()["residency"].clone()
}

/// Waits until the tick count has not moved for `quiet`, and returns it.
fn ticks_once_settled(server: &Server, quiet: Duration, within: Duration) -> u64 {
    let deadline = Instant::now() + within;
    let mut last = ticks(server);
    loop {
        std::thread::sleep(quiet);
        let now = ticks(server);
        if now == last {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "ticks never stopped:\n{}",
            server.log()
        );
        last = now;
    }
}

fn load_lines(server: &Server) -> Vec<String> {
    server
        .log()
        .lines()
        .filter(|l| l.contains("residency:"))
        .map(str::to_owned)
        .collect()
}

fn greedy_text(server: &Server, prompt: &str) -> String {
    let (status, body) = server.post_json(
        "/v1/completions",
        &json!({"model": "m", "prompt": prompt, "temperature": 0, "max_tokens": 24, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[test]
fn the_held_set_is_locked_memory_and_reported() {
    let server = Server::start(QWEN, &[]);
    let lines = load_lines(&server);
    assert_eq!(lines.len(), 1, "exactly one load line:\n{}", server.log());
    let report = residency(&server);
    let locked = vm_locked(server.pid());
    let metrics = server.metrics();
    match report["state"].as_str().unwrap() {
        "held" => {
            let bytes = report["bytes"].as_u64().unwrap();
            let buffers = report["buffers"].as_u64().unwrap();
            assert!(lines[0].contains("held between requests"), "{}", lines[0]);
            assert!(bytes > 0 && buffers > 0, "{report}");
            // Every held byte lies in a locked page; pages shared or partly used by buffers add
            // at most a page at each end of each buffer.
            assert!(locked >= bytes, "VmLck {locked} < held {bytes}");
            assert!(
                locked <= bytes + buffers * 2 * 4096,
                "VmLck {locked} far above the held {bytes}: something outside the set is locked"
            );
            assert_eq!(
                metric(&metrics, "ember_residency_bytes"),
                Some(bytes as f64)
            );
            assert_eq!(
                metric(&metrics, "ember_residency_buffers"),
                Some(buffers as f64)
            );
            assert_eq!(metric(&metrics, "ember_residency_commits_total"), Some(1.0));
        }
        // Where the OS refuses (no CAP_IPC_LOCK, low RLIMIT_MEMLOCK), the server serves without
        // a set and its one line says why.
        "inactive" => {
            assert!(lines[0].contains("residency: none:"), "{}", lines[0]);
            assert_eq!(locked, 0);
            assert_eq!(
                metric(&metrics, "ember_residency_refusals_total"),
                Some(1.0)
            );
        }
        other => panic!("unexpected state {other}"),
    }
    assert_eq!(metric(&metrics, "ember_residency_staged"), Some(0.0));
}

#[test]
fn no_residency_locks_nothing_and_never_ticks() {
    let server = Server::start_with_env(
        QWEN,
        &["--keepalive-interval-ms", "10"],
        &[("EMBER_NO_RESIDENCY", "1")],
    );
    assert_eq!(vm_locked(server.pid()), 0);
    let report = residency(&server);
    assert_eq!(report["state"], "disabled", "{report}");
    assert_eq!(report["keepalive"]["enabled"], false);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(ticks(&server), 0);
    assert!(!greedy_text(&server, "Hello").is_empty());
}

/// Idle ticks read a byte of every held page (a held set's page-table entries go cold in the
/// CPU's caches otherwise), at least one pass's worth per tick; `--no-keepalive-warm` keeps
/// ticking without it.
#[test]
fn idle_ticks_warm_every_held_page_unless_turned_off() {
    let server = Server::start(QWEN, &["--keepalive-interval-ms", "20"]);
    let report = residency(&server);
    if report["state"] != "held" {
        eprintln!("skipping: no set held here: {report}");
        return;
    }
    assert_eq!(report["keepalive"]["warm"], true, "{report}");
    let held_pages = report["bytes"].as_u64().unwrap() / 4096;
    let deadline = Instant::now() + Duration::from_secs(10);
    while residency(&server)["keepalive"]["warmed_pages"]
        .as_u64()
        .unwrap()
        < held_pages
    {
        assert!(
            Instant::now() < deadline,
            "no full warm pass:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!greedy_text(&server, "Hello").is_empty());

    let server = Server::start(
        QWEN,
        &["--keepalive-interval-ms", "20", "--no-keepalive-warm"],
    );
    std::thread::sleep(Duration::from_millis(200));
    let report = residency(&server);
    assert_eq!(report["keepalive"]["warm"], false, "{report}");
    assert!(ticks(&server) > 0);
    assert_eq!(report["keepalive"]["warmed_pages"], 0);
}

#[test]
fn over_the_bound_the_server_serves_without_a_set_and_says_so_once() {
    let server = Server::start(QWEN, &["--load-limit-gib", "1"]);
    let lines = load_lines(&server);
    assert_eq!(lines.len(), 1, "{}", server.log());
    let line = &lines[0];
    assert!(line.contains("residency: none:"), "{line}");
    assert!(line.contains("1.00 GiB load limit"), "{line}");
    assert!(line.contains("--load-limit-gib"), "names the flag: {line}");
    assert_eq!(residency(&server)["state"], "inactive");
    assert_eq!(vm_locked(server.pid()), 0);
    assert!(!greedy_text(&server, "Hello").is_empty());
}

#[test]
fn required_residency_refuses_to_start_over_the_bound() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "serve",
            "--port",
            "0",
            "--residency",
            "required",
            "--load-limit-gib",
            "1",
        ])
        .arg("--model")
        .arg(common::fixture(QWEN))
        .env_remove("EMBER_NO_RESIDENCY")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("residency: none:"), "{stderr}");
}

#[test]
fn ticks_stop_keep_warm_after_the_last_request_and_resume_after_the_next() {
    let interval_ms = 20;
    let server = Server::start(
        QWEN,
        &[
            "--keep-warm",
            "1",
            "--keepalive-interval-ms",
            &interval_ms.to_string(),
        ],
    );
    let most_per_window = 1000 / interval_ms + 2;
    let after_load =
        ticks_once_settled(&server, Duration::from_millis(300), Duration::from_secs(10));
    assert!(after_load > 0, "no ticks after load:\n{}", server.log());
    assert!(
        after_load <= most_per_window,
        "{after_load} ticks in a 1 s window"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(ticks(&server), after_load, "ticks past --keep-warm");

    greedy_text(&server, "Hello");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        ticks(&server) > after_load,
        "no ticks after the request ended"
    );
    let after_request =
        ticks_once_settled(&server, Duration::from_millis(300), Duration::from_secs(10));
    assert!(after_request - after_load <= most_per_window);
}

#[test]
fn no_tick_runs_during_a_request() {
    let server = Server::start(
        LLAMA,
        &[
            "--keep-warm",
            "60",
            "--keepalive-interval-ms",
            "5",
            "--context",
            "4096",
        ],
    );
    // Ticking now, well inside the keep-warm window.
    let before = ticks(&server);
    std::thread::sleep(Duration::from_millis(100));
    assert!(ticks(&server) > before, "not ticking while idle");

    let body = json!({
        "model": "m", "prompt": "Once upon a time", "temperature": 0,
        "max_tokens": 1500, "ignore_eos": true, "stream": true,
    });
    let mut stream = SseStream::open(
        server.addr(),
        "/v1/completions",
        &[JSON],
        body.to_string().as_bytes(),
    )
    .unwrap();
    let mut during = Vec::new();
    let mut events = 0usize;
    while let Some(data) = stream.next_data().unwrap() {
        if data == "[DONE]" {
            break;
        }
        let event: Value = serde_json::from_str(&data).unwrap();
        if event["choices"][0]["finish_reason"].is_string() {
            // The request is ending: its guard drops right after this event.
            break;
        }
        events += 1;
        if events % 100 == 1 {
            during.push(ticks(&server));
        }
    }
    assert!(during.len() >= 3, "too few samples: {events} events");
    assert!(
        during.windows(2).all(|w| w[0] == w[1]),
        "ticks moved during the request: {during:?}"
    );
    let _ = stream.collect_data();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        ticks(&server) > during[0],
        "ticking did not resume after the request"
    );
}

#[test]
fn sigterm_mid_idle_exits_within_three_seconds() {
    let mut server = Server::start(
        QWEN,
        &["--keep-warm", "600", "--keepalive-interval-ms", "500"],
    );
    let start = Instant::now();
    while ticks(&server) == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never ticked");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Between ticks now: the keepalive thread is waiting out its 500 ms interval.
    std::thread::sleep(Duration::from_millis(150));
    let start = Instant::now();
    server.sigterm();
    let status = server
        .wait_exit(Duration::from_secs(3))
        .unwrap_or_else(|| panic!("still running 3 s after SIGTERM:\n{}", server.log()));
    assert!(status.success(), "{status:?}\n{}", server.log());
    eprintln!("idle shutdown with a keepalive took {:?}", start.elapsed());
}

#[test]
fn greedy_output_is_the_same_with_and_without_residency() {
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
    ];
    let held = Server::start(QWEN, &["--keepalive-interval-ms", "5"]);
    // Let some ticks run between requests.
    std::thread::sleep(Duration::from_millis(50));
    let with: Vec<String> = prompts.iter().map(|p| greedy_text(&held, p)).collect();
    drop(held);
    let plain = Server::start_with_env(QWEN, &[], &[("EMBER_NO_RESIDENCY", "1")]);
    let without: Vec<String> = prompts.iter().map(|p| greedy_text(&plain, p)).collect();
    assert_eq!(with, without);
}
