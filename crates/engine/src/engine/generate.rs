//! Prompts and decode steps: a request's prefix from the prompt cache, the rest computed in
//! chunks, then one token a step until a stop.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use ember_models::{Logits, PassInput};

use super::picker::Picker;
use super::{BatchEvent, Engine};
use crate::constraint::Constraint;
use crate::error::{Error, Result};
use crate::kv::Transfer;
use crate::sampler::SamplingParams;
use crate::scheduler::SeqId;

/// One generation request.
#[derive(Clone, Copy, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep going past end-of-sequence tokens until `max_tokens`.
    pub ignore_eos: bool,
    /// Hand each step's logits to the caller ([`Step::logits`]; for log-probabilities). Off,
    /// a greedy generation on a GPU picks each token on the device and brings back only it.
    pub step_logits: bool,
    /// Take the longest cached prefix of the prompt and keep this request's blocks when it
    /// ends (llama.cpp's `cache_prompt`); off, the request neither reads nor feeds the cache.
    pub cache_prompt: bool,
    /// Whether the batched loop may draft tokens for this request when the engine drafts
    /// (`"draft": false` turns it off for one request); the output is the same either way.
    pub draft: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, or the caller asked to stop.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

/// What one generated token looked like, handed to the caller as it is produced.
pub struct Step<'a> {
    pub token: u32,
    /// The logits it was sampled from; `None` when they stayed where they were made (a
    /// greedy generation without [`GenerateParams::step_logits`]).
    pub logits: Option<&'a [f32]>,
    /// Whether it ends the sequence (it is still reported; callers usually do not print it).
    pub is_eos: bool,
    /// Prompt tokens of this request that came from the prompt cache (the same every step):
    /// a server reports them before the first token is out.
    pub cached_tokens: usize,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prompt cache, not a prefill.
    pub cached_tokens: usize,
    /// Prompt processing up to the first token.
    pub prefill_time: Duration,
    /// From the first token to the last.
    pub decode_time: Duration,
    /// Tokens drafted for the request and verified (speculative decoding), and those of them
    /// the model accepted.
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
}

impl Engine {
    /// Gives the sequence blocks for `n` more positions (evicting cached prefixes if it must)
    /// and runs the copies that makes between the pool and its host tier.
    fn reserve(&mut self, n: usize) -> Result<()> {
        let positions = self.seq.len() + n;
        if positions > self.context() {
            return Err(Error::Model(ember_models::Error::ContextFull {
                used: self.seq.len(),
                requested: n,
                capacity: self.context(),
            }));
        }
        self.blocks
            .reserve(&mut self.seq, positions, &mut self.transfers)?;
        self.run_transfers()
    }

    /// Enqueues the block manager's copies, in order, ahead of the next pass.
    pub(super) fn run_transfers(&mut self) -> Result<()> {
        let kv = self.runner.kv();
        for transfer in self.transfers.drain(..) {
            match transfer {
                Transfer::ToHost { block, slot } => kv.save_to_host(block, slot)?,
                Transfer::FromHost { slot, block } => kv.load_from_host(slot, block)?,
            }
        }
        Ok(())
    }

    fn forward(&mut self, tokens: &[u32], logits: Logits) -> Result<&[f32]> {
        self.reserve(tokens.len())?;
        self.runner.forward(&mut self.seq, tokens, logits)
    }

    fn forward_greedy(&mut self, tokens: &[u32]) -> Result<u32> {
        self.reserve(tokens.len())?;
        self.runner.forward_greedy(&mut self.seq, tokens)
    }

    fn forward_ahead(&mut self, input: PassInput<'_>) -> Result<()> {
        let n = match input {
            PassInput::Tokens(tokens) => tokens.len(),
            PassInput::Fed => 1,
        };
        self.reserve(n)?;
        self.runner.forward_ahead(&mut self.seq, input)
    }

