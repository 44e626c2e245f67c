use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::process::ExitCode;

use anyhow::Context;
use ember_engine::chat_template::ChatMessage;
use ember_engine::detokenizer::StreamDecoder;
use ember_engine::sampler::{Penalties, SamplingParams};
use ember_engine::{FinishReason, GenerateParams};

use crate::args::RunArgs;

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        penalties: Penalties {
            repetition: args.repeat_penalty,
            presence: args.presence_penalty,
            frequency: args.frequency_penalty,
            last_n: None,
        },
    };
    // Bad flags fail before seconds are spent loading a model.
    sampling.validate()?;
    let options = ember_engine::EngineOptions {
        draft: args.draft.options()?,
        draft_model: args.draft.draft_model.clone(),
        ..super::engine_options(&args.model)
    };
    let mut engine = super::load_engine_with(&args.model, &options)?;
    let prompt = if args.chat {
        let mut kwargs = serde_json::Map::new();
        if args.no_think {
            kwargs.insert("enable_thinking".into(), false.into());
        }
        let message = ChatMessage::new("user", args.prompt.clone());
        engine.encode_chat(&[message], &kwargs)?
    } else {
        engine.encode_prompt(&args.prompt)?
    };
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampling,
        ignore_eos: args.ignore_eos,
        step_logits: false,
        cache_prompt: true,
        draft: true,
    };
    let mut decoder = StreamDecoder::new(engine.tokenizer().clone());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_error = None;
    let generation = engine.generate(&prompt, &params, |step| {
        // The end-of-sequence token is not part of the text.
        if step.is_eos && !params.ignore_eos {
            return ControlFlow::Continue(());
        }
        if let Some(text) = decoder.push(step.token)
            && let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush())
        {
            write_error = Some(e);
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    })?;
    if let Some(e) = write_error {
        // A closed pipe (`ember run … | head`) is the reader's choice, not a failure.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(ExitCode::SUCCESS);
        }
        return Err(e).context("writing to stdout");
    }
    if let Some(text) = decoder.flush() {
        out.write_all(text.as_bytes())
            .context("writing to stdout")?;
    }
    // A terminal gets a final newline so the shell prompt starts on its own line; a pipe gets
    // exactly the generated text.
    if std::io::stdout().is_terminal() {
        writeln!(out).ok();
    }
    out.flush().ok();

    let prefill_s = generation.prefill_time.as_secs_f64();
    let decode_s = generation.decode_time.as_secs_f64();
    let decoded = generation.tokens.len().saturating_sub(1);
    let drafts = match generation.drafted_tokens {
        0 => String::new(),
        n => format!(" | drafts: {} of {n} kept", generation.accepted_tokens),
    };
    eprintln!(
        "prompt: {} tokens in {:.3} s ({:.1} tok/s) | generated: {} tokens, {:.2} tok/s | finish: {}{drafts}",
        generation.prompt_tokens,
        prefill_s,
        generation.prompt_tokens as f64 / prefill_s.max(1e-9),
        generation.tokens.len(),
        if decode_s > 0.0 {
            decoded as f64 / decode_s
        } else {
            0.0
        },
        match generation.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    );
    Ok(ExitCode::SUCCESS)
}
