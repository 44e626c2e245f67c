//! Flash-decoding: each sequence's one new token over its cache, one sequence a launch or
//! the decode rows of many ([`DecodeRows`]), optionally rotating and storing the new key
//! itself ([`attention_decode_rope`]).

use super::super::device::launch;
use super::super::kernels::{Float, Kernel, Module};
use super::super::rope::RopeNorm;
use super::super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, FloatElem, Position, config3, ensure, int,
};
use super::{
    AttentionPrecision, MAX_HEAD_DIM, MMA_HEAD_DIMS, PagedCache, PagedCacheMut, THREADS,
    check_shape, lane_width,
};
use crate::cpu::{AttentionShape, RopeLayout};

/// The most chunks decode splits the context into (`DEC_MAX_SPLITS` in attention_decode.cu);
/// sizes the scratch.
pub(super) const MAX_SPLITS: usize = 64;
/// Keys per chunk at least (`DEC_MIN_KEYS_PER_SPLIT`), and what a chunk's keys are a whole
/// number of (`DEC_KEY_ROUND`).
pub(super) const MIN_KEYS_PER_SPLIT: usize = 128;
pub(super) const KEY_ROUND: usize = 32;
/// The most query heads a decode block takes for its kv head (`ROWS` in attention_decode.cu).
pub(super) const MAX_DECODE_ROWS: usize = 8;
/// Keys a tensor-core decode warp takes at once (`DEC_MMA_KEYS`): the kernel reads a step's
/// rows from one block of the pool, so blocks must hold at least this many positions (they
/// are powers of two: then a step from a multiple of 16 never crosses one).
pub(super) const MMA_DECODE_KEYS: usize = 16;
/// Decode blocks per multiprocessor the chunks are sized for (`DEC_BLOCKS_PER_SM`).
pub(super) const DECODE_BLOCKS_PER_SM: usize = 3;
/// Waves of blocks a launch of many rows' decode takes ([`DecodeRows`]).
const DECODE_ROW_WAVES: usize = 4;
/// f32 elements of scratch [`attention_decode`] needs for a shape (any context length), for
/// each query row a launch takes ([`DecodeRows`]): the chunks' partial results, then one
/// ticket per block row of the grid (at most one a head), rounded up to 16 bytes.
pub fn attention_decode_scratch_len(shape: AttentionShape) -> usize {
    (tickets_at(shape) + shape.n_heads).next_multiple_of(4)
}

fn tickets_at(shape: AttentionShape) -> usize {
    MAX_SPLITS * shape.n_heads * (shape.head_dim + 2)
}

/// Zeroes the tickets of a new decode scratch ([`attention_decode_scratch_len`] values for
/// each row it serves). The decode kernels leave them zero, so once, before the scratch's
/// first use, is enough.
pub fn attention_decode_scratch_reset(
    device: &CudaDevice,
    shape: AttentionShape,
    scratch: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    let len = attention_decode_scratch_len(shape);
    ensure!(
        scratch.len() >= len,
        "attention_decode_scratch_reset",
        "scratch of {} values, {len} needed",
        scratch.len()
    );
    device.fill_bytes(scratch, 0)
}

/// Several sequences' decode rows in one launch of [`attention_decode`] or
/// [`attention_decode_rope`], each row over its own sequence's blocks and positions, all read
/// from device memory (a pass's inputs): row `rows[i]` of the pass's queries (and of the step's
/// keys and values, and of the output) is at position `row_pos[row]` of sequence
/// `row_seq[row]`, whose block table is entries `row_seq · table_stride ..` of the cache's
/// table. A row's result is the bits it gets in a launch of its own: its chunks depend on its
/// context alone.
#[derive(Clone, Copy)]
pub struct DecodeRows<'a> {
    /// One entry per query row the launch takes (its grid's z).
    pub rows: DevSlice<'a, i32>,
    /// Every pass row's position and sequence.
    pub row_pos: DevSlice<'a, i32>,
    pub row_seq: DevSlice<'a, i32>,
    /// Entries from one sequence's block table to the next's; a sequence's table covers
    /// `table_stride · block_size` positions.
    pub table_stride: usize,
}

