//! The block manager: who holds each pool block and host slot, and the public calls a
//! scheduler makes as sequences start, grow and finish.

use ember_models::BlockTable;

use super::prefix::{EntryId, Location, PrefixCache};
use super::{BlockStats, KvError, Transfer};

/// What a pool block is doing; exactly one of these at any time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockState {
    /// On the free list.
    Free,
    /// In one running sequence's table, private to it (not a cache entry).
    Held,
    /// Where this cache entry's keys and values are (pinned by sequences or not).
    Cached(EntryId),
}

/// The bookkeeping of the KV pool: which blocks are free, held by sequences or cached, which
/// host slots hold which cached blocks, and the prefix cache over them.
///
/// Pure logic: it hands out block and slot numbers and asks for copies between them
/// ([`Transfer`]s) but never touches memory, so the scheduler can plan a step before the
/// backend runs it, and the tests can check every decision against a model of the memory.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<BlockState>,
    /// Free pool blocks; taken from the end.
    free_blocks: Vec<u32>,
    held: usize,
    /// Which entry each host slot holds.
    slots: Vec<Option<EntryId>>,
    free_slots: Vec<u32>,
    cache: PrefixCache,
    counters: Counters,
}

#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    evictions: u64,
    host_evictions: u64,
    offloads: u64,
    restores: u64,
    queried_blocks: u64,
    hit_blocks: u64,
}

