//! Decode products `y = x · Wᵀ` for a few rows of activations: weights streamed once, and
//! fused with what surrounds them in a layer (the RMSNorm before, several matrices sharing one
//! input, SwiGLU or the residual add after), so a decode step is a few launches per layer.

use super::device::launch;
use super::kernels::{Float, Kernel};
use super::moe::{ExpertRoad, ExpertTable, ExpertTiles, check_routed_shapes, max_tiles};
use super::{CudaDevice, CudaError, DevMat, DevSlice, DevSliceMut, config, ensure, int};

/// The most activation rows one block of a [`matvec`] kernel takes; longer batches run in
/// blocks of this many (prefill of f32 weights and routed experts; bf16 prompts take
/// [`super::Gemm`]).
pub const MAX_BATCH: usize = 8;

/// The most matrices one [`matvec_fused`] takes (`MATVEC_MAX_OUTPUTS` in matvec.cu).
pub const MAX_OUTPUTS: usize = 3;

/// Threads of a block (`MATVEC_THREADS` in matvec.cu).
const THREADS: u32 = 256;

/// Blocks per multiprocessor that prefetch their weights before waiting on the kernel before
/// (`matvec_prefetch` in matvec.cu): about those that start while it finishes.
const PREFETCH_BLOCKS_PER_SM: usize = 2;

/// What happens to a product's sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `y = sum (+ bias)`.
    Store,
    /// `y += sum`: straight into the residual stream.
    Accumulate,
    /// Two matrices, gate and up: `y_gate = silu(gate) · up` (the up output is not written).
    SwiGlu,
}

/// One matrix of a fused product, its optional bias (`rows` values) and its output
/// (`[batch, rows]`).
pub struct MatvecOutput<'w, 'y> {
    pub w: &'w DevMat<'w>,
    pub bias: Option<DevSlice<'w, f32>>,
    pub y: DevSliceMut<'y, f32>,
}

/// An RMS norm applied to `x` inside the product: `x[b] / rms(x[b]) · weight`.
#[derive(Clone, Copy, Debug)]
pub struct MatvecNorm<'a> {
    pub weight: DevSlice<'a, f32>,
    pub eps: f32,
}

/// One output as the kernel reads it (`MatvecOut` in matvec.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KernelOut {
    w: u64,
    bias: u64,
    y: u64,
    rows: i32,
    pad: i32,
}

/// The kernel's one argument, field for field `MatvecArgs` in matvec.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KernelArgs {
    out: [KernelOut; MAX_OUTPUTS],
    x: u64,
    norm: u64,
    eps: f32,
    outputs: i32,
    total_rows: i32,
    cols: i32,
    accumulate: i32,
    swiglu: i32,
    vec: i32,
    wpr: i32,
    tiles: u64,
    order: u64,
    experts: u64,
    x_div: i32,
    prefetch_blocks: i32,
}
// The kernel's struct asserts the same size (a field added on one side only fails both).
const _: () = assert!(size_of::<KernelArgs>() == 176);

impl KernelArgs {
    /// The matrices' shape and the epilogue, as the kernel reads them.
    fn describe(&mut self, shape: &Shape, epilogue: Epilogue) -> Result<(), CudaError> {
        const OP: &str = "matvec";
        self.outputs = shape.outputs as i32;
        self.total_rows = int(OP, "rows", shape.total_rows)?;
        self.cols = int(OP, "cols", shape.cols)?;
        self.accumulate = i32::from(epilogue == Epilogue::Accumulate);
        self.swiglu = i32::from(epilogue == Epilogue::SwiGlu);
        Ok(())
    }
}

