//! Q4_K and Q5_K interleaved. One core, a 1536-wide Q4_K matrix in L2: 56 GB/s of weights
//! against one activation row (27 row by row), 22 against four (9.4), 11 against eight (4.7);
//! and from 16 rows on, a third faster than the wide road ([`super::super::wide`]) on plain
//! rows, so interleaved Q4_K weights never take it. Without VNNI ([`group_avx2`], a Zen 3 core,
//! the load's calibration: 2048 wide in L2, one activation row) 18.6 GB/s against 10.0.
//!
//! A group of 16 rows is `nsb` blocks of `16 ×` [`block`] bytes (the bytes of the plain
//! rows), one per super-block:
//!
//! | bytes      | what                                                                   |
//! |------------|------------------------------------------------------------------------|
//! | 0..32      | `d` of rows 0..16 (f16)                                                |
//! | 32..64     | `dmin` of rows 0..16 (f16)                                             |
//! | 64..256    | three vectors of 16 u32 lanes, lane `r` row `r`'s scales and mins      |
//! | 256..2304  | `qs`: for chunk `c < 4` and step `s < 8`, 64 bytes: row `r`'s bytes `32c + 4s .. +4` at `4r` |
//! | 2304..2816 | Q5_K only, `qh`: for step `s < 8`, 64 bytes: row `r`'s bytes `4s .. 4s + 4` at `4r` |
//!
//! Lane `r` of scale vector `t < 3` holds sub-blocks `2t` and `2t + 1`: bits 0-5 `sc[2t]`, 6-11
//! `m[2t]`, 16-21 `sc[2t+1]`, 22-27 `m[2t+1]`, so `& 0x3F` and `>> 6 & 0x003F003F` take them
//! out. The nibbles left free (bits 12-15 and 28-31 of each) carry chunk 3's word, shifted so
//! that three shifts and masks put it together ([`chunk3`]): 6 bits a value, 12 bytes a row,
//! as in the plain format.
//!
//! Chunk `c`'s fifth bits (Q5_K) are bits `2c` (low nibbles) and `2c + 1` (high ones) of the
//! `qh` bytes of the same step.
//!
//! Per row, the integer sums (each sub-block's dot product times its scale, and the mins
//! against the activations' 32-value sums) are exact, and the float steps are those of
//! [`super::super::tiles`]' Q4_K or Q5_K tile, lane for lane: a row gives the same bits
//! interleaved or not.

use super::super::act::ActLayout;
use super::super::rows::QIsa;
use super::super::tiles::rdf32;
#[cfg(target_arch = "x86_64")]
use super::dot4_avx2;
use super::{GroupKernel, X16};
use crate::quant::scales_mins_k4_u64;

/// Bytes of one plain Q4_K (`five`: Q5_K) block.
const fn block(five: bool) -> usize {
    if five { 176 } else { 144 }
}
/// Where a plain block's `qs` start.
const fn plain_qs(five: bool) -> usize {
    if five { 48 } else { 16 }
}
/// Where a plain Q5_K block's `qh` start.
const PLAIN_QH: usize = 16;
const OFF_DMIN: usize = 32;
const OFF_SCALES: usize = 64;
const OFF_QS: usize = 256;
const OFF_QH: usize = 2304;

/// The word of chunk 3 (sub-blocks 6 and 7) from the free nibbles of the other three.
#[inline(always)]
fn chunk3(v0: u32, v1: u32, v2: u32) -> u32 {
    ((v0 >> 12) & 0x000F_000F) | ((v1 >> 8) & 0x00F0_00F0) | ((v2 >> 4) & 0x0F00_0F00)
}

/// A chunk's word: scales and mins of sub-blocks `2c`, `2c + 1`.
#[inline(always)]
fn chunk_word(sc: &[u8; 8], mn: &[u8; 8], c: usize) -> u32 {
    let (a, b) = (2 * c, 2 * c + 1);
    sc[a] as u32 | (mn[a] as u32) << 6 | (sc[b] as u32) << 16 | (mn[b] as u32) << 22
}

