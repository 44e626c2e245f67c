pub mod bench;
pub mod bench_idle;
pub mod bench_quality;
pub mod bench_serve;
pub mod gen_checkpoint;
pub mod run;
pub mod serve;

use std::path::PathBuf;

use anyhow::Context;
use ember_engine::prompt_cache::CacheBudget;
use ember_engine::{Engine, EngineOptions, KvDtype, ResidencyMode};

use crate::args::ModelArgs;

/// Loads the model named by the shared flags, logging what was loaded and how long it took.
pub fn load_engine(args: &ModelArgs) -> anyhow::Result<Engine> {
    load_engine_with(args, &engine_options(args))
}

/// [`load_engine`] with options the command has adjusted.
pub fn load_engine_with(args: &ModelArgs, options: &EngineOptions) -> anyhow::Result<Engine> {
    let model = model_path(args)?;
    let start = std::time::Instant::now();
    let engine =
        Engine::load(&model, options).with_context(|| format!("loading {}", model.display()))?;
    let bytes: usize = engine.buffers().iter().map(|b| b.bytes).sum();
    tracing::info!(
        "loaded {} ({}, {} layers) in {:.2} s: {} buffers, {:.2} GiB, on {}, context {} ({} cache)",
        model.display(),
        engine.config().architecture.hf_name(),
        engine.config().num_hidden_layers,
        start.elapsed().as_secs_f64(),
        engine.buffers().len(),
        bytes as f64 / (1u64 << 30) as f64,
        engine.device_label(),
        engine.context(),
        engine.kv_dtype().name(),
    );
    Ok(engine)
}

pub fn engine_options(args: &ModelArgs) -> EngineOptions {
    EngineOptions {
        threads: args.threads,
        context: args.context,
        kv_dtype: args.kv_type.as_deref().map(|t| match t {
            "f32" => KvDtype::F32,
            "f16" => KvDtype::F16,
            "bf16" => KvDtype::Bf16,
            _ => unreachable!("clap accepts only f32, f16 and bf16"),
        }),
        residency: match (args.no_residency, args.residency.as_str()) {
            (true, _) => ResidencyMode::Off,
            (false, "required") => ResidencyMode::Required,
            (false, _) => ResidencyMode::Auto,
        },
        load_limit_gib: args.load_limit_gib,
        device: args.device,
        cuda_graphs: !args.no_cuda_graphs,
        batch_invariant: args.batch_invariant,
        prefill_chunk: args.prefill_chunk.map(|n| n as usize),
        // One-off commands run one sequence and gain nothing from keeping prompts; `serve`
        // sets its own.
        parallel: Some(1),
        kv_pool_tokens: None,
        prompt_cache: CacheBudget::Off,
        prompt_cache_host: CacheBudget::Off,
        draft: Default::default(),
        draft_model: None,
        tensor_parallel: args.tensor_parallel as usize,
        collectives: args.collectives,
        expert_parallel: args.expert_parallel,
        rank_fault: args.fail_rank,
    }
}

/// The default model's file name, as `scripts/fetch-model smollm2` writes it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `--model`, or the default model: in `$EMBER_MODELS_DIR`, `./models`, or the `models/` folder
/// of the checkout this binary was built in.
pub fn model_path(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    if let Some(model) = &args.model {
        return Ok(model.clone());
    }
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("EMBER_MODELS_DIR") {
        candidates.push(PathBuf::from(dir).join(DEFAULT_MODEL_FILE));
    }
    candidates.push(PathBuf::from("models").join(DEFAULT_MODEL_FILE));
    candidates.push(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models")
            .join(DEFAULT_MODEL_FILE),
    );
    if let Some(found) = candidates.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    anyhow::bail!(
        "no --model given and the default model is missing (looked for {DEFAULT_MODEL_FILE} in $EMBER_MODELS_DIR, ./models and {}); fetch it with: scripts/fetch-model smollm2",
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models")
            .display()
    )
}
