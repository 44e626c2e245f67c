//! The block manager against a model of the memory it manages: every block and slot holds
//! the token prefix its positions were computed for, transfers copy it, and every hit must
//! find exactly the prefix it is keyed by.

use ember_models::BlockTable;

use super::{BlockManager, BlockStats, KvError, Transfer};

/// The manager plus what its blocks and slots would hold: for each, the tokens of every
/// position up to the last one written in it (earlier tokens shape a position's keys and
/// values, so a block's content is its whole prefix).
struct Sim {
    kv: BlockManager,
    blocks: Vec<Vec<u32>>,
    slots: Vec<Vec<u32>>,
}

impl Sim {
    fn new(blocks: usize, host_slots: usize, block_size: usize) -> Self {
        Sim {
            kv: BlockManager::new(blocks, host_slots, block_size),
            blocks: vec![Vec::new(); blocks],
            slots: vec![Vec::new(); host_slots],
        }
    }

    fn bs(&self) -> usize {
        self.kv.block_size()
    }

    fn apply(&mut self, transfers: &[Transfer]) {
        for t in transfers {
            match *t {
                Transfer::ToHost { block, slot } => {
                    self.slots[slot as usize] = self.blocks[block as usize].clone();
                }
                Transfer::FromHost { slot, block } => {
                    self.blocks[block as usize] = self.slots[slot as usize].clone();
                }
            }
        }
    }

    /// `start`, with its transfers applied and its hit checked against the memory.
    fn start(&mut self, prompt: &[u32], use_cache: bool) -> Result<BlockTable, KvError> {
        let mut transfers = Vec::new();
        let table = self.kv.start(prompt, use_cache, &mut transfers);
        self.kv.check_invariants();
        let table = match table {
            Ok(table) => table,
            Err(e) => {
                assert!(transfers.is_empty(), "a failed start asked for copies");
                return Err(e);
            }
        };
        self.apply(&transfers);
        let bs = self.bs();
        assert_eq!(table.len() % bs, 0, "a hit is whole blocks");
        assert_eq!(table.blocks().len(), table.len() / bs);
        assert!(
            table.is_empty() || table.len() < prompt.len(),
            "the last token is recomputed"
        );
        assert!(use_cache || table.is_empty());
        self.check_table(&table, prompt);
        Ok(table)
    }

    /// `reserve` with its transfers applied.
    fn reserve(&mut self, table: &mut BlockTable, positions: usize) -> Result<(), KvError> {
        let mut transfers = Vec::new();
        let before = table.blocks().len();
        let result = self.kv.reserve(table, positions, &mut transfers);
        self.kv.check_invariants();
        if result.is_err() {
            assert!(transfers.is_empty(), "a failed reserve asked for copies");
            assert_eq!(
                table.blocks().len(),
                before,
                "a failed reserve changed the table"
            );
        }
        self.apply(&transfers);
        result
    }

    /// Computes positions `table.len()..tokens.len()` (a forward pass).
    fn fill(&mut self, table: &mut BlockTable, tokens: &[u32]) {
        let bs = self.bs();
        assert!(
            table.capacity(bs) >= tokens.len(),
            "fill past the reserved blocks"
        );
        for pos in table.len()..tokens.len() {
            self.blocks[table.blocks()[pos / bs] as usize] = tokens[..=pos].to_vec();
        }
        table.advance(tokens.len() - table.len());
    }

    fn finish(&mut self, table: &mut BlockTable, tokens: &[u32], cache: bool) {
        self.check_table(table, tokens);
        self.kv.finish(table, tokens, cache);
        assert!(
            table.blocks().is_empty() && table.is_empty(),
            "finish leaves the table empty"
        );
        self.kv.check_invariants();
    }

    /// A whole sequence: start, reserve, fill, finish with the cache.
    fn run(&mut self, tokens: &[u32]) {
        let mut table = self.start(tokens, true).unwrap();
        self.reserve(&mut table, tokens.len()).unwrap();
        self.fill(&mut table, tokens);
        self.finish(&mut table, tokens, true);
    }

    /// Every filled block holds the prefix of `tokens` it was computed for.
    fn check_table(&self, table: &BlockTable, tokens: &[u32]) {
        let bs = self.bs();
        for (i, &b) in table.blocks().iter().enumerate() {
            let end = ((i + 1) * bs).min(table.len()).min(tokens.len());
            if end <= i * bs {
                break;
            }
            // Positions past a truncated table's length may hold more: only its own count.
            let held = &self.blocks[b as usize];
            assert!(
                held.len() >= end && held[..end] == tokens[..end],
                "block {b} (table index {i}) holds {held:?}, not {:?}",
                &tokens[..end]
            );
        }
    }