/// Which queries a decode launch takes, and how many keys each sees.
#[derive(Clone, Copy)]
pub enum DecodeContext<'a> {
    /// One sequence's one new token, over this many positions (its own included).
    One(Position<'a>),
    /// Several sequences' new tokens.
    Rows(DecodeRows<'a>),
}

impl<'a> From<Position<'a>> for DecodeContext<'a> {
    fn from(context: Position<'a>) -> Self {
        DecodeContext::One(context)
    }
}

impl<'a> From<DecodeRows<'a>> for DecodeContext<'a> {
    fn from(rows: DecodeRows<'a>) -> Self {
        DecodeContext::Rows(rows)
    }
}

impl DecodeContext<'_> {
    /// Query rows the launch takes.
    fn count(&self) -> usize {
        match self {
            DecodeContext::One(_) => 1,
            DecodeContext::Rows(r) => r.rows.len(),
        }
    }
}

/// `DecodeBatch` in attention_decode.cu, field for field; all zero for one sequence.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DecodeBatch {
    rows: u64,
    row_pos: u64,
    row_seq: u64,
    table_stride: i64,
    scratch_stride: i64,
}
const _: () = assert!(size_of::<DecodeBatch>() == 40);

/// Attention of one new token's queries `q` (`[n_heads · head_dim]`) over the first `context`
/// positions of the sequence's cache (the token's own included), into `out`; or of several
/// sequences' new tokens ([`DecodeRows`]: `q` and `out` then hold the pass's rows).
///
/// The context is split into up to 64 chunks, each taken by its own blocks, and the last
/// block of each group of heads to finish merges them, in one launch. The kernel works the
/// chunks out from the context alone, so a context read on the device ([`Position::Device`],
/// at most the positions the table covers: checked on the host only for [`Position::Host`]) gives the
/// same bits as the same context known on the host. `scratch` holds
/// [`attention_decode_scratch_len`] values, its tickets zeroed once by
/// [`attention_decode_scratch_reset`] (that many for each row of [`DecodeRows`]).
///
/// With [`AttentionPrecision::Bf16`], a 16-bit cache and heads of 64 or 128, the products run
/// on the tensor cores (compute capability 8.0 on) with the queries and probabilities rounded
/// to the cache's type; otherwise in f32.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode<'a, T: FloatElem>(
    device: &CudaDevice,
    q: DevSlice<'_, f32>,
    cache: PagedCache<'_, T>,
    context: impl Into<DecodeContext<'a>>,
    shape: AttentionShape,
    scale: f32,
    precision: AttentionPrecision,
    scratch: &mut DevSliceMut<'_, f32>,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    launch_decode(
        device,
        q,
        cache,
        context.into(),
        shape,
        scale,
        precision,
        scratch,
        out,
        RopeArgs::default(),
    )
}

/// The step's key and queries as the projections made them, for [`attention_decode_rope`] to
/// normalise and rotate (as [`super::rope_qk`] would) and to store the key and value (as
/// [`kv_store`] would) itself.
#[derive(Clone, Copy, Debug)]
pub struct DecodeRope<'a> {
    /// `n_kv_heads · head_dim` each (a row of that each for [`DecodeRows`]).
    pub k_new: DevSlice<'a, f32>,
    pub v_new: DevSlice<'a, f32>,
    /// Qwen3's per-head norms, sharing one epsilon.
    pub q_norm: Option<RopeNorm<'a>>,
    pub k_norm: Option<RopeNorm<'a>>,
    /// `[positions, head_dim / 2]`, as for [`super::rope`].
    pub cos: DevSlice<'a, f32>,
    pub sin: DevSlice<'a, f32>,
    pub layout: RopeLayout,
}

/// Whether [`attention_decode_rope`] takes heads of `head_dim` in `layout`: a lane's values
/// of a head must not straddle a rotated pair's halves.
pub fn attention_decode_rope_fits(head_dim: usize, layout: RopeLayout) -> bool {
    if !head_dim.is_multiple_of(2) || !(1..=MAX_HEAD_DIM).contains(&head_dim) {
        return false;
    }
    let width = usize::from(lane_width(head_dim));
    match layout {
        RopeLayout::Pairs => true,
        RopeLayout::Halves => (head_dim / 2).is_multiple_of(width),
    }
}

