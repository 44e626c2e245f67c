//! Keys and values in a pool of fixed-size blocks, and a sequence's table of its blocks.
//!
//! The pool is made once at load, for every sequence and the prompt cache together; a
//! sequence holds a [`BlockTable`] of the blocks its positions are in. Blocks move between
//! sequences and the cache by changing hands, never by copying or allocating, and sequences
//! with a common prefix read the same blocks.
//!
//! A block is one contiguous run of memory holding its positions for every layer,
//! `[layer][keys, values][block_size][kv_dim]`, so a block moves to and from a host tier in
//! one copy.

use ember_tensor::cpu::{KvSlice, PagedKv};
use ember_tensor::{Buffer, BufferKind, BufferOwner};

use crate::backend::KvStore;
use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// Positions a block holds (vLLM's default): a prompt cache hit is reused to within this many
/// tokens, and a block table costs 4 bytes per this many positions.
pub const KV_BLOCK_SIZE: usize = 16;

/// How cached keys and values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// Exact: what the golden tests against transformers need.
    F32,
    /// Half the memory and the decode reads; what llama.cpp keeps by default.
    F16,
    /// bf16 bits: half the memory and the decode reads, the model's own type for bf16
    /// checkpoints (what transformers and vLLM keep for them).
    Bf16,
}

impl KvDtype {
    /// The name `--kv-type` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }

    pub fn size_in_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

/// Where a position's keys and values lie in a pool's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    /// Elements of one position's keys (or values) in one layer: `kv_heads · head_dim`.
    pub kv_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    pub fn new(config: &ModelConfig, dtype: KvDtype) -> Self {
        KvLayout {
            layers: config.num_hidden_layers,
            kv_dim: config.kv_dim(),
            block_size: KV_BLOCK_SIZE,
            dtype,
        }
    }

    /// Elements of one block: every layer's keys and values of its positions.
    pub fn block_elems(&self) -> usize {
        self.layers * 2 * self.block_size * self.kv_dim
    }

    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size_in_bytes()
    }

    /// Elements from a block's start to `layer`'s keys; its values follow them.
    pub fn keys_offset(&self, layer: usize) -> usize {
        layer * 2 * self.block_size * self.kv_dim
    }

    pub fn values_offset(&self, layer: usize) -> usize {
        self.keys_offset(layer) + self.block_size * self.kv_dim
    }

    /// Element offset of position `pos`'s row of `layer`'s keys, through `table`.
    pub fn key_row(&self, table: &[u32], layer: usize, pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_elems()
            + self.keys_offset(layer)
            + pos % self.block_size * self.kv_dim
    }

    /// Blocks that hold `positions`.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// Bytes of pool block `block` and of host slot `slot`, after checking that a pool of
    /// `blocks` and a tier of `host_blocks` have them (a transfer between the two).
    pub fn transfer_ranges(
        &self,
        block: u32,
        slot: u32,
        blocks: usize,
        host_blocks: usize,
        backend: &'static str,
    ) -> Result<(std::ops::Range<usize>, std::ops::Range<usize>)> {
        if block as usize >= blocks || slot as usize >= host_blocks {
            return Err(Error::Unsupported {
                what: format!(
                    "kv block {block} / host slot {slot} past the pool's {blocks} / {host_blocks}"
                ),
                backend,
            });
        }
        let bytes = self.block_bytes();
        let at = |i: u32| i as usize * bytes..(i as usize + 1) * bytes;
        Ok((at(block), at(slot)))
    }

    /// Bytes one position takes across all layers, keys and values.
    pub fn bytes_per_position(config: &ModelConfig, dtype: KvDtype) -> usize {
        2 * config.num_hidden_layers * config.kv_dim() * dtype.size_in_bytes()
    }
}

/// A sequence's blocks, in position order, and how many of its positions hold keys and
/// values. The blocks are the pool's; whoever hands them out (the engine's block manager)
/// decides which, and a forward pass only fills positions its blocks already cover.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    len: usize,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// A table of `blocks` whose first `len` positions are filled (a cached prefix).
    pub fn with_blocks(blocks: Vec<u32>, len: usize) -> Self {
        BlockTable { blocks, len }
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the blocks cover.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    pub fn push_block(&mut self, block: u32) {
        self.blocks.push(block);
    }

    /// Forgets the positions from `len` on; their blocks stay in the table.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Marks `n` more positions filled (after a forward pass wrote them).
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Empties the table, handing back its blocks.
    pub fn take_blocks(&mut self) -> Vec<u32> {
        self.len = 0;
        std::mem::take(&mut self.blocks)
    }
}

