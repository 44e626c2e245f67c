//! Mixture-of-experts layers on the device: top-k experts per token and the pairs grouped
//! into tiles by expert ([`moe_route`]), each routed pair's products through a table of the
//! experts' addresses ([`ExpertTable`]: [`super::matvec_experts`] for decode, [`experts_mma`]
//! on the tensor cores for prompts), then the weighted sum of each token's expert outputs
//! added to the residual ([`moe_combine`]). Nothing goes back to the host, so a MoE decode
//! step records as a CUDA graph like a dense one.

use super::device::launch;
use super::kernels::Kernel;
use super::matvec::aligned;
use super::{
    CudaDevice, CudaError, DevMat, DevSlice, DevSliceMut, DeviceBuffer, Float, MAX_BATCH, THREADS,
    config, ensure, int, stride_blocks,
};
use crate::{BufferKind, BufferOwner};

/// The most threads of the routing block (`MOE_THREADS` in moe.cu).
const ROUTE_THREADS: usize = 1024;
/// The most experts a layer may have (`MOE_MAX_EXPERTS` in moe.cu).
pub const MAX_EXPERTS: usize = 1024;
/// The most experts a token may take (one lane of a warp keeps each).
pub const MAX_TOP_K: usize = 32;

/// The weights of a mixture-of-experts layer's experts for [`super::matvec_experts`] and
/// [`experts_mma`]: a device table of each expert's matrix addresses (`[experts][matrices]`,
/// u64), all `rows × cols` of `dtype`.
pub struct ExpertTable {
    pub(super) addresses: DeviceBuffer,
    pub(super) experts: usize,
    pub(super) matrices: usize,
    pub(super) dtype: Float,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Every matrix starts on 16 bytes (the kernels' wide loads).
    pub(super) aligned: bool,
}

impl ExpertTable {
    /// `experts[e]` are expert `e`'s matrices (the same number for each, 1 or 2: with two,
    /// gate and up for [`super::Epilogue::SwiGlu`]).
    ///
    /// # Safety
    /// The table holds the matrices' addresses, not the matrices: the memory behind each must
    /// outlive it (ember's MoE layer keeps the weights and their table together).
    pub unsafe fn new(
        device: &CudaDevice,
        owner: &BufferOwner,
        label: &str,
        experts: &[Vec<DevMat<'_>>],
    ) -> Result<ExpertTable, CudaError> {
        const OP: &str = "expert table";
        ensure!(!experts.is_empty(), OP, "no experts");
        let first = &experts[0];
        ensure!(
            (1..=2).contains(&first.len()),
            OP,
            "{} matrices per expert, 1 or 2",
            first.len()
        );
        let (dtype, rows, cols) = (first[0].dtype, first[0].rows, first[0].cols);
        let mut addresses = Vec::with_capacity(experts.len() * first.len());
        for (e, mats) in experts.iter().enumerate() {
            ensure!(
                mats.len() == first.len(),
                OP,
                "expert {e} has {} matrices, expert 0 {}",
                mats.len(),
                first.len()
            );
            for m in mats {
                ensure!(
                    m.dtype == dtype && m.rows == rows && m.cols == cols,
                    OP,
                    "expert {e}: a {}×{} {} matrix among {rows}×{cols} {dtype} ones",
                    m.rows,
                    m.cols,
                    m.dtype
                );
                addresses.push(m.data.device_ptr());
            }
        }
        let mut buffer = owner.alloc_device(
            BufferKind::Weights,
            label,
            device,
            addresses.len() * std::mem::size_of::<u64>(),
        )?;
        buffer.upload(&addresses)?;
        let aligned = addresses.iter().all(|&a| aligned(a));
        Ok(ExpertTable {
            addresses: buffer,
            experts: experts.len(),
            matrices: first.len(),
            dtype,
            rows,
            cols,
            aligned,
        })
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Rows of each matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether [`experts_mma`] takes these matrices: bf16, rows on 16 bytes, rows of a whole
    /// number of its steps.
    pub fn takes_tensor_cores(&self) -> bool {
        self.dtype == Float::Bf16 && self.aligned && self.cols.is_multiple_of(EXPERT_MMA_K)
    }
}

/// How the routed pairs' products run, which sets how many pairs a tile holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertRoad {
    /// One token: its experts all differ, a tile per pair ([`super::matvec_experts`]).
    Decode,
    /// A few tokens, or weights the tensor cores do not take: tiles of [`MAX_BATCH`]
    /// ([`super::matvec_experts`]).
    Matvec,
    /// Prompts of bf16 experts: tiles of [`EXPERT_MMA_PAIRS`] ([`experts_mma`]).
    TensorCores,
}

impl ExpertRoad {
    /// Pairs per tile at most.
    pub fn tile_rows(self) -> usize {
        match self {
            ExpertRoad::Decode => 1,
            ExpertRoad::Matvec => MAX_BATCH,
            ExpertRoad::TensorCores => EXPERT_MMA_PAIRS,
        }
    }
}

/// Pairs per tile of [`experts_mma`] (`XM_PAIRS` in experts_mma.cu).
pub const EXPERT_MMA_PAIRS: usize = 64;
/// Rows of the row length [`experts_mma`] steps through at a time (`XM_K`).
const EXPERT_MMA_K: usize = 32;
/// Output rows of one block of [`experts_mma`] (`XM_ROWS`).
const EXPERT_MMA_ROWS: usize = 64;
/// Threads of a block of [`experts_mma`] (`XM_THREADS`).
const EXPERT_MMA_THREADS: u32 = 128;

/// Routed (token, expert) pairs grouped into tiles by [`moe_route`].
#[derive(Clone, Copy)]
pub struct ExpertTiles<'a> {
    /// `[1 + 3·max_tiles]`: the tile count, then (expert, first, pairs) per tile.
    pub tiles: DevSlice<'a, i32>,
    /// `[pairs]`: pair indices grouped by expert.
    pub order: DevSlice<'a, i32>,
    pub pairs: usize,
    pub road: ExpertRoad,
}

/// The most tiles `pairs` routed pairs make over `experts` experts in tiles of `tile_rows`:
/// each expert's pairs fill whole tiles but its last.
pub fn max_tiles(pairs: usize, experts: usize, tile_rows: usize) -> usize {
    (pairs + (tile_rows - 1) * experts.min(pairs)) / tile_rows
}

/// How a layer routes: `top_k` of `experts`, the chosen probabilities renormalised to sum to 1
/// with `normalize` (Qwen3-MoE's `norm_topk_prob`), to the experts `held` here.
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub experts: usize,
    pub top_k: usize,
    pub normalize: bool,
    pub held: HeldExperts,
}

