//! [`Qv`] with AVX2 (and FMA, F16C): a 64-byte vector is two `__m256i`. Also the 8-lane
//! helpers and float side that the AVX-512 implementation shares.

use super::QR;
use super::qv::Qv;
use std::arch::x86_64::*;

/// AVX2: a 64-byte vector is two `__m256i`, one per group.
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

#[derive(Clone, Copy)]
pub(crate) struct Y2(__m256i, __m256i);

#[inline(always)]
pub(super) unsafe fn loadu256(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p.cast()) }
}
#[inline(always)]
pub(super) unsafe fn loadu128(p: *const u8) -> __m128i {
    unsafe { _mm_loadu_si128(p.cast()) }
}
/// 16 bytes at `p0`, then 16 at `p1`.
#[inline(always)]
pub(super) unsafe fn load16x2(p0: *const u8, p1: *const u8) -> __m256i {
    unsafe { _mm256_set_m128i(loadu128(p1), loadu128(p0)) }
}
/// Eight vectors of eight i32 to `[r0..r3 sums of the low 128 bits, r0..r3 of the high]`
/// for `v[0..4]`, and the same for `v[4..8]`.
#[inline(always)]
unsafe fn hadd_tree(v: [__m256i; 8]) -> (__m256i, __m256i) {
    unsafe {
        let s01 = _mm256_hadd_epi32(v[0], v[1]);
        let s23 = _mm256_hadd_epi32(v[2], v[3]);
        let s45 = _mm256_hadd_epi32(v[4], v[5]);
        let s67 = _mm256_hadd_epi32(v[6], v[7]);
        (_mm256_hadd_epi32(s01, s23), _mm256_hadd_epi32(s45, s67))
    }
}
/// Eight vectors of eight i32 to one vector of their eight sums.
#[inline(always)]
unsafe fn reduce8(v: [__m256i; 8]) -> __m256i {
    unsafe {
        let (t0, t1) = hadd_tree(v);
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(t0, t1),
            _mm256_permute2x128_si256::<0x31>(t0, t1),
        )
    }
}
/// Eight vectors of eight i32 to the sums of their low 128 bits and of their high 128 bits.
#[inline(always)]
pub(super) unsafe fn reduce8_halves(v: [__m256i; 8]) -> (__m256i, __m256i) {
    unsafe {
        let (t0, t1) = hadd_tree(v);
        (
            _mm256_permute2x128_si256::<0x20>(t0, t1),
            _mm256_permute2x128_si256::<0x31>(t0, t1),
        )
    }
}
#[inline(always)]
unsafe fn mins_dot8_x86(mins: &[u64; QR], s: *const i16) -> __m256i {
    unsafe {
        let b = _mm_loadu_si128(s.cast());
        let row = |r: usize| {
            let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins[r] as i64));
            _mm_madd_epi16(m, b)
        };
        // [row r's four partial sums | row r+4's].
        let y = |r: usize| _mm256_set_m128i(row(r + 4), row(r));
        let h01 = _mm256_hadd_epi32(y(0), y(1));
        let h23 = _mm256_hadd_epi32(y(2), y(3));
        _mm256_hadd_epi32(h01, h23)
    }
}
/// vpshufb control giving every i16 lane the value of lane `j` of its 128-bit half.
#[inline(always)]
unsafe fn pick16(j: usize) -> __m256i {
    unsafe { _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16) }
}

/// The 8-lane float and integer side, shared by both x86 sets.
macro_rules! float_side {
    () => {
        #[inline(always)]
        unsafe fn isplat(v: i32) -> __m256i {
            unsafe { _mm256_set1_epi32(v) }
        }
        #[inline(always)]
        unsafe fn iadd(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_add_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn isub(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_sub_epi32(a, b) }
        }
        #[inline(always)]
        unsafe fn cvt(a: __m256i) -> __m256 {
            unsafe { _mm256_cvtepi32_ps(a) }
        }
        #[inline(always)]
        unsafe fn fzero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn fsplat(v: f32) -> __m256 {
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn fmul(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fadd(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn fsub(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_sub_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn f16x8(h: [u64; 2]) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_set_epi64x(h[1] as i64, h[0] as i64)) }
        }
        #[inline(always)]
        unsafe fn fstore(p: *mut f32, a: __m256) {
            unsafe { _mm256_storeu_ps(p, a) }
        }
        /// Into L2, not L1: decode prefetches a whole tile of rows ahead, and as many lines
        /// requested into L1 fill its few miss buffers, stalling the demand loads behind
        /// them (with `T0`, a 1536-wide Q4_K matrix streamed at half the rate of a long one).
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
        }
    };
}
pub(super) use float_side;