    fn stats(&self) -> BlockStats {
        self.kv.stats()
    }
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn same_prompt_twice_hits_the_full_blocks_before_the_last_token() {
    let mut sim = Sim::new(16, 0, 16);
    let prompt = tokens(0..40);
    sim.run(&prompt);
    assert_eq!(sim.stats().cached_blocks, 2);
    let table = sim.start(&prompt, true).unwrap();
    assert_eq!(table.len(), 32);
    assert_eq!(sim.stats().cached_in_use_blocks, 2);

    // Exactly k blocks: the last block holds the last token, so only k - 1 are hit.
    let mut sim = Sim::new(16, 0, 16);
    let prompt = tokens(100..148);
    sim.run(&prompt);
    assert_eq!(sim.stats().cached_blocks, 3);
    let mut table = sim.start(&prompt, true).unwrap();
    assert_eq!(table.len(), 32);
    assert_eq!((sim.stats().queried_blocks, sim.stats().hit_blocks), (4, 2));

    // The recomputed last block duplicates the cached one: ours is freed, not cached twice.
    sim.reserve(&mut table, prompt.len()).unwrap();
    sim.fill(&mut table, &prompt);
    sim.finish(&mut table, &prompt, true);
    let s = sim.stats();
    assert_eq!(
        (s.cached_blocks, s.cached_in_use_blocks, s.held_blocks),
        (3, 0, 0)
    );
    assert_eq!(s.free_blocks, 13);

    // Without the cache, nothing is looked up.
    assert!(sim.start(&prompt, false).unwrap().is_empty());
}

#[test]
fn a_conversation_extended_hits_its_prompt_and_reply() {
    let mut sim = Sim::new(32, 0, 16);
    let prompt = tokens(0..40);
    let mut table = sim.start(&prompt, true).unwrap();
    sim.reserve(&mut table, prompt.len()).unwrap();
    sim.fill(&mut table, &prompt);
    // A 30-token reply, reserved token by token as decoding does.
    let mut all = prompt.clone();
    for t in 1000..1030 {
        all.push(t);
        sim.reserve(&mut table, all.len()).unwrap();
        sim.fill(&mut table, &all);
    }
    let blocks = table.blocks()[..4].to_vec();
    sim.finish(&mut table, &all, true);
    assert_eq!(sim.stats().cached_blocks, 4);

    all.extend(2000..2010); // the next user message: 80 tokens
    let table = sim.start(&all, true).unwrap();
    assert_eq!(
        table.len(),
        64,
        "the prompt's blocks and the reply's full ones"
    );
    assert_eq!(table.blocks(), blocks);
}

#[test]
fn prompts_diverging_inside_a_block_share_the_blocks_before_it() {
    let mut sim = Sim::new(16, 0, 16);
    let a: Vec<u32> = (0..40).chain(100..120).collect();
    let b: Vec<u32> = (0..40).chain(200..220).collect();
    sim.run(&a);
    let mut table = sim.start(&b, true).unwrap();
    assert_eq!(table.len(), 32);
    sim.reserve(&mut table, b.len()).unwrap();
    sim.fill(&mut table, &b);
    sim.finish(&mut table, &b, true);
    // Two shared blocks and a third block for each.
    assert_eq!(sim.stats().cached_blocks, 4);
    assert_eq!(sim.start(&a, true).unwrap().len(), 48);
    assert_eq!(sim.start(&b, true).unwrap().len(), 48);
}

#[test]
fn eviction_takes_the_least_recently_used_leaf() {
    let mut sim = Sim::new(5, 0, 4);
    sim.run(&tokens(0..8)); // chain c1 (block 0) -> c2 (block 1)
    sim.run(&tokens(10..14)); // p (block 2)
    sim.run(&tokens(20..24)); // q (block 3)
    // A hit makes the chain the most recent; p is now the oldest, then q.
    let mut t = sim.start(&tokens(0..9), true).unwrap();
    assert_eq!(t.blocks(), [0, 1]);
    sim.finish(&mut t, &[], false);

    let mut table = BlockTable::new();
    let order: Vec<u32> = (1..=5)
        .map(|n| {
            sim.reserve(&mut table, 4 * n).unwrap();
            table.blocks()[n - 1]
        })
        .collect();
    // The free block, p, q, then the chain from its leaf up.
    assert_eq!(order, [4, 2, 3, 1, 0]);
    assert_eq!(sim.stats().evictions, 4);
    assert!(matches!(
        sim.reserve(&mut table, 24),
        Err(KvError::PoolExhausted {
            needed: 1,
            free: 0,
            evictable: 0,
            held: 5,
            ..
        })
    ));
}

#[test]
fn pinned_blocks_are_never_evicted() {
    let mut sim = Sim::new(8, 0, 4);
    let a = tokens(0..16);
    let c = tokens(100..116);
    sim.run(&a); // 4 entries
    sim.run(&c); // 4 more: the pool is all cache
    // B holds A's first three blocks (the fourth holds its last prompt token).
    let mut b = sim.start(&a, true).unwrap();
    assert_eq!(b.blocks(), [0, 1, 2]);
    assert_eq!(sim.stats().cached_in_use_blocks, 3);

    // D takes everything else, leaves first: A's fourth block (the oldest: B's hit did not
    // touch it), C's fourth, then the rest of C's chain.
    let mut d = BlockTable::new();
    sim.reserve(&mut d, 8).unwrap();
    assert_eq!(d.blocks(), [3, 7]);
    let mut probe = sim.start(&c, true).unwrap();
    assert_eq!(probe.len(), 12, "C keeps the start of its chain");
    sim.finish(&mut probe, &[], false);
    sim.reserve(&mut d, 20).unwrap();
    assert_eq!(d.blocks(), [3, 7, 6, 5, 4]);
    assert_eq!(sim.stats().evictions, 5);

    let err = sim.reserve(&mut d, 24).unwrap_err();
    assert_eq!(
        err,
        KvError::PoolExhausted {
            needed: 1,
            free: 0,
            evictable: 0,
            held: 5,
            pinned: 3,
            total: 8,
            block_size: 4,
        }
    );
    // B's blocks are untouched and still the cache's: B's prompt hits them again.
    assert_eq!(sim.stats().cached_in_use_blocks, 3);
    sim.check_table(&b, &a);
    let mut again = sim.start(&a, true).unwrap();
    assert_eq!(again.blocks(), [0, 1, 2]);
    sim.finish(&mut again, &[], false);
    sim.finish(&mut b, &a[..12], true);
    assert_eq!(sim.stats().cached_in_use_blocks, 0);
}

#[test]
fn a_full_pool_refuses_with_a_clear_message_until_the_holder_finishes() {
    let mut sim = Sim::new(4, 0, 16);
    let long = tokens(0..64);
    let mut a = sim.start(&long, false).unwrap();
    sim.reserve(&mut a, 64).unwrap();
    sim.fill(&mut a, &long);

    let mut b = sim.start(&tokens(500..510), true).unwrap();
    let err = sim.reserve(&mut b, 10).unwrap_err();
    let message = err.to_string();
    for part in [
        "KV cache is full",
        "1 more blocks of 16 positions",
        "4 blocks only 0 are free",
    ] {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
    assert!(
        message.contains("4 are held by running sequences"),
        "{message}"
    );

    sim.finish(&mut a, &long, false);
    assert_eq!(sim.stats().free_blocks, 4);
    sim.reserve(&mut b, 10).unwrap();
}

#[test]
fn host_tier_round_trip() {
    let mut sim = Sim::new(2, 2, 4);
    let a = tokens(0..8);
    let b = tokens(10..18);
    let c = tokens(20..28);
    let d = tokens(30..38);
    let plus_one = |t: &[u32]| -> Vec<u32> { t.iter().copied().chain([99]).collect() };
    sim.run(&a); // a1 in block 0, a2 in block 1

    // B needs the whole pool: A's chain goes to the host, leaf first.
    let mut t = sim.start(&b, true).unwrap();
    let mut transfers = Vec::new();
    sim.kv.reserve(&mut t, 8, &mut transfers).unwrap();
    use Transfer::{FromHost, ToHost};
    assert_eq!(
        transfers,
        [ToHost { block: 1, slot: 0 }, ToHost { block: 0, slot: 1 }]
    );
    sim.apply(&transfers);
    sim.kv.check_invariants();
    sim.fill(&mut t, &b);
    sim.finish(&mut t, &b, true); // b1 in block 1, b2 in block 0
    let s = sim.stats();
    assert_eq!(
        (s.offloads, s.evictions, s.host_cached, s.cached_blocks),
        (2, 2, 2, 2)
    );

    // A returns: a1 (slot 1) then a2 (slot 0) come back by copy. The host slots are A's
    // until copied, so b2 is dropped for a1's block; b1 then takes the slot a1 left.
    let a_next = plus_one(&a);
    let mut transfers = Vec::new();
    let mut t = sim.kv.start(&a_next, true, &mut transfers).unwrap();
    sim.kv.check_invariants();
    assert_eq!(
        transfers,
        [
            FromHost { slot: 1, block: 0 },
            ToHost { block: 1, slot: 1 },
            FromHost { slot: 0, block: 1 },
        ]
    );
    sim.apply(&transfers);
    assert_eq!((t.blocks(), t.len()), (&[0, 1][..], 8));
    sim.check_table(&t, &a_next);
    let s = sim.stats();
    assert_eq!(
        (s.restores, s.offloads, s.evictions, s.host_cached),
        (2, 3, 4, 1)
    );
    sim.finish(&mut t, &a_next, true);

    // C: A's chain goes back to the host; the host is full for a1, so it drops b1, its
    // least recently used entry without children.
    let mut t = sim.start(&c, true).unwrap();
    let mut transfers = Vec::new();
    sim.kv.reserve(&mut t, 8, &mut transfers).unwrap();
    assert_eq!(
        transfers,
        [ToHost { block: 1, slot: 0 }, ToHost { block: 0, slot: 1 }]
    );
    sim.apply(&transfers);
    sim.kv.check_invariants();
    sim.fill(&mut t, &c);
    sim.finish(&mut t, &c, true);
    assert_eq!(sim.stats().host_evictions, 1);
    assert!(
        sim.start(&plus_one(&b), true).unwrap().is_empty(),
        "b1 was dropped"
    );

    // D: the host drops A's chain leaf first (a1 is older but has a child until a2 goes).
    let mut t = sim.start(&d, true).unwrap();
    let mut transfers = Vec::new();
    sim.kv.reserve(&mut t, 8, &mut transfers).unwrap();
    assert_eq!(
        transfers,
        [ToHost { block: 0, slot: 0 }, ToHost { block: 1, slot: 1 }]
    );
    sim.apply(&transfers);
    sim.kv.check_invariants();
    sim.fill(&mut t, &d);
    sim.finish(&mut t, &d, true);
    assert_eq!(sim.stats().host_evictions, 3);
    assert!(
        sim.start(&a_next, true).unwrap().is_empty(),
        "A's chain was dropped"
    );
    let mut t = sim.start(&plus_one(&c), true).unwrap();
    assert_eq!(t.len(), 8, "C comes back from the host");
    sim.finish(&mut t, &[], false);
}

#[test]
fn a_cancelled_sequence_caches_only_its_full_filled_blocks() {
    let mut sim = Sim::new(10, 0, 16);
    let prompt = tokens(0..50);
    let mut t = sim.start(&prompt, true).unwrap();
    sim.reserve(&mut t, 100).unwrap(); // 7 blocks, 50 positions filled
    sim.fill(&mut t, &prompt);
    let s = sim.stats();
    assert_eq!((s.held_blocks, s.free_blocks), (7, 3));
    sim.finish(&mut t, &prompt, true);
    let s = sim.stats();
    assert_eq!((s.cached_blocks, s.free_blocks, s.held_blocks), (3, 7, 0));
    assert_eq!(
        s.free_blocks + s.cached_blocks + s.held_blocks,
        s.total_blocks
    );

    // Cancelled after a hit, before computing anything: its hit is only unpinned.
    let longer = tokens(0..70);
    let mut t = sim.start(&longer, true).unwrap();
    assert_eq!(t.len(), 48);
    sim.reserve(&mut t, 70).unwrap();
    sim.finish(&mut t, &longer[..48], true);
    let s = sim.stats();
    assert_eq!(
        (s.cached_blocks, s.cached_in_use_blocks, s.free_blocks),
        (3, 0, 7)
    );

    // Finished without the cache, mid-block: the private blocks are all freed.
    let other = tokens(500..540);
    let mut t = sim.start(&other, true).unwrap();
    sim.reserve(&mut t, 64).unwrap();
    sim.fill(&mut t, &other[..37]);
    sim.finish(&mut t, &other[..37], false);
    assert_eq!(sim.stats().free_blocks, 7);
}

#[test]
fn clear_cache_drops_all_but_what_sequences_use() {
    let mut sim = Sim::new(6, 4, 4);
    sim.run(&tokens(0..12));
    sim.run(&tokens(20..32));
    sim.run(&tokens(40..52)); // pushes part of the first chain to the host
    assert!(sim.stats().host_cached > 0);
    let mut t = sim.start(&tokens(40..53), true).unwrap();
    assert_eq!(t.len(), 12);
    sim.kv.clear_cache();
    sim.kv.check_invariants();
    let s = sim.stats();
    assert_eq!(
        (s.cached_blocks, s.cached_in_use_blocks, s.host_cached),
        (3, 3, 0)
    );
    assert_eq!(s.free_blocks, 3);
    sim.finish(&mut t, &[], false);
    sim.kv.clear_cache();
    assert_eq!(sim.stats().free_blocks, 6);
}

/// splitmix64: a seeded, dependency-free source for the random workload.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

struct Live {
    table: BlockTable,
    tokens: Vec<u32>,
}

/// Thousands of random starts, steps, cancellations and finishes of overlapping
/// conversations on a small pool: invariants after every call, and the memory model
/// checks every hit and every live sequence's blocks.
fn random_workload(seed: u64, blocks: usize, host_slots: usize, block_size: usize) -> BlockStats {
    let mut rng = Rng(seed);
    let mut sim = Sim::new(blocks, host_slots, block_size);
    let mut live: Vec<Live> = Vec::new();
    let mut history: Vec<Vec<u32>> = Vec::new();
    let mut refused = 0;
    for _ in 0..4000 {
        match rng.below(10) {
            0..=2 if live.len() < 4 => {
                let mut prompt = if !history.is_empty() && rng.chance(75) {
                    let h = &history[rng.below(history.len())];
                    h[..rng.below(h.len() + 1)].to_vec()
                } else {
                    Vec::new()
                };
                // A vocabulary of 3 makes unrelated prompts collide too.
                let extra = 1 + rng.below(3 * block_size);
                prompt.extend((0..extra).map(|_| rng.below(3) as u32));
                let Ok(mut table) = sim.start(&prompt, rng.chance(85)) else {
                    refused += 1;
                    continue;
                };
                if sim.reserve(&mut table, prompt.len()).is_err() {
                    refused += 1;
                    let filled = table.len();
                    sim.finish(&mut table, &prompt[..filled], rng.chance(50));
                    continue;
                }
                sim.fill(&mut table, &prompt);
                live.push(Live {
                    table,
                    tokens: prompt,
                });
            }
            3..=6 if !live.is_empty() => {
                let i = rng.below(live.len());
                let steps = 1 + rng.below(block_size + 2);
                let seq = &mut live[i];
                let want = seq.tokens.len() + steps;
                if sim.reserve(&mut seq.table, want).is_err() {
                    // Preempted: its work so far may be cached for when it comes back.
                    refused += 1;
                    let mut seq = live.swap_remove(i);
                    let cache = rng.chance(70);
                    sim.finish(&mut seq.table, &seq.tokens, cache);
                    continue;
                }
                seq.tokens.extend((0..steps).map(|_| rng.below(3) as u32));
                let (table, tokens) = (&mut seq.table, &seq.tokens);
                sim.fill(table, tokens);
            }
            7..=8 if !live.is_empty() => {
                let mut seq = live.swap_remove(rng.below(live.len()));
                if rng.chance(30) {
                    // Cancelled: the last positions are dropped before they count.
                    let keep = rng.below(seq.table.len() + 1);
                    seq.table.truncate(keep);
                    seq.tokens.truncate(keep);
                }
                let cache = rng.chance(80);
                sim.finish(&mut seq.table, &seq.tokens, cache);
                history.push(seq.tokens);
                if history.len() > 12 {
                    history.remove(rng.below(history.len()));
                }
            }
            9 if rng.chance(3) => {
                sim.kv.clear_cache();
                sim.kv.check_invariants();
            }
            _ => {}
        }
        for seq in &live {
            sim.check_table(&seq.table, &seq.tokens);
        }
        let s = sim.stats();
        assert_eq!(
            s.free_blocks + s.held_blocks + s.cached_blocks,
            s.total_blocks
        );
    }
    for mut seq in live {
        sim.finish(&mut seq.table, &seq.tokens, true);
    }
    let s = sim.stats();
    assert_eq!((s.held_blocks, s.cached_in_use_blocks), (0, 0));
    assert!(
        refused > 0,
        "the workload never ran out of blocks: too small a test"
    );
    s
}

#[test]
fn random_workloads_keep_every_invariant_and_every_hit_exact() {
    for seed in 1..=3 {
        let s = random_workload(seed, 24, 0, 4);
        assert!(s.hit_blocks > 100 && s.evictions > 50, "seed {seed}: {s:?}");
        assert_eq!((s.host_cached, s.offloads, s.restores), (0, 0, 0));

        let s = random_workload(seed, 24, 8, 4);
        assert!(
            s.restores > 20 && s.host_evictions > 20,
            "seed {seed}: {s:?}"
        );
        assert!(s.offloads > s.restores, "seed {seed}: {s:?}");

        // A host tier larger than the pool, and blocks of one position.
        random_workload(seed, 12, 40, 1);
    }
}
