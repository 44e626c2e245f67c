//! Decode products `y = x · Wᵀ` for a few rows of activations: weights streamed once.

use super::device::launch;
use super::kernels::{Float, Kernel};
use super::{CudaDevice, CudaError, DevMat, DevSlice, DevSliceMut, config, ensure, int};

/// The most activation rows one [`matvec`] takes; larger batches are prefill ([`super::Gemm`]).
pub const MAX_BATCH: usize = 8;

/// Threads of a block (`MATVEC_THREADS` in matvec.cu).
const THREADS: u32 = 256;

/// `y[b] = W · x[b]` for `b < batch` (`y[b] += …` with `accumulate`, e.g. straight into the
/// residual stream).
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
    const OP: &str = "matvec";
    ensure!(
        (1..=MAX_BATCH).contains(&batch),
        OP,
        "batch {batch} outside 1..={MAX_BATCH}"
    );
    ensure!(
        x.len() == batch * w.cols && y.len() == batch * w.rows,
        OP,
        "x has {} values and y {} for batch {batch} of a {}×{} matrix",
        x.len(),
        y.len(),
        w.rows,
        w.cols
    );
    if w.rows == 0 {
        return Ok(());
    }
    let per_chunk = 16 / w.dtype.size_in_bytes();
    let vectorised = w.cols.is_multiple_of(per_chunk)
        && w.data.device_ptr().is_multiple_of(16)
        && x.device_ptr().is_multiple_of(16);
    // Warps sharing a group of rows: enough that each lane takes about 4 steps of a row (more
    // would leave lanes idle on short rows, fewer too few loads in flight on long ones).
    let steps = if vectorised {
        w.cols / per_chunk
    } else {
        w.cols
    };
    let warps_per_rows = match steps / 128 {
        0..=1 => 1,
        2..=3 => 2,
        4..=7 => 4,
        _ => 8,
    };
    // Rows per group, as the MATVEC_ALL_BATCHES table in matvec.cu sets them.
    let rows_per_group = if batch <= 2 { 2 } else { 4 };
    let rows_per_block = (THREADS as usize / 32 / warps_per_rows) * rows_per_group;
    let blocks = int(OP, "blocks", w.rows.div_ceil(rows_per_block))? as u32;
    let (wp, xp, yp) = (w.data.device_ptr(), x.device_ptr(), y.device_ptr());
    let (rows, cols) = (int(OP, "rows", w.rows)?, int(OP, "cols", w.cols)?);
    let (accumulate, vec, wpr) = (
        i32::from(accumulate),
        i32::from(vectorised),
        warps_per_rows as i32,
    );
    let kernel = Kernel::Matvec {
        weights: w.dtype,
        batch: batch as u8,
    };
    launch!(device, kernel, config((blocks, 1), THREADS, 0); wp, xp, yp, rows, cols, accumulate, vec, wpr)
}

/// Bytes one [`matvec`] must move at least: the weights once, `x` and `y` once.
pub fn matvec_bytes(dtype: Float, rows: usize, cols: usize, batch: usize) -> usize {
    rows * cols * dtype.size_in_bytes() + batch * (rows + cols) * 4
}
