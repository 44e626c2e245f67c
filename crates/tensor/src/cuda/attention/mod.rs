//! Attention over a paged KV cache: flash-decoding for one new token, tiled causal attention
//! for a prompt chunk. Layouts as in [`crate::cpu::causal_attention`]: a layer's cache is rows
//! of `n_kv_heads · head_dim`, a position's row found through the sequence's block table
//! ([`PagedCache`]); queries and outputs are `[tokens, n_heads · head_dim]`.
//!
//! Split by job: [`decode`] (one new token per sequence, of one sequence or many in a launch),
//! [`prefill`] (a prompt chunk) and [`prompt_rows`] (a prompt chunk's rows with the bits decode
//! gives them, for batch invariance); this file holds what both read: the paged cache's view,
//! the shape checks, the cache store and the precision choice.

mod decode;
mod prefill;
mod prompt_rows;

pub use decode::{
    DecodeContext, DecodeRope, DecodeRows, attention_decode, attention_decode_rope,
    attention_decode_rope_fits, attention_decode_scratch_len, attention_decode_scratch_reset,
};
pub use prefill::{attention_prefill, attention_prefill_scratch_len};
pub use prompt_rows::{attention_prompt_rows, attention_prompt_rows_max_context};

use super::device::launch;
use super::kernels::Kernel;
use super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, FloatElem, Position, config, ensure, int,
    stride_blocks,
};
use crate::cpu::AttentionShape;

/// The widest head the kernels take (8 values per lane).
pub const MAX_HEAD_DIM: usize = 256;

/// Query rows a prompt block takes (`ATT_ROWS` in attention.cu); threads of a block of
/// either kernel.
const ROWS: usize = 16;
const THREADS: u32 = 128;

fn check_shape(op: &'static str, shape: AttentionShape) -> Result<u8, CudaError> {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    ensure!(
        n_kv_heads > 0 && n_heads % n_kv_heads == 0,
        op,
        "{n_heads} heads over {n_kv_heads} kv heads"
    );
    ensure!(
        (1..=MAX_HEAD_DIM).contains(&head_dim),
        op,
        "head_dim {head_dim} outside 1..={MAX_HEAD_DIM}"
    );
    Ok(lane_width(head_dim))
}

/// Values of a head each lane holds (the kernels' `E`): 2, 4 or 8.
fn lane_width(head_dim: usize) -> u8 {
    match head_dim.div_ceil(32) {
        0..=2 => 2,
        3..=4 => 4,
        _ => 8,
    }
}

/// One layer's keys and values of a sequence in a pool of KV blocks (as
/// [`crate::cpu::PagedKv`]): position `t` is row `t % block_size` of block
/// `table[t / block_size]`; a block's rows of this layer's keys start `keys_offset` elements
/// into it, its values' `values_offset`, and block `b` starts `b · block_stride` elements into
/// `pool`. The table's entries are the caller's to keep inside the pool (the kernels trust
/// them; only the host can check them).
#[derive(Clone, Copy)]
pub struct PagedCache<'a, T> {
    pub pool: DevSlice<'a, T>,
    pub keys_offset: usize,
    pub values_offset: usize,
    /// The sequence's blocks, in position order.
    pub table: DevSlice<'a, i32>,
    /// Positions a block holds: a power of two.
    pub block_size: usize,
    pub block_stride: usize,
}

/// [`PagedCache`] to be written: the kernels that store keys and values take it.
pub struct PagedCacheMut<'a, T> {
    pub pool: DevSliceMut<'a, T>,
    pub keys_offset: usize,
    pub values_offset: usize,
    pub table: DevSlice<'a, i32>,
    pub block_size: usize,
    pub block_stride: usize,
}

impl<T: FloatElem> PagedCacheMut<'_, T> {
    pub fn as_ref(&self) -> PagedCache<'_, T> {
        PagedCache {
            pool: self.pool.as_slice(),
            keys_offset: self.keys_offset,
            values_offset: self.values_offset,
            table: self.table,
            block_size: self.block_size,
            block_stride: self.block_stride,
        }
    }
}

/// `KvPages` in common.cuh, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct KvPages {
    table: u64,
    block_stride: i64,
    shift: i32,
    capacity: i32,
}
const _: () = assert!(size_of::<KvPages>() == 24);

