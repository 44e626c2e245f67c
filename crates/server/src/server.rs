//! Binding, loading, serving and shutting down.

use crate::cors::CorsOrigins;
use crate::listen::ConnectionLimits;
use ember_engine::sampler::SamplingParams;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ember_engine::constraint::ConstraintCompiler;
use ember_engine::prompt_cache::PromptCacheStats;
use ember_engine::{Engine, EngineOptions, PromptEncoder};
use ember_residency::{Keepalive, ResidencySet, ResidencyState};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::worker::{self, Job};

#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub host: String,
    pub port: u16,
    pub model: PathBuf,
    pub engine: EngineOptions,
    /// One key per line; when set, `/v1/*` needs `Authorization: Bearer KEY`.
    pub api_keys_file: Option<PathBuf>,
    /// The model name clients see; defaults to the model directory's name.
    pub served_model_name: Option<String>,
    /// How long in-flight requests may run on after SIGINT/SIGTERM before they are cancelled.
    pub shutdown_timeout: Duration,
    /// Requests that may wait for the engine; more get 503.
    pub max_queue: usize,
    /// Largest request body accepted; larger gets 413.
    pub max_body_bytes: usize,
    /// Tokens a request that names no limit may generate (`None`: to the end of the context).
    pub default_max_tokens: Option<usize>,
    /// Web origins whose pages may call the server (`--cors-origin`).
    pub cors: CorsOrigins,
    /// Sampling defaults set on the command line, over the model's.
    pub sampling: SamplingOverrides,
    /// How many connections may be open, and how long one may take to send its headers.
    pub connections: ConnectionLimits,
    /// How long after the last request the keepalive goes on ticking (zero: never ticks).
    pub keep_warm: Duration,
    /// Time between keepalive ticks (at most `ember_residency::MAX_INTERVAL`).
    pub keepalive_interval: Duration,
    /// Each tick also reads a byte of every held page, so page-table entries stay cached
    /// (`ember_residency::Keepalive`).
    pub keepalive_warm: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    ApiKeys { path: PathBuf, message: String },
    /// The engine's error is in the message and not given as the source, which would print
    /// it a second time in an error chain (`ember serve`'s `{:#}`).
    #[error("loading the model failed: {0}")]
    Load(ember_engine::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// An error after which the engine cannot serve (a tensor-parallel rank lost): every
    /// request then running or queued failed with it, and the server stopped.
    #[error("the engine stopped: {0}")]
    EngineFailed(ember_engine::Error),
}

impl From<ember_engine::Error> for ServerError {
    fn from(e: ember_engine::Error) -> Self {
        ServerError::Load(e)
    }
}

/// What the routes need once the model is loaded.
pub(crate) struct Ready {
    pub queue: mpsc::Sender<Job>,
    pub encoder: PromptEncoder,
    pub context: usize,
    pub residency: Arc<ResidencySet>,
    /// `None` when residency is turned off: there is nothing to keep warm.
    pub keepalive: Option<Arc<Keepalive>>,
    pub keep_warm: Duration,
    /// The prompt cache's budget, contents and counters, updated by the engine thread.
    pub prompt_cache: Arc<PromptCacheStats>,
    /// Responses' `system_fingerprint`: the build and what decides the model's arithmetic.
    pub fingerprint: String,
    /// The sampling of what a request leaves out: the model's defaults under the server's
    /// flags.
    pub sampling_defaults: SamplingParams,
    /// Turns requests' schemas and grammars into output constraints.
    pub constraints: Arc<ConstraintCompiler>,
    /// Requests generated at once, and the model's path (llama-server's `/props`).
    pub parallel: usize,
    pub model_path: String,
}

pub(crate) struct AppState {
    pub ready: OnceLock<Ready>,
    pub model_name: String,
    pub api_keys: Vec<String>,
    pub metrics: Arc<Metrics>,
    pub max_body_bytes: usize,
    /// [`ServerOptions::default_max_tokens`].
    pub default_max_tokens: Option<usize>,
    pub cors: CorsOrigins,
    pub created: u64,
}

/// Binds to `--host:--port`, then serves until SIGINT or SIGTERM.
pub async fn run(options: ServerOptions) -> Result<(), ServerError> {
    let addr = format!("{}:{}", options.host, options.port);
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.clone(),
            source,
        })?;
    serve(listener, options, shutdown_signal()).await
}

