//! Speculative decoding's drafts: tokens proposed to follow a sequence, which the target model
//! verifies in one forward pass (a row for each), keeping those it would have made itself.
//!
//! A draft never changes the output: the batched loop ([`crate::Engine::step_batch`]) picks
//! each verified row's token with the request's own picker (greedy, or its seeded sampler),
//! exactly as a decode step would from the same logits, and a drafted token stands only while
//! it equals that pick. The CPU's rows are the same bits alone and in any pass, so a drafted
//! reply is the undrafted one; what a draft changes is how many passes it takes.
//!
//! Sources sit behind [`DraftSource`]: [`ngram::NgramDrafter`] (prompt lookup) and
//! [`model::DraftModel`] (a smaller model's greedy picks) now, MTP heads later, each keeping
//! what it needs per sequence.

pub mod model;
pub mod ngram;

use crate::scheduler::SeqId;

pub use model::DraftModel;
pub use ngram::NgramDrafter;

/// Proposes tokens to follow a sequence.
pub trait DraftSource: Send {
    /// Writes into `out` (cleared first) up to `max` tokens likely to follow `tokens`, the
    /// prompt and reply so far of sequence `id`; none when it has no guess.
    fn propose(&mut self, id: SeqId, tokens: &[u32], max: usize, out: &mut Vec<u32>);

    /// [`DraftSource::propose`] for several sequences at once, `outs[i]` for `asks[i]`: a
    /// draft model runs them in shared passes. By default, one after another.
    fn propose_all(&mut self, asks: &[Proposal<'_>], outs: &mut [Vec<u32>]) {
        for (ask, out) in asks.iter().zip(outs) {
            self.propose(ask.id, ask.tokens, ask.max, out);
        }
    }

    /// Sequence `id` ended: what was kept for it goes.
    fn finish(&mut self, id: SeqId) {
        let _ = id;
    }
}

/// One sequence's ask for a proposal: up to `max` tokens to follow `tokens`.
#[derive(Clone, Copy, Debug)]
pub struct Proposal<'a> {
    pub id: SeqId,
    pub tokens: &'a [u32],
    pub max: usize,
}

/// Where drafts come from (`--draft`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftKind {
    /// No drafting: one token a pass.
    #[default]
    None,
    /// Prompt lookup where a pass's rows are the bits of decode steps (the CPU, CUDA with
    /// `--batch-invariant`), none elsewhere: `ember serve`'s default.
    Auto,
    /// Prompt lookup: the continuation of the latest earlier match of the sequence's last few
    /// tokens ([`NgramDrafter`]).
    Ngram,
    /// A draft model's greedy picks (`--draft-model`, [`DraftModel`]).
    Model,
}

impl DraftKind {
    /// The name `--draft` takes.
    pub fn name(self) -> &'static str {
        match self {
            DraftKind::None => "none",
            DraftKind::Auto => "auto",
            DraftKind::Ngram => "ngram",
            DraftKind::Model => "model",
        }
    }
}

impl std::str::FromStr for DraftKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(DraftKind::None),
            "auto" => Ok(DraftKind::Auto),
            "ngram" => Ok(DraftKind::Ngram),
            "model" => Ok(DraftKind::Model),
            _ => Err(format!("{s:?}: expected auto, ngram, model or none")),
        }
    }
}

/// How a loaded engine drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftOptions {
    pub kind: DraftKind,
    /// Most tokens drafted for one pass (`--draft-max`).
    pub max: usize,
    /// Fewest worth a wider pass (`--draft-min`): shorter proposals are not verified.
    pub min: usize,
}

impl Default for DraftOptions {
    fn default() -> Self {
        DraftOptions {
            kind: DraftKind::None,
            max: DEFAULT_DRAFT_MAX,
            min: DEFAULT_DRAFT_MIN,
        }
    }
}

/// `--draft-max`'s default.
pub const DEFAULT_DRAFT_MAX: usize = 8;
/// `--draft-min`'s default.
pub const DEFAULT_DRAFT_MIN: usize = 1;

impl DraftOptions {
    /// These options where a pass's rows are (`rows_exact`) or are not the bits of decode
    /// steps: `Auto` made `Ngram` or `None`.
    pub fn on(self, rows_exact: bool) -> DraftOptions {
        let kind = match (self.kind, rows_exact) {
            (DraftKind::Auto, true) => DraftKind::Ngram,
            (DraftKind::Auto, false) => DraftKind::None,
            (kind, _) => kind,
        };
        DraftOptions { kind, ..self }
    }

