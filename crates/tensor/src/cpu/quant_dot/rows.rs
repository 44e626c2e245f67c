//! One thread's share of a matrix product: the instruction set chosen, then its weight rows
//! run past the activation rows in tiles (or on the wide road).

use super::super::Isa;
use super::act::ActLayout;
#[cfg(target_arch = "x86_64")]
use super::avx2::Avx2;
#[cfg(target_arch = "x86_64")]
use super::avx512::Avx512;
use super::portable::Portable;
use super::qv::Qv;
use super::tiles::*;
use super::wide::{TILE_SB, TM, tile_row, unpack_interleaved};
use super::x16::X16;
use super::{QM, QR, prefetch_ahead};
use crate::dtype::DType;

/// The instruction sets the integer kernels come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QIsa {
    Avx512Vnni,
    Avx512,
    Avx2,
    Portable,
}

impl QIsa {
    /// The set for the float kernels' [`Isa`], with VNNI when the CPU has it.
    pub(crate) fn from_isa(isa: Isa) -> QIsa {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if std::is_x86_feature_detected!("avx512vnni") => QIsa::Avx512Vnni,
            Isa::Avx512 => QIsa::Avx512,
            Isa::Avx2 => QIsa::Avx2,
            Isa::Portable => QIsa::Portable,
        }
    }

    /// Every set this CPU can run.
    pub(crate) fn available() -> Vec<QIsa> {
        let mut sets = Vec::new();
        for isa in Isa::available() {
            let q = QIsa::from_isa(isa);
            if q == QIsa::Avx512Vnni {
                sets.push(q);
            }
            sets.push(match isa {
                Isa::Avx512 => QIsa::Avx512,
                Isa::Avx2 => QIsa::Avx2,
                Isa::Portable => QIsa::Portable,
            });
        }
        sets
    }
}

/// Weight rows `rows` of a quantized matrix against activation rows `0..m`.
#[derive(Clone, Copy)]
pub(crate) struct QJob {
    pub w: *const u8,
    pub row_bytes: usize,
    pub n: usize,
    pub rows: (usize, usize),
    pub acts: *const u8,
    pub layout: ActLayout,
    pub m: usize,
    /// Activation rows a prefill block keeps in cache while weight rows stream past.
    pub block_rows: usize,
    pub y: *mut f32,
    /// Activation rows `0..wide` taken by the wide road ([`wide_rows`]), from `tiles`
    /// ([`build_tiles`]), with this thread's `panel` ([`panel_bytes`]).
    pub wide: usize,
    pub tiles: *const u8,
    pub panel: *mut u8,
    /// Wide tiles a prefill block keeps in cache.
    pub block_tiles: usize,
    /// Weights interleaved sixteen rows at a time ([`super::x16`]), on their own kernels
    /// (`wide` is 0); `rows` are whole groups.
    pub interleaved: bool,
}

// SAFETY: each thread writes its own columns of `y`.
unsafe impl Send for QJob {}
unsafe impl Sync for QJob {}

/// Runs `job` with the kernels of `dtype` compiled for `isa`.
pub(crate) fn quant_rows(isa: QIsa, dtype: DType, job: QJob) {
    // Interleaved weights: rows past the wide road's on their own kernels, the wide road's
    // (if any) below.
    if job.interleaved {
        if job.wide < job.m {
            super::x16::rows(isa, dtype, job);
        }
        if job.wide == 0 {
            return;
        }
    }
    match dtype {
        DType::Q8_0 => rows_dispatch::<KQ8_0>(isa, job),
        DType::Q4_0 => rows_dispatch::<KQ4_0>(isa, job),
        DType::Q4_1 => rows_dispatch::<KQ4_1>(isa, job),
        DType::Q4_K => rows_dispatch::<KQ4K>(isa, job),
        DType::Q5_K => rows_dispatch::<KQ5K>(isa, job),
        DType::Q6_K => rows_dispatch::<KQ6K>(isa, job),
        _ => unreachable!("quant_rows: {dtype} is not quantized"),
    }
}