/// Interleaves `rows` plain Q4_K (`five`: Q5_K) rows (`rows` a multiple of [`X16`]) of `k`
/// columns from `src` into `dst`, which has the same length.
pub(crate) fn interleave(five: bool, src: &[u8], rows: usize, k: usize, dst: &mut [u8]) {
    let (nsb, block, qs) = (k / 256, block(five), plain_qs(five));
    let row_bytes = nsb * block;
    let sb_bytes = X16 * block;
    assert!(rows.is_multiple_of(X16) && k.is_multiple_of(256));
    assert!(src.len() == rows * row_bytes && dst.len() == src.len());
    for g in 0..rows / X16 {
        for sb in 0..nsb {
            let out = &mut dst[(g * nsb + sb) * sb_bytes..][..sb_bytes];
            for r in 0..X16 {
                let blk = &src[(g * X16 + r) * row_bytes + sb * block..][..block];
                out[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                out[OFF_DMIN + 2 * r..OFF_DMIN + 2 * r + 2].copy_from_slice(&blk[2..4]);
                let (sc, mn) = scales_mins_k4_u64(blk[4..16].try_into().unwrap());
                let (sc, mn) = (sc.to_le_bytes(), mn.to_le_bytes());
                let t3 = chunk_word(&sc, &mn, 3);
                let mut words = [0u32; 3];
                for (t, w) in words.iter_mut().enumerate() {
                    // Chunk 3's nibbles `t` and `t + 4` go to bits 12-15 and 28-31.
                    let (lo, hi) = ((t3 >> (4 * t)) & 0xF, (t3 >> (16 + 4 * t)) & 0xF);
                    *w = chunk_word(&sc, &mn, t) | lo << 12 | hi << 28;
                }
                for (t, w) in words.iter().enumerate() {
                    let at = OFF_SCALES + 64 * t + 4 * r;
                    out[at..at + 4].copy_from_slice(&w.to_le_bytes());
                }
                for c in 0..4 {
                    for s in 0..8 {
                        let at = OFF_QS + (8 * c + s) * 64 + 4 * r;
                        let from = qs + 32 * c + 4 * s;
                        out[at..at + 4].copy_from_slice(&blk[from..from + 4]);
                    }
                }
                if five {
                    for s in 0..8 {
                        let (at, from) = (OFF_QH + 64 * s + 4 * r, PLAIN_QH + 4 * s);
                        out[at..at + 4].copy_from_slice(&blk[from..from + 4]);
                    }
                }
            }
        }
    }
}

/// Row `r` of the group at `group` (`nsb` super-blocks) as a plain Q4_K (`five`: Q5_K) row,
/// into `out` (`nsb ·` [`block`] bytes).
pub(crate) fn plain_row(five: bool, group: &[u8], nsb: usize, r: usize, out: &mut [u8]) {
    let (block, qs) = (block(five), plain_qs(five));
    for sb in 0..nsb {
        let g = &group[sb * X16 * block..][..X16 * block];
        let blk = &mut out[sb * block..][..block];
        blk[0..2].copy_from_slice(&g[2 * r..2 * r + 2]);
        blk[2..4].copy_from_slice(&g[OFF_DMIN + 2 * r..OFF_DMIN + 2 * r + 2]);
        let word = |t: usize| {
            let at = OFF_SCALES + 64 * t + 4 * r;
            u32::from_le_bytes(g[at..at + 4].try_into().unwrap())
        };
        let (v0, v1, v2) = (word(0), word(1), word(2));
        let words = [v0, v1, v2, chunk3(v0, v1, v2)];
        let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
        for (c, w) in words.iter().enumerate() {
            sc[2 * c] = (w & 63) as u8;
            mn[2 * c] = (w >> 6 & 63) as u8;
            sc[2 * c + 1] = (w >> 16 & 63) as u8;
            mn[2 * c + 1] = (w >> 22 & 63) as u8;
        }
        // ggml's packing (the inverse of `get_scale_min_k4`).
        let q = &mut blk[4..16];
        for j in 0..4 {
            q[j] = sc[j] | (sc[j + 4] >> 4) << 6;
            q[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
            q[j + 8] = (sc[j + 4] & 0xF) | (mn[j + 4] & 0xF) << 4;
        }
        for c in 0..4 {
            for s in 0..8 {
                let at = OFF_QS + (8 * c + s) * 64 + 4 * r;
                let to = qs + 32 * c + 4 * s;
                blk[to..to + 4].copy_from_slice(&g[at..at + 4]);
            }
        }
        if five {
            for s in 0..8 {
                let (at, to) = (OFF_QH + 64 * s + 4 * r, PLAIN_QH + 4 * s);
                blk[to..to + 4].copy_from_slice(&g[at..at + 4]);
            }
        }
    }
}

/// Where chunk `c`'s low-nibble values (sub-block `2c`) lie in a super-block of activations
/// quantized for Q4_K ([`super::ActKind::Q8KI`]); the high-nibble ones lie 64 bytes on.
#[inline(always)]
fn lo_offset(c: usize) -> usize {
    128 * (c / 2) + 32 * (c % 2)
}

/// The Q4_K (`FIVE`: Q5_K) kernels.
pub(super) struct Q45K<const FIVE: bool>;

impl<const FIVE: bool> GroupKernel for Q45K<FIVE> {
    const MAX_M: usize = 4;
    #[inline(always)]
    unsafe fn group<const M: usize>(
        isa: QIsa,
        g: *const u8,
        k: usize,
        a: [*const u8; M],
        lay: &ActLayout,
        ahead: usize,
    ) -> [[f32; X16]; M] {
        #[cfg(target_arch = "x86_64")]
        match isa {
            QIsa::Avx512Vnni => return unsafe { group_vnni::<M, FIVE>(g, k / 256, a, lay, ahead) },
            QIsa::Avx512 | QIsa::Avx2 => {
                return std::array::from_fn(|i| unsafe {
                    group_avx2::<FIVE>(g, k / 256, a[i], lay, ahead)
                });
            }
            QIsa::Portable => {}
        }
        let _ = (isa, ahead);
        group_portable::<M, FIVE>(g, k / 256, a, lay)
    }
}

/// One group against `M` activation rows: `out[i][r]` the dot of row `r` with row `i`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_vnni<const M: usize, const FIVE: bool>(
    g: *const u8,
    nsb: usize,
    a: [*const u8; M],
    lay: &ActLayout,
    ahead: usize,
) -> [[f32; X16]; M] {
    use std::arch::x86_64::*;
    unsafe {
        let low = _mm512_set1_epi8(0x0F);
        let six = _mm512_set1_epi32(0x3F);
        let pair = _mm512_set1_epi32(0x003F_003F);
        let bit = _mm512_set1_epi8(0x10);
        let bcast = |p: *const u8| _mm512_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut acc = [_mm512_setzero_ps(); M];
        let mut acc_min = [_mm512_setzero_ps(); M];
        for sb in 0..nsb {
            let blk = g.add(sb * X16 * block(FIVE));
            // The block's lines one by one beside the work (a burst of 36 at once streamed
            // 10% slower): its scales (and fifth bits) now, each step's `qs` in the step.
            for line in 0..OFF_QS / 64 {
                _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + 64 * line).cast());
            }
            if FIVE {
                for line in 0..8 {
                    _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + OFF_QH + 64 * line).cast());
                }
            }
            let v0 = _mm512_loadu_si512(blk.add(OFF_SCALES).cast());
            let v1 = _mm512_loadu_si512(blk.add(OFF_SCALES + 64).cast());
            let v2 = _mm512_loadu_si512(blk.add(OFF_SCALES + 128).cast());
            let v3 = _mm512_or_si512(
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi32::<12>(v0), _mm512_set1_epi32(0x000F_000F)),
                    _mm512_and_si512(_mm512_srli_epi32::<8>(v1), _mm512_set1_epi32(0x00F0_00F0)),
                ),
                _mm512_and_si512(_mm512_srli_epi32::<4>(v2), _mm512_set1_epi32(0x0F00_0F00)),
            );
            let words = [v0, v1, v2, v3];
            let mut isum = [_mm512_setzero_si512(); M];
            let mut msum = [_mm512_setzero_si512(); M];
            for (c, &word) in words.iter().enumerate() {
                let mut lo = [_mm512_setzero_si512(); M];
                let mut hi = [_mm512_setzero_si512(); M];
                for s in 0..8 {
                    let at = OFF_QS + (8 * c + s) * 64;
                    _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + at).cast());
                    let v = _mm512_loadu_si512(blk.add(at).cast());
                    let mut wl = _mm512_and_si512(v, low);
                    let mut wh = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                    if FIVE {
                        // Bits 2c and 2c + 1 of the step's `qh` bytes to bit 4.
                        let qh = _mm512_loadu_si512(blk.add(OFF_QH + 64 * s).cast());
                        let h = _mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32));
                        wl = _mm512_or_si512(wl, _mm512_and_si512(_mm512_slli_epi16::<4>(h), bit));
                        wh = _mm512_or_si512(wh, _mm512_and_si512(_mm512_slli_epi16::<3>(h), bit));
                    }
                    for i in 0..M {
                        let x = a[i].add(256 * sb + lo_offset(c) + 4 * s);
                        lo[i] = _mm512_dpbusd_epi32(lo[i], wl, bcast(x));
                        hi[i] = _mm512_dpbusd_epi32(hi[i], wh, bcast(x.add(64)));
                    }
                }
                let sc_lo = _mm512_and_si512(word, six);
                let sc_hi = _mm512_and_si512(_mm512_srli_epi32::<16>(word), six);
                let mins = _mm512_and_si512(_mm512_srli_epi32::<6>(word), pair);
                for i in 0..M {
                    let scaled = _mm512_add_epi32(
                        _mm512_mullo_epi32(lo[i], sc_lo),
                        _mm512_mullo_epi32(hi[i], sc_hi),
                    );
                    isum[i] = _mm512_add_epi32(isum[i], scaled);
                    // The activations' sums of sub-blocks 2c and 2c+1, an i16 pair.
                    let bs = a[i].add(lay.b + 2 * (8 * sb + 2 * c));
                    msum[i] = _mm512_dpwssd_epi32(msum[i], mins, bcast(bs));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(OFF_DMIN).cast()));
            for i in 0..M {
                let dx = _mm512_set1_ps(rdf32(a[i].add(lay.d), sb));
                let s1 = _mm512_cvtepi32_ps(isum[i]);
                let s2 = _mm512_cvtepi32_ps(msum[i]);
                if FIVE {
                    // The Q5_K tile's order: `acc += (d·dx)·s1 − (dmin·dx)·s2`.
                    let t = _mm512_sub_ps(
                        _mm512_mul_ps(_mm512_mul_ps(dw, dx), s1),
                        _mm512_mul_ps(_mm512_mul_ps(dmin, dx), s2),
                    );
                    acc[i] = _mm512_add_ps(acc[i], t);
                } else {
                    acc[i] = _mm512_fmadd_ps(s1, _mm512_mul_ps(dw, dx), acc[i]);
                    acc_min[i] = _mm512_fmadd_ps(s2, _mm512_mul_ps(dmin, dx), acc_min[i]);
                }
            }
        }
        let mut out = [[0f32; X16]; M];
        for i in 0..M {
            _mm512_storeu_ps(out[i].as_mut_ptr(), _mm512_sub_ps(acc[i], acc_min[i]));
        }
        out
    }
}