/// [`attention_decode`] of queries not yet normalised and rotated, with the step's own key
/// and value (position `context - 1`) given apart and stored into the cache by the same
/// launch: a decode step's rope and cache store cost no launch of their own. The result is
/// what [`super::rope_qk`], [`kv_store`] and [`attention_decode`] give, up to the order of the
/// norms' sums. The rope's tables and norm weights are read before the kernel waits on the one
/// launched before it (programmatic dependent launch): no kernel in flight may write them.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_rope<'a, T: FloatElem>(
    device: &CudaDevice,
    q: DevSlice<'_, f32>,
    rope: DecodeRope<'_>,
    cache: &mut PagedCacheMut<'_, T>,
    context: impl Into<DecodeContext<'a>>,
    shape: AttentionShape,
    scale: f32,
    precision: AttentionPrecision,
    scratch: &mut DevSliceMut<'_, f32>,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    const OP: &str = "attention_decode_rope";
    let context = context.into();
    let AttentionShape {
        n_kv_heads,
        head_dim,
        ..
    } = shape;
    ensure!(
        attention_decode_rope_fits(head_dim, rope.layout),
        OP,
        "heads of {head_dim} in the {:?} layout",
        rope.layout
    );
    let kv_dim = n_kv_heads * head_dim;
    let kv_len = match context {
        DecodeContext::One(_) => kv_dim,
        // As many rows as the queries: checked against them below.
        DecodeContext::Rows(_) => kv_dim * (q.len() / (shape.n_heads * head_dim)),
    };
    ensure!(
        rope.k_new.len() == kv_len && rope.v_new.len() == kv_len,
        OP,
        "{} keys and {} values for {n_kv_heads} heads of {head_dim}",
        rope.k_new.len(),
        rope.v_new.len()
    );
    let half = head_dim / 2;
    ensure!(
        rope.cos.len() == rope.sin.len() && rope.cos.len().is_multiple_of(half),
        OP,
        "tables of {} and {} values for heads of {head_dim}",
        rope.cos.len(),
        rope.sin.len()
    );
    let norms = [rope.q_norm, rope.k_norm];
    for norm in norms.iter().flatten() {
        ensure!(
            norm.weight.len() == head_dim,
            OP,
            "norm weight of {} for heads of {head_dim}",
            norm.weight.len()
        );
    }
    let norm_ptr = |n: Option<RopeNorm<'_>>| n.map_or(0, |n| n.weight.device_ptr());
    let args = RopeArgs {
        k_new: rope.k_new.device_ptr(),
        v_new: rope.v_new.device_ptr(),
        q_norm: norm_ptr(rope.q_norm),
        k_norm: norm_ptr(rope.k_norm),
        cos: rope.cos.device_ptr(),
        sin: rope.sin.device_ptr(),
        positions: int(OP, "positions", rope.cos.len() / half)?,
        pairs: i32::from(rope.layout == RopeLayout::Pairs),
        eps: norms.iter().flatten().next().map_or(0.0, |n| n.eps),
    };
    // The kernel writes the step's row through this view: the pool is borrowed mutably for it.
    launch_decode(
        device,
        q,
        cache.as_ref(),
        context,
        shape,
        scale,
        precision,
        scratch,
        out,
        args,
    )
}

/// `DecodeRope` in attention_decode.cu, field for field; all zero for none.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RopeArgs {
    k_new: u64,
    v_new: u64,
    q_norm: u64,
    k_norm: u64,
    cos: u64,
    sin: u64,
    positions: i32,
    pairs: i32,
    eps: f32,
}
// The kernel's struct asserts the same size (a field added on one side only fails both).
const _: () = assert!(size_of::<RopeArgs>() == 64);

