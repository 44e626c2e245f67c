//! The KV pool's plan at load: how many blocks the running sequences and the prompt cache get
//! in the room the residency bound leaves, and the load line that says so.

use ember_models::KvLayout;
use ember_residency::Bound;
use ember_tensor::BufferOwner;

use super::EngineOptions;
use crate::prompt_cache::{
    DEFAULT_CACHE_GIB_CPU, DEFAULT_CACHE_GIB_GPU, DEFAULT_HOST_TIER_GIB_GPU, budget_blocks,
};

/// The KV pool made at load: one sequence's context of blocks plus the prompt cache's budget,
/// and the host tier's slots, with the figures for the load line.
pub(super) struct PoolPlan {
    /// A pool's geometry (a rank's, where the model is split).
    pub layout: KvLayout,
    /// Blocks in the pool, and how many of them are the cache's beyond the sequence's.
    pub blocks: usize,
    pub cache_blocks: usize,
    pub host_blocks: usize,
    on_gpu: bool,
    /// Pools of this plan: the ranks of a split model, each holding its heads' share of
    /// every block (in one memory, or on GPUs counted together).
    pools: usize,
}

impl PoolPlan {
    /// Sizes the budgets against the room the residency bound leaves once what `owner` lists
    /// (the weights and activations) and the sequence's blocks are counted: `auto` takes the
    /// device's default share, clamped to half that room; a size asked for is taken as is
    /// (the residency load line says when it does not fit).
    /// `layout` is a pool's (a rank's, of a split model), and `pools` how many such share
    /// the memory: the host's, or `device_memory` (a split model's GPUs', together).
    pub(super) fn new(
        options: &EngineOptions,
        layout: KvLayout,
        context: usize,
        parallel: usize,
        owner: &BufferOwner,
        device_memory: Option<u64>,
        pools: usize,
    ) -> PoolPlan {
        // What a block is in all: every pool's share of it.
        let block_bytes = layout.block_bytes() * pools;
        // A whole context for each sequence that may run at once, or the share asked for (at
        // least one whole context: a request of the full length must fit alone).
        let seq_blocks = match options.kv_pool_tokens {
            Some(tokens) => layout.blocks_for(tokens.max(context)),
            None => layout.blocks_for(context) * parallel,
        };
        let seq_bytes = (seq_blocks * block_bytes) as u64;
        let bound = Bound::from_system(options.load_limit_gib);
        let (mut host_listed, mut device_listed) = (0u64, 0u64);
        for b in owner.list() {
            match b.location {
                ember_tensor::Location::Host => host_listed += b.bytes as u64,
                _ => device_listed += b.bytes as u64,
            }
        }
        let host_room = bound.host_bytes().saturating_sub(host_listed);
        let (cache_room, cache_default, host_default) = match device_memory {
            Some(memory) => (
                memory.saturating_sub(device_listed + seq_bytes),
                DEFAULT_CACHE_GIB_GPU,
                DEFAULT_HOST_TIER_GIB_GPU,
            ),
            None => (
                host_room.saturating_sub(seq_bytes),
                DEFAULT_CACHE_GIB_CPU,
                0.0,
            ),
        };
        let cache_blocks =
            budget_blocks(options.prompt_cache, cache_default, cache_room, block_bytes);
        let cache_bytes = (cache_blocks * block_bytes) as u64;
        // On the CPU the host tier shares the RAM the cache already took.
        let host_room = match device_memory {
            Some(_) => host_room,
            None => host_room.saturating_sub(seq_bytes + cache_bytes),
        };
        // Without a cache there is nothing to keep on the host either.
        let host_blocks = if cache_blocks == 0 {
            0
        } else {
            budget_blocks(
                options.prompt_cache_host,
                host_default,
                host_room,
                block_bytes,
            )
        };
        PoolPlan {
            layout,
            blocks: seq_blocks + cache_blocks,
            cache_blocks,
            host_blocks,
            on_gpu: device_memory.is_some(),
            pools,
        }
    }

    /// A block's bytes in all the plan's pools.
    pub(super) fn block_bytes(&self) -> usize {
        self.layout.block_bytes() * self.pools
    }

    pub(super) fn caching(&self) -> bool {
        self.cache_blocks > 0
    }

    /// One line: the pool, the cache's share and the host tier, or that the cache is off.
    pub(super) fn log(&self) {
        let gib = |blocks: usize| (blocks * self.block_bytes()) as f64 / (1u64 << 30) as f64;
        let memory = match (self.on_gpu, self.pools) {
            (true, 1) => "device memory".to_string(),
            (false, 1) => "RAM".to_string(),
            (true, ranks) => {
                format!("device memory, each block's heads shared among {ranks} ranks")
            }
            (false, ranks) => format!("RAM, each block's heads shared among {ranks} ranks"),
        };
        if !self.caching() {
            tracing::info!(
                "kv pool: {} blocks of {} positions ({:.2} GiB of {memory}); prompt cache off",
                self.blocks,
                self.layout.block_size,
                gib(self.blocks)
            );
            return;
        }
        let host = if self.host_blocks > 0 {
            format!(
                ", host tier {:.2} GiB ({} blocks)",
                gib(self.host_blocks),
                self.host_blocks
            )
        } else {
            String::new()
        };
        tracing::info!(
            "kv pool: {} blocks of {} positions ({:.2} GiB of {memory}); prompt cache {:.2} GiB \
             ({} blocks, {} KiB each){host}",
            self.blocks,
            self.layout.block_size,
            gib(self.blocks),
            gib(self.cache_blocks),
            self.cache_blocks,
            self.block_bytes() / 1024
        );
    }
}
