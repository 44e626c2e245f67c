//! Rotary position embedding, with Qwen3's per-head RMS norm optionally fused in front.

use super::device::launch;
use super::kernels::Kernel;
use super::{CudaDevice, CudaError, DevSlice, DevSliceMut, Position, config, ensure, int};
use crate::cpu::RopeLayout;

/// Warps (one per row and head) per block (`ROPE_THREADS / 32` in rope.cu).
const HEADS_PER_BLOCK: usize = 4;

/// A per-head RMS norm applied before the rotation (Qwen3's `q_norm`/`k_norm`).
#[derive(Clone, Copy, Debug)]
pub struct RopeNorm<'a> {
    /// `head_dim` values.
    pub weight: DevSlice<'a, f32>,
    pub eps: f32,
}

/// Rotates rows of `n_heads × head_dim` values in place; row `r` is at position `pos0 + r`.
/// `cos`/`sin` are `[positions, head_dim / 2]` (the CPU tables, uploaded); a row whose
/// position (read on the device) passes them is left as it is. Computes what
/// [`crate::cpu::rms_norm_in_place`] followed by [`crate::cpu::rope_in_place`] computes.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    device: &CudaDevice,
    x: &mut DevSliceMut<'_, f32>,
    n_heads: usize,
    head_dim: usize,
    pos0: Position<'_>,
    cos: DevSlice<'_, f32>,
    sin: DevSlice<'_, f32>,
    layout: RopeLayout,
    norm: Option<RopeNorm<'_>>,
) -> Result<(), CudaError> {
    const OP: &str = "rope";
    let row = n_heads * head_dim;
    ensure!(
        head_dim.is_multiple_of(2) && row > 0 && x.len().is_multiple_of(row),
        OP,
        "{} values in rows of {n_heads} heads of {head_dim}",
        x.len()
    );
    let rows = x.len() / row;
    let half = head_dim / 2;
    ensure!(
        cos.len() == sin.len() && cos.len().is_multiple_of(half),
        OP,
        "tables of {} and {} values for heads of {head_dim}",
        cos.len(),
        sin.len()
    );
    let positions = cos.len() / half;
    if let Some(pos0) = pos0.host() {
        ensure!(
            pos0 + rows <= positions,
            OP,
            "positions {pos0}..{} beyond tables of {positions}",
            pos0 + rows
        );
    }
    if let Some(norm) = &norm {
        ensure!(
            norm.weight.len() == head_dim,
            OP,
            "norm weight of {} for heads of {head_dim}",
            norm.weight.len()
        );
    }
    let items = rows * n_heads;
    if items == 0 {
        return Ok(());
    }
    let blocks = int(OP, "blocks", items.div_ceil(HEADS_PER_BLOCK))? as u32;
    let (xp, cp, sp) = (x.device_ptr(), cos.device_ptr(), sin.device_ptr());
    let (np, eps) = norm.map_or((0, 0.0), |n| (n.weight.device_ptr(), n.eps));
    let (n, heads, d) = (
        int(OP, "rows", rows)?,
        int(OP, "heads", n_heads)?,
        int(OP, "head_dim", head_dim)?,
    );
    let (pos0, pos0_dev) = pos0.args(OP, "pos0")?;
    let positions = int(OP, "positions", positions)?;
    let pairs = i32::from(layout == RopeLayout::Pairs);
    let cfg = config((blocks, 1), (HEADS_PER_BLOCK * 32) as u32, 0);
    launch!(device, Kernel::Rope, cfg;
        xp, cp, sp, np, n, heads, d, pos0, pos0_dev, positions, pairs, eps)
}