/// [`group_vnni`] on AVX2 for one activation row: the group as two halves of eight rows (32
/// bytes of each 64-byte step a half) taking turns a super-block at a time, the second finding
/// its lines in cache, as [`super::q41`]'s. (One half over every super-block and then the
/// other left memory idle while the second ran: Zen 3, one core, from memory, 0.70-0.83 of a
/// plain read's rate; by turns 0.81-0.98.) `vpmaddubsw` then `vpmaddwd` by ones gives each
/// lane's four products as one exact i32 (weights below 32 against i8 activations: no pair
/// reaches i16's limit), as `vpdpbusd` does, and `vpmaddwd` is `vpdpwssd` less its add; the
/// float steps are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const FIVE: bool>(
    g: *const u8,
    nsb: usize,
    a: *const u8,
    lay: &ActLayout,
    ahead: usize,
) -> [f32; X16] {
    use std::arch::x86_64::*;
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        let six = _mm256_set1_epi32(0x3F);
        let pair = _mm256_set1_epi32(0x003F_003F);
        let bit = _mm256_set1_epi8(0x10);
        let load = |p: *const u8| _mm256_loadu_si256(p.cast());
        let bcast = |p: *const u8| _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut out = [0f32; X16];
        let mut accs = [_mm256_setzero_ps(); 2];
        let mut acc_mins = [_mm256_setzero_ps(); 2];
        for sb in 0..nsb {
            let blk = g.add(sb * X16 * block(FIVE));
            for h in 0..2 {
                let half = 32 * h;
                let mut acc = accs[h];
                let mut acc_min = acc_mins[h];
                if h == 0 {
                    for line in 0..OFF_QS / 64 {
                        _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + 64 * line).cast());
                    }
                    if FIVE {
                        for line in 0..8 {
                            _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + OFF_QH + 64 * line).cast());
                        }
                    }
                }
                let v0 = load(blk.add(OFF_SCALES + half));
                let v1 = load(blk.add(OFF_SCALES + 64 + half));
                let v2 = load(blk.add(OFF_SCALES + 128 + half));
                let v3 = _mm256_or_si256(
                    _mm256_or_si256(
                        _mm256_and_si256(
                            _mm256_srli_epi32::<12>(v0),
                            _mm256_set1_epi32(0x000F_000F),
                        ),
                        _mm256_and_si256(
                            _mm256_srli_epi32::<8>(v1),
                            _mm256_set1_epi32(0x00F0_00F0),
                        ),
                    ),
                    _mm256_and_si256(_mm256_srli_epi32::<4>(v2), _mm256_set1_epi32(0x0F00_0F00)),
                );
                let mut isum = _mm256_setzero_si256();
                let mut msum = _mm256_setzero_si256();
                for (c, word) in [v0, v1, v2, v3].into_iter().enumerate() {
                    let mut lo = _mm256_setzero_si256();
                    let mut hi = _mm256_setzero_si256();
                    for s in 0..8 {
                        let at = OFF_QS + (8 * c + s) * 64;
                        if h == 0 {
                            _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + at).cast());
                        }
                        let v = load(blk.add(at + half));
                        let mut wl = _mm256_and_si256(v, low);
                        let mut wh = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        if FIVE {
                            // Bits 2c and 2c + 1 of the step's `qh` bytes to bit 4.
                            let qh = load(blk.add(OFF_QH + 64 * s + half));
                            let q = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32));
                            wl = _mm256_or_si256(
                                wl,
                                _mm256_and_si256(_mm256_slli_epi16::<4>(q), bit),
                            );
                            wh = _mm256_or_si256(
                                wh,
                                _mm256_and_si256(_mm256_slli_epi16::<3>(q), bit),
                            );
                        }
                        let x = a.add(256 * sb + lo_offset(c) + 4 * s);
                        lo = _mm256_add_epi32(lo, dot4_avx2(wl, bcast(x)));
                        hi = _mm256_add_epi32(hi, dot4_avx2(wh, bcast(x.add(64))));
                    }
                    let sc_lo = _mm256_and_si256(word, six);
                    let sc_hi = _mm256_and_si256(_mm256_srli_epi32::<16>(word), six);
                    let mins = _mm256_and_si256(_mm256_srli_epi32::<6>(word), pair);
                    let scaled = _mm256_add_epi32(
                        _mm256_mullo_epi32(lo, sc_lo),
                        _mm256_mullo_epi32(hi, sc_hi),
                    );
                    isum = _mm256_add_epi32(isum, scaled);
                    // The activations' sums of sub-blocks 2c and 2c+1, an i16 pair.
                    let bs = a.add(lay.b + 2 * (8 * sb + 2 * c));
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins, bcast(bs)));
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h).cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(OFF_DMIN + 16 * h).cast()));
                let dx = _mm256_set1_ps(rdf32(a.add(lay.d), sb));
                let s1 = _mm256_cvtepi32_ps(isum);
                let s2 = _mm256_cvtepi32_ps(msum);
                if FIVE {
                    // The Q5_K tile's order: `acc += (d·dx)·s1 − (dmin·dx)·s2`.
                    let t = _mm256_sub_ps(
                        _mm256_mul_ps(_mm256_mul_ps(dw, dx), s1),
                        _mm256_mul_ps(_mm256_mul_ps(dmin, dx), s2),
                    );
                    acc = _mm256_add_ps(acc, t);
                } else {
                    acc = _mm256_fmadd_ps(s1, _mm256_mul_ps(dw, dx), acc);
                    acc_min = _mm256_fmadd_ps(s2, _mm256_mul_ps(dmin, dx), acc_min);
                }
                accs[h] = acc;
                acc_mins[h] = acc_min;
            }
        }
        for h in 0..2 {
            _mm256_storeu_ps(
                out[8 * h..].as_mut_ptr(),
                _mm256_sub_ps(accs[h], acc_mins[h]),
            );
        }
        out
    }
}

