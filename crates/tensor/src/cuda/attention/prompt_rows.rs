//! The batch-invariant prompt attention: every row of a prompt chunk with the bits
//! [`attention_decode`](super::attention_decode) gives it as a decode row (on the tensor
//! cores), each chunk of keys read once for a tile of rows instead of once a row
//! (attention_prompt_rows.cu).

use super::super::device::launch;
use super::super::kernels::Kernel;
use super::super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, FloatElem, config, config3, ensure, int,
};
use super::decode::{
    MAX_SPLITS, MIN_KEYS_PER_SPLIT, decode_blocks_per_split, decode_on_tensor_cores,
    decode_target_splits,
};
use super::{AttentionPrecision, PagedCache, THREADS, check_shape};
use crate::cpu::AttentionShape;

/// Query rows a block takes (`PR_TILE_ROWS` in attention_prompt_rows.cu).
const TILE_ROWS: usize = 32;

/// The longest context (a row's position + 1) [`attention_prompt_rows`] takes a row at, or
/// 0 where it takes none: decode must run on the tensor cores for a cache of `T` at
/// `precision`, and the kernel takes the contexts whose decode chunks are all of 128 keys.
/// Rows past it attend as decode rows.
pub fn attention_prompt_rows_max_context<T: FloatElem>(
    device: &CudaDevice,
    cache: &PagedCache<'_, T>,
    shape: AttentionShape,
    precision: AttentionPrecision,
) -> usize {
    if check_shape("attention_prompt_rows", shape).is_err()
        || !decode_on_tensor_cores(device, cache, shape, precision)
    {
        return 0;
    }
    longest_whole_chunk_context(decode_target_splits(device, shape, true))
}

/// The longest context whose decode chunks are 128 keys for a target of `target` chunks:
/// `decode_keys_per_split` gives 128 while the context is at most 128 a chunk of the target
/// and of the 64 chunks a context may have.
fn longest_whole_chunk_context(target: usize) -> usize {
    MIN_KEYS_PER_SPLIT * target.min(MAX_SPLITS)
}

/// f32 values of scratch one row of a launch takes when its last row's context is `context`
/// (`prompt_row_parts` in attention_prompt_rows.cu): each chunk's maxima and sums (padded to
/// 16 bytes), then its values, for every head.
fn row_slab(shape: AttentionShape, context: usize) -> usize {
    let splits = context.div_ceil(MIN_KEYS_PER_SPLIT);
    (splits * shape.n_heads * 2).next_multiple_of(4) + splits * shape.n_heads * shape.head_dim
}

