//! [`Qv`] with AVX-512 BW, with or without VNNI: a 64-byte vector is one `__m512i`.

use super::QR;
use super::avx2::{float_side, load16x2, loadu128, loadu256, reduce8_halves};
use super::qv::Qv;
use std::arch::x86_64::*;

/// AVX-512 BW (with VNNI's `vpdpbusd`/`vpdpwssd` when `VNNI`): one `__m512i`, `g0` the
/// low half.
#[derive(Clone, Copy)]
pub(crate) struct Avx512<const VNNI: bool>;

unsafe impl<const VNNI: bool> Qv for Avx512<VNNI> {
    type V = __m512i;
    type I = __m256i;
    type F = __m256;
    type F2 = __m512;
    const FAST_DPBUSD: bool = VNNI;

    #[inline(always)]
    unsafe fn ffma(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn q41_lanes(a: __m512i, b: __m512i, c: __m512i, d: __m512i) -> [__m512i; 4] {
        unsafe {
            // [a0 a1 b0 b1], [a2 a3 b2 b3], [c0 c1 d0 d1], [c2 c3 d2 d3], then pick.
            let t0 = _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b);
            let t1 = _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b);
            let t2 = _mm512_shuffle_i64x2::<0b01_00_01_00>(c, d);
            let t3 = _mm512_shuffle_i64x2::<0b11_10_11_10>(c, d);
            [
                _mm512_shuffle_i64x2::<0b10_00_10_00>(t0, t2),
                _mm512_shuffle_i64x2::<0b11_01_11_01>(t0, t2),
                _mm512_shuffle_i64x2::<0b10_00_10_00>(t1, t3),
                _mm512_shuffle_i64x2::<0b11_01_11_01>(t1, t3),
            ]
        }
    }
    #[inline(always)]
    unsafe fn cvt2(v: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn f2zero() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn f2splat(v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn fmul2(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn ffma2(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn pair_splat(f: __m256, p: usize) -> __m512 {
        unsafe {
            let idx = _mm512_inserti64x4::<1>(
                _mm512_set1_epi32(2 * p as i32),
                _mm256_set1_epi32(2 * p as i32 + 1),
            );
            _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(f))
        }
    }
    #[inline(always)]
    unsafe fn f2store(p: *mut f32, a: __m512) {
        unsafe { _mm512_storeu_ps(p, a) }
    }
    #[inline(always)]
    unsafe fn pair16(a: __m512i, b: __m512i) -> __m512i {
        unsafe {
            _mm512_or_si512(
                _mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)),
                _mm512_slli_epi32::<16>(b),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales_q6(p: *const i8) -> __m512i {
        unsafe {
            // Dwords (p0,p4), (p1,p5), (p2,p6), (p3,p7), each spread over four lanes.
            let s = _mm_cvtepi8_epi16(_mm_loadl_epi64(p.cast()));
            let d = _mm512_castsi128_si512(_mm_unpacklo_epi16(s, _mm_srli_si128::<8>(s)));
            let idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            _mm512_permutexvar_epi32(idx, d)
        }
    }
    #[inline(always)]
    unsafe fn q6_fold(a: __m512i, b: __m512i) -> __m512i {
        unsafe {
            _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b),
                _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b),
            )
        }
    }
    #[inline(always)]
    unsafe fn q6_mins(sa: *const i8, sb: *const i8, bs: *const i16) -> __m512i {
        unsafe {
            let s = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_cvtepi8_epi16(loadu128(sa.cast()))),
                _mm256_cvtepi8_epi16(loadu128(sb.cast())),
            );
            let b = _mm512_broadcast_i64x4(loadu256(bs.cast()));
            _mm512_slli_epi32::<5>(_mm512_madd_epi16(b, s))
        }
    }
    #[inline(always)]
    unsafe fn isub2(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn iadd2(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn mullo(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_mullo_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn bcast32(p: *const u8) -> __m512i {
        unsafe { _mm512_set1_epi32(p.cast::<i32>().read_unaligned()) }
    }
    #[inline(always)]
    unsafe fn zip_halves(a: __m512i) -> __m512i {
        unsafe {
            let idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
            _mm512_permutexvar_epi32(idx, a)
        }
    }
    #[inline(always)]
    unsafe fn bcast64(p: *const u8) -> __m512i {
        unsafe { _mm512_set1_epi64(p.cast::<i64>().read_unaligned()) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: __m512i) {
        unsafe { _mm512_storeu_si512(p.cast(), v) }
    }
    #[inline(always)]
    unsafe fn f2load(p: *const u8) -> __m512 {
        unsafe { _mm512_loadu_ps(p.cast()) }
    }
    #[inline(always)]
    unsafe fn fsub2(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fadd2(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn zero() -> __m512i {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load2(p0: *const u8, p1: *const u8) -> __m512i {
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(loadu256(p0)), loadu256(p1)) }
    }
    #[inline(always)]
    unsafe fn nib_pair(p0: *const u8, p1: *const u8) -> __m512i {
        unsafe {
            let a = load16x2(p0, p1);
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), _mm256_srli_epi16::<4>(a));
            _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
        }
    }
    #[inline(always)]
    unsafe fn dup_shr<const S: u32>(p: *const u8) -> __m512i {
        unsafe {
            let a = loadu256(p);
            let shifted = _mm256_srl_epi16(a, _mm_cvtsi32_si128(S as i32));
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), shifted)
        }
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn splat8(v: u8) -> __m512i {
        unsafe { _mm512_set1_epi8(v as i8) }
    }
    #[inline(always)]
    unsafe fn shl3(a: __m512i) -> __m512i {
        unsafe { _mm512_slli_epi16::<3>(a) }
    }
    #[inline(always)]
    unsafe fn shl4(a: __m512i) -> __m512i {
        unsafe { _mm512_slli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn shr4(a: __m512i) -> __m512i {
        unsafe { _mm512_srli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn abs8(a: __m512i) -> __m512i {
        unsafe { _mm512_abs_epi8(a) }
    }
    #[inline(always)]
    unsafe fn sign8(a: __m512i, b: __m512i) -> __m512i {
        unsafe {
            let neg = _mm512_movepi8_mask(b);
            _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a)
        }
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        unsafe {
            if VNNI {
                _mm512_dpbusd_epi32(acc, a, b)
            } else {
                let pairs = _mm512_maddubs_epi16(a, b);
                _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))
            }
        }
    }
    #[inline(always)]
    unsafe fn maddubs(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_maddubs_epi16(a, b) }
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        unsafe {
            if VNNI {
                // The saturating form: the same sums, which never come near saturation
                // (kernels' bounds), and LLVM cannot split it into `vpmaddwd` + `vpaddd`
                // to shorten a dependency chain, which costs throughput here.
                _mm512_dpwssds_epi32(acc, a, b)
            } else {
                _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
            }
        }
    }
    #[inline(always)]
    unsafe fn scales8(v: u64) -> __m512i {
        unsafe { _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(v as i64))) }
    }
    #[inline(always)]
    unsafe fn scale_pick(s: __m512i, j0: usize, j1: usize) -> __m512i {
        unsafe {
            let idx =
                _mm512_inserti64x4::<1>(_mm512_set1_epi16(j0 as i16), _mm256_set1_epi16(j1 as i16));
            _mm512_permutexvar_epi16(idx, s)
        }
    }
    #[inline(always)]
    unsafe fn packs32(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_packs_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn scale_pick4(s: __m512i, j: [usize; 4]) -> __m512i {
        unsafe {
            let q = |a: usize| (a as i64) * 0x0001_0001_0001_0001;
            let idx = _mm512_setr_epi64(
                q(j[0]),
                q(j[1]),
                q(j[0]),
                q(j[1]),
                q(j[2]),
                q(j[3]),
                q(j[2]),
                q(j[3]),
            );
            _mm512_permutexvar_epi16(idx, s)
        }
    }
    #[inline(always)]
    unsafe fn scales8_i8(p: *const i8) -> __m512i {
        unsafe {
            let s = _mm_cvtepi8_epi16(_mm_loadl_epi64(p.cast()));
            _mm512_castsi128_si512(s)
        }
    }
    #[inline(always)]
    unsafe fn scales4(t: __m512i, s: usize) -> __m512i {
        unsafe {
            let q = |q: usize| (0x0001_0001_0001_0001 * (4 * s + q) as u64) as i64;
            let idx = _mm512_set_epi64(q(3), q(3), q(2), q(2), q(1), q(1), q(0), q(0));
            _mm512_permutexvar_epi16(idx, t)
        }
    }
    #[inline(always)]
    unsafe fn reduce(v: &[__m512i; QR]) -> (__m256i, __m256i) {
        unsafe {
            // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3].
            let pair = |a: __m512i, b: __m512i| {
                _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
            };
            // Per 128-bit lane: the four rows' sums over that lane.
            let quad = |ab: __m512i, cd: __m512i| {
                _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
            };
            let u0 = quad(pair(v[0], v[1]), pair(v[2], v[3]));
            let u1 = quad(pair(v[4], v[5]), pair(v[6], v[7]));
            // Lanes 0,1 hold g0, lanes 2,3 hold g1: add lane 0 to 1 and lane 2 to 3.
            let a = _mm512_shuffle_i64x2::<0b10_00_10_00>(u0, u1);
            let b = _mm512_shuffle_i64x2::<0b11_01_11_01>(u0, u1);
            let s = _mm512_add_epi32(a, b);
            let s = _mm512_shuffle_i64x2::<0b11_01_10_00>(s, s);
            (_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s))
        }
    }
    #[inline(always)]
    unsafe fn reduce_x(v: &[__m512i; QR]) -> (__m256i, __m256i) {
        unsafe {
            reduce8_halves(std::array::from_fn(|r| {
                _mm256_add_epi32(
                    _mm512_castsi512_si256(v[r]),
                    _mm512_extracti64x4_epi64::<1>(v[r]),
                )
            }))
        }
    }
    #[inline(always)]
    unsafe fn mins_dot8(mins: &[u64; QR], s: *const i16) -> __m256i {
        unsafe {
            // Each row's eight mins widened to one 128-bit lane, times the eight sums.
            let m = _mm512_loadu_si512(mins.as_ptr().cast());
            let b = _mm512_broadcast_i32x4(_mm_loadu_si128(s.cast()));
            let a = _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(m)), b);
            let c = _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(m)), b);
            // Lane `r`: [a0+a2, c0+c2, a1+a3, c1+c3], then row r's sum, row r+4's.
            let e = _mm512_add_epi32(_mm512_unpacklo_epi32(a, c), _mm512_unpackhi_epi32(a, c));
            let f = _mm512_add_epi32(e, _mm512_shuffle_epi32::<0b01_00_11_10>(e));
            let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
            _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, f))
        }
    }
    #[inline(always)]
    unsafe fn regroup(a: __m512i, b: __m512i) -> (__m512i, __m512i) {
        unsafe {
            (
                _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b),
                _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b),
            )
        }
    }
    #[inline(always)]
    unsafe fn nib_quad_q41(p: *const u8) -> (__m512i, __m512i) {
        unsafe {
            // The four blocks' `qs` are dwords 1-4, 6-9, 11-14 of `p[..64]` and 12-15 of
            // `p[16..80]`.
            let a = _mm512_loadu_si512(p.cast());
            let b = _mm512_loadu_si512(p.add(16).cast());
            let idx = _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 28, 29, 30, 31);
            let q = _mm512_permutex2var_epi32(a, idx, b);
            let m = _mm512_set1_epi8(0x0F);
            (
                _mm512_and_si512(q, m),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q), m),
            )
        }
    }
    #[inline(always)]
    unsafe fn meta_q41(p: &[*const u8; QR]) -> [(__m256, __m256); 4] {
        unsafe {
            // `d | m << 16` of block q is dword 5q of `p[r][..64]`.
            let l: [__m512i; QR] = std::array::from_fn(|r| _mm512_loadu_si512(p[r].cast()));
            let i2 = _mm512_setr_epi32(0, 5, 10, 15, 16, 21, 26, 31, 0, 0, 0, 0, 0, 0, 0, 0);
            // [row r's blocks 0-3, row r+1's], in the low 256 bits.
            let pr = |r: usize| _mm512_permutex2var_epi32(l[r], i2, l[r + 1]);
            let q0 = _mm512_inserti64x4::<1>(pr(0), _mm512_castsi512_si256(pr(2)));
            let q1 = _mm512_inserti64x4::<1>(pr(4), _mm512_castsi512_si256(pr(6)));
            // q0 lane 4r + q: row r, block q (rows 0-3); q1 rows 4-7.
            let ia = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
            let ib = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
            let z01 = _mm512_permutex2var_epi32(q0, ia, q1);
            let z23 = _mm512_permutex2var_epi32(q0, ib, q1);
            let dm = |z: __m512i| {
                let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(z));
                let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(z)));
                (d, m)
            };
            let (d01, m01) = dm(z01);
            let (d23, m23) = dm(z23);
            let lo = |f: __m512| _mm512_castps512_ps256(f);
            let hi = |f: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(f)));
            [
                (lo(d01), lo(m01)),
                (hi(d01), hi(m01)),
                (lo(d23), lo(m23)),
                (hi(d23), hi(m23)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn k4_meta(
        blk: &[*const u8; QR],
        sc: &mut [u64; QR],
        mn: &mut [u64; QR],
    ) -> (__m256, __m256) {
        unsafe {
            // Each row's 16-byte header (d, dmin, the 12 packed bytes) in one 128-bit
            // lane, four rows a vector.
            let four = |r0: usize| {
                let v = _mm512_castsi128_si512(loadu128(blk[r0]));
                let v = _mm512_inserti32x4::<1>(v, loadu128(blk[r0 + 1]));
                let v = _mm512_inserti32x4::<2>(v, loadu128(blk[r0 + 2]));
                _mm512_inserti32x4::<3>(v, loadu128(blk[r0 + 3]))
            };
            let (v0, v1) = (four(0), four(4));
            // `scales_mins_k4_u64` on dwords [dm, u0, u1, u2] of each lane, giving
            // [sc_lo, sc_hi, m_lo, m_hi].
            let k1 = 0x3f3f3f3f;
            let k2 = 0x0f0f0f0f;
            let k3 = 0x03030303;
            let mask_lo = _mm512_setr_epi32(
                k1, k2, k1, k2, k1, k2, k1, k2, k1, k2, k1, k2, k1, k2, k1, k2,
            );
            let mask_hi = _mm512_setr_epi32(0, k3, 0, k3, 0, k3, 0, k3, 0, k3, 0, k3, 0, k3, 0, k3);
            let shift = _mm512_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4);
            let decode = |v: __m512i| {
                // [u0, u2, u1, u2] and [u0, u0, u1, u1].
                let p = _mm512_shuffle_epi32::<0b11_10_11_01>(v);
                let q = _mm512_shuffle_epi32::<0b10_10_01_01>(v);
                let lo = _mm512_and_si512(_mm512_srlv_epi32(p, shift), mask_lo);
                let hi = _mm512_and_si512(_mm512_srli_epi32::<6>(q), mask_hi);
                _mm512_or_si512(lo, _mm512_slli_epi32::<4>(hi))
            };
            let (o0, o1) = (decode(v0), decode(v1));
            let even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
            let odd = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
            _mm512_storeu_si512(
                sc.as_mut_ptr().cast(),
                _mm512_permutex2var_epi64(o0, even, o1),
            );
            _mm512_storeu_si512(
                mn.as_mut_ptr().cast(),
                _mm512_permutex2var_epi64(o0, odd, o1),
            );
            // Dword 0 of each lane: d | dmin << 16, rows 0..8; then d's, dmin's.
            let idx = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
            let dd = _mm512_castsi512_si256(_mm512_permutex2var_epi32(v0, idx, v1));
            let d = _mm256_cvtepi32_epi16(dd);
            let dmin = _mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(dd));
            (_mm256_cvtph_ps(d), _mm256_cvtph_ps(dmin))
        }
    }
    float_side!();
}
