//! Q6_K interleaved. A group of 16 rows is `nsb` blocks of [`SB_BYTES`] (16 × 210, the bytes
//! of the plain rows), one per super-block:
//!
//! | bytes      | what                                                                     |
//! |------------|--------------------------------------------------------------------------|
//! | 0..3072    | for half `n < 2` and step `t < 8`, three vectors of 64 bytes, row `r`'s 4 bytes at `4r`: `ql[64n + 4t..]`, `ql[64n + 32 + 4t..]`, `qh[32n + 4t..]` |
//! | 3072..3104 | `d` of rows 0..16 (f16)                                                  |
//! | 3104..3360 | scales: for lane `l < 8`, 32 bytes, row `r`'s `sc[2l], sc[2l + 1]` at `2r` |
//!
//! The one-row formula ([`super::super::tiles`]' `tile_q6k`, llama.cpp's) keeps eight i32 lanes
//! per row: lane `l` holds the four-value groups `g ≡ l (mod 8)` of the super-block, each
//! times its sub-block's scale, less `32·(bsum[2l]·sc[2l] + bsum[2l+1]·sc[2l+1])`; then
//! `acc[l] = fma(d_x·d_w, lane, acc[l])` per super-block and `hsum_float_8(acc)` at the end.
//! A step `(n, t)` holds exactly four groups of lane `t` (`32n + t + 8j`, `j < 4`: the two
//! nibbles of each `ql` word and the four bit pairs of the `qh` word), so a lane's eight groups
//! come from two steps. Each group is scaled alone (no two groups of a lane share a
//! sub-block): `vpmaddubsw` of the 6-bit weights with the broadcast activations, then
//! `vpdpwssd` with the scale as an i16 pair, into the lane's accumulator of 16 rows.
//! Integer sums are exact, so a row gives the same bits interleaved or not.

use super::super::act::ActLayout;
use super::super::rows::QIsa;
use super::super::tiles::{hsum_float_8, rdf32};
#[cfg(target_arch = "x86_64")]
use super::hsum_float_8_lanes;
use super::{GroupKernel, X16};

/// Bytes of one plain Q6_K block.
const BLOCK: usize = 210;
/// Bytes of a group's super-block.
const SB_BYTES: usize = X16 * BLOCK;
const OFF_D: usize = 3072;
const OFF_SCALES: usize = 3104;

/// Where step `(n, t)`'s vector `v` (0: `ql` low words, 1: `ql` high words, 2: `qh`) lies.
#[inline(always)]
fn step_offset(n: usize, t: usize, v: usize) -> usize {
    ((8 * n + t) * 3 + v) * 64
}

/// Where step `(n, t)`'s vector `v` takes its 4 bytes from in a plain block.
#[inline(always)]
fn plain_offset(n: usize, t: usize, v: usize) -> usize {
    match v {
        0 => 64 * n + 4 * t,
        1 => 64 * n + 32 + 4 * t,
        _ => 128 + 32 * n + 4 * t,
    }
}

/// Interleaves `rows` plain Q6_K rows (`rows` a multiple of [`X16`]) of `k` columns from
/// `src` into `dst`, which has the same length.
pub(super) fn interleave(src: &[u8], rows: usize, k: usize, dst: &mut [u8]) {
    let nsb = k / 256;
    let row_bytes = nsb * BLOCK;
    for g in 0..rows / X16 {
        for sb in 0..nsb {
            let out = &mut dst[(g * nsb + sb) * SB_BYTES..][..SB_BYTES];
            for r in 0..X16 {
                let blk = &src[(g * X16 + r) * row_bytes + sb * BLOCK..][..BLOCK];
                for (n, t, v) in steps() {
                    let (at, from) = (step_offset(n, t, v) + 4 * r, plain_offset(n, t, v));
                    out[at..at + 4].copy_from_slice(&blk[from..from + 4]);
                }
                out[OFF_D + 2 * r..OFF_D + 2 * r + 2].copy_from_slice(&blk[208..210]);
                for l in 0..8 {
                    let at = OFF_SCALES + 32 * l + 2 * r;
                    out[at..at + 2].copy_from_slice(&blk[192 + 2 * l..194 + 2 * l]);
                }
            }
        }
    }
}