/// The experts whose weights this device's [`ExpertTable`]s hold, `first..first + count` of
/// the router's: all of them, or one rank's share under expert parallelism. Pairs routed to
/// the others get no tile and add nothing in [`moe_combine`]: the rank holding their expert
/// adds them, and the ranks' sums are added up after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldExperts {
    pub first: usize,
    pub count: usize,
}

impl Routing {
    /// `top_k` of `experts`, all of them held.
    pub fn new(experts: usize, top_k: usize, normalize: bool) -> Routing {
        Routing {
            experts,
            top_k,
            normalize,
            held: HeldExperts {
                first: 0,
                count: experts,
            },
        }
    }

    /// The same routing with only `count` experts from `first` held here.
    pub fn holding(self, first: usize, count: usize) -> Routing {
        Routing {
            held: HeldExperts { first, count },
            ..self
        }
    }

    /// Values of the tile list for `tokens` on `road` (see [`ExpertTiles::tiles`]): tiles for
    /// the held experts only.
    pub fn tiles_len(&self, tokens: usize, road: ExpertRoad) -> usize {
        let pairs = tokens * self.top_k;
        1 + 3 * max_tiles(pairs, self.held.count, road.tile_rows())
    }
}

/// Where [`moe_route`] writes: per pair (`[tokens · top_k]`, pair `t · top_k + rank`) its
/// expert and weight, the pairs grouped by expert, and their tiles for `road`.
pub struct Routes<'a> {
    pub ids: DevSliceMut<'a, i32>,
    pub weights: DevSliceMut<'a, f32>,
    pub order: DevSliceMut<'a, i32>,
    pub tiles: DevSliceMut<'a, i32>,
    pub road: ExpertRoad,
}

impl Routes<'_> {
    /// The tiles as the expert products read them.
    pub fn tiles(&self, routing: &Routing, tokens: usize) -> ExpertTiles<'_> {
        ExpertTiles {
            tiles: self.tiles.as_slice(),
            order: self.order.as_slice(),
            pairs: tokens * routing.top_k,
            road: self.road,
        }
    }
}

