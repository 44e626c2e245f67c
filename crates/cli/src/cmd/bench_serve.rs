//! `ember bench serve`: load on any OpenAI-compatible server (ember, llama-server, vLLM), in the
//! manner of `vllm bench serve`. Per setting — a number of streams kept in flight, or a rate of
//! Poisson arrivals — it sends distinct synthetic prompts as streaming `/v1/completions` with a
//! fixed reply length (`ignore_eos`), and prints one JSON line: requests/s, output tokens/s, and
//! the percentiles of the time to first token and of the gaps between tokens.

use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::args::BenchServeArgs;
use crate::http_client::{self, BaseUrl};

/// Longest wait for a server that is still loading its model.
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// Longest wait for one reply: at 64 streams on a slow machine a reply can take minutes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1800);

/// Words the synthetic prompts are drawn from: common English words, a token or so each.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "was", "for", "on", "are", "as",
    "with", "his", "they", "at", "be", "this", "from", "have", "or", "one", "had", "by", "word",
    "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an",
    "each", "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out",
    "many", "then", "them", "these", "so", "some", "her", "would", "make", "like", "him", "into",
    "time", "has", "look", "two", "more", "write", "go", "see", "number", "no", "way", "could",
    "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its", "now", "find",
    "long", "down", "day", "did", "get", "come", "made", "may", "part", "river",
];

/// One setting of the sweep.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// This many requests in flight at every moment (until the last ones).
    Concurrency(usize),
    /// Arrivals at this many requests per second, exponential gaps.
    Rate(f64),
}

pub fn run(args: BenchServeArgs) -> anyhow::Result<ExitCode> {
    let loads = loads(&args)?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if args.prompt_words == 0 {
        bail!("--prompt-words must be at least 1");
    }
    if let Some(max) = args.prompt_words_max
        && max < args.prompt_words
    {
        bail!(
            "--prompt-words-max {max} is below --prompt-words {}",
            args.prompt_words
        );
    }
    let base = BaseUrl::parse(&args.api)?;
    http_client::wait_ready(&base, args.api_key.as_deref(), LOAD_TIMEOUT)?;
    let model = match &args.model {
        Some(model) => model.clone(),
        None => super::bench_idle::first_model(&base, args.api_key.as_deref())?,
    };
    let client = Client {
        base,
        api_key: args.api_key.clone(),
        model,
        max_tokens: args.max_tokens,
    };
    // One request first, so the first setting does not pay for whatever the server does first.
    let warmup = client.complete(&prompt(&args, u64::MAX))?;
    eprintln!(
        "bench serve: warm-up request, first token after {:.3} s",
        warmup.ttft_s
    );
    for (setting, load) in loads.into_iter().enumerate() {
        let requests = args.requests.unwrap_or(match load {
            Load::Concurrency(c) => (4 * c).max(8),
            Load::Rate(_) => 32,
        });
        if requests == 0 {
            bail!("--requests must be at least 1");
        }
        // Prompts distinct across settings too, so a setting never hits what the one before
        // left in a prompt cache.
        let first_index = (setting as u64) << 32;
        let report = run_load(&client, &args, load, requests, first_index)?;
        println!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}

fn loads(args: &BenchServeArgs) -> anyhow::Result<Vec<Load>> {
    if !args.rate.is_empty() {
        if let Some(bad) = args.rate.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
            bail!("--rate: {bad} is not a number of requests per second above 0");
        }
        return Ok(args.rate.iter().map(|&r| Load::Rate(r)).collect());
    }
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency: every setting needs at least 1 stream");
    }
    Ok(args
        .concurrency
        .iter()
        .map(|&c| Load::Concurrency(c))
        .collect())
}

/// What one request measured.
#[derive(Clone, Debug)]
struct Outcome {
    ttft_s: f64,
    /// Gaps between successive chunks of text after the first.
    gaps_s: Vec<f64>,
    latency_s: f64,
    /// The server's counts when it reports usage, else the text chunks seen.
    output_tokens: usize,
    prompt_tokens: Option<usize>,
}

