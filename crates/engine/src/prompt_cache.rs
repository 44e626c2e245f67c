//! The prompt cache's budget and its figures: how much of the KV pool (and of a GPU's host
//! tier) the cache may hold, decided once at load, and the counters `/metrics` and `/health`
//! read while the engine runs.
//!
//! The cache lives inside the KV pool (`crate::kv`): the pool is one sequence's context
//! plus the cache's budget, made at load and held by the residency set with everything else,
//! so the cache never grows memory the set does not hold.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// How much memory the prompt cache may take (`--prompt-cache-gib`, `--prompt-cache-host-gib`).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum CacheBudget {
    /// No cache: every request prefills its whole prompt (the library's default, so tests and
    /// embedders opt in).
    #[default]
    Off,
    /// The device's share ([`DEFAULT_CACHE_GIB_CPU`], [`DEFAULT_CACHE_GIB_GPU`],
    /// [`DEFAULT_HOST_TIER_GIB_GPU`]), clamped to half the room the residency bound leaves.
    Auto,
    /// This many GiB, as asked; the residency load line says when it does not fit.
    Gib(f64),
}

impl std::str::FromStr for CacheBudget {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "auto" {
            return Ok(CacheBudget::Auto);
        }
        match s.parse::<f64>() {
            Ok(0.0) => Ok(CacheBudget::Off),
            Ok(g) if g.is_finite() && g > 0.0 => Ok(CacheBudget::Gib(g)),
            _ => Err(format!(
                "{s:?}: expected auto or a size in GiB (0 turns it off)"
            )),
        }
    }
}

/// The prompt cache's share of RAM on the CPU when none is asked for.
pub const DEFAULT_CACHE_GIB_CPU: f64 = 2.0;
/// Its share of device memory on a GPU.
pub const DEFAULT_CACHE_GIB_GPU: f64 = 8.0;
/// The host tier's pinned memory on a GPU (none on the CPU: it would be the same memory).
pub const DEFAULT_HOST_TIER_GIB_GPU: f64 = 16.0;

const GIB: f64 = (1u64 << 30) as f64;

/// Blocks of `block_bytes` a budget takes. `room` is what the residency bound leaves on that
/// side once everything else is counted; `auto_gib` the default share (0: none by default).
pub(crate) fn budget_blocks(
    budget: CacheBudget,
    auto_gib: f64,
    room: u64,
    block_bytes: usize,
) -> usize {
    let bytes = match budget {
        CacheBudget::Off => 0.0,
        CacheBudget::Gib(g) => g * GIB,
        // Half the room at most: the rest of the machine (and other requests' activations)
        // keeps the other half.
        CacheBudget::Auto => (auto_gib * GIB).min(room as f64 / 2.0),
    };
    (bytes / block_bytes.max(1) as f64) as usize
}

/// What the cache holds and has done, shared with the server's `/metrics` and `/health`.
#[derive(Debug, Default)]
pub struct PromptCacheStats {
    block_bytes: AtomicU64,
    /// Blocks the pool gives the cache beyond one sequence's context, and host tier slots.
    budget_blocks: AtomicU64,
    host_budget_blocks: AtomicU64,
    blocks: AtomicU64,
    host_blocks: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_tokens: AtomicU64,
    evictions: AtomicU64,
    host_evictions: AtomicU64,
}

/// A copy of [`PromptCacheStats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PromptCacheSnapshot {
    /// Whether requests look up and keep prefixes at all.
    pub enabled: bool,
    /// The budget and what the cached blocks take of it, in bytes (device memory on a GPU).
    pub budget_bytes: u64,
    pub bytes: u64,
    pub blocks: u64,
    pub host_budget_bytes: u64,
    pub host_bytes: u64,
    pub host_blocks: u64,
    /// Requests that reused at least one cached block, and those that reused none.
    pub hits_total: u64,
    pub misses_total: u64,
    /// Prompt tokens served from the cache.
    pub hit_tokens_total: u64,
    /// Blocks that left the pool (to the host tier or dropped), and host slots dropped.
    pub evictions_total: u64,
    pub host_evictions_total: u64,
}

impl PromptCacheStats {
    pub(crate) fn new(block_bytes: usize, budget_blocks: usize, host_budget_blocks: usize) -> Self {
        let stats = PromptCacheStats::default();
        stats
            .block_bytes
            .store(block_bytes as u64, Ordering::Relaxed);
        stats
            .budget_blocks
            .store(budget_blocks as u64, Ordering::Relaxed);
        stats
            .host_budget_blocks
            .store(host_budget_blocks as u64, Ordering::Relaxed);
        stats
    }

    /// A request's lookup: `cached` prompt tokens came from the cache.
    pub(crate) fn record_lookup(&self, cached: usize) {
        if cached > 0 {
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.hit_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The cache's contents and eviction counters after a request.
    pub(crate) fn record_contents(
        &self,
        blocks: usize,
        host_blocks: usize,
        evictions: u64,
        host_evictions: u64,
    ) {
        self.blocks.store(blocks as u64, Ordering::Relaxed);
        self.host_blocks
            .store(host_blocks as u64, Ordering::Relaxed);
        self.evictions.store(evictions, Ordering::Relaxed);
        self.host_evictions.store(host_evictions, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> PromptCacheSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let block = get(&self.block_bytes);
        let (budget, host_budget) = (get(&self.budget_blocks), get(&self.host_budget_blocks));
        PromptCacheSnapshot {
            enabled: budget > 0,
            budget_bytes: budget * block,
            bytes: get(&self.blocks) * block,
            blocks: get(&self.blocks),
            host_budget_bytes: host_budget * block,
            host_bytes: get(&self.host_blocks) * block,
            host_blocks: get(&self.host_blocks),
            hits_total: get(&self.hits),
            misses_total: get(&self.misses),
            hit_tokens_total: get(&self.hit_tokens),
            evictions_total: get(&self.evictions),
            host_evictions_total: get(&self.host_evictions),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_and_size() {
        assert_eq!("auto".parse::<CacheBudget>(), Ok(CacheBudget::Auto));
        assert_eq!("0".parse::<CacheBudget>(), Ok(CacheBudget::Off));
        assert_eq!("1.5".parse::<CacheBudget>(), Ok(CacheBudget::Gib(1.5)));
        assert!("-1".parse::<CacheBudget>().is_err());
        assert!("lots".parse::<CacheBudget>().is_err());
        let mib = 1 << 20;
        // 1 GiB asked: 1024 blocks of 1 MiB, whatever the room.
        assert_eq!(budget_blocks(CacheBudget::Gib(1.0), 2.0, 0, mib), 1024);
        // Auto: the default share, or half the room when that is less.
        assert_eq!(budget_blocks(CacheBudget::Auto, 2.0, 100 << 30, mib), 2048);
        assert_eq!(budget_blocks(CacheBudget::Auto, 2.0, 1 << 30, mib), 512);
        assert_eq!(budget_blocks(CacheBudget::Auto, 0.0, 1 << 30, mib), 0);
        assert_eq!(budget_blocks(CacheBudget::Off, 2.0, 100 << 30, mib), 0);
    }
}