#[allow(clippy::too_many_arguments)]
fn launch_decode<T: FloatElem>(
    device: &CudaDevice,
    q: DevSlice<'_, f32>,
    cache: PagedCache<'_, T>,
    context: DecodeContext<'_>,
    shape: AttentionShape,
    scale: f32,
    precision: AttentionPrecision,
    scratch: &mut DevSliceMut<'_, f32>,
    out: &mut DevSliceMut<'_, f32>,
    rope: RopeArgs,
) -> Result<(), CudaError> {
    const OP: &str = "attention_decode";
    let width = check_shape(OP, shape)?;
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let kv_row = n_kv_heads * head_dim;
    let q_len = n_heads * head_dim;
    let count = context.count();
    let slab = attention_decode_scratch_len(shape);
    let (mut pages, batch) = match context {
        DecodeContext::One(position) => {
            if let Some(context) = position.host() {
                ensure!(context > 0, OP, "no keys to attend to");
            }
            ensure!(
                q.len() == q_len && out.len() == q_len,
                OP,
                "q {} and out {} for {n_heads} heads of {head_dim}",
                q.len(),
                out.len()
            );
            (
                cache.pages(OP, position.host(), kv_row)?,
                DecodeBatch::default(),
            )
        }
        DecodeContext::Rows(r) => {
            // The rows' indices are the kernel's to trust: the host checks the shapes.
            ensure!(
                q.len() == out.len() && q.len().is_multiple_of(q_len) && q.len() >= q_len * count,
                OP,
                "q {} and out {} for {count} rows of {n_heads} heads of {head_dim}",
                q.len(),
                out.len()
            );
            let pass_rows = q.len() / q_len;
            ensure!(
                r.row_pos.len() >= pass_rows
                    && r.row_seq.len() >= pass_rows
                    && r.table_stride > 0
                    && cache.table.len() >= r.table_stride,
                OP,
                "positions {} and sequences {} of {pass_rows} rows, tables of {} in {}",
                r.row_pos.len(),
                r.row_seq.len(),
                r.table_stride,
                cache.table.len()
            );
            let batch = DecodeBatch {
                rows: r.rows.device_ptr(),
                row_pos: r.row_pos.device_ptr(),
                row_seq: r.row_seq.device_ptr(),
                table_stride: r.table_stride as i64,
                scratch_stride: slab as i64,
            };
            (cache.pages(OP, None, kv_row)?, batch)
        }
    };
    if let DecodeContext::Rows(r) = context {
        // A store past a sequence's own table is dropped, as for one sequence.
        pages.capacity = int(OP, "positions", r.table_stride * cache.block_size)?;
    }
    if count == 0 {
        return Ok(());
    }
    ensure!(
        scratch.len() >= slab * count,
        OP,
        "scratch of {} values, {} needed",
        scratch.len(),
        slab * count
    );
    // The merge reads the partial results 16 bytes at a time.
    ensure!(
        scratch.device_ptr().is_multiple_of(16),
        OP,
        "scratch not on 16 bytes"
    );

    // A lane's values of a row come whole in vector loads.
    let vec = cache.vectorised(head_dim, kv_row) & i32::from(head_dim.is_multiple_of(width.into()));
    let tensor_cores = decode_on_tensor_cores(device, &cache, shape, precision);
    let rows = decode_block_rows(shape, tensor_cores);
    let blocks_per_split = decode_blocks_per_split(shape, tensor_cores);
    let target_splits = decode_target_splits(device, shape, tensor_cores);
    let grid_splits = match context {
        DecodeContext::One(Position::Host(context)) => {
            context.div_ceil(keys_per_split(context, target_splits))
        }
        DecodeContext::One(Position::Device(_)) => MAX_SPLITS,
        // Many rows fill the device with fewer blocks a row, each taking several chunks in
        // turn (each chunk's arithmetic as alone): four waves of blocks in all. One wave
        // left each block a row's chunks to take in turn, a memory round trip each: 64 rows
        // of 576 keys on qwen3-8b (H100) ran at 1.06 TB/s, 150 us a layer; four waves with
        // chunks of at least 128 keys, 1.8 TB/s (bench batch 4.5k → 5.5k tok/s).
        DecodeContext::Rows(_) => {
            (DECODE_ROW_WAVES * DECODE_BLOCKS_PER_SM * device.info().multiprocessors)
                .div_ceil(blocks_per_split * count)
                .clamp(1, MAX_SPLITS)
        }
    };

    let tickets = scratch
        .slice_mut(tickets_at(shape)..scratch.len())
        .device_ptr();
    let (part_ml, part_acc) = scratch.reborrow().split_at_mut(MAX_SPLITS * n_heads * 2);
    let (qp, kp, vp) = (q.device_ptr(), cache.keys_ptr(), cache.values_ptr());
    let (mlp, accp, outp) = (
        part_ml.device_ptr(),
        part_acc.device_ptr(),
        out.device_ptr(),
    );
    let (ctx, ctx_dev) = match context {
        DecodeContext::One(position) => position.args(OP, "context")?,
        DecodeContext::Rows(_) => (0, 0),
    };
    let (heads, kv_heads, d) = (
        int(OP, "n_heads", n_heads)?,
        int(OP, "n_kv_heads", n_kv_heads)?,
        int(OP, "head_dim", head_dim)?,
    );
    let target = int(OP, "splits", target_splits)?;
    let kernel = if tensor_cores {
        Kernel::AttentionDecodeMma {
            kv: T::FLOAT,
            head_dim: head_dim as u16,
            rope: rope.k_new != 0,
        }
    } else {
        Kernel::AttentionDecode {
            kv: T::FLOAT,
            width,
            rows: rows as u8,
            rope: rope.k_new != 0,
        }
    };
    let grid = (
        grid_splits as u32,
        int(OP, "blocks", blocks_per_split)? as u32,
        int(OP, "rows", count)? as u32,
    );
    launch!(device, kernel, config3(grid, THREADS, 0);
        qp, kp, vp, mlp, accp, tickets, outp, ctx, ctx_dev, heads, kv_heads, d, scale, target, vec,
        pages, rope, batch)
}