/// `y[b] = W · x[b]` for `b < batch` (`y[b] += …` with `accumulate`, e.g. straight into the
/// residual stream). `W` is a weight, as for [`matvec_fused`].
///
/// `w` is `[rows, cols]`; `x` is `[batch, cols]` f32; `y` is `[batch, rows]` f32. The weights
/// are read with 16-byte loads when every row and `x` start on 16 bytes (cols a multiple of
/// 8 for 16-bit weights, 4 for f32), else element by element.
pub fn matvec(
    device: &CudaDevice,
    w: &DevMat<'_>,
    x: DevSlice<'_, f32>,
    batch: usize,
    y: &mut DevSliceMut<'_, f32>,
    accumulate: bool,
) -> Result<(), CudaError> {
    let epilogue = if accumulate {
        Epilogue::Accumulate
    } else {
        Epilogue::Store
    };
    let output = MatvecOutput {
        w,
        bias: None,
        y: y.reborrow(),
    };
    matvec_fused(device, &mut [output], x, batch, None, epilogue)
}

/// Up to [`MAX_OUTPUTS`] matrices of the same dtype and row length reading the same `x`
/// (`[batch, cols]`): `y_i[b] = W_i · norm(x[b]) + bias_i`, finished by `epilogue`. One launch
/// for whole blocks of [`MAX_BATCH`] rows and one for the rest. With `norm`, `x` is the
/// un-normalised input and the norm is computed inside the product.
///
/// The matrices are weights: the kernel starts reading them before the kernel launched just
/// before it has finished (programmatic dependent launch), so no kernel still in flight on
/// the stream may write them (model weights are uploaded once and only read).
pub fn matvec_fused(
    device: &CudaDevice,
    outputs: &mut [MatvecOutput<'_, '_>],
    x: DevSlice<'_, f32>,
    batch: usize,
    norm: Option<MatvecNorm<'_>>,
    epilogue: Epilogue,
) -> Result<(), CudaError> {
    const OP: &str = "matvec";
    ensure!(batch >= 1, OP, "an empty batch");
    ensure!(
        (1..=MAX_OUTPUTS).contains(&outputs.len()),
        OP,
        "{} matrices, 1..={MAX_OUTPUTS} fuse",
        outputs.len()
    );
    let (dtype, cols) = (outputs[0].w.dtype, outputs[0].w.cols);
    ensure!(
        x.len() == batch * cols,
        OP,
        "x has {} values for batch {batch} of {cols}",
        x.len()
    );
    check_norm(OP, norm, cols)?;
    for o in outputs.iter() {
        let w = o.w;
        ensure!(
            w.dtype == dtype && w.cols == cols,
            OP,
            "a {}×{} {} matrix fused with {dtype} rows of {cols}",
            w.rows,
            w.cols,
            w.dtype
        );
        ensure!(
            o.y.len() == batch * w.rows,
            OP,
            "y has {} values for batch {batch} of a {}×{} matrix",
            o.y.len(),
            w.rows,
            w.cols
        );
        if let Some(bias) = o.bias {
            ensure!(
                bias.len() == w.rows,
                OP,
                "bias of {} for {} rows",
                bias.len(),
                w.rows
            );
        }
    }
    if epilogue == Epilogue::SwiGlu {
        ensure!(
            outputs.len() == 2 && outputs[0].w.rows == outputs[1].w.rows,
            OP,
            "SwiGLU takes a gate and an up matrix of the same shape"
        );
    }
    // Whole blocks of rows in one launch (blockIdx.y picks the block), then the rest.
    let per_block = batch.min(MAX_BATCH);
    let blocks = batch / per_block;
    let done = blocks * per_block;
    let rows_of = |o: &MatvecOutput<'_, '_>, range: std::ops::Range<usize>| {
        o.y.device_ptr() + (range.start * o.w.rows * 4) as u64
    };
    for (first, rows, grid_y) in [(0, per_block, blocks), (done, batch - done, 1)] {
        if rows == 0 {
            continue;
        }
        let mut args = KernelArgs {
            x: x.slice(first * cols..batch * cols).device_ptr(),
            eps: norm.map_or(0.0, |n| n.eps),
            norm: norm.map_or(0, |n| n.weight.device_ptr()),
            ..KernelArgs::default()
        };
        for (o, out) in outputs.iter().zip(&mut args.out) {
            *out = KernelOut {
                w: o.w.data.device_ptr(),
                bias: o.bias.map_or(0, |b| b.device_ptr()),
                y: rows_of(o, first..batch),
                rows: int(OP, "rows", o.w.rows)?,
                pad: 0,
            };
        }
        let shape = Shape {
            dtype,
            cols,
            outputs: outputs.len(),
            total_rows: outputs.iter().map(|o| o.w.rows).sum(),
            aligned: outputs.iter().all(|o| aligned(o.w.data.device_ptr()))
                && aligned(args.x)
                && norm.is_none_or(|n| aligned(n.weight.device_ptr())),
        };
        let kernel = Kernel::Matvec {
            weights: dtype,
            batch: rows as u8,
            norm: norm.is_some(),
        };
        let grid_y = int(OP, "row blocks", grid_y)? as u32;
        launch_product(device, kernel, &mut args, &shape, epilogue, rows, grid_y)?;
    }
    Ok(())
}

