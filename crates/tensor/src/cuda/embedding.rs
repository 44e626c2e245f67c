//! Token embedding lookup.

use super::device::launch;
use super::kernels::Kernel;
use super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, FloatElem, THREADS, config, ensure, int,
};

/// `out[i] = table[tokens[i]]` as f32; `table` is `[vocab, hidden]`. A token id past the
/// table gives a row of NaN (tokens may come from the device, so they are not checked here).
pub fn embedding<T: FloatElem>(
    device: &CudaDevice,
    table: DevSlice<'_, T>,
    hidden: usize,
    tokens: DevSlice<'_, u32>,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    lookup(device, table, hidden, tokens, 0, false, out)
}

/// [`embedding`] on a rank of a tensor-parallel group whose `table` holds rows
/// `first..first + table rows` of the vocabulary: a token outside them gets a row of zeros
/// (the rank holding it gives its row, and the ranks' rows are summed).
pub fn embedding_part<T: FloatElem>(
    device: &CudaDevice,
    table: DevSlice<'_, T>,
    hidden: usize,
    tokens: DevSlice<'_, u32>,
    first: usize,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    lookup(device, table, hidden, tokens, first, true, out)
}

fn lookup<T: FloatElem>(
    device: &CudaDevice,
    table: DevSlice<'_, T>,
    hidden: usize,
    tokens: DevSlice<'_, u32>,
    first: usize,
    zero_outside: bool,
    out: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    const OP: &str = "embedding";
    ensure!(
        hidden > 0 && table.len().is_multiple_of(hidden) && out.len() == tokens.len() * hidden,
        OP,
        "table of {} values in rows of {hidden}, {} tokens into {}",
        table.len(),
        tokens.len(),
        out.len()
    );
    if tokens.is_empty() {
        return Ok(());
    }
    let (tp, kp, op) = (table.device_ptr(), tokens.device_ptr(), out.device_ptr());
    let (h, vocab) = (
        int(OP, "hidden", hidden)?,
        int(OP, "vocab", table.len() / hidden)?,
    );
    let first = u32::try_from(first)
        .map_err(|_| CudaError::invalid(OP, format!("first row {first} past u32")))?;
    let zero_outside = i32::from(zero_outside);
    let blocks = int(OP, "tokens", tokens.len())? as u32;
    launch!(device, Kernel::Embedding { table: T::FLOAT }, config((blocks, 1), THREADS, 0); tp, kp, op, h, vocab, first, zero_outside)
}
