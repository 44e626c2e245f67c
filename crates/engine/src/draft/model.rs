//! A draft model (`--draft-model`): a smaller model of the same vocabulary proposes the tokens
//! it would pick greedily after the sequence so far. Each sequence keeps its keys and values
//! in the draft's own KV pool, so a proposal computes only what changed since the last one:
//! the target's accepted tokens and pick, after the draft's rejected tokens are cut off.

use std::collections::HashMap;

use ember_models::{BlockTable, Logits, SequencePass};

use super::{DraftSource, Proposal};
use crate::error::{Error, Result};
use crate::runner::Runner;
use crate::scheduler::SeqId;

/// The draft model on its backend with its KV pool, and each drafting sequence's blocks.
pub struct DraftModel {
    runner: Box<dyn Runner>,
    /// Blocks of the draft's pool no sequence holds.
    free: Vec<u32>,
    block_size: usize,
    /// Tokens the target can take: a draft's pick at or past its vocabulary (a padded row of
    /// a larger embedding) ends the proposal.
    target_vocab: usize,
    seqs: HashMap<SeqId, DraftSequence>,
    /// The checkpoint the draft's weights are read from, when they were not copied out of it.
    _files: Option<Box<dyn Send>>,
}

/// What a sequence holds in the draft's pool.
#[derive(Default)]
struct DraftSequence {
    table: BlockTable,
    /// The tokens whose keys and values the table's filled positions hold, in order.
    tokens: Vec<u32>,
}

impl DraftModel {
    /// A draft over `runner`, whose KV pool has `blocks` blocks of `block_size` positions.
    pub(crate) fn new(
        runner: Box<dyn Runner>,
        blocks: usize,
        block_size: usize,
        target_vocab: usize,
        files: Option<Box<dyn Send>>,
    ) -> Self {
        DraftModel {
            runner,
            // Lowest first off the end: the order does not matter, only that each is once.
            free: (0..blocks as u32).rev().collect(),
            block_size,
            target_vocab,
            seqs: HashMap::new(),
            _files: files,
        }
    }

    /// Sequences holding blocks of the draft's pool (tests check that ended ones let go).
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Sequence `ask.id`'s blocks made ready for a proposal: cut back to what they hold of
    /// `ask.tokens` (but its last token), grown to hold the drafts, and caught up but for the
    /// last chunk of what they lack, which the first shared pass takes (its pick is the first
    /// draft). `None` when there is nothing to propose.
    fn begin(&mut self, slot: usize, ask: &Proposal<'_>) -> Result<Option<Going>> {
        let tokens = ask.tokens;
        // The draft steps hold the sequence and all but the last drafted token.
        let max = ask
            .max
            .min(self.runner.context().saturating_sub(tokens.len()));
        if tokens.is_empty() || max == 0 {
            return Ok(None);
        }
        let mut seq = self.seqs.remove(&ask.id).unwrap_or_default();
        let keep = common_prefix(&seq.tokens, tokens).min(tokens.len() - 1);
        seq.tokens.truncate(keep);
        seq.table.truncate(keep);
        let blocks = (tokens.len() + max - 1).div_ceil(self.block_size);
        while seq.table.blocks().len() < blocks {
            let Some(block) = self.free.pop() else {
                self.free.extend(seq.table.take_blocks());
                // Every sequence's context fits the pool; more sequences than the engine runs
                // at once would have to end first.
                return Err(Error::DraftPoolFull);
            };
            seq.table.push_block(block);
        }
        let chunk = self.runner.max_batch();
        let fresh = &tokens[keep..];
        let last = (fresh.len() - 1) / chunk * chunk;
        for earlier in fresh[..last].chunks(chunk) {
            if let Err(e) = self.runner.forward(&mut seq.table, earlier, Logits::None) {
                self.free.extend(seq.table.take_blocks());
                return Err(e);
            }
            seq.tokens.extend_from_slice(earlier);
        }
        Ok(Some(Going {
            slot,
            id: ask.id,
            max,
            input: fresh[last..].to_vec(),
            seq,
        }))
    }