    /// Appends `tokens` to the sequence, in chunks of the batch size, and returns the logits
    /// after the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        let last = self.prefill_all_but_the_last_chunk(tokens, &|| false)?;
        self.forward(last, Logits::Last)
    }

    /// [`Self::prefill`], returning the greedy choice after the last token (the index of the
    /// largest logit, by `ember_tensor::cpu::argmax`'s rule) instead of the logits, which a
    /// GPU keeps.
    pub fn prefill_greedy(&mut self, tokens: &[u32]) -> Result<u32> {
        let last = self.prefill_all_but_the_last_chunk(tokens, &|| false)?;
        self.forward_greedy(last)
    }

    /// Runs every chunk of a non-empty prompt but the last, and returns the last; `None` when
    /// `stop` asked to stop between two chunks.
    fn prefill_all_but_the_last_chunk<'t>(
        &mut self,
        tokens: &'t [u32],
        stop: &dyn Fn() -> bool,
    ) -> Result<&'t [u32]> {
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let chunk = self.runner.max_batch();
        let last = (tokens.len() - 1) / chunk * chunk;
        for part in tokens[..last].chunks(chunk) {
            if stop() {
                return Err(Error::Cancelled);
            }
            self.forward(part, Logits::Last)?;
        }
        Ok(&tokens[last..])
    }

    /// Appends one token and returns the logits after it.
    pub fn step(&mut self, token: u32) -> Result<&[f32]> {
        self.forward(&[token], Logits::Last)
    }

    /// Appends one token and returns the greedy choice after it ([`Self::prefill_greedy`]).
    pub fn step_greedy(&mut self, token: u32) -> Result<u32> {
        self.forward_greedy(&[token])
    }

    /// Prefills `prompt` and decodes greedily (the picks of [`Self::prefill_greedy`]) up to
    /// `limit` tokens, each handed to `on_token` once it is on the host; `on_token` stops the
    /// decode by returning `ControlFlow::Break`. Each step is enqueued before the token it
    /// takes has reached the host, fed by the pick where it was made
    /// ([`ember_models::Backend::pick_ahead`]), so a GPU does not idle while the host reads a
    /// token and launches the next step; a step run for a token that ended the decode is
    /// dropped, its position too. The tokens are those of [`Self::step_greedy`] one by one.
    pub fn decode_greedy(
        &mut self,
        prompt: &[u32],
        limit: usize,
        on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<()> {
        self.decode_greedy_until(prompt, limit, &|| false, on_token)
    }

    /// [`Self::decode_greedy`] that also stops, with [`Error::Cancelled`], when `stop` says so
    /// between two prompt chunks.
    fn decode_greedy_until(
        &mut self,
        prompt: &[u32],
        limit: usize,
        stop: &dyn Fn() -> bool,
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<()> {
        if limit == 0 {
            return Ok(());
        }
        let last = self.prefill_all_but_the_last_chunk(prompt, stop)?;
        self.forward_ahead(PassInput::Tokens(last))?;
        let mut made = 0;
        loop {
            // One pick is in flight; the step that takes it goes first if it may be needed.
            let ahead = made + 1 < limit;
            if ahead {
                self.forward_ahead(PassInput::Fed)?;
            }
            let token = self.runner.read_pick()?;
            made += 1;
            if on_token(token).is_break() || made >= limit {
                if ahead {
                    // That step's token ended the decode: its pick and position go.
                    self.runner.read_pick()?;
                    let len = self.seq.len() - 1;
                    self.seq.truncate(len);
                }
                return Ok(());
            }
        }
    }

    /// Generates from `prompt` on a fresh sequence. `on_step` sees every token as it is made and
    /// may stop generation early by returning `ControlFlow::Break`.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_step: impl FnMut(Step<'_>) -> ControlFlow<()>,
    ) -> Result<Generation> {
        self.generate_until(prompt, params, None, &|| false, on_step)
    }

    /// [`Self::generate`] with the output held to `constraint` when given, that also gives
    /// up, with [`Error::Cancelled`], when `stop` says so between two prompt chunks (a client
    /// gone mid-prefill); `on_step` stops it once tokens come.
    ///
    /// With [`GenerateParams::cache_prompt`] (and a prompt cache), the prompt's longest cached
    /// prefix is taken instead of prefilled (at least its last token is always computed, for
    /// its logits), and when the request ends, however it ends, the full blocks of its prompt
    /// and reply are left to the cache.
    pub fn generate_until(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        constraint: Option<Constraint>,
        stop: &dyn Fn() -> bool,
        on_step: impl FnMut(Step<'_>) -> ControlFlow<()>,
    ) -> Result<Generation> {
        params.sampling.validate()?;
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if prompt.len() >= self.context() {
            return Err(Error::PromptTooLong {
                prompt_tokens: prompt.len(),
                context: self.context(),
            });
        }
        // Drafts are verified in the batched loop only: there, alone, the request drafts and
        // gets the same tokens.
        if params.draft && constraint.is_none() && self.drafts() && self.pending_requests() == 0 {
            return self.generate_drafted(prompt, params, stop, on_step);
        }
        self.reset();
        let cache = params.cache_prompt && self.cache_enabled;
        let mut seq = self.blocks.start(prompt, cache, &mut self.transfers)?;
        std::mem::swap(&mut self.seq, &mut seq);
        let started = self.run_transfers();
        let cached = self.seq.len();
        if cache {
            self.cache_stats.record_lookup(cached);
        }
        let mut tokens = Vec::with_capacity(prompt.len() + params.max_tokens);
        tokens.extend_from_slice(prompt);
        let result = started.and_then(|()| {
            let picker = Picker::new(params.sampling, constraint);
            self.run_generation(&mut tokens, cached, params, picker, stop, on_step)
        });
        // The positions filled hold `tokens`' keys and values: the prompt's, then the reply's
        // but its last token's (never run). A failed pass may have left garbage past them,
        // and a device error anything anywhere: then nothing new is cached.
        let filled = self.seq.len().min(tokens.len());
        let keep = cache && !matches!(&result, Err(e) if !e.is_cancellation());
        let mut seq = std::mem::take(&mut self.seq);
        self.blocks.finish(&mut seq, &tokens[..filled], keep);
        self.seq = seq;
        self.publish_cache_stats();
        let mut generation = result?;
        generation.cached_tokens = cached;
        Ok(generation)
    }

    /// The prefill of `prompt[cached..]` (`tokens` holds the prompt) and the decode, each
    /// token appended to `tokens`.
    fn run_generation(
        &mut self,
        tokens: &mut Vec<u32>,
        cached: usize,
        params: &GenerateParams,
        mut picker: Picker,
        stop: &dyn Fn() -> bool,
        mut on_step: impl FnMut(Step<'_>) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let prompt_len = tokens.len();
        let (eos_ids, context) = (self.eos_ids.clone(), self.context());
        let start = Instant::now();
        let mut finish_reason = FinishReason::Length;
        let mut first_token_at = None;
        // Each token as it comes: whether generation goes on after it.
        let mut accept = |tokens: &mut Vec<u32>, token: u32, logits: Option<&[f32]>| {
            first_token_at.get_or_insert_with(Instant::now);
            let is_eos = eos_ids.contains(&token);
            tokens.push(token);
            let flow = on_step(Step {
                token,
                logits,
                is_eos,
                cached_tokens: cached,
            });
            if flow.is_break() || (is_eos && !params.ignore_eos) {
                finish_reason = FinishReason::Stop;
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        };
        // At most this many, and the last one's position inside the context.
        let limit = params.max_tokens.min(context - prompt_len);
        let rest = tokens[cached..].to_vec();
        if picker.is_plain_greedy() && !params.step_logits {
            // Greedy without logits for the caller: the choice is made where the logits are.
            self.decode_greedy_until(&rest, limit, stop, |token| accept(tokens, token, None))?;
        } else if limit > 0 {
            let last = self.prefill_all_but_the_last_chunk(&rest, stop)?;
            let mut logits = picker.prepare_beside(|| self.forward(last, Logits::Last))?;
            for made in 1.. {
                let token = picker.pick(logits, tokens, prompt_len)?;
                picker.accept(token)?;
                if accept(tokens, token, Some(logits)).is_break() || made >= limit {
                    break;
                }
                if picker.is_complete() {
                    break;
                }
                logits = picker.prepare_beside(|| self.forward(&[token], Logits::Last))?;
            }
        }
        // A complete grammar ends the reply as an end-of-sequence token would.
        if picker.is_complete() {
            finish_reason = FinishReason::Stop;
        }
        let first = first_token_at.unwrap_or_else(Instant::now);
        Ok(Generation {
            tokens: tokens[prompt_len..].to_vec(),
            finish_reason,
            prompt_tokens: prompt_len,
            cached_tokens: cached,
            prefill_time: first - start,
            decode_time: first.elapsed(),
            drafted_tokens: 0,
            accepted_tokens: 0,
        })
    }

    /// [`Self::generate_until`] through the batched loop, the request alone in it, so that it
    /// drafts (`ember run` on an engine loaded to draft).
    fn generate_drafted(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        stop: &dyn Fn() -> bool,
        mut on_step: impl FnMut(Step<'_>) -> ControlFlow<()>,
    ) -> Result<Generation> {
        // No other request is pending: any id is free.
        const ID: SeqId = 0;
        if params.max_tokens == 0 {
            // What the serial road gives: nothing generated, nothing to stop.
            return Ok(Generation {
                tokens: Vec::new(),
                finish_reason: FinishReason::Length,
                prompt_tokens: prompt.len(),
                cached_tokens: 0,
                prefill_time: Duration::ZERO,
                decode_time: Duration::ZERO,
                drafted_tokens: 0,
                accepted_tokens: 0,
            });
        }
        let (start, before) = (Instant::now(), self.step_timing());
        self.submit(ID, prompt, *params, None)?;
        let mut made = Vec::new();
        let (mut cached, mut first_token_at) = (0, None);
        let (mut ended, mut failed, mut stopped) = (None, None, false);
        while ended.is_none() && failed.is_none() && !stopped {
            if made.is_empty() && stop() {
                self.cancel(ID);
                return Err(Error::Cancelled);
            }
            let stepped = self.step_batch(&mut |_, event| match event {
                BatchEvent::Prompt { cached_tokens } => cached = cached_tokens,
                // Tokens of the same pass after the caller stopped are not its.
                BatchEvent::Token { .. } if stopped => {}
                BatchEvent::Token {
                    token,
                    logits,
                    is_eos,
                } => {
                    first_token_at.get_or_insert_with(Instant::now);
                    made.push(token);
                    let step = Step {
                        token,
                        logits,
                        is_eos,
                        cached_tokens: cached,
                    };
                    stopped = on_step(step).is_break();
                }
                BatchEvent::Finished(generation) => ended = Some(generation),
                BatchEvent::Failed(e) => failed = Some(e),
            });
            // A failed pass fails its requests with it (their events).
            if let (Err(e), None) = (stepped, &failed) {
                failed = Some(e);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if let (Some(generation), false) = (ended, stopped) {
            return Ok(generation);
        }
        // The caller stopped it: it ends at the token that stopped it, as on the serial road
        // (and if the same pass ended it, with tokens past that one, it is already gone).
        self.cancel(ID);
        let first = first_token_at.unwrap_or_else(Instant::now);
        // It ran alone: the loop's drafts since it came are its own.
        let drafts = self.step_timing().since(&before).drafts;
        Ok(Generation {
            tokens: made,
            finish_reason: FinishReason::Stop,
            prompt_tokens: prompt.len(),
            cached_tokens: cached,
            prefill_time: first - start,
            decode_time: first.elapsed(),
            drafted_tokens: drafts.drafted,
            accepted_tokens: drafts.accepted,
        })
    }

    /// The cache's contents and counters, for `/metrics` and `/health`.
    pub(super) fn publish_cache_stats(&self) {
        let b = self.blocks.stats();
        self.cache_stats.record_contents(
            b.cached_blocks,
            b.host_cached,
            b.evictions,
            b.host_evictions,
        );
    }
}
