//! Bookkeeping of the paged KV pool: which sequence holds which block, the prefix cache
//! over finished sequences' blocks, and a host tier that keeps evicted blocks.
//!
//! The pool's memory belongs to the model backend ([`ember_models::KvStore`]); this module
//! hands out block numbers and says which copies between pool blocks and host slots to make
//! ([`Transfer`]s, run by the caller in order before the next forward pass), never touching
//! memory itself, as vLLM v1's `KVCacheManager` and `BlockPool` hand out block ids.
//!
//! # The prefix cache
//!
//! A finished sequence's full blocks stay in the pool as cache entries, so a later prompt
//! that starts with the same tokens reuses them instead of computing them again. Each entry
//! is keyed by (its parent entry, the block's token ids): a chain of keys from the first
//! block spells out the whole prefix, as vLLM's chained block hashes do, but the key is
//! compared exactly — token ids, not a hash of them — because a false hit would silently
//! give another prompt's keys and values, wrong output with no error. The parent is an
//! entry id rather than a hash, so the map from keys to entries is a trie whose edges are
//! looked up by hashing, one block at a time from the root, stopping at the first miss.
//!
//! Entry ids come from a slab and are reused only once their entry is gone; an entry goes
//! only once it has no children, so no key ever names a dead parent.
//!
//! # Eviction and the host tier
//!
//! When a sequence needs a block and none is free, the least recently used entry that no
//! running sequence uses (unpinned) and that has no child in the pool is evicted, so the
//! pool-resident part of every chain stays a prefix of it (what a lookup can reach). With a
//! host tier the entry moves there (`ToHost`) rather than being lost, and a later hit brings
//! it back by copy (`FromHost`), never by recompute; a full host tier first drops its least
//! recently used entry without children. Blocks held by sequences and pinned entries are
//! never touched; when too few are left, the request gets [`KvError::PoolExhausted`].
//!
//! Both candidate sets are ordered by (last use, id), so each eviction costs O(log n).
//!
//! Layout: `blocks` holds the manager and its pool, `prefix` the entries and their index.

mod blocks;
mod prefix;
#[cfg(test)]
mod tests;

pub use blocks::BlockManager;

/// A copy between a pool block and a host slot that the caller must make, in the order
/// given, before the next forward pass reads or writes the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// Copy pool block `block` into host slot `slot`: an evicted entry kept for later.
    ToHost { block: u32, slot: u32 },
    /// Copy host slot `slot` into pool block `block`: a cached prefix coming back.
    FromHost { slot: u32, block: u32 },
}

/// Why the block manager could not do what was asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Every pool block a request could get is in use by running sequences: it has to wait
    /// for one to finish (or the pool must be larger).
    #[error(
        "the KV cache is full: {needed} more blocks of {block_size} positions are needed, but \
         of the pool's {total} blocks only {free} are free and {evictable} hold evictable \
         cached prefixes ({held} are held by running sequences and {pinned} hold cached \
         prefixes they use); it frees up as sequences finish, or give the pool more blocks"
    )]
    PoolExhausted {
        needed: usize,
        free: usize,
        evictable: usize,
        held: usize,
        pinned: usize,
        total: usize,
        block_size: usize,
    },
}

/// A snapshot of the pool and the cache for the server's metrics. Pool blocks are
/// `free_blocks + held_blocks + cached_blocks == total_blocks`; counters run from creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    pub total_blocks: usize,
    /// On the free list: never cached, or released.
    pub free_blocks: usize,
    /// Private to running sequences (not cache entries).
    pub held_blocks: usize,
    /// Cache entries in the pool, in use or not.
    pub cached_blocks: usize,
    /// Of those, the ones running sequences use (pinned: not evictable).
    pub cached_in_use_blocks: usize,
    pub host_slots: usize,
    /// Cache entries in the host tier.
    pub host_cached: usize,
    /// Cache entries that left the pool by eviction: moved to the host tier or dropped.
    pub evictions: u64,
    /// Host-tier entries dropped to make room.
    pub host_evictions: u64,
    /// Entries moved from the pool to the host tier.
    pub offloads: u64,
    /// Entries copied back from the host tier for a hit.
    pub restores: u64,
    /// Full prompt blocks looked up by `start` with the cache on (the hit rate's base).
    pub queried_blocks: u64,
    /// Of those, the ones found cached.
    pub hit_blocks: u64,
}
