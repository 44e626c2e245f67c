//! RMS normalisation of rows, optionally with the residual add fused in front.

use super::device::launch;
use super::kernels::Kernel;
use super::{CudaDevice, CudaError, DevSlice, DevSliceMut, Float, FloatElem, config, ensure, int};

/// Groups of four values a thread holds (`RMS_GROUPS` in rms_norm.cu).
const GROUPS: usize = 4;
/// The most threads a block has (the kernel's `block_sum` takes up to 32 warps).
const MAX_THREADS: usize = 1024;

/// Threads per row. A row that the kernel holds in registers (d a multiple of 4, at most
/// `GROUPS` groups of four a thread) gets just enough warps for that; any other row loops,
/// with enough threads to keep a row of 1k–8k values in flight. Depends on d alone, so a
/// row's arithmetic does not change with the rows beside it.
fn threads(d: usize) -> u32 {
    if d.is_multiple_of(4) && d <= GROUPS * 4 * MAX_THREADS {
        d.div_ceil(GROUPS * 4).next_multiple_of(32) as u32
    } else if d >= 4096 {
        512
    } else {
        256
    }
}

/// `out[r] = x[r] / rms(x[r]) · weight` for each row of `weight.len()` values; `out` is f32 or
/// bf16 (the input of a prefill GEMM).
pub fn rms_norm<O: FloatElem>(
    device: &CudaDevice,
    x: DevSlice<'_, f32>,
    weight: DevSlice<'_, f32>,
    eps: f32,
    out: &mut DevSliceMut<'_, O>,
) -> Result<(), CudaError> {
    launch_norm(device, x.device_ptr(), x.len(), 0, weight, eps, out)
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(
    device: &CudaDevice,
    x: &mut DevSliceMut<'_, f32>,
    weight: DevSlice<'_, f32>,
    eps: f32,
) -> Result<(), CudaError> {
    let (ptr, len) = (x.device_ptr(), x.len());
    launch_norm(device, ptr, len, 0, weight, eps, x)
}

/// `x += add`, then `out = rms_norm(x)`: the residual add and the next layer's norm in one
/// pass over the stream.
pub fn add_rms_norm<O: FloatElem>(
    device: &CudaDevice,
    x: &mut DevSliceMut<'_, f32>,
    add: DevSlice<'_, f32>,
    weight: DevSlice<'_, f32>,
    eps: f32,
    out: &mut DevSliceMut<'_, O>,
) -> Result<(), CudaError> {
    ensure!(
        add.len() == x.len(),
        "add_rms_norm",
        "adding {} values to {}",
        add.len(),
        x.len()
    );
    launch_norm(
        device,
        x.device_ptr(),
        x.len(),
        add.device_ptr(),
        weight,
        eps,
        out,
    )
}

fn launch_norm<O: FloatElem>(
    device: &CudaDevice,
    x: u64,
    len: usize,
    add: u64,
    weight: DevSlice<'_, f32>,
    eps: f32,
    out: &mut DevSliceMut<'_, O>,
) -> Result<(), CudaError> {
    const OP: &str = "rms_norm";
    let d = weight.len();
    ensure!(
        d > 0 && len.is_multiple_of(d) && out.len() == len,
        OP,
        "{len} values in rows of {d} into {}",
        out.len()
    );
    ensure!(
        O::FLOAT != Float::F16,
        OP,
        "f16 output is not built (f32 or bf16)"
    );
    let rows = int(OP, "rows", len / d)? as u32;
    if rows == 0 {
        return Ok(());
    }
    let (w, o, dim) = (weight.device_ptr(), out.device_ptr(), int(OP, "d", d)?);
    let kernel = Kernel::RmsNorm { out: O::FLOAT };
    launch!(device, kernel, config((rows, 1), threads(d), 0); x, add, w, o, dim, eps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::Module;

    /// The host sizes the block for the kernel's registers.
    #[test]
    fn constants_match_the_kernel() {
        assert_eq!(Module::RmsNorm.define("RMS_GROUPS"), GROUPS);
    }

    #[test]
    fn rows_held_in_registers_get_just_enough_warps() {
        assert_eq!(threads(4096), 256);
        assert_eq!(threads(1000), 64);
        assert_eq!(threads(16), 32);
        assert_eq!(threads(16384), 1024);
        // Looped: not a multiple of four, or too long to hold.
        assert_eq!(threads(13), 256);
        assert_eq!(threads(16388), 512);
    }
}
