//! Greedy sampling on the device.

use super::device::launch;
use super::kernels::Kernel;
use super::{CudaDevice, CudaError, DevSlice, DevSliceMut, config, ensure, int};

/// `out[r]` = the index of the largest of row `r`'s `vocab` logits: the lowest index on ties,
/// NaN never chosen (0 for a row of only NaN), as the CPU sampler's greedy pick.
pub fn argmax(
    device: &CudaDevice,
    logits: DevSlice<'_, f32>,
    vocab: usize,
    out: &mut DevSliceMut<'_, u32>,
) -> Result<(), CudaError> {
    const OP: &str = "argmax";
    ensure!(
        vocab > 0 && logits.len() == out.len() * vocab,
        OP,
        "{} logits for {} rows of {vocab}",
        logits.len(),
        out.len()
    );
    if out.is_empty() {
        return Ok(());
    }
    let (lp, op, n) = (
        logits.device_ptr(),
        out.device_ptr(),
        int(OP, "vocab", vocab)?,
    );
    let rows = int(OP, "rows", out.len())? as u32;
    launch!(device, Kernel::Argmax, config((rows, 1), 1024, 0); lp, op, n)
}
