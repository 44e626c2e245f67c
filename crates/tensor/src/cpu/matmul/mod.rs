//! `y = x · Wᵀ` for weights stored F32, BF16, F16 or in a ggml block-quantized format
//! (row-major `[n, k]`, as in a HF Linear).
//!
//! Quantized weights take another road (see [`super::quant_dot`]): the `m` activation rows are
//! quantized once into scratch as llama.cpp quantizes them, then integer kernels take the dot
//! products block by block. Decode streams the weights once; prefill keeps a block of
//! quantized activation rows in cache (for Q4_K and Q6_K with VNNI, interleaved into the wide
//! road's tiles) and runs each group of weight rows past all of it. Their float steps are
//! llama.cpp's for one row (a decode step), so a decode step gives llama.cpp's results to the
//! bit, and every row of a batch takes the same steps: a row's result never depends on the
//! rows beside it (where llama.cpp takes other kernels for batches, Q4_K rows in groups of four
//! and Q6_K products of eight rows or more, ember's prompts differ from llama.cpp's in their
//! last bits).
//!
//! Float weights: each output element is a dot product accumulated lane-wise over `k` in order, with one
//! fused multiply-add per lane and step and a masked tail, then summed by the fixed tree of
//! [`Simd::hsum`]. Decode (few rows) reads the stored weights directly, converting in
//! registers, so weight bandwidth is the only cost; prefill converts a small panel of weight
//! rows to f32 once and reuses it across a block of activation rows, so it runs at the FMA
//! units' rate. Both compute every element identically, which is what makes prefill and
//! decode, batched and alone, agree to the bit.

use super::mat_ref::{MatRef, WeightLayout};
use super::quant_dot::{self, ActJob, ActKind, ActLayout, QJob};
use super::simd::{Bf16, F16, Simd, WeightElem};
use super::{Isa, SharedPtr, simd_dispatch};
use crate::dtype::DType;
use crate::pool::ThreadPool;

/// Weight rows computed together: each activation vector loaded feeds this many FMAs.
const NR: usize = 6;
/// Activation rows computed together in prefill.
const MR: usize = 4;
/// How far ahead of its loads decode prefetches weights, at least.
const PREFETCH_BYTES: usize = 16 * 1024;
/// Bytes of activation rows a prefill block keeps in a core's L2 while panels stream past.
const ACTIVATION_BLOCK_BYTES: usize = 768 * 1024;

/// Quantized activation rows a prefill block keeps in a core's L2 while weight rows stream past.
const QUANT_ACTIVATION_BLOCK_BYTES: usize = 512 * 1024;
/// Below this many activation values, the calling thread quantizes them alone.
const QUANTIZE_ALONE: usize = 16 * 1024;

/// f32 elements of scratch [`matmul`] needs for up to `max_m` activation rows of `k` columns
/// on `n_threads` threads, whatever the weights' type: float panels for prefill, or the
/// quantized activation rows (with the wide road's tiles and unpacked weight rows).
pub fn matmul_scratch_len(n_threads: usize, max_m: usize, k: usize) -> usize {
    let float_panels = n_threads * NR * k;
    let quantized = QuantScratch::new(n_threads, max_m.max(1), ActLayout::max_stride(k), k).end;
    float_panels.max(quantized.div_ceil(4))
}

/// Where the quantized road's parts lie in scratch, in bytes from a 64-byte boundary: the
/// activation rows, the wide tiles, then each thread's panel.
struct QuantScratch {
    tiles: usize,
    panels: usize,
    panel_bytes: usize,
    /// Bytes needed from the scratch's start, 64 of them slack to align it.
    end: usize,
}

impl QuantScratch {
    fn new(n_threads: usize, m: usize, stride: usize, k: usize) -> QuantScratch {
        let tiles = m * stride;
        let panels = tiles + quant_dot::tiles_bytes(m, k);
        let panel_bytes = quant_dot::panel_bytes(k);
        QuantScratch {
            tiles,
            panels,
            panel_bytes,
            end: 64 + panels + n_threads * panel_bytes,
        }
    }
}