/// `y[p] = W_e · x[p / x_div]` for each routed pair `p` and its expert `e` (with two matrices,
/// gate and up, `y[p] = silu(W_gate · x) · (W_up · x)`): the products of a mixture-of-experts
/// layer, every routed pair of a batch in one launch. `x` is `[pairs / x_div, cols]`, `y` is
/// `[pairs, rows]`. With `norm`, `x` is the un-normalised input (the residual stream) and the
/// norm is computed inside the product, as in [`matvec_fused`].
pub fn matvec_experts(
    device: &CudaDevice,
    table: &ExpertTable,
    tiles: ExpertTiles<'_>,
    x: DevSlice<'_, f32>,
    x_div: usize,
    norm: Option<MatvecNorm<'_>>,
    y: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    const OP: &str = "matvec_experts";
    let (pairs, cols, rows) = (tiles.pairs, table.cols, table.rows);
    check_routed_shapes(OP, table, &tiles, x.len(), x_div, y.len())?;
    ensure!(
        tiles.road != ExpertRoad::TensorCores,
        OP,
        "tiles for the tensor cores"
    );
    check_norm(OP, norm, cols)?;
    if pairs == 0 {
        return Ok(());
    }
    let epilogue = if table.matrices == 2 {
        Epilogue::SwiGlu
    } else {
        Epilogue::Store
    };
    let mut args = KernelArgs {
        x: x.device_ptr(),
        tiles: tiles.tiles.device_ptr(),
        order: tiles.order.device_ptr(),
        experts: table.addresses.device_ptr(),
        x_div: int(OP, "x_div", x_div)?,
        norm: norm.map_or(0, |n| n.weight.device_ptr()),
        eps: norm.map_or(0.0, |n| n.eps),
        ..KernelArgs::default()
    };
    for out in &mut args.out[..table.matrices] {
        *out = KernelOut {
            w: 0,
            bias: 0,
            y: y.device_ptr(),
            rows: int(OP, "rows", rows)?,
            pad: 0,
        };
    }
    let shape = Shape {
        dtype: table.dtype,
        cols,
        outputs: table.matrices,
        total_rows: rows * table.matrices,
        aligned: table.aligned
            && aligned(x.device_ptr())
            && norm.is_none_or(|n| aligned(n.weight.device_ptr())),
    };
    let kernel = Kernel::MatvecExperts {
        weights: table.dtype,
        batch: tiles.road.tile_rows() as u8,
        norm: norm.is_some(),
    };
    let max_tiles = max_tiles(pairs, table.experts, tiles.road.tile_rows());
    let grid_y = int(OP, "tiles", max_tiles)? as u32;
    launch_product(
        device,
        kernel,
        &mut args,
        &shape,
        epilogue,
        tiles.road.tile_rows(),
        grid_y,
    )
}

