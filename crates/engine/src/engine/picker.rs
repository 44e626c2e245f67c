//! How one request picks each next token: the penalties on tokens it has seen and its output
//! constraint adjust the logits, then its sampler draws (or takes the argmax). Shared by the
//! one-sequence road and the batched loop, so a request picks the same way on either.

use std::collections::{HashMap, HashSet};

use crate::constraint::Constraint;
use crate::error::{Error, Result};
use crate::sampler::{Penalties, Sampler, SamplingParams};

pub(super) struct Picker {
    sampler: Sampler,
    penalties: Penalties,
    constraint: Option<Constraint>,
    /// The logits as adjusted; allocated on the first pick that adjusts them.
    adjusted: Vec<f32>,
    /// How often each token of the reply was picked (penalties counted over the reply).
    reply_counts: HashMap<u32, u32>,
    /// The prompt's tokens (the repetition penalty over the prompt), made on the first pick.
    prompt_tokens: Option<HashSet<u32>>,
}

impl Picker {
    pub(super) fn new(params: SamplingParams, constraint: Option<Constraint>) -> Self {
        Picker {
            sampler: Sampler::new(params),
            penalties: params.penalties,
            constraint,
            adjusted: Vec::new(),
            reply_counts: HashMap::new(),
            prompt_tokens: None,
        }
    }

    /// Whether the pick is the argmax of the logits as the model made them, so it can be
    /// made where they are (on the device) without bringing them to the host.
    pub(super) fn is_plain_greedy(&self) -> bool {
        self.sampler.params().is_greedy() && !self.penalties.any() && self.constraint.is_none()
    }

    /// How many of the drafted `tokens` could be picked in turn: those the output
    /// constraint allows (all without one), so a pass never verifies a draft no pick can equal.
    pub(super) fn allowed_drafts(&mut self, tokens: &[u32]) -> usize {
        match &mut self.constraint {
            Some(c) => c.allowed_prefix(tokens),
            None => tokens.len(),
        }
    }

    /// Runs `work` (the forward pass whose logits the next pick takes) while the constraint's
    /// next mask is computed on a thread beside it.
    pub(super) fn prepare_beside<T>(&mut self, work: impl FnOnce() -> T) -> T {
        match &mut self.constraint {
            None => work(),
            Some(c) => std::thread::scope(|scope| {
                scope.spawn(|| c.prepare());
                work()
            }),
        }
    }

    /// The constraint, taken out to compute its next mask beside a forward pass
    /// ([`Constraint::prepare`]); give it back with [`Self::restore_constraint`].
    pub(super) fn take_constraint(&mut self) -> Option<Constraint> {
        self.constraint.take()
    }

    pub(super) fn restore_constraint(&mut self, constraint: Option<Constraint>) {
        self.constraint = constraint;
    }

    /// The next token from `logits`, for a sequence of `tokens` (its prompt, the first
    /// `prompt_len`, then its reply so far).
    pub(super) fn pick(
        &mut self,
        logits: &[f32],
        tokens: &[u32],
        prompt_len: usize,
    ) -> Result<u32> {
        if !self.penalties.any() && self.constraint.is_none() {
            return Ok(self.sampler.sample(logits));
        }
        let mut adjusted = std::mem::take(&mut self.adjusted);
        adjusted.clear();
        adjusted.extend_from_slice(logits);
        if self.penalties.any() {
            self.penalize(&mut adjusted, tokens, prompt_len);
        }
        if let Some(c) = &mut self.constraint {
            c.apply(&mut adjusted).map_err(Error::Constraint)?;
        }
        let token = self.sampler.sample(&adjusted);
        self.adjusted = adjusted;
        Ok(token)
    }

    /// Takes `token` as picked: the reply's counts and the constraint move past it.
    pub(super) fn accept(&mut self, token: u32) -> Result<()> {
        if self.penalties.any() {
            *self.reply_counts.entry(token).or_insert(0) += 1;
        }
        if let Some(c) = &mut self.constraint {
            c.accept(token).map_err(Error::Constraint)?;
        }
        Ok(())
    }

    /// Whether the constraint's grammar is complete: nothing may follow.
    pub(super) fn is_complete(&self) -> bool {
        self.constraint
            .as_ref()
            .is_some_and(Constraint::is_complete)
    }

