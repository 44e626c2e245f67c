//! `ember bench batch`: the batched loop's aggregate speed, engine only (no HTTP), in the
//! shape of llama.cpp's `llama-batched-bench`: for each count of sequences, that many distinct
//! prompts of `prompt_tokens`, each then generating `decode_tokens`, all at once. Reported
//! against the bound of one batched decode step (the weights read once, every sequence's KV
//! cache read once) at a read bandwidth measured in the same run.

use std::collections::HashMap;
use std::time::Instant;

use ember_models::KvLayout;

use crate::engine::{BatchEvent, Engine, GenerateParams, StepTiming};
use crate::error::{Error, Result};
use crate::sampler::SamplingParams;

#[derive(Clone, Debug)]
pub struct BatchBenchOptions {
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Sequences at once, one setting each.
    pub sequences: Vec<usize>,
    pub probe_bytes: usize,
    /// Decode steps a GPU profiler captures (started with `--profile-from-start off`), from
    /// the middle of each setting's decode; 0 for none.
    pub profile_steps: usize,
    /// The profiler captures each setting's prefill (until every sequence has its first
    /// token) instead.
    pub profile_prefill: bool,
}

/// What a GPU profiler captures of a setting.
#[derive(Clone, Copy, Debug)]
enum Capture {
    Nothing,
    /// This many decode steps from the middle of the decode.
    DecodeSteps(usize),
    Prefill,
}

/// One setting's figures.
#[derive(Clone, Debug)]
pub struct BatchBenchLine {
    pub sequences: usize,
    /// Until every sequence had its first token: all the prompts, in chunks beside the first
    /// sequences' decode steps.
    pub prefill_s: f64,
    pub prefill_tok_s: f64,
    /// From then to the end: tokens made in that time over it.
    pub decode_s: f64,
    pub decode_tok_s: f64,
    /// Decode at the bound: one step reads the weights once and each sequence's cache.
    pub bound_tok_s: f64,
    /// Of the decode time: the forward passes (until their picks are on the host), host
    /// sampling and bookkeeping, and scheduling, as shares.
    pub pass_share: f64,
    pub sample_share: f64,
    pub schedule_share: f64,
    pub steps: usize,
}

impl BatchBenchLine {
    pub fn to_json(&self) -> serde_json::Value {
        let r = |x: f64| (x * 1000.0).round() / 1000.0;
        serde_json::json!({
            "sequences": self.sequences,
            "prefill_s": r(self.prefill_s),
            "prefill_tok_s": r(self.prefill_tok_s),
            "decode_s": r(self.decode_s),
            "decode_tok_s": r(self.decode_tok_s),
            "bound_tok_s": r(self.bound_tok_s),
            "of_bound": r(self.decode_tok_s / self.bound_tok_s),
            "decode_steps": self.steps,
            "pass_share": r(self.pass_share),
            "sample_share": r(self.sample_share),
            "schedule_share": r(self.schedule_share),
        })
    }
}

/// Runs every setting of `options` (each after a short warm-up of the same count, so that
/// kernels are loaded and decode graphs recorded), on an engine whose `--parallel` takes the
/// largest.
pub fn bench_batch(
    engine: &mut Engine,
    options: &BatchBenchOptions,
) -> Result<Vec<BatchBenchLine>> {
    let needed = options.prompt_tokens + options.decode_tokens;
    if needed >= engine.context() {
        return Err(Error::PromptTooLong {
            prompt_tokens: needed,
            context: engine.context(),
        });
    }
    if let Some(&most) = options.sequences.iter().max()
        && most > engine.parallel()
    {
        return Err(Error::TooManySequences {
            wanted: most,
            parallel: engine.parallel(),
        });
    }
    let bandwidth = engine.measure_bandwidth(options.probe_bytes, 5)? * 1e9;
    let kv_per_position = KvLayout::bytes_per_position(engine.config(), engine.kv_dtype()) as f64;
    let weights = engine.weight_bytes_per_token() as f64;
    let mut lines = Vec::new();
    let mut seed = 1;
    for &n in &options.sequences {
        let warm_up = (options.prompt_tokens.min(64), 4);
        run(engine, n, warm_up, Capture::Nothing, &mut seed)?;
        let capture = match (options.profile_prefill, options.profile_steps) {
            (true, _) => Capture::Prefill,
            (false, 0) => Capture::Nothing,
            (false, steps) => Capture::DecodeSteps(steps),
        };
        let run = run(
            engine,
            n,
            (options.prompt_tokens, options.decode_tokens),
            capture,
            &mut seed,
        )?;
        let mean_position = options.prompt_tokens as f64 + options.decode_tokens as f64 / 2.0;
        let step_bytes = weights + n as f64 * mean_position * kv_per_position;
        let decode_s = run.decode_s.max(f64::MIN_POSITIVE);
        let t = run.timing;
        let share = |d: std::time::Duration| d.as_secs_f64() / decode_s;
        lines.push(BatchBenchLine {
            sequences: n,
            prefill_s: run.prefill_s,
            prefill_tok_s: (n * options.prompt_tokens) as f64 / run.prefill_s,
            decode_s,
            decode_tok_s: run.decode_tokens as f64 / decode_s,
            bound_tok_s: n as f64 * bandwidth / step_bytes,
            pass_share: share(t.pass),
            sample_share: share(t.sample),
            schedule_share: share(t.schedule),
            steps: t.passes,
        });
    }
    Ok(lines)
}