/// Routes each of `tokens` rows of router `logits` (`[tokens, experts]`) to its top-k experts
/// (softmax, then the k most probable, ties to the lower index as `torch.topk`), and groups
/// the pairs of held experts into tiles for the road `out` names, each tile naming its expert
/// by its place in the held ones (the [`ExpertTable`]'s index).
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
        held,
    } = *routing;
    ensure!(
        (1..=MAX_EXPERTS).contains(&experts),
        OP,
        "{experts} experts, 1..={MAX_EXPERTS} route"
    );
    ensure!(
        held.count >= 1 && held.first + held.count <= experts,
        OP,
        "{} experts held from {} of {experts}",
        held.count,
        held.first
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
        out.tiles.len() >= routing.tiles_len(tokens, out.road),
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
    let (norm, tile_rows) = (i32::from(normalize), out.road.tile_rows() as i32);
    let (held_first, held_end) = (held.first as i32, (held.first + held.count) as i32);
    // A warp per token to pick experts, a thread per expert to group pairs; one warp for
    // a single token with a tile per pair, which it lays out itself (moe.cu).
    let threads = if tokens == 1 && tile_rows == 1 {
        32
    } else {
        (tokens * 32)
            .max(experts)
            .next_multiple_of(32)
            .min(ROUTE_THREADS) as u32
    };
    launch!(device, Kernel::MoeRoute, config((1, 1), threads, 0);
        lp, n, e, k, norm, tile_rows, held_first, held_end, ip, wp, op, tp)
}

/// `out[t] += Σ_r weights[t·top_k + r] · expert_out[t·top_k + r]` for `out` `[tokens, hidden]`
/// (the residual stream, or a rank's partial sum) and `expert_out` `[tokens · top_k, hidden]`,
/// summed in rank order over the pairs whose expert (`ids`, as [`moe_route`] wrote them) is
/// `held`.
pub fn moe_combine(
    device: &CudaDevice,
    routes: (DevSlice<'_, f32>, DevSlice<'_, i32>),
    held: HeldExperts,
    expert_out: DevSlice<'_, f32>,
    top_k: usize,
    out: &mut DevSliceMut<'_, f32>,
    hidden: usize,
) -> Result<(), CudaError> {
    let (weights, ids) = routes;
    const OP: &str = "moe_combine";
    ensure!(
        hidden > 0 && out.len().is_multiple_of(hidden),
        OP,
        "out of {} values in rows of {hidden}",
        out.len()
    );
    let tokens = out.len() / hidden;
    ensure!(
        expert_out.len() == tokens * top_k * hidden
            && weights.len() == tokens * top_k
            && ids.len() == weights.len(),
        OP,
        "{} expert outputs, {} weights and {} ids for {tokens} tokens of top {top_k}",
        expert_out.len(),
        weights.len(),
        ids.len()
    );
    if tokens == 0 {
        return Ok(());
    }
    let (xp, wp, ip, op) = (
        expert_out.device_ptr(),
        weights.device_ptr(),
        ids.device_ptr(),
        out.device_ptr(),
    );
    let held_first = int(OP, "held experts", held.first)?;
    let held_end = int(OP, "held experts", held.first + held.count)?;
    let (n, k, h) = (
        int(OP, "tokens", tokens)?,
        int(OP, "top_k", top_k)?,
        int(OP, "hidden", hidden)?,
    );
    let cfg = config((stride_blocks(device, out.len()), 1), THREADS, 0);
    launch!(device, Kernel::MoeCombine, cfg; xp, wp, ip, held_first, held_end, n, k, h, op)
}