/// The kernels quantized products of `types` run with, chosen by measurement on first use:
/// `q4_k avx512-vnni x16, q6_k avx512-vnni`.
pub fn quant_kernels(types: &[DType]) -> String {
    quant_dot::kernel_summary(types)
}

/// What each quantized kernel candidate measured when the kernels were chosen.
pub fn quant_kernel_report() -> String {
    quant_dot::kernel_report()
}

/// `y[i, j] = Σ_p x[i, p] · w[j, p]` for `i < m`, `j < w.rows`, `p < w.cols`.
///
/// `scratch` holds at least [`matmul_scratch_len`]`(pool.n_threads(), m, k)` f32s (float
/// weights use it when `m > 4`, quantized weights always).
pub fn matmul(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    w: &MatRef<'_>,
    y: &mut [f32],
    scratch: &mut [f32],
) {
    let (n, k) = (w.rows, w.cols);
    check_shapes(x, m, k, std::iter::once((&*y, n)));
    if m == 0 || n == 0 {
        return;
    }
    if w.dtype.is_quantized() {
        matmul_quantized(pool, x, m, &[*w], &mut [y], scratch);
        return;
    }
    if m > MR {
        assert!(
            scratch.len() >= pool.n_threads() * NR * k,
            "matmul: scratch too small"
        );
    }
    let isa = Isa::detect();
    let x_ptr = SharedPtr(x.as_ptr() as *mut f32);
    let y_ptr = SharedPtr(y.as_mut_ptr());
    let scratch_ptr = SharedPtr(scratch.as_mut_ptr());
    let w_ptr = SharedPtr(w.data.as_ptr() as *mut u8);
    let dtype = w.dtype;
    let blocks = n.div_ceil(NR);
    pool.share(blocks, piece(pool, blocks), &|thread, blocks| {
        let rows = blocks.start * NR..(blocks.end * NR).min(n);
        let panel = SharedPtr(unsafe { scratch_ptr.get().add(thread * NR * k) });
        let job = Job {
            x: x_ptr,
            m,
            k,
            w: w_ptr,
            n,
            y: y_ptr,
            rows_start: rows.start,
            rows_end: rows.end,
            panel,
        };
        match dtype {
            DType::F32 => matmul_rows_f32(isa, job),
            DType::BF16 => matmul_rows_bf16(isa, job),
            DType::F16 => matmul_rows_f16(isa, job),
            _ => unreachable!("quantized weights take matmul_quantized"),
        }
    });
}

/// Panics unless `x` holds `m` rows of `k` and each output `(y, n)` `m` rows of `n`.
fn check_shapes<'y>(
    x: &[f32],
    m: usize,
    k: usize,
    outputs: impl Iterator<Item = (&'y [f32], usize)>,
) {
    assert!(
        x.len() >= m * k,
        "matmul: x has {} values, needs {m}×{k}",
        x.len()
    );
    for (y, n) in outputs {
        assert!(
            y.len() >= m * n,
            "matmul: y has {} values, needs {m}×{n}",
            y.len()
        );
    }
}

