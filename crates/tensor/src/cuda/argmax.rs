//! Greedy sampling on the device.

use super::device::launch;
use super::kernels::Kernel;
use super::{CudaDevice, CudaError, DevSlice, DevSliceMut, config, ensure, int};

/// Threads of a block (`ARGMAX_THREADS` in argmax.cu).
const THREADS: usize = 256;
/// Values a thread takes per batch of loads (`ARGMAX_BATCH`).
const BATCH: usize = 8;
/// The most chunks a row is cut into (`ARGMAX_MAX_BLOCKS`).
const MAX_BLOCKS: usize = 128;
/// Scratch words a row takes (`ARGMAX_ROW_WORDS`): each chunk's best value and index, and the
/// row's ticket.
const ROW_WORDS: usize = 2 * MAX_BLOCKS + 1;

/// The u32 words of scratch [`argmax`] takes for `rows` rows. Zero it before the first launch
/// ([`CudaDevice::fill_bytes`]); every launch leaves it that way.
pub fn argmax_scratch_len(rows: usize) -> usize {
    rows * ROW_WORDS
}

/// `out[r]` = the index of the largest of row `r`'s `vocab` logits: the lowest index on ties,
/// NaN never chosen (0 for a row of only NaN), as the CPU sampler's greedy pick. A row is
/// shared by blocks of a few thousand values each, the last to finish picking from their
/// bests (`scratch`, [`argmax_scratch_len`]), so one launch has a row's values in flight at
/// once; the pick does not depend on which block finishes last.
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
    scratch: &mut DevSliceMut<'_, u32>,
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
    ensure!(
        scratch.len() >= argmax_scratch_len(out.len()),
        OP,
        "scratch of {} words for {} rows, {} needed",
        scratch.len(),
        out.len(),
        argmax_scratch_len(out.len())
    );
    if out.is_empty() {
        return Ok(());
    }
    let (lp, op, sp, n) = (
        logits.device_ptr(),
        out.device_ptr(),
        scratch.device_ptr(),
        int(OP, "vocab", vocab)?,
    );
    let fp = feed.map_or(0, |f| f.device_ptr());
    let rows = int(OP, "rows", out.len())? as u32;
    let chunks = chunks(vocab) as u32;
    launch!(device, Kernel::Argmax, config((chunks, rows), THREADS as u32, 0); lp, op, n, fp, sp)
}

/// Chunks a row of `vocab` values is cut into: enough for each thread to have one batch of
/// loads, at most [`MAX_BLOCKS`].
fn chunks(vocab: usize) -> usize {
    vocab.div_ceil(THREADS * BATCH).clamp(1, MAX_BLOCKS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::Module;

    /// The host sizes the grid and the scratch from the kernel's own constants.
    #[test]
    fn constants_match_the_kernel() {
        let m = Module::Argmax;
        assert_eq!(m.define("ARGMAX_THREADS"), THREADS);
        assert_eq!(m.define("ARGMAX_BATCH"), BATCH);
        assert_eq!(m.define("ARGMAX_MAX_BLOCKS"), MAX_BLOCKS);
    }

    #[test]
    fn rows_are_cut_into_a_batch_of_loads_a_thread() {
        assert_eq!(chunks(1), 1);
        assert_eq!(chunks(2048), 1);
        assert_eq!(chunks(2049), 2);
        // Qwen3's vocabulary: 75 chunks of 2026.
        assert_eq!(chunks(151_936), 75);
        assert_eq!(chunks(10_000_000), MAX_BLOCKS);
    }
}
