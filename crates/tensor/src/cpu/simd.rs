//! The vector operations the CPU kernels are written in, once per instruction set.
//!
//! Kernels are generic over [`Simd`] and monomorphised inside `#[target_feature]` entry points,
//! so one kernel source serves AVX-512, AVX2 and a portable fallback. Every horizontal sum
//! uses one fixed tree (lane `l` with `l + LANES/2`, then `l + LANES/4`, …), which is what
//! makes a dot product's result independent of the kernel that computed it.

/// A SIMD register of f32 lanes and the operations the kernels need.
///
/// # Safety
/// Implementations use instructions of one target feature set; callers must only use an
/// implementation when [`super::Isa::detect`] found that set, and every pointer must be valid
/// for the lanes read or written (`n` lanes for the `_partial` forms).
pub(crate) unsafe trait Simd: Copy {
    const LANES: usize;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    /// Loads `n < LANES` values; the other lanes are zero.
    unsafe fn load_partial(p: *const f32, n: usize) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn store_partial(p: *mut f32, v: Self::V, n: usize);
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    unsafe fn load_bf16_partial(p: *const u16, n: usize) -> Self::V;
    unsafe fn load_f16(p: *const u16) -> Self::V;
    unsafe fn load_f16_partial(p: *const u16, n: usize) -> Self::V;
    /// `a * b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// Rounds to the nearest integer, ties to even.
    unsafe fn round(v: Self::V) -> Self::V;
    /// Rounds to the nearest f16 value, ties to even (`half::f16::from_f32(x).to_f32()`).
    unsafe fn round_f16(v: Self::V) -> Self::V;
    /// `2^n` for lanes holding integers `n` in the normal exponent range.
    unsafe fn pow2i(n: Self::V) -> Self::V;
    unsafe fn hsum(v: Self::V) -> f32;
    /// `[hsum(v[0]), …, hsum(v[3])]`, the same bits: sets with wide registers take the four
    /// trees' steps side by side.
    #[inline(always)]
    unsafe fn hsum4(v: [Self::V; 4]) -> [f32; 4] {
        unsafe {
            [
                Self::hsum(v[0]),
                Self::hsum(v[1]),
                Self::hsum(v[2]),
                Self::hsum(v[3]),
            ]
        }
    }
    /// Hints that the cache line at `p` will be read soon.
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        let _ = p;
    }

    /// `e^x` exactly as llama.cpp's `ggml_v_expf` computes it with AVX-512 (ggml-cpu
    /// `vec.h`; within 2 ulp): `n = round(x·log2 e)` by the 1.5·2²³ trick, `b = x − n·ln 2` in
    /// two parts, a degree-5 polynomial in `b`, then `j·2ⁿ` (`_mm512_scalef_ps`), 0 below
    /// and ∞ above the range. Softmax and SiLU use it, so their results are llama.cpp's to the
    /// bit, and every instruction set computes the same bits.
    #[inline(always)]
    unsafe fn exp(x: Self::V) -> Self::V {
        unsafe {
            // Beyond ±1000 the result is 0 or ∞ either way; clamping keeps ±∞ from making NaN.
            let x = Self::min(Self::max(x, Self::splat(-1000.0)), Self::splat(1000.0));
            let r = Self::splat(f32::from_bits(0x4b40_0000)); // 0x1.8p23
            let z = Self::fma(x, Self::splat(f32::from_bits(0x3fb8_aa3b)), r); // log2 e
            let n = Self::add(z, Self::splat(-f32::from_bits(0x4b40_0000)));
            // b = x − n·0x1.62e4p-1 − n·0x1.7f7d1cp-20 (two fnmadds)
            let b = Self::fma(n, Self::splat(-f32::from_bits(0x3f31_7200)), x);
            let b = Self::fma(n, Self::splat(-f32::from_bits(0x35bf_be8e)), b);
            let u = Self::mul(b, b);
            let c = |bits: u32| Self::splat(f32::from_bits(bits));
            let hi = Self::fma(
                Self::fma(c(0x3c07_2010), b, c(0x3d2b_9f17)), // 0x1.0e4020p-7, 0x1.573e2ep-5
                u,
                Self::fma(c(0x3e2a_af33), b, c(0x3eff_fedb)), // 0x1.555e66p-3, 0x1.fffdb6p-2
            );
            let j = Self::fma(hi, u, Self::fma(c(0x3f7f_fff6), b, Self::splat(1.0))); // 0x1.ffffecp-1
            // scalef(j, n) = j·2ⁿ rounded once: two exact power-of-two steps, the first exact.
            let n = Self::min(Self::max(n, Self::splat(-250.0)), Self::splat(250.0));
            let n1 = Self::round(Self::mul(n, Self::splat(0.5)));
            let n2 = Self::add(n, Self::mul(n1, Self::splat(-1.0)));
            Self::mul(Self::mul(j, Self::pow2i(n1)), Self::pow2i(n2))
        }
    }
}

