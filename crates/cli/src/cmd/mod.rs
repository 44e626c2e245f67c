pub mod bench;
pub mod gen_checkpoint;
pub mod run;
pub mod serve;

use anyhow::Context;
use ember_engine::{Engine, EngineOptions};

use crate::args::ModelArgs;

/// Loads the model named by the shared flags, logging what was loaded and how long it took.
pub fn load_engine(args: &ModelArgs) -> anyhow::Result<Engine> {
    let options = EngineOptions {
        threads: args.threads,
        context: args.context,
        ..EngineOptions::default()
    };
    let start = std::time::Instant::now();
    let engine = Engine::load(&args.model, &options)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let bytes: usize = engine.buffers().iter().map(|b| b.bytes).sum();
    tracing::info!(
        "loaded {} ({}, {} layers) in {:.2} s: {} buffers, {:.2} GiB, {} threads, context {}",
        args.model.display(),
        engine.config().architecture.hf_name(),
        engine.config().num_hidden_layers,
        start.elapsed().as_secs_f64(),
        engine.buffers().len(),
        bytes as f64 / (1u64 << 30) as f64,
        engine.threads(),
        engine.context(),
    );
    Ok(engine)
}

pub fn engine_options(args: &ModelArgs) -> EngineOptions {
    EngineOptions {
        threads: args.threads,
        context: args.context,
        ..EngineOptions::default()
    }
}
