//! Mixture-of-experts routing on the device: top-k experts per token and the pairs grouped
//! into tiles by expert ([`moe_route`]), then the weighted sum of each token's expert outputs
//! ([`moe_combine`]). The products between them are [`super::matvec_experts`]. Nothing goes
//! back to the host, so a MoE decode step records as a CUDA graph like a dense one.

use super::device::launch;
use super::kernels::Kernel;
use super::matvec::max_tiles;
use super::{
    CudaDevice, CudaError, DevSlice, DevSliceMut, ExpertTiles, MAX_BATCH, THREADS, config, ensure,
    int, stride_blocks,
};

/// The most threads of the routing block (`MOE_THREADS` in moe.cu).
const ROUTE_THREADS: usize = 1024;
/// The most experts a layer may have (`MOE_MAX_EXPERTS` in moe.cu).
pub const MAX_EXPERTS: usize = 1024;
/// The most experts a token may take (one lane of a warp keeps each).
pub const MAX_TOP_K: usize = 32;

/// How a layer routes: `top_k` of `experts`, the chosen probabilities renormalised to sum to 1
/// with `normalize` (Qwen3-MoE's `norm_topk_prob`).
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub experts: usize,
    pub top_k: usize,
    pub normalize: bool,
}

impl Routing {
    /// Pairs per tile for a batch of `tokens`: one when a decoded token's experts all differ,
    /// [`MAX_BATCH`] once several tokens may share an expert.
    pub fn tile_rows(&self, tokens: usize) -> usize {
        if tokens == 1 { 1 } else { MAX_BATCH }
    }

    /// Values of the tile list for `tokens` (see [`ExpertTiles::tiles`]).
    pub fn tiles_len(&self, tokens: usize) -> usize {
        let pairs = tokens * self.top_k;
        1 + 3 * max_tiles(pairs, self.experts, self.tile_rows(tokens))
    }
}

/// Where [`moe_route`] writes: per pair (`[tokens · top_k]`, pair `t · top_k + rank`) its
/// expert and weight, the pairs grouped by expert, and their tiles.
pub struct Routes<'a> {
    pub ids: DevSliceMut<'a, i32>,
    pub weights: DevSliceMut<'a, f32>,
    pub order: DevSliceMut<'a, i32>,
    pub tiles: DevSliceMut<'a, i32>,
}

impl Routes<'_> {
    /// The tiles as [`super::matvec_experts`] reads them.
    pub fn tiles(&self, routing: &Routing, tokens: usize) -> ExpertTiles<'_> {
        ExpertTiles {
            tiles: self.tiles.as_slice(),
            order: self.order.as_slice(),
            pairs: tokens * routing.top_k,
            tile_rows: routing.tile_rows(tokens),
        }
    }
}

/// Routes each of `tokens` rows of router `logits` (`[tokens, experts]`) to its top-k experts
/// (softmax, then the k most probable, ties to the lower index as `torch.topk`), and groups
/// the pairs into tiles of [`Routing::tile_rows`].
pub fn moe_route(
    device: &CudaDevice,
    logits: DevSlice<'_, f32>,
    tokens: usize,
    routing: &Routing,
    out: &mut Routes<'_>,
) -> Result<(), CudaError> {
    const OP: &str = "moe_route";
    let Routing {
        experts,
        top_k,
        normalize,
    } = *routing;
    ensure!(
        (1..=MAX_EXPERTS).contains(&experts),
        OP,
        "{experts} experts, 1..={MAX_EXPERTS} route"
    );
    ensure!(
        (1..=experts.min(MAX_TOP_K)).contains(&top_k),
        OP,
        "top {top_k} of {experts} experts (at most {MAX_TOP_K})"
    );
    ensure!(
        logits.len() == tokens * experts,
        OP,
        "{} logits for {tokens} tokens of {experts} experts",
        logits.len()
    );
    let pairs = tokens * top_k;
    for (what, len) in [
        ("ids", out.ids.len()),
        ("weights", out.weights.len()),
        ("order", out.order.len()),
    ] {
        ensure!(
            len >= pairs,
            OP,
            "{what} has {len} places for {pairs} pairs"
        );
    }
    ensure!(
        out.tiles.len() >= routing.tiles_len(tokens),
        OP,
        "a tile list of {} values for {tokens} tokens",
        out.tiles.len()
    );
    if tokens == 0 {
        return Ok(());
    }
    let (lp, ip, wp, op, tp) = (
        logits.device_ptr(),
        out.ids.device_ptr(),
        out.weights.device_ptr(),
        out.order.device_ptr(),
        out.tiles.device_ptr(),
    );
    let (n, e, k) = (int(OP, "tokens", tokens)?, experts as i32, top_k as i32);
    let (norm, tile_rows) = (i32::from(normalize), routing.tile_rows(tokens) as i32);
    // A warp per token to pick experts, a thread per expert to group pairs.
    let threads = (tokens * 32)
        .max(experts)
        .next_multiple_of(32)
        .min(ROUTE_THREADS) as u32;
    launch!(device, Kernel::MoeRoute, config((1, 1), threads, 0);
        lp, n, e, k, norm, tile_rows, ip, wp, op, tp)
}

/// `out[t] += Σ_r weights[t·top_k + r] · expert_out[t·top_k + r]` for `out` `[tokens, hidden]`
/// (the residual stream) and `expert_out` `[tokens · top_k, hidden]`, summed in rank order.
pub fn moe_combine(
    device: &CudaDevice,
    expert_out: DevSlice<'_, f32>,
    weights: DevSlice<'_, f32>,
    top_k: usize,
    out: &mut DevSliceMut<'_, f32>,
    hidden: usize,
) -> Result<(), CudaError> {
    const OP: &str = "moe_combine";
    ensure!(
        hidden > 0 && out.len().is_multiple_of(hidden),
        OP,
        "out of {} values in rows of {hidden}",
        out.len()
    );
    let tokens = out.len() / hidden;
    ensure!(
        expert_out.len() == tokens * top_k * hidden && weights.len() == tokens * top_k,
        OP,
        "{} expert outputs and {} weights for {tokens} tokens of top {top_k}",
        expert_out.len(),
        weights.len()
    );
    if tokens == 0 {
        return Ok(());
    }
    let (xp, wp, op) = (
        expert_out.device_ptr(),
        weights.device_ptr(),
        out.device_ptr(),
    );
    let (n, k, h) = (
        int(OP, "tokens", tokens)?,
        int(OP, "top_k", top_k)?,
        int(OP, "hidden", hidden)?,
    );
    let cfg = config((stride_blocks(device, out.len()), 1), THREADS, 0);
    launch!(device, Kernel::MoeCombine, cfg; xp, wp, n, k, h, op)
}
