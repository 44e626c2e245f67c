//! The prompt cache's budget holds: a thousand requests, each a long prompt of its own, fill the
//! cache many times over and evict all the while, and the process's resident memory stays
//! within 1% of what it was once the cache had first filled. The KV pool (context plus budget)
//! is made and written at load; blocks only change hands afterwards.
//!
//! Its own test binary with one test, so that no other test allocates in the process while
//! resident memory is measured.

#![cfg(target_os = "linux")]

use std::ops::ControlFlow;
use std::path::PathBuf;

use ember_engine::prompt_cache::CacheBudget;
use ember_engine::sampler::SamplingParams;
use ember_engine::{Engine, EngineOptions, GenerateParams};

fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[test]
fn a_thousand_requests_stay_inside_the_budget() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/qwen3-f32");
    let options = EngineOptions {
        threads: Some(2),
        context: Some(512),
        prefill_chunk: Some(128),
        prompt_cache: CacheBudget::Gib(1.0 / 16.0),
        ..EngineOptions::default()
    };
    let mut engine = Engine::load(&dir, &options).unwrap();
    let vocab = engine.config().vocab_size as u64;
    let params = GenerateParams {
        max_tokens: 2,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        step_logits: false,
        cache_prompt: true,
        draft: true,
    };
    let mut state = 7u64;
    let mut run = |engine: &mut Engine| {
        // 400 tokens of its own: every request misses, fills blocks, and evicts others.
        let prompt: Vec<u32> = (0..400)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) as u32 % vocab as u32
            })
            .collect();
        engine
            .generate(&prompt, &params, |_| ControlFlow::Continue(()))
            .unwrap();
    };
    // Until the cache is full: its own bookkeeping (an entry a block) has grown to its size.
    for _ in 0..150 {
        run(&mut engine);
    }
    let start = resident_bytes();
    for _ in 0..1000 {
        run(&mut engine);
    }
    let end = resident_bytes();
    let stats = engine.prompt_cache_stats().snapshot();
    eprintln!(
        "resident {:.1} -> {:.1} MiB; cache {} blocks ({:.1} MiB of a {:.1} MiB budget), {} evictions",
        start as f64 / (1 << 20) as f64,
        end as f64 / (1 << 20) as f64,
        stats.blocks,
        stats.bytes as f64 / (1 << 20) as f64,
        stats.budget_bytes as f64 / (1 << 20) as f64,
        stats.evictions_total
    );
    assert!(
        stats.evictions_total > 1000,
        "the run should churn the cache"
    );
    assert!(
        end as f64 <= start as f64 * 1.01,
        "resident memory grew from {start} to {end} bytes"
    );
}