/// How a stored weight element becomes f32 lanes.
pub(crate) trait WeightElem: Copy + Send + Sync + 'static {
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
    unsafe fn load_partial<S: Simd>(p: *const Self, n: usize) -> S::V;
    fn to_f32(self) -> f32;
}

impl WeightElem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        unsafe { S::load(p) }
    }
    #[inline(always)]
    unsafe fn load_partial<S: Simd>(p: *const f32, n: usize) -> S::V {
        unsafe { S::load_partial(p, n) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// bf16 weights, stored as raw bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct Bf16(pub u16);

/// f16 weights, stored as raw bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct F16(pub u16);

impl WeightElem for Bf16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const Bf16) -> S::V {
        unsafe { S::load_bf16(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_partial<S: Simd>(p: *const Bf16, n: usize) -> S::V {
        unsafe { S::load_bf16_partial(p.cast(), n) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::dtype::bf16_to_f32(self.0)
    }
}

impl WeightElem for F16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const F16) -> S::V {
        unsafe { S::load_f16(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_partial<S: Simd>(p: *const F16, n: usize) -> S::V {
        unsafe { S::load_f16_partial(p.cast(), n) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::dtype::f16_to_f32(self.0)
    }
}

/// Plain Rust over 16 lanes; compilers vectorise it to whatever the baseline target offers.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

const PORTABLE_LANES: usize = 16;

unsafe impl Simd for Portable {
    const LANES: usize = PORTABLE_LANES;
    type V = [f32; PORTABLE_LANES];

    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; PORTABLE_LANES]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; PORTABLE_LANES]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        unsafe { p.cast::<Self::V>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> Self::V {
        let mut v = [0.0; PORTABLE_LANES];
        for (i, lane) in v.iter_mut().enumerate().take(n) {
            *lane = unsafe { *p.add(i) };
        }
        v
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        unsafe { p.cast::<Self::V>().write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn store_partial(p: *mut f32, v: Self::V, n: usize) {
        for (i, lane) in v.iter().enumerate().take(n) {
            unsafe { *p.add(i) = *lane };
        }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self::V {
        let raw = unsafe { p.cast::<[u16; PORTABLE_LANES]>().read_unaligned() };
        raw.map(crate::dtype::bf16_to_f32)
    }
    #[inline(always)]
    unsafe fn load_bf16_partial(p: *const u16, n: usize) -> Self::V {
        let mut v = [0.0; PORTABLE_LANES];
        for (i, lane) in v.iter_mut().enumerate().take(n) {
            *lane = crate::dtype::bf16_to_f32(unsafe { *p.add(i) });
        }
        v
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self::V {
        let raw = unsafe { p.cast::<[u16; PORTABLE_LANES]>().read_unaligned() };
        raw.map(crate::dtype::f16_to_f32)
    }
    #[inline(always)]
    unsafe fn load_f16_partial(p: *const u16, n: usize) -> Self::V {
        let mut v = [0.0; PORTABLE_LANES];
        for (i, lane) in v.iter_mut().enumerate().take(n) {
            *lane = crate::dtype::f16_to_f32(unsafe { *p.add(i) });
        }
        v
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        // Fused, as the vector sets' FMA instructions: one rounding.
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] / b[i])
    }
    #[inline(always)]
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i].max(b[i]))
    }
    #[inline(always)]
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i].min(b[i]))
    }
    #[inline(always)]
    unsafe fn round(v: Self::V) -> Self::V {
        v.map(f32::round_ties_even)
    }
    #[inline(always)]
    unsafe fn round_f16(v: Self::V) -> Self::V {
        v.map(|x| half::f16::from_f32(x).to_f32())
    }
    #[inline(always)]
    unsafe fn pow2i(n: Self::V) -> Self::V {
        n.map(|n| f32::from_bits(((n as i32 + 127) as u32) << 23))
    }
    #[inline(always)]
    unsafe fn hsum(v: Self::V) -> f32 {
        let mut w = v;
        let mut half = PORTABLE_LANES / 2;
        while half > 0 {
            for i in 0..half {
                w[i] += w[i + half];
            }
            half /= 2;
        }
        w[0]
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Simd;
    use std::arch::x86_64::*;

    /// AVX-512 F/BW/VL: 16 f32 lanes, masked loads for tails.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    #[inline(always)]
    fn mask16(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    unsafe impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;

        #[inline(always)]
        unsafe fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_partial(p: *const f32, n: usize) -> __m512 {
            unsafe { _mm512_maskz_loadu_ps(mask16(n), p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn store_partial(p: *mut f32, v: __m512, n: usize) {
            unsafe { _mm512_mask_storeu_ps(p, mask16(n), v) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            unsafe {
                let raw = _mm256_loadu_si256(p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
            }
        }
        #[inline(always)]
        unsafe fn load_bf16_partial(p: *const u16, n: usize) -> __m512 {
            unsafe {
                let raw = _mm256_maskz_loadu_epi16(mask16(n), p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
            }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
        #[inline(always)]
        unsafe fn load_f16_partial(p: *const u16, n: usize) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16(n), p.cast())) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_div_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_max_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn min(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_min_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn round(v: __m512) -> __m512 {
            unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
        }
        #[inline(always)]
        unsafe fn round_f16(v: __m512) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
        }
        #[inline(always)]
        unsafe fn pow2i(n: __m512) -> __m512 {
            unsafe {
                _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                    _mm512_cvtps_epi32(n),
                    _mm512_set1_epi32(127),
                )))
            }
        }
        /// Into L2, as the quantized kernels do (`quant_dot::avx2`'s `prefetch` says why).
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
        }
        #[inline(always)]
        unsafe fn hsum(v: __m512) -> f32 {
            unsafe {
                let lo = _mm512_castps512_ps256(v);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                hsum8(_mm256_add_ps(lo, hi))
            }
        }
        #[inline(always)]
        unsafe fn hsum4(v: [__m512; 4]) -> [f32; 4] {
            unsafe {
                // Lane l + l+8: two vectors' halves side by side, [v0 | v1] and [v2 | v3].
                let fold8 = |a: __m512, b: __m512| {
                    let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
                    let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
                    _mm512_add_ps(lo, hi)
                };
                let (s01, s23) = (fold8(v[0], v[1]), fold8(v[2], v[3]));
                // l + l+4: vector k's four sums in 128-bit lane k.
                let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(s01, s23);
                let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(s01, s23);
                let s4 = _mm512_add_ps(lo, hi);
                // l + l+2, then l + l+1, within each 128-bit lane (as `hsum8`).
                let s2 = _mm512_add_ps(s4, _mm512_permute_ps::<0b11_10_11_10>(s4));
                let s1 = _mm512_add_ps(s2, _mm512_permute_ps::<0b01_01_01_01>(s2));
                let mut out = [0f32; 16];
                _mm512_storeu_ps(out.as_mut_ptr(), s1);
                [out[0], out[4], out[8], out[12]]
            }
        }
    }

    /// The tree shared by both x86 sets: (l, l+4), (l, l+2), (l, l+1) over 8 lanes.
    #[inline(always)]
    unsafe fn hsum8(v: __m256) -> f32 {
        unsafe {
            let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
            _mm_cvtss_f32(s1)
        }
    }

    /// AVX2 + FMA + F16C: 8 f32 lanes; tails go through a zero-padded copy.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    unsafe impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;

        #[inline(always)]
        unsafe fn zero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_partial(p: *const f32, n: usize) -> __m256 {
            let mut tmp = [0f32; 8];
            unsafe {
                std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
                _mm256_loadu_ps(tmp.as_ptr())
            }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn store_partial(p: *mut f32, v: __m256, n: usize) {
            let mut tmp = [0f32; 8];
            unsafe {
                _mm256_storeu_ps(tmp.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), p, n);
            }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            unsafe {
                let raw = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
            }
        }
        #[inline(always)]
        unsafe fn load_bf16_partial(p: *const u16, n: usize) -> __m256 {
            let mut tmp = [0u16; 8];
            unsafe {
                std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
                Self::load_bf16(tmp.as_ptr())
            }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
        #[inline(always)]
        unsafe fn load_f16_partial(p: *const u16, n: usize) -> __m256 {
            let mut tmp = [0u16; 8];
            unsafe {
                std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
                Self::load_f16(tmp.as_ptr())
            }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn div(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_div_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_max_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn min(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_min_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn round(v: __m256) -> __m256 {
            unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
        }
        #[inline(always)]
        unsafe fn round_f16(v: __m256) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
        }
        #[inline(always)]
        unsafe fn pow2i(n: __m256) -> __m256 {
            unsafe {
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                    _mm256_cvtps_epi32(n),
                    _mm256_set1_epi32(127),
                )))
            }
        }
        /// Into L2, as the quantized kernels do (`quant_dot::avx2`'s `prefetch` says why).
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
        }
        #[inline(always)]
        unsafe fn hsum(v: __m256) -> f32 {
            unsafe { hsum8(v) }
        }
        #[inline(always)]
        unsafe fn hsum4(v: [__m256; 4]) -> [f32; 4] {
            unsafe {
                // Lane l + l+4: [v0 | v1] and [v2 | v3], a vector's four sums a 128-bit lane.
                let fold4 = |a: __m256, b: __m256| {
                    let lo = _mm256_permute2f128_ps::<0x20>(a, b);
                    let hi = _mm256_permute2f128_ps::<0x31>(a, b);
                    _mm256_add_ps(lo, hi)
                };
                let (s01, s23) = (fold4(v[0], v[1]), fold4(v[2], v[3]));
                // l + l+2: [0 | 1] and [2 | 3] lanes 0-1 from s01, 2-3 from s23.
                let lo = _mm256_shuffle_ps::<0b01_00_01_00>(s01, s23);
                let hi = _mm256_shuffle_ps::<0b11_10_11_10>(s01, s23);
                let s2 = _mm256_add_ps(lo, hi);
                // l + l+1: the four sums land in lanes 0, 2 (v0, v2) and 4, 6 (v1, v3).
                let s1 = _mm256_add_ps(s2, _mm256_permute_ps::<0b11_11_01_01>(s2));
                let mut out = [0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), s1);
                [out[0], out[4], out[2], out[6]]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_exp<S: Simd>() {
        // Below about -87.3 the result leaves the normal range and is clamped.
        for i in -1990..=2000 {
            let x = i as f32 * 0.0437;
            let got = unsafe {
                let mut out = [0f32; 16];
                S::store_partial(out.as_mut_ptr(), S::exp(S::splat(x)), 1);
                out[0]
            };
            let want = (x as f64).exp();
            assert!(
                ((got as f64 - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
    }

    fn check_round_f16<S: Simd>() {
        // Every f16 value and the points halfway between neighbours (ties go to even), across
        // subnormals, normals, overflow and both signs; plus values between those.
        let mut xs = Vec::new();
        for bits in 0..=u16::MAX {
            let x = half::f16::from_bits(bits).to_f32();
            if x.is_finite() {
                xs.push(x);
                let next = half::f16::from_bits(bits.wrapping_add(1)).to_f32();
                if next.is_finite() {
                    xs.push(((x as f64 + next as f64) / 2.0) as f32);
                    xs.push(x + (next - x) * 0.3);
                }
            }
        }
        xs.extend([70000.0, -70000.0, 1e-9, -1e-9, 0.0, -0.0]);
        for chunk in xs.chunks(S::LANES) {
            let mut out = [0f32; 16];
            unsafe {
                let v = S::load_partial(chunk.as_ptr(), chunk.len());
                S::store_partial(out.as_mut_ptr(), S::round_f16(v), chunk.len());
            }
            for (x, got) in chunk.iter().zip(out) {
                let want = half::f16::from_f32(*x).to_f32();
                assert_eq!(got.to_bits(), want.to_bits(), "round_f16({x:e})");
            }
        }
    }

    /// Runs `$check::<S>()` for the portable set and every x86 set this CPU has.
    macro_rules! on_every_available_set {
        ($check:ident) => {{
            $check::<Portable>();
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    #[target_feature(enable = "avx2,fma,f16c")]
                    unsafe fn avx2() {
                        $check::<Avx2>()
                    }
                    unsafe { avx2() };
                }
                if super::super::Isa::available().contains(&super::super::Isa::Avx512) {
                    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                    unsafe fn avx512() {
                        $check::<Avx512>()
                    }
                    unsafe { avx512() };
                }
            }
        }};
    }

    fn check_hsum4<S: Simd>() {
        // Sums whose rounding depends on the order of the adds: any other tree gives other
        // bits for some of them.
        let mut seed = 9u64;
        for _ in 0..2000 {
            let mut x = [0f32; 64];
            for e in x.iter_mut() {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                let m = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                *e = m * [1.0, 1e-7, 3e7][(seed >> 20) as usize % 3];
            }
            unsafe {
                let v: [S::V; 4] = std::array::from_fn(|k| S::load(x.as_ptr().add(k * S::LANES)));
                let each = v.map(|v| S::hsum(v).to_bits());
                assert_eq!(S::hsum4(v).map(f32::to_bits), each);
            }
        }
    }

    #[test]
    fn four_sums_side_by_side_are_each_alone_on_every_available_set() {
        on_every_available_set!(check_hsum4);
    }

    #[test]
    fn vector_f16_rounding_is_half_s_on_every_available_set() {
        on_every_available_set!(check_round_f16);
    }

    #[test]
    fn vector_exp_is_accurate_on_every_available_set() {
        on_every_available_set!(check_exp);
    }
}
