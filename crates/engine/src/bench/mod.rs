//! `ember bench decode`: prefill and decode speed against a memory-bandwidth bound measured in
//! the same run; `ember bench turn`: a chat's next turn with the prompt cache against without;
//! `ember bench batch` ([`batch`]): many sequences at once.

mod batch;

pub use batch::{BatchBenchLine, BatchBenchOptions, bench_batch};

use std::ops::ControlFlow;
use std::time::Instant;

use ember_models::KvLayout;
use ember_tensor::cpu;

use crate::engine::{Engine, GenerateParams};
use crate::error::{Error, Result};
use crate::sampler::SamplingParams;

#[derive(Clone, Debug)]
pub struct DecodeBenchOptions {
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub repeats: usize,
    /// Size of the read-bandwidth probe; far past the last-level cache.
    pub probe_bytes: usize,
    /// Bring every step's logits to the host and pick there, as a request asking for
    /// log-probabilities runs, instead of picking where the logits are.
    pub step_logits: bool,
}

impl Default for DecodeBenchOptions {
    fn default() -> Self {
        DecodeBenchOptions {
            prompt_tokens: 512,
            decode_tokens: 128,
            repeats: 3,
            probe_bytes: 1 << 30,
            step_logits: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct DecodeBenchReport {
    pub model: String,
    pub threads: usize,
    /// What ran it: "cpu (avx512, 2 threads)", "cuda (NVIDIA H200 …)".
    pub device: String,
    /// Prompt tokens a forward pass took (the prompt ran in chunks of this many).
    pub prefill_chunk: usize,
    /// Medians over the repeats.
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub prefill_runs: Vec<f64>,
    pub decode_runs: Vec<f64>,
    /// Weights plus the mean KV cache read per decoded token.
    pub bytes_per_token: f64,
    pub bandwidth_gb_s: f64,
    /// What decode would reach if it moved `bytes_per_token` at the probe's bandwidth.
    pub bound_tok_s: f64,
}

impl DecodeBenchReport {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model": self.model,
            "threads": self.threads,
            "device": self.device,
            "prefill_chunk": self.prefill_chunk,
            "prefill_tok_s": round(self.prefill_tok_s),
            "decode_tok_s": round(self.decode_tok_s),
            "bytes_per_token": self.bytes_per_token.round(),
            "bandwidth_gb_s": round(self.bandwidth_gb_s),
            "bound_tok_s": round(self.bound_tok_s),
            "decode_vs_bound": (self.decode_tok_s / self.bound_tok_s * 1000.0).round() / 1000.0,
            "prefill_runs": self.prefill_runs.iter().map(|v| round(*v)).collect::<Vec<_>>(),
            "decode_runs": self.decode_runs.iter().map(|v| round(*v)).collect::<Vec<_>>(),
        })
    }
}

fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Prefill of a `prompt_tokens` prompt and greedy decode of `decode_tokens`, `repeats` times.
pub fn bench_decode(
    engine: &mut Engine,
    options: &DecodeBenchOptions,
) -> Result<DecodeBenchReport> {
    let needed = options.prompt_tokens + options.decode_tokens;
    if needed > engine.context() {
        return Err(Error::PromptTooLong {
            prompt_tokens: needed,
            context: engine.context(),
        });
    }
    let bandwidth_gb_s = engine.measure_bandwidth(options.probe_bytes, 5)?;
    let vocab = engine.config().vocab_size as u64;
    // A fixed pseudo-random prompt: the same work every run, no tokenizer involved.
    let mut state = 0x1234_5678_u64;
    let prompt: Vec<u32> = (0..options.prompt_tokens)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab) as u32
        })
        .collect();
    let (mut prefill_runs, mut decode_runs) = (Vec::new(), Vec::new());
    for _ in 0..options.repeats.max(1) {
        engine.reset();
        let start = Instant::now();
        // The first token ends the prompt's time; the decode's runs from it to the last.
        let (first, last) = if options.step_logits {
            // As a request wanting log-probabilities runs: every row of logits to the host.
            let mut token = cpu::argmax(engine.prefill(&prompt)?);
            let first = Instant::now();
            for _ in 0..options.decode_tokens {
                token = cpu::argmax(engine.step(token)?);
            }
            (first, Instant::now())
        } else {
            // As a greedy request without them: each token picked where the logits are, and
            // the device running a step ahead where it can.
            let (mut first, mut last) = (None, start);
            engine.decode_greedy(&prompt, 1 + options.decode_tokens, |_| {
                last = Instant::now();
                first.get_or_insert(last);
                ControlFlow::Continue(())
            })?;
            (first.unwrap_or(last), last)
        };
        prefill_runs.push(options.prompt_tokens as f64 / (first - start).as_secs_f64());
        decode_runs.push(options.decode_tokens as f64 / (last - first).as_secs_f64());
    }
    let mean_position = options.prompt_tokens as f64 + options.decode_tokens as f64 / 2.0;
    let bytes_per_token = engine.weight_bytes_per_token() as f64
        + mean_position * KvLayout::bytes_per_position(engine.config(), engine.kv_dtype()) as f64;
    Ok(DecodeBenchReport {
        model: engine.dir().display().to_string(),
        threads: engine.threads(),
        device: engine.device_label(),
        prefill_chunk: engine.prefill_chunk(),
        prefill_tok_s: median(&prefill_runs),
        decode_tok_s: median(&decode_runs),
        prefill_runs,
        decode_runs,
        bytes_per_token,
        bandwidth_gb_s,
        bound_tok_s: bandwidth_gb_s * 1e9 / bytes_per_token,
    })
}