struct Run {
    prefill_s: f64,
    decode_s: f64,
    /// Tokens made after every sequence had its first.
    decode_tokens: usize,
    /// The loop's timing over the decode part.
    timing: StepTiming,
}

/// `n` requests of distinct prompts of `prompt` tokens, `decode` tokens each, greedy; a
/// profiler captures what `capture` asks.
fn run(
    engine: &mut Engine,
    n: usize,
    (prompt, decode): (usize, usize),
    capture: Capture,
    seed: &mut u64,
) -> Result<Run> {
    let vocab = engine.config().vocab_size as u64;
    let params = GenerateParams {
        max_tokens: decode,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        step_logits: false,
        // Distinct prompts: a cache would only fill.
        cache_prompt: false,
        draft: true,
    };
    for id in 0..n as u64 {
        let tokens: Vec<u32> = (0..prompt)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 33) % vocab) as u32
            })
            .collect();
        engine.submit(id, &tokens, params, None)?;
    }
    let start = Instant::now();
    let mut made: HashMap<u64, usize> = HashMap::new();
    let (mut total, mut failed) = (0usize, None);
    let mut decoding: Option<(Instant, usize, StepTiming)> = None;
    let (mut capturing, mut captured) = (false, 0);
    if let Capture::Prefill = capture {
        engine.profiler_capture(true)?;
        capturing = true;
    }
    loop {
        let more = engine.step_batch(&mut |id, event| match event {
            BatchEvent::Token { .. } => {
                *made.entry(id).or_default() += 1;
                total += 1;
            }
            BatchEvent::Failed(e) => failed = Some(e),
            BatchEvent::Prompt { .. } | BatchEvent::Finished(_) => {}
        })?;
        if let Some(e) = failed.take() {
            return Err(e);
        }
        if decoding.is_none() && made.len() == n {
            decoding = Some((Instant::now(), total, engine.step_timing()));
            if let Capture::Prefill = capture {
                engine.profiler_capture(false)?;
                capturing = false;
            }
        }
        if let Some((_, at, _)) = decoding
            && let Capture::DecodeSteps(profile_steps) = capture
        {
            // Steps since every sequence had its first token, each a token of each.
            let steps = (total - at) / n;
            let first = (decode / 2).saturating_sub(profile_steps / 2);
            if steps == first && !capturing && captured == 0 {
                engine.profiler_capture(true)?;
                capturing = true;
            } else if capturing {
                captured += 1;
                if captured == profile_steps {
                    engine.profiler_capture(false)?;
                    capturing = false;
                }
            }
        }
        if !more {
            break;
        }
    }
    if capturing {
        engine.profiler_capture(false)?;
    }
    let end = Instant::now();
    let (first, at, timing) = decoding.unwrap_or((end, total, engine.step_timing()));
    let now = engine.step_timing();
    Ok(Run {
        prefill_s: (first - start).as_secs_f64(),
        decode_s: (end - first).as_secs_f64(),
        decode_tokens: total - at,
        timing: now.since(&timing),
    })
}
