//! [`Qv`] in plain Rust, one lane at a time: the reference every instruction set must match
//! to the bit, and the road on other architectures.

use super::QR;
use super::qv::Qv;

/// Plain Rust, one lane at a time.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Pv([u8; 64]);

impl Pv {
    #[inline(always)]
    fn i8s(self) -> [i8; 64] {
        bytemuck::cast(self.0)
    }
    #[inline(always)]
    fn i16s(self) -> [i16; 32] {
        bytemuck::cast(self.0)
    }
    #[inline(always)]
    fn i32s(self) -> [i32; 16] {
        bytemuck::cast(self.0)
    }
    #[inline(always)]
    fn from_i16(v: [i16; 32]) -> Pv {
        Pv(bytemuck::cast(v))
    }
    #[inline(always)]
    fn from_i32(v: [i32; 16]) -> Pv {
        Pv(bytemuck::cast(v))
    }
    #[inline(always)]
    fn map16(self, f: impl Fn(u16) -> u16) -> Pv {
        Pv(bytemuck::cast(
            bytemuck::cast::<_, [u16; 32]>(self.0).map(f),
        ))
    }
}

/// Sum of i32 lanes `lanes` of `v`, wrapping as the vector units do.
fn lane_sum(v: &Pv, lanes: impl Iterator<Item = usize>) -> i32 {
    let v = v.i32s();
    lanes.fold(0i32, |s, l| s.wrapping_add(v[l]))
}

unsafe impl Qv for Portable {
    type V = Pv;
    type I = [i32; 8];
    type F = [f32; 8];
    type F2 = [f32; 16];

