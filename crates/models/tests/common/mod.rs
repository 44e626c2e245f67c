//! What the batch tests share: the golden fixtures, deterministic tokens, logits as bits.

use std::path::PathBuf;

use ember_models::{BlockTable, KV_BLOCK_SIZE};

pub fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/golden")
        .join(name)
}

pub fn bits(row: &[f32]) -> Vec<u32> {
    row.iter().map(|x| x.to_bits()).collect()
}

/// Deterministic tokens: `len` of them from `seed`.
pub fn tokens(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as u32
        })
        .collect()
}

/// A new sequence's table with blocks of its own for `context` positions, the pool's next
/// blocks after `next_block` (advanced past them).
pub fn fresh_table(next_block: &mut u32, context: usize) -> BlockTable {
    let count = (context / KV_BLOCK_SIZE) as u32;
    let blocks = (*next_block..*next_block + count).collect();
    *next_block += count;
    BlockTable::with_blocks(blocks, 0)
}