#[derive(Clone, Debug)]
pub struct TurnBenchOptions {
    /// The conversation so far: the first turn's prompt.
    pub history_tokens: usize,
    /// The first turn's reply, which the second turn's prompt repeats.
    pub reply_tokens: usize,
    /// New tokens the second turn adds (the user's next message).
    pub new_tokens: usize,
    pub repeats: usize,
}

impl Default for TurnBenchOptions {
    fn default() -> Self {
        TurnBenchOptions {
            history_tokens: 2048,
            reply_tokens: 64,
            new_tokens: 30,
            repeats: 3,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TurnBenchReport {
    pub model: String,
    pub device: String,
    /// The second turn's prompt, and how much of it the cache held.
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Time to the second turn's first token, medians over the repeats: with the cache, and
    /// with the same request opting out (`cache_prompt: false`), alternated.
    pub cached_s: f64,
    pub cold_s: f64,
    pub cached_runs: Vec<f64>,
    pub cold_runs: Vec<f64>,
}

impl TurnBenchReport {
    pub fn to_json(&self) -> serde_json::Value {
        let ms = |v: f64| (v * 1e5).round() / 100.0;
        serde_json::json!({
            "model": self.model,
            "device": self.device,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_cached_ms": ms(self.cached_s),
            "ttft_cold_ms": ms(self.cold_s),
            "cached_vs_cold": (self.cached_s / self.cold_s * 1e4).round() / 1e4,
            "cached_runs_ms": self.cached_runs.iter().map(|v| ms(*v)).collect::<Vec<_>>(),
            "cold_runs_ms": self.cold_runs.iter().map(|v| ms(*v)).collect::<Vec<_>>(),
        })
    }
}

/// A chat's second turn, `repeats` times: into an emptied cache the first turn runs
/// (`history_tokens` of prompt, `reply_tokens` of greedy reply); then the second turn's prompt
/// (the history, the reply, `new_tokens` more) runs opting out of the cache (cold: neither
/// read nor fed), then with it (finding the first turn's blocks), and the time to its first
/// token is taken each time. Cold and cached alternate, in the same minutes.
pub fn bench_turn(engine: &mut Engine, options: &TurnBenchOptions) -> Result<TurnBenchReport> {
    let vocab = engine.config().vocab_size as u64;
    let mut state = 0x5EED_u64;
    let mut random = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % vocab) as u32
            })
            .collect()
    };
    let history = random(options.history_tokens);
    let new = random(options.new_tokens);
    let params = |max_tokens, cache_prompt| GenerateParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ignore_eos: true,
        step_logits: false,
        cache_prompt,
        draft: true,
    };
    let needed = options.history_tokens + options.reply_tokens + options.new_tokens + 1;
    if needed >= engine.context() {
        return Err(Error::PromptTooLong {
            prompt_tokens: needed,
            context: engine.context(),
        });
    }
    if !engine.prompt_cache_enabled() {
        return Err(Error::Io(std::io::Error::other(
            "the prompt cache is off: give --prompt-cache-gib a size",
        )));
    }
    let (mut cached_runs, mut cold_runs) = (Vec::new(), Vec::new());
    let (mut prompt_tokens, mut cached_tokens) = (0, 0);
    for _ in 0..options.repeats.max(1) {
        // The first turn, into an empty cache; its reply is the same every time (greedy).
        engine.clear_prompt_cache();
        let first = engine.generate(&history, &params(options.reply_tokens, true), |_| {
            ControlFlow::Continue(())
        })?;
        let mut prompt = history.clone();
        prompt.extend(&first.tokens);
        prompt.extend(&new);
        prompt_tokens = prompt.len();
        // The second turn opting out, then the same turn with the cache.
        for cache in [false, true] {
            let g = engine.generate(&prompt, &params(1, cache), |_| ControlFlow::Continue(()))?;
            let runs = if cache {
                cached_tokens = g.cached_tokens;
                &mut cached_runs
            } else {
                &mut cold_runs
            };
            runs.push(g.prefill_time.as_secs_f64());
        }
    }
    Ok(TurnBenchReport {
        model: engine.dir().display().to_string(),
        device: engine.device_label(),
        prompt_tokens,
        cached_tokens,
        cached_s: median(&cached_runs),
        cold_s: median(&cold_runs),
        cached_runs,
        cold_runs,
    })
}
