//! Batch-invariant products on the tensor cores: `out = a · Wᵀ` where a row of `out` is the
//! same bits whatever other rows share the launch (see sliced_gemm.cu for how).

use super::device::launch;
use super::gemm::product_rows;
use super::kernels::{Float, Kernel};
use super::tensor_map::tensor_map;
use super::{
    CudaDevice, CudaError, DevMat, DevSlice, DevSliceMut, DeviceBuffer, FloatElem, config3, ensure,
    int,
};
use crate::buffer::{BufferKind, BufferOwner};
use cudarc::driver::sys as drv_sys;

/// Values a step of the kernel takes (`SG_STEP`): slices are whole steps.
const STEP: usize = 32;

/// Slice lengths the host picks from, longest first.
const SLICE_LENS: [usize; 5] = [2048, 1024, 512, 256, 128];

/// Blocks a row length is cut into slices for, at least: with 64-row tiles, about four per
/// multiprocessor of a large GPU, so a batch of one still has the weights' every byte in
/// flight from many blocks at once.
const SLICE_TARGET_BLOCKS: usize = 512;

/// Bytes of slice sums the split form may write ([`SlicedGemm`]'s scratch): a decode batch of
/// 64 over qwen3-8b's widest products takes 13 MiB.
const PARTIALS_BYTES: usize = 64 << 20;

/// The longest batch whose slices may run in blocks of their own.
const SPLIT_MOST_TOKENS: usize = 128;

/// Tickets of the split form: one per tile of a launch.
const TICKETS: usize = 8192;

/// The values a slice of `W [n, k]`'s rows takes: decided by the matrix alone, never the
/// batch, since it fixes the order of every sum. The longest of [`SLICE_LENS`] that still cuts
/// the matrix into [`SLICE_TARGET_BLOCKS`] 64-row slices, else the shortest.
pub fn slice_len(n: usize, k: usize) -> usize {
    let tiles = n.div_ceil(64);
    SLICE_LENS
        .into_iter()
        .find(|&s| tiles * k.div_ceil(s) >= SLICE_TARGET_BLOCKS)
        .unwrap_or(SLICE_LENS[SLICE_LENS.len() - 1])
}

/// A block's tile: 16·WM·WARPS_M weight rows by 8·WN·WARPS_N tokens, `stages` deep (the
/// `SLICED_GEMM_ALL` table in sliced_gemm.cu). The `Wg` tiles multiply by Hopper's warpgroup
/// instructions (wgmma), which only compute capability 9.0 runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlicedTile {
    M128N8K2,
    M64N16K4,
    M64N32K4,
    M64N64W8K4,
    M128N64K2,
    M128N128K2,
    M128N128W16K2,
    Tma128N128K2,
}

impl SlicedTile {
    pub const ALL: [SlicedTile; 8] = [
        SlicedTile::M128N8K2,
        SlicedTile::M64N16K4,
        SlicedTile::M64N32K4,
        SlicedTile::M64N64W8K4,
        SlicedTile::M128N64K2,
        SlicedTile::M128N128K2,
        SlicedTile::M128N128W16K2,
        SlicedTile::Tma128N128K2,
    ];

    /// Whether the tile multiplies by wgmma (sm_90a), not mma.sync (sm_80 and later). On an
    /// H100 the TMA tile took 136 µs for qwen3-8b's q/o at 2,048 tokens against the best
    /// mma.sync tile's 249 (gate/up 421 against 774), the same bits.
    pub fn is_wgmma(self) -> bool {
        self == SlicedTile::Tma128N128K2
    }

    /// Whether the tensor memory accelerator fills the tile's stages, asked by a warp of its
    /// own while two warpgroups only multiply, buffers handed over by mbarriers
    /// (`SLICED_GEMM_TMA_KERNEL`): the kernel takes tensor maps of W and x
    /// ([`TmaKernelArgs`]), and has no split form.
    pub fn uses_tma(self) -> bool {
        self == SlicedTile::Tma128N128K2
    }