fn rows_dispatch<K: Kernel>(isa: QIsa, job: QJob) {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn vnni<K: Kernel>(job: QJob) {
        unsafe { rows::<Avx512<true>, K>(job) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn avx512<K: Kernel>(job: QJob) {
        unsafe { rows::<Avx512<false>, K>(job) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<K: Kernel>(job: QJob) {
        unsafe { rows::<Avx2, K>(job) }
    }
    // SAFETY: `QIsa` values only name sets the CPU has (`from_isa`, `available`).
    match isa {
        #[cfg(target_arch = "x86_64")]
        QIsa::Avx512Vnni => unsafe { vnni::<K>(job) },
        #[cfg(target_arch = "x86_64")]
        QIsa::Avx512 => unsafe { avx512::<K>(job) },
        #[cfg(target_arch = "x86_64")]
        QIsa::Avx2 => unsafe { avx2::<K>(job) },
        _ => unsafe { rows::<Portable, K>(job) },
    }
}

#[inline(always)]
unsafe fn rows<Q: Qv, K: Kernel>(job: QJob) {
    let QJob {
        w,
        row_bytes,
        n,
        rows: (start, end),
        acts,
        layout,
        m,
        block_rows,
        y,
        wide,
        ..
    } = job;
    if start >= end || m == 0 {
        return;
    }
    if wide > 0 {
        unsafe { rows_wide::<Q, K>(job) };
        // Interleaved rows past the wide road's take their own kernels ([`quant_rows`]).
        if wide == m || job.interleaved {
            return;
        }
    }
    // The kernels prefetch a fixed distance ahead of their loads, which leaves the start of
    // the thread's rows to wait on memory: ask for it now.
    let first = (end - start) * row_bytes;
    for offset in (0..first.min(prefetch_ahead(row_bytes))).step_by(64) {
        unsafe { Q::prefetch(w.add(start * row_bytes + offset)) };
    }
    // A tile past the last row repeats it and its result is dropped: no extra code for edges.
    let w_rows = |j: usize| -> [*const u8; QR] {
        std::array::from_fn(|r| unsafe { w.add((j + r).min(end - 1) * row_bytes) })
    };
    let act = |i: usize| unsafe { acts.add(i.min(m - 1) * layout.stride) };
    let store = |out: &[[f32; QR]], i0: usize, i_end: usize, j: usize| {
        for (di, vals) in out.iter().enumerate() {
            if i0 + di >= i_end {
                break;
            }
            for (r, &v) in vals.iter().enumerate() {
                if j + r < end {
                    unsafe { *y.add((i0 + di) * n + j + r) = v };
                }
            }
        }
    };
    unsafe {
        if m == 1 {
            let mut j = start;
            while j < end {
                let mut out = [[0f32; QR]; 1];
                K::tile::<Q, 1>(w_rows(j), [act(0)], &layout, &mut out);
                store(&out, 0, 1, j);
                j += QR;
            }
            return;
        }
        // Rows below `wide` took the wide road.
        let mut i0 = wide;
        while i0 < m {
            let i_end = (i0 + block_rows).min(m);
            let mut j = start;
            while j < end {
                let ws = w_rows(j);
                let mut i = i0;
                while i + QM <= i_end {
                    let mut out = [[0f32; QR]; QM];
                    K::tile::<Q, QM>(ws, std::array::from_fn(|c| act(i + c)), &layout, &mut out);
                    store(&out, i, i_end, j);
                    i += QM;
                }
                // The last rows of a block alone (the same bits as in a tile of four).
                while i < i_end {
                    let mut out = [[0f32; QR]; 1];
                    K::tile::<Q, 1>(ws, [act(i)], &layout, &mut out);
                    store(&out, i, i_end, j);
                    i += 1;
                }
                j += QR;
            }
            i0 = i_end;
        }
    }
}

/// [`rows`] through the wide road: per block of tiles, each `QR` weight rows unpacked once,
/// then run past every tile of the block.
#[inline(always)]
unsafe fn rows_wide<Q: Qv, K: Kernel>(job: QJob) {
    let QJob {
        w,
        row_bytes,
        n,
        rows: (start, end),
        layout,
        y,
        wide,
        tiles,
        panel,
        block_tiles,
        ..
    } = job;
    let nsb = layout.k / 256;
    let tile_bytes = nsb * TILE_SB;
    let n_tiles = wide.div_ceil(TM);
    let w_rows = |j: usize| -> [*const u8; QR] {
        std::array::from_fn(|r| unsafe { w.add((j + r).min(end - 1) * row_bytes) })
    };
    let mut t0 = 0;
    while t0 < n_tiles {
        let t_end = (t0 + block_tiles).min(n_tiles);
        let mut j = start;
        while j < end {
            let cols = (end - j).min(QR);
            unsafe {
                if job.interleaved {
                    let group = j / X16 * X16;
                    unpack_interleaved::<Q, K>(w.add(group * row_bytes), j - group, nsb, panel);
                } else {
                    K::unpack::<Q>(w_rows(j), nsb, panel);
                }
                for tile in t0..t_end {
                    let out = K::wide::<Q>(panel, tiles.add(tile * tile_bytes), nsb);
                    let lanes = (wide - tile * TM).min(TM);
                    for (r, v) in out.iter().enumerate().take(cols) {
                        let mut l = [0f32; TM];
                        Q::f2store(l.as_mut_ptr(), *v);
                        for (lane, &v) in l.iter().enumerate() {
                            let i = tile_row(layout.kind, lane);
                            if i < lanes {
                                *y.add((tile * TM + i) * n + j + r) = v;
                            }
                        }
                    }
                }
            }
            j += QR;
        }
        t0 = t_end;
    }
}
