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

/// Outputs [`split_columns`] writes at most: q, k and v.
pub const SPLIT_MAX_OUTPUTS: usize = 3;

/// One output of `split_columns_f32`, field for field `SplitOut` in elementwise.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SplitOut {
    y: u64,
    first: i32,
    width: i32,
}

/// The kernel's argument, field for field `SplitColumnsArgs` in elementwise.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SplitColumnsArgs {
    src: u64,
    out: [SplitOut; SPLIT_MAX_OUTPUTS],
    rows: i64,
    width: i32,
    outs: i32,
}
const _: () = assert!(size_of::<SplitColumnsArgs>() == 72);

/// `outs[i] = src[.., first_i .. first_i + widths[i]]` for `src` of rows `Σ widths` wide: the
/// product of matrices laid end to end (q, k and v) cut into each one's output. Every width a
/// multiple of 4 and every slice on 16 bytes.
pub fn split_columns(
    device: &CudaDevice,
    src: DevSlice<'_, f32>,
    outs: &mut [DevSliceMut<'_, f32>],
    widths: &[usize],
) -> Result<(), CudaError> {
    const OP: &str = "split_columns";
    ensure!(
        (1..=SPLIT_MAX_OUTPUTS).contains(&outs.len()) && widths.len() == outs.len(),
        OP,
        "{} outputs of {} widths (1 to {SPLIT_MAX_OUTPUTS})",
        outs.len(),
        widths.len()
    );
    let width: usize = widths.iter().sum();
    ensure!(
        width > 0 && src.len().is_multiple_of(width),
        OP,
        "{} values in rows of {width}",
        src.len()
    );
    let rows = src.len() / width;
    let mut args = SplitColumnsArgs {
        src: src.device_ptr(),
        rows: rows as i64,
        width: super::int(OP, "width", width)?,
        outs: outs.len() as i32,
        ..Default::default()
    };
    let mut first = 0;
    for (i, (out, &w)) in outs.iter_mut().zip(widths).enumerate() {
        ensure!(
            out.len() == rows * w && w.is_multiple_of(4),
            OP,
            "output {i} of {} values for {rows} rows of {w} (a multiple of 4)",
            out.len()
        );
        args.out[i] = SplitOut {
            y: out.device_ptr(),
            first: super::int(OP, "first", first)?,
            width: super::int(OP, "width", w)?,
        };
        first += w;
    }
    let pointers = std::iter::once(args.src).chain(args.out[..outs.len()].iter().map(|o| o.y));
    ensure!(
        pointers.into_iter().all(|p| p.is_multiple_of(16)),
        OP,
        "every slice starting on 16 bytes"
    );
    if rows == 0 {
        return Ok(());
    }
    let cfg = config((stride_blocks(device, rows * width / 4), 1), THREADS, 0);
    launch!(device, Kernel::SplitColumns, cfg; args)
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

/// `out[i] = ((parts[i] + parts[n + i]) + parts[2n + i]) + …` for `n = out.len()`: the
/// partial sums of `parts.len() / n` ranks gathered end to end, added in rank order (so the
/// same bits as adding them one after another, in one launch).
pub fn sum_parts(
    device: &CudaDevice,
    parts: DevSlice<'_, f32>,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    const OP: &str = "sum_parts";
    let n = out.len();
    ensure!(
        n > 0 && parts.len().is_multiple_of(n) && parts.len() >= n,
        OP,
        "{} values gathered into sums of {n}",
        parts.len()
    );
    let (pp, op, len) = (parts.device_ptr(), out.device_ptr(), n as i64);
    let ranks = super::int(OP, "ranks", parts.len() / n)?;
    let cfg = config((stride_blocks(device, n), 1), THREADS, 0);
    launch!(device, Kernel::SumParts, cfg; pp, op, len, ranks)
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
