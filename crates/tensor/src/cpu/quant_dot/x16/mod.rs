//! Weights interleaved sixteen rows at a time (Q4_K, Q5_K, Q8_0, Q4_0, Q4_1, Q6_K), for kernels
//! that hold one weight row per i32 lane.
//!
//! The row-by-row tiles ([`super::tiles`]) sum each weight row in a vector of its own and
//! reduce eight such vectors across lanes per block and activation row. Interleaved, four
//! values of each of sixteen rows fill one 64-byte vector, an activation's four values are
//! broadcast to every lane (`vpdpbusd` with a broadcast operand), and lane `r` accumulates
//! row `r`'s sums as they are: no reduction, no shuffles. A group of 16 rows keeps the bytes
//! of its plain rows (Q8_0's values offset to unsigned bytes), block by block (Q8_0 and Q4_0: a
//! pair of blocks at a time); each type's file says how they lie.
//!
//! Per row, the integer sums are exact and the float steps are those of the type's tile in
//! [`super::tiles`], lane for lane: a row gives the same bits interleaved or not, alone or in
//! any batch, on the VNNI kernel, the AVX2 one (Q8_0, Q4_0 and Q4_1: a group as two halves of
//! eight rows, [`runs_on`]) or the portable one.

/// The body of a 32-value type's [`GroupKernel::group`] (Q8_0, Q4_0, Q4_1), from its file's
/// kernels: `group_vnni` for the `M` activation rows at once, `group_avx2` one row at a time
/// without VNNI (its accumulators for sixteen rows fill the 256-bit registers), else
/// `group_portable`.
macro_rules! group_of_32_value_blocks {
    ($isa:expr, $g:expr, $k:expr, $a:expr, $lay:expr, $ahead:expr) => {{
        let (isa, g, nb, a, lay, ahead) = ($isa, $g, $k / 32, $a, $lay, $ahead);
        #[cfg(target_arch = "x86_64")]
        match isa {
            QIsa::Avx512Vnni => return unsafe { group_vnni::<M>(g, nb, a, lay, ahead) },
            QIsa::Avx512 | QIsa::Avx2 => {
                return std::array::from_fn(|i| unsafe { group_avx2(g, nb, a[i], lay, ahead) });
            }
            QIsa::Portable => {}
        }
        let _ = (isa, ahead);
        group_portable::<M>(g, nb, a, lay)
    }};
}

mod paired;
mod q40;
mod q41;
mod q4k;
mod q6k;
mod q80;

use super::act::ActLayout;
use super::prefetch_ahead;
use super::rows::{QIsa, QJob};
use crate::dtype::DType;

/// Rows a group interleaves.
pub(crate) const X16: usize = 16;

/// Whether `dtype` has interleaved kernels.
pub(crate) fn interleaves(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_K | DType::Q5_K | DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q6_K
    )
}

/// Whether `dtype`'s interleaved rows have a SIMD kernel on `isa` (the portable one computes
/// them on any set, too slowly to be chosen). Without VNNI, the 256-bit kernels take a group
/// as two halves of eight rows, one activation row at a time (see [`q41`]); Q8_0's (AVX2, one
/// core, hot) ran 1.4-1.6 times its plain rows' rate for 1 to 4 activation rows, 576 to 8960
/// wide, and prompts 512x2048x1536 at 25 against 15 GMAC/s. Q4_K's and Q5_K's, first dropped
/// as no faster from memory on a machine whose two cores outran its memory, came back for one
/// whose did not (Zen 3, 2 cores: hot 18.6 against 10.0 GB/s for Q4_K, 13.6 against 10.4 for
/// Q5_K; Qwen2.5-Coder-1.5B Q4_K_M decode +20%, prompts no slower); the choice by timing
/// decides per machine.
pub(crate) fn runs_on(dtype: DType, isa: QIsa) -> bool {
    match isa {
        QIsa::Avx512Vnni => interleaves(dtype),
        QIsa::Avx512 | QIsa::Avx2 => matches!(
            dtype,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4_K | DType::Q5_K
        ),
        QIsa::Portable => false,
    }
}