impl BlockManager {
    /// A manager of `blocks` pool blocks of `block_size` positions and `host_slots` host
    /// slots (0: no host tier, evicted entries are dropped), everything free.
    pub fn new(blocks: usize, host_slots: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "a KV block holds at least one position");
        assert!(
            u32::try_from(blocks).is_ok() && u32::try_from(host_slots).is_ok(),
            "block and slot numbers are u32"
        );
        BlockManager {
            block_size,
            blocks: vec![BlockState::Free; blocks],
            // Reversed so blocks are handed out from 0 up: easier to read in logs and tests.
            free_blocks: (0..blocks as u32).rev().collect(),
            held: 0,
            slots: vec![None; host_slots],
            free_slots: (0..host_slots as u32).rev().collect(),
            cache: PrefixCache::new(block_size),
            counters: Counters::default(),
        }
    }

    /// Positions one block holds: a cache hit is reused to a multiple of this.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Starts a sequence for `prompt` and returns its table.
    ///
    /// With `use_cache`, the table begins with the longest cached prefix made of full
    /// blocks lying entirely inside `prompt[..prompt.len() - 1]` (the last prompt token is
    /// always computed again: its logits are needed, as in vLLM v1), and its `len` is those
    /// blocks' positions. The hit blocks are pinned (never evicted while the sequence runs);
    /// any in the host tier are brought back into pool blocks by `FromHost` transfers pushed
    /// onto `transfers` (evicting other unpinned entries if the pool is full: see
    /// [`reserve`](Self::reserve)), which the caller runs in order before the next forward
    /// pass. Without `use_cache`, or on a miss, the table is empty.
    ///
    /// The hit blocks are shared with the cache and other sequences: read-only. A caller
    /// must never truncate the table below its starting `len` and write those positions
    /// again (to recompute, finish the sequence and start it anew).
    ///
    /// Fails with [`KvError::PoolExhausted`] only when the pool cannot take back the hit's
    /// host-tier blocks: the sequence could not run then anyway. Nothing changes on failure.
    pub fn start(
        &mut self,
        prompt: &[u32],
        use_cache: bool,
        transfers: &mut Vec<Transfer>,
    ) -> Result<BlockTable, KvError> {
        if !use_cache {
            return Ok(BlockTable::new());
        }
        let bs = self.block_size();
        let lookup_blocks = prompt.len().saturating_sub(1) / bs;
        let mut hit = Vec::new();
        let mut parent = None;
        for chunk in prompt.chunks_exact(bs).take(lookup_blocks) {
            match self.cache.find(parent, chunk) {
                Some(id) => {
                    hit.push(id);
                    parent = Some(id);
                }
                None => break,
            }
        }
        // Pinned first, so that making room for the host-tier part cannot evict the rest.
        for &id in &hit {
            self.cache.pin(id);
        }
        let on_host = hit
            .iter()
            .filter(|&&id| matches!(self.cache.get(id).location, Location::Host(_)))
            .count();
        if let Err(err) = self.check_room(on_host) {
            for &id in &hit {
                self.cache.unpin(id);
            }
            return Err(err);
        }
        let mut table = Vec::with_capacity(hit.len());
        for &id in &hit {
            let block = match self.cache.get(id).location {
                Location::Device(block) => block,
                Location::Host(slot) => {
                    let block = self.take_block(transfers);
                    transfers.push(Transfer::FromHost { slot, block });
                    self.free_slot(slot);
                    self.cache.relocate(id, Location::Device(block));
                    self.blocks[block as usize] = BlockState::Cached(id);
                    self.counters.restores += 1;
                    block
                }
            };
            table.push(block);
        }
        self.counters.queried_blocks += lookup_blocks as u64;
        self.counters.hit_blocks += hit.len() as u64;
        Ok(BlockTable::with_blocks(table, hit.len() * bs))
    }

    /// Adds blocks to `table` until it covers `positions`: free blocks first, then blocks
    /// of evicted cache entries, least recently used first. Eviction takes only unpinned
    /// entries with no child in the pool; with a host tier it moves them there (a `ToHost`
    /// transfer pushed onto `transfers`, before the block is reused), dropping the least
    /// recently used childless host entry when the tier is full.
    ///
    /// Fails with [`KvError::PoolExhausted`], changing nothing, when the free and evictable
    /// blocks together are too few: the rest are held by running sequences.
    pub fn reserve(
        &mut self,
        table: &mut BlockTable,
        positions: usize,
        transfers: &mut Vec<Transfer>,
    ) -> Result<(), KvError> {
        let needed = positions
            .div_ceil(self.block_size())
            .saturating_sub(table.blocks().len());
        self.check_room(needed)?;
        for _ in 0..needed {
            let block = self.take_block(transfers);
            self.blocks[block as usize] = BlockState::Held;
            self.held += 1;
            table.push_block(block);
        }
        Ok(())
    }

    /// Ends a sequence, leaving `table` empty.
    ///
    /// `tokens` are the token ids of its filled positions (`table.len()` of them; extra ones
    /// are ignored, and blocks past the tokens given are not cached). With `cache`, each
    /// full filled block becomes (or stays) a cache entry keyed by its token prefix, so a
    /// later prompt that starts the same way skips computing it; where an equal entry
    /// already exists (another sequence cached the same prefix meanwhile, or the block was
    /// recomputed after a hit) the existing entry is kept and ours freed, or, if that entry
    /// is in the host tier, ours becomes its pool copy. Partial and unfilled blocks go back
    /// to the free list. Without `cache`, the blocks that were not cache entries go back to
    /// the free list. Either way the entries the sequence hit are unpinned.
    pub fn finish(&mut self, table: &mut BlockTable, tokens: &[u32], cache: bool) {
        let bs = self.block_size();
        let filled = table.len().min(tokens.len());
        let full = if cache { filled / bs } else { 0 };
        let blocks = table.take_blocks();
        let mut parent = None;
        for (i, &block) in blocks.iter().enumerate() {
            let state = self.blocks[block as usize];
            if i >= full {
                match state {
                    BlockState::Cached(id) => self.cache.unpin(id),
                    BlockState::Held => self.release(block),
                    BlockState::Free => panic!("finish: table block {block} is free"),
                }
                continue;
            }
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let id = match state {
                BlockState::Cached(id) => {
                    debug_assert!(
                        self.cache.get(id).parent == parent && *self.cache.get(id).tokens == *chunk,
                        "finish: tokens differ from the cached block {block} they were hit as"
                    );
                    self.cache.unpin(id);
                    self.cache.touch(id);
                    id
                }
                BlockState::Held => match self.cache.find(parent, chunk) {
                    Some(id) => {
                        match self.cache.get(id).location {
                            Location::Host(slot) => {
                                self.cache.relocate(id, Location::Device(block));
                                self.blocks[block as usize] = BlockState::Cached(id);
                                self.held -= 1;
                                self.free_slot(slot);
                            }
                            Location::Device(_) => self.release(block),
                        }
                        self.cache.touch(id);
                        id
                    }
                    None => {
                        let id = self.cache.insert(parent, chunk, Location::Device(block));
                        self.blocks[block as usize] = BlockState::Cached(id);
                        self.held -= 1;
                        id
                    }
                },
                BlockState::Free => panic!("finish: table block {block} is free"),
            };
            parent = Some(id);
        }
    }

    /// Drops every cache entry no running sequence uses, in both tiers (their blocks and
    /// slots become free): for a changed model state or an operator's explicit reset.
    /// Not counted as evictions.
    pub fn clear_cache(&mut self) {
        while let Some(id) = self.cache.host_victim() {
            self.drop_entry(id);
        }
        while let Some(id) = self.cache.device_victim() {
            for id in self.cache.subtree(id) {
                self.drop_entry(id);
            }
        }
    }

    /// Figures for the server's metrics and logs.
    pub fn stats(&self) -> BlockStats {
        BlockStats {
            total_blocks: self.blocks.len(),
            free_blocks: self.free_blocks.len(),
            held_blocks: self.held,
            cached_blocks: self.cache.device_entries(),
            cached_in_use_blocks: self.cache.device_pinned(),
            host_slots: self.slots.len(),
            host_cached: self.cache.host_entries(),
            evictions: self.counters.evictions,
            host_evictions: self.counters.host_evictions,
            offloads: self.counters.offloads,
            restores: self.counters.restores,
            queried_blocks: self.counters.queried_blocks,
            hit_blocks: self.counters.hit_blocks,
        }
    }

    /// Err unless `needed` blocks can be had from the free list and eviction.
    fn check_room(&self, needed: usize) -> Result<(), KvError> {
        let free = self.free_blocks.len();
        let evictable = self.cache.evictable();
        if needed <= free + evictable {
            return Ok(());
        }
        Err(KvError::PoolExhausted {
            needed,
            free,
            evictable,
            held: self.held,
            pinned: self.cache.device_pinned(),
            total: self.blocks.len(),
            block_size: self.block_size,
        })
    }

    /// A block off the free list, evicting a cache entry first when it is empty (the caller
    /// has checked with [`check_room`](Self::check_room) that one can be had).
    fn take_block(&mut self, transfers: &mut Vec<Transfer>) -> u32 {
        if self.free_blocks.is_empty() {
            self.evict(transfers);
        }
        let block = self.free_blocks.pop().expect("room was checked");
        debug_assert_eq!(self.blocks[block as usize], BlockState::Free);
        block
    }

    /// Frees one pool block by evicting the least recently used device leaf: to the host
    /// tier if it has or can make a free slot, else dropped with anything below it.
    fn evict(&mut self, transfers: &mut Vec<Transfer>) {
        let id = self.cache.device_victim().expect("room was checked");
        let Location::Device(block) = self.cache.get(id).location else {
            unreachable!("device candidates are on the device")
        };
        if !self.slots.is_empty()
            && self.free_slots.is_empty()
            && let Some(host) = self.cache.host_victim()
        {
            self.drop_entry(host);
            self.counters.host_evictions += 1;
        }
        match self.free_slots.pop() {
            Some(slot) => {
                transfers.push(Transfer::ToHost { block, slot });
                self.cache.relocate(id, Location::Host(slot));
                self.slots[slot as usize] = Some(id);
                self.free_block(block);
                self.counters.evictions += 1;
                self.counters.offloads += 1;
            }
            None => {
                // Below a device leaf everything is on the host: dropped with it, as it
                // would be unreachable.
                for gone in self.cache.subtree(id) {
                    match self.cache.get(gone).location {
                        Location::Device(_) => self.counters.evictions += 1,
                        Location::Host(_) => self.counters.host_evictions += 1,
                    }
                    self.drop_entry(gone);
                }
            }
        }
    }

    /// Removes a childless entry and frees its block or slot.
    fn drop_entry(&mut self, id: EntryId) {
        match self.cache.remove(id) {
            Location::Device(block) => self.free_block(block),
            Location::Host(slot) => self.free_slot(slot),
        }
    }

    /// A block a sequence held back to the free list.
    fn release(&mut self, block: u32) {
        debug_assert_eq!(self.blocks[block as usize], BlockState::Held);
        self.held -= 1;
        self.free_block(block);
    }

    fn free_block(&mut self, block: u32) {
        self.blocks[block as usize] = BlockState::Free;
        self.free_blocks.push(block);
    }

    fn free_slot(&mut self, slot: u32) {
        self.slots[slot as usize] = None;
        self.free_slots.push(slot);
    }

    /// Panics, naming the broken rule, unless every block and slot is in exactly one state
    /// that agrees with the cache entries, the free lists and counters are exact, and the
    /// cache's own invariants hold (every entry's parent live, device chains prefixes,
    /// candidate sets in sync). The tests call it after every operation.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        self.cache.check();
        let mut free = vec![false; self.blocks.len()];
        for &b in &self.free_blocks {
            assert_eq!(
                self.blocks[b as usize],
                BlockState::Free,
                "free-list block {b} not free"
            );
            assert!(!free[b as usize], "block {b} on the free list twice");
            free[b as usize] = true;
        }
        let mut held = 0;
        for (b, state) in self.blocks.iter().enumerate() {
            match *state {
                BlockState::Free => assert!(free[b], "free block {b} not on the free list"),
                BlockState::Held => held += 1,
                BlockState::Cached(id) => assert_eq!(
                    self.cache.get(id).location,
                    Location::Device(b as u32),
                    "block {b} names entry {id}, which is elsewhere"
                ),
            }
        }
        assert_eq!(self.held, held, "held block count");
        let mut free_slot = vec![false; self.slots.len()];
        for &s in &self.free_slots {
            assert_eq!(self.slots[s as usize], None, "free-list slot {s} in use");
            assert!(!free_slot[s as usize], "slot {s} on the free list twice");
            free_slot[s as usize] = true;
        }
        for (s, owner) in self.slots.iter().enumerate() {
            match *owner {
                None => assert!(free_slot[s], "free slot {s} not on the free list"),
                Some(id) => assert_eq!(
                    self.cache.get(id).location,
                    Location::Host(s as u32),
                    "slot {s} names entry {id}, which is elsewhere"
                ),
            }
        }
        for (id, e) in self.cache.iter() {
            match e.location {
                Location::Device(b) => assert_eq!(
                    self.blocks[b as usize],
                    BlockState::Cached(id),
                    "entry {id} says block {b}, which does not name it"
                ),
                Location::Host(s) => assert_eq!(
                    self.slots[s as usize],
                    Some(id),
                    "entry {id} says slot {s}, which does not name it"
                ),
            }
        }
        let s = self.stats();
        assert_eq!(
            s.free_blocks + s.held_blocks + s.cached_blocks,
            s.total_blocks,
            "free + held + cached != total"
        );
    }
}
