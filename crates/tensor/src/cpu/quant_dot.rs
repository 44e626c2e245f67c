//! Integer dot products of ggml block-quantized weight rows with quantized activation rows.
//!
//! A kernel computes [`QR`] weight rows against one or [`QM`] activation rows at a time. For
//! each block (a pair of 32-element blocks, or one 256-element super-block) it forms every
//! (weight row, activation row) integer sum exactly — `vpdpbusd`/`vpdpwssd` with AVX-512 VNNI,
//! `vpmaddubsw` + `vpmaddwd` without — reduces them so that one f32 lane holds one weight row,
//! and only then applies the float scales:
//!
//! | weights     | activations | per block, f32, added to the row's sum in block order       |
//! |-------------|-------------|-------------------------------------------------------------|
//! | Q8_0, Q4_0  | Q8_0        | `(dw·dx)·S`                                                  |
//! | Q4_1        | Q8_1        | see below                                                    |
//! | Q5_K        | Q8_K        | `(dw·dx)·Σ sc·S − (dminw·dx)·Σ m·bsum`                       |
//! | Q4_K, Q6_K  | Q8_K        | see below                                                    |
//!
//! Q4_1 instead keeps llama.cpp's eight partial sums per output and its fused multiply-adds
//! ([`tile_q41`]), so that its outputs are llama.cpp's to the bit.
//!
//! Q4_K and Q6_K follow llama.cpp's x86 kernels too, including their choice by batch: Q4_K
//! (repacked there) fuses per super-block for a lone row and per 64 values for rows in whole
//! groups of four ([`tile_q45k`]); Q6_K keeps eight lanes below eight rows and one sum per
//! super-block from eight rows on ([`tile_q6k`]). Q8_0, Q4_0 and Q5_K keep ember's own order.
//!
//! Prefill of those batched Q4_K and Q6_K rows takes the wide road with VNNI ([`wide_rows`]):
//! the same float steps, lane for lane, with one lane per activation row instead of per
//! weight row, so that no integer sum needs reducing across lanes.
//!
//! Integer sums are exact and every float operation is a lane-wise IEEE multiply, add,
//! subtract or fused multiply-add in a fixed order, so an output is bit-identical whatever
//! the instruction set, tile shape or thread count (and, but for the cases above, batch size).

use super::Isa;
use crate::dtype::DType;
use crate::quant::{quantize_block_q8, quantize_block_q8k, scales_mins_k4_u64};

/// Weight rows computed together: one f32 lane each.
pub(crate) const QR: usize = 8;
/// Activation rows computed together in prefill.
pub(crate) const QM: usize = 4;
/// How far ahead of its reads decode prefetches each weight row.
/// How far ahead decode prefetches each weight row: to the same place in the next tile's
/// rows, which lie right after this tile's (a thread's rows are one contiguous stretch). That
/// is one tile's compute ahead, which covers the memory latency whatever the row length; a
/// fixed distance of a few hundred bytes halved the streaming rate on short (1536-wide) rows.
#[inline(always)]
fn prefetch_ahead(row_bytes: usize) -> usize {
    QR * row_bytes
}

// ---------------------------------------------------------------------------------------------
// Activations
// ---------------------------------------------------------------------------------------------

/// The blocks activations are quantized to for a weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    /// 32-element blocks: Q8_0 and Q8_1 at once, in order (Q8_0 weights).
    Q8,
    /// As `Q8`, each pair of blocks stored as the halves Q4_0/Q4_1 nibbles unpack to:
    /// `b0[0..16], b1[0..16], b0[16..32], b1[16..32]` (Q4_0, Q4_1 weights).
    Q8I,
    /// As `Q8`, each four blocks (128 values) stored as [`Qv::nib_quad_q41`] unpacks Q4_1
    /// nibbles: the first halves of blocks 0–3, then their second halves; a last group of
    /// fewer than four blocks as `Q8I` (Q4_1 weights).
    Q8I4,
    /// 256-element blocks: Q8_K, in order (Q6_K weights).
    Q8K,
    /// As `Q8K`, each 128 values stored as Q4_K/Q5_K nibbles unpack:
    /// `x[0..32], x[64..96], x[32..64], x[96..128]` (Q4_K, Q5_K weights).
    Q8KI,
}

impl ActKind {
    pub(crate) fn for_weights(dtype: DType) -> ActKind {
        match dtype {
            DType::Q4_K | DType::Q5_K => ActKind::Q8KI,
            DType::Q6_K => ActKind::Q8K,
            DType::Q4_0 => ActKind::Q8I,
            DType::Q4_1 => ActKind::Q8I4,
            _ => ActKind::Q8,
        }
    }
}

/// Where the parts of one quantized activation row lie, in bytes from the row's start. Rows
/// are `stride` bytes apart and 64-byte aligned.
///
/// - `qs`: `k` i8 values at 0, padded to a multiple of 64;
/// - `d`: one f32 scale per block (Q8: `f16(d)` widened, as ggml stores it; Q8K: f32 `d`);
/// - `a`: Q8: `Σq` per block (i32); Q8K: `bsums` of each 16 values (i16);
/// - `b`: Q8: `f16(d·Σq)` per block (f32, Q8_1's `s`); Q8K: sums of each 32 values (i16).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActLayout {
    pub kind: ActKind,
    pub k: usize,
    pub d: usize,
    pub a: usize,
    pub b: usize,
    pub stride: usize,
    /// Activation rows in the product being computed (set by [`rows`]): llama.cpp takes
    /// another Q6_K kernel for eight rows or more, and the kernels here follow it.
    pub batch: usize,
}

impl ActLayout {
    pub(crate) fn new(kind: ActKind, k: usize) -> ActLayout {
        let qs = k.div_ceil(64) * 64;
        let (d, a, b, end) = match kind {
            ActKind::Q8 | ActKind::Q8I | ActKind::Q8I4 => {
                let nb = k.div_ceil(32);
                (qs, qs + 4 * nb, qs + 8 * nb, qs + 12 * nb)
            }
            ActKind::Q8K | ActKind::Q8KI => {
                let nb = k.div_ceil(256);
                let a = qs + 4 * nb;
                let b = a + 2 * k.div_ceil(16);
                (qs, a, b, b + 2 * k.div_ceil(32))
            }
        };
        ActLayout {
            kind,
            k,
            d,
            a,
            b,
            stride: end.div_ceil(64) * 64,
            batch: 1,
        }
    }

    /// Bytes of the largest layout for `k` columns, whatever the kind.
    pub(crate) fn max_stride(k: usize) -> usize {
        ActLayout::new(ActKind::Q8, k)
            .stride
            .max(ActLayout::new(ActKind::Q8K, k).stride)
    }
}

/// Quantizes activation rows `rows` of `x` (`k` wide) into `out` (rows `stride` apart).
#[derive(Clone, Copy)]
pub(crate) struct ActJob {
    pub x: *const f32,
    pub rows: (usize, usize),
    pub layout: ActLayout,
    pub out: *mut u8,
}

// SAFETY: each thread writes its own rows of `out`.
unsafe impl Send for ActJob {}
unsafe impl Sync for ActJob {}

super::simd_dispatch!(pub(crate) fn quantize_activations(job: ActJob) => quantize_activations_generic);

/// Plain Rust; compiled inside each instruction set's entry point so that it vectorises with
/// it. Every step is exact or correctly rounded, so each set gives the same bytes.
#[inline(always)]
unsafe fn quantize_activations_generic<S: super::simd::Simd>(job: ActJob) {
    let ActJob {
        x,
        rows,
        layout,
        out,
    } = job;
    let k = layout.k;
    for i in rows.0..rows.1 {
        unsafe {
            let x = std::slice::from_raw_parts(x.add(i * k), k);
            let row = out.add(i * layout.stride);
            quantize_activation_row(&layout, x, row);
        }
    }
}