/// Serves on `listener` until `shutdown` completes; then stops accepting, lets in-flight
/// requests finish for up to the shutdown timeout, cancels what is left, and returns.
pub async fn serve(
    listener: TcpListener,
    options: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let api_keys = match &options.api_keys_file {
        Some(path) => read_api_keys(path)?,
        None => Vec::new(),
    };
    let model_name = options.served_model_name.clone().unwrap_or_else(|| {
        options
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "ember".into())
    });
    let local: SocketAddr = listener.local_addr()?;
    tracing::info!(
        "listening on http://{local}; loading {}",
        options.model.display()
    );
    let state = Arc::new(AppState {
        ready: OnceLock::new(),
        model_name,
        api_keys,
        metrics: Arc::new(Metrics::default()),
        max_body_bytes: options.max_body_bytes,
        default_max_tokens: options.default_max_tokens,
        cors: options.cors.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    });
    let abort = Arc::new(AtomicBool::new(false));

    let (load_failed_tx, load_failed_rx) = tokio::sync::oneshot::channel::<ember_engine::Error>();
    let (engine_failed_tx, engine_failed_rx) =
        tokio::sync::oneshot::channel::<ember_engine::Error>();
    let worker = {
        let (state, abort, options) = (Arc::clone(&state), Arc::clone(&abort), options.clone());
        std::thread::Builder::new()
            .name("ember-engine".into())
            .spawn(move || {
                let engine = match Engine::load(&options.model, &options.engine) {
                    Ok(engine) => engine,
                    Err(e) => {
                        let _ = load_failed_tx.send(e);
                        return;
                    }
                };
                let (queue, receiver) = mpsc::channel(options.max_queue.max(1));
                let residency = Arc::clone(engine.residency());
                // An inactive set (over the bound, refused) still gets ticks: on a GPU the tick
                // keeps the device's queue warm even when host memory is not held.
                let keepalive = (residency.stats().state != ResidencyState::Disabled).then(|| {
                    Arc::new(Keepalive::start_with(
                        Arc::clone(&residency),
                        options.keep_warm,
                        options.keepalive_interval,
                        options.keepalive_warm,
                        Box::new(engine.keepalive_tick()),
                    ))
                });
                let ready = Ready {
                    queue,
                    encoder: engine.encoder().clone(),
                    context: engine.context(),
                    residency,
                    keepalive: keepalive.clone(),
                    keep_warm: options.keep_warm,
                    prompt_cache: engine.prompt_cache_stats(),
                    fingerprint: fingerprint(&engine),
                    sampling_defaults: sampling_defaults(&engine, &options.sampling),
                    constraints: Arc::new(ConstraintCompiler::new(
                        Arc::clone(engine.tokenizer()),
                        engine.config().vocab_size,
                        engine.eos_token_ids(),
                    )),
                    parallel: engine.parallel(),
                    model_path: engine.dir().display().to_string(),
                };
                let device = engine.device_label();
                let context = ready.context;
                let _ = state.ready.set(ready);
                // Logged only once /health answers 200: tools wait for this line.
                tracing::info!(
                    "ready: serving {} on http://{local} (context {context}, on {device})",
                    state.model_name
                );
                let metrics = Arc::clone(&state.metrics);
                if let Some(e) = worker::run(engine, receiver, metrics, keepalive, abort) {
                    let _ = engine_failed_tx.send(e);
                }
            })?
    };

    let router = crate::routes::router(Arc::clone(&state));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let server = crate::listen::serve(listener, router, options.connections, stop_rx);
    let mut server = std::pin::pin!(server);

    let load_failed = async move {
        match load_failed_rx.await {
            Ok(e) => Some(e),
            Err(_) => std::future::pending().await,
        }
    };
    let engine_failed = async move {
        match engine_failed_rx.await {
            Ok(e) => e,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        result = &mut server => return result.map_err(ServerError::Io),
        error = load_failed => {
            let _ = stop_tx.send(true);
            return Err(ServerError::Load(error.expect("a load error")));
        }
        error = engine_failed => {
            // Every request has had its answer: stop listening, let the connections carry
            // their errors out, and leave.
            tracing::error!("stopping: the engine cannot serve any more");
            let _ = stop_tx.send(true);
            if let Some(keepalive) = state.ready.get().and_then(|r| r.keepalive.as_ref()) {
                keepalive.stop();
            }
            let _ = tokio::time::timeout(options.shutdown_timeout, &mut server).await;
            drop(worker);
            return Err(ServerError::EngineFailed(error));
        }
        () = shutdown => {}
    }

    let in_flight = state.metrics.running.load(Ordering::Relaxed)
        + state.metrics.queued.load(Ordering::Relaxed);
    tracing::info!(
        "shutting down: no new connections; {in_flight} requests get up to {:?} to finish",
        options.shutdown_timeout
    );
    let _ = stop_tx.send(true);
    // Ticks are for an idle server that will serve again; this one will not. The tick in flight,
    // if any, is a 16-byte copy, so this returns at once.
    if let Some(keepalive) = state.ready.get().and_then(|r| r.keepalive.as_ref()) {
        keepalive.stop();
    }
    if tokio::time::timeout(options.shutdown_timeout, &mut server)
        .await
        .is_err()
    {
        tracing::warn!("shutdown timeout passed: cancelling the requests still running");
        abort.store(true, Ordering::Relaxed);
        // Cancelled streams end at their next token; give them a moment to say so.
        let _ = tokio::time::timeout(Duration::from_secs(1), &mut server).await;
    }
    abort.store(true, Ordering::Relaxed);
    drop(worker);
    Ok(())
}