    #[inline(always)]
    unsafe fn ffma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn q41_lanes(a: Pv, b: Pv, c: Pv, d: Pv) -> [Pv; 4] {
        std::array::from_fn(|q| {
            let mut v = [0u8; 64];
            for (j, src) in [a, b, c, d].iter().enumerate() {
                v[16 * j..16 * j + 16].copy_from_slice(&src.0[16 * q..16 * q + 16]);
            }
            Pv(v)
        })
    }
    #[inline(always)]
    unsafe fn cvt2(v: Pv) -> [f32; 16] {
        v.i32s().map(|x| x as f32)
    }
    #[inline(always)]
    unsafe fn f2zero() -> [f32; 16] {
        [0.0; 16]
    }
    #[inline(always)]
    unsafe fn f2splat(v: f32) -> [f32; 16] {
        [v; 16]
    }
    #[inline(always)]
    unsafe fn fmul2(a: [f32; 16], b: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn ffma2(a: [f32; 16], b: [f32; 16], c: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn pair_splat(f: [f32; 8], p: usize) -> [f32; 16] {
        std::array::from_fn(|i| f[2 * p + i / 8])
    }
    #[inline(always)]
    unsafe fn f2store(p: *mut f32, a: [f32; 16]) {
        unsafe { p.cast::<[f32; 16]>().write_unaligned(a) }
    }
    #[inline(always)]
    unsafe fn pair16(a: Pv, b: Pv) -> Pv {
        let (a, b) = (a.i32s(), b.i32s());
        Pv::from_i32(std::array::from_fn(|j| (a[j] & 0xFFFF) | (b[j] << 16)))
    }
    #[inline(always)]
    unsafe fn scales_q6(p: *const i8) -> Pv {
        Pv::from_i16(std::array::from_fn(|l| {
            let j = l / 2;
            (unsafe { *p.add(if l % 2 == 0 { j / 4 } else { 4 + j / 4 }) }) as i16
        }))
    }
    #[inline(always)]
    unsafe fn q6_fold(a: Pv, b: Pv) -> Pv {
        let (a, b) = (a.i32s(), b.i32s());
        Pv::from_i32(std::array::from_fn(|j| {
            let v = if j < 8 { a } else { b };
            v[j % 8].wrapping_add(v[j % 8 + 8])
        }))
    }
    #[inline(always)]
    unsafe fn q6_mins(sa: *const i8, sb: *const i8, bs: *const i16) -> Pv {
        Pv::from_i32(std::array::from_fn(|j| {
            let (sc, l) = if j < 8 { (sa, j) } else { (sb, j - 8) };
            let t = |g: usize| unsafe { *sc.add(g) as i32 * bs.add(g).read_unaligned() as i32 };
            32 * (t(2 * l) + t(2 * l + 1))
        }))
    }
    #[inline(always)]
    unsafe fn isub2(a: Pv, b: Pv) -> Pv {
        let (a, b) = (a.i32s(), b.i32s());
        Pv::from_i32(std::array::from_fn(|j| a[j].wrapping_sub(b[j])))
    }
    #[inline(always)]
    unsafe fn iadd2(a: Pv, b: Pv) -> Pv {
        let (a, b) = (a.i32s(), b.i32s());
        Pv::from_i32(std::array::from_fn(|j| a[j].wrapping_add(b[j])))
    }
    #[inline(always)]
    unsafe fn mullo(a: Pv, b: Pv) -> Pv {
        let (a, b) = (a.i32s(), b.i32s());
        Pv::from_i32(std::array::from_fn(|j| a[j].wrapping_mul(b[j])))
    }
    #[inline(always)]
    unsafe fn bcast32(p: *const u8) -> Pv {
        Pv::from_i32([unsafe { p.cast::<i32>().read_unaligned() }; 16])
    }
    #[inline(always)]
    unsafe fn zip_halves(a: Pv) -> Pv {
        let a = a.i32s();
        Pv::from_i32(std::array::from_fn(|j| a[j / 2 + 8 * (j % 2)]))
    }
    #[inline(always)]
    unsafe fn bcast64(p: *const u8) -> Pv {
        Pv(bytemuck::cast(
            [unsafe { p.cast::<u64>().read_unaligned() }; 8],
        ))
    }
    #[inline(always)]
    unsafe fn store(p: *mut u8, v: Pv) {
        unsafe { p.cast::<[u8; 64]>().write_unaligned(v.0) }
    }
    #[inline(always)]
    unsafe fn f2load(p: *const u8) -> [f32; 16] {
        unsafe { p.cast::<[f32; 16]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn fsub2(a: [f32; 16], b: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    unsafe fn fadd2(a: [f32; 16], b: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i] + b[i])
    }

    #[inline(always)]
    unsafe fn zero() -> Pv {
        Pv([0; 64])
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Pv {
        Pv(unsafe { p.cast::<[u8; 64]>().read_unaligned() })
    }
    #[inline(always)]
    unsafe fn load2(p0: *const u8, p1: *const u8) -> Pv {
        let mut v = [0u8; 64];
        unsafe {
            std::ptr::copy_nonoverlapping(p0, v.as_mut_ptr(), 32);
            std::ptr::copy_nonoverlapping(p1, v.as_mut_ptr().add(32), 32);
        }
        Pv(v)
    }
    #[inline(always)]
    unsafe fn nib_pair(p0: *const u8, p1: *const u8) -> Pv {
        let mut v = [0u8; 64];
        for (h, p) in [p0, p1].into_iter().enumerate() {
            for j in 0..16 {
                let b = unsafe { *p.add(j) };
                v[16 * h + j] = b & 0xF;
                v[32 + 16 * h + j] = b >> 4;
            }
        }
        Pv(v)
    }
    #[inline(always)]
    unsafe fn dup_shr<const S: u32>(p: *const u8) -> Pv {
        let v = unsafe { Self::load2(p, p) };
        let mut w = v.map16(|x| x >> S);
        w.0[..32].copy_from_slice(&v.0[..32]);
        w
    }
    #[inline(always)]
    unsafe fn and(a: Pv, b: Pv) -> Pv {
        Pv(std::array::from_fn(|i| a.0[i] & b.0[i]))
    }
    #[inline(always)]
    unsafe fn or(a: Pv, b: Pv) -> Pv {
        Pv(std::array::from_fn(|i| a.0[i] | b.0[i]))
    }
    #[inline(always)]
    unsafe fn splat8(v: u8) -> Pv {
        Pv([v; 64])
    }
    #[inline(always)]
    unsafe fn shl3(a: Pv) -> Pv {
        a.map16(|x| x << 3)
    }
    #[inline(always)]
    unsafe fn shl4(a: Pv) -> Pv {
        a.map16(|x| x << 4)
    }
    #[inline(always)]
    unsafe fn shr4(a: Pv) -> Pv {
        a.map16(|x| x >> 4)
    }
    #[inline(always)]
    unsafe fn abs8(a: Pv) -> Pv {
        Pv(a.i8s().map(|x| x.unsigned_abs()))
    }
    #[inline(always)]
    unsafe fn sign8(a: Pv, b: Pv) -> Pv {
        let (a, b) = (a.i8s(), b.i8s());
        Pv(std::array::from_fn(|i| match b[i].signum() {
            -1 => a[i].wrapping_neg() as u8,
            0 => 0,
            _ => a[i] as u8,
        }))
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: Pv, a: Pv, b: Pv) -> Pv {
        let (mut acc, b8) = (acc.i32s(), b.i8s());
        for (l, s) in acc.iter_mut().enumerate() {
            for t in 0..4 {
                *s = s.wrapping_add(a.0[4 * l + t] as i32 * b8[4 * l + t] as i32);
            }
        }
        Pv::from_i32(acc)
    }
    #[inline(always)]
    unsafe fn maddubs(a: Pv, b: Pv) -> Pv {
        let b8 = b.i8s();
        Pv::from_i16(std::array::from_fn(|l| {
            let s =
                a.0[2 * l] as i32 * b8[2 * l] as i32 + a.0[2 * l + 1] as i32 * b8[2 * l + 1] as i32;
            s.clamp(i16::MIN as i32, i16::MAX as i32) as i16
        }))
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: Pv, a: Pv, b: Pv) -> Pv {
        let (mut acc, a, b) = (acc.i32s(), a.i16s(), b.i16s());
        for (l, s) in acc.iter_mut().enumerate() {
            let p = a[2 * l] as i32 * b[2 * l] as i32 + a[2 * l + 1] as i32 * b[2 * l + 1] as i32;
            *s = s.wrapping_add(p);
        }
        Pv::from_i32(acc)
    }
    #[inline(always)]
    unsafe fn scales8(v: u64) -> Pv {
        let b = v.to_le_bytes();
        Pv::from_i16(std::array::from_fn(|l| if l < 8 { b[l] as i16 } else { 0 }))
    }
    #[inline(always)]
    unsafe fn scale_pick(s: Pv, j0: usize, j1: usize) -> Pv {
        let s = s.i16s();
        Pv::from_i16(std::array::from_fn(|l| if l < 16 { s[j0] } else { s[j1] }))
    }
    #[inline(always)]
    unsafe fn packs32(a: Pv, b: Pv) -> Pv {
        let (a, b) = (a.i32s(), b.i32s());
        Pv::from_i16(std::array::from_fn(|l| {
            let (q, t) = (l / 8, l % 8);
            let v = if t < 4 {
                a[4 * q + t]
            } else {
                b[4 * q + t - 4]
            };
            v.clamp(i16::MIN as i32, i16::MAX as i32) as i16
        }))
    }
    #[inline(always)]
    unsafe fn scale_pick4(s: Pv, j: [usize; 4]) -> Pv {
        let s = s.i16s();
        Pv::from_i16(std::array::from_fn(|l| {
            let (q, t) = (l / 8, l % 8);
            s[j[2 * (q / 2) + usize::from(t >= 4)]]
        }))
    }
    #[inline(always)]
    unsafe fn scales8_i8(p: *const i8) -> Pv {
        let mut t = [0i16; 32];
        for (l, v) in t.iter_mut().take(8).enumerate() {
            *v = (unsafe { *p.add(l) }) as i16;
        }
        Pv::from_i16(t)
    }
    #[inline(always)]
    unsafe fn scales4(t: Pv, s: usize) -> Pv {
        let t = t.i16s();
        Pv::from_i16(std::array::from_fn(|l| t[4 * s + l / 8]))
    }
    #[inline(always)]
    unsafe fn reduce(v: &[Pv; QR]) -> ([i32; 8], [i32; 8]) {
        (
            std::array::from_fn(|r| lane_sum(&v[r], 0..8)),
            std::array::from_fn(|r| lane_sum(&v[r], 8..16)),
        )
    }
    #[inline(always)]
    unsafe fn reduce_x(v: &[Pv; QR]) -> ([i32; 8], [i32; 8]) {
        (
            std::array::from_fn(|r| lane_sum(&v[r], (0..4).chain(8..12))),
            std::array::from_fn(|r| lane_sum(&v[r], (4..8).chain(12..16))),
        )
    }
    #[inline(always)]
    unsafe fn regroup(a: Pv, b: Pv) -> (Pv, Pv) {
        let mut lo = [0u8; 64];
        let mut hi = [0u8; 64];
        lo[..32].copy_from_slice(&a.0[..32]);
        lo[32..].copy_from_slice(&b.0[..32]);
        hi[..32].copy_from_slice(&a.0[32..]);
        hi[32..].copy_from_slice(&b.0[32..]);
        (Pv(lo), Pv(hi))
    }
    #[inline(always)]
    unsafe fn mins_dot8(mins: &[u64; QR], s: *const i16) -> [i32; 8] {
        std::array::from_fn(|r| {
            let m = mins[r].to_le_bytes();
            (0..8).fold(0i32, |acc, t| {
                acc + m[t] as i32 * unsafe { s.add(t).read_unaligned() } as i32
            })
        })
    }
    #[inline(always)]
    unsafe fn isplat(v: i32) -> [i32; 8] {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn iadd(a: [i32; 8], b: [i32; 8]) -> [i32; 8] {
        std::array::from_fn(|i| a[i].wrapping_add(b[i]))
    }
    #[inline(always)]
    unsafe fn isub(a: [i32; 8], b: [i32; 8]) -> [i32; 8] {
        std::array::from_fn(|i| a[i].wrapping_sub(b[i]))
    }
    #[inline(always)]
    unsafe fn cvt(a: [i32; 8]) -> [f32; 8] {
        a.map(|x| x as f32)
    }
    #[inline(always)]
    unsafe fn fzero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn fsplat(v: f32) -> [f32; 8] {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn fmul(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn fadd(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn fsub(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    unsafe fn f16x8(h: [u64; 2]) -> [f32; 8] {
        std::array::from_fn(|i| crate::dtype::f16_to_f32((h[i / 4] >> (16 * (i % 4))) as u16))
    }
    #[inline(always)]
    unsafe fn fstore(p: *mut f32, a: [f32; 8]) {
        unsafe { p.cast::<[f32; 8]>().write_unaligned(a) }
    }
}