/// # Safety
/// `row` is valid for `layout.stride` bytes and 4-aligned.
#[inline(always)]
pub(crate) unsafe fn quantize_activation_row(layout: &ActLayout, x: &[f32], row: *mut u8) {
    let k = layout.k;
    unsafe {
        let qs = std::slice::from_raw_parts_mut(row.cast::<i8>(), k);
        match layout.kind {
            ActKind::Q8 | ActKind::Q8I | ActKind::Q8I4 => {
                let nb = k / 32;
                let d = std::slice::from_raw_parts_mut(row.add(layout.d).cast::<f32>(), nb);
                let sums = std::slice::from_raw_parts_mut(row.add(layout.a).cast::<i32>(), nb);
                let s = std::slice::from_raw_parts_mut(row.add(layout.b).cast::<f32>(), nb);
                for b in 0..nb {
                    let (scale, sum) =
                        quantize_block_q8(&x[32 * b..32 * b + 32], &mut qs[32 * b..32 * b + 32]);
                    d[b] = round_f16(scale);
                    sums[b] = sum;
                    s[b] = round_f16(scale * sum as f32);
                }
                // Groups of four blocks (Q8I4), then pairs.
                let quads = if layout.kind == ActKind::Q8I4 {
                    k / 128 * 128
                } else {
                    0
                };
                if layout.kind != ActKind::Q8 {
                    // The padding after `k` holds the second half of a last, unpaired block.
                    let padded =
                        std::slice::from_raw_parts_mut(row.cast::<i8>(), k.div_ceil(64) * 64);
                    for quad in padded[..quads].chunks_exact_mut(128) {
                        interleave4(quad);
                    }
                    for pair in padded[quads..].chunks_exact_mut(64) {
                        interleave(pair, 16);
                    }
                }
            }
            ActKind::Q8K | ActKind::Q8KI => {
                let nb = k / 256;
                let d = std::slice::from_raw_parts_mut(row.add(layout.d).cast::<f32>(), nb);
                let bs16 = std::slice::from_raw_parts_mut(row.add(layout.a).cast::<i16>(), k / 16);
                let bs32 = std::slice::from_raw_parts_mut(row.add(layout.b).cast::<i16>(), k / 32);
                for b in 0..nb {
                    d[b] = quantize_block_q8k(
                        &x[256 * b..256 * b + 256],
                        &mut qs[256 * b..256 * b + 256],
                        &mut bs16[16 * b..16 * b + 16],
                    );
                }
                for (p, s) in bs32.iter_mut().zip(bs16.chunks_exact(2)) {
                    *p = s[0] + s[1];
                }
                if layout.kind == ActKind::Q8KI {
                    for chunk in qs.chunks_mut(128) {
                        interleave(chunk, 32);
                    }
                }
            }
        }
    }
}

/// Reorders `q`, four quarters `[A, B, C, D]` of `part` values, to `[A, C, B, D]`.
#[inline(always)]
fn interleave(q: &mut [i8], part: usize) {
    let mut tmp = [0i8; 128];
    tmp[..4 * part].copy_from_slice(&q[..4 * part]);
    q[part..2 * part].copy_from_slice(&tmp[2 * part..3 * part]);
    q[2 * part..3 * part].copy_from_slice(&tmp[part..2 * part]);
}

/// Reorders 128 values, four blocks of 32, to their first halves then their second halves.
#[inline(always)]
fn interleave4(q: &mut [i8]) {
    let mut tmp = [0i8; 128];
    tmp.copy_from_slice(&q[..128]);
    for b in 0..4 {
        q[16 * b..16 * b + 16].copy_from_slice(&tmp[32 * b..32 * b + 16]);
        q[64 + 16 * b..64 + 16 * b + 16].copy_from_slice(&tmp[32 * b + 16..32 * b + 32]);
    }
}

#[inline(always)]
fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

// ---------------------------------------------------------------------------------------------
// The vector operations, once per instruction set
// ---------------------------------------------------------------------------------------------

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
    /// i16 lanes: the 16-byte quarter `q` all `p[q]` (i8), `q < 4`.
    unsafe fn scales4(p: *const i8) -> Self::V;
    /// For 8 vectors of i32 lanes: lane `r` of the first result is the sum of `v[r].g0`'s
    /// lanes, of the second the sum of `v[r].g1`'s.
    unsafe fn reduce(v: &[Self::V; QR]) -> (Self::I, Self::I);
    /// As [`Qv::reduce`], but the first result sums 16-byte quarters 0 and 2 of each vector,
    /// the second quarters 1 and 3 (the blocks [`Qv::nib_pair`] interleaves).
    unsafe fn reduce_x(v: &[Self::V; QR]) -> (Self::I, Self::I);
    /// Lane `r`: `Σ_t mins[r].byte(t)·s[t]`, `t < 8`.
    unsafe fn mins_dot8(mins: &[u64; QR], s: *const i16) -> Self::I;
    /// Per pair `c < 4`, lane `r`: `Σ_{t ∈ {2c, 2c+1}} mins[r].byte(t)·s[t]`.
    #[inline(always)]
    unsafe fn mins_dot_pairs(mins: &[u64; QR], s: *const i16) -> [Self::I; 4] {
        let mut out = [unsafe { Self::isplat(0) }; 4];
        for (c, o) in out.iter_mut().enumerate() {
            let mut b = [0i16; 8];
            unsafe {
                b[2 * c] = s.add(2 * c).read_unaligned();
                b[2 * c + 1] = s.add(2 * c + 1).read_unaligned();
                *o = Self::mins_dot8(mins, b.as_ptr());
            }
        }
        out
    }
    /// Lane `r`: `Σ_j sc[r][j]·s[j]`, `j < 16`.
    unsafe fn scales_dot8(sc: [*const i8; QR], s: *const i16) -> Self::I;
    /// Shifts each lane left by 5 (× 32).
    unsafe fn ishl5(a: Self::I) -> Self::I;
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
    unsafe fn store(p: *mut u8, v: Self::V);
    /// 16 f32 from `p`.
    unsafe fn f2load(p: *const u8) -> Self::F2;
    unsafe fn fsub2(a: Self::F2, b: Self::F2) -> Self::F2;
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        let _ = p;
    }
}

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
    unsafe fn scales4(p: *const i8) -> Pv {
        Pv::from_i16(std::array::from_fn(|l| (unsafe { *p.add(l / 8) }) as i16))
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
    unsafe fn scales_dot8(sc: [*const i8; QR], s: *const i16) -> [i32; 8] {
        std::array::from_fn(|r| {
            (0..16).fold(0i32, |acc, j| unsafe {
                acc + *sc[r].add(j) as i32 * s.add(j).read_unaligned() as i32
            })
        })
    }
    #[inline(always)]
    unsafe fn ishl5(a: [i32; 8]) -> [i32; 8] {
        a.map(|x| x.wrapping_shl(5))
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

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{QR, Qv};
    use std::arch::x86_64::*;

    /// AVX2: a 64-byte vector is two `__m256i`, one per group.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    #[derive(Clone, Copy)]
    pub(crate) struct Y2(__m256i, __m256i);

    #[inline(always)]
    unsafe fn loadu256(p: *const u8) -> __m256i {
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn loadu128(p: *const u8) -> __m128i {
        unsafe { _mm_loadu_si128(p.cast()) }
    }
    /// 16 bytes at `p0`, then 16 at `p1`.
    #[inline(always)]
    unsafe fn load16x2(p0: *const u8, p1: *const u8) -> __m256i {
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
    unsafe fn reduce8_halves(v: [__m256i; 8]) -> (__m256i, __m256i) {
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
    #[inline(always)]
    unsafe fn scales_dot8_x86(sc: [*const i8; QR], s: *const i16) -> __m256i {
        unsafe {
            let b = _mm256_loadu_si256(s.cast());
            reduce8(std::array::from_fn(|r| {
                _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(sc[r].cast())), b)
            }))
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
            unsafe fn scales_dot8(sc: [*const i8; QR], s: *const i16) -> __m256i {
                unsafe { scales_dot8_x86(sc, s) }
            }
            #[inline(always)]
            unsafe fn ishl5(a: __m256i) -> __m256i {
                unsafe { _mm256_slli_epi32::<5>(a) }
            }
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
            #[inline(always)]
            unsafe fn prefetch(p: *const u8) {
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
            }
        };
    }

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
        unsafe fn scales4(p: *const i8) -> Y2 {
            unsafe {
                let s = |q: usize| _mm_set1_epi16(*p.add(q) as i16);
                Y2(_mm256_set_m128i(s(1), s(0)), _mm256_set_m128i(s(3), s(2)))
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
                let v =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), _mm256_srli_epi16::<4>(a));
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
                let idx = _mm512_inserti64x4::<1>(
                    _mm512_set1_epi16(j0 as i16),
                    _mm256_set1_epi16(j1 as i16),
                );
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
        unsafe fn scales4(p: *const i8) -> __m512i {
            unsafe {
                let s = _mm_cvtepi8_epi16(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
                let idx = _mm512_set_epi64(
                    0x0003_0003_0003_0003,
                    0x0003_0003_0003_0003,
                    0x0002_0002_0002_0002,
                    0x0002_0002_0002_0002,
                    0x0001_0001_0001_0001,
                    0x0001_0001_0001_0001,
                    0,
                    0,
                );
                _mm512_permutexvar_epi16(idx, _mm512_castsi128_si512(s))
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
                let c =
                    _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(m)), b);
                // Lane `r`: [a0+a2, c0+c2, a1+a3, c1+c3], then row r's sum, row r+4's.
                let e = _mm512_add_epi32(_mm512_unpacklo_epi32(a, c), _mm512_unpackhi_epi32(a, c));
                let f = _mm512_add_epi32(e, _mm512_shuffle_epi32::<0b01_00_11_10>(e));
                let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
                _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, f))
            }
        }
        #[inline(always)]
        unsafe fn mins_dot_pairs(mins: &[u64; QR], s: *const i16) -> [__m256i; 4] {
            unsafe {
                // Quarter r of `a` holds row r's four pair sums, of `c` row r + 4's.
                let m = _mm512_loadu_si512(mins.as_ptr().cast());
                let b = _mm512_broadcast_i32x4(_mm_loadu_si128(s.cast()));
                let a = _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(m)), b);
                let c =
                    _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(m)), b);
                let pick = |q: i32| {
                    let idx = _mm512_setr_epi32(
                        q,
                        4 + q,
                        8 + q,
                        12 + q,
                        16 + q,
                        20 + q,
                        24 + q,
                        28 + q,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                    );
                    _mm512_castsi512_si256(_mm512_permutex2var_epi32(a, idx, c))
                };
                [pick(0), pick(1), pick(2), pick(3)]
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
                let ia =
                    _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
                let ib =
                    _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
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
                let hi =
                    |f: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(f)));
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
                let mask_hi =
                    _mm512_setr_epi32(0, k3, 0, k3, 0, k3, 0, k3, 0, k3, 0, k3, 0, k3, 0, k3);
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
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