/// Interleaves `rows` plain rows of `dtype` (`rows` a multiple of [`X16`]), `k` columns, from
/// `src` into `dst`, which has the same length.
pub(crate) fn interleave(dtype: DType, src: &[u8], rows: usize, k: usize, dst: &mut [u8]) {
    let row_bytes = dtype.row_bytes(k);
    assert!(rows.is_multiple_of(X16) && src.len() == rows * row_bytes);
    assert_eq!(dst.len(), src.len());
    match dtype {
        DType::Q4_K => q4k::interleave(false, src, rows, k, dst),
        DType::Q5_K => q4k::interleave(true, src, rows, k, dst),
        DType::Q8_0 => q80::interleave(src, rows, k, dst),
        DType::Q4_0 => q40::interleave(src, rows, k, dst),
        DType::Q4_1 => q41::interleave(src, rows, k, dst),
        DType::Q6_K => q6k::interleave(src, rows, k, dst),
        _ => unreachable!("{dtype} does not interleave"),
    }
}

/// Row `r` of the group at `group` (`k` columns of `dtype`) as a plain row, into `out`.
pub(crate) fn plain_row(dtype: DType, group: &[u8], k: usize, r: usize, out: &mut [u8]) {
    match dtype {
        DType::Q4_K => q4k::plain_row(false, group, k / 256, r, out),
        DType::Q5_K => q4k::plain_row(true, group, k / 256, r, out),
        DType::Q8_0 => q80::plain_row(group, k / 32, r, out),
        DType::Q4_0 => q40::plain_row(group, k / 32, r, out),
        DType::Q4_1 => q41::plain_row(group, k / 32, r, out),
        DType::Q6_K => q6k::plain_row(group, k / 256, r, out),
        _ => unreachable!("{dtype} does not interleave"),
    }
}

/// Rows `r0..r0 + 8` of one super-block (`block_size` columns) of a group of `dtype` at
/// `sb` as plain blocks one after another from `out`. For the types whose groups lie block
/// by block (not Q8_0 or Q4_0, which pair them and have no wide road).
///
/// # Safety
/// `sb` holds a group's super-block; `out` has room for 8 plain blocks.
pub(crate) unsafe fn plain_rows8(dtype: DType, sb: *const u8, r0: usize, out: *mut u8) {
    debug_assert!(
        !matches!(dtype, DType::Q8_0 | DType::Q4_0),
        "{dtype}'s groups pair their blocks"
    );
    if dtype == DType::Q6_K {
        return unsafe { q6k::plain_rows8(sb, r0, out) };
    }
    let block = dtype.row_bytes(dtype.block_size());
    let group = unsafe { std::slice::from_raw_parts(sb, X16 * block) };
    for r in 0..8 {
        let row = unsafe { std::slice::from_raw_parts_mut(out.add(r * block), block) };
        plain_row(dtype, group, dtype.block_size(), r0 + r, row);
    }
}

/// `vpdpbusd`'s products without its add, on AVX2: each i32 lane the sum of its four
/// products of unsigned bytes `w` and signed bytes `x` (`vpmaddubsw`, then `vpmaddwd` by
/// ones). Exact where no pair of products passes i16's range, as with weights below 128.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot4_avx2(
    w: std::arch::x86_64::__m256i,
    x: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)) }
}

/// llama.cpp's `hsum_float_8` of eight accumulators, lane by lane: sixteen rows' sums of
/// their eight lanes, in its order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum_float_8_lanes(l: &[std::arch::x86_64::__m512; 8]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    unsafe {
        let (r0, r1) = (_mm512_add_ps(l[4], l[0]), _mm512_add_ps(l[5], l[1]));
        let (r2, r3) = (_mm512_add_ps(l[6], l[2]), _mm512_add_ps(l[7], l[3]));
        _mm512_add_ps(_mm512_add_ps(r0, r2), _mm512_add_ps(r1, r3))
    }
}

