//! Q8_0 interleaved. A group of 16 rows holds the bytes of its plain rows (16 × 34 a block),
//! its `k / 32` blocks in pairs ([`super::paired`]), the `qs` first so that every 64-byte step
//! lies on a cache line of its own (a load across two lines reads L2 at half the rate):
//!
//! | bytes      | what                                                                      |
//! |------------|---------------------------------------------------------------------------|
//! | 0..512     | the first block's `qs`: for step `t < 8`, 64 bytes, row `r`'s bytes      |
//! |            | `4t .. 4t + 4` at `4r`, each XOR `0x80` (see below)                       |
//! | 512..1024  | the second block's `qs`, as the first's                                   |
//! | 1024..1056 | the first block's `d` of rows 0..16 (f16)                                 |
//! | 1056..1088 | the second block's `d`                                                    |
//!
//! A last, unpaired block is its `qs`, then its `d`s.
//!
//! A step holds values `4t..4t+4` of each row. The tile ([`super::super::tiles`]' `tile_q32`)
//! sums a block's products in one exact integer per row and adds `(d_w·d_x)·sum` to one f32
//! per row in block order; lane `r` here does the same for row `r`. `vpdpbusd` multiplies
//! unsigned bytes by signed ones, so the weights are stored XOR `0x80`, as `q + 128`: their
//! sum with the broadcast activations is `Σq·x + 128·Σx`, and the activation block's sum takes
//! the second term off exactly (a `vpxor` per step in the kernel instead ran as fast, within
//! the noise, but costs the VNNI kernel an operation; the AVX2 one takes it off either way).
//! [`plain_row`] takes the bias back off. The activations are plain Q8_0 blocks
//! ([`super::super::ActKind::Q8`]), values in order.

use super::super::act::ActLayout;
use super::super::rows::QIsa;
use super::super::tiles::rdf32;
use super::{GroupKernel, X16, paired};

/// Bytes of one plain Q8_0 block.
const BLOCK: usize = 34;
/// Bytes of a group's block's `qs`.
const QS: usize = X16 * 32;
/// What the stored weight bytes are XORed with: a value `q` becomes the u8 `q + 128`.
const BIAS: u8 = 0x80;

pub(super) fn interleave(src: &[u8], rows: usize, k: usize, dst: &mut [u8]) {
    let nb = k / 32;
    let row_bytes = nb * BLOCK;
    for g in 0..rows / X16 {
        let out = &mut dst[g * X16 * row_bytes..][..X16 * row_bytes];
        for b in 0..nb {
            let (qs, d) = paired::block_at::<QS>(b, nb);
            for r in 0..X16 {
                let blk = &src[(g * X16 + r) * row_bytes + b * BLOCK..][..BLOCK];
                out[d + 2 * r..d + 2 * r + 2].copy_from_slice(&blk[0..2]);
                for t in 0..8 {
                    let at = qs + 64 * t + 4 * r;
                    for (o, &q) in out[at..at + 4].iter_mut().zip(&blk[2 + 4 * t..6 + 4 * t]) {
                        *o = q ^ BIAS;
                    }
                }
            }
        }
    }
}

/// Row `r` of the group at `group` (`nb` blocks) as a plain row, into `out`: the bias taken
/// off the weights.
pub(super) fn plain_row(group: &[u8], nb: usize, r: usize, out: &mut [u8]) {
    for b in 0..nb {
        let (qs, d) = paired::block_at::<QS>(b, nb);
        let blk = &mut out[b * BLOCK..][..BLOCK];
        blk[0..2].copy_from_slice(&group[d + 2 * r..d + 2 * r + 2]);
        for t in 0..8 {
            let at = qs + 64 * t + 4 * r;
            for (o, &q) in blk[2 + 4 * t..6 + 4 * t].iter_mut().zip(&group[at..at + 4]) {
                *o = q ^ BIAS;
            }
        }
    }
}

/// The Q8_0 kernels.
pub(super) struct Q80;