/// Runs one setting to the end; the JSON line to print.
fn run_load(
    client: &Client,
    args: &BenchServeArgs,
    load: Load,
    requests: usize,
    first_index: u64,
) -> anyhow::Result<Value> {
    let outcomes: Mutex<Vec<Outcome>> = Mutex::new(Vec::with_capacity(requests));
    let failure: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let done = AtomicUsize::new(0);
    let label = match load {
        Load::Concurrency(c) => format!("concurrency {c}"),
        Load::Rate(r) => format!("rate {r}/s"),
    };
    let one = |i: usize| {
        if failure.lock().unwrap().is_some() {
            return;
        }
        match client.complete(&prompt(args, first_index + i as u64)) {
            Ok(outcome) => outcomes.lock().unwrap().push(outcome),
            Err(e) => {
                failure.lock().unwrap().get_or_insert(e);
            }
        }
        let n = done.fetch_add(1, Ordering::Relaxed) + 1;
        eprint!("\rbench serve: {label}: {n}/{requests} requests");
    };
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|s| match load {
        Load::Concurrency(streams) => {
            for _ in 0..streams.min(requests) {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= requests {
                            break;
                        }
                        one(i);
                    }
                });
            }
        }
        Load::Rate(rate) => {
            let mut arrivals = Rng(args.seed ^ 0x9e37_79b9_7f4a_7c15 ^ first_index);
            let mut at = Duration::ZERO;
            for i in 0..requests {
                // Exponential gaps: a Poisson process of `rate` arrivals a second.
                at += Duration::from_secs_f64(-(1.0 - arrivals.unit()).ln() / rate);
                if let Some(wait) = at.checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
                let one = &one;
                s.spawn(move || one(i));
            }
        }
    });
    let wall_s = start.elapsed().as_secs_f64();
    eprintln!();
    if let Some(e) = failure.into_inner().unwrap() {
        return Err(e.context(format!("bench serve, {label}")));
    }
    Ok(report(load, &outcomes.into_inner().unwrap(), wall_s))
}

fn report(load: Load, outcomes: &[Outcome], wall_s: f64) -> Value {
    let output: usize = outcomes.iter().map(|o| o.output_tokens).sum();
    let prompt: Option<usize> = outcomes.iter().map(|o| o.prompt_tokens).sum();
    let ttft: Vec<f64> = outcomes.iter().map(|o| o.ttft_s).collect();
    let gaps: Vec<f64> = outcomes.iter().flat_map(|o| o.gaps_s.clone()).collect();
    let latency: Vec<f64> = outcomes.iter().map(|o| o.latency_s).collect();
    let mut line = match load {
        Load::Concurrency(c) => json!({ "concurrency": c }),
        Load::Rate(r) => json!({ "rate": r }),
    };
    let n = outcomes.len();
    line["requests"] = json!(n);
    line["duration_s"] = json!(round(wall_s));
    line["requests_per_s"] = json!(round(n as f64 / wall_s));
    line["output_tokens"] = json!(output);
    line["output_tokens_per_s"] = json!(round(output as f64 / wall_s));
    line["mean_prompt_tokens"] = json!(prompt.map(|p| round(p as f64 / n as f64)));
    for (name, values) in [("ttft", &ttft), ("itl", &gaps), ("latency", &latency)] {
        for p in [50, 90, 99] {
            line[format!("{name}_p{p}_s")] = json!(percentile(values, p).map(round));
        }
    }
    line
}

struct Client {
    base: BaseUrl,
    api_key: Option<String>,
    model: String,
    max_tokens: usize,
}

