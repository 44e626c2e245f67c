//! The vector operations the kernels are written in, one implementation per instruction set
//! ([`super::portable`], [`super::avx2`], [`super::avx512`]): integer products and reductions
//! on 64-byte vectors, and the 8- and 16-lane float steps after them.

use super::QR;
use crate::quant::scales_mins_k4_u64;

/// 64 bytes of integer lanes, seen as two 32-byte groups `g0`, `g1` (which hold different
/// blocks or sub-blocks), and the 8-lane i32/f32 vectors a reduction produces.
///
/// # Safety
/// Implementations use instructions of one target feature set; callers only use one when the
/// CPU has that set. Pointers must be valid for the bytes read.
pub(crate) unsafe trait Qv: Copy {
    type V: Copy;
    type I: Copy;
    type F: Copy;
    /// 16 f32 lanes.
    type F2: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const u8) -> Self::V;
    /// `g0 = p0[..32]`, `g1 = p1[..32]`.
    unsafe fn load2(p0: *const u8, p1: *const u8) -> Self::V;
    /// 16 nibble bytes at `p0` and 16 at `p1`: `g0` = the low nibbles (`p0`'s, then `p1`'s),
    /// `g1` = the high nibbles, in the same order.
    unsafe fn nib_pair(p0: *const u8, p1: *const u8) -> Self::V;
    /// `g0 = p[..32]`, `g1` = the same shifted right by `S` bits in 16-bit lanes.
    unsafe fn dup_shr<const S: u32>(p: *const u8) -> Self::V;
    unsafe fn and(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn or(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn splat8(v: u8) -> Self::V;
    /// Shifts 16-bit lanes left by 3.
    unsafe fn shl3(a: Self::V) -> Self::V;
    /// Shifts 16-bit lanes left by 4.
    unsafe fn shl4(a: Self::V) -> Self::V;
    /// Shifts 16-bit lanes right by 4.
    unsafe fn shr4(a: Self::V) -> Self::V;
    /// `|a|` per i8 lane, as u8.
    unsafe fn abs8(a: Self::V) -> Self::V;
    /// `a` with the sign of `b` per i8 lane (any value where `b` is 0).
    unsafe fn sign8(a: Self::V, b: Self::V) -> Self::V;
    /// Whether [`Qv::dpbusd`] is one instruction: the K kernels then form sums of four
    /// products and pack two vectors of them ([`Qv::packs32`]) before one scaling
    /// `dpwssd`, instead of scaling each vector's sums of two (`maddubs`).
    const FAST_DPBUSD: bool = false;
    /// i32 lane `l` += Σ of the four products `a[4l+t]` (u8) · `b[4l+t]` (i8).
    unsafe fn dpbusd(acc: Self::V, a: Self::V, b: Self::V) -> Self::V;
    /// i16 lane `l` = `a[2l]·b[2l] + a[2l+1]·b[2l+1]`, `a` u8, `b` i8 (inputs never saturate).
    unsafe fn maddubs(a: Self::V, b: Self::V) -> Self::V;
    /// i32 lane `l` += `a[2l]·b[2l] + a[2l+1]·b[2l+1]` over i16 lanes.
    unsafe fn dpwssd(acc: Self::V, a: Self::V, b: Self::V) -> Self::V;
    /// Eight u8 scales (the bytes of `v`, little-endian), widened to i16 lanes 0–7 (the rest
    /// unspecified): the form [`Qv::scale_pick`] picks from.
    unsafe fn scales8(v: u64) -> Self::V;
    /// i16 lanes: scale `j0` of `s` (from [`Qv::scales8`]) in all of `g0`, `j1` in `g1`.
    unsafe fn scale_pick(s: Self::V, j0: usize, j1: usize) -> Self::V;
    /// Per 128-bit quarter `q` (i32 lanes `4q..4q+4`): i16 lanes `8q..8q+4` = `a`'s lanes
    /// narrowed, `8q+4..8q+8` = `b`'s (saturating; callers' values always fit).
    unsafe fn packs32(a: Self::V, b: Self::V) -> Self::V;
    /// i16 lanes, per quarter `q` of 8: the first four scale `j[2·(q/2)]`, the last four
    /// `j[2·(q/2) + 1]` — the scales of a [`Qv::packs32`] of two `g0`/`g1` vectors.
    unsafe fn scale_pick4(s: Self::V, j: [usize; 4]) -> Self::V;
    /// Eight i8 scales at `p` (half a Q6_K super-block's), widened once per block into the
    /// form [`Qv::scales4`] spreads from.
    unsafe fn scales8_i8(p: *const i8) -> Self::V;
    /// i16 lanes: the 16-byte quarter `q` all scale `4s + q` of `t` (from
    /// [`Qv::scales8_i8`]), `q < 4`, `s < 2`.
    unsafe fn scales4(t: Self::V, s: usize) -> Self::V;
    /// For 8 vectors of i32 lanes: lane `r` of the first result is the sum of `v[r].g0`'s
    /// lanes, of the second the sum of `v[r].g1`'s.
    unsafe fn reduce(v: &[Self::V; QR]) -> (Self::I, Self::I);
    /// As [`Qv::reduce`], but the first result sums 16-byte quarters 0 and 2 of each vector,
    /// the second quarters 1 and 3 (the blocks [`Qv::nib_pair`] interleaves).
    unsafe fn reduce_x(v: &[Self::V; QR]) -> (Self::I, Self::I);
    /// Lane `r`: `Σ_t mins[r].byte(t)·s[t]`, `t < 8`.
    unsafe fn mins_dot8(mins: &[u64; QR], s: *const i16) -> Self::I;
    /// `(g0(a) | g0(b), g1(a) | g1(b))`.
    unsafe fn regroup(a: Self::V, b: Self::V) -> (Self::V, Self::V);
    /// Four Q4_1 blocks from `p`: the low nibbles of their `qs` (16 bytes a block, in block
    /// order), and the high nibbles.
    #[inline(always)]
    unsafe fn nib_quad_q41(p: *const u8) -> (Self::V, Self::V) {
        unsafe {
            let a = Self::nib_pair(p.add(4), p.add(24));
            let b = Self::nib_pair(p.add(44), p.add(64));
            Self::regroup(a, b)
        }
    }
    /// `d` and `m` of the four Q4_1 blocks at each `p[r]`, widened.
    #[inline(always)]
    unsafe fn meta_q41(p: &[*const u8; QR]) -> [(Self::F, Self::F); 4] {
        std::array::from_fn(|q| {
            let mut d = [0u64; 2];
            let mut m = [0u64; 2];
            for (r, &pr) in p.iter().enumerate() {
                unsafe {
                    put16(&mut d, r, rd16(pr.add(20 * q)));
                    put16(&mut m, r, rd16(pr.add(20 * q + 2)));
                }
            }
            unsafe { (Self::f16x8(d), Self::f16x8(m)) }
        })
    }
    /// The header of each row's Q4_K/Q5_K super-block at `blk[r]`: stores the eight 6-bit
    /// scales and mins as [`scales_mins_k4_u64`] gives them, returns `d` and `dmin` widened.
    #[inline(always)]
    unsafe fn k4_meta(
        blk: &[*const u8; QR],
        sc: &mut [u64; QR],
        mn: &mut [u64; QR],
    ) -> (Self::F, Self::F) {
        let mut dw = [0u64; 2];
        let mut dm = [0u64; 2];
        for r in 0..QR {
            unsafe {
                put16(&mut dw, r, rd16(blk[r]));
                put16(&mut dm, r, rd16(blk[r].add(2)));
                (sc[r], mn[r]) = scales_mins_k4_u64(&*blk[r].add(4).cast::<[u8; 12]>());
            }
        }
        unsafe { (Self::f16x8(dw), Self::f16x8(dm)) }
    }
    unsafe fn isplat(v: i32) -> Self::I;
    unsafe fn iadd(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn isub(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn cvt(a: Self::I) -> Self::F;
    unsafe fn fzero() -> Self::F;
    unsafe fn fsplat(v: f32) -> Self::F;
    unsafe fn fmul(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn fadd(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn fsub(a: Self::F, b: Self::F) -> Self::F;
    /// Eight f16 values (four per word, from the low bits up), widened.
    unsafe fn f16x8(h: [u64; 2]) -> Self::F;
    unsafe fn fstore(p: *mut f32, a: Self::F);
    /// `a·b + c`, one rounding.
    unsafe fn ffma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// Per 128-bit quarter `q`: `[a.q, b.q, c.q, d.q]` (a 4×4 transpose of quarters). With
    /// `a`, `b` a row's low- and high-nibble sums of four Q4_1 blocks and `c`, `d` the next
    /// row's, result `q` holds block `q`'s eight lanes of `ggml_vec_dot_q4_1_q8_1` for both.
    unsafe fn q41_lanes(a: Self::V, b: Self::V, c: Self::V, d: Self::V) -> [Self::V; 4];
    /// 16 i32 lanes to f32.
    unsafe fn cvt2(v: Self::V) -> Self::F2;
    unsafe fn f2zero() -> Self::F2;
    unsafe fn f2splat(v: f32) -> Self::F2;
    unsafe fn fmul2(a: Self::F2, b: Self::F2) -> Self::F2;
    /// `a·b + c` over 16 lanes, one rounding.
    unsafe fn ffma2(a: Self::F2, b: Self::F2, c: Self::F2) -> Self::F2;
    /// Lane `r` of `f` (`r = 2p`) in lanes 0–7, lane `2p + 1` in lanes 8–15.
    unsafe fn pair_splat(f: Self::F, p: usize) -> Self::F2;
    unsafe fn f2store(p: *mut f32, a: Self::F2);
    /// i32 lane `j`: the low 16 bits of `a[j]`, then `b[j]` in the high 16 (two i16 sums).
    unsafe fn pair16(a: Self::V, b: Self::V) -> Self::V;
    /// i32 lane `j` as two i16: `p[j/4]`, `p[4 + j/4]` (i8): the Q6_K sub-block scales of
    /// [`Qv::pair16`] of two 64-value sums.
    unsafe fn scales_q6(p: *const i8) -> Self::V;
    /// `[a[l] + a[l+8] for l < 8, b[l] + b[l+8] for l < 8]` over i32 lanes.
    unsafe fn q6_fold(a: Self::V, b: Self::V) -> Self::V;
    /// i32 lane `l < 8`: `32·(bs[2l]·sa[2l] + bs[2l+1]·sa[2l+1])`; lanes 8–15 the same with
    /// `sb` (Q6_K's offset term, as `ggml_vec_dot_q6_K_q8_K` forms it).
    unsafe fn q6_mins(sa: *const i8, sb: *const i8, bs: *const i16) -> Self::V;
    unsafe fn isub2(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn iadd2(a: Self::V, b: Self::V) -> Self::V;
    /// i32 lanes `a·b` (the low 32 bits).
    unsafe fn mullo(a: Self::V, b: Self::V) -> Self::V;
    /// The i32 at `p` in every lane.
    unsafe fn bcast32(p: *const u8) -> Self::V;
    /// The eight bytes at `p` in every 64-bit lane.
    unsafe fn bcast64(p: *const u8) -> Self::V;
    /// i32 lanes `[a0, a8, a1, a9, …, a7, a15]`: each lane of the first half beside the same
    /// lane of the second.
    unsafe fn zip_halves(a: Self::V) -> Self::V;
    unsafe fn store(p: *mut u8, v: Self::V);
    /// 16 f32 from `p`.
    unsafe fn f2load(p: *const u8) -> Self::F2;
    unsafe fn fsub2(a: Self::F2, b: Self::F2) -> Self::F2;
    unsafe fn fadd2(a: Self::F2, b: Self::F2) -> Self::F2;
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        let _ = p;
    }
}

#[inline(always)]
pub(super) unsafe fn rd16(p: *const u8) -> u16 {
    unsafe { p.cast::<u16>().read_unaligned() }
}

/// Puts row `r`'s f16 bits where [`Qv::f16x8`] takes them: kept in registers, not memory.
#[inline(always)]
pub(super) fn put16(h: &mut [u64; 2], r: usize, bits: u16) {
    h[r / 4] |= (bits as u64) << (16 * (r % 4));
}
