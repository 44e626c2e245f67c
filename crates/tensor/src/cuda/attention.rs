//! Attention over a paged KV cache: flash-decoding for one new token, tiled causal attention
//! for a prompt chunk. Layouts as in [`crate::cpu::causal_attention`]: a layer's cache is rows
//! of `n_kv_heads · head_dim`, a position's row found through the sequence's block table
//! ([`PagedCache`]); queries and outputs are `[tokens, n_heads · head_dim]`.

use super::device::launch;
use super::kernels::{Float, Kernel, Module};
use super::rope::RopeNorm;
use super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, FloatElem, Position, config, config3, ensure,
    int, stride_blocks,
};
use crate::cpu::{AttentionShape, RopeLayout};

/// The widest head the kernels take (8 values per lane).
pub const MAX_HEAD_DIM: usize = 256;

/// The most chunks decode splits the context into (`DEC_MAX_SPLITS` in attention_decode.cu);
/// sizes the scratch.
const MAX_SPLITS: usize = 64;
/// Keys per chunk at least (`DEC_MIN_KEYS_PER_SPLIT`), and what a chunk's keys are a whole
/// number of (`DEC_KEY_ROUND`).
const MIN_KEYS_PER_SPLIT: usize = 32;
const KEY_ROUND: usize = 32;
/// The most query heads a decode block takes for its kv head (`ROWS` in attention_decode.cu).
const MAX_DECODE_ROWS: usize = 8;
/// Decode blocks per multiprocessor the chunks are sized for (`DEC_BLOCKS_PER_SM`).
const DECODE_BLOCKS_PER_SM: usize = 3;
/// Query rows a prompt block takes (`ATT_ROWS` in attention.cu); threads of a block of
/// either kernel.
const ROWS: usize = 16;
const THREADS: u32 = 128;

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
    let tensor_cores = precision == AttentionPrecision::Bf16
        && T::FLOAT != Float::F32
        && MMA_HEAD_DIMS.contains(&head_dim)
        && vec == 1
        && device.info().compute_capability
            >= Module::AttentionDecodeMma(T::FLOAT).min_compute_capability();
    // Query heads a block takes: the group, or blocks of 8 of it (always 8 on the tensor
    // cores: the n of their product).
    let group = n_heads / n_kv_heads;
    let rows = if tensor_cores {
        MAX_DECODE_ROWS
    } else {
        group.min(MAX_DECODE_ROWS).next_power_of_two()
    };
    let blocks_per_split = n_kv_heads * group.div_ceil(rows);
    // As many blocks as fit on the device at once, so that the chunks run in one wave;
    // `decode_keys_per_split` in attention_decode.cu turns this into chunks.
    let target_splits =
        (DECODE_BLOCKS_PER_SM * device.info().multiprocessors).div_ceil(blocks_per_split);
    let grid_splits = match context {
        DecodeContext::One(Position::Host(context)) => {
            context.div_ceil(keys_per_split(context, target_splits))
        }
        DecodeContext::One(Position::Device(_)) => MAX_SPLITS,
        // Many rows fill the device with fewer blocks a row, each taking several chunks in
        // turn (each chunk's arithmetic as alone): the blocks of one wave in all.
        DecodeContext::Rows(_) => (DECODE_BLOCKS_PER_SM * device.info().multiprocessors)
            .div_ceil(blocks_per_split * count)
            .clamp(1, MAX_SPLITS),
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

/// Keys per decode chunk: `decode_keys_per_split` in attention_decode.cu, for the grid.
fn keys_per_split(context: usize, target_splits: usize) -> usize {
    context
        .div_ceil(target_splits)
        .max(MIN_KEYS_PER_SPLIT)
        .max(context.div_ceil(MAX_SPLITS))
        .next_multiple_of(KEY_ROUND)
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
/// Query rows a tensor-core block takes (`MMA_ROWS` in attention_mma.cu), and its threads.
const MMA_ROWS: usize = 64;
const MMA_THREADS: u32 = 128;

/// A prompt chunk's attention splits the keys when its grid is too small to fill the device:
/// a chat's next turn computes a few dozen tokens over thousands of cached positions, one
/// block per 64 (16) queries and head, and without splits each block walked every key with
/// most multiprocessors idle. The grid is sized for this many blocks per multiprocessor.
const PREFILL_BLOCKS_PER_SM: usize = 4;
/// Keys a split takes at least: fewer would cost more in partial results than they save.
/// A whole number of both kernels' key tiles (64 and 32).
const PREFILL_MIN_KEYS_PER_SPLIT: usize = 512;
const PREFILL_KEY_ROUND: usize = 64;
/// (row, split) pairs the scratch holds partial results for: bounds the splits of a chunk of
/// `n` rows to `PREFILL_PART_ROWS / n`, so long chunks (whose grids fill the device anyway)
/// never split.
const PREFILL_PART_ROWS: usize = 1024;

/// f32 elements of scratch [`attention_prefill`] needs for a shape (any chunk and context).
pub fn attention_prefill_scratch_len(shape: AttentionShape) -> usize {
    PREFILL_PART_ROWS * shape.n_heads * (shape.head_dim + 2)
}

/// How many splits, of how many keys, a chunk of `n` queries after `pos0` positions takes
/// when a block takes `rows` queries of one head: `(1, _)` when its grid fills the device.
fn prefill_splits(
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
        && device.info().compute_capability >= super::Module::AttentionMma.min_compute_capability()
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

#[cfg(test)]
mod tests {
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