impl Client {
    /// One greedy streaming completion of `prompt`, read to the end.
    fn complete(&self, prompt: &str) -> anyhow::Result<Outcome> {
        let body = json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let start = Instant::now();
        let mut response = http_client::post_stream(
            &self.base,
            "/v1/completions",
            self.api_key.as_deref(),
            &body,
            REQUEST_TIMEOUT,
        )?;
        let mut chunks: Vec<f64> = Vec::new();
        let mut usage = None;
        while let Some(event) = response.next_event()? {
            if event["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            {
                chunks.push(start.elapsed().as_secs_f64());
            }
            if event["usage"].is_object() {
                usage = Some(event["usage"].clone());
            }
        }
        let latency_s = start.elapsed().as_secs_f64();
        let ttft_s = *chunks
            .first()
            .context("the stream ended without any generated text")?;
        let count = |key: &str| {
            usage
                .as_ref()
                .and_then(|u| u[key].as_u64())
                .map(|n| n as usize)
        };
        Ok(Outcome {
            ttft_s,
            gaps_s: chunks.windows(2).map(|w| w[1] - w[0]).collect(),
            latency_s,
            output_tokens: count("completion_tokens").unwrap_or(chunks.len()),
            prompt_tokens: count("prompt_tokens"),
        })
    }
}

/// The prompt of request `index`: a line naming the request (so no two prompts share more than
/// a few tokens of prefix), then words drawn from `index` and the seed.
fn prompt(args: &BenchServeArgs, index: u64) -> String {
    let mut rng = Rng(args.seed ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03));
    let words = match args.prompt_words_max {
        Some(max) if max > args.prompt_words => {
            args.prompt_words + (rng.next() % (max - args.prompt_words + 1) as u64) as usize
        }
        _ => args.prompt_words,
    };
    let mut text = format!("Request {index:x}:");
    for _ in 0..words {
        text.push(' ');
        text.push_str(WORDS[(rng.next() % WORDS.len() as u64) as usize]);
    }
    text
}

/// SplitMix64: small, seedable, and the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The `p`th percentile by nearest rank; `None` for no values.
fn percentile(values: &[f64], p: usize) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    Some(sorted[rank - 1])
}

/// To the microsecond: gaps between tokens of a small model are tens of microseconds.
fn round(seconds: f64) -> f64 {
    (seconds * 1e6).round() / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50), Some(50.0));
        assert_eq!(percentile(&v, 90), Some(90.0));
        assert_eq!(percentile(&v, 99), Some(99.0));
        assert_eq!(percentile(&[3.0], 99), Some(3.0));
        assert_eq!(percentile(&[2.0, 1.0], 50), Some(1.0));
        assert_eq!(percentile(&[], 50), None);
    }

    #[test]
    fn prompts_are_distinct_seeded_and_sized() {
        let args = |max: Option<usize>| BenchServeArgs {
            api: String::new(),
            concurrency: vec![1],
            rate: vec![],
            requests: None,
            prompt_words: 10,
            prompt_words_max: max,
            max_tokens: 1,
            seed: 3,
            api_key: None,
            model: None,
        };
        let fixed = args(None);
        let (a, b) = (prompt(&fixed, 1), prompt(&fixed, 2));
        assert_ne!(a, b);
        assert_eq!(
            a,
            prompt(&fixed, 1),
            "the same seed and index give the same prompt"
        );
        assert_eq!(a.split(' ').count(), 2 + 10);
        let sampled = args(Some(20));
        let lengths: Vec<usize> = (0..200)
            .map(|i| prompt(&sampled, i).split(' ').count() - 2)
            .collect();
        assert!(lengths.iter().all(|&n| (10..=20).contains(&n)));
        assert!(lengths.contains(&10) && lengths.contains(&20));
    }

    #[test]
    fn poisson_gaps_average_the_rate() {
        let mut rng = Rng(7);
        let rate = 4.0;
        let n = 20_000;
        let mean: f64 = (0..n).map(|_| -(1.0 - rng.unit()).ln() / rate).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "mean gap {mean}");
    }
}
