use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use ember_server::ServerOptions;

use crate::args::ServeArgs;

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    if !(args.shutdown_timeout.is_finite() && args.shutdown_timeout >= 0.0) {
        bail!("--shutdown-timeout must be a number of seconds >= 0");
    }
    if !(args.header_timeout.is_finite() && args.header_timeout > 0.0) {
        bail!("--header-timeout must be a number of seconds > 0");
    }
    if !(args.keep_warm.is_finite() && args.keep_warm >= 0.0) {
        bail!("--keep-warm must be a number of seconds >= 0");
    }
    let options = ServerOptions {
        host: args.host,
        port: args.port,
        model: super::model_path(&args.model)?,
        engine: ember_engine::EngineOptions {
            parallel: args.parallel.map(|n| n as usize),
            kv_pool_tokens: args.kv_pool_tokens,
            prompt_cache: args.prompt_cache_gib,
            prompt_cache_host: args.prompt_cache_host_gib,
            draft: args.draft.options()?,
            draft_model: args.draft.draft_model,
            ..super::engine_options(&args.model)
        },
        api_keys_file: args.api_keys_file,
        served_model_name: args.served_model_name,
        shutdown_timeout: Duration::from_secs_f64(args.shutdown_timeout),
        max_queue: args.max_queue,
        max_body_bytes: args.max_body_bytes,
        cors: ember_server::CorsOrigins::new(&args.cors_origin),
        connections: ember_server::ConnectionLimits {
            max_connections: args.max_connections.map_or_else(
                ember_server::ConnectionLimits::default_max_connections,
                |n| n as usize,
            ),
            header_timeout: Duration::from_secs_f64(args.header_timeout),
        },
        sampling: ember_server::SamplingOverrides {
            temperature: args.temp,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            seed: args.seed,
            repetition_penalty: args.repeat_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
        },
        default_max_tokens: match args.n_predict {
            -1 => None,
            0 => bail!("--n-predict 0 would generate nothing: give a limit of 1 or more, or -1"),
            n => Some(n as usize),
        },
        keep_warm: Duration::from_secs_f64(args.keep_warm),
        keepalive_interval: Duration::from_millis(args.keepalive_interval_ms),
        keepalive_warm: !args.no_keepalive_warm,
    };
    // The engine computes on its own threads; the runtime only moves bytes.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(ember_server::run(options))?;
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}