#[inline(always)]
unsafe fn rd16(p: *const u8) -> u16 {
    unsafe { p.cast::<u16>().read_unaligned() }
}

/// Puts row `r`'s f16 bits where [`Qv::f16x8`] takes them: kept in registers, not memory.
#[inline(always)]
fn put16(h: &mut [u64; 2], r: usize, bits: u16) {
    h[r / 4] |= (bits as u64) << (16 * (r % 4));
}

/// llama.cpp's `hsum_float_8`: lanes `(l, l+4)`, then `(l, l+2)`, then `(l, l+1)`.
#[inline(always)]
fn hsum_float_8(v: &[f32]) -> f32 {
    let (r0, r1, r2, r3) = (v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]);
    (r0 + r2) + (r1 + r3)
}

#[inline(always)]
unsafe fn rdf32(p: *const u8, i: usize) -> f32 {
    unsafe { p.cast::<f32>().add(i).read() }
}

/// One weight type's tile: `QR` weight rows (`w`, each `k` columns) against `M` activation
/// rows (`a`, laid out by `lay`); `out[i][r]` receives row `r`'s dot with activation `i`.
pub(crate) trait Kernel {
    unsafe fn tile<Q: Qv, const M: usize>(
        w: [*const u8; QR],
        a: [*const u8; M],
        lay: &ActLayout,
        out: &mut [[f32; QR]; M],
    );
    /// The wide road ([`wide_rows`]): unpacks `QR` weight rows of `nsb` super-blocks to a
    /// panel.
    unsafe fn unpack<Q: Qv>(w: [*const u8; QR], nsb: usize, panel: *mut u8) {
        let _ = (w, nsb, panel);
        unreachable!("no wide road for this type")
    }
    /// The wide road: a panel's rows against a tile's [`TM`] activation rows, lane `l` of
    /// result `r` the dot of weight row `r` with activation row `l`.
    unsafe fn wide<Q: Qv>(panel: *const u8, tile: *const u8, nsb: usize) -> [Q::F2; QR] {
        let _ = (panel, tile, nsb);
        unreachable!("no wide road for this type")
    }
}

/// Q8_0, Q4_0: 32-element blocks, taken two at a time.
#[inline(always)]
unsafe fn tile_q32<Q: Qv, const M: usize, const T: u8>(
    w: [*const u8; QR],
    a: [*const u8; M],
    lay: &ActLayout,
    out: &mut [[f32; QR]; M],
) {
    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    let (bb, qoff) = match T {
        Q8_0 => (34, 2),
        _ => (18, 2),
    };
    let nb = lay.k / 32;
    unsafe {
        let mut acc = [Q::fzero(); M];
        let mut b0 = 0;
        while b0 < nb {
            let has1 = b0 + 1 < nb;
            let b1 = if has1 { b0 + 1 } else { b0 };
            let xs: [Q::V; M] = std::array::from_fn(|i| Q::load(a[i].add(32 * b0)));
            let mut d0 = [0u64; 2];
            let mut d1 = [0u64; 2];
            let mut ints = [[Q::zero(); QR]; M];
            for r in 0..QR {
                let p0 = w[r].add(b0 * bb);
                let p1 = w[r].add(b1 * bb);
                if M == 1 {
                    Q::prefetch(p0.add(prefetch_ahead(nb * bb)));
                }
                put16(&mut d0, r, rd16(p0));
                put16(&mut d1, r, rd16(p1));
                if T == Q8_0 {
                    let wv = Q::load2(p0.add(qoff), p1.add(qoff));
                    let wa = Q::abs8(wv);
                    for i in 0..M {
                        ints[i][r] = Q::dpbusd(Q::zero(), wa, Q::sign8(xs[i], wv));
                    }
                } else {
                    let wv = Q::nib_pair(p0.add(qoff), p1.add(qoff));
                    for i in 0..M {
                        ints[i][r] = Q::dpbusd(Q::zero(), wv, xs[i]);
                    }
                }
            }
            let fd0 = Q::f16x8(d0);
            let fd1 = Q::f16x8(d1);
            for i in 0..M {
                let (s0, s1) = if T == Q8_0 {
                    Q::reduce(&ints[i])
                } else {
                    Q::reduce_x(&ints[i])
                };
                let row = a[i];
                for (half, b, s, fd) in [(0, b0, s0, fd0), (1, b1, s1, fd1)] {
                    if half == 1 && !has1 {
                        break;
                    }
                    let s = if T == Q4_0 {
                        let sum = row.add(lay.a).cast::<i32>().add(b).read();
                        Q::isub(s, Q::isplat(8 * sum))
                    } else {
                        s
                    };
                    let dx = Q::fsplat(rdf32(row.add(lay.d), b));
                    acc[i] = Q::fadd(acc[i], Q::fmul(Q::fmul(fd, dx), Q::cvt(s)));
                }
            }
            b0 += 2;
        }
        for i in 0..M {
            Q::fstore(out[i].as_mut_ptr(), acc[i]);
        }
    }
}

/// Q4_1 against Q8_1, as llama.cpp's `ggml_vec_dot_q4_1_q8_1` (AVX2 form, which AVX-512
/// builds use) computes each output, to the bit: eight f32 lanes per output, lane `l` of block
/// `b` the exact integer sum of products `4l..4l+4` of `bytes_from_nibbles_32` (the low
/// nibbles' 16 values, then the high nibbles'), accumulated over blocks in order as
/// `acc = fma(d_w·d_x, lane, acc)`; `summs = fma(m_w, s_x, summs)` beside it (GCC contracts
/// `summs += m·s`); the result `hsum_float_8(acc) + summs`. Why it matters: the next layer
/// quantizes these outputs to 8 bits, and a last-bit difference flips some of those roundings,
/// which is enough to move SmolLM2's logits by tenths.
// Indices name rows, row pairs and blocks across several arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_q41<Q: Qv, const M: usize>(
    w: [*const u8; QR],
    a: [*const u8; M],
    lay: &ActLayout,
    out: &mut [[f32; QR]; M],
) {
    const BB: usize = 20;
    let nb = lay.k / 32;
    unsafe {
        let mut acc = [[Q::f2zero(); QR / 2]; M];
        let mut summs = [Q::fzero(); M];
        let mut b0 = 0;
        // Four blocks at a time ([`ActKind::Q8I4`]).
        while b0 + 4 <= nb {
            let p: [*const u8; QR] = std::array::from_fn(|r| w[r].add(b0 * BB));
            let meta = Q::meta_q41(&p);
            for pair in 0..QR / 2 {
                // Each row's d_w over its eight lanes; times d_x (lane-wise, so the same
                // rounding as ggml's d0·d1) per activation row.
                let mut dw = [Q::f2zero(); 4];
                for q in 0..4 {
                    dw[q] = Q::pair_splat(meta[q].0, pair);
                }
                let mut sums = [[Q::zero(); 4]; M];
                for (h, r) in [2 * pair, 2 * pair + 1].into_iter().enumerate() {
                    if M == 1 {
                        let ahead = prefetch_ahead(nb * BB);
                        Q::prefetch(p[r].add(ahead));
                        Q::prefetch(p[r].add(ahead + 64));
                    }
                    let (lo, hi) = Q::nib_quad_q41(p[r]);
                    for i in 0..M {
                        let x = a[i].add(32 * b0);
                        sums[i][2 * h] = Q::dpbusd(Q::zero(), lo, Q::load(x));
                        sums[i][2 * h + 1] = Q::dpbusd(Q::zero(), hi, Q::load(x.add(64)));
                    }
                }
                for i in 0..M {
                    let [s0, s1, s2, s3] = sums[i];
                    let lanes = Q::q41_lanes(s0, s1, s2, s3);
                    for q in 0..4 {
                        let dx = Q::f2splat(rdf32(a[i].add(lay.d), b0 + q));
                        let scale = Q::fmul2(dw[q], dx);
                        acc[i][pair] = Q::ffma2(scale, Q::cvt2(lanes[q]), acc[i][pair]);
                    }
                }
            }
            for i in 0..M {
                for q in 0..4 {
                    let sx = Q::fsplat(rdf32(a[i].add(lay.b), b0 + q));
                    summs[i] = Q::ffma(meta[q].1, sx, summs[i]);
                }
            }
            b0 += 4;
        }
        // The rest two at a time ([`ActKind::Q8I`] pairs), a last odd block alone.
        while b0 < nb {
            let has1 = b0 + 1 < nb;
            let b1 = if has1 { b0 + 1 } else { b0 };
            let xs: [Q::V; M] = std::array::from_fn(|i| Q::load(a[i].add(32 * b0)));
            let mut meta = [[0u64; 2]; 4];
            for r in 0..QR {
                let (p0, p1) = (w[r].add(b0 * BB), w[r].add(b1 * BB));
                put16(&mut meta[0], r, rd16(p0));
                put16(&mut meta[1], r, rd16(p1));
                put16(&mut meta[2], r, rd16(p0.add(2)));
                put16(&mut meta[3], r, rd16(p1.add(2)));
            }
            let (fd0, fd1) = (Q::f16x8(meta[0]), Q::f16x8(meta[1]));
            let (fm0, fm1) = (Q::f16x8(meta[2]), Q::f16x8(meta[3]));
            for pair in 0..QR / 2 {
                // Per row: [b0 low, b1 low, b0 high, b1 high] nibble sums; and its high half.
                let mut sums = [[Q::zero(); 4]; M];
                for (h, r) in [2 * pair, 2 * pair + 1].into_iter().enumerate() {
                    let wv = Q::nib_pair(w[r].add(b0 * BB + 4), w[r].add(b1 * BB + 4));
                    for i in 0..M {
                        let v = Q::dpbusd(Q::zero(), wv, xs[i]);
                        sums[i][2 * h] = v;
                        sums[i][2 * h + 1] = Q::regroup(v, v).1;
                    }
                }
                for i in 0..M {
                    let [s0, s1, s2, s3] = sums[i];
                    let lanes = Q::q41_lanes(s0, s1, s2, s3);
                    for (q, (b, fd)) in [(b0, fd0), (b1, fd1)].into_iter().enumerate() {
                        if q == 1 && !has1 {
                            break;
                        }
                        let dd = Q::fmul(fd, Q::fsplat(rdf32(a[i].add(lay.d), b)));
                        let scale = Q::pair_splat(dd, pair);
                        acc[i][pair] = Q::ffma2(scale, Q::cvt2(lanes[q]), acc[i][pair]);
                    }
                }
            }
            for i in 0..M {
                summs[i] = Q::ffma(fm0, Q::fsplat(rdf32(a[i].add(lay.b), b0)), summs[i]);
                if has1 {
                    summs[i] = Q::ffma(fm1, Q::fsplat(rdf32(a[i].add(lay.b), b1)), summs[i]);
                }
            }
            b0 += 2;
        }
        for i in 0..M {
            let mut m = [0f32; 8];
            Q::fstore(m.as_mut_ptr(), summs[i]);
            for pair in 0..QR / 2 {
                let mut l = [0f32; 16];
                Q::f2store(l.as_mut_ptr(), acc[i][pair]);
                for h in 0..2 {
                    out[i][2 * pair + h] = hsum_float_8(&l[8 * h..8 * h + 8]) + m[2 * pair + h];
                }
            }
        }
    }
}