/// Row `r` of the group at `group` (`nsb` super-blocks) as a plain Q6_K row, into `out`
/// (`nsb · 210` bytes).
pub(super) fn plain_row(group: &[u8], nsb: usize, r: usize, out: &mut [u8]) {
    for sb in 0..nsb {
        let g = &group[sb * SB_BYTES..][..SB_BYTES];
        let blk = &mut out[sb * BLOCK..][..BLOCK];
        for (n, t, v) in steps() {
            let (at, to) = (step_offset(n, t, v) + 4 * r, plain_offset(n, t, v));
            blk[to..to + 4].copy_from_slice(&g[at..at + 4]);
        }
        blk[208..210].copy_from_slice(&g[OFF_D + 2 * r..OFF_D + 2 * r + 2]);
        for l in 0..8 {
            let at = OFF_SCALES + 32 * l + 2 * r;
            blk[192 + 2 * l..194 + 2 * l].copy_from_slice(&g[at..at + 2]);
        }
    }
}

/// Rows `r0..r0 + 8` of one super-block of a group (`sb`, [`SB_BYTES`]) as plain blocks, 210
/// bytes apart from `out`: the wide road's unpacking ([`super::super::wide`]) reads plain rows.
/// With AVX2, 8×8 transposes of the steps' words; else [`plain_row`] row by row.
///
/// # Safety
/// `sb` holds a group's super-block; `out` has room for 8 blocks.
pub(super) unsafe fn plain_rows8(sb: *const u8, r0: usize, out: *mut u8) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        return unsafe { plain_rows8_avx2(sb, r0, out) };
    }
    let group = unsafe { std::slice::from_raw_parts(sb, SB_BYTES) };
    for r in 0..8 {
        let row = unsafe { std::slice::from_raw_parts_mut(out.add(r * BLOCK), BLOCK) };
        plain_row(group, 1, r0 + r, row);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn plain_rows8_avx2(sb: *const u8, r0: usize, out: *mut u8) {
    use std::arch::x86_64::*;
    unsafe {
        for n in 0..2 {
            for v in 0..3 {
                // Word `i` of step `t`'s vector is row `r0 + i`'s word `t` of 8 consecutive
                // ones in the plain block: transpose.
                let y: [__m256i; 8] = std::array::from_fn(|t| {
                    _mm256_loadu_si256(sb.add(step_offset(n, t, v) + 4 * r0).cast())
                });
                let a: [__m256i; 8] = std::array::from_fn(|i| {
                    let (p, q) = (y[2 * (i / 2)], y[2 * (i / 2) + 1]);
                    match i % 2 {
                        0 => _mm256_unpacklo_epi32(p, q),
                        _ => _mm256_unpackhi_epi32(p, q),
                    }
                });
                // `b[i]`: rows `i % 4` and `i % 4 + 4` (the 128-bit halves), words `0..4`
                // for `i < 4`, `4..8` after.
                let b: [__m256i; 8] = std::array::from_fn(|i| {
                    let (base, odd) = (4 * (i / 4) + (i / 2) % 2, i % 2);
                    let (p, q) = (a[base], a[base + 2]);
                    match odd {
                        0 => _mm256_unpacklo_epi64(p, q),
                        _ => _mm256_unpackhi_epi64(p, q),
                    }
                });
                for i in 0..4 {
                    let lo = _mm256_permute2x128_si256::<0x20>(b[i], b[i + 4]);
                    let hi = _mm256_permute2x128_si256::<0x31>(b[i], b[i + 4]);
                    let to = plain_offset(n, 0, v);
                    _mm256_storeu_si256(out.add(i * BLOCK + to).cast(), lo);
                    _mm256_storeu_si256(out.add((i + 4) * BLOCK + to).cast(), hi);
                }
            }
        }
        for r in 0..8 {
            let row = out.add(r * BLOCK);
            let at = |off: usize| sb.add(off + 2 * (r0 + r)).cast::<u16>().read_unaligned();
            row.add(208).cast::<u16>().write_unaligned(at(OFF_D));
            for l in 0..8 {
                let to = row.add(192 + 2 * l).cast::<u16>();
                to.write_unaligned(at(OFF_SCALES + 32 * l));
            }
        }
    }
}

/// Every `(n, t, v)` of a super-block's weight vectors.
fn steps() -> impl Iterator<Item = (usize, usize, usize)> {
    (0..2).flat_map(|n| (0..8).flat_map(move |t| (0..3).map(move |v| (n, t, v))))
}

/// The Q6_K kernels.
pub(super) struct Q6K;

impl GroupKernel for Q6K {
    // Eight f32 accumulators an activation row, kept in memory past two rows (each is
    // touched once per lane and super-block).
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
        if isa == QIsa::Avx512Vnni {
            return unsafe { group_vnni::<M>(g, k / 256, a, lay, ahead) };
        }
        let _ = (isa, ahead);
        group_portable::<M>(g, k / 256, a, lay)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_vnni<const M: usize>(
    g: *const u8,
    nsb: usize,
    a: [*const u8; M],
    lay: &ActLayout,
    ahead: usize,
) -> [[f32; X16]; M] {
    use std::arch::x86_64::*;
    // `vpdpwssd` kept whole: LLVM splits the intrinsic's chains into `vpmaddwd` + `vpaddd`,
    // one more op a group where the ALU ports bound the kernel.
    macro_rules! dpwssd {
        ($acc:expr, $a:expr, $b:expr) => {{
            let mut acc: __m512i = $acc;
            std::arch::asm!(
                "vpdpwssd {acc}, {a}, {b}",
                acc = inout(zmm_reg) acc,
                a = in(zmm_reg) $a,
                b = in(zmm_reg) $b,
                options(pure, nomem, nostack, preserves_flags)
            );
            acc
        }};
    }
    unsafe {
        let low = _mm512_set1_epi8(0x0F);
        // Lane `r`'s i16 pair `(s0, s1)` to `(s0, s0)` and to `(s1, s1)` (byte indices
        // within each 128-bit lane). Opaque, so that LLVM keeps one `vpshufb` (it splits a
        // constant one into `vpshuflw` + `vpshufhw`).
        let dup = |first: i32| {
            let at = |q: i32| (4 * q + first) | (4 * q + first + 1) << 8;
            let idx = |q: i32| at(q) | at(q) << 16;
            let v = _mm512_broadcast_i32x4(_mm_setr_epi32(idx(0), idx(1), idx(2), idx(3)));
            std::hint::black_box(v)
        };
        let (dup_first, dup_second) = (dup(0), dup(2));
        let bcast = |p: *const u8| _mm512_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut acc = [[_mm512_setzero_ps(); 8]; M];
        for sb in 0..nsb {
            let blk = g.add(sb * SB_BYTES);
            // The steps prefetch their own lines; `d` and the scales (read first) now.
            for off in (OFF_D..SB_BYTES).step_by(64).chain([SB_BYTES - 1]) {
                _mm_prefetch::<_MM_HINT_T1>(blk.add(ahead + off).cast());
            }
            // Lane `l`'s scales of sub-blocks `2l`, `2l + 1` times -32 as i16 pairs (the
            // bsums' term), and each sub-block's scale twice (the groups' products).
            let mut pairs = [_mm512_setzero_si512(); 8];
            let mut scales = [_mm512_setzero_si512(); 16];
            for l in 0..8 {
                let p =
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256(blk.add(OFF_SCALES + 32 * l).cast()));
                pairs[l] = _mm512_mullo_epi16(p, _mm512_set1_epi16(-32));
                scales[2 * l] = _mm512_shuffle_epi8(p, dup_first);
                scales[2 * l + 1] = _mm512_shuffle_epi8(p, dup_second);
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(OFF_D).cast()));
            let d: [__m512; M] = std::array::from_fn(|i| {
                _mm512_mul_ps(_mm512_set1_ps(rdf32(a[i].add(lay.d), sb)), dw)
            });
            for l in 0..8 {
                // Two chains of `vpdpwssd` a row (one is latency-bound), the first from
                // `-32·(bsum[2l]·sc[2l] + bsum[2l+1]·sc[2l+1])`; exact in i32.
                let mut lane: [[__m512i; 2]; M] = std::array::from_fn(|i| {
                    let bsums = a[i].add(lay.a).cast::<i16>().add(16 * sb + 2 * l);
                    let offset = dpwssd!(_mm512_setzero_si512(), pairs[l], bcast(bsums.cast()));
                    [offset, _mm512_setzero_si512()]
                });
                for n in 0..2 {
                    let at = |v: usize| blk.add(step_offset(n, l, v));
                    for v in 0..3 {
                        _mm_prefetch::<_MM_HINT_T1>(at(v).add(ahead).cast());
                    }
                    let ql0 = _mm512_loadu_si512(at(0).cast());
                    let ql1 = _mm512_loadu_si512(at(1).cast());
                    let qh = _mm512_loadu_si512(at(2).cast());
                    // The `qh` pairs of `j` = 0, 2 apart from those of 1, 3: with the others
                    // cleared, each shifts to bits 4-5 with zeros above it, and one
                    // `vpternlogd` takes bits 0-3 from the nibble, 4-7 from the pair.
                    let h02 = _mm512_and_si512(qh, _mm512_set1_epi8(0x33));
                    let h13 = _mm512_and_si512(qh, _mm512_set1_epi8(0xCCu8 as i8));
                    let sel =
                        |nib: __m512i, hi: __m512i| _mm512_ternarylogic_epi32::<0xE4>(nib, hi, low);
                    // Groups `32n + l + 8j`: low nibbles of the two `ql` words, then high
                    // ones, each with its pair of `qh` bits as bits 4-5.
                    let w = [
                        sel(ql0, _mm512_slli_epi16::<4>(h02)),
                        sel(ql1, _mm512_slli_epi16::<2>(h13)),
                        sel(_mm512_srli_epi16::<4>(ql0), h02),
                        sel(_mm512_srli_epi16::<4>(ql1), _mm512_srli_epi16::<2>(h13)),
                    ];
                    for (j, &wj) in w.iter().enumerate() {
                        let group = 32 * n + l + 8 * j;
                        let scale = scales[group / 4];
                        for i in 0..M {
                            let x = bcast(a[i].add(256 * sb + 4 * group));
                            // Below 2·63·128 in i16: no saturation.
                            let dot = _mm512_maddubs_epi16(wj, x);
                            lane[i][j % 2] = dpwssd!(lane[i][j % 2], scale, dot);
                        }
                    }
                }
                for i in 0..M {
                    let sum = _mm512_add_epi32(lane[i][0], lane[i][1]);
                    acc[i][l] = _mm512_fmadd_ps(d[i], _mm512_cvtepi32_ps(sum), acc[i][l]);
                }
            }
        }
        let mut out = [[0f32; X16]; M];
        for i in 0..M {
            let sum = hsum_float_8_lanes(&acc[i]);
            _mm512_storeu_ps(out[i].as_mut_ptr(), sum);
        }
        out
    }
}

