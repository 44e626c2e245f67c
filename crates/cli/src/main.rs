//! `ember`: run, serve and benchmark local LLMs.

mod args;
mod cmd;
mod http_client;
mod server_process;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // NVLink multicast (NVLS) stays off in NCCL unless the environment asks for it: a program
    // using it can take a shared host's GPUs out of service, and tensor parallelism's
    // all-gathers do not need it. Set before any thread starts.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: no other thread exists yet to read the environment.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let args = args::Cli::parse();
    init_logging();
    let result = match args.command {
        args::Command::Run(run) => cmd::run::run(run),
        args::Command::Serve(serve) => cmd::serve::run(*serve),
        args::Command::Bench(bench) => cmd::bench::run(bench),
        args::Command::GenCheckpoint(gen_args) => cmd::gen_checkpoint::run(gen_args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr (stdout carries generated text only); `EMBER_LOG` sets the filter.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("EMBER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}