    /// The source these options name that needs nothing loaded, if any (`Auto` as where rows
    /// are exact); a draft model is loaded with the engine.
    pub fn source(&self) -> Option<Box<dyn DraftSource>> {
        match self.on(true).kind {
            DraftKind::None | DraftKind::Auto | DraftKind::Model => None,
            DraftKind::Ngram => Some(Box::new(NgramDrafter::default())),
        }
    }
}

/// One sequence's drafting depth, following how much of its drafts the target keeps: all of a
/// draft accepted doubles the next one's length (to `max`), a rejection takes it to one past
/// what was accepted (down to `min`), so drafts that keep missing cost little. Drafts of which
/// nothing stands, one after another, make the sequence sit out passes: 1, 3, 7, … up to
/// [`MAX_REST`] after the first, second, third miss, until one is accepted again (a draft that
/// never hits would otherwise widen every pass for nothing: a 0.6b draft for qwen3-8b on an
/// H100, 0 of 133 accepted, made decode 0.63× as fast; sitting out, 0.95×).
#[derive(Clone, Copy, Debug)]
pub struct Depth {
    now: usize,
    min: usize,
    max: usize,
    /// Drafts in a row of which nothing stood, and passes still to sit out.
    misses: u32,
    rest: usize,
}

/// Most passes a sequence sits out after drafts that missed.
pub const MAX_REST: usize = 63;

impl Depth {
    pub fn new(options: &DraftOptions) -> Self {
        Depth {
            now: options.max,
            min: options.min.max(1),
            max: options.max,
            misses: 0,
            rest: 0,
        }
    }

    /// Whether this pass may draft: false while the sequence sits out after misses (counting
    /// the pass off).
    pub fn take_turn(&mut self) -> bool {
        if self.rest > 0 {
            self.rest -= 1;
            return false;
        }
        true
    }

    /// Tokens to ask the source for.
    pub fn get(&self) -> usize {
        self.now
    }

    /// Fewest tokens worth verifying.
    pub fn min(&self) -> usize {
        self.min
    }

    /// After a verification of `drafted` tokens of which the first `accepted` stood.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        self.now = if accepted == drafted {
            (self.now * 2).min(self.max)
        } else {
            (accepted + 1).clamp(self.min, self.max)
        };
        if accepted > 0 {
            self.misses = 0;
            self.rest = 0;
        } else {
            self.misses += 1;
            self.rest = ((1usize << self.misses.min(6)) - 1).min(MAX_REST);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_doubles_on_full_acceptance_and_falls_past_a_rejection() {
        let options = DraftOptions {
            kind: DraftKind::Ngram,
            max: 8,
            min: 2,
        };
        let mut depth = Depth::new(&options);
        assert_eq!(depth.get(), 8);
        depth.update(8, 0);
        assert_eq!(depth.get(), 2, "never below the minimum");
        depth.update(2, 2);
        assert_eq!(depth.get(), 4);
        depth.update(4, 4);
        depth.update(8, 8);
        assert_eq!(depth.get(), 8, "never above the maximum");
        depth.update(8, 4);
        assert_eq!(depth.get(), 5);
        assert!(depth.take_turn(), "drafts that hit never sit out");
    }

    #[test]
    fn drafts_that_keep_missing_sit_out_ever_longer_until_one_hits() {
        let options = DraftOptions {
            kind: DraftKind::Model,
            max: 8,
            min: 1,
        };
        let mut depth = Depth::new(&options);
        // Passes sat out after each of seven misses in a row.
        let mut rests = Vec::new();
        for _ in 0..7 {
            assert!(depth.take_turn());
            depth.update(depth.get(), 0);
            let mut sat = 0;
            while !depth.take_turn() {
                sat += 1;
            }
            rests.push(sat);
            // `take_turn` said yes: that pass drafts (the loop's next update).
        }
        assert_eq!(rests, [1, 3, 7, 15, 31, MAX_REST, MAX_REST]);
        // One accepted token ends it.
        depth.update(1, 1);
        depth.update(2, 0);
        assert!(!depth.take_turn());
        assert!(depth.take_turn());
    }
}
