use std::process::ExitCode;

use ember_engine::EngineOptions;
use ember_engine::bench::{
    BatchBenchOptions, DecodeBenchOptions, TurnBenchOptions, bench_batch, bench_decode, bench_turn,
};

use crate::args::{BenchBatchArgs, BenchCommand, BenchDecodeArgs, BenchTurnArgs};

pub fn run(command: BenchCommand) -> anyhow::Result<ExitCode> {
    match command {
        BenchCommand::Decode(args) => decode(args),
        BenchCommand::Idle(args) => super::bench_idle::run(args),
        BenchCommand::Turn(args) => turn(args),
        BenchCommand::Serve(args) => super::bench_serve::run(args),
        BenchCommand::Batch(args) => batch(args),
        BenchCommand::Quality(args) => super::bench_quality::run(args),
    }
}

fn batch(args: BenchBatchArgs) -> anyhow::Result<ExitCode> {
    let most = args.sequences.iter().copied().max().unwrap_or(1);
    if args.sequences.contains(&0) {
        anyhow::bail!("--sequences: every setting needs at least 1 sequence");
    }
    let options = EngineOptions {
        parallel: Some(most),
        ..super::engine_options(&args.model)
    };
    let mut engine = super::load_engine_with(&args.model, &options)?;
    let lines = bench_batch(
        &mut engine,
        &BatchBenchOptions {
            prompt_tokens: args.prompt_tokens,
            decode_tokens: args.decode_tokens,
            sequences: args.sequences,
            probe_bytes: args.probe_mib << 20,
            profile_steps: args.profile_steps,
            profile_prefill: args.profile_prefill,
        },
    )?;
    for line in lines {
        println!("{}", line.to_json());
    }
    Ok(ExitCode::SUCCESS)
}

fn turn(args: BenchTurnArgs) -> anyhow::Result<ExitCode> {
    let options = EngineOptions {
        prompt_cache: args.prompt_cache_gib,
        ..super::engine_options(&args.model)
    };
    let mut engine = super::load_engine_with(&args.model, &options)?;
    let report = bench_turn(
        &mut engine,
        &TurnBenchOptions {
            history_tokens: args.history_tokens,
            reply_tokens: args.reply_tokens,
            new_tokens: args.new_tokens,
            repeats: args.repeats,
        },
    )?;
    if report.cached_tokens < args.history_tokens {
        // Then the figure measures a cache too small for the history, not a resumed turn.
        tracing::warn!(
            "the prompt cache held {} of the history's {} tokens: raise --prompt-cache-gib",
            report.cached_tokens,
            args.history_tokens
        );
    }
    if args.json {
        println!("{}", report.to_json());
    } else {
        println!("model            {}", report.model);
        println!("device           {}", report.device);
        println!(
            "second turn      {} prompt tokens, {} from the cache",
            report.prompt_tokens, report.cached_tokens
        );
        println!(
            "first token      {:.1} ms cached, {:.1} ms cold ({:.1}% of cold; medians of {})",
            report.cached_s * 1e3,
            report.cold_s * 1e3,
            report.cached_s / report.cold_s * 100.0,
            report.cold_runs.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn decode(args: BenchDecodeArgs) -> anyhow::Result<ExitCode> {
    let mut engine = super::load_engine(&args.model)?;
    let options = DecodeBenchOptions {
        prompt_tokens: args.prompt_tokens,
        decode_tokens: args.decode_tokens,
        repeats: args.repeats,
        probe_bytes: args.probe_mib << 20,
        step_logits: args.step_logits,
    };
    let report = bench_decode(&mut engine, &options)?;
    if args.json {
        println!("{}", report.to_json());
    } else {
        println!("model            {}", report.model);
        println!("device           {}", report.device);
        println!(
            "prefill          {:.1} tok/s  (pp{} in chunks of {}, median of {})",
            report.prefill_tok_s,
            args.prompt_tokens,
            report.prefill_chunk,
            report.prefill_runs.len()
        );
        println!(
            "decode           {:.2} tok/s  (tg{}, median of {})",
            report.decode_tok_s,
            args.decode_tokens,
            report.decode_runs.len()
        );
        println!("bytes per token  {:.3} GB", report.bytes_per_token / 1e9);
        println!("read bandwidth   {:.1} GB/s", report.bandwidth_gb_s);
        println!(
            "bound            {:.2} tok/s  (decode at {:.0}% of it)",
            report.bound_tok_s,
            report.decode_tok_s / report.bound_tok_s * 100.0
        );
    }
    Ok(ExitCode::SUCCESS)
}