impl GroupKernel for Q80 {
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
        let bcast = |p: *const u8| _mm512_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut acc = [_mm512_setzero_ps(); M];
        paired::each_block::<QS>(
            g,
            nb,
            ahead,
            #[inline(always)]
            |qs, d, b| {
                let mut sums = [_mm512_setzero_si512(); M];
                for t in 0..8 {
                    // The block's lines one by one beside the work, as Q4_K's kernel does.
                    _mm_prefetch::<_MM_HINT_T1>(qs.add(ahead + 64 * t).cast());
                    let v = _mm512_loadu_si512(qs.add(64 * t).cast());
                    for i in 0..M {
                        sums[i] = _mm512_dpbusd_epi32(sums[i], v, bcast(a[i].add(32 * b + 4 * t)));
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(d.cast()));
                for i in 0..M {
                    // The weights stand for `q + 128`.
                    let xsum = a[i].add(lay.a).cast::<i32>().add(b).read();
                    let s = _mm512_sub_epi32(sums[i], _mm512_set1_epi32(128 * xsum));
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(rdf32(a[i].add(lay.d), b)));
                    acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
                }
            },
        );
        let mut out = [[0f32; X16]; M];
        for i in 0..M {
            _mm512_storeu_ps(out[i].as_mut_ptr(), acc[i]);
        }
        out
    }
}

/// [`group_vnni`] with 256-bit vectors and without VNNI, against one activation row: each
/// 64-byte step as two halves of eight rows. `vpmaddubsw` of `q + 128` could saturate i16
/// (2·255·127), so it takes `|q|` and the activations with `q`'s sign, as the tile does
/// (pairs at most 2·128·127), then `vpmaddwd` by ones: the block's exact integer per row, as
/// `vpdpbusd` gives it; the float steps are the same.
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
        let bias = _mm256_set1_epi8(BIAS as i8);
        let ones = _mm256_set1_epi16(1);
        let bcast = |p: *const u8| _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
        let mut acc = [_mm256_setzero_ps(); 2];
        paired::each_block::<QS>(
            g,
            nb,
            ahead,
            #[inline(always)]
            |qs, d, b| {
                let mut sums = [_mm256_setzero_si256(); 2];
                for t in 0..8 {
                    _mm_prefetch::<_MM_HINT_T1>(qs.add(ahead + 64 * t).cast());
                    let x = bcast(a.add(32 * b + 4 * t));
                    for (h, sum) in sums.iter_mut().enumerate() {
                        let v = _mm256_loadu_si256(qs.add(64 * t + 32 * h).cast());
                        let q = _mm256_xor_si256(v, bias);
                        let pairs =
                            _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
                        *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones));
                    }
                }
                let dx = _mm256_set1_ps(rdf32(a.add(lay.d), b));
                for (h, acc) in acc.iter_mut().enumerate() {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(d.add(16 * h).cast()));
                    let s = _mm256_cvtepi32_ps(sums[h]);
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_mul_ps(dw, dx), s));
                }
            },
        );
        let mut out = [0f32; X16];
        _mm256_storeu_ps(out.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(out[8..].as_mut_ptr(), acc[1]);
        out
    }
}

/// [`group_vnni`] in plain Rust, row by row from the plain bytes: the same integers and
/// float steps.
// Indices name rows and lanes across several arrays at once.
#[allow(clippy::needless_range_loop)]
fn group_portable<const M: usize>(
    g: *const u8,
    nb: usize,
    a: [*const u8; M],
    lay: &ActLayout,
) -> [[f32; X16]; M] {
    // SAFETY: the caller's promise that `g` holds a group of `nb` blocks.
    let group = unsafe { std::slice::from_raw_parts(g, X16 * nb * BLOCK) };
    let mut acc = [[0f32; X16]; M];
    let mut row = vec![0u8; nb * BLOCK];
    for r in 0..X16 {
        plain_row(group, nb, r, &mut row);
        for (b, blk) in row.chunks_exact(BLOCK).enumerate() {
            let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            for i in 0..M {
                let x = |v: usize| unsafe { *a[i].add(32 * b + v).cast::<i8>() } as i32;
                let sum: i32 = (0..32).map(|v| blk[2 + v] as i8 as i32 * x(v)).sum();
                let dx = unsafe { rdf32(a[i].add(lay.d), b) };
                acc[i][r] += dw * dx * sum as f32;
            }
        }
    }
    acc
}