    /// The table in sliced_gemm.cu that defines the tile's kernels.
    pub fn kernel_table(self) -> &'static str {
        if self.uses_tma() {
            "SLICED_GEMM_TMA_KERNEL"
        } else {
            "SLICED_GEMM_KERNEL"
        }
    }

    /// Whether the tile's slices may run in blocks of their own (`_split`).
    pub fn splits(self) -> bool {
        !self.uses_tma()
    }

    /// Whether a device of compute capability `cc` runs the tile. wgmma is one of sm_90's
    /// architecture-specific features: no later architecture has it.
    pub fn runs_on(self, cc: (i32, i32)) -> bool {
        !self.is_wgmma() || cc == (9, 0)
    }

    /// `(weight rows, tokens, warps, stages, steps a stage)`.
    fn shape(self) -> (usize, usize, usize, usize, usize) {
        match self {
            SlicedTile::M128N8K2 => (128, 8, 8, 4, 2),
            SlicedTile::M64N16K4 => (64, 16, 4, 4, 4),
            SlicedTile::M64N32K4 => (64, 32, 4, 3, 4),
            SlicedTile::M64N64W8K4 => (64, 64, 8, 3, 4),
            SlicedTile::M128N64K2 => (128, 64, 8, 4, 2),
            SlicedTile::M128N128K2 => (128, 128, 8, 3, 2),
            SlicedTile::M128N128W16K2 => (128, 128, 16, 3, 2),
            // 8 multiplying warps, 1 asking the TMA.
            SlicedTile::Tma128N128K2 => (128, 128, 9, 6, 2),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SlicedTile::M128N8K2 => "m128n8k2",
            SlicedTile::M64N16K4 => "m64n16k4",
            SlicedTile::M64N32K4 => "m64n32k4",
            SlicedTile::M64N64W8K4 => "m64n64w8k4",
            SlicedTile::M128N64K2 => "m128n64k2",
            SlicedTile::M128N128K2 => "m128n128k2",
            SlicedTile::M128N128W16K2 => "m128n128w16k2",
            SlicedTile::Tma128N128K2 => "tma128n128k2",
        }
    }

    /// The tile for a batch of `m` tokens of `n`-row weights on `sms` multiprocessors where the
    /// shape was not timed on the device ([`SlicedGemm::tune`]): the fastest of a sweep of 16
    /// shapes at qwen3-8b's products on an H100 (`cuda_probe products`, December 2026, before the
    /// kernel's staging and ldmatrix changes, which sped up every tile: re-sweep before moving a
    /// boundary). Up to 8 tokens: 128 weight rows of 8 warps, stages of 64 values (q/o 14.8 µs at
    /// one token against cuBLASLt's 16.5); up to 256: 64 rows of 8 warps by 64 tokens, stages of
    /// 128 values (q/o 30.8 µs at 64 tokens, cuBLASLt 15.6); beyond, 128 by 128 for the reuse where
    /// that still makes half as many blocks as multiprocessors (q/o at 512 tokens 96 µs against
    /// 132), else 64 by 64 (k/v's 1024 rows at 512 tokens: 47 µs against 103).
    fn for_batch(m: usize, n: usize, sms: usize) -> SlicedTile {
        match m {
            0..=8 => SlicedTile::M128N8K2,
            9..=16 => SlicedTile::M64N16K4,
            17..=32 => SlicedTile::M64N32K4,
            33..=256 => SlicedTile::M64N64W8K4,
            _ if n.div_ceil(128) * m.div_ceil(128) >= sms / 2 => SlicedTile::M128N128K2,
            _ => SlicedTile::M64N64W8K4,
        }
    }

    /// Whether timing this tile for a batch of `m` is worth it: a tile of fewer than 1/16 of
    /// the batch's tokens reads every weight 16 times or more (from L2), and measured several
    /// times slower than the wide tiles there (qwen3-8b's q/o at 2048 tokens on an H100: 8
    /// tokens 1,107 µs, 128 tokens 276).
    fn worth_timing(self, m: usize) -> bool {
        self.shape().1 * 16 >= m
    }

    /// Shared memory a block takes: its stages of weight and token rows, 64 bytes a step each,
    /// and a TMA tile's two mbarriers a stage after them.
    pub fn smem_bytes(self) -> usize {
        let (rows, tokens, _, stages, steps) = self.shape();
        let barriers = if self.uses_tma() { 2 * stages * 8 } else { 0 };
        stages * (rows + tokens) * steps * STEP * 2 + barriers
    }
}

/// A product's tile as timed on the device ([`SlicedGemm::tune`]): for `[n, k]` weights and
/// batches of up to `most_rows` rows (above the tuned batch before), `tile`, its slices split
/// across blocks or not; `us` a product took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TunedPlan {
    pub n: usize,
    pub k: usize,
    pub most_rows: usize,
    pub tile: SlicedTile,
    pub split: bool,
    pub us: f64,
}