impl<T: FloatElem> PagedCache<'_, T> {
    fn keys_ptr(&self) -> u64 {
        self.pool.device_ptr() + (self.keys_offset * size_of::<T>()) as u64
    }

    fn values_ptr(&self) -> u64 {
        self.pool.device_ptr() + (self.values_offset * size_of::<T>()) as u64
    }

    /// Positions the table covers.
    fn capacity(&self) -> usize {
        self.table.len() * self.block_size
    }

    /// Checks the geometry, and that the table covers `positions` where the host knows them;
    /// returns the kernels' view.
    fn pages(
        &self,
        op: &'static str,
        positions: Option<usize>,
        kv_row: usize,
    ) -> Result<KvPages, CudaError> {
        let (size, stride) = (self.block_size, self.block_stride);
        ensure!(
            size.is_power_of_two(),
            op,
            "blocks of {size} positions, not a power of two"
        );
        ensure!(
            self.keys_offset + size * kv_row <= stride
                && self.values_offset + size * kv_row <= stride
                && stride > 0
                && self.pool.len() >= stride
                && self.pool.len().is_multiple_of(stride),
            op,
            "a layer's rows of {kv_row} at {} and {} do not lie inside blocks of {stride} elements \
             in a pool of {}",
            self.keys_offset,
            self.values_offset,
            self.pool.len()
        );
        if let Some(positions) = positions {
            ensure!(
                positions <= self.capacity(),
                op,
                "{positions} positions in a table of {} blocks of {size}",
                self.table.len()
            );
        }
        Ok(KvPages {
            table: self.table.device_ptr(),
            block_stride: i64::try_from(stride)
                .map_err(|_| CudaError::invalid(op, format!("blocks of {stride} elements")))?,
            shift: size.trailing_zeros() as i32,
            capacity: int(op, "positions", self.capacity())?,
        })
    }

    /// Whether the tiles can load 16 bytes at a time: every row of a head starts on 16 bytes
    /// (as 1 when it can, for the kernel's `vec`).
    fn vectorised(&self, head_dim: usize, kv_row: usize) -> i32 {
        let bytes = size_of::<T>();
        let per_chunk = 16 / bytes;
        i32::from(
            head_dim.is_multiple_of(per_chunk)
                && (kv_row * bytes).is_multiple_of(16)
                && (self.block_stride * bytes).is_multiple_of(16)
                && self.keys_ptr().is_multiple_of(16)
                && self.values_ptr().is_multiple_of(16),
        )
    }
}

/// Stores one step's keys and values (`[rows, kv_dim]` f32 each) into one layer's cache at
/// positions `pos0..pos0 + rows` of the sequence's blocks, converted to the cache's type, in
/// one launch. With [`Position::Device`] rows past the positions the table covers are dropped
/// on the device.
pub fn kv_store<T: FloatElem>(
    device: &CudaDevice,
    k: DevSlice<'_, f32>,
    v: DevSlice<'_, f32>,
    cache: &mut PagedCacheMut<'_, T>,
    kv_dim: usize,
    pos0: Position<'_>,
) -> Result<(), CudaError> {
    const OP: &str = "kv_store";
    ensure!(
        kv_dim > 0 && k.len() == v.len() && k.len().is_multiple_of(kv_dim),
        OP,
        "{} keys and {} values in rows of {kv_dim}",
        k.len(),
        v.len()
    );
    let rows = k.len() / kv_dim;
    let cache = cache.as_ref();
    let pages = cache.pages(OP, pos0.host().map(|p| p + rows), kv_dim)?;
    if rows == 0 {
        return Ok(());
    }
    let (kp, vp, kcp, vcp) = (
        k.device_ptr(),
        v.device_ptr(),
        cache.keys_ptr(),
        cache.values_ptr(),
    );
    let (p0, p0_dev) = pos0.args(OP, "pos0")?;
    let (n, dim) = (int(OP, "rows", rows)?, int(OP, "kv_dim", kv_dim)?);
    let blocks = stride_blocks(device, k.len());
    launch!(device, Kernel::KvStore { kv: T::FLOAT }, config((blocks, 1), super::THREADS, 0);
        kp, vp, kcp, vcp, n, dim, p0, p0_dev, pages)
}