/// One type's kernels over a group.
trait GroupKernel {
    /// Activation rows a call takes at most (what its accumulators leave of the registers).
    const MAX_M: usize;
    /// The group at `g` (`k` columns) against `M` activation rows: `out[i][r]` the dot of
    /// weight row `r` with activation row `i`, by `isa`'s kernel (the portable one where the
    /// type has none for it: [`runs_on`]); `ahead`
    /// is how far ahead of its loads it prefetches.
    ///
    /// # Safety
    /// The pointers hold a group and `M` activation rows laid out by `lay`; the CPU runs `isa`.
    unsafe fn group<const M: usize>(
        isa: QIsa,
        g: *const u8,
        k: usize,
        a: [*const u8; M],
        lay: &ActLayout,
        ahead: usize,
    ) -> [[f32; X16]; M];
}

/// `job` over interleaved weights of `dtype`: each group of the thread's rows against every
/// activation row, as many at a time as the kernel takes.
pub(crate) fn rows(isa: QIsa, dtype: DType, job: QJob) {
    match dtype {
        DType::Q4_K => rows_with::<q4k::Q45K<false>>(isa, &job),
        DType::Q5_K => rows_with::<q4k::Q45K<true>>(isa, &job),
        DType::Q8_0 => rows_with::<q80::Q80>(isa, &job),
        DType::Q4_0 => rows_with::<q40::Q40>(isa, &job),
        DType::Q4_1 => rows_with::<q41::Q41>(isa, &job),
        DType::Q6_K => rows_with::<q6k::Q6K>(isa, &job),
        _ => unreachable!("{dtype} does not interleave"),
    }
}

fn rows_with<K: GroupKernel>(isa: QIsa, job: &QJob) {
    let QJob {
        w,
        row_bytes,
        n,
        rows: (start, end),
        acts,
        layout,
        m,
        y,
        ..
    } = *job;
    if start >= end || m == 0 {
        return;
    }
    assert!(start.is_multiple_of(X16) && end.is_multiple_of(X16));
    let ahead = prefetch_ahead(row_bytes);
    #[cfg(target_arch = "x86_64")]
    {
        // The kernels prefetch `ahead` of their loads, which leaves the start of the
        // thread's rows to wait on memory: ask for it now.
        let first = ((end - start) * row_bytes).min(ahead);
        for offset in (0..first).step_by(64) {
            let p = unsafe { w.add(start * row_bytes + offset) };
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.cast())
            };
        }
    }
    let act = |i: usize| unsafe { acts.add(i * layout.stride) };
    let store = |out: &[[f32; X16]], i0: usize, j: usize| {
        for (di, vals) in out.iter().enumerate() {
            for (r, &v) in vals.iter().enumerate() {
                unsafe { *y.add((i0 + di) * n + j + r) = v };
            }
        }
    };
    macro_rules! group {
        ($m:literal, $g:expr, $i:expr) => {{
            let a: [*const u8; $m] = std::array::from_fn(|c| act($i + c));
            unsafe { K::group::<$m>(isa, $g, layout.k, a, &layout, ahead) }
        }};
    }
    let mut j = start;
    while j < end {
        let g = unsafe { w.add(j * row_bytes) };
        // Rows below `wide` took the wide road.
        let mut i = job.wide;
        while i < m {
            let take = (m - i).min(K::MAX_M);
            match take {
                1 => store(&group!(1, g, i), i, j),
                2 => store(&group!(2, g, i), i, j),
                3 => store(&group!(3, g, i), i, j),
                _ => store(&group!(4, g, i), i, j),
            }
            i += take;
        }
        j += X16;
    }
}