    fn penalize(&mut self, logits: &mut [f32], tokens: &[u32], prompt_len: usize) {
        let p = self.penalties;
        let apply = |logit: &mut f32, count: u32, repeat: bool| {
            if repeat && p.repetition != 1.0 {
                *logit = if *logit > 0.0 {
                    *logit / p.repetition
                } else {
                    *logit * p.repetition
                };
            }
            if count > 0 {
                *logit -= p.presence + count as f32 * p.frequency;
            }
        };
        match p.last_n {
            // llama.cpp: everything over the last n tokens of prompt and reply.
            Some(n) => {
                let window = &tokens[tokens.len().saturating_sub(n)..];
                let mut counts: HashMap<u32, u32> = HashMap::new();
                for &t in window {
                    *counts.entry(t).or_insert(0) += 1;
                }
                for (t, count) in counts {
                    if let Some(logit) = logits.get_mut(t as usize) {
                        apply(logit, count, true);
                    }
                }
            }
            // OpenAI and vLLM: presence and frequency over the reply, repetition over both.
            None => {
                let prompt = self
                    .prompt_tokens
                    .get_or_insert_with(|| tokens[..prompt_len].iter().copied().collect());
                for (&t, &count) in &self.reply_counts {
                    if let Some(logit) = logits.get_mut(t as usize) {
                        apply(logit, count, true);
                    }
                }
                if p.repetition != 1.0 {
                    for &t in prompt.iter() {
                        if !self.reply_counts.contains_key(&t)
                            && let Some(logit) = logits.get_mut(t as usize)
                        {
                            apply(logit, 0, true);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(penalties: Penalties) -> SamplingParams {
        SamplingParams {
            penalties,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn no_penalty_no_constraint_is_the_plain_argmax() {
        let mut p = Picker::new(SamplingParams::default(), None);
        assert!(p.is_plain_greedy());
        assert_eq!(p.pick(&[0.0, 3.0, 1.0], &[1, 1], 1).unwrap(), 1);
    }

    #[test]
    fn penalties_follow_openai_and_llama_cpp() {
        // Token 1 was picked twice in the reply; token 2 is in the prompt.
        let logits = [1.0, 3.0, 2.9, -1.0];
        let tokens = [2, 1, 1];
        let mut p = Picker::new(
            params(Penalties {
                frequency: 0.1,
                ..Penalties::default()
            }),
            None,
        );
        p.accept(1).unwrap();
        p.accept(1).unwrap();
        assert!(!p.is_plain_greedy());
        // 3.0 - 2 · 0.1 = 2.8 < 2.9: the prompt's token wins (not counted by frequency).
        assert_eq!(p.pick(&logits, &tokens, 1).unwrap(), 2);

        // Repetition over prompt and reply: 3.0 / 2 = 1.5 against 2.9 / 2 = 1.45 and 1.0.
        let mut p = Picker::new(
            params(Penalties {
                repetition: 2.0,
                ..Penalties::default()
            }),
            None,
        );
        p.accept(1).unwrap();
        p.accept(1).unwrap();
        assert_eq!(p.pick(&logits, &tokens, 1).unwrap(), 1);
        let mut p = Picker::new(
            params(Penalties {
                repetition: 4.0,
                ..Penalties::default()
            }),
            None,
        );
        p.accept(1).unwrap();
        // 3.0 / 4 and 2.9 / 4 fall below the unseen token's 1.0.
        assert_eq!(p.pick(&logits, &tokens, 1).unwrap(), 0);

        // llama.cpp's window: the last 2 tokens (1, 1) count; presence takes 2.5 off token 1.
        let mut p = Picker::new(
            params(Penalties {
                presence: 0.5,
                last_n: Some(2),
                ..Penalties::default()
            }),
            None,
        );
        assert_eq!(p.pick(&logits, &tokens, 1).unwrap(), 2);
        // A window of 0 is off.
        let p = Picker::new(
            params(Penalties {
                presence: 0.5,
                last_n: Some(0),
                ..Penalties::default()
            }),
            None,
        );
        assert!(p.is_plain_greedy());
    }

    #[test]
    fn negative_logits_are_pushed_down_by_repetition() {
        let mut p = Picker::new(
            params(Penalties {
                repetition: 2.0,
                ..Penalties::default()
            }),
            None,
        );
        // Token 0 (-1.0, seen) becomes -2.0, below token 1's -1.5.
        p.accept(0).unwrap();
        assert_eq!(p.pick(&[-1.0, -1.5], &[0], 0).unwrap(), 1);
    }
}