/// Q4_K and Q5_K (`Q5`): 256-element super-blocks of eight 32-element sub-blocks, taken 128
/// elements at a time: 64 bytes of `qs` hold sub-blocks `4c` and `4c + 2` in their low
/// nibbles and `4c + 1`, `4c + 3` in their high ones, which is the order the activations are
/// stored in ([`ActKind::Q8KI`]).
#[inline(always)]
unsafe fn tile_q45k<Q: Qv, const M: usize, const Q5: bool>(
    w: [*const u8; QR],
    a: [*const u8; M],
    lay: &ActLayout,
    out: &mut [[f32; QR]; M],
) {
    let (bb, qs_off) = if Q5 { (176, 48) } else { (144, 16) };
    let nsb = lay.k / 256;
    unsafe {
        let mut acc = [Q::fzero(); M];
        let mut acc_min = [Q::fzero(); M];
        for sb in 0..nsb {
            let blks: [*const u8; QR] = std::array::from_fn(|r| w[r].add(sb * bb));
            let mut sc = [0u64; QR];
            let mut mins = [0u64; QR];
            let (fdw, fdm) = Q::k4_meta(&blks, &mut sc, &mut mins);
            // Batched Q4_K keeps each 64 values' sums apart (see below).
            let split = !Q5 && M > 1;
            let mut ints = [[[Q::zero(); QR]; M]; 2];
            for r in 0..QR {
                let blk = blks[r];
                if M == 1 {
                    let ahead = prefetch_ahead(nsb * bb);
                    for line in 0..bb.div_ceil(64) {
                        Q::prefetch(blk.add(ahead + 64 * line));
                    }
                }
                let scales = Q::scales8(sc[r]);
                let mut hv = if Q5 {
                    Q::dup_shr::<2>(blk.add(16))
                } else {
                    Q::zero()
                };
                let low = Q::splat8(0x0F);
                let mut ai = [[Q::zero(); M]; 2];
                for c in 0..2 {
                    let ai = &mut ai[if split { c } else { 0 }];
                    let q = Q::load(blk.add(qs_off + 64 * c));
                    let mut lo = Q::and(q, low);
                    let mut hi = Q::and(Q::shr4(q), low);
                    if Q5 {
                        let bit = Q::splat8(0x10);
                        lo = Q::or(lo, Q::and(Q::shl4(hv), bit));
                        hi = Q::or(hi, Q::and(Q::shl3(hv), bit));
                        hv = Q::shr4(hv);
                    }
                    if Q::FAST_DPBUSD {
                        // Sums of four products fit in i16: pack two vectors' and scale once.
                        let scv = Q::scale_pick4(scales, [4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3]);
                        for i in 0..M {
                            let x = a[i].add(256 * sb + 128 * c);
                            let s0 = Q::dpbusd(Q::zero(), lo, Q::load(x));
                            let s1 = Q::dpbusd(Q::zero(), hi, Q::load(x.add(64)));
                            ai[i] = Q::dpwssd(ai[i], Q::packs32(s0, s1), scv);
                        }
                    } else {
                        let sc_lo = Q::scale_pick(scales, 4 * c, 4 * c + 2);
                        let sc_hi = Q::scale_pick(scales, 4 * c + 1, 4 * c + 3);
                        for i in 0..M {
                            let x = a[i].add(256 * sb + 128 * c);
                            ai[i] = Q::dpwssd(ai[i], Q::maddubs(lo, Q::load(x)), sc_lo);
                            ai[i] = Q::dpwssd(ai[i], Q::maddubs(hi, Q::load(x.add(64))), sc_hi);
                        }
                    }
                }
                for (c, ai) in ai.iter().enumerate().take(if split { 2 } else { 1 }) {
                    for i in 0..M {
                        ints[c][i][r] = ai[i];
                    }
                }
            }
            for i in 0..M {
                let bs32 = a[i].add(lay.b).cast::<i16>().add(8 * sb);
                let dx = Q::fsplat(rdf32(a[i].add(lay.d), sb));
                if split {
                    // Q4_K rows of a batch, as llama.cpp's `ggml_gemm_q4_K_8x8_q8_K`: one
                    // fused step per 64 values (two sub-blocks), for the sums and the mins.
                    let (dd, dm) = (Q::fmul(fdw, dx), Q::fmul(fdm, dx));
                    let m = Q::mins_dot_pairs(&mins, bs32);
                    for (c, ints) in ints.iter().enumerate() {
                        let (g0, g1) = Q::reduce(&ints[i]);
                        for (h, s) in [g0, g1].into_iter().enumerate() {
                            acc[i] = Q::ffma(Q::cvt(s), dd, acc[i]);
                            acc_min[i] = Q::ffma(Q::cvt(m[2 * c + h]), dm, acc_min[i]);
                        }
                    }
                    continue;
                }
                let (g0, g1) = Q::reduce(&ints[0][i]);
                let s1 = Q::iadd(g0, g1);
                let s2 = Q::mins_dot8(&mins, bs32);
                if Q5 {
                    let t = Q::fsub(
                        Q::fmul(Q::fmul(fdw, dx), Q::cvt(s1)),
                        Q::fmul(Q::fmul(fdm, dx), Q::cvt(s2)),
                    );
                    acc[i] = Q::fadd(acc[i], t);
                } else {
                    // Q4_K as llama.cpp's repacked x86 kernel for one row computes it
                    // (`ggml_gemv_q4_K_8x8_q8_K`): per super-block, the scaled sums and the
                    // mins' terms into two fused accumulators, subtracted at the end.
                    acc[i] = Q::ffma(Q::cvt(s1), Q::fmul(fdw, dx), acc[i]);
                    acc_min[i] = Q::ffma(Q::cvt(s2), Q::fmul(fdm, dx), acc_min[i]);
                }
            }
        }
        for i in 0..M {
            Q::fstore(out[i].as_mut_ptr(), Q::fsub(acc[i], acc_min[i]));
        }
    }
}