/// 16 f32 lanes as two halves.
#[derive(Clone, Copy)]
pub(crate) struct F2y(__m256, __m256);

unsafe impl Qv for Avx2 {
    type V = Y2;
    type I = __m256i;
    type F = __m256;
    type F2 = F2y;

    #[inline(always)]
    unsafe fn ffma(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn q41_lanes(a: Y2, b: Y2, c: Y2, d: Y2) -> [Y2; 4] {
        unsafe {
            let lo = |x: __m256i, y: __m256i| _mm256_permute2x128_si256::<0x20>(x, y);
            let hi = |x: __m256i, y: __m256i| _mm256_permute2x128_si256::<0x31>(x, y);
            [
                Y2(lo(a.0, b.0), lo(c.0, d.0)),
                Y2(hi(a.0, b.0), hi(c.0, d.0)),
                Y2(lo(a.1, b.1), lo(c.1, d.1)),
                Y2(hi(a.1, b.1), hi(c.1, d.1)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn cvt2(v: Y2) -> F2y {
        unsafe { F2y(_mm256_cvtepi32_ps(v.0), _mm256_cvtepi32_ps(v.1)) }
    }
    #[inline(always)]
    unsafe fn f2zero() -> F2y {
        unsafe { F2y(_mm256_setzero_ps(), _mm256_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn f2splat(v: f32) -> F2y {
        unsafe { F2y(_mm256_set1_ps(v), _mm256_set1_ps(v)) }
    }
    #[inline(always)]
    unsafe fn fmul2(a: F2y, b: F2y) -> F2y {
        unsafe { F2y(_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn ffma2(a: F2y, b: F2y, c: F2y) -> F2y {
        unsafe {
            F2y(
                _mm256_fmadd_ps(a.0, b.0, c.0),
                _mm256_fmadd_ps(a.1, b.1, c.1),
            )
        }
    }
    #[inline(always)]
    unsafe fn pair_splat(f: __m256, p: usize) -> F2y {
        unsafe {
            F2y(
                _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(2 * p as i32)),
                _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(2 * p as i32 + 1)),
            )
        }
    }
    #[inline(always)]
    unsafe fn f2store(p: *mut f32, a: F2y) {
        unsafe {
            _mm256_storeu_ps(p, a.0);
            _mm256_storeu_ps(p.add(8), a.1);
        }
    }
    #[inline(always)]
    unsafe fn pair16(a: Y2, b: Y2) -> Y2 {
        unsafe {
            let m = _mm256_set1_epi32(0xFFFF);
            let f = |x: __m256i, y: __m256i| {
                _mm256_or_si256(_mm256_and_si256(x, m), _mm256_slli_epi32::<16>(y))
            };
            Y2(f(a.0, b.0), f(a.1, b.1))
        }
    }
    #[inline(always)]
    unsafe fn scales_q6(p: *const i8) -> Y2 {
        unsafe {
            // Dwords (p0,p4), (p1,p5), (p2,p6), (p3,p7), each spread over four lanes.
            let s = _mm_cvtepi8_epi16(_mm_loadl_epi64(p.cast()));
            let d = _mm256_castsi128_si256(_mm_unpacklo_epi16(s, _mm_srli_si128::<8>(s)));
            Y2(
                _mm256_permutevar8x32_epi32(d, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
                _mm256_permutevar8x32_epi32(d, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)),
            )
        }
    }
    #[inline(always)]
    unsafe fn q6_fold(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_add_epi32(a.0, a.1), _mm256_add_epi32(b.0, b.1)) }
    }
    #[inline(always)]
    unsafe fn q6_mins(sa: *const i8, sb: *const i8, bs: *const i16) -> Y2 {
        unsafe {
            let b = loadu256(bs.cast());
            let m = |sc: *const i8| {
                let s = _mm256_cvtepi8_epi16(loadu128(sc.cast()));
                _mm256_slli_epi32::<5>(_mm256_madd_epi16(b, s))
            };
            Y2(m(sa), m(sb))
        }
    }
    #[inline(always)]
    unsafe fn isub2(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_sub_epi32(a.0, b.0), _mm256_sub_epi32(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn iadd2(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_add_epi32(a.0, b.0), _mm256_add_epi32(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn mullo(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_mullo_epi32(a.0, b.0), _mm256_mullo_epi32(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn bcast32(p: *const u8) -> Y2 {
        unsafe {
            let v = _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
            Y2(v, v)
        }
    }
    #[inline(always)]
    unsafe fn zip_halves(a: Y2) -> Y2 {
        unsafe {
            let lo = _mm256_unpacklo_epi32(a.0, a.1);
            let hi = _mm256_unpackhi_epi32(a.0, a.1);
            Y2(
                _mm256_permute2x128_si256::<0x20>(lo, hi),
                _mm256_permute2x128_si256::<0x31>(lo, hi),
            )
        }
    }
    #[inline(always)]
    unsafe fn bcast64(p: *const u8) -> Y2 {
        unsafe {
            let v = _mm256_set1_epi64x(p.cast::<i64>().read_unaligned());
            Y2(v, v)
        }
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: Y2) {
        unsafe {
            _mm256_storeu_si256(p.cast(), v.0);
            _mm256_storeu_si256(p.add(32).cast(), v.1);
        }
    }
    #[inline(always)]
    unsafe fn f2load(p: *const u8) -> F2y {
        unsafe { F2y(_mm256_loadu_ps(p.cast()), _mm256_loadu_ps(p.add(32).cast())) }
    }
    #[inline(always)]
    unsafe fn fsub2(a: F2y, b: F2y) -> F2y {
        unsafe { F2y(_mm256_sub_ps(a.0, b.0), _mm256_sub_ps(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn fadd2(a: F2y, b: F2y) -> F2y {
        unsafe { F2y(_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1)) }
    }

    #[inline(always)]
    unsafe fn zero() -> Y2 {
        unsafe { Y2(_mm256_setzero_si256(), _mm256_setzero_si256()) }
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Y2 {
        unsafe { Y2(loadu256(p), loadu256(p.add(32))) }
    }
    #[inline(always)]
    unsafe fn load2(p0: *const u8, p1: *const u8) -> Y2 {
        unsafe { Y2(loadu256(p0), loadu256(p1)) }
    }
    #[inline(always)]
    unsafe fn nib_pair(p0: *const u8, p1: *const u8) -> Y2 {
        unsafe {
            let x = load16x2(p0, p1);
            let m = _mm256_set1_epi8(0x0F);
            Y2(
                _mm256_and_si256(x, m),
                _mm256_and_si256(_mm256_srli_epi16::<4>(x), m),
            )
        }
    }
    #[inline(always)]
    unsafe fn dup_shr<const S: u32>(p: *const u8) -> Y2 {
        unsafe {
            let x = loadu256(p);
            Y2(x, _mm256_srl_epi16(x, _mm_cvtsi32_si128(S as i32)))
        }
    }
    #[inline(always)]
    unsafe fn and(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_and_si256(a.0, b.0), _mm256_and_si256(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn or(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_or_si256(a.0, b.0), _mm256_or_si256(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn splat8(v: u8) -> Y2 {
        unsafe {
            let x = _mm256_set1_epi8(v as i8);
            Y2(x, x)
        }
    }
    #[inline(always)]
    unsafe fn shl3(a: Y2) -> Y2 {
        unsafe { Y2(_mm256_slli_epi16::<3>(a.0), _mm256_slli_epi16::<3>(a.1)) }
    }
    #[inline(always)]
    unsafe fn shl4(a: Y2) -> Y2 {
        unsafe { Y2(_mm256_slli_epi16::<4>(a.0), _mm256_slli_epi16::<4>(a.1)) }
    }
    #[inline(always)]
    unsafe fn shr4(a: Y2) -> Y2 {
        unsafe { Y2(_mm256_srli_epi16::<4>(a.0), _mm256_srli_epi16::<4>(a.1)) }
    }
    #[inline(always)]
    unsafe fn abs8(a: Y2) -> Y2 {
        unsafe { Y2(_mm256_abs_epi8(a.0), _mm256_abs_epi8(a.1)) }
    }
    #[inline(always)]
    unsafe fn sign8(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_sign_epi8(a.0, b.0), _mm256_sign_epi8(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: Y2, a: Y2, b: Y2) -> Y2 {
        unsafe {
            let one = _mm256_set1_epi16(1);
            Y2(
                _mm256_add_epi32(
                    acc.0,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(a.0, b.0), one),
                ),
                _mm256_add_epi32(
                    acc.1,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(a.1, b.1), one),
                ),
            )
        }
    }
    #[inline(always)]
    unsafe fn maddubs(a: Y2, b: Y2) -> Y2 {
        unsafe {
            Y2(
                _mm256_maddubs_epi16(a.0, b.0),
                _mm256_maddubs_epi16(a.1, b.1),
            )
        }
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: Y2, a: Y2, b: Y2) -> Y2 {
        unsafe {
            Y2(
                _mm256_add_epi32(acc.0, _mm256_madd_epi16(a.0, b.0)),
                _mm256_add_epi32(acc.1, _mm256_madd_epi16(a.1, b.1)),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales8(v: u64) -> Y2 {
        unsafe {
            let s = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(v as i64));
            let s = _mm256_broadcastsi128_si256(s);
            Y2(s, s)
        }
    }
    #[inline(always)]
    unsafe fn scale_pick(s: Y2, j0: usize, j1: usize) -> Y2 {
        unsafe {
            Y2(
                _mm256_shuffle_epi8(s.0, pick16(j0)),
                _mm256_shuffle_epi8(s.1, pick16(j1)),
            )
        }
    }
    #[inline(always)]
    unsafe fn packs32(a: Y2, b: Y2) -> Y2 {
        unsafe { Y2(_mm256_packs_epi32(a.0, b.0), _mm256_packs_epi32(a.1, b.1)) }
    }
    #[inline(always)]
    unsafe fn scale_pick4(s: Y2, j: [usize; 4]) -> Y2 {
        unsafe {
            let c = |a: usize, b: usize| {
                let pa = ((2 * a + 1) << 8) | (2 * a);
                let pb = ((2 * b + 1) << 8) | (2 * b);
                _mm256_set1_epi64x((pa | pa << 16 | pb << 32 | pb << 48) as i64)
            };
            Y2(
                _mm256_shuffle_epi8(s.0, c(j[0], j[1])),
                _mm256_shuffle_epi8(s.1, c(j[2], j[3])),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales8_i8(p: *const i8) -> Y2 {
        unsafe {
            // The eight as i16 in both 128-bit lanes, so that one in-lane byte shuffle spreads
            // any two of them over a vector's halves ([`Qv::scales4`]): a super-block's
            // sixteen take two widenings and eight shuffles. (Spreading four at a time from a
            // 64-bit broadcast, LLVM emitted three shuffles for each `vpshufb`: 28 in all.)
            let s = _mm256_cvtepi8_epi16(_mm_set1_epi64x(p.cast::<i64>().read_unaligned()));
            Y2(s, s)
        }
    }
    #[inline(always)]
    unsafe fn scales4(t: Y2, s: usize) -> Y2 {
        unsafe {
            let spread = |lo: usize, hi: usize| {
                let (l0, l1) = ((2 * lo) as i8, (2 * lo + 1) as i8);
                let (h0, h1) = ((2 * hi) as i8, (2 * hi + 1) as i8);
                _mm256_setr_epi8(
                    l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, l0, l1, //
                    h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1, h0, h1,
                )
            };
            Y2(
                _mm256_shuffle_epi8(t.0, spread(4 * s, 4 * s + 1)),
                _mm256_shuffle_epi8(t.1, spread(4 * s + 2, 4 * s + 3)),
            )
        }
    }
    #[inline(always)]
    unsafe fn reduce(v: &[Y2; QR]) -> (__m256i, __m256i) {
        unsafe {
            (
                reduce8(std::array::from_fn(|r| v[r].0)),
                reduce8(std::array::from_fn(|r| v[r].1)),
            )
        }
    }
    #[inline(always)]
    unsafe fn reduce_x(v: &[Y2; QR]) -> (__m256i, __m256i) {
        unsafe { reduce8_halves(std::array::from_fn(|r| _mm256_add_epi32(v[r].0, v[r].1))) }
    }
    #[inline(always)]
    unsafe fn mins_dot8(mins: &[u64; QR], s: *const i16) -> __m256i {
        unsafe { mins_dot8_x86(mins, s) }
    }
    #[inline(always)]
    unsafe fn regroup(a: Y2, b: Y2) -> (Y2, Y2) {
        (Y2(a.0, b.0), Y2(a.1, b.1))
    }
    float_side!();
}
