//! Q4_1 interleaved. A group of 16 rows is `k / 32` blocks of [`GROUP_BLOCK`] bytes (16 × 20,
//! the bytes of the plain rows), one per 32-value block:
//!
//! | bytes    | what                                                                       |
//! |----------|----------------------------------------------------------------------------|
//! | 0..32    | `d` of rows 0..16 (f16)                                                    |
//! | 32..64   | `m` of rows 0..16 (f16)                                                    |
//! | 64..320  | `qs`: for step `t < 4`, 64 bytes: row `r`'s bytes `4t .. 4t + 4` at `4r`   |
//!
//! A step's low nibbles are values `4t..4t+4` of each row, its high nibbles values
//! `16+4t..`: llama.cpp's lanes `t` and `t + 4` of the one-row formula the tile computes
//! ([`super::super::tiles`]' `tile_q41`), so each of eight f32 accumulators holds one of
//! those lanes for sixteen rows, and the horizontal sum at the end adds them in its order.
//! The activations are plain Q8_0/Q8_1 blocks ([`super::super::ActKind::Q8`]), values in order.

use super::super::act::ActLayout;
use super::super::rows::QIsa;
use super::super::tiles::rdf32;
use super::{GroupKernel, X16};
#[cfg(target_arch = "x86_64")]
use super::{dot4_avx2, hsum_float_8_lanes};

/// Bytes of one plain Q4_1 block.
const BLOCK: usize = 20;
/// Bytes of a group's block.
const GROUP_BLOCK: usize = X16 * BLOCK;
const OFF_M: usize = 32;
const OFF_QS: usize = 64;

pub(super) fn interleave(src: &[u8], rows: usize, k: usize, dst: &mut [u8]) {
    let nb = k / 32;
    let row_bytes = nb * BLOCK;
    for g in 0..rows / X16 {
        for b in 0..nb {
            let out = &mut dst[(g * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
            for r in 0..X16 {
                let blk = &src[(g * X16 + r) * row_bytes + b * BLOCK..][..BLOCK];
                out[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                out[OFF_M + 2 * r..OFF_M + 2 * r + 2].copy_from_slice(&blk[2..4]);
                for t in 0..4 {
                    let at = OFF_QS + 64 * t + 4 * r;
                    out[at..at + 4].copy_from_slice(&blk[4 + 4 * t..8 + 4 * t]);
                }
            }
        }
    }
}

pub(super) fn plain_row(group: &[u8], nb: usize, r: usize, out: &mut [u8]) {
    for b in 0..nb {
        let g = &group[b * GROUP_BLOCK..][..GROUP_BLOCK];
        let blk = &mut out[b * BLOCK..][..BLOCK];
        blk[0..2].copy_from_slice(&g[2 * r..2 * r + 2]);
        blk[2..4].copy_from_slice(&g[OFF_M + 2 * r..OFF_M + 2 * r + 2]);
        for t in 0..4 {
            let at = OFF_QS + 64 * t + 4 * r;
            blk[4 + 4 * t..8 + 4 * t].copy_from_slice(&g[at..at + 4]);
        }
    }
}

/// The Q4_1 kernels.
pub(super) struct Q41;

impl GroupKernel for Q41 {
    // Eight accumulators an activation row.
    const MAX_M: usize = 2;
    #[inline(always)]
    unsafe fn group<const M: usize>(
        isa: QIsa,
        g: *const u8,
        k: usize,
        a: [*const u8; M],
        lay: &ActLayout,
        ahead: usize,
    ) -> [[f32; X16]; M] {
        group_of_32_value_blocks!(isa, g, k, a, lay, ahead)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_vnni<const M: usize>(
    g: *const u8,
    nb: usize,
    a: [*const u8; M],
    lay: &ActLayout,
    ahead: usize,
) -> [[f32; X16]; M] {
    use std::arch::x86_64::*;
    unsafe {
        let low = _mm512_set1_epi8(0x0F);
        let bcast = |p: *const u8| _mm512_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut acc = [[_mm512_setzero_ps(); 8]; M];
        let mut summs = [_mm512_setzero_ps(); M];
        for b in 0..nb {
            let blk = g.add(b * GROUP_BLOCK);
            // The block's lines one by one beside the work, as Q4_K's kernel does.
            _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead).cast());
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(OFF_M).cast()));
            let scale: [__m512; M] = std::array::from_fn(|i| {
                _mm512_mul_ps(dw, _mm512_set1_ps(rdf32(a[i].add(lay.d), b)))
            });
            for t in 0..4 {
                _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + OFF_QS + 64 * t).cast());
                let v = _mm512_loadu_si512(blk.add(OFF_QS + 64 * t).cast());
                let lo = _mm512_and_si512(v, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                for i in 0..M {
                    let x = a[i].add(32 * b + 4 * t);
                    let l0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, bcast(x));
                    let l1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, bcast(x.add(16)));
                    acc[i][t] = _mm512_fmadd_ps(scale[i], _mm512_cvtepi32_ps(l0), acc[i][t]);
                    acc[i][t + 4] =
                        _mm512_fmadd_ps(scale[i], _mm512_cvtepi32_ps(l1), acc[i][t + 4]);
                }
            }
            for i in 0..M {
                let sx = _mm512_set1_ps(rdf32(a[i].add(lay.b), b));
                summs[i] = _mm512_fmadd_ps(mw, sx, summs[i]);
            }
        }
        let mut out = [[0f32; X16]; M];
        for i in 0..M {
            let sum = hsum_float_8_lanes(&acc[i]);
            _mm512_storeu_ps(out[i].as_mut_ptr(), _mm512_add_ps(sum, summs[i]));
        }
        out
    }
}

