//! The buffer list accounts for the engine's memory.
//!
//! This is its own test binary with one test, so that no other test allocates in the process
//! while resident memory is measured.
//!
//! Tolerance: after loading a ~120 MB checkpoint and generating (which touches every weight,
//! the whole KV cache, and every activation buffer, since heap buffers are written when
//! made), the growth of the process's resident memory must equal the listed bytes within
//! 16 MiB + 5%. The slack covers what is not an engine buffer: the tokenizer and template,
//! thread stacks, the allocator's own bookkeeping.

#![cfg(target_os = "linux")]

use std::ops::ControlFlow;

use ember_engine::sampler::SamplingParams;
use ember_engine::synthetic::{SyntheticDtype, write_checkpoint_for_config};
use ember_engine::{Engine, EngineOptions, GenerateParams};
use ember_tensor::BufferKind;
use serde_json::json;

fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[test]
fn listed_buffers_account_for_resident_memory_growth() {
    let dir = std::env::temp_dir().join(format!("ember-memory-accounting-{}", std::process::id()));
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 151936, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": true, "torch_dtype": "float32",
    });
    write_checkpoint_for_config(&config, SyntheticDtype::F32, &dir).unwrap();

    let before = resident_bytes();
    let options = EngineOptions {
        threads: Some(2),
        context: Some(4096),
        prefill_chunk: Some(64),
        kv_dtype: None,
        ..EngineOptions::default()
    };
    let mut engine = Engine::load(&dir, &options).unwrap();
    let prompt = engine
        .encode_prompt("Measuring what the engine holds.")
        .unwrap();
    let params = GenerateParams {
        max_tokens: 8,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        step_logits: false,
        cache_prompt: true,
        draft: true,
    };
    engine
        .generate(&prompt, &params, |_| ControlFlow::Continue(()))
        .unwrap();
    let growth = resident_bytes().saturating_sub(before) as f64;

    let buffers = engine.buffers();
    let listed: usize = buffers.iter().map(|b| b.bytes).sum();
    let by_kind = |kind| {
        buffers
            .iter()
            .filter(|b| b.kind == kind)
            .map(|b| b.bytes)
            .sum::<usize>()
    };
    assert!(
        by_kind(BufferKind::Weights) > 100 << 20,
        "the checkpoint is mapped and listed"
    );
    assert!(by_kind(BufferKind::KvCache) > 0 && by_kind(BufferKind::Activations) > 0);
    let listed = listed as f64;
    let tolerance = 16.0 * (1 << 20) as f64 + 0.05 * listed;
    eprintln!(
        "resident growth {:.1} MiB, listed {:.1} MiB",
        growth / (1 << 20) as f64,
        listed / (1 << 20) as f64
    );
    assert!(
        (growth - listed).abs() <= tolerance,
        "resident memory grew {:.1} MiB; the list holds {:.1} MiB (tolerance {:.1} MiB)",
        growth / (1 << 20) as f64,
        listed / (1 << 20) as f64,
        tolerance / (1 << 20) as f64
    );
    drop(engine);
    std::fs::remove_dir_all(&dir).ok();
}