/// `y[p] = W_e · x[p / x_div]` for each routed pair `p` and its expert `e` (with two matrices,
/// gate and up, `y[p] = silu(W_gate · x) · (W_up · x)`) on the tensor cores: bf16 experts,
/// `x` rounded to bf16 as it is staged, f32 sums; tiles of the [`ExpertRoad::TensorCores`]
/// road. `x` is `[pairs / x_div, cols]`, `y` is `[pairs, rows]`; cols a multiple of 32.
pub fn experts_mma(
    device: &CudaDevice,
    table: &ExpertTable,
    tiles: ExpertTiles<'_>,
    x: DevSlice<'_, f32>,
    x_div: usize,
    y: &mut DevSliceMut<'_, f32>,
) -> Result<(), CudaError> {
    const OP: &str = "experts_mma";
    let (pairs, cols, rows) = (tiles.pairs, table.cols, table.rows);
    ensure!(
        table.dtype == Float::Bf16 && table.aligned,
        OP,
        "{} experts (bf16 with rows on 16 bytes take the tensor cores)",
        table.dtype
    );
    ensure!(
        cols.is_multiple_of(EXPERT_MMA_K) && aligned(x.device_ptr()),
        OP,
        "rows of {cols} (a multiple of {EXPERT_MMA_K}, x on 16 bytes)"
    );
    check_routed_shapes(OP, table, &tiles, x.len(), x_div, y.len())?;
    ensure!(
        tiles.road == ExpertRoad::TensorCores,
        OP,
        "tiles for {:?}",
        tiles.road
    );
    if pairs == 0 {
        return Ok(());
    }
    let blocks = int(OP, "blocks", rows.div_ceil(EXPERT_MMA_ROWS))? as u32;
    let grid_y = int(
        OP,
        "tiles",
        max_tiles(pairs, table.experts, EXPERT_MMA_PAIRS),
    )? as u32;
    let (xp, yp, tp, op, ep) = (
        x.device_ptr(),
        y.device_ptr(),
        tiles.tiles.device_ptr(),
        tiles.order.device_ptr(),
        table.addresses.device_ptr(),
    );
    let (r, c, d) = (
        int(OP, "rows", rows)?,
        int(OP, "cols", cols)?,
        int(OP, "x_div", x_div)?,
    );
    let kernel = Kernel::ExpertsMma {
        swiglu: table.matrices == 2,
    };
    let cfg = config((blocks, grid_y), EXPERT_MMA_THREADS, 0);
    launch!(device, kernel, cfg; xp, yp, tp, op, ep, r, c, d)
}

/// The checks every routed product makes: `x` holds a row per `x_div` pairs, `y` a row per
/// pair, and the tile list fits the most tiles its road can make.
pub(super) fn check_routed_shapes(
    op: &'static str,
    table: &ExpertTable,
    tiles: &ExpertTiles<'_>,
    x_len: usize,
    x_div: usize,
    y_len: usize,
) -> Result<(), CudaError> {
    let (pairs, cols, rows) = (tiles.pairs, table.cols, table.rows);
    ensure!(
        x_div >= 1 && pairs.is_multiple_of(x_div),
        op,
        "{pairs} pairs read x rows in steps of {x_div}"
    );
    ensure!(
        x_len == pairs / x_div * cols,
        op,
        "x has {x_len} values for {} rows of {cols}",
        pairs / x_div
    );
    ensure!(
        y_len == pairs * rows,
        op,
        "y has {y_len} values for {pairs} pairs of {rows}"
    );
    ensure!(
        tiles.order.len() >= pairs,
        op,
        "order has {} places for {pairs} pairs",
        tiles.order.len()
    );
    let max_tiles = max_tiles(pairs, table.experts, tiles.road.tile_rows());
    ensure!(
        tiles.tiles.len() > 3 * max_tiles,
        op,
        "a tile list of {} values for up to {max_tiles} tiles",
        tiles.tiles.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' grids are sized by `max_tiles`: it must bound the tiles of every way the
    /// pairs can fall on the experts (each expert's run cut into tiles of `tile_rows`).
    #[test]
    fn max_tiles_bounds_every_routing() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for road in [
            ExpertRoad::Decode,
            ExpertRoad::Matvec,
            ExpertRoad::TensorCores,
        ] {
            let t = road.tile_rows();
            for experts in [1, 2, 8, 128, 1024] {
                for pairs in [0, 1, 7, 8, 9, 64, 65, 300, 4096] {
                    let bound = max_tiles(pairs, experts, t);
                    // Spread evenly (the most partial tiles), all on one expert, and at random.
                    let even: Vec<usize> = (0..experts)
                        .map(|e| pairs / experts + usize::from(e < pairs % experts))
                        .collect();
                    let mut one = vec![0; experts];
                    one[0] = pairs;
                    let mut random = vec![0; experts];
                    for _ in 0..pairs {
                        random[next(experts)] += 1;
                    }
                    for counts in [even, one, random] {
                        let tiles: usize = counts.iter().map(|c| c.div_ceil(t)).sum();
                        assert!(
                            tiles <= bound,
                            "{road:?}: {tiles} tiles over {bound} ({pairs} pairs, {experts} experts)"
                        );
                    }
                }
            }
        }
    }
}
