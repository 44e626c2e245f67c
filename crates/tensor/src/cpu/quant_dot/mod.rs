//! Integer dot products of ggml block-quantized weight rows with quantized activation rows.
//!
//! A kernel computes [`QR`] weight rows against one or [`QM`] activation rows at a time. For
//! each block (a pair of 32-element blocks, or one 256-element super-block) it forms every
//! (weight row, activation row) integer sum exactly — `vpdpbusd`/`vpdpwssd` with AVX-512 VNNI,
//! `vpmaddubsw` + `vpmaddwd` without — reduces them so that one f32 lane holds one weight row,
//! and only then applies the float scales:
//!
//! | weights     | activations | per block, f32, added to the row's sum in block order       |
//! |-------------|-------------|-------------------------------------------------------------|
//! | Q8_0, Q4_0  | Q8_0        | `(dw·dx)·S`                                                  |
//! | Q4_1        | Q8_1        | llama.cpp's eight lanes ([`tiles::tile_q41`])                |
//! | Q5_K        | Q8_K        | `(dw·dx)·Σ sc·S − (dminw·dx)·Σ m·bsum`                       |
//! | Q4_K        | Q8_K        | llama.cpp's one-row fused steps ([`tiles::tile_q45k`])      |
//! | Q6_K        | Q8_K        | llama.cpp's one-row eight lanes ([`tiles::tile_q6k`])       |
//!
//! One formula per weight type, for every activation row, whatever the batch size, the row's
//! place in it, the instruction set, the tile shape or the thread count: a row's result is the
//! same bits alone (a decode step) as inside a prompt chunk of any size, which is what lets a
//! prompt resume from a cache computed in other chunks, or a reply computed token by token,
//! give the bits of a cold run. Q4_1, Q4_K and Q6_K take llama.cpp's formula for one row (a
//! decode step, what most tokens go through), so a decode step's products are llama.cpp's to
//! the bit; llama.cpp itself takes other kernels for batches (Q4_K rows in groups of four fuse
//! per 64 values, Q6_K products of eight rows or more sum a super-block at once), so ember's
//! prompt rows differ from llama.cpp's in their last bits. Q8_0, Q4_0 and Q5_K keep ember's
//! own order.
//!
//! Prefill of Q4_K and Q6_K rows takes the wide road with VNNI ([`wide_rows`]): the same
//! integer sums and float steps, lane for lane, with one lane per activation row instead of per
//! weight row, so that no integer sum needs reducing across lanes. For Q6_K that costs more
//! than llama.cpp's batched formula would (each four values need their own scale: see
//! [`wide::wide_q6k`]); it is the price of one formula.
//!
//! Integer sums are exact and every float operation is a lane-wise IEEE multiply, add,
//! subtract or fused multiply-add in a fixed order, so an output is bit-identical whatever
//! the road.
//!
//! The files, by job: [`act`] quantizes activation rows into the layouts the kernels read;
//! [`qv`] is the vector operations the kernels are written in, implemented by [`portable`],
//! `avx2` and `avx512`; [`tiles`] holds each weight type's tile; [`wide`] the wide road;
//! [`rows`] one thread's share of a product, and the dispatch by type and instruction set;
//! [`x16`] Q4_K, Q5_K, Q8_0, Q4_0, Q4_1 and Q6_K weights interleaved sixteen rows at a time and
//! their kernels; [`choice`] which set and layout each type runs with, by measurement.

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod choice;
mod portable;
mod qv;
mod rows;
#[cfg(test)]
pub(crate) mod tests;
mod tiles;
mod wide;
mod x16;

pub(crate) use act::{ActJob, ActKind, ActLayout, quantize_activations};
pub(crate) use choice::{choice, report as kernel_report, summary as kernel_summary};
pub(crate) use rows::{QJob, quant_rows};
pub(crate) use wide::{TM, build_tiles, panel_bytes, tiles_bytes, wide_rows};
pub(crate) use x16::{X16, interleave, interleaves, plain_row};

/// Weight rows computed together: one f32 lane each.
pub(crate) const QR: usize = 8;
/// Activation rows computed together in prefill.
pub(crate) const QM: usize = 4;
/// How far ahead decode prefetches each weight row: to the same place in a later tile's rows,
/// which lie right after this tile's (a thread's rows are one contiguous stretch). At least
/// two tiles and [`PREFETCH_MIN_BYTES`] ahead: enough requests in flight to cover the memory
/// latency whatever the row length. One tile ahead streamed 1536-wide rows 10% slower than
/// 8960-wide ones, and 576-wide rows (a 135M model's) 20% slower than with four tiles.
#[inline(always)]
pub(super) fn prefetch_ahead(row_bytes: usize) -> usize {
    let tile = QR * row_bytes;
    tile * PREFETCH_MIN_BYTES.div_ceil(tile).max(2)
}

/// See [`prefetch_ahead`].
const PREFETCH_MIN_BYTES: usize = 16 * 1024;