/// [`group_vnni`] in plain Rust, lane by lane: the same integers and float steps.
fn group_portable<const M: usize, const FIVE: bool>(
    g: *const u8,
    nsb: usize,
    a: [*const u8; M],
    lay: &ActLayout,
) -> [[f32; X16]; M] {
    let f16 = |p: *const u8| half::f16::from_bits(unsafe { p.cast::<u16>().read_unaligned() });
    let mut acc = [[0f32; X16]; M];
    let mut acc_min = [[0f32; X16]; M];
    let (block, qs) = (block(FIVE), plain_qs(FIVE));
    for sb in 0..nsb {
        // SAFETY: the caller's promise that `g` holds `nsb` blocks.
        let blk = unsafe { std::slice::from_raw_parts(g.add(sb * X16 * block), X16 * block) };
        let mut row = [0u8; 176];
        for r in 0..X16 {
            let row = &mut row[..block];
            plain_row(FIVE, blk, 1, r, row);
            let (sc, mn) = scales_mins_k4_u64(row[4..16].try_into().unwrap());
            let (sc, mn) = (sc.to_le_bytes(), mn.to_le_bytes());
            let dw = f16(row.as_ptr()).to_f32();
            let dmin = f16(row[2..].as_ptr()).to_f32();
            for i in 0..M {
                let x = |o: usize| unsafe { *a[i].add(256 * sb + o).cast::<i8>() } as i32;
                let bs = |j: usize| unsafe {
                    a[i].add(lay.b)
                        .cast::<i16>()
                        .add(8 * sb + j)
                        .read_unaligned()
                } as i32;
                let (mut isum, mut msum) = (0i32, 0i32);
                for j in 0..8 {
                    let (c, high) = (j / 2, j % 2 == 1);
                    let base = lo_offset(c) + 64 * usize::from(high);
                    let dot: i32 = (0..32)
                        .map(|l| {
                            let byte = row[qs + 32 * c + l];
                            let mut q = if high { byte >> 4 } else { byte & 0xF };
                            if FIVE {
                                q |= (row[PLAIN_QH + l] >> j & 1) << 4;
                            }
                            q as i32 * x(base + l)
                        })
                        .sum();
                    isum += dot * sc[j] as i32;
                    msum += mn[j] as i32 * bs(j);
                }
                let dx = unsafe { rdf32(a[i].add(lay.d), sb) };
                if FIVE {
                    acc[i][r] += dw * dx * isum as f32 - dmin * dx * msum as f32;
                } else {
                    acc[i][r] = (isum as f32).mul_add(dw * dx, acc[i][r]);
                    acc_min[i][r] = (msum as f32).mul_add(dmin * dx, acc_min[i][r]);
                }
            }
        }
    }
    std::array::from_fn(|i| std::array::from_fn(|r| acc[i][r] - acc_min[i][r]))
}
