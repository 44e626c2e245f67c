//! `ember bench quality`: the equalities a trustworthy OpenAI-compatible server keeps (ember,
//! llama-server, ...): a reply is the same with speculative decoding or without, alone or among
//! other requests, streamed or not, resumed from the prompt cache or not; stop strings cut
//! exactly, `max_tokens` is exact, reasoning lands in its own field. One JSON line per check:
//! its name, how many comparisons passed of how many, and the first mismatch. Exit status 1
//! when any check fails, for CI.

mod client;
mod limits;
mod model;
mod prompts;
mod sameness;
mod soak;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use serde_json::json;

use crate::http_client::{self, BaseUrl};
use client::Client;

/// Longest wait for a server that is still loading its model.
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(clap::Args, Debug)]
pub struct BenchQualityArgs {
    /// The server: http://host:port (an OpenAI base URL ending in /v1 works too).
    #[arg(long)]
    pub api: String,
    /// Bearer key for servers that require one.
    #[arg(long, env = "EMBER_API_KEY")]
    pub api_key: Option<String>,
    /// Model name sent with each request [default: the first of /v1/models].
    #[arg(long)]
    pub model: Option<String>,
    /// Checks to run, comma-separated: drafts, concurrent, streaming, multiturn, stop,
    /// thinking, copy, max-tokens, soak [default: all].
    #[arg(long, value_delimiter = ',', value_parser = check_name)]
    pub checks: Vec<&'static str>,
    /// Longest reply of the generation checks (`copy` and `max-tokens` set their own).
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    /// Turns of each `soak` chat.
    #[arg(long, default_value_t = 20)]
    pub soak_turns: usize,
    /// Longest wait for one reply, in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
}

/// What every check is given.
pub struct Suite {
    client: Client,
    max_tokens: usize,
    soak_turns: usize,
}

/// A check: its name on the command line and in the report, and what runs it.
struct Check {
    name: &'static str,
    run: fn(&Suite) -> Tally,
}

/// Every check, in the order they run.
const CHECKS: &[Check] = &[
    Check {
        name: "drafts",
        run: sameness::drafts,
    },
    Check {
        name: "concurrent",
        run: sameness::concurrent,
    },
    Check {
        name: "streaming",
        run: sameness::streaming,
    },
    Check {
        name: "multiturn",
        run: sameness::multiturn,
    },
    Check {
        name: "stop",
        run: limits::stop,
    },
    Check {
        name: "thinking",
        run: model::thinking,
    },
    Check {
        name: "copy",
        run: model::copy,
    },
    Check {
        name: "max-tokens",
        run: limits::max_tokens,
    },
    Check {
        name: "soak",
        run: soak::soak,
    },
];

fn check_name(name: &str) -> Result<&'static str, String> {
    CHECKS
        .iter()
        .map(|c| c.name)
        .find(|&n| n == name)
        .ok_or_else(|| {
            let names: Vec<&str> = CHECKS.iter().map(|c| c.name).collect();
            format!("no check named {name:?}; the checks: {}", names.join(", "))
        })
}