/// Blocks a half of [`group_avx2`] takes before the other half takes them (2.5 KiB, in L1).
/// One half over every block and then the other left memory idle while the second ran from
/// cache; by turns the requests go out all along (Zen 3, one core, from memory, 1536 wide:
/// 0.66-0.75 of a plain read's rate, 0.69-0.93 by turns).
const HALVES_RUN: usize = 8;

/// [`group_vnni`] with 256-bit vectors and without VNNI, against one activation row: the group
/// as two halves of eight rows (a block's 64-byte step holds four values of all sixteen rows,
/// 32 bytes a half), each with its own eight accumulators, taking turns over runs of
/// [`HALVES_RUN`] blocks, the second half finding the run's lines in cache. `vpmaddubsw` then
/// `vpmaddwd` by ones gives each lane's four products as one exact i32, as `vpdpbusd` does;
/// the float steps are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2(
    g: *const u8,
    nb: usize,
    a: *const u8,
    lay: &ActLayout,
    ahead: usize,
) -> [f32; X16] {
    use std::arch::x86_64::*;
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        let bcast = |p: *const u8| _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut out = [0f32; X16];
        let mut accs = [[_mm256_setzero_ps(); 8]; 2];
        let mut summss = [_mm256_setzero_ps(); 2];
        for run in (0..nb).step_by(HALVES_RUN) {
            for h in 0..2 {
                let mut acc = accs[h];
                let mut summs = summss[h];
                for b in run..(run + HALVES_RUN).min(nb) {
                    let blk = g.add(b * GROUP_BLOCK);
                    if h == 0 {
                        for line in (0..GROUP_BLOCK).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + line).cast());
                        }
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h).cast()));
                    let mw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(OFF_M + 16 * h).cast()));
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(rdf32(a.add(lay.d), b)));
                    for t in 0..4 {
                        let v = _mm256_loadu_si256(blk.add(OFF_QS + 64 * t + 32 * h).cast());
                        let lo = _mm256_and_si256(v, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        let x = a.add(32 * b + 4 * t);
                        let l0 = dot4_avx2(lo, bcast(x));
                        let l1 = dot4_avx2(hi, bcast(x.add(16)));
                        acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(l0), acc[t]);
                        acc[t + 4] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(l1), acc[t + 4]);
                    }
                    let sx = _mm256_set1_ps(rdf32(a.add(lay.b), b));
                    summs = _mm256_fmadd_ps(mw, sx, summs);
                }
                accs[h] = acc;
                summss[h] = summs;
            }
        }
        for h in 0..2 {
            let (acc, summs) = (accs[h], summss[h]);
            // `hsum_float_8_lanes`' order.
            let (r0, r1) = (_mm256_add_ps(acc[4], acc[0]), _mm256_add_ps(acc[5], acc[1]));
            let (r2, r3) = (_mm256_add_ps(acc[6], acc[2]), _mm256_add_ps(acc[7], acc[3]));
            let sum = _mm256_add_ps(_mm256_add_ps(r0, r2), _mm256_add_ps(r1, r3));
            _mm256_storeu_ps(out[8 * h..].as_mut_ptr(), _mm256_add_ps(sum, summs));
        }
        out
    }
}

/// [`group_vnni`] in plain Rust, lane by lane: the same integers and float steps.
fn group_portable<const M: usize>(
    g: *const u8,
    nb: usize,
    a: [*const u8; M],
    lay: &ActLayout,
) -> [[f32; X16]; M] {
    let mut acc = [[[0f32; 8]; X16]; M];
    let mut summs = [[0f32; X16]; M];
    for b in 0..nb {
        // SAFETY: the caller's promise that `g` holds `nb` blocks.
        let blk = unsafe { std::slice::from_raw_parts(g.add(b * GROUP_BLOCK), GROUP_BLOCK) };
        let mut row = [0u8; BLOCK];
        for r in 0..X16 {
            plain_row(blk, 1, r, &mut row);
            let dw = half::f16::from_le_bytes([row[0], row[1]]).to_f32();
            let mw = half::f16::from_le_bytes([row[2], row[3]]).to_f32();
            for i in 0..M {
                let x = |v: usize| unsafe { *a[i].add(32 * b + v).cast::<i8>() } as i32;
                let (dx, sx) = unsafe { (rdf32(a[i].add(lay.d), b), rdf32(a[i].add(lay.b), b)) };
                let scale = dw * dx;
                for l in 0..8 {
                    let lane: i32 = (0..4)
                        .map(|u| {
                            let (byte, high) = (row[4 + 4 * (l % 4) + u], l >= 4);
                            let q = if high { byte >> 4 } else { byte & 0xF };
                            q as i32 * x(4 * l + u)
                        })
                        .sum();
                    acc[i][r][l] = scale.mul_add(lane as f32, acc[i][r][l]);
                }
                summs[i][r] = mw.mul_add(sx, summs[i][r]);
            }
        }
    }
    std::array::from_fn(|i| {
        std::array::from_fn(|r| {
            let v = &acc[i][r];
            let (r0, r1, r2, r3) = (v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]);
            ((r0 + r2) + (r1 + r3)) + summs[i][r]
        })
    })
}