/// Q6_K: 256-element super-blocks of sixteen 16-element sub-blocks with i8 scales. The
/// values are stored `+32`; `32·Σ sc·bsum` comes off the integer sums. As llama.cpp's
/// `ggml_vec_dot_q6_K_q8_K` (AVX2 form) computes it, to the bit: eight i32 lanes per output,
/// lane `l` holding positions `4l..4l+4` of every 32-value chunk, scaled, less
/// `32·(bsum[2l]·sc[2l] + bsum[2l+1]·sc[2l+1])`; per super-block
/// `acc = fma(d_x·d_w, lane, acc)`; the result `hsum_float_8(acc)`.
// Indices name rows, row pairs and blocks across several arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_q6k<Q: Qv, const M: usize>(
    w: [*const u8; QR],
    a: [*const u8; M],
    lay: &ActLayout,
    out: &mut [[f32; QR]; M],
) {
    const BB: usize = 210;
    let nsb = lay.k / 256;
    unsafe {
        let mut acc = [[Q::f2zero(); QR / 2]; M];
        let mut tiled = [Q::fzero(); M];
        for sb in 0..nsb {
            let mut dw = [0u64; 2];
            let mut ints = [[Q::zero(); QR]; M];
            for r in 0..QR {
                let blk = w[r].add(sb * BB);
                if M == 1 {
                    let ahead = prefetch_ahead(nsb * BB);
                    for line in 0..BB.div_ceil(64) {
                        Q::prefetch(blk.add(ahead + 64 * line));
                    }
                }
                put16(&mut dw, r, rd16(blk.add(208)));
                let sc = blk.add(192).cast::<i8>();
                let mut ai = [Q::zero(); M];
                for h in 0..2 {
                    let ql = Q::load(blk.add(64 * h));
                    let hv = Q::dup_shr::<2>(blk.add(128 + 32 * h));
                    let low = Q::splat8(0x0F);
                    let top = Q::splat8(0x30);
                    if Q::FAST_DPBUSD {
                        // Sums of four products (< 4·63·128) fit in i16: pack and scale once.
                        let w0 = Q::or(Q::and(ql, low), Q::and(Q::shl4(hv), top));
                        let w1 = Q::or(Q::and(Q::shr4(ql), low), Q::and(hv, top));
                        // Lane j pairs the sums of the same four positions of two 32-value
                        // chunks, so lane j keeps llama.cpp's lane j % 8 (see below).
                        let scv = Q::scales_q6(sc.add(8 * h));
                        for i in 0..M {
                            let x = a[i].add(256 * sb + 128 * h);
                            let s0 = Q::dpbusd(Q::zero(), w0, Q::load(x));
                            let s1 = Q::dpbusd(Q::zero(), w1, Q::load(x.add(64)));
                            ai[i] = Q::dpwssd(ai[i], Q::pair16(s0, s1), scv);
                        }
                        continue;
                    }
                    for s in 0..2 {
                        let (nib, hb) = if s == 0 {
                            (ql, Q::shl4(hv))
                        } else {
                            (Q::shr4(ql), hv)
                        };
                        let wv = Q::or(Q::and(nib, Q::splat8(0x0F)), Q::and(hb, Q::splat8(0x30)));
                        let scv = Q::scales4(sc.add(8 * h + 4 * s));
                        for i in 0..M {
                            let x = Q::load(a[i].add(256 * sb + 128 * h + 64 * s));
                            ai[i] = Q::dpwssd(ai[i], Q::maddubs(wv, x), scv);
                        }
                    }
                }
                for i in 0..M {
                    ints[i][r] = ai[i];
                }
            }
            let fdw = Q::f16x8(dw);
            if lay.batch >= 8 {
                // Eight rows or more: llama.cpp's tiled K-quant kernel (`ggml-cpu/tiled`,
                // `tiled_run_micro_vnni_8x16`): the super-block's whole integer sum times
                // d_w, then `fma(·, d_x, acc)` (GCC contracts its `add(acc, mul(·, d_x))`).
                let scales: [*const i8; QR] =
                    std::array::from_fn(|r| w[r].add(sb * BB + 192).cast::<i8>());
                for i in 0..M {
                    let (g0, g1) = Q::reduce(&ints[i]);
                    let bs16 = a[i].add(lay.a).cast::<i16>().add(16 * sb);
                    let s = Q::isub(Q::iadd(g0, g1), Q::ishl5(Q::scales_dot8(scales, bs16)));
                    let dx = Q::fsplat(rdf32(a[i].add(lay.d), sb));
                    tiled[i] = Q::ffma(Q::fmul(Q::cvt(s), fdw), dx, tiled[i]);
                }
                continue;
            }
            for i in 0..M {
                let bs16 = a[i].add(lay.a).cast::<i16>().add(16 * sb);
                let d = Q::fmul(Q::fsplat(rdf32(a[i].add(lay.d), sb)), fdw);
                for pair in 0..QR / 2 {
                    let (r0, r1) = (2 * pair, 2 * pair + 1);
                    let sc = |r: usize| w[r].add(sb * BB + 192).cast::<i8>();
                    let lanes = Q::isub2(
                        Q::q6_fold(ints[i][r0], ints[i][r1]),
                        Q::q6_mins(sc(r0), sc(r1), bs16),
                    );
                    let scale = Q::pair_splat(d, pair);
                    acc[i][pair] = Q::ffma2(scale, Q::cvt2(lanes), acc[i][pair]);
                }
            }
        }
        for i in 0..M {
            if lay.batch >= 8 {
                Q::fstore(out[i].as_mut_ptr(), tiled[i]);
                continue;
            }
            for pair in 0..QR / 2 {
                let mut l = [0f32; 16];
                Q::f2store(l.as_mut_ptr(), acc[i][pair]);
                for h in 0..2 {
                    out[i][2 * pair + h] = hsum_float_8(&l[8 * h..8 * h + 8]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The wide batched road (Q4_K, Q6_K with VNNI)
// ---------------------------------------------------------------------------------------------
//
// The tiles above hold one weight row per lane, so every (weight row, activation row) sum must
// be reduced across lanes before its float step, and Q4_K's step comes every 64 values. Here a
// lane holds an activation row instead: [`TM`] activation rows are interleaved four bytes at a
// time ([`build_tiles`]), each four weight values are broadcast to all lanes, and one
// `vpdpbusd` adds the four products of every row, so no sum is ever reduced. The weights are
// unpacked to bytes once per activation block ([`Kernel::unpack`]); each sub-block's sum is
// multiplied by its scale in i32. The float steps are the tiles' own, lane for lane.

/// Activation rows a wide tile holds, one i32 lane each.
pub(crate) const TM: usize = 16;

/// One super-block of a wide activation tile: `[g][row]` the row's `qs` bytes `4g..4g+4` (in
/// the stored order of [`ActKind::Q8K`] or [`ActKind::Q8KI`]), then each row's `d`, then the
/// pairs of `bsums` (of 16 values, then of 32) as the i16 pairs `vpdpwssd` takes.
const TILE_D: usize = 64 * TM * 4;
const TILE_BS16: usize = TILE_D + TM * 4;
const TILE_BS32: usize = TILE_BS16 + 8 * TM * 4;
const TILE_SB: usize = TILE_BS32 + 4 * TM * 4;

/// One super-block of [`QR`] unpacked weight rows: `[row][256]` the values as bytes (in the
/// activations' stored order), `[sub-block][row]` the scales as i32, `[pair][row]` two i16
/// (Q4_K: the mins of sub-blocks `2j`, `2j+1`; Q6_K: `-32·` the scales of `2p`, `2p+1`), then
/// each row's `d` and `dmin` as f32.
const PANEL_SC: usize = QR * 256;
const PANEL_PAIRS: usize = PANEL_SC + 16 * QR * 4;
const PANEL_D: usize = PANEL_PAIRS + 8 * QR * 4;
const PANEL_DMIN: usize = PANEL_D + QR * 4;
const PANEL_SB: usize = PANEL_DMIN + QR * 4;

/// Bytes of the wide tiles for `m` activation rows of `k` columns.
pub(crate) fn tiles_bytes(m: usize, k: usize) -> usize {
    m.div_ceil(TM) * k.div_ceil(256) * TILE_SB
}

/// Bytes of one thread's unpacked weight rows for `k` columns.
pub(crate) fn panel_bytes(k: usize) -> usize {
    k.div_ceil(256) * PANEL_SB
}

/// Smaller batches keep the tiles above: a wide tile would be mostly empty.
const WIDE_MIN_ROWS: usize = 16;

/// The activation rows of a batch of `m` that the wide road computes, a prefix of them (none
/// without VNNI): for Q4_K the whole groups of four (the rest are rows alone, as in llama.cpp),
/// for Q6_K all of them (from eight rows on, one formula for every row).
pub(crate) fn wide_rows(isa: QIsa, dtype: DType, m: usize) -> usize {
    if isa != QIsa::Avx512Vnni || m < WIDE_MIN_ROWS {
        return 0;
    }
    match dtype {
        DType::Q4_K => m - m % 4,
        DType::Q6_K => m,
        _ => 0,
    }
}

/// Interleaves activation rows `0..rows` (quantized, `layout`) into tiles `tiles` at `out`; a
/// last tile's lanes past `rows` repeat row `rows - 1`.
///
/// # Safety
/// `acts` holds the quantized rows, `out` has room for the tiles.
pub(crate) unsafe fn build_tiles(
    layout: &ActLayout,
    acts: *const u8,
    rows: usize,
    tiles: std::ops::Range<usize>,
    out: *mut u8,
) {
    let nsb = layout.k / 256;
    let word = |p: *const u8, i: usize| unsafe { p.cast::<u32>().add(i).read_unaligned() };
    for tile in tiles {
        let base = unsafe { out.add(tile * nsb * TILE_SB) };
        for lane in 0..TM {
            let row = unsafe { acts.add((tile * TM + lane).min(rows - 1) * layout.stride) };
            for sb in 0..nsb {
                unsafe {
                    let put = |off: usize, i: usize, v: u32| {
                        base.add(sb * TILE_SB + off + 4 * (i * TM + lane))
                            .cast::<u32>()
                            .write(v)
                    };
                    for g in 0..64 {
                        put(0, g, word(row, 64 * sb + g));
                    }
                    put(TILE_D, 0, word(row.add(layout.d), sb));
                    for p in 0..8 {
                        put(TILE_BS16, p, word(row.add(layout.a), 8 * sb + p));
                    }
                    for j in 0..4 {
                        put(TILE_BS32, j, word(row.add(layout.b), 4 * sb + j));
                    }
                }
            }
        }
    }
}

/// Writes `v` as the i32 at `[i][r]` of a panel table starting at `off`.
#[inline(always)]
unsafe fn put_panel(panel: *mut u8, off: usize, i: usize, r: usize, v: u32) {
    unsafe { panel.add(off + 4 * (i * QR + r)).cast::<u32>().write(v) }
}

/// Q4_K rows to a panel: each 64 bytes of `qs` as their low nibbles, then their high ones,
/// which is [`ActKind::Q8KI`]'s order.
#[inline(always)]
unsafe fn unpack_q4k<Q: Qv>(w: [*const u8; QR], nsb: usize, panel: *mut u8) {
    unsafe {
        let low = Q::splat8(0x0F);
        for sb in 0..nsb {
            let p = panel.add(sb * PANEL_SB);
            for (r, row) in w.iter().enumerate() {
                let blk = row.add(sb * 144);
                for c in 0..2 {
                    let q = Q::load(blk.add(16 + 64 * c));
                    Q::store(p.add(256 * r + 128 * c), Q::and(q, low));
                    Q::store(p.add(256 * r + 128 * c + 64), Q::and(Q::shr4(q), low));
                }
                let (sc, mn) = scales_mins_k4_u64(&*blk.add(4).cast::<[u8; 12]>());
                let (sc, mn) = (sc.to_le_bytes(), mn.to_le_bytes());
                for (s, &scale) in sc.iter().enumerate() {
                    put_panel(p, PANEL_SC, s, r, scale as u32);
                }
                for j in 0..4 {
                    put_panel(
                        p,
                        PANEL_PAIRS,
                        j,
                        r,
                        mn[2 * j] as u32 | (mn[2 * j + 1] as u32) << 16,
                    );
                }
                let f = |off: usize| crate::dtype::f16_to_f32(rd16(blk.add(off))).to_bits();
                put_panel(p, PANEL_D, 0, r, f(0));
                put_panel(p, PANEL_DMIN, 0, r, f(2));
            }
        }
    }
}

/// Q6_K rows to a panel, values `0..64` (the `+32` taken off through the bsums) in order.
#[inline(always)]
unsafe fn unpack_q6k<Q: Qv>(w: [*const u8; QR], nsb: usize, panel: *mut u8) {
    unsafe {
        let (low, top) = (Q::splat8(0x0F), Q::splat8(0x30));
        for sb in 0..nsb {
            let p = panel.add(sb * PANEL_SB);
            for (r, row) in w.iter().enumerate() {
                let blk = row.add(sb * 210);
                for h in 0..2 {
                    let ql = Q::load(blk.add(64 * h));
                    let hv = Q::dup_shr::<2>(blk.add(128 + 32 * h));
                    let w0 = Q::or(Q::and(ql, low), Q::and(Q::shl4(hv), top));
                    let w1 = Q::or(Q::and(Q::shr4(ql), low), Q::and(hv, top));
                    Q::store(p.add(256 * r + 128 * h), w0);
                    Q::store(p.add(256 * r + 128 * h + 64), w1);
                }
                let sc = blk.add(192).cast::<i8>();
                for s in 0..16 {
                    put_panel(p, PANEL_SC, s, r, *sc.add(s) as i32 as u32);
                }
                for j in 0..8 {
                    let m = |s: usize| (-32 * *sc.add(s) as i32) as u16 as u32;
                    put_panel(p, PANEL_PAIRS, j, r, m(2 * j) | m(2 * j + 1) << 16);
                }
                let d = crate::dtype::f16_to_f32(rd16(blk.add(208)));
                put_panel(p, PANEL_D, 0, r, d.to_bits());
            }
        }
    }
}

/// The scaled sum of one sub-block for every panel row: `n` four-value groups from position
/// `pos` of the panel's and the tile's values, added as `sc·Σ` to `s`.
#[inline(always)]
unsafe fn wide_sub_block<Q: Qv>(
    p: *const u8,
    t: *const u8,
    pos: usize,
    n: usize,
    sub: usize,
    s: &mut [Q::V; QR],
) {
    unsafe {
        let mut part = [Q::zero(); QR];
        for g in 0..n {
            let x = Q::load(t.add((pos / 4 + g) * 64));
            for (r, part) in part.iter_mut().enumerate() {
                *part = Q::dpbusd(*part, Q::bcast32(p.add(256 * r + pos + 4 * g)), x);
            }
        }
        for (r, s) in s.iter_mut().enumerate() {
            let sc = Q::bcast32(p.add(PANEL_SC + 4 * (sub * QR + r)));
            *s = Q::iadd2(*s, Q::mullo(part[r], sc));
        }
    }
}

/// Q4_K, rows in groups of four: the float steps of [`tile_q45k`]'s batched form, per 64
/// values `acc = fma(Σ, d_w·d_x, acc)` and `acc_min = fma(Σ mins, dmin_w·d_x, acc_min)`, the
/// result `acc − acc_min`.
#[inline(always)]
unsafe fn wide_q4k<Q: Qv>(panel: *const u8, tile: *const u8, nsb: usize) -> [Q::F2; QR] {
    // Where sub-block `s` of a 128-value half lies in [`ActKind::Q8KI`]'s order.
    const POS: [usize; 4] = [0, 64, 32, 96];
    unsafe {
        let mut acc = [Q::f2zero(); QR];
        for sb in 0..nsb {
            let (p, t) = (panel.add(sb * PANEL_SB), tile.add(sb * TILE_SB));
            let dx = Q::f2load(t.add(TILE_D));
            for j in 0..4 {
                let mut s = [Q::zero(); QR];
                for sub in [2 * j, 2 * j + 1] {
                    let pos = 128 * (sub / 4) + POS[sub % 4];
                    wide_sub_block::<Q>(p, t, pos, 8, sub, &mut s);
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let dd = Q::fmul2(Q::f2splat(rdf32(p.add(PANEL_D), r)), dx);
                    *acc = Q::ffma2(Q::cvt2(s[r]), dd, *acc);
                }
            }
        }
        // The mins' terms do not depend on the values: their own pass, after.
        let mut acc_min = [Q::f2zero(); QR];
        for sb in 0..nsb {
            let (p, t) = (panel.add(sb * PANEL_SB), tile.add(sb * TILE_SB));
            let dx = Q::f2load(t.add(TILE_D));
            for j in 0..4 {
                let bs = Q::load(t.add(TILE_BS32 + 64 * j));
                for (r, acc_min) in acc_min.iter_mut().enumerate() {
                    let mins = Q::bcast32(p.add(PANEL_PAIRS + 4 * (j * QR + r)));
                    let m = Q::dpwssd(Q::zero(), mins, bs);
                    let dm = Q::fmul2(Q::f2splat(rdf32(p.add(PANEL_DMIN), r)), dx);
                    *acc_min = Q::ffma2(Q::cvt2(m), dm, *acc_min);
                }
            }
        }
        std::array::from_fn(|r| Q::fsub2(acc[r], acc_min[r]))
    }
}

/// Q6_K, eight rows or more: [`tile_q6k`]'s batched form, per super-block
/// `acc = fma(Σ·d_w, d_x, acc)`.
#[inline(always)]
unsafe fn wide_q6k<Q: Qv>(panel: *const u8, tile: *const u8, nsb: usize) -> [Q::F2; QR] {
    unsafe {
        let mut acc = [Q::f2zero(); QR];
        for sb in 0..nsb {
            let (p, t) = (panel.add(sb * PANEL_SB), tile.add(sb * TILE_SB));
            // The stored `+32`: `-32·Σ sc·bsum`, sub-blocks in pairs.
            let mut s = [Q::zero(); QR];
            for j in 0..8 {
                let bs = Q::load(t.add(TILE_BS16 + 64 * j));
                for (r, s) in s.iter_mut().enumerate() {
                    *s = Q::dpwssd(*s, Q::bcast32(p.add(PANEL_PAIRS + 4 * (j * QR + r))), bs);
                }
            }
            for sub in 0..16 {
                wide_sub_block::<Q>(p, t, 16 * sub, 4, sub, &mut s);
            }
            let dx = Q::f2load(t.add(TILE_D));
            for (r, acc) in acc.iter_mut().enumerate() {
                let dw = Q::f2splat(rdf32(p.add(PANEL_D), r));
                *acc = Q::ffma2(Q::fmul2(Q::cvt2(s[r]), dw), dx, *acc);
            }
        }
        acc
    }
}

macro_rules! kernel {
    ($name:ident, $tile:ident $(, $arg:expr)? $(; wide: $unpack:ident, $wide:ident)?) => {
        pub(crate) struct $name;
        impl Kernel for $name {
            #[inline(always)]
            unsafe fn tile<Q: Qv, const M: usize>(
                w: [*const u8; QR],
                a: [*const u8; M],
                lay: &ActLayout,
                out: &mut [[f32; QR]; M],
            ) {
                unsafe { $tile::<Q, M $(, $arg)?>(w, a, lay, out) }
            }
            $(
            #[inline(always)]
            unsafe fn unpack<Q: Qv>(w: [*const u8; QR], nsb: usize, panel: *mut u8) {
                unsafe { $unpack::<Q>(w, nsb, panel) }
            }
            #[inline(always)]
            unsafe fn wide<Q: Qv>(panel: *const u8, tile: *const u8, nsb: usize) -> [Q::F2; QR] {
                unsafe { $wide::<Q>(panel, tile, nsb) }
            }
            )?
        }
    };
}

kernel!(KQ8_0, tile_q32, 0);
kernel!(KQ4_0, tile_q32, 1);
kernel!(KQ4_1, tile_q41);
kernel!(KQ4K, tile_q45k, false; wide: unpack_q4k, wide_q4k);
kernel!(KQ5K, tile_q45k, true);
kernel!(KQ6K, tile_q6k; wide: unpack_q6k, wide_q6k);

// ---------------------------------------------------------------------------------------------
// One thread's share of a matrix product
// ---------------------------------------------------------------------------------------------

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
    #[cfg(test)]
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
}

// SAFETY: each thread writes its own columns of `y`.
unsafe impl Send for QJob {}
unsafe impl Sync for QJob {}

/// Runs `job` with the kernels of `dtype` compiled for `isa`.
pub(crate) fn quant_rows(isa: QIsa, dtype: DType, job: QJob) {
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
        return;
    }
    let layout = ActLayout { batch: m, ..layout };
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
        let mut i0 = 0;
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
                // The last rows of a batch alone, as llama.cpp takes them (Q4_K computes
                // those as a lone row; every other kernel gives the same bits either way).
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
/// then run past every tile of the block; the rows past `wide` (Q4_K's last rows of a batch)
/// alone, while the weight rows are still in cache.
#[inline(always)]
unsafe fn rows_wide<Q: Qv, K: Kernel>(job: QJob) {
    let QJob {
        w,
        row_bytes,
        n,
        rows: (start, end),
        acts,
        layout,
        m,
        y,
        wide,
        tiles,
        panel,
        block_tiles,
        ..
    } = job;
    let layout = ActLayout { batch: m, ..layout };
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
            let ws = w_rows(j);
            let cols = (end - j).min(QR);
            unsafe {
                K::unpack::<Q>(ws, nsb, panel);
                for tile in t0..t_end {
                    let out = K::wide::<Q>(panel, tiles.add(tile * tile_bytes), nsb);
                    let lanes = (wide - tile * TM).min(TM);
                    for (r, v) in out.iter().enumerate().take(cols) {
                        let mut l = [0f32; TM];
                        Q::f2store(l.as_mut_ptr(), *v);
                        for (lane, &v) in l.iter().enumerate().take(lanes) {
                            *y.add((tile * TM + lane) * n + j + r) = v;
                        }
                    }
                }
                if t_end == n_tiles {
                    for i in wide..m {
                        let mut out = [[0f32; QR]; 1];
                        let a = acts.add(i * layout.stride);
                        K::tile::<Q, 1>(ws, [a], &layout, &mut out);
                        for (r, &v) in out[0].iter().enumerate().take(cols) {
                            *y.add(i * n + j + r) = v;
                        }
                    }
                }
            }
            j += QR;
        }
        t0 = t_end;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::{
        BlockQ8_0, BlockQ8_1, BlockQ8K, dequantize_row, quantize_row_q8_0, quantize_row_q8_1,
        quantize_row_q8_k,
    };
    use bytemuck::Zeroable;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    fn unit(seed: &mut u64) -> f32 {
        (lcg(seed) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    /// An f16 scale of varied magnitude: zero, tiny (subnormal), huge, negative or ordinary.
    fn scale(seed: &mut u64, extreme: bool) -> u16 {
        let v = match lcg(seed) % if extreme { 8 } else { 3 } {
            0..=2 => 0.002 + unit(seed).abs() * 0.05,
            3 => 0.0,
            4 => 6e-8,
            5 => 30000.0,
            6 => -0.04,
            _ => 1.0,
        };
        half::f16::from_f32(v).to_bits()
    }

    /// Random blocks of `dtype`: random bytes with scales put where the format has them. With
    /// `all_max`, every quantized value is at its largest.
    pub(crate) fn random_row(dtype: DType, k: usize, seed: &mut u64, extreme: bool) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut bytes: Vec<u8> = (0..dtype.row_bytes(k)).map(|_| lcg(seed) as u8).collect();
        for blk in bytes.chunks_exact_mut(bb) {
            let all_max = extreme && lcg(seed).is_multiple_of(6);
            if all_max {
                blk.fill(0xFF);
            }
            let offsets: &[usize] = match dtype {
                DType::Q8_0 | DType::Q4_0 => &[0],
                DType::Q4_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
                DType::Q6_K => &[208],
                _ => unreachable!(),
            };
            for &off in offsets {
                blk[off..off + 2].copy_from_slice(&scale(seed, extreme).to_le_bytes());
            }
            if dtype == DType::Q6_K && all_max {
                for s in &mut blk[192..208] {
                    *s = if lcg(seed).is_multiple_of(2) {
                        0x7F
                    } else {
                        0x80
                    };
                }
            }
            if dtype == DType::Q8_0 && lcg(seed).is_multiple_of(4) {
                blk[2] = 0x80; // -128: a value ggml never writes, which files may still hold.
            }
        }
        bytes
    }

    /// Activations as the kernel sees them: quantized with the public ggml-format functions,
    /// then dequantized.
    pub(crate) fn dequantized_activations(dtype: DType, x: &[f32]) -> Vec<f64> {
        let k = x.len();
        match dtype {
            DType::Q4_1 => {
                let mut b = vec![BlockQ8_1::zeroed(); k / 32];
                quantize_row_q8_1(x, &mut b);
                b.iter()
                    .flat_map(|b| {
                        let d = half::f16::from_le_bytes(b.d).to_f64();
                        b.qs.map(|q| q as f64 * d)
                    })
                    .collect()
            }
            DType::Q8_0 | DType::Q4_0 => {
                let mut b = vec![BlockQ8_0::zeroed(); k / 32];
                quantize_row_q8_0(x, &mut b);
                b.iter()
                    .flat_map(|b| {
                        let d = half::f16::from_le_bytes(b.d).to_f64();
                        b.qs.map(|q| q as f64 * d)
                    })
                    .collect()
            }
            _ => {
                let mut b = vec![BlockQ8K::zeroed(); k / 256];
                quantize_row_q8_k(x, &mut b);
                b.iter()
                    .flat_map(|b| b.qs.map(|q| q as f64 * b.d as f64))
                    .collect()
            }
        }
    }

    /// The plain reference for one output: weights dequantized to f32, activations quantized
    /// and dequantized as the kernel's are, the dot in f64 (Q4_1 takes Q8_1's f16 `s` for the
    /// `m` term, as llama.cpp does). Also returns a bound of the terms' sizes, for tolerances:
    /// `Σ|w·x|` plus, for formats with an offset term (Q4_1's `m`, the K formats' mins), that
    /// term's size (the row decoded with `d = 0`).
    pub(crate) fn reference(dtype: DType, row: &[u8], x: &[f32]) -> (f64, f64) {
        let k = x.len();
        let xs = dequantized_activations(dtype, x);
        let mut wf = vec![0f32; k];
        dequantize_row(dtype, row, &mut wf);
        let mut w0 = vec![0f32; k];
        if matches!(dtype, DType::Q4_1 | DType::Q4_K | DType::Q5_K) {
            let mut zeroed = row.to_vec();
            for blk in zeroed.chunks_exact_mut(dtype.block_bytes()) {
                blk[..2].fill(0);
            }
            dequantize_row(dtype, &zeroed, &mut w0);
        }
        let mut want: f64 = (0..k).map(|p| wf[p] as f64 * xs[p]).sum();
        let size: f64 = (0..k)
            .map(|p| xs[p].abs() * (wf[p].abs() + 2.0 * w0[p].abs()) as f64)
            .sum();
        if dtype == DType::Q4_1 {
            let mut b = vec![BlockQ8_1::zeroed(); k / 32];
            quantize_row_q8_1(x, &mut b);
            for (q8, w) in b.iter().zip(row.chunks_exact(20)) {
                let m = half::f16::from_le_bytes([w[2], w[3]]).to_f64();
                let d = half::f16::from_le_bytes(q8.d).to_f64();
                let sum: f64 = q8.qs.iter().map(|&q| q as f64).sum();
                let s = half::f16::from_le_bytes(q8.s).to_f64();
                want += m * (s - d * sum);
            }
        }
        (want, size)
    }

    fn quantize_acts(dtype: DType, x: &[f32], m: usize, k: usize) -> (ActLayout, Vec<u64>) {
        let layout = ActLayout::new(ActKind::for_weights(dtype), k);
        let mut buf = vec![0u64; (m * layout.stride).div_ceil(8) + 8];
        let base = buf.as_mut_ptr().cast::<u8>();
        let base = unsafe { base.add(base.align_offset(64)) };
        for i in 0..m {
            unsafe {
                quantize_activation_row(
                    &layout,
                    &x[i * k..(i + 1) * k],
                    base.add(i * layout.stride),
                )
            };
        }
        (layout, buf)
    }

    fn run(
        isa: QIsa,
        dtype: DType,
        w: &[u8],
        n: usize,
        acts: &[u64],
        layout: ActLayout,
        m: usize,
    ) -> Vec<f32> {
        let base = acts.as_ptr().cast::<u8>();
        let base = unsafe { base.add(base.align_offset(64)) };
        let mut y = vec![f32::NAN; m * n];
        let wide = wide_rows(isa, dtype, m);
        let mut tiles = vec![0u8; tiles_bytes(wide, layout.k)];
        let mut panel = vec![0u8; panel_bytes(layout.k)];
        if wide > 0 {
            unsafe {
                build_tiles(
                    &layout,
                    base,
                    wide,
                    0..wide.div_ceil(TM),
                    tiles.as_mut_ptr(),
                );
            }
        }
        quant_rows(
            isa,
            dtype,
            QJob {
                w: w.as_ptr(),
                row_bytes: dtype.row_bytes(layout.k),
                n,
                rows: (0, n),
                acts: base,
                layout,
                m,
                block_rows: 8,
                y: y.as_mut_ptr(),
                wide,
                tiles: tiles.as_ptr(),
                panel: panel.as_mut_ptr(),
                // Several blocks: each weight row is unpacked more than once.
                block_tiles: 1,
            },
        );
        y
    }

    #[test]
    fn activation_rows_hold_what_the_ggml_format_functions_make() {
        let mut seed = 11u64;
        let k = 512;
        let x: Vec<f32> = (0..k).map(|_| unit(&mut seed) * 4.0).collect();
        let row_of = |buf: &Vec<u64>| unsafe {
            let p = buf.as_ptr().cast::<u8>();
            p.add(p.align_offset(64))
        };
        let (lay, buf) = quantize_acts(DType::Q8_0, &x, 1, k);
        let row = row_of(&buf);
        let mut b1 = vec![BlockQ8_1::zeroed(); k / 32];
        quantize_row_q8_1(&x, &mut b1);
        for (b, blk) in b1.iter().enumerate() {
            unsafe {
                let qs = std::slice::from_raw_parts(row.cast::<i8>().add(32 * b), 32);
                assert_eq!(qs, &blk.qs);
                assert_eq!(
                    rdf32(row.add(lay.d), b),
                    half::f16::from_le_bytes(blk.d).to_f32()
                );
                assert_eq!(
                    rdf32(row.add(lay.b), b),
                    half::f16::from_le_bytes(blk.s).to_f32()
                );
                let sum: i32 = blk.qs.iter().map(|&q| q as i32).sum();
                assert_eq!(row.add(lay.a).cast::<i32>().add(b).read(), sum);
            }
        }
        let natural = unsafe { std::slice::from_raw_parts(row.cast::<i8>(), k).to_vec() };
        // Q4_0's layout: pairs of blocks as their nibbles unpack.
        let (_, buf) = quantize_acts(DType::Q4_0, &x, 1, k);
        let inter = unsafe { std::slice::from_raw_parts(row_of(&buf).cast::<i8>(), k) };
        for (n, i) in natural.chunks(64).zip(inter.chunks(64)) {
            assert_eq!(&i[..16], &n[..16]);
            assert_eq!(&i[16..32], &n[32..48]);
            assert_eq!(&i[32..48], &n[16..32]);
            assert_eq!(&i[48..], &n[48..]);
        }
        // Q4_1's: each four blocks as their first halves, then their second halves.
        let (_, buf) = quantize_acts(DType::Q4_1, &x, 1, k);
        let inter = unsafe { std::slice::from_raw_parts(row_of(&buf).cast::<i8>(), k) };
        for (n, i) in natural.chunks(128).zip(inter.chunks(128)) {
            for b in 0..4 {
                assert_eq!(&i[16 * b..16 * b + 16], &n[32 * b..32 * b + 16]);
                assert_eq!(&i[64 + 16 * b..80 + 16 * b], &n[32 * b + 16..32 * b + 32]);
            }
        }

        let (lay, buf) = quantize_acts(DType::Q6_K, &x, 1, k);
        let row = row_of(&buf);
        let mut bk = vec![BlockQ8K::zeroed(); k / 256];
        quantize_row_q8_k(&x, &mut bk);
        for (b, blk) in bk.iter().enumerate() {
            unsafe {
                let qs = std::slice::from_raw_parts(row.cast::<i8>().add(256 * b), 256);
                assert_eq!(qs, &blk.qs);
                assert_eq!(rdf32(row.add(lay.d), b), blk.d);
                let bs = std::slice::from_raw_parts(row.add(lay.a).cast::<i16>().add(16 * b), 16);
                assert_eq!(bs, &blk.bsums);
                for t in 0..8 {
                    let p = row.add(lay.b).cast::<i16>().add(8 * b + t).read();
                    assert_eq!(p, blk.bsums[2 * t] + blk.bsums[2 * t + 1]);
                }
            }
        }
        // Q4_K's layout: each 128 values as sub-blocks 0, 2, 1, 3.
        let natural = unsafe { std::slice::from_raw_parts(row.cast::<i8>(), k).to_vec() };
        let (_, buf) = quantize_acts(DType::Q4_K, &x, 1, k);
        let inter = unsafe { std::slice::from_raw_parts(row_of(&buf).cast::<i8>(), k) };
        for (n, i) in natural.chunks(128).zip(inter.chunks(128)) {
            assert_eq!(&i[..32], &n[..32]);
            assert_eq!(&i[32..64], &n[64..96]);
            assert_eq!(&i[64..96], &n[32..64]);
            assert_eq!(&i[96..], &n[96..]);
        }
    }

    /// Every kernel, every instruction set, against `Σ dequant(w)·dequant(quant(x))` in f64;
    /// every set gives the portable kernel's bits.
    #[test]
    fn kernels_match_f64_reference_and_agree_across_sets() {
        let dtypes = [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ];
        for dtype in dtypes {
            for &(n, blocks, m, extreme) in &[
                (1, 1, 1, false),
                (8, 2, 1, false),
                (13, 3, 5, true),
                (17, 5, 4, false),
                (9, 4, 2, true),
                (3, 1, 9, true),
                // The wide road, with Q4_K's last rows alone (three, then one).
                (11, 2, 35, true),
                (16, 3, 16, false),
                (9, 1, 33, false),
            ] {
                let k = blocks * dtype.block_size();
                let mut seed = (n * 31 + k * 7 + m) as u64 + dtype.ggml_type() as u64 * 1000;
                let w: Vec<u8> = (0..n)
                    .flat_map(|_| random_row(dtype, k, &mut seed, extreme))
                    .collect();
                let mut x: Vec<f32> = (0..m * k).map(|_| unit(&mut seed) * 3.0).collect();
                if extreme {
                    // An all-zero block and a huge one.
                    x[..dtype.block_size().min(k)].fill(0.0);
                    x[(m - 1) * k] = 1e4;
                }
                let (layout, acts) = quantize_acts(dtype, &x, m, k);
                let rb = dtype.row_bytes(k);
                let (want, magnitude): (Vec<f64>, Vec<f64>) = (0..m * n)
                    .map(|idx| {
                        let (i, j) = (idx / n, idx % n);
                        reference(dtype, &w[j * rb..(j + 1) * rb], &x[i * k..(i + 1) * k])
                    })
                    .unzip();
                let portable = run(QIsa::Portable, dtype, &w, n, &acts, layout, m);
                for (idx, (&got, &want)) in portable.iter().zip(&want).enumerate() {
                    let tol = 2e-6 * magnitude[idx] * (k as f64 / 32.0).sqrt() + 1e-30;
                    assert!(
                        (got as f64 - want).abs() <= tol,
                        "{dtype} n={n} k={k} m={m}: y[{}, {}] = {got}, want {want} (tol {tol})",
                        idx / n,
                        idx % n
                    );
                }
                for isa in QIsa::available() {
                    let got = run(isa, dtype, &w, n, &acts, layout, m);
                    let same = got
                        .iter()
                        .zip(&portable)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dtype} {isa:?} n={n} k={k} m={m}: {got:?} vs portable {portable:?}"
                    );
                }
            }
        }
    }
}
