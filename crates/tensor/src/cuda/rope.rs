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

/// The heads one launch rotates: `rows × n_heads × head_dim` values, with an optional
/// per-head norm in front.
pub struct RopeHeads<'a, 'n> {
    pub x: DevSliceMut<'a, f32>,
    pub n_heads: usize,
    pub norm: Option<RopeNorm<'n>>,
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
    let heads = RopeHeads {
        x: x.reborrow(),
        n_heads,
        norm,
    };
    rope_qk(device, heads, None, head_dim, pos0, cos, sin, layout)
}

/// [`rope`] of a step's queries and keys (the same rows, positions and layout) in one launch.
#[allow(clippy::too_many_arguments)]
pub fn rope_qk(
    device: &CudaDevice,
    q: RopeHeads<'_, '_>,
    k: Option<RopeHeads<'_, '_>>,
    head_dim: usize,
    pos0: Position<'_>,
    cos: DevSlice<'_, f32>,
    sin: DevSlice<'_, f32>,
    layout: RopeLayout,
) -> Result<(), CudaError> {
    const OP: &str = "rope";
    let q_row = q.n_heads * head_dim;
    ensure!(
        head_dim.is_multiple_of(2) && q_row > 0 && q.x.len().is_multiple_of(q_row),
        OP,
        "{} values in rows of {} heads of {head_dim}",
        q.x.len(),
        q.n_heads
    );
    let rows = q.x.len() / q_row;
    if let Some(k) = &k {
        ensure!(
            k.x.len() == rows * k.n_heads * head_dim,
            OP,
            "{} keys for {rows} rows of {} heads of {head_dim}",
            k.x.len(),
            k.n_heads
        );
    }
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
    let norms = [q.norm.as_ref(), k.as_ref().and_then(|k| k.norm.as_ref())];
    for norm in norms.into_iter().flatten() {
        ensure!(
            norm.weight.len() == head_dim,
            OP,
            "norm weight of {} for heads of {head_dim}",
            norm.weight.len()
        );
    }
    // Both norms share one epsilon (the model's).
    let eps = norms.into_iter().flatten().next().map_or(0.0, |n| n.eps);
    let k_heads = k.as_ref().map_or(0, |k| k.n_heads);
    let items = rows * (q.n_heads + k_heads);
    if items == 0 {
        return Ok(());
    }
    let blocks = int(OP, "blocks", items.div_ceil(HEADS_PER_BLOCK))? as u32;
    let norm_ptr = |n: Option<&RopeNorm<'_>>| n.map_or(0, |n| n.weight.device_ptr());
    let (qp, qn, qh) = (
        q.x.device_ptr(),
        norm_ptr(q.norm.as_ref()),
        int(OP, "heads", q.n_heads)?,
    );
    let (kp, kn, kh) = match &k {
        Some(k) => (
            k.x.device_ptr(),
            norm_ptr(k.norm.as_ref()),
            int(OP, "heads", k.n_heads)?,
        ),
        None => (0, 0, 0),
    };
    let (cp, sp) = (cos.device_ptr(), sin.device_ptr());
    let (n, d) = (int(OP, "rows", rows)?, int(OP, "head_dim", head_dim)?);
    let (pos0, pos0_dev) = pos0.args(OP, "pos0")?;
    let positions = int(OP, "positions", positions)?;
    let pairs = i32::from(layout == RopeLayout::Pairs);
    let cfg = config((blocks, 1), (HEADS_PER_BLOCK * 32) as u32, 0);
    launch!(device, Kernel::Rope, cfg;
        qp, qn, qh, kp, kn, kh, cp, sp, n, d, pos0, pos0_dev, positions, pairs, eps)
}
