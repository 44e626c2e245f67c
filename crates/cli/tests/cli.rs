//! The `ember` binary as a user runs it.

use std::path::PathBuf;
use std::process::{Command, Output};

use ember_engine::tokenizer::Tokenizer;
use serde_json::Value;

fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .env("EMBER_LOG", "warn")
        .output()
        .expect("running ember")
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/golden")
        .join(name)
}

#[test]
fn run_prints_exactly_the_generated_text_on_stdout() {
    let dir = fixture("qwen3-f32");
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let case = &expected["completions"][0];
    let ids: Vec<u32> = case["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want = Tokenizer::from_dir(&dir).unwrap().decode(&ids, true);

    let n = ids.len().to_string();
    let prompt = case["prompt"].as_str().unwrap();
    let out = ember(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        prompt,
        "-n",
        &n,
        "--ignore-eos",
        "--threads",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tok/s") && stderr.contains("finish: length"),
        "timings go to stderr: {stderr}"
    );
}

#[test]
fn same_seed_gives_the_same_sampled_text() {
    let dir = fixture("llama-f32");
    let run = |seed: &str| {
        let args = [
            "run",
            "-m",
            dir.to_str().unwrap(),
            "-p",
            "Once upon",
            "-n",
            "16",
            "--temperature",
            "1.2",
            "--top-k",
            "50",
        ];
        let out = ember(
            &[
                &args[..],
                &[
                    "--top-p",
                    "0.95",
                    "--min-p",
                    "0.02",
                    "--seed",
                    seed,
                    "--ignore-eos",
                ],
            ]
            .concat(),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(
        run("7"),
        run("8"),
        "different seeds should (almost surely) differ over 16 sampled tokens"
    );
}

/// `ember run` drafts as `serve` does (`--draft`, `--draft-model`), the text the same as
/// undrafted; the summary line counts the drafts kept.
#[test]
fn run_drafts_with_the_same_text() {
    let dir = fixture("qwen3-f32");
    let model = dir.to_str().unwrap();
    let run = |draft: &[&str]| {
        let args = [
            "run",
            "-m",
            model,
            "-p",
            "one two three one two three one two",
        ];
        let rest = ["-n", "24", "--ignore-eos", "--threads", "2"];
        let out = ember(&[&args[..], &rest[..], draft].concat());
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        (out.stdout, stderr)
    };
    let (plain, plain_err) = run(&["--draft", "none"]);
    assert!(!plain_err.contains("drafts:"), "{plain_err}");
    let (ngram, _) = run(&["--draft", "ngram"]);
    assert_eq!(ngram, plain);
    // The model drafting for itself: every draft kept.
    let (drafted, stderr) = run(&["--draft-model", model]);
    assert_eq!(drafted, plain);
    let kept = stderr
        .split("drafts: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no drafts counted: {stderr}"));
    let words: Vec<&str> = kept.split_whitespace().collect();
    assert_eq!(words[0], words[2], "all kept: {stderr}");
    let bad = ember(&[
        "run",
        "-m",
        model,
        "-p",
        "hi",
        "--draft-min",
        "5",
        "--draft-max",
        "2",
    ]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--draft-min 5 is more than --draft-max 2")
    );
}

#[test]
fn chat_renders_the_template() {
    let dir = fixture("qwen3-f32");
    let out = ember(&[
        "run",
        "-m",
        dir.to_str().unwrap(),
        "-p",
        "What is 2+2?",
        "--chat",
        "--no-think",
        "-n",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn errors_are_one_clear_line_and_a_failure_status() {
    let out = ember(&["run", "--model", "/nonexistent/model", "--prompt", "hi"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent/model") && stderr.starts_with("error:"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());

    let out = ember(&[
        "run",
        "-m",
        fixture("qwen3-f32").to_str().unwrap(),
        "-p",
        "hi",
        "--temperature",
        "-1",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("temperature"));

    let out = ember(&["gen-checkpoint", "--shape", "qwen9-1t", "--out", "/tmp/x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("qwen3-0.6b"));
}

#[test]
fn help_lists_every_command_and_flag() {
    let top = String::from_utf8(ember(&["--help"]).stdout).unwrap();
    for word in ["run", "bench", "gen-checkpoint"] {
        assert!(top.contains(word), "ember --help lacks {word}");
    }
    let run = String::from_utf8(ember(&["run", "--help"]).stdout).unwrap();
    for flag in [
        "--model",
        "--prompt",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--min-p",
        "--seed",
        "--chat",
        "--ignore-eos",
        "--threads",
        "--context",
        "--draft",
        "--draft-model",
    ] {
        assert!(run.contains(flag), "ember run --help lacks {flag}");
    }
    let bench = String::from_utf8(ember(&["bench", "decode", "--help"]).stdout).unwrap();
    for flag in ["--model", "--json", "--repeats", "--threads"] {
        assert!(
            bench.contains(flag),
            "ember bench decode --help lacks {flag}"
        );
    }
    let gen_help = String::from_utf8(ember(&["gen-checkpoint", "--help"]).stdout).unwrap();
    for flag in ["--shape", "--dtype", "--out"] {
        assert!(
            gen_help.contains(flag),
            "ember gen-checkpoint --help lacks {flag}"
        );
    }
}

/// Without a GPU (CI, this machine) `--device cuda` is one clear error naming what is missing,
/// and `auto` falls back to the CPU; with one, both run on it.
#[test]
fn device_cuda_without_cuda_is_a_clear_error_and_auto_falls_back() {
    let model = fixture("qwen3-f32");
    let model = model.to_str().unwrap();
    let cuda = ember(&[
        "run", "-m", model, "-p", "hi", "-n", "2", "--device", "cuda",
    ]);
    let stderr = String::from_utf8_lossy(&cuda.stderr);
    if cuda.status.success() {
        eprintln!("a CUDA device is present: nothing to check here");
        return;
    }
    assert!(stderr.starts_with("error:"), "{stderr}");
    assert!(
        stderr.contains("CUDA unavailable") || stderr.contains("no CUDA device"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let auto = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "run", "-m", model, "-p", "hi", "-n", "2", "--device", "auto",
        ])
        .env("EMBER_LOG", "info")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(auto.status.success());
    let log = String::from_utf8_lossy(&auto.stderr);
    assert!(log.contains("device: cpu (CUDA unavailable"), "{log}");

    let bad = ember(&["run", "-m", model, "-p", "hi", "--device", "tpu"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("cuda:N"));
}
