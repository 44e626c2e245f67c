//! Tensor parallelism: one model split across ranks, each a backend of its own, as vLLM and
//! Megatron split it. Every layer's q, k and v projections are cut by heads and its gate and up
//! by rows, so a rank computes its heads' attention and its share of the MLP's width alone; the
//! o and down projections are cut by columns, so each rank's product is a partial sum of the
//! whole output, and the ranks add their partials (an all-reduce) before the residual takes it:
//! two all-reduces a layer. The embedding and the output head are cut by vocabulary: a token's
//! row comes from the rank holding it (the others give zeros, summed in), and each rank's
//! logits are its slice of the row, gathered.
//!
//! - [`Shard`]: a rank and how many there are; [`ModelConfig::for_shard`] the shapes a rank
//!   computes.
//! - [`ShardSource`]: a checkpoint seen as one rank's share of each tensor.
//! - [`HostGroup`]: the CPU's all-reduce and all-gather among rank threads, summing in rank
//!   order so results never depend on which rank arrives first.
//!
//! A rank's forward pass is [`crate::Transformer`]'s own, loaded by
//! [`crate::Transformer::load_shard`]; the backend adds the ranks' partials
//! ([`crate::Backend::all_reduce`]).

mod host_group;
mod shard_source;

use std::ops::Range;

pub use host_group::{GroupAborted, HostGroup};
pub use shard_source::ShardSource;

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// How the ranks share a mixture of experts' experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertSplit {
    /// Every rank holds every expert, each cut like a dense MLP (its share of the columns):
    /// tensor parallelism's way, every rank busy for every token.
    #[default]
    Columns,
    /// Each rank holds a share of the experts whole (expert parallelism): a token's experts
    /// run on the ranks that hold them, the others adding nothing for it.
    Experts,
}

/// One rank of a model split `ranks` ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
    pub experts: ExpertSplit,
}

impl Shard {
    /// The whole model on one rank.
    pub const WHOLE: Shard = Shard {
        rank: 0,
        ranks: 1,
        experts: ExpertSplit::Columns,
    };

    pub fn new(rank: usize, ranks: usize) -> Result<Shard> {
        if ranks == 0 || rank >= ranks {
            return Err(split_error(format!("there is no rank {rank} of {ranks}")));
        }
        Ok(Shard {
            rank,
            ranks,
            experts: ExpertSplit::Columns,
        })
    }

    pub fn with_experts(self, experts: ExpertSplit) -> Shard {
        Shard { experts, ..self }
    }

    /// The experts (of `count`) this rank holds: all of them cut by columns, or its share
    /// whole (as evenly as they go).
    pub fn held_experts(self, count: usize) -> Range<usize> {
        match self.experts {
            ExpertSplit::Columns => 0..count,
            ExpertSplit::Experts => self.part(count),
        }
    }

    pub fn is_whole(self) -> bool {
        self.ranks == 1
    }

    /// This rank's part of `len` items cut as evenly as they go: the first `len % ranks`
    /// ranks none more than the rest (the vocabulary, which need not divide).
    pub fn part(self, len: usize) -> Range<usize> {
        len * self.rank / self.ranks..len * (self.rank + 1) / self.ranks
    }

    /// This rank's part of `count` units of `unit` values each (heads of `head_dim`), which
    /// must divide among the ranks.
    pub fn even_part(self, what: &str, count: usize, unit: usize) -> Result<Range<usize>> {
        if !count.is_multiple_of(self.ranks) {
            return Err(split_error(format!(
                "{count} {what} across {} ranks: they must divide evenly",
                self.ranks
            )));
        }
        let per = count / self.ranks;
        Ok(self.rank * per * unit..(self.rank + 1) * per * unit)
    }

    /// This rank's key-value heads, of `count` of `unit` values each: a share of them as
    /// [`Shard::even_part`] cuts it, or, where there are more ranks than heads (a multiple of
    /// them), the one head its query heads read, held by each of those ranks alike (as vLLM
    /// replicates them): every rank then keeps a whole head's cache.
    pub fn kv_part(self, count: usize, unit: usize) -> Result<Range<usize>> {
        if count >= self.ranks {
            return self.even_part("key-value heads", count, unit);
        }
        if !self.ranks.is_multiple_of(count) {
            return Err(split_error(format!(
                "{count} key-value heads across {} ranks: the ranks must divide them or be a \
                 multiple of them",
                self.ranks
            )));
        }
        let head = self.rank / (self.ranks / count);
        Ok(head * unit..(head + 1) * unit)
    }
}

fn split_error(why: String) -> Error {
    Error::CannotSplit(why)
}

impl ModelConfig {
    /// The shapes `shard` computes: its share of the attention heads and key-value heads and
    /// of the MLP's width. The vocabulary stays whole: tokens are checked against it and
    /// every rank ends a pass with whole rows of logits.
    pub fn for_shard(&self, shard: Shard) -> Result<ModelConfig> {
        if shard.is_whole() {
            return Ok(self.clone());
        }
        let heads = shard.even_part("attention heads", self.num_attention_heads, 1)?;
        let kv_heads = shard.kv_part(self.num_key_value_heads, 1)?;
        let width = shard.even_part("MLP columns", self.intermediate_size, 1)?;
        // Every rank holds every expert, each cut like a dense MLP: its share of the
        // columns; or a share of the experts whole (the router stays whole either way).
        let moe = match &self.moe {
            Some(moe) if shard.experts == ExpertSplit::Experts => Some(moe.clone()),
            Some(moe) => {
                let part = shard.even_part("expert MLP columns", moe.moe_intermediate_size, 1)?;
                Some(crate::config::MoeConfig {
                    moe_intermediate_size: part.len(),
                    ..moe.clone()
                })
            }
            None => None,
        };
        Ok(ModelConfig {
            num_attention_heads: heads.len(),
            num_key_value_heads: kv_heads.len(),
            intermediate_size: width.len(),
            moe,
            ..self.clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_whole_once() {
        for ranks in 1..=8 {
            for len in [1, 7, 405, 416, 151_936] {
                let mut next = 0;
                for rank in 0..ranks {
                    let part = Shard::new(rank, ranks).unwrap().part(len);
                    assert_eq!(part.start, next);
                    assert!(part.len() <= len.div_ceil(ranks));
                    next = part.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn heads_split_evenly_or_not_at_all() {
        let shard = Shard::new(1, 2).unwrap();
        assert_eq!(shard.even_part("heads", 4, 32).unwrap(), 64..128);
        let err = Shard::new(0, 4).unwrap().even_part("key-value heads", 2, 1);
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("2 key-value heads across 4 ranks")
        );
        // More ranks than key-value heads: each head held by the ranks whose queries read it.
        let kv = |rank, ranks, count| Shard::new(rank, ranks).unwrap().kv_part(count, 8);
        assert_eq!(
            (0..8).map(|r| kv(r, 8, 2).unwrap()).collect::<Vec<_>>(),
            [0..8, 0..8, 0..8, 0..8, 8..16, 8..16, 8..16, 8..16]
        );
        assert_eq!(kv(3, 4, 8).unwrap(), 48..64);
        let err = kv(0, 3, 2).unwrap_err().to_string();
        assert!(err.contains("2 key-value heads across 3 ranks"), "{err}");
        assert!(Shard::new(2, 2).is_err());
        assert!(Shard::new(0, 0).is_err());
    }
}