fn read_api_keys(path: &PathBuf) -> Result<Vec<String>, ServerError> {
    let text = std::fs::read_to_string(path).map_err(|e| ServerError::ApiKeys {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if keys.is_empty() {
        return Err(ServerError::ApiKeys {
            path: path.clone(),
            message: "no keys in the file (one key per line)".into(),
        });
    }
    Ok(keys)
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

/// `fp_` and 16 hex digits of a hash (FNV-1a) of ember's version, the model's path, the device
/// and the KV cache's type: what a reply's bits depend on besides the request. Replies with the
/// same fingerprint and seed are the same (OpenAI's meaning of the field).
fn fingerprint(engine: &ember_engine::Engine) -> String {
    let identity = format!(
        "ember {} | {} | {} | {}",
        env!("CARGO_PKG_VERSION"),
        engine.dir().display(),
        engine.device_label(),
        engine.kv_dtype().name(),
    );
    let hash = identity.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("fp_{hash:016x}")
}

/// Sampling defaults set on the command line (`--temp`, `--top-k`, `--top-p`, `--min-p`,
/// `--seed`, `--repeat-penalty`, `--presence-penalty`, `--frequency-penalty`): each, where
/// set, replaces the model's default; a request's own field wins.
#[derive(Clone, Copy, Debug, Default)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
}

/// The model's sampling defaults with the command line's over them, logged once.
fn sampling_defaults(engine: &ember_engine::Engine, flags: &SamplingOverrides) -> SamplingParams {
    let model = engine.sampling_defaults();
    let mut p = model.params;
    p.temperature = flags.temperature.unwrap_or(p.temperature);
    p.top_k = flags.top_k.unwrap_or(p.top_k);
    p.top_p = flags.top_p.unwrap_or(p.top_p);
    p.min_p = flags.min_p.unwrap_or(p.min_p);
    p.seed = flags.seed.or(p.seed);
    let q = &mut p.penalties;
    q.repetition = flags.repetition_penalty.unwrap_or(q.repetition);
    q.presence = flags.presence_penalty.unwrap_or(q.presence);
    q.frequency = flags.frequency_penalty.unwrap_or(q.frequency);
    let flagged = flags.temperature.is_some()
        || flags.top_k.is_some()
        || flags.top_p.is_some()
        || flags.min_p.is_some()
        || flags.seed.is_some()
        || flags.repetition_penalty.is_some()
        || flags.presence_penalty.is_some()
        || flags.frequency_penalty.is_some();
    let q = p.penalties;
    let penalties = if q.any() {
        format!(
            ", repetition_penalty {}, presence_penalty {}, frequency_penalty {}",
            q.repetition, q.presence, q.frequency
        )
    } else {
        String::new()
    };
    tracing::info!(
        "sampling defaults: temperature {}, top_k {}, top_p {}, min_p {}{}{} (from {}{}); a \
         request's own fields win",
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.seed.map(|s| format!(", seed {s}")).unwrap_or_default(),
        penalties,
        model.source,
        if flagged {
            ", with the command line's over them"
        } else {
            ""
        },
    );
    p
}