pub fn run(args: BenchQualityArgs) -> anyhow::Result<ExitCode> {
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if args.soak_turns == 0 {
        bail!("--soak-turns must be at least 1");
    }
    if args.timeout_s == 0 {
        bail!("--timeout-s must be at least 1");
    }
    let base = BaseUrl::parse(&args.api)?;
    http_client::wait_ready(&base, args.api_key.as_deref(), LOAD_TIMEOUT)?;
    let model = match &args.model {
        Some(model) => model.clone(),
        None => super::bench_idle::first_model(&base, args.api_key.as_deref())?,
    };
    let suite = Suite {
        client: Client {
            base,
            api_key: args.api_key.clone(),
            model,
            timeout: Duration::from_secs(args.timeout_s),
        },
        max_tokens: args.max_tokens,
        soak_turns: args.soak_turns,
    };
    let mut all_passed = true;
    for check in CHECKS
        .iter()
        .filter(|c| args.checks.is_empty() || args.checks.contains(&c.name))
    {
        eprintln!("bench quality: {}", check.name);
        let tally = (check.run)(&suite);
        all_passed &= tally.ok();
        println!("{}", tally.to_json(check.name));
        // Each line as soon as its check ends: a long suite shows its progress.
        std::io::stdout().flush()?;
    }
    Ok(if all_passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One check's count of comparisons, and the first that failed.
#[derive(Debug)]
pub struct Tally {
    passed: usize,
    total: usize,
    first_failure: Option<String>,
    /// False when the check does not apply to this server or model (see `thinking`); such a
    /// check never fails the suite.
    applicable: bool,
}

impl Default for Tally {
    fn default() -> Tally {
        Tally {
            passed: 0,
            total: 0,
            first_failure: None,
            applicable: true,
        }
    }
}

impl Tally {
    /// Records one comparison: `Ok(None)` passed, `Ok(Some(why))` a mismatch, `Err` a request
    /// that got no usable answer (which fails the comparison too).
    pub fn record(&mut self, label: &str, outcome: anyhow::Result<Option<String>>) {
        self.total += 1;
        let problem = match outcome {
            Ok(None) => {
                self.passed += 1;
                return;
            }
            Ok(Some(why)) => why,
            Err(e) => format!("request failed: {e:#}"),
        };
        self.first_failure
            .get_or_insert(format!("{label}: {problem}"));
    }

    /// Runs one comparison and records it (see [`Tally::record`]).
    pub fn check(&mut self, label: &str, compare: impl FnOnce() -> anyhow::Result<Option<String>>) {
        self.record(label, compare());
    }

    fn ok(&self) -> bool {
        !self.applicable || (self.total > 0 && self.passed == self.total)
    }

    fn to_json(&self, name: &str) -> serde_json::Value {
        json!({
            "check": name,
            "ok": self.ok(),
            "passed": self.passed,
            "total": self.total,
            "applicable": self.applicable,
            "first_failure": self.first_failure,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::client::{Reply, difference, first_difference, snippet};
    use super::*;

    #[test]
    fn tally_counts_and_keeps_the_first_failure() {
        let mut tally = Tally::default();
        tally.record("a", Ok(None));
        tally.record("b", Ok(Some("differs".into())));
        tally.record("c", Err(anyhow::anyhow!("refused")));
        assert_eq!((tally.passed, tally.total), (1, 3));
        assert_eq!(tally.first_failure.as_deref(), Some("b: differs"));
        assert!(!tally.ok());
        let line = tally.to_json("x");
        assert_eq!(line["check"], "x");
        assert_eq!(line["ok"], false);
        tally.applicable = false;
        assert!(tally.ok(), "a check that does not apply never fails");
        assert!(
            !Tally::default().ok(),
            "a check that compared nothing fails"
        );
    }

    #[test]
    fn differences_name_the_first_differing_char() {
        assert_eq!(first_difference("abc", "abc"), None);
        assert_eq!(first_difference("abc", "abd"), Some(2));
        assert_eq!(first_difference("ab", "abc"), Some(2));
        assert_eq!(first_difference("é1", "é2"), Some(1));
        let long = "x".repeat(100);
        assert_eq!(snippet(&long, 50).chars().count(), 12 + 28 + 2);
        assert_eq!(snippet("short", 2), "short");
        let reply = |content: &str, finish: &str| Reply {
            content: content.into(),
            finish_reason: Some(finish.into()),
            ..Reply::default()
        };
        let why = difference(
            ("alone", &reply("hello", "stop")),
            ("b", &reply("help", "stop")),
        );
        assert_eq!(
            why.as_deref(),
            Some(r#"content differs at char 3: alone "hello", b "help""#)
        );
        let why = difference(("a", &reply("x", "stop")), ("b", &reply("x", "length")));
        assert!(why.unwrap().contains("finish_reason"));
        assert_eq!(
            difference(("a", &reply("x", "stop")), ("b", &reply("x", "stop"))),
            None
        );
    }

    #[test]
    fn check_names_are_known_and_unique() {
        assert_eq!(check_name("max-tokens"), Ok("max-tokens"));
        assert!(check_name("speed").unwrap_err().contains("soak"));
        let mut names: Vec<&str> = CHECKS.iter().map(|c| c.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), CHECKS.len());
    }
}