/// [`group_vnni`] in plain Rust, row by row from the plain bytes: the same integers and
/// float steps.
// Indices name rows and lanes across several arrays at once.
#[allow(clippy::needless_range_loop)]
fn group_portable<const M: usize>(
    g: *const u8,
    nsb: usize,
    a: [*const u8; M],
    lay: &ActLayout,
) -> [[f32; X16]; M] {
    let mut acc = [[[0f32; 8]; X16]; M];
    for sb in 0..nsb {
        // SAFETY: the caller's promise that `g` holds `nsb` blocks.
        let blk = unsafe { std::slice::from_raw_parts(g.add(sb * SB_BYTES), SB_BYTES) };
        let mut row = [0u8; BLOCK];
        for r in 0..X16 {
            plain_row(blk, 1, r, &mut row);
            // Value `p` of the super-block, 0..64.
            let q = |p: usize| {
                let (n, l) = (p / 128, p % 128);
                let (ql, shift) = (row[64 * n + l % 64], 4 * (l / 64));
                let qh = row[128 + 32 * n + l % 32] >> (2 * (l / 32)) & 3;
                (ql >> shift & 0xF | qh << 4) as i32
            };
            let sc = |s: usize| row[192 + s] as i8 as i32;
            let dw = half::f16::from_le_bytes([row[208], row[209]]).to_f32();
            for i in 0..M {
                let x = |p: usize| unsafe { *a[i].add(256 * sb + p).cast::<i8>() } as i32;
                let bsum = |s: usize| unsafe {
                    a[i].add(lay.a)
                        .cast::<i16>()
                        .add(16 * sb + s)
                        .read_unaligned()
                } as i32;
                let d = unsafe { rdf32(a[i].add(lay.d), sb) } * dw;
                for l in 0..8 {
                    let mut lane = 0i32;
                    for group in (l..64).step_by(8) {
                        let dot: i32 = (0..4).map(|u| q(4 * group + u) * x(4 * group + u)).sum();
                        lane += sc(group / 4) * dot;
                    }
                    lane -= 32 * (bsum(2 * l) * sc(2 * l) + bsum(2 * l + 1) * sc(2 * l + 1));
                    acc[i][r][l] = d.mul_add(lane as f32, acc[i][r][l]);
                }
            }
        }
    }
    std::array::from_fn(|i| std::array::from_fn(|r| hsum_float_8(&acc[i][r])))
}