/// A norm inside a product takes one weight per column.
fn check_norm(
    op: &'static str,
    norm: Option<MatvecNorm<'_>>,
    cols: usize,
) -> Result<(), CudaError> {
    if let Some(n) = norm {
        ensure!(
            n.weight.len() == cols,
            op,
            "norm weight of {} for rows of {cols}",
            n.weight.len()
        );
    }
    Ok(())
}

/// What [`launch_product`] needs to know of the matrices.
struct Shape {
    dtype: Float,
    cols: usize,
    outputs: usize,
    total_rows: usize,
    /// The matrices, `x` and the norm weight start on 16 bytes.
    aligned: bool,
}

pub(super) fn aligned(p: u64) -> bool {
    p.is_multiple_of(16)
}

/// Completes `args` from `shape` and launches `kernel` (whose batch is `batch`) over
/// `grid_y` blocks of rows or tiles.
fn launch_product(
    device: &CudaDevice,
    kernel: Kernel,
    args: &mut KernelArgs,
    shape: &Shape,
    epilogue: Epilogue,
    batch: usize,
    grid_y: u32,
) -> Result<(), CudaError> {
    const OP: &str = "matvec";
    if shape.total_rows == 0 || grid_y == 0 {
        return Ok(());
    }
    let cols = shape.cols;
    args.describe(shape, epilogue)?;
    let per_chunk = 16 / shape.dtype.size_in_bytes();
    let vectorised = cols.is_multiple_of(per_chunk) && shape.aligned;
    let steps = if vectorised { cols / per_chunk } else { cols };
    let warps_per_rows =
        warps_per_row_group(steps, shape.total_rows, device.info().multiprocessors);
    // Rows per group, as the MATVEC_ALL_BATCHES table in matvec.cu sets them.
    let rows_per_group = if batch <= 2 { 2 } else { 4 };
    let rows_per_block = (THREADS as usize / 32 / warps_per_rows) * rows_per_group;
    let blocks = int(OP, "blocks", shape.total_rows.div_ceil(rows_per_block))? as u32;
    args.vec = i32::from(vectorised);
    args.wpr = warps_per_rows as i32;
    let weight_bytes = shape.total_rows * cols * shape.dtype.size_in_bytes();
    args.prefetch_blocks = if prefetches(weight_bytes, device.info().l2_bytes) {
        int(
            OP,
            "blocks",
            PREFETCH_BLOCKS_PER_SM * device.info().multiprocessors,
        )?
    } else {
        0
    };
    let args = *args;
    launch!(device, kernel, config((blocks, grid_y), THREADS, 0); args)
}

/// Blocks per multiprocessor the grid over a matrix's rows must keep for its groups to take
/// longer rows ([`warps_per_row_group`]).
const MIN_BLOCKS_PER_SM: usize = 3;

/// Warps sharing a group of rows of `steps` steps (16-byte chunks, or elements unvectorised):
/// enough that each lane takes 8 to 15 steps of a row where the matrix has the rows to still
/// give every multiprocessor [`MIN_BLOCKS_PER_SM`] blocks, else 4 to 7 (more warps would
/// leave lanes idle on short rows, fewer too few loads in flight on long ones). Longer-lived
/// blocks spend less of their time starting and reducing: on the H200 qwen3-8b's products
/// (4096-12288 columns, 4096 rows and more) took 8 steps a lane for +0.9% decode (217.3 ->
/// 219.4 tok/s), and 16 lost 1.4%; qwen3-0.6b's 1024-row matrices lost 9% with 8, their grid
/// down to 64 blocks. Decided by the matrix alone, never the batch, so a row's sums are the
/// same bits in a batch as alone.
fn warps_per_row_group(steps: usize, rows: usize, multiprocessors: usize) -> usize {
    let for_steps_per_lane = |per_lane: usize| match steps / (32 * per_lane) {
        0..=1 => 1,
        2..=3 => 2,
        4..=7 => 4,
        _ => 8,
    };
    let longer = for_steps_per_lane(8);
    // The grid at batch 1 (2 rows a group; MATVEC_ALL_BATCHES in matvec.cu).
    let rows_per_block = THREADS as usize / 32 / longer * 2;
    if rows.div_ceil(rows_per_block) >= MIN_BLOCKS_PER_SM * multiprocessors {
        longer
    } else {
        for_steps_per_lane(4)
    }
}