/// How [`attention_prefill`] and [`attention_decode`] may compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPrecision {
    /// f32 products throughout (CUDA cores), as the CPU computes.
    F32,
    /// 16-bit operands with f32 sums on the tensor cores, where the device and head size
    /// allow, else as `F32`: prompts (FlashAttention-2) and decode over a 16-bit cache with the
    /// queries and probabilities rounded to the cache's type, prompts over an f32 cache with
    /// everything rounded to bf16. For models whose products already run in 16 bits.
    Bf16,
}

/// Heads the tensor-core kernels take.
const MMA_HEAD_DIMS: [usize; 2] = [64, 128];
#[cfg(test)]
mod tests {
    use super::decode::*;
    use super::prefill::*;
    use super::*;
    use crate::cuda::Module;

    /// The host sizes the decode grid and scratch with the kernel's own chunking: the same
    /// constants on both sides, or chunks would go unlaunched (only a GPU would show it).
    #[test]
    fn attention_constants_match_the_kernels() {
        let m = Module::AttentionDecode(crate::cuda::Float::Bf16);
        assert_eq!(m.define("DEC_MAX_SPLITS"), MAX_SPLITS);
        assert_eq!(m.define("DEC_MIN_KEYS_PER_SPLIT"), MIN_KEYS_PER_SPLIT);
        assert_eq!(m.define("DEC_KEY_ROUND"), KEY_ROUND);
        assert_eq!(m.define("DEC_BLOCKS_PER_SM"), DECODE_BLOCKS_PER_SM);
        assert_eq!(32 * m.define("DEC_WARPS"), THREADS as usize);
        // The tensor-core form always takes eight query heads a block (the grid's rows).
        let mma = Module::AttentionDecodeMma(crate::cuda::Float::Bf16);
        assert_eq!(mma.define("DEC_MMA_ROWS"), MAX_DECODE_ROWS);
        assert_eq!(mma.define("DEC_MMA_KEYS"), MMA_DECODE_KEYS);
        let p = Module::AttentionMma;
        assert_eq!(p.define("MMA_ROWS"), MMA_ROWS);
        assert_eq!(32 * p.define("MMA_WARPS"), MMA_THREADS as usize);
        let a = Module::Attention;
        assert_eq!(a.define("ATT_WARPS") * a.define("ATT_ROWS_PER_WARP"), ROWS);
        assert_eq!(32 * a.define("ATT_WARPS"), THREADS as usize);
    }

    /// The host's chunk size for a context gives as many chunks as the kernel's, the last
    /// one not empty, never more than the scratch holds.
    #[test]
    fn prompt_splits_cover_the_keys_and_fit_the_scratch() {
        let shape = AttentionShape {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
        };
        for sms in [1, 16, 132] {
            for rows in [ROWS, MMA_ROWS] {
                for pos0 in [0, 100, 511, 4000, 8208, 100_000] {
                    for n in [1, 2, 8, 30, 78, 130, 700, 2048] {
                        let (splits, per_split) = prefill_splits(sms, n, pos0, rows, 32);
                        let keys = pos0 + n;
                        assert_eq!(per_split % PREFILL_KEY_ROUND, 0);
                        assert_eq!(per_split % ROWS.max(32), 0, "whole tiles of both kernels");
                        assert!(splits * per_split >= keys && (splits - 1) * per_split < keys);
                        if splits > 1 {
                            assert!(per_split >= PREFILL_MIN_KEYS_PER_SPLIT - PREFILL_KEY_ROUND);
                            let need = splits * n * shape.n_heads * (shape.head_dim + 2);
                            assert!(need <= attention_prefill_scratch_len(shape));
                        }
                    }
                }
            }
        }
        // A chat's next turn on an H200: 78 new tokens over 8,208 cached positions split;
        // a long chunk does not.
        assert!(prefill_splits(132, 78, 8208, MMA_ROWS, 32).0 >= 8);
        assert_eq!(prefill_splits(132, 2048, 8208, MMA_ROWS, 32).0, 1);
    }

    #[test]
    fn decode_chunks_cover_the_context() {
        for target in [1, 8, 50, 66, 528] {
            for context in (1..5000).step_by(7).chain([4096, 32768, 131072]) {
                let kps = keys_per_split(context, target);
                let splits = context.div_ceil(kps);
                assert!(splits <= MAX_SPLITS, "{context} keys, target {target}");
                assert!(kps.is_multiple_of(KEY_ROUND) && kps >= MIN_KEYS_PER_SPLIT);
                assert!((splits - 1) * kps < context);
            }
        }
    }
}
