//! ember against llama.cpp on real GGUF models: the same prompt tokens, the same 48 greedy
//! tokens on every prompt, and at every step the same top-2 logits.
//!
//! The references are recorded by `scripts/record_llamacpp.py` (llama-cpp-python 0.3.36 =
//! llama.cpp 0c1e570 built for AVX-512, f16 cache, no flash attention, greedy, 48 tokens) into
//! `tests/fixtures/llamacpp/`, with llama.cpp's top-2 token ids and logits (to 5 decimals) at
//! every step.
//!
//! Why it holds to the bit: ember computes every token with the arithmetic of llama.cpp's CPU
//! backend for a lone token, op by op: RMSNorm, RoPE, softmax, SwiGLU, the activation
//! quantization, the Q4_1, Q4_K and Q6_K products (`ggml_vec_dot_q4_1_q8_1`, the repacked
//! `ggml_gemv_q4_K_8x8_q8_K`, `ggml_vec_dot_q6_K_q8_K`) and the attention's f16 products
//! (`ggml_vec_dot_f16`). It does so for every row of a prompt chunk too, so that a row's result
//! never depends on the rows beside it (a prompt resumed from the prompt cache gives the bits
//! of a cold one: `prompt_cache.rs`). llama.cpp takes other kernels for a batch of tokens (Q4_K
//! rows in groups of four, Q6_K products of eight rows or more, tinyBLAS for the f16
//! attention), so the references are recorded with one token per batch (`n_batch = n_ubatch =
//! 1`), where llama.cpp takes its one-token kernels throughout. These models quantize every
//! layer's input to 8 bits, so a last-bit difference anywhere flips some roundings and moves
//! the logits by tenths: matching logits to 1e-5 means matching arithmetic. SmolLM2's Q8_0
//! output layer keeps ember's own summation order, within `SMOLLM2_LOGIT_TOLERANCE`.
//! `scripts/llamacpp_dump` and the `llamacpp_ops` example compare ember with llama.cpp tensor
//! by tensor.

use std::ops::ControlFlow;
use std::path::PathBuf;

use ember_engine::sampler::SamplingParams;
use ember_engine::{Engine, EngineOptions, GenerateParams};
use serde_json::Value;

/// The recorded logits are rounded to 5 decimals; f32 near 20 has steps of 2e-6.
const LOGIT_TOLERANCE: f64 = 1e-5;
/// SmolLM2's Q8_0 output layer sums in ember's order, not llama.cpp's.
const SMOLLM2_LOGIT_TOLERANCE: f64 = 5e-5;

fn model_path(file: &str) -> Option<PathBuf> {
    let mut dirs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")];
    if let Some(dir) = std::env::var_os("EMBER_MODELS_DIR") {
        dirs.insert(0, PathBuf::from(dir));
    }
    dirs.into_iter().map(|d| d.join(file)).find(|p| p.is_file())
}

/// Runs every recorded prompt: every token and every step's top-2 logits must agree.
fn check(fixture: &str, required: bool, tolerance: f64) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llamacpp")
        .join(fixture);
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let file = reference["model"]["file"].as_str().unwrap();
    let Some(model) = model_path(file) else {
        let fetch = if file.starts_with("SmolLM2") {
            "smollm2"
        } else {
            "qwen2.5-coder-1.5b"
        };
        if required && std::env::var_os("CI").is_some() {
            panic!("{file} is missing: CI must run scripts/fetch-model {fetch}");
        }
        eprintln!("SKIPPED: {file} is not in models/ (scripts/fetch-model {fetch})");
        return;
    };
    let options = EngineOptions {
        threads: Some(2),
        context: Some(512),
        prefill_chunk: Some(512),
        kv_dtype: None,
        ..EngineOptions::default()
    };
    let mut engine = Engine::load(&model, &options).unwrap();

    if let Some(extras) = reference["tokenizer_extras"].as_array() {
        for extra in extras {
            let text = extra["text"].as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(extra["ids_special"].clone()).unwrap();
            assert_eq!(
                engine.tokenizer().encode(text, false).unwrap(),
                want,
                "tokenizing {text:?}"
            );
        }
    }

    let ids = |v: &Value| -> Vec<u32> { serde_json::from_value(v.clone()).unwrap() };
    let floats = |v: &Value| -> Vec<f64> { serde_json::from_value(v.clone()).unwrap() };
    let mut worst = 0f64;
    for case in reference["prompts"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = case["prompt"].as_str().unwrap();
        let prompt_ids = ids(&case["prompt_ids"]);
        assert_eq!(
            engine.encode_prompt(prompt).unwrap(),
            prompt_ids,
            "tokenizing {prompt:?}"
        );
        let want = ids(&case["generated_ids"]);
        let (top1, top2_id, top2) = (
            floats(&case["top1_logit"]),
            ids(&case["top2_id"]),
            floats(&case["top2_logit"]),
        );
        let params = GenerateParams {
            max_tokens: want.len(),
            sampling: SamplingParams::default(),
            ignore_eos: true,
            step_logits: true,
            cache_prompt: true,
            draft: true,
        };
        // Per step: ember's logits of llama.cpp's top-2 tokens.
        let mut steps = Vec::new();
        let generation = engine
            .generate(&prompt_ids, &params, |step| {
                let logits = step.logits.expect("logits asked for");
                let i = steps.len();
                steps.push((
                    logits[want[i] as usize] as f64,
                    logits[top2_id[i] as usize] as f64,
                ));
                ControlFlow::Continue(())
            })
            .unwrap();
        let matched = generation
            .tokens
            .iter()
            .zip(&want)
            .take_while(|(a, b)| a == b)
            .count();
        // Up to the first divergence (after it the inputs differ), the logits.
        for (i, &(ours1, ours2)) in steps.iter().enumerate().take(matched + 1) {
            let diff = (ours1 - top1[i]).abs().max((ours2 - top2[i]).abs());
            worst = worst.max(diff);
            assert!(
                diff <= tolerance,
                "{fixture} {name}: step {i}: ember's logits of llama.cpp's top-2 tokens are \
                 {ours1:.5}, {ours2:.5}; llama.cpp's {:.5}, {:.5}",
                top1[i],
                top2[i]
            );
        }
        assert_eq!(
            matched,
            want.len(),
            "{fixture} {name}: {matched} of {} tokens agree",
            want.len()
        );
    }
    eprintln!("{fixture}: every token agrees; logits within {worst:.1e} of llama.cpp's");
}

#[test]
fn smollm2_matches_llamacpp() {
    check(
        "smollm2-135m-instruct-q4_1.json",
        true,
        SMOLLM2_LOGIT_TOLERANCE,
    );
}

#[test]
fn qwen25_coder_matches_llamacpp() {
    check(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.json",
        false,
        LOGIT_TOLERANCE,
    );
}