/// Whether decode over `cache` runs on the tensor cores (attention_decode_mma.cu): with
/// [`AttentionPrecision::Bf16`], a 16-bit cache whose rows load in 16-byte pieces, heads of 64
/// or 128 and compute capability 8.0 on.
pub(super) fn decode_on_tensor_cores<T: FloatElem>(
    device: &CudaDevice,
    cache: &PagedCache<'_, T>,
    shape: AttentionShape,
    precision: AttentionPrecision,
) -> bool {
    let AttentionShape {
        n_kv_heads,
        head_dim,
        ..
    } = shape;
    precision == AttentionPrecision::Bf16
        && T::FLOAT != Float::F32
        && MMA_HEAD_DIMS.contains(&head_dim)
        && cache.vectorised(head_dim, n_kv_heads * head_dim) == 1
        && cache.block_size >= MMA_DECODE_KEYS
        && device.info().compute_capability
            >= Module::AttentionDecodeMma(T::FLOAT).min_compute_capability()
}

/// Query heads a decode block takes for its kv head: the group, or blocks of 8 of it (always
/// 8 on the tensor cores: the n of their product).
pub(super) fn decode_block_rows(shape: AttentionShape, tensor_cores: bool) -> usize {
    if tensor_cores {
        MAX_DECODE_ROWS
    } else {
        (shape.n_heads / shape.n_kv_heads)
            .min(MAX_DECODE_ROWS)
            .next_power_of_two()
    }
}

/// Blocks a decode chunk takes (the grid's y): one for each kv head's blocks of query heads.
pub(super) fn decode_blocks_per_split(shape: AttentionShape, tensor_cores: bool) -> usize {
    let rows = decode_block_rows(shape, tensor_cores);
    shape.n_kv_heads * (shape.n_heads / shape.n_kv_heads).div_ceil(rows)
}

/// The chunks decode aims for: as many blocks as fit on the device at once, so that a lone
/// row's chunks run in one wave; `decode_keys_per_split` in attention_decode.cu turns this
/// into chunks of a context.
pub(super) fn decode_target_splits(
    device: &CudaDevice,
    shape: AttentionShape,
    tensor_cores: bool,
) -> usize {
    (DECODE_BLOCKS_PER_SM * device.info().multiprocessors)
        .div_ceil(decode_blocks_per_split(shape, tensor_cores))
}

/// Keys per decode chunk: `decode_keys_per_split` in attention_decode.cu, for the grid.
pub(super) fn keys_per_split(context: usize, target_splits: usize) -> usize {
    context
        .div_ceil(target_splits)
        .max(MIN_KEYS_PER_SPLIT)
        .max(context.div_ceil(MAX_SPLITS))
        .next_multiple_of(KEY_ROUND)
}
