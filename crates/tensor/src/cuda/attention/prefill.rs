//! Tiled causal attention of a prompt chunk over its sequence's cache, its keys split when
//! a short chunk over a long cache would leave the device idle.

use super::super::device::launch;
use super::super::kernels::{Kernel, Module};
use super::super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, FloatElem, config, config3, ensure, int,
};
use super::{AttentionPrecision, MMA_HEAD_DIMS, PagedCache, ROWS, THREADS, check_shape};
use crate::cpu::AttentionShape;

/// Query rows a tensor-core block takes (`MMA_ROWS` in attention_mma.cu), and its threads.
pub(super) const MMA_ROWS: usize = 64;
pub(super) const MMA_THREADS: u32 = 128;

/// A prompt chunk's attention splits the keys when its grid is too small to fill the device:
/// a chat's next turn computes a few dozen tokens over thousands of cached positions, one
/// block per 64 (16) queries and head, and without splits each block walked every key with
/// most multiprocessors idle. The grid is sized for this many blocks per multiprocessor.
pub(super) const PREFILL_BLOCKS_PER_SM: usize = 4;
/// Keys a split takes at least: fewer would cost more in partial results than they save.
/// A whole number of both kernels' key tiles (64 and 32).
pub(super) const PREFILL_MIN_KEYS_PER_SPLIT: usize = 512;
pub(super) const PREFILL_KEY_ROUND: usize = 64;
/// (row, split) pairs the scratch holds partial results for: bounds the splits of a chunk of
/// `n` rows to `PREFILL_PART_ROWS / n`, so long chunks (whose grids fill the device anyway)
/// never split.
pub(super) const PREFILL_PART_ROWS: usize = 1024;

/// f32 elements of scratch [`attention_prefill`] needs for a shape (any chunk and context).
pub fn attention_prefill_scratch_len(shape: AttentionShape) -> usize {
    PREFILL_PART_ROWS * shape.n_heads * (shape.head_dim + 2)
}

/// How many splits, of how many keys, a chunk of `n` queries after `pos0` positions takes
/// when a block takes `rows` queries of one head: `(1, _)` when its grid fills the device.
pub(super) fn prefill_splits(
    multiprocessors: usize,
    n: usize,
    pos0: usize,
    rows: usize,
    n_heads: usize,
) -> (usize, usize) {
    let keys = pos0 + n;
    let blocks = n.div_ceil(rows) * n_heads;
    let wanted = (PREFILL_BLOCKS_PER_SM * multiprocessors).div_ceil(blocks);
    let most = (keys / PREFILL_MIN_KEYS_PER_SPLIT).min(PREFILL_PART_ROWS / n);
    let splits = wanted.min(most);
    if splits <= 1 {
        return (1, keys.next_multiple_of(PREFILL_KEY_ROUND));
    }
    let per_split = keys.div_ceil(splits).next_multiple_of(PREFILL_KEY_ROUND);
    (keys.div_ceil(per_split), per_split)
}

/// Causal attention of `n` new tokens at positions `pos0..pos0 + n` (their keys and values
/// already in the sequence's cache): query `i` sees positions `..=pos0 + i`. `q` and `out` are
/// `[n, n_heads · head_dim]`; `scratch` ([`attention_prefill_scratch_len`] values) holds the
/// partial results when a short chunk over a long cache splits its keys.
#[allow(clippy::too_many_arguments)]
pub fn attention_prefill<T: FloatElem>(
    device: &CudaDevice,
    q: DevSlice<'_, f32>,
    cache: PagedCache<'_, T>,
    pos0: usize,
    n: usize,
    shape: AttentionShape,
    scale: f32,
    precision: AttentionPrecision,
    scratch: &mut DevSliceMut<'_, f32>,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    const OP: &str = "attention_prefill";
    let width = check_shape(OP, shape)?;
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let kv_row = n_kv_heads * head_dim;
    let pages = cache.pages(OP, Some(pos0 + n), kv_row)?;
    let len = n * n_heads * head_dim;
    ensure!(
        q.len() == len && out.len() == len,
        OP,
        "q {} and out {} for {n} tokens of {n_heads} heads of {head_dim}",
        q.len(),
        out.len()
    );
    if n == 0 {
        return Ok(());
    }
    let (qp, kp, vp, op) = (
        q.device_ptr(),
        cache.keys_ptr(),
        cache.values_ptr(),
        out.device_ptr(),
    );
    let (tokens, p0, heads, kv_heads, d) = (
        int(OP, "n", n)?,
        int(OP, "pos0", pos0)?,
        int(OP, "n_heads", n_heads)?,
        int(OP, "n_kv_heads", n_kv_heads)?,
        int(OP, "head_dim", head_dim)?,
    );
    let tensor_cores = precision == AttentionPrecision::Bf16
        && MMA_HEAD_DIMS.contains(&head_dim)
        && device.info().compute_capability >= Module::AttentionMma.min_compute_capability()
        && cache.vectorised(head_dim, kv_row) == 1;
    let rows = if tensor_cores { MMA_ROWS } else { ROWS };
    let (splits, per_split) = prefill_splits(device.info().multiprocessors, n, pos0, rows, n_heads);
    if splits > 1 {
        let need = splits * n * n_heads * (head_dim + 2);
        ensure!(
            scratch.len() >= need,
            OP,
            "scratch of {} values, {need} needed",
            scratch.len()
        );
    }
    let part = if splits > 1 { scratch.device_ptr() } else { 0 };
    let grid = (n.div_ceil(rows) as u32, n_heads as u32, splits as u32);
    let per_split = int(OP, "keys per split", per_split)?;
    if tensor_cores {
        let kernel = Kernel::AttentionPrefillMma {
            kv: T::FLOAT,
            head_dim: head_dim as u16,
        };
        let smem = kernel.dynamic_smem_bytes().unwrap_or(0);
        launch!(device, kernel, config3(grid, MMA_THREADS, smem);
            qp, kp, vp, op, tokens, p0, heads, kv_heads, scale, pages, per_split, part)?;
    } else {
        let vec = cache.vectorised(head_dim, kv_row);
        let kernel = Kernel::AttentionPrefill {
            kv: T::FLOAT,
            width,
        };
        let smem = kernel.dynamic_smem_bytes().unwrap_or(0);
        launch!(device, kernel, config3(grid, THREADS, smem);
            qp, kp, vp, op, tokens, p0, heads, kv_heads, d, scale, vec, pages, per_split, part)?;
    }
    if splits == 1 {
        return Ok(());
    }
    let (splits, log2_domain) = (int(OP, "splits", splits)?, i32::from(tensor_cores));
    launch!(device, Kernel::AttentionPrefillCombine,
        config((n as u32, n_heads as u32), THREADS, 0);
        part, op, splits, tokens, heads, d, log2_domain)
}
