//! Resumed = cold: a prompt served from the prompt cache gives the same tokens, bit for bit
//! through the greedy picks, as the same prompt on an engine with the cache off.
//!
//! For every golden fixture (and both real GGUF models when `scripts/fetch-model` has fetched
//! them), one engine with a cache and one without run the same requests: the same prompt
//! twice; the prompt extended by its reply and new tokens (a chat's next turn); a prompt that
//! leaves the first inside a block; the first prompt again after other prompts evicted it;
//! with a host tier, after its blocks went to the host and came back; and a request that opts
//! out (`cache_prompt: false`). Each is checked greedy with the pick made where the logits
//! are (the same tokens), and with the logits brought to the host (a request asking for
//! log-probabilities: the same tokens and every logit the same bits).
//!
//! Prompts run in chunks of 5 tokens (`EMBER_TEST_PREFILL_CHUNK`), so that the cold and the
//! resumed prefill split the prompt at other places: a row's result must not depend on the
//! rows around it.
//!
//! `EMBER_TEST_DEVICE=cuda` runs the fixtures on the GPU (graphs on, and off with
//! `EMBER_TEST_CUDA_GRAPHS=0`; the batch-invariant products with
//! `EMBER_TEST_BATCH_INVARIANT=1`, where every bit is held equal; without it only the tokens, see
//! [`assert_same`]).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use ember_engine::prompt_cache::CacheBudget;
use ember_engine::sampler::SamplingParams;
use ember_engine::{Device, Engine, EngineOptions, Error, GenerateParams};

// The device under test, and how a split model's GPUs meet there.
#[path = "common/replies.rs"]
#[allow(dead_code)]
mod replies;
use replies::{collectives, device};

/// Tokens a prompt chunk takes: `EMBER_TEST_PREFILL_CHUNK`, 5 by default.
fn prefill_chunk() -> usize {
    std::env::var("EMBER_TEST_PREFILL_CHUNK").map_or(5, |v| v.parse().expect("a chunk size"))
}

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

fn gguf(file: &str) -> Option<PathBuf> {
    let mut dirs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")];
    if let Some(dir) = std::env::var_os("EMBER_MODELS_DIR") {
        dirs.insert(0, PathBuf::from(dir));
    }
    dirs.into_iter().map(|d| d.join(file)).find(|p| p.is_file())
}

/// Whether the run takes the batch-invariant kernels (`EMBER_TEST_BATCH_INVARIANT=1`).
fn batch_invariant() -> bool {
    std::env::var("EMBER_TEST_BATCH_INVARIANT").is_ok_and(|v| v == "1")
}

fn load(path: &Path, cache: CacheBudget, host: CacheBudget) -> Engine {
    load_split(path, cache, host, 1)
}

