//! A draft model (`--draft-model`): a smaller model of the same vocabulary proposes the tokens
//! it would pick greedily after the sequence so far. Each sequence keeps its keys and values
//! in the draft's own KV pool, so a proposal computes only what changed since the last one:
//! the target's accepted tokens and pick, after the draft's rejected tokens are cut off.

use std::collections::HashMap;

use ember_models::{BlockTable, Logits};

use super::DraftSource;
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

    fn try_propose(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        max: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        // The draft steps hold the sequence and all but the last drafted token.
        let max = max.min(self.runner.context().saturating_sub(tokens.len()));
        if tokens.is_empty() || max == 0 {
            return Ok(());
        }
        let seq = self.seqs.entry(id).or_default();
        // What the blocks hold of `tokens` stays, but for the last token: it is in the pass
        // that makes the first draft.
        let keep = common_prefix(&seq.tokens, tokens).min(tokens.len() - 1);
        seq.tokens.truncate(keep);
        seq.table.truncate(keep);
        let needed = tokens.len() + max - 1;
        let blocks = needed.div_ceil(self.block_size);
        while seq.table.blocks().len() < blocks {
            let Some(block) = self.free.pop() else {
                // Every sequence's context fits the pool; more sequences than the engine runs
                // at once would have to end first.
                return Err(Error::DraftPoolFull);
            };
            seq.table.push_block(block);
        }
        // What the blocks lack, the last token included: its last chunk's pass makes the
        // first draft (one pass, not a catch-up and then a step).
        let fresh = &tokens[keep..];
        let chunks = fresh.len().div_ceil(self.runner.max_batch());
        let mut pick = 0;
        for (i, chunk) in fresh.chunks(self.runner.max_batch()).enumerate() {
            if i + 1 < chunks {
                self.runner.forward(&mut seq.table, chunk, Logits::None)?;
            } else {
                pick = self.runner.forward_greedy(&mut seq.table, chunk)?;
            }
        }
        seq.tokens.extend_from_slice(fresh);
        while (pick as usize) < self.target_vocab {
            out.push(pick);
            if out.len() == max {
                break;
            }
            let input = pick;
            pick = self.runner.forward_greedy(&mut seq.table, &[input])?;
            seq.tokens.push(input);
        }
        Ok(())
    }
}

impl DraftSource for DraftModel {
    fn propose(&mut self, id: SeqId, tokens: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        if let Err(e) = self.try_propose(id, tokens, max, out) {
            // A draft is only ever a guess: the sequence goes on undrafted this pass, and its
            // blocks start over.
            tracing::warn!("the draft model could not propose for request {id}: {e}");
            out.clear();
            self.finish(id);
        }
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