/// Causal attention of `n` prompt rows at positions `pos0..pos0 + n` of one sequence (their
/// keys and values already in its cache), each row's result the bits
/// [`attention_decode`](super::attention_decode) gives it alone: contexts up to
/// [`attention_prompt_rows_max_context`] (which must be positive) only. `q` and `out` are
/// `[n, n_heads · head_dim]`. `scratch` holds the rows' chunks: the rows go in as many launches
/// as it needs (a launch takes as many rows as it has room for at the last row's context).
#[allow(clippy::too_many_arguments)]
pub fn attention_prompt_rows<T: FloatElem>(
    device: &CudaDevice,
    q: DevSlice<'_, f32>,
    cache: PagedCache<'_, T>,
    pos0: usize,
    n: usize,
    shape: AttentionShape,
    scale: f32,
    scratch: &mut DevSliceMut<'_, f32>,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    const OP: &str = "attention_prompt_rows";
    check_shape(OP, shape)?;
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let row_len = n_heads * head_dim;
    ensure!(
        q.len() == n * row_len && out.len() == n * row_len,
        OP,
        "q {} and out {} for {n} rows of {n_heads} heads of {head_dim}",
        q.len(),
        out.len()
    );
    if n == 0 {
        return Ok(());
    }
    let most = attention_prompt_rows_max_context(device, &cache, shape, AttentionPrecision::Bf16);
    ensure!(
        pos0 + n <= most,
        OP,
        "contexts up to {} for a cache whose decode chunks are 128 keys up to {most}",
        pos0 + n
    );
    let kv_row = n_kv_heads * head_dim;
    let pages = cache.pages(OP, Some(pos0 + n), kv_row)?;
    // The scratch's slab a row is sized for the last row's chunks; a launch takes as many rows
    // as the scratch has slabs (rows of one chunk need none, but keep their slab: simpler).
    let slab = row_slab(shape, pos0 + n);
    let per_launch = scratch.len() / slab;
    ensure!(
        per_launch > 0 || pos0 + n <= MIN_KEYS_PER_SPLIT,
        OP,
        "scratch of {} values, {slab} needed for a row",
        scratch.len()
    );
    let per_launch = per_launch.max(1);
    // The merge reads the partial results 16 bytes at a time.
    ensure!(
        scratch.device_ptr().is_multiple_of(16),
        OP,
        "scratch not on 16 bytes"
    );
    // The decode kernel's blocks of query heads, a kv head's.
    let blocks_y = decode_blocks_per_split(shape, true);
    let attend = Kernel::AttentionPromptRowsMma {
        kv: T::FLOAT,
        head_dim: head_dim as u16,
    };
    let merge = Kernel::AttentionPromptRowsMerge { kv: T::FLOAT };
    let smem = attend.dynamic_smem_bytes().unwrap_or(0);
    let splits_max = int(OP, "splits", (pos0 + n).div_ceil(MIN_KEYS_PER_SPLIT))?;
    let (heads, kv_heads, d) = (
        int(OP, "n_heads", n_heads)?,
        int(OP, "n_kv_heads", n_kv_heads)?,
        int(OP, "head_dim", head_dim)?,
    );
    let (kp, vp, sp) = (cache.keys_ptr(), cache.values_ptr(), scratch.device_ptr());
    for start in (0..n).step_by(per_launch) {
        let rows = per_launch.min(n - start);
        let span = start * row_len..(start + rows) * row_len;
        let qp = q.slice(span.clone()).device_ptr();
        let op = out.slice_mut(span).device_ptr();
        let (p0, count) = (int(OP, "pos0", pos0 + start)?, int(OP, "rows", rows)?);
        let grid = (
            (pos0 + start + rows).div_ceil(MIN_KEYS_PER_SPLIT) as u32,
            blocks_y as u32,
            rows.div_ceil(TILE_ROWS) as u32,
        );
        launch!(device, attend, config3(grid, THREADS, smem);
            qp, kp, vp, sp, op, p0, count, splits_max, heads, kv_heads, scale, pages)?;
        if pos0 + start + rows > MIN_KEYS_PER_SPLIT {
            launch!(device, merge, config((rows as u32, blocks_y as u32), THREADS, 0);
                sp, op, p0, splits_max, heads, kv_heads, d)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::decode::keys_per_split;
    use super::*;
    use crate::cuda::kernels::{Float, Module};

    /// The longest context the kernel takes is the last whose decode chunks are 128 keys.
    #[test]
    fn the_longest_context_is_the_last_of_128_key_chunks() {
        for target in [1, 2, 7, 50, 63, 64, 65, 200] {
            let context = longest_whole_chunk_context(target);
            assert_eq!(
                keys_per_split(context, target),
                MIN_KEYS_PER_SPLIT,
                "{target}"
            );
            assert!(
                keys_per_split(context + 1, target) > MIN_KEYS_PER_SPLIT,
                "{target}"
            );
        }
    }

    /// The host's tile and chunk are the kernel's.
    #[test]
    fn tiles_and_chunks_match_the_kernel() {
        let m = Module::AttentionDecodeMma(Float::Bf16);
        assert_eq!(m.define("PR_TILE_ROWS"), TILE_ROWS);
        assert_eq!(m.define("DEC_MIN_KEYS_PER_SPLIT"), MIN_KEYS_PER_SPLIT);
    }

    /// A row's slab holds its chunks' maxima and sums on 16 bytes, then their values.
    #[test]
    fn a_row_slab_holds_every_chunk_of_the_last_row() {
        let shape = AttentionShape {
            n_heads: 3,
            n_kv_heads: 1,
            head_dim: 64,
        };
        // 129 positions: two chunks; 2 · 3 · 2 = 12 maxima and sums, 2 · 3 · 64 values.
        assert_eq!(row_slab(shape, 129), 12 + 384);
        // One chunk: 6 padded to 8.
        assert_eq!(row_slab(shape, 128), 8 + 192);
    }
}
