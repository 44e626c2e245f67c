//! Greedy sampling on the device.

use super::device::launch;
use super::kernels::Kernel;
use super::{CudaDevice, CudaError, DevSlice, DevSliceMut, config, ensure, int};

/// `out[r]` = the index of the largest of row `r`'s `vocab` logits: the lowest index on ties,
/// NaN never chosen (0 for a row of only NaN), as the CPU sampler's greedy pick.
///
/// With `feed` (one row only), the pick also becomes the next decode step's input on the
/// device: `feed` holds a pass's inputs as the kernels read them, `[pos0, end, token…]` (i32),
/// and becomes `[end, end + 1, pick]`, so the next one-token pass can be enqueued before the
/// pick reaches the host.
pub fn argmax(
    device: &CudaDevice,
    logits: DevSlice<'_, f32>,
    vocab: usize,
    out: &mut DevSliceMut<'_, u32>,
    feed: Option<&mut DevSliceMut<'_, i32>>,
) -> Result<(), CudaError> {
    const OP: &str = "argmax";
    ensure!(
        vocab > 0 && logits.len() == out.len() * vocab,
        OP,
        "{} logits for {} rows of {vocab}",
        logits.len(),
        out.len()
    );
    if let Some(feed) = &feed {
        ensure!(
            out.len() == 1 && feed.len() >= 3,
            OP,
            "feeding the next step takes one row and [pos0, end, token], not {} rows and {} values",
            out.len(),
            feed.len()
        );
    }
    if out.is_empty() {
        return Ok(());
    }
    let (lp, op, n) = (
        logits.device_ptr(),
        out.device_ptr(),
        int(OP, "vocab", vocab)?,
    );
    let fp = feed.map_or(0, |f| f.device_ptr());
    let rows = int(OP, "rows", out.len())? as u32;
    launch!(device, Kernel::Argmax, config((rows, 1), 1024, 0); lp, op, n, fp)
}