/// [`matmul`] for matrices that take the same input (q, k and v; gate and up): `ys[i] = x ·
/// ws[i]ᵀ`. Each run of neighbours that are quantized in one type, layout and width runs as
/// one share of the threads, the input quantized once (a decode step's small products cost
/// their synchronisation more than their reads; a Q4_K_M file's q and k go together, its Q6_K
/// v apart); the rest one product at a time. Every output's bits are [`matmul`]'s.
pub fn matmul_shared_input(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    ws: &[MatRef<'_>],
    ys: &mut [&mut [f32]],
    scratch: &mut [f32],
) {
    assert_eq!(
        ws.len(),
        ys.len(),
        "matmul_shared_input: a matrix an output"
    );
    let key = |w: &MatRef<'_>| (w.dtype, w.layout, w.cols);
    let mut start = 0;
    while start < ws.len() {
        let mut end = start + 1;
        if ws[start].dtype.is_quantized() {
            while end < ws.len() && key(&ws[end]) == key(&ws[start]) {
                end += 1;
            }
        }
        if end - start == 1 {
            matmul(pool, x, m, &ws[start], ys[start], scratch);
        } else {
            let outputs = ys[start..end].iter().map(|y| &**y);
            check_shapes(
                x,
                m,
                ws[start].cols,
                outputs.zip(ws[start..end].iter().map(|w| w.rows)),
            );
            if m > 0 {
                matmul_quantized(pool, x, m, &ws[start..end], &mut ys[start..end], scratch);
            }
        }
        start = end;
    }
}

/// The quantized road: quantize the activation rows once, then run the integer kernels, the
/// weight rows of every matrix of `ws` (one type, layout and width: they share the quantized
/// rows) split over the threads in groups of [`quant_dot::QR`], `ys[i]` taking `ws[i]`'s.
fn matmul_quantized(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    ws: &[MatRef<'_>],
    ys: &mut [&mut [f32]],
    scratch: &mut [f32],
) {
    let w = &ws[0];
    let k = w.cols;
    let interleaved = w.layout == WeightLayout::Interleaved16;
    let kind = match interleaved {
        true => ActKind::for_interleaved(w.dtype),
        false => ActKind::for_weights(w.dtype),
    };
    let layout = ActLayout::new(kind, k);
    let isa = Isa::detect();
    let qisa = quant_dot::choice(w.dtype).isa;
    let wide = quant_dot::wide_rows(qisa, w.dtype, m, interleaved);
    let places = if wide > 0 {
        QuantScratch::new(pool.n_threads(), m, layout.stride, k)
    } else {
        // Only the activation rows.
        QuantScratch::new(0, m, layout.stride, 0)
    };
    let scratch_bytes: &mut [u8] = bytemuck::cast_slice_mut(scratch);
    let offset = scratch_bytes.as_ptr().align_offset(64);
    assert!(
        scratch_bytes.len() >= offset + places.end - 64,
        "matmul: scratch too small for {m} quantized rows of {k}: give it matmul_scratch_len"
    );
    let acts = SharedPtr(scratch_bytes[offset..].as_mut_ptr());
    let at = |bytes: usize| SharedPtr(unsafe { acts.get().add(bytes) });
    let (tiles, panels) = (at(places.tiles), at(places.panels));
    let x_ptr = SharedPtr(x.as_ptr() as *mut f32);
    // Rows `rows` quantized, then the wide tiles among them: threads split the rows in whole
    // tiles, so each tile's rows are its own thread's.
    let quantize = |rows: (usize, usize)| {
        quant_dot::quantize_activations(
            isa,
            ActJob {
                x: x_ptr.get(),
                rows,
                layout,
                out: acts.get(),
            },
        );
        if wide > 0 {
            let tile_range = rows.0 / quant_dot::TM..rows.1.min(wide).div_ceil(quant_dot::TM);
            unsafe { quant_dot::build_tiles(&layout, acts.get(), wide, tile_range, tiles.get()) };
        }
    };
    if m * k <= QUANTIZE_ALONE || pool.n_threads() == 1 {
        quantize((0, m));
    } else {
        let units = m.div_ceil(quant_dot::TM);
        pool.share(units, piece(pool, units), &|_, units| {
            let rows = (
                units.start * quant_dot::TM,
                (units.end * quant_dot::TM).min(m),
            );
            quantize(rows);
        });
    }

    // Threads take whole tiles of weight rows, or whole interleaved groups, of the matrices
    // one after another: matrix i's groups are `starts[i]..starts[i + 1]`.
    let unit = if interleaved {
        quant_dot::X16
    } else {
        quant_dot::QR
    };
    let mut starts = Vec::with_capacity(ws.len() + 1);
    starts.push(0);
    for w in ws {
        starts.push(starts[starts.len() - 1] + w.rows.div_ceil(unit));
    }
    let groups = starts[ws.len()];
    let outputs: Vec<(usize, usize, SharedPtr<f32>)> = ws
        .iter()
        .zip(ys.iter_mut())
        .map(|(w, y)| (w.data.as_ptr() as usize, w.rows, SharedPtr(y.as_mut_ptr())))
        .collect();
    let block_rows = (QUANT_ACTIVATION_BLOCK_BYTES / layout.stride).max(quant_dot::QM)
        / quant_dot::QM
        * quant_dot::QM;
    let block_tiles =
        (QUANT_ACTIVATION_BLOCK_BYTES / quant_dot::tiles_bytes(quant_dot::TM, k)).max(1);
    let dtype = w.dtype;
    let row_bytes = dtype.row_bytes(k);
    pool.share(groups, piece(pool, groups), &|thread, groups| {
        for (i, &(w_ptr, n, y)) in outputs.iter().enumerate() {
            let (first, end) = (starts[i], starts[i + 1]);
            let (start, stop) = (groups.start.max(first), groups.end.min(end));
            if start >= stop {
                continue;
            }
            let rows = ((start - first) * unit, ((stop - first) * unit).min(n));
            quant_dot::quant_rows(
                qisa,
                dtype,
                QJob {
                    w: w_ptr as *const u8,
                    row_bytes,
                    n,
                    rows,
                    acts: acts.get(),
                    layout,
                    m,
                    block_rows,
                    y: y.get(),
                    wide,
                    tiles: tiles.get(),
                    panel: unsafe { panels.get().add(thread * places.panel_bytes) },
                    block_tiles,
                    interleaved,
                },
            );
        }
    });
}

/// Items of a product's piece: about [`PIECES_PER_THREAD`] pieces a thread, so that a thread
/// another process holds off its core leaves most of its share to the others, while a piece
/// stays long enough to stream its rows at full rate. A row's result never depends on its
/// piece, so neither do the bits.
fn piece(pool: &ThreadPool, items: usize) -> usize {
    items.div_ceil(pool.n_threads() * PIECES_PER_THREAD).max(1)
}

/// See [`piece`].
const PIECES_PER_THREAD: usize = 4;

/// One thread's share: weight rows `rows_start..rows_end` against every activation row.
#[derive(Clone, Copy)]
struct Job {
    x: SharedPtr<f32>,
    m: usize,
    k: usize,
    w: SharedPtr<u8>,
    n: usize,
    y: SharedPtr<f32>,
    rows_start: usize,
    rows_end: usize,
    panel: SharedPtr<f32>,
}

simd_dispatch!(fn matmul_rows_f32(job: Job) => rows_f32);
simd_dispatch!(fn matmul_rows_bf16(job: Job) => rows_bf16);
simd_dispatch!(fn matmul_rows_f16(job: Job) => rows_f16);

#[inline(always)]
unsafe fn rows_f32<S: Simd>(job: Job) {
    unsafe { matmul_rows::<S, f32>(job) }
}
#[inline(always)]
unsafe fn rows_bf16<S: Simd>(job: Job) {
    unsafe { matmul_rows::<S, Bf16>(job) }
}
#[inline(always)]
unsafe fn rows_f16<S: Simd>(job: Job) {
    unsafe { matmul_rows::<S, F16>(job) }
}

#[inline(always)]
unsafe fn matmul_rows<S: Simd, W: WeightElem>(job: Job) {
    let Job { m, k, n, .. } = job;
    let x = job.x.get() as *const f32;
    let w = job.w.get() as *const W;
    let y = job.y.get();
    let x_row = |i: usize| unsafe { x.add(i.min(m - 1) * k) };
    // A tile past the last row repeats it and its result is dropped: no extra code for edges.
    let w_row = |j: usize| unsafe { w.add(j.min(job.rows_end - 1) * k) };
    unsafe {
        if m == 1 {
            let mut j = job.rows_start;
            while j < job.rows_end {
                let out = tile::<S, W, 1, NR>([x_row(0)], std::array::from_fn(|c| w_row(j + c)), k);
                store_tile::<1, NR>(&out, y, n, 0, 1, j, job.rows_end);
                j += NR;
            }
        } else if m <= MR {
            let mut j = job.rows_start;
            while j < job.rows_end {
                let out = tile::<S, W, MR, NR>(
                    std::array::from_fn(x_row),
                    std::array::from_fn(|c| w_row(j + c)),
                    k,
                );
                store_tile::<MR, NR>(&out, y, n, 0, m, j, job.rows_end);
                j += NR;
            }
        } else {
            let panel = job.panel.get();
            let block_rows = (ACTIVATION_BLOCK_BYTES / (k * 4)).max(MR) / MR * MR;
            let mut i0 = 0;
            while i0 < m {
                let i_end = (i0 + block_rows).min(m);
                let mut j = job.rows_start;
                while j < job.rows_end {
                    // Convert NR weight rows to f32 once per activation block.
                    for r in 0..NR {
                        let src = w_row(j + r);
                        let dst = panel.add(r * k);
                        for p in 0..k {
                            *dst.add(p) = (*src.add(p)).to_f32();
                        }
                    }
                    let ws: [*const f32; NR] =
                        std::array::from_fn(|c| panel.add(c * k) as *const f32);
                    let mut i = i0;
                    while i < i_end {
                        let out =
                            tile::<S, f32, MR, NR>(std::array::from_fn(|r| x_row(i + r)), ws, k);
                        store_tile::<MR, NR>(&out, y, n, i, i_end, j, job.rows_end);
                        i += MR;
                    }
                    j += NR;
                }
                i0 = i_end;
            }
        }
    }
}

/// Writes the part of a tile that lies inside `rows < row_end`, `cols < col_end`.
#[inline(always)]
unsafe fn store_tile<const R: usize, const C: usize>(
    out: &[[f32; C]; R],
    y: *mut f32,
    n: usize,
    row: usize,
    row_end: usize,
    col: usize,
    col_end: usize,
) {
    for (r, values) in out.iter().enumerate() {
        if row + r >= row_end {
            break;
        }
        for (c, &value) in values.iter().enumerate() {
            if col + c < col_end {
                unsafe { *y.add((row + r) * n + col + c) = value };
            }
        }
    }
}

/// Dot products of `R` activation rows with `C` weight rows, `k` long.
#[inline(always)]
unsafe fn tile<S: Simd, W: WeightElem, const R: usize, const C: usize>(
    x: [*const f32; R],
    w: [*const W; C],
    k: usize,
) -> [[f32; C]; R] {
    unsafe {
        let mut acc = [[S::zero(); C]; R];
        let mut wv = [S::zero(); C];
        let full = k / S::LANES * S::LANES;
        // Decode streams each weight row once: ask for the same place in a later tile's rows,
        // which lie right after these (as the quantized kernels do; see
        // `quant_dot::prefetch_ahead`): at least one tile and `PREFETCH_BYTES` ahead.
        let tile_elements = C * k;
        let ahead = tile_elements
            * (PREFETCH_BYTES.div_ceil(tile_elements * std::mem::size_of::<W>())).max(1);
        let mut p = 0;
        while p < full {
            if R == 1 {
                for row in &w {
                    S::prefetch(row.add(p + ahead).cast());
                }
            }
            for c in 0..C {
                wv[c] = W::load::<S>(w[c].add(p));
            }
            for r in 0..R {
                let xv = S::load(x[r].add(p));
                for c in 0..C {
                    acc[r][c] = S::fma(xv, wv[c], acc[r][c]);
                }
            }
            p += S::LANES;
        }
        if p < k {
            let rest = k - p;
            for c in 0..C {
                wv[c] = W::load_partial::<S>(w[c].add(p), rest);
            }
            for r in 0..R {
                let xv = S::load_partial(x[r].add(p), rest);
                for c in 0..C {
                    acc[r][c] = S::fma(xv, wv[c], acc[r][c]);
                }
            }
        }
        let mut out = [[0f32; C]; R];
        for r in 0..R {
            for c in 0..C {
                out[r][c] = S::hsum(acc[r][c]);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