/// [`load`] of the model split across `ranks` (`--tensor-parallel`).
fn load_split(path: &Path, cache: CacheBudget, host: CacheBudget, ranks: usize) -> Engine {
    let options = EngineOptions {
        tensor_parallel: ranks,
        threads: Some(2),
        context: Some(512),
        prefill_chunk: Some(prefill_chunk()),
        device: device(),
        cuda_graphs: std::env::var("EMBER_TEST_CUDA_GRAPHS").map_or(true, |v| v != "0"),
        batch_invariant: batch_invariant(),
        collectives: collectives(),
        prompt_cache: cache,
        prompt_cache_host: host,
        ..EngineOptions::default()
    };
    Engine::load(path, &options).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Greedy tokens of `prompt` (with `step_logits`, each step's logits' bits after its token),
/// and how many of its tokens came from the cache.
fn greedy(
    engine: &mut Engine,
    prompt: &[u32],
    step_logits: bool,
    cache: bool,
) -> (Vec<u32>, usize) {
    let params = GenerateParams {
        max_tokens: 12,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ignore_eos: true,
        step_logits,
        cache_prompt: cache,
        draft: true,
    };
    let mut out = Vec::new();
    let g = engine
        .generate(prompt, &params, |step| {
            out.push(step.token);
            // Bit for bit: the logits themselves, where they come to the host.
            if let Some(logits) = step.logits {
                out.extend(logits.iter().map(|l| l.to_bits()));
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(g.tokens.len(), 12);
    (out, g.cached_tokens)
}

/// Fails naming the first step and value where `got` and `want` (what [`greedy`] returned)
/// part, rather than printing whole rows of logits.
///
/// On CUDA without `--batch-invariant` only the tokens must agree, and the largest logit
/// difference is printed: there its prompt GEMMs and prompt attention do not compute a row as
/// decode does (the README says so). With it, every bit.
#[track_caller]
fn assert_same(got: &[u32], want: &[u32], vocab: usize, what: &str) {
    if device() != Device::Cpu && !batch_invariant() && got.len() > 12 {
        let step = 1 + vocab;
        let tokens = |v: &[u32]| v.chunks(step).map(|s| s[0]).collect::<Vec<_>>();
        assert_eq!(tokens(got), tokens(want), "{what}: tokens");
        let worst = got
            .chunks(step)
            .zip(want.chunks(step))
            .flat_map(|(a, b)| a[1..].iter().zip(&b[1..]))
            .map(|(&a, &b)| (f32::from_bits(a) - f32::from_bits(b)).abs())
            .fold(0f32, f32::max);
        eprintln!("{what}: the same tokens, logits up to {worst:e} apart");
        return;
    }
    if let Some(i) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
        let per_step = if got.len() > 12 { 1 + vocab } else { 1 };
        let (step, at) = (i / per_step, i % per_step);
        let part = if at == 0 {
            "token".to_string()
        } else {
            format!("logit {}", at - 1)
        };
        panic!(
            "{what}: step {step}, {part}: {:?} against {:?} cold (as f32 bits where a logit)",
            got.get(i),
            want.get(i)
        );
    }
}

/// The tokens of what [`greedy`] returned.
fn greedy_tokens(out: &[u32], vocab: usize, step_logits: bool) -> Vec<u32> {
    if step_logits {
        out.chunks(1 + vocab).map(|step| step[0]).collect()
    } else {
        out.to_vec()
    }
}

/// A deterministic prompt of `n` tokens below `vocab`, different for each `seed`.
fn prompt(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Away from the special tokens at the ends of small vocabularies.
            (10 + (state >> 33) as usize % (vocab - 20)) as u32
        })
        .collect()
}

/// Runs every case on `path`; `what` names the model in failures.
fn check(path: &Path, what: &str) {
    check_split(path, what, 1);
}

/// [`check`] of the model split across `ranks`: every rank's pool holds its heads' share of
/// each block, and copies to and from the host tier go to every rank.
fn check_split(path: &Path, what: &str, ranks: usize) {
    let load = |path, cache, host| load_split(path, cache, host, ranks);
    let mut cold = load(path, CacheBudget::Off, CacheBudget::Off);
    let mut warm = load(path, CacheBudget::Gib(0.02), CacheBudget::Off);
    let vocab = cold.config().vocab_size;
    for step_logits in [false, true] {
        let how = format!("{what}, step_logits {step_logits}");
        warm.clear_prompt_cache();
        let first = prompt(70, 1, vocab);
        let want = greedy(&mut cold, &first, step_logits, true).0;
        let (got, cached) = greedy(&mut warm, &first, step_logits, true);
        assert_eq!(cached, 0, "{how}: the first request");
        assert_same(&got, &want, vocab, &format!("{how}: the first request"));

        // The same prompt again: the 4 full blocks before its last token come from the cache.
        let (again, cached) = greedy(&mut warm, &first, step_logits, true);
        assert_eq!(cached, 64, "{how}: the same prompt again");
        assert_same(
            &again,
            &want,
            vocab,
            &format!("{how}: the same prompt again"),
        );

        // The next turn: the prompt, its reply, and new tokens.
        let mut next = first.clone();
        next.extend(&greedy_tokens(&want, vocab, step_logits)[..11]);
        next.extend(prompt(9, 2, vocab));
        let want_next = greedy(&mut cold, &next, step_logits, true).0;
        let (got, cached) = greedy(&mut warm, &next, step_logits, true);
        assert_eq!(cached, 80, "{how}: the prompt extended by its reply");
        assert_same(
            &got,
            &want_next,
            vocab,
            &format!("{how}: the prompt extended by its reply"),
        );

        // A prompt that leaves the first one 40 tokens in, inside its third block.
        let mut branch = first[..40].to_vec();
        branch.extend(prompt(30, 3, vocab));
        let want_branch = greedy(&mut cold, &branch, step_logits, true).0;
        let (got, cached) = greedy(&mut warm, &branch, step_logits, true);
        assert_eq!(cached, 32, "{how}: a branch inside a block");
        assert_same(
            &got,
            &want_branch,
            vocab,
            &format!("{how}: a branch inside a block"),
        );

        // Opted out: nothing read, the same tokens.
        let (got, cached) = greedy(&mut warm, &first, step_logits, false);
        assert_eq!(cached, 0, "{how}: cache_prompt false");
        assert_same(&got, &want, vocab, &format!("{how}: cache_prompt false"));
    }

    // Evicted: a budget of a few blocks beyond the context (between requests the cache may
    // fill the whole pool, the context's blocks too), filled by other prompts; the first
    // prompt's blocks are gone, and it is computed again, the same.
    let mut small = load(path, CacheBudget::Gib(tiny_budget(&cold)), CacheBudget::Off);
    let first = prompt(70, 1, vocab);
    let want = greedy(&mut cold, &first, false, true).0;
    greedy(&mut small, &first, false, true);
    for seed in 10..17 {
        greedy(&mut small, &prompt(120, seed, vocab), false, true);
    }
    let (got, cached) = greedy(&mut small, &first, false, true);
    assert_eq!(cached, 0, "{what}: evicted");
    assert_same(
        &got,
        &want,
        vocab,
        &format!("{what}: evicted and computed again"),
    );
    assert!(small.prompt_cache_stats().snapshot().evictions_total > 0);
    // And cached again after that.
    let (got, cached) = greedy(&mut small, &first, false, true);
    assert_eq!(cached, 64, "{what}: back in the cache");
    assert_same(&got, &want, vocab, &format!("{what}: back in the cache"));

    // With a host tier: evicted blocks go to the host and come back by copy.
    let mut tiered = load(
        path,
        CacheBudget::Gib(tiny_budget(&cold)),
        CacheBudget::Gib(0.02),
    );
    greedy(&mut tiered, &first, false, true);
    for seed in 10..17 {
        greedy(&mut tiered, &prompt(120, seed, vocab), false, true);
    }
    let stats = tiered.prompt_cache_stats().snapshot();
    assert!(
        stats.host_blocks > 0,
        "{what}: nothing went to the host tier"
    );
    let (got, cached) = greedy(&mut tiered, &first, false, true);
    assert_eq!(cached, 64, "{what}: back from the host tier");
    assert_same(
        &got,
        &want,
        vocab,
        &format!("{what}: back from the host tier"),
    );
}

/// GiB for a cache of 8 blocks of `engine`'s model, beyond the context's.
fn tiny_budget(engine: &Engine) -> f64 {
    let c = engine.config();
    let bytes_per_position =
        2 * c.num_hidden_layers * c.kv_dim() * engine.kv_dtype().size_in_bytes();
    (8 * 16 * bytes_per_position) as f64 / (1u64 << 30) as f64
}

/// Split two ways (ranks as threads on the CPU, GPUs on CUDA).
#[test]
fn resumed_equals_cold_on_split_models() {
    for name in ["qwen3-f32", "qwen3moe-bf16", "llama-f32"] {
        check_split(&golden(name), name, 2);
    }
}

#[test]
fn resumed_equals_cold_on_every_golden_fixture() {
    // Every fixture runs, and the failures are listed together.
    let mut failed = Vec::new();
    for name in [
        "qwen3-f32",
        "qwen3-bf16",
        "qwen3-hd128-bf16",
        "qwen3moe-f32",
        "qwen3moe-bf16",
        "qwen2-f32",
        "qwen2-bf16",
        "llama-f32",
        "llama-bf16",
    ] {
        let run = std::panic::catch_unwind(|| check(&golden(name), name));
        if let Err(panic) = run {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failed.push(format!("{name}: {message}"));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn resumed_equals_cold_on_the_gguf_models() {
    if device() != Device::Cpu {
        return; // GGUF models run on the CPU.
    }
    let mut ran = 0;
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    ] {
        match gguf(file) {
            Some(path) => {
                check(&path, file);
                ran += 1;
            }
            None => eprintln!("SKIPPED: {file} is not in models/ (scripts/fetch-model)"),
        }
    }
    if ran == 0 && std::env::var_os("CI").is_some() {
        panic!("CI must fetch the default model (scripts/fetch-model smollm2)");
    }
}

/// A prompt longer than the context is refused before anything is taken from the pool; a
/// request stopped between prompt chunks gives its blocks back and leaves the cache whole:
/// the next requests hit what was cached before and give the cold tokens.
#[test]
fn bad_requests_leave_the_pool_and_the_cache_consistent() {
    let path = golden("qwen3-f32");
    let mut cold = load(&path, CacheBudget::Off, CacheBudget::Off);
    let mut warm = load(&path, CacheBudget::Gib(0.02), CacheBudget::Off);
    let vocab = cold.config().vocab_size;
    let first = prompt(70, 1, vocab);
    let want = greedy(&mut cold, &first, false, true).0;
    greedy(&mut warm, &first, false, true);

    let params = GenerateParams {
        max_tokens: 4,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        step_logits: false,
        cache_prompt: true,
        draft: true,
    };
    let too_long = prompt(600, 5, vocab);
    let err = warm
        .generate(&too_long, &params, |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(matches!(err, Error::PromptTooLong { .. }), "{err}");

    // A new prompt stopped after the chunks that fill 20 positions or more (4 of 5 tokens,
    // 1 of 64), before its prefill ends (the stop is asked before each chunk but the last).
    let chunk = prefill_chunk();
    let other = prompt(90.max(2 * chunk + 10), 6, vocab);
    let (run_chunks, filled) = (20usize.div_ceil(chunk), 20usize.div_ceil(chunk) * chunk);
    assert!(run_chunks < (other.len() - 1) / chunk);
    let chunks = std::cell::Cell::new(0);
    let stop = || {
        chunks.set(chunks.get() + 1);
        chunks.get() > run_chunks
    };
    let err = warm
        .generate_until(&other, &params, None, &stop, |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(err.is_cancellation(), "{err}");
    assert_eq!(
        warm.position(),
        0,
        "the cancelled sequence's blocks went back"
    );

    let (got, cached) = greedy(&mut warm, &first, false, true);
    assert_eq!(cached, 64, "the cache after a cancelled request");
    assert_same(&got, &want, vocab, "the cache after a cancelled request");
    let want_other = greedy(&mut cold, &other, false, true).0;
    let (got, cached) = greedy(&mut warm, &other, false, true);
    // The whole blocks the chunks run before the stop filled were kept.
    assert_eq!(cached, filled / 16 * 16, "what a cancelled prefill left");
    assert_same(
        &got,
        &want_other,
        vocab,
        "a prompt whose prefill was cancelled, run again",
    );
}