/// Outputs one launch may write (`SG_MAX_OUTS`): q, k and v.
pub const MAX_OUTPUTS: usize = 3;

/// Where a run of the weights' rows goes, field for field `SlicedOut` in sliced_gemm.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct OutArgs {
    y: u64,
    first: i32,
    width: i32,
}

/// The kernel's one argument, field for field `SlicedGemmArgs` in sliced_gemm.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KernelArgs {
    w: u64,
    x: u64,
    partials: u64,
    tickets: u64,
    out: [OutArgs; MAX_OUTPUTS],
    outs: i32,
    m: i32,
    n: i32,
    k: i32,
    slice: i32,
    slices: i32,
    accumulate: i32,
    out_bf16: i32,
}
const _: () = assert!(size_of::<KernelArgs>() == 112);

/// The TMA tile's argument, field for field `SlicedTmaArgs` in sliced_gemm.cu: tensor maps of
/// W and x, then the others' argument.
#[repr(C)]
#[derive(Clone, Copy)]
struct TmaKernelArgs {
    w_map: drv_sys::CUtensorMap,
    x_map: drv_sys::CUtensorMap,
    args: KernelArgs,
}
const _: () = assert!(size_of::<TmaKernelArgs>() == 384);

/// Values and rows of the boxes the TMA tile asks for (`SG_STEP · KS` by its 128 rows).
const TMA_BOX: (u32, u32) = (64, 128);

/// Runs `out = a · Wᵀ` (or `out += a · Wᵀ`) for 16-bit activations `a [m, k]` and weights
/// `W [n, k]` of the same type into f32 or bf16 `out [m, n]`, each row's sums in one fixed
/// order for every `m` (so decode batches, prompt chunks and a request alone agree to the bit).
///
/// Holds the split form's scratch (slice sums and tickets), listed by the buffer owner.
pub struct SlicedGemm {
    device: CudaDevice,
    partials: DeviceBuffer,
    tickets: DeviceBuffer,
    forced: Option<(SlicedTile, bool)>,
    /// Choices timed on this device ([`Self::tune`]), ahead of the built-in plan.
    tuned: Vec<TunedPlan>,
}

impl std::fmt::Debug for SlicedGemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlicedGemm")
            .field("device", &self.device.ordinal())
            .field("partials", &self.partials.len())
            .finish()
    }
}

impl SlicedGemm {
    pub fn new(device: &CudaDevice, owner: &BufferOwner) -> Result<SlicedGemm, CudaError> {
        let partials = owner.alloc_device(
            BufferKind::Scratch,
            "sliced gemm sums",
            device,
            PARTIALS_BYTES,
        )?;
        let mut tickets = owner.alloc_device(
            BufferKind::Scratch,
            "sliced gemm tickets",
            device,
            TICKETS * 4,
        )?;
        device.fill_bytes(&mut tickets.as_mut_slice::<u32>(), 0)?;
        Ok(SlicedGemm {
            device: device.clone(),
            partials,
            tickets,
            forced: None,
            tuned: Vec::new(),
        })
    }

    /// The tiles this device runs.
    pub fn tiles(&self) -> Vec<SlicedTile> {
        let cc = self.device.info().compute_capability;
        SlicedTile::ALL
            .into_iter()
            .filter(|t| t.runs_on(cc))
            .collect()
    }

    /// Runs every later product with `tile`, its slices split across blocks or not (where the
    /// split's sums fit), instead of the plan for its batch; `None` goes back to planning. For
    /// benchmarks and tests: every tile and form gives the same bits.
    pub fn force_tile(&mut self, forced: Option<(SlicedTile, bool)>) {
        self.forced = forced;
    }