    /// One step of every proposal under way, in as few passes as the runner takes (tokens
    /// and rows of logits): each sequence's input in, its greedy pick out, in order.
    fn step(&mut self, going: &mut [Going]) -> Result<Vec<u32>> {
        let (most_tokens, most_rows) = (self.runner.max_batch(), self.runner.logit_rows());
        let mut picks = Vec::with_capacity(going.len());
        let mut rest = going;
        while !rest.is_empty() {
            let mut take = 0;
            let mut tokens = 0;
            while take < rest.len()
                && take < most_rows.max(1)
                && (take == 0 || tokens + rest[take].input.len() <= most_tokens)
            {
                tokens += rest[take].input.len();
                take += 1;
            }
            let (now, later) = rest.split_at_mut(take);
            let mut passes: Vec<SequencePass<'_, '_>> = now
                .iter_mut()
                .map(|g| SequencePass {
                    seq: &mut g.seq.table,
                    tokens: &g.input,
                    logits: Logits::Last,
                })
                .collect();
            let rows = self.runner.forward_batch(&mut passes)?;
            picks.extend(self.runner.greedy_tokens(rows)?);
            for g in now.iter_mut() {
                g.seq.tokens.extend_from_slice(&g.input);
            }
            rest = later;
        }
        Ok(picks)
    }

    fn propose_together(&mut self, asks: &[Proposal<'_>], outs: &mut [Vec<u32>]) {
        let mut going = Vec::with_capacity(asks.len());
        for (slot, ask) in asks.iter().enumerate() {
            outs[slot].clear();
            match self.begin(slot, ask) {
                Ok(Some(g)) => going.push(g),
                Ok(None) => {}
                Err(e) => self.give_up(ask.id, &e),
            }
        }
        while !going.is_empty() {
            let picks = match self.step(&mut going) {
                Ok(picks) => picks,
                Err(e) => {
                    for Going { slot, id, seq, .. } in going.drain(..) {
                        outs[slot].clear();
                        let mut table = seq.table;
                        self.free.extend(table.take_blocks());
                        self.give_up(id, &e);
                    }
                    return;
                }
            };
            let mut still = Vec::with_capacity(going.len());
            for (mut g, pick) in going.drain(..).zip(picks) {
                let out = &mut outs[g.slot];
                // A pick past the target's vocabulary (a padded row) ends the proposal.
                let more = (pick as usize) < self.target_vocab && {
                    out.push(pick);
                    out.len() < g.max
                };
                if more {
                    g.input.clear();
                    g.input.push(pick);
                    still.push(g);
                } else {
                    self.seqs.insert(g.id, g.seq);
                }
            }
            going = still;
        }
    }

    /// A proposal failed: a draft is only ever a guess, so the sequence goes on undrafted
    /// this pass, and its blocks start over.
    fn give_up(&mut self, id: SeqId, e: &Error) {
        tracing::warn!("the draft model could not propose for request {id}: {e}");
        self.finish(id);
    }
}

/// A sequence's proposal under way: its blocks (out of [`DraftModel::seqs`] meanwhile) and
/// the tokens its next pass takes.
struct Going {
    /// Its place among the asks.
    slot: usize,
    id: SeqId,
    max: usize,
    input: Vec<u32>,
    seq: DraftSequence,
}

impl DraftSource for DraftModel {
    fn propose(&mut self, id: SeqId, tokens: &[u32], max: usize, out: &mut Vec<u32>) {
        let ask = Proposal { id, tokens, max };
        self.propose_together(&[ask], std::slice::from_mut(out));
    }

    /// The sequences' draft steps share passes: a step of four sequences is one pass, not
    /// four.
    fn propose_all(&mut self, asks: &[Proposal<'_>], outs: &mut [Vec<u32>]) {
        self.propose_together(asks, outs);
    }

    fn finish(&mut self, id: SeqId) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            self.free.extend(seq.table.take_blocks());
        }
    }
}

/// How many tokens `a` and `b` begin with alike.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