/// The CPU's pool: blocks in one host buffer, and a host tier's slots in another (a copy
/// of a block each; on the CPU only the tests use it, to exercise the tiers' bookkeeping).
pub struct KvPool {
    layout: KvLayout,
    blocks: usize,
    storage: Buffer,
    host: Buffer,
    host_blocks: usize,
}

impl KvPool {
    pub fn new(
        layout: KvLayout,
        blocks: usize,
        host_blocks: usize,
        owner: &BufferOwner,
    ) -> Result<Self> {
        let bytes = blocks * layout.block_bytes();
        Ok(KvPool {
            layout,
            blocks,
            storage: owner.alloc(BufferKind::KvCache, "kv pool", bytes)?,
            host: owner.alloc(
                BufferKind::KvCache,
                "kv host tier",
                host_blocks * layout.block_bytes(),
            )?,
            host_blocks,
        })
    }

    fn slice<'a>(layout: &KvLayout, buffer: &'a Buffer, start: usize) -> KvSlice<'a> {
        match layout.dtype {
            KvDtype::F32 => KvSlice::F32(&buffer.as_slice()[start..]),
            KvDtype::F16 => KvSlice::F16(&buffer.as_slice()[start..]),
            KvDtype::Bf16 => KvSlice::Bf16(&buffer.as_slice()[start..]),
        }
    }

    /// One layer's keys and values of the sequence whose blocks `table` lists.
    pub(crate) fn layer<'a>(&'a self, layer: usize, table: &'a [u32]) -> PagedKv<'a> {
        let l = &self.layout;
        PagedKv {
            keys: Self::slice(l, &self.storage, l.keys_offset(layer)),
            values: Self::slice(l, &self.storage, l.values_offset(layer)),
            table,
            block_size: l.block_size,
            block_stride: l.block_elems(),
        }
    }

    /// Stores the keys and values of positions `start..start + n` of one layer, `n` rows of
    /// `kv_dim` in `keys` and `values`, into the blocks `table` lists.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        table: &[u32],
        start: usize,
        keys: &[f32],
        values: &[f32],
    ) {
        let l = self.layout;
        let values_delta = l.values_offset(layer) - l.keys_offset(layer);
        for (i, (k, v)) in keys
            .chunks_exact(l.kv_dim)
            .zip(values.chunks_exact(l.kv_dim))
            .enumerate()
        {
            let at = l.key_row(table, layer, start + i);
            self.write_row(at, k);
            self.write_row(at + values_delta, v);
        }
    }

    fn write_row(&mut self, at: usize, row: &[f32]) {
        let range = at..at + row.len();
        match self.layout.dtype {
            KvDtype::F32 => self.storage.as_mut_slice::<f32>()[range].copy_from_slice(row),
            // Both round to nearest even.
            KvDtype::F16 => convert(
                &mut self.storage.as_mut_slice::<u16>()[range],
                row,
                ember_tensor::dtype::f32_to_f16,
            ),
            KvDtype::Bf16 => convert(
                &mut self.storage.as_mut_slice::<u16>()[range],
                row,
                ember_tensor::dtype::f32_to_bf16,
            ),
        }
    }
}

fn convert(dst: &mut [u16], src: &[f32], f: impl Fn(f32) -> u16) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f(s);
    }
}

impl KvStore for KvPool {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn blocks(&self) -> usize {
        self.blocks
    }

    fn host_blocks(&self) -> usize {
        self.host_blocks
    }

    fn save_to_host(&mut self, block: u32, slot: u32) -> Result<()> {
        let (src, dst) =
            self.layout
                .transfer_ranges(block, slot, self.blocks, self.host_blocks, "cpu")?;
        self.host.as_mut_slice::<u8>()[dst].copy_from_slice(&self.storage.as_slice::<u8>()[src]);
        Ok(())
    }

    fn load_from_host(&mut self, slot: u32, block: u32) -> Result<()> {
        let (dst, src) =
            self.layout
                .transfer_ranges(block, slot, self.blocks, self.host_blocks, "cpu")?;
        self.storage.as_mut_slice::<u8>()[dst].copy_from_slice(&self.host.as_slice::<u8>()[src]);
        Ok(())
    }
}