    /// Times every tile, split and not, on `matrices` (all of one shape `[n, k]`: a model's
    /// layers' matrices of one role, so that the weights stream from memory as in a pass)
    /// for each batch of `batches` (rising), and keeps the fastest for products of that
    /// shape up to that batch (over the last, the last's). Tiles never change a result's
    /// bits, only its time, so the plan may follow the device it runs on. `input` holds
    /// `k` values for the largest batch, `out` `n`.
    pub fn tune<A: FloatElem>(
        &mut self,
        matrices: &[DevMat<'_>],
        input: DevSlice<'_, A>,
        out: &mut DevSliceMut<'_, f32>,
        batches: &[usize],
    ) -> Result<Vec<TunedPlan>, CudaError> {
        const OP: &str = "sliced_gemm tune";
        let Some(first) = matrices.first() else {
            return Ok(Vec::new());
        };
        let (n, k) = (first.rows, first.cols);
        ensure!(
            matrices.iter().all(|w| (w.rows, w.cols) == (n, k)),
            OP,
            "matrices of one shape ({n}×{k} first)"
        );
        ensure!(
            batches.is_sorted() && batches.first().is_some_and(|&m| m > 0),
            OP,
            "rising batches of at least one row, not {batches:?}"
        );
        let most = batches.last().copied().unwrap_or(0);
        ensure!(
            input.len() >= most * k && out.len() >= most * n,
            OP,
            "{} inputs and {} outputs for {most} rows of {n}×{k}",
            input.len(),
            out.len()
        );
        let forced = self.forced.take();
        self.tuned.retain(|t| (t.n, t.k) != (n, k));
        let partials = self.partials.len() / 4;
        let sms = self.device.info().multiprocessors;
        let device = self.device.clone();
        let mut found = Vec::with_capacity(batches.len());
        let timed = (|| {
            for &m in batches {
                let a = input.slice(0..m * k);
                let mut y = out.slice_mut(0..m * n);
                let mut best: Option<TunedPlan> = None;
                for tile in self.tiles().into_iter().filter(|t| t.worth_timing(m)) {
                    for split in [false, true] {
                        // A split the sums do not fit runs unsplit: timed already.
                        let plan =
                            plan(m, n, k, sms, partials).with_tile(tile, split, m, n, partials);
                        if plan.split != split {
                            continue;
                        }
                        self.forced = Some((tile, split));
                        // Once untimed (the first launch of a kernel loads it), then once over
                        // each matrix.
                        self.matmul(a, &matrices[0], &mut y, false)?;
                        let ms = device.time_ms(|| {
                            for w in matrices {
                                self.matmul(a, w, &mut y, false)?;
                            }
                            Ok(())
                        })?;
                        let us = f64::from(ms) * 1e3 / matrices.len() as f64;
                        if best.is_none_or(|b| us < b.us) {
                            best = Some(TunedPlan {
                                n,
                                k,
                                most_rows: m,
                                tile,
                                split,
                                us,
                            });
                        }
                    }
                }
                found.extend(best);
            }
            Ok(())
        })();
        self.forced = forced;
        timed?;
        self.tuned.extend_from_slice(&found);
        Ok(found)
    }

    /// `out = a · Wᵀ`, or `out += a · Wᵀ` with `accumulate`. `a` has `w.cols` values per row
    /// (a multiple of 8); `out` has `w.rows`.
    ///
    /// `w` is a weight: the kernel starts reading it before the kernel launched just before
    /// has finished (programmatic dependent launch), so nothing in flight may write it.
    pub fn matmul<A: FloatElem, O: FloatElem>(
        &mut self,
        a: DevSlice<'_, A>,
        w: &DevMat<'_>,
        out: &mut DevSliceMut<'_, O>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let m = product_rows("sliced_gemm", &a, w, out)?;
        let mut outs = [OutArgs::default(); MAX_OUTPUTS];
        outs[0] = OutArgs {
            y: out.device_ptr(),
            first: 0,
            width: int("sliced_gemm", "n", w.rows)?,
        };
        self.run::<A, O>(a, w, m, &outs[..1], accumulate)
    }

    /// [`Self::matmul`] for matrices sharing the input `a` with their rows end to end in `w`
    /// (q, k and v as one launch): `outs[i]` takes `rows[i]` of them, `[m, rows[i]]`, in
    /// order. Each row's sums are those `w` alone gives it.
    pub fn matmul_parts<A: FloatElem, O: FloatElem>(
        &mut self,
        a: DevSlice<'_, A>,
        w: &DevMat<'_>,
        outs: &mut [DevSliceMut<'_, O>],
        rows: &[usize],
        accumulate: bool,
    ) -> Result<(), CudaError> {
        const OP: &str = "sliced_gemm";
        ensure!(
            (1..=MAX_OUTPUTS).contains(&outs.len()) && rows.len() == outs.len(),
            OP,
            "{} outputs of {} row counts (1 to {MAX_OUTPUTS})",
            outs.len(),
            rows.len()
        );
        ensure!(
            rows.iter().sum::<usize>() == w.rows,
            OP,
            "outputs of {rows:?} rows from a matrix of {}",
            w.rows
        );
        ensure!(
            w.cols > 0 && a.len().is_multiple_of(w.cols),
            OP,
            "{} activations in rows of {}",
            a.len(),
            w.cols
        );
        let m = a.len() / w.cols;
        let mut args = [OutArgs::default(); MAX_OUTPUTS];
        let mut first = 0;
        for (i, (out, &r)) in outs.iter_mut().zip(rows).enumerate() {
            ensure!(
                out.len() == m * r,
                OP,
                "output {i} of {} values for {m}×{r}",
                out.len()
            );
            args[i] = OutArgs {
                y: out.device_ptr(),
                first: int(OP, "first row", first)?,
                width: int(OP, "rows", r)?,
            };
            first += r;
        }
        self.run::<A, O>(a, w, m, &args[..outs.len()], accumulate)
    }

    fn run<A: FloatElem, O: FloatElem>(
        &mut self,
        a: DevSlice<'_, A>,
        w: &DevMat<'_>,
        m: usize,
        outs: &[OutArgs],
        accumulate: bool,
    ) -> Result<(), CudaError> {
        const OP: &str = "sliced_gemm";
        let input = A::FLOAT;
        ensure!(
            input != Float::F32 && w.dtype == input,
            OP,
            "activations {input} and weights {} (both bf16 or both f16)",
            w.dtype
        );
        ensure!(O::FLOAT != Float::F16, OP, "f16 output (f32 or bf16 only)");
        let (n, k) = (w.rows, w.cols);
        ensure!(
            k.is_multiple_of(8),
            OP,
            "rows of {k} values (a multiple of 8: 16-byte pieces)"
        );
        ensure!(
            [w.data.device_ptr(), a.device_ptr()]
                .iter()
                .all(|p| p.is_multiple_of(16)),
            OP,
            "weights and activations starting on 16 bytes"
        );
        if m == 0 || n == 0 {
            return Ok(());
        }
        let partials = self.partials.len() / 4;
        let mut plan = plan(m, n, k, self.device.info().multiprocessors, partials);
        if let Some((tile, split)) = self.forced.or_else(|| tuned_choice(&self.tuned, m, n, k)) {
            plan = plan.with_tile(tile, split, m, n, partials);
        }
        let cc = self.device.info().compute_capability;
        ensure!(
            plan.tile.runs_on(cc),
            OP,
            "tile {} on a device of compute capability {}.{}",
            plan.tile.name(),
            cc.0,
            cc.1
        );
        let mut out = [OutArgs::default(); MAX_OUTPUTS];
        out[..outs.len()].copy_from_slice(outs);
        let mut args = KernelArgs {
            w: w.data.device_ptr(),
            x: a.device_ptr(),
            partials: self.partials.device_ptr(),
            tickets: self.tickets.device_ptr(),
            out,
            outs: outs.len() as i32,
            m: int(OP, "m", m)?,
            n: int(OP, "n", n)?,
            k: int(OP, "k", k)?,
            slice: int(OP, "slice", plan.slice)?,
            slices: int(OP, "slices", plan.slices)?,
            accumulate: i32::from(accumulate),
            out_bf16: i32::from(O::FLOAT == Float::Bf16),
        };
        if !plan.split {
            args.partials = 0;
            args.tickets = 0;
        }
        let kernel = Kernel::SlicedGemm {
            weights: input,
            tile: plan.tile,
            split: plan.split,
        };
        let (_, _, warps, ..) = plan.tile.shape();
        let grid = (
            int(OP, "row tiles", plan.grid.0)? as u32,
            int(OP, "token tiles", plan.grid.1)? as u32,
            if plan.split { plan.slices as u32 } else { 1 },
        );
        let config = config3(grid, (warps * 32) as u32, plan.tile.smem_bytes());
        if plan.tile.uses_tma() {
            let tma = TmaKernelArgs {
                w_map: tensor_map(input, args.w, n, k, TMA_BOX)?,
                x_map: tensor_map(input, args.x, m, k, TMA_BOX)?,
                args,
            };
            return launch!(self.device, kernel, config; tma);
        }
        launch!(self.device, kernel, config; args)
    }
}

/// The tuned choice for `m` rows of `[n, k]`: that of the least tuned batch of at least `m`
/// rows, else of the largest; none where the shape was not tuned.
fn tuned_choice(tuned: &[TunedPlan], m: usize, n: usize, k: usize) -> Option<(SlicedTile, bool)> {
    let shape = || tuned.iter().filter(|t| (t.n, t.k) == (n, k));
    shape()
        .filter(|t| t.most_rows >= m)
        .min_by_key(|t| t.most_rows)
        .or_else(|| shape().max_by_key(|t| t.most_rows))
        .map(|t| (t.tile, t.split))
}

/// How one product runs: its tile, its slices, whether they run in blocks of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    tile: SlicedTile,
    slice: usize,
    slices: usize,
    /// Row tiles, token tiles.
    grid: (usize, usize),
    split: bool,
}

impl Plan {
    /// This plan's slices with `tile`, split where asked and the sums fit.
    fn with_tile(self, tile: SlicedTile, split: bool, m: usize, n: usize, partials: usize) -> Plan {
        let (rows, tokens, ..) = tile.shape();
        let grid = (n.div_ceil(rows), m.div_ceil(tokens));
        let split = split
            && tile.splits()
            && self.slices > 1
            && grid.0 * grid.1 <= TICKETS
            && self.slices * m * n <= partials;
        Plan {
            tile,
            grid,
            split,
            ..self
        }
    }
}

/// The plan for `[m, k] · [n, k]ᵀ` on a device of `sms` multiprocessors with room for
/// `partials` slice sums. Only the slice length enters the arithmetic, and it depends on the
/// matrix alone; the tile and the split are free to follow the batch.
fn plan(m: usize, n: usize, k: usize, sms: usize, partials: usize) -> Plan {
    let tile = SlicedTile::for_batch(m, n, sms);
    let (rows, tokens, ..) = tile.shape();
    let grid = (n.div_ceil(rows), m.div_ceil(tokens));
    let slice = slice_len(n, k);
    let slices = k.div_ceil(slice);
    // Slices in blocks of their own when the tiles alone would leave the device half idle and
    // the batch is short enough that writing and reading back its slice sums costs less than
    // the idle time (measured: 256 tokens run faster unsplit even on 64 blocks), and the sums
    // fit.
    let split = slices > 1
        && grid.0 * grid.1 < 2 * sms
        && m <= SPLIT_MOST_TOKENS
        && grid.0 * grid.1 <= TICKETS
        && slices * m * n <= partials;
    Plan {
        tile,
        slice,
        slices,
        grid,
        split,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::Module;

    #[test]
    fn constants_match_the_kernel() {
        assert_eq!(Module::SlicedGemm.define("SG_STEP"), STEP);
        assert_eq!(Module::SlicedGemm.define("SG_MAX_OUTS"), MAX_OUTPUTS);
        assert!(SLICE_LENS.iter().all(|s| s.is_multiple_of(STEP)));
        // Every tile fits the shared memory a block can have where it runs (sm_86: 99 KiB;
        // sm_90: 227 KiB), and its steps a stage divide every slice.
        for tile in SlicedTile::ALL {
            let most = if tile.is_wgmma() { 227 << 10 } else { 99 << 10 };
            assert!(tile.smem_bytes() <= most, "{tile:?}");
            let steps = tile.shape().4;
            assert!(SLICE_LENS.iter().all(|s| (s / STEP).is_multiple_of(steps)));
        }
    }

    /// The host's tile shapes (grid, threads, shared memory) are the kernel's.
    #[test]
    fn tiles_match_the_kernel_table() {
        let source = Module::SlicedGemm.source();
        let producers = Module::SlicedGemm.define("SG_TMA_PRODUCER_WARPS");
        for tile in SlicedTile::ALL {
            let prefix = format!("{}(tname, T, {}, ", tile.kernel_table(), tile.name());
            let line = source
                .lines()
                .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
                .unwrap_or_else(|| panic!("no {tile:?} in sliced_gemm.cu"));
            let v: Vec<usize> = line
                .trim_end_matches([')', '\\', ' '])
                .split(',')
                .map(|x| x.trim().parse().unwrap())
                .collect();
            let [wm, wn, warps_m, warps_n, stages, steps] = v[..] else {
                panic!("{tile:?}: {line}")
            };
            // A TMA tile's table gives its multiplying warps.
            let staging = if tile.uses_tma() { producers } else { 0 };
            let shape = (
                16 * wm * warps_m,
                8 * wn * warps_n,
                warps_m * warps_n + staging,
                stages,
                steps,
            );
            assert_eq!(tile.shape(), shape, "{tile:?}");
        }
    }

    #[test]
    fn slices_follow_the_matrix_never_the_batch() {
        // qwen3-8b: q and o, k and v, gate and up, down, the head.
        assert_eq!(slice_len(4096, 4096), 512);
        assert_eq!(slice_len(1024, 4096), 128);
        assert_eq!(slice_len(12288, 4096), 1024);
        assert_eq!(slice_len(4096, 12288), 1024);
        assert_eq!(slice_len(151_936, 4096), 2048);
        let sms = 132;
        for (n, k) in [(4096, 4096), (1024, 4096), (4096, 12288), (151_936, 1024)] {
            let slice = slice_len(n, k);
            for m in [1, 3, 8, 9, 33, 64, 65, 200, 512, 4096] {
                for partials in [0, PARTIALS_BYTES / 4] {
                    let p = plan(m, n, k, sms, partials);
                    assert_eq!((p.slice, p.slices), (slice, k.div_ceil(slice)));
                }
            }
        }
    }

    #[test]
    fn a_batch_takes_the_choice_tuned_at_the_least_batch_not_below_it() {
        let at = |most_rows, tile| TunedPlan {
            n: 4096,
            k: 4096,
            most_rows,
            tile,
            split: most_rows == 1,
            us: 1.0,
        };
        let tuned = [
            at(1, SlicedTile::M128N8K2),
            at(16, SlicedTile::M64N16K4),
            at(256, SlicedTile::M64N64W8K4),
            at(2048, SlicedTile::M128N128W16K2),
        ];
        let choice = |m| tuned_choice(&tuned, m, 4096, 4096);
        assert_eq!(choice(1), Some((SlicedTile::M128N8K2, true)));
        assert_eq!(choice(2), Some((SlicedTile::M64N16K4, false)));
        assert_eq!(choice(16), Some((SlicedTile::M64N16K4, false)));
        assert_eq!(choice(17), Some((SlicedTile::M64N64W8K4, false)));
        assert_eq!(choice(2048), Some((SlicedTile::M128N128W16K2, false)));
        // Past the largest tuned batch, the largest's choice; another shape, none.
        assert_eq!(choice(4096), Some((SlicedTile::M128N128W16K2, false)));
        assert_eq!(tuned_choice(&tuned, 1, 1024, 4096), None);
    }

    #[test]
    fn wide_batches_time_only_wide_tiles() {
        assert!(SlicedTile::ALL.iter().all(|t| t.worth_timing(1)));
        assert!(SlicedTile::M128N8K2.worth_timing(128));
        assert!(!SlicedTile::M128N8K2.worth_timing(129));
        assert!(SlicedTile::M128N128K2.worth_timing(2048));
        assert!(!SlicedTile::M64N32K4.worth_timing(2048));
    }

    #[test]
    fn short_batches_split_their_slices_long_ones_do_not() {
        let sms = 132;
        let decode = plan(1, 4096, 4096, sms, PARTIALS_BYTES / 4);
        assert_eq!(decode.tile, SlicedTile::M128N8K2);
        assert!(decode.split);
        assert_eq!(decode.grid, (32, 1));
        // gate/up's 12288 rows fill the device at 128 tokens without splitting.
        let wide = plan(128, 12288, 4096, sms, PARTIALS_BYTES / 4);
        assert_eq!(
            (wide.tile, wide.grid, wide.split),
            (SlicedTile::M64N64W8K4, (192, 2), false)
        );
        let prompt = plan(2048, 4096, 4096, sms, PARTIALS_BYTES / 4);
        assert_eq!(prompt.tile, SlicedTile::M128N128K2);
        assert!(!prompt.split);
        assert!(!plan(256, 1024, 4096, sms, PARTIALS_BYTES / 4).split);
        // k/v's 1024 rows: too few 128-row blocks at 512 tokens, enough at 2048.
        assert_eq!(plan(512, 1024, 4096, sms, 0).tile, SlicedTile::M64N64W8K4);
        assert_eq!(plan(2048, 1024, 4096, sms, 0).tile, SlicedTile::M128N128K2);
        // Without room for the sums the slices run in order inside each block: same bits.
        assert!(!plan(1, 4096, 4096, sms, 0).split);
    }
}