/// Whether a product's first blocks prefetch their weights into L2 while the kernel before
/// finishes (`matvec_prefetch` in matvec.cu): only for matrices of at most half the L2. On the
/// H200 it is worth 7% of qwen3-0.6b's decode (matrices of 4-13 MB), while qwen3-8b's (34-201
/// MB) ran 1.4% faster without it (208 -> 211 tok/s, December 2026): there the first wave is a
/// small share of the matrix, and its early requests only compete with the kernel before.
fn prefetches(weight_bytes: usize, l2_bytes: usize) -> bool {
    weight_bytes <= l2_bytes / 2
}

/// Bytes one [`matvec`] must move at least: the weights once, `x` and `y` once.
pub fn matvec_bytes(dtype: Float, rows: usize, cols: usize, batch: usize) -> usize {
    rows * cols * dtype.size_in_bytes() + batch * (rows + cols) * 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::Module;

    /// The host sizes a product's blocks from the kernel's own block size.
    #[test]
    fn constants_match_the_kernel() {
        assert_eq!(Module::Matvec.define("MATVEC_THREADS"), THREADS as usize);
    }

    /// On the H200 (132 multiprocessors): qwen3-8b's products take 8 to 15 steps a lane,
    /// qwen3-0.6b's keep 4 to 7, their grids too small for longer rows.
    #[test]
    fn only_matrices_with_rows_to_spare_take_longer_rows_a_group() {
        let sms = 132;
        let bf16_steps = |cols: usize| cols / 8;
        // qwen3-8b: q/k/v (6144 × 4096), o (4096 × 4096), gate/up (2 × 12288 × 4096), down
        // (4096 × 12288), output head (151936 × 4096): 8 steps a lane.
        for (rows, cols, wpr) in [
            (6144, 4096, 2),
            (4096, 4096, 2),
            (24576, 4096, 2),
            (4096, 12288, 4),
            (151936, 4096, 2),
        ] {
            assert_eq!(
                warps_per_row_group(bf16_steps(cols), rows, sms),
                wpr,
                "{rows}×{cols}"
            );
            let per_lane = bf16_steps(cols) / (32 * wpr);
            assert!(
                (8..16).contains(&per_lane),
                "{rows}×{cols}: {per_lane} steps a lane"
            );
        }
        // qwen3-0.6b: o (1024 × 2048) and down (1024 × 3072) stay at 4 steps a lane; the
        // 1024-column ones have a warp a group either way.
        assert_eq!(warps_per_row_group(bf16_steps(2048), 1024, sms), 2);
        assert_eq!(warps_per_row_group(bf16_steps(3072), 1024, sms), 2);
        assert_eq!(warps_per_row_group(bf16_steps(1024), 4096, sms), 1);
        assert_eq!(warps_per_row_group(bf16_steps(1024), 151936, sms), 1);
    }

    /// On the H200's 50 MB of L2: every matrix of qwen3-0.6b prefetches, none of qwen3-8b's.
    #[test]
    fn only_matrices_of_up_to_half_the_l2_prefetch() {
        let l2 = 50 << 20;
        let bf16 = |rows: usize, cols: usize| rows * cols * 2;
        // qwen3-0.6b: q/k/v (4096 rows of 1024), gate/up (2 × 3072 of 1024).
        assert!(prefetches(bf16(4096, 1024), l2));
        assert!(prefetches(bf16(6144, 1024), l2));
        // qwen3-8b: o (4096 of 4096), q/k/v (6144 of 4096).
        assert!(!prefetches(bf16(4096, 4096), l2));
        assert!(!prefetches(bf16(6144, 4096), l2));
    }
}
