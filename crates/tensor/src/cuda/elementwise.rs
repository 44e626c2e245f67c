//! Element-wise ops: SwiGLU, residual add, type conversion.

use super::device::launch;
use super::kernels::{Float, Kernel};
use super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, FloatElem, THREADS, config, ensure, stride_blocks,
};

/// `out = silu(gate) · up` (SwiGLU), computed in f32: `gate` and `up` are f32 or bf16 (a
/// prompt's gate/up GEMM outputs), `out` f32 or bf16 (the input of the down GEMM).
pub fn silu_mul<I: FloatElem, O: FloatElem>(
    device: &CudaDevice,
    gate: DevSlice<'_, I>,
    up: DevSlice<'_, I>,
    out: &mut DevSliceMut<'_, O>,
) -> Result<(), CudaError> {
    launch_silu_mul(device, gate.device_ptr(), gate.len(), up, out)
}

/// `gate = silu(gate) · up`.
pub fn silu_mul_in_place(
    device: &CudaDevice,
    gate: &mut DevSliceMut<'_, f32>,
    up: DevSlice<'_, f32>,
) -> Result<(), CudaError> {
    let (ptr, len) = (gate.device_ptr(), gate.len());
    launch_silu_mul(device, ptr, len, up, gate)
}

fn launch_silu_mul<I: FloatElem, O: FloatElem>(
    device: &CudaDevice,
    gate: u64,
    len: usize,
    up: DevSlice<'_, I>,
    out: &mut DevSliceMut<'_, O>,
) -> Result<(), CudaError> {
    ensure!(
        up.len() == len && out.len() == len,
        "silu_mul",
        "gate {len}, up {}, out {}",
        up.len(),
        out.len()
    );
    ensure!(
        I::FLOAT != Float::F16 && O::FLOAT != Float::F16,
        "silu_mul",
        "{} to {} is not built (f32 or bf16 each)",
        I::FLOAT,
        O::FLOAT
    );
    if len == 0 {
        return Ok(());
    }
    let (u, o, n) = (up.device_ptr(), out.device_ptr(), len as i64);
    let vec = i32::from([gate, u, o].iter().all(|p| p.is_multiple_of(16)));
    let kernel = Kernel::SiluMul {
        input: I::FLOAT,
        out: O::FLOAT,
    };
    let cfg = config((stride_blocks(device, len.div_ceil(8)), 1), THREADS, 0);
    launch!(device, kernel, cfg; gate, u, o, n, vec)
}

/// `x += y`.
pub fn add(
    device: &CudaDevice,
    x: &mut DevSliceMut<'_, f32>,
    y: DevSlice<'_, f32>,
) -> Result<(), CudaError> {
    ensure!(
        x.len() == y.len(),
        "add",
        "adding {} values to {}",
        y.len(),
        x.len()
    );
    if x.is_empty() {
        return Ok(());
    }
    let (xp, yp, n) = (x.device_ptr(), y.device_ptr(), x.len() as i64);
    let cfg = config((stride_blocks(device, x.len()), 1), THREADS, 0);
    launch!(device, Kernel::Add, cfg; xp, yp, n)
}

/// `out = src` converted: f32 to f32/bf16/f16 (activations for a GEMM, keys and values into
/// a 16-bit cache, rounded to nearest even), or bf16/f16 to f32.
pub fn convert<I: FloatElem, O: FloatElem>(
    device: &CudaDevice,
    src: DevSlice<'_, I>,
    out: &mut DevSliceMut<'_, O>,
) -> Result<(), CudaError> {
    let (from, to) = (I::FLOAT, O::FLOAT);
    ensure!(
        from == Float::F32 || to == Float::F32,
        "convert",
        "{from} to {to} is not built (one side must be f32)"
    );
    ensure!(
        src.len() == out.len(),
        "convert",
        "{} values into {}",
        src.len(),
        out.len()
    );
    if src.is_empty() {
        return Ok(());
    }
    let (s, o, n) = (src.device_ptr(), out.device_ptr(), src.len() as i64);
    let cfg = config((stride_blocks(device, src.len()), 1), THREADS, 0);
    launch!(device, Kernel::Convert { from, to }, cfg; s, o, n)
}
