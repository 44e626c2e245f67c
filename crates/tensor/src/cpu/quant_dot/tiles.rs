//! The tiles, one per weight type: [`QR`] weight rows against one activation row (decode) or
//! [`QM`](super::QM) (prefill), one f32 lane per weight row. A tile forms every (weight row,
//! activation row) integer sum of a block, reduces it across lanes, then takes the type's float
//! steps; a row's steps never depend on how many rows the tile holds, so a tile of four and a
//! row alone give the same bits.

use super::QR;
use super::act::ActLayout;
use super::prefetch_ahead;
use super::qv::{Qv, put16, rd16};
use super::wide::{unpack_q4k, unpack_q6k, wide_q4k, wide_q6k};
use crate::dtype::DType;

/// llama.cpp's `hsum_float_8`: lanes `(l, l+4)`, then `(l, l+2)`, then `(l, l+1)`.
#[inline(always)]
pub(super) fn hsum_float_8(v: &[f32]) -> f32 {
    let (r0, r1, r2, r3) = (v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]);
    (r0 + r2) + (r1 + r3)
}

#[inline(always)]
pub(super) unsafe fn rdf32(p: *const u8, i: usize) -> f32 {
    unsafe { p.cast::<f32>().add(i).read() }
}

/// One weight type's tile: `QR` weight rows (`w`, each `k` columns) against `M` activation
/// rows (`a`, laid out by `lay`); `out[i][r]` receives row `r`'s dot with activation `i`.
pub(crate) trait Kernel {
    /// The weight type.
    const DTYPE: DType;
    unsafe fn tile<Q: Qv, const M: usize>(
        w: [*const u8; QR],
        a: [*const u8; M],
        lay: &ActLayout,
        out: &mut [[f32; QR]; M],
    );
    /// The wide road ([`wide_rows`](super::wide_rows)): unpacks `QR` weight rows of `nsb`
    /// super-blocks to a panel.
    unsafe fn unpack<Q: Qv>(w: [*const u8; QR], nsb: usize, panel: *mut u8) {
        let _ = (w, nsb, panel);
        unreachable!("no wide road for this type")
    }
    /// The wide road: a panel's rows against a tile's [`TM`](super::TM) activation rows, lane
    /// `l` of result `r` the dot of weight row `r` with the tile's activation row
    /// [`tile_row`](super::wide::tile_row)`(kind, l)`.
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
                // Both ends of the pair: a Q8_0 pair (68 bytes) is longer than a line.
                let ahead = prefetch_ahead(nb * bb);
                Q::prefetch(p0.add(ahead));
                Q::prefetch(p0.add(ahead + 2 * bb - 1));
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
                    let ahead = prefetch_ahead(nb * BB);
                    Q::prefetch(p[r].add(ahead));
                    Q::prefetch(p[r].add(ahead + 64));
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
/// stored in ([`ActKind::Q8KI`](super::ActKind::Q8KI)). Per super-block the whole integer sum
/// `s = Σ sc·Σ q·x` and the mins' sum `m = Σ min·bsum` are exact; then
///
/// - Q4_K, as llama.cpp's repacked x86 kernel for one row (`ggml_gemv_q4_K_8x8_q8_K`):
///   `acc = fma(s, d_w·d_x, acc)`, `acc_min = fma(m, dmin_w·d_x, acc_min)`, the result
///   `acc − acc_min`. llama.cpp's batched kernel (`ggml_gemm_q4_K_8x8_q8_K`, rows in groups of
///   four) takes a fused step per 64 values instead; every row here takes the one-row form, so
///   a row's result is the same alone, in any batch, and on the wide road.
/// - Q5_K, ember's own order: `acc += (d_w·d_x)·s − (dmin_w·d_x)·m`.
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
            let mut ints = [[Q::zero(); QR]; M];
            for r in 0..QR {
                let blk = blks[r];
                let ahead = prefetch_ahead(nsb * bb);
                for line in 0..bb.div_ceil(64) {
                    Q::prefetch(blk.add(ahead + 64 * line));
                }
                let scales = Q::scales8(sc[r]);
                let mut hv = if Q5 {
                    Q::dup_shr::<2>(blk.add(16))
                } else {
                    Q::zero()
                };
                let low = Q::splat8(0x0F);
                let mut ai = [Q::zero(); M];
                for c in 0..2 {
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
                for i in 0..M {
                    ints[i][r] = ai[i];
                }
            }
            for i in 0..M {
                let bs32 = a[i].add(lay.b).cast::<i16>().add(8 * sb);
                let dx = Q::fsplat(rdf32(a[i].add(lay.d), sb));
                let (g0, g1) = Q::reduce(&ints[i]);
                let s1 = Q::iadd(g0, g1);
                let s2 = Q::mins_dot8(&mins, bs32);
                if Q5 {
                    let t = Q::fsub(
                        Q::fmul(Q::fmul(fdw, dx), Q::cvt(s1)),
                        Q::fmul(Q::fmul(fdm, dx), Q::cvt(s2)),
                    );
                    acc[i] = Q::fadd(acc[i], t);
                } else {
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
/// `acc = fma(d_x·d_w, lane, acc)`; the result `hsum_float_8(acc)`. llama.cpp takes another
/// kernel for eight rows or more (`ggml-cpu/tiled`: one sum per super-block); every row here
/// takes the one-row form, so a row's result is the same alone, in any batch, and on the
/// wide road.
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
        for sb in 0..nsb {
            let mut dw = [0u64; 2];
            let mut ints = [[Q::zero(); QR]; M];
            for r in 0..QR {
                let blk = w[r].add(sb * BB);
                let ahead = prefetch_ahead(nsb * BB);
                for line in 0..BB.div_ceil(64) {
                    Q::prefetch(blk.add(ahead + 64 * line));
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
                    let scales = Q::scales8_i8(sc.add(8 * h));
                    for s in 0..2 {
                        let (nib, hb) = if s == 0 {
                            (ql, Q::shl4(hv))
                        } else {
                            (Q::shr4(ql), hv)
                        };
                        let wv = Q::or(Q::and(nib, Q::splat8(0x0F)), Q::and(hb, Q::splat8(0x30)));
                        let scv = Q::scales4(scales, s);
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

macro_rules! kernel {
    ($name:ident, $dtype:ident, $tile:ident $(, $arg:expr)? $(; wide: $unpack:ident, $wide:ident)?) => {
        pub(crate) struct $name;
        impl Kernel for $name {
            const DTYPE: DType = DType::$dtype;
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

kernel!(KQ8_0, Q8_0, tile_q32, 0);
kernel!(KQ4_0, Q4_0, tile_q32, 1);
kernel!(KQ4_1, Q4_1, tile_q41);
kernel!(KQ4K, Q4_K, tile_q45k, false; wide: unpack_q4k, wide_q4k);
kernel!(KQ5K, Q5_K, tile_q45k, true);
kernel!(KQ6K, Q6_K, tile_q6k; wide: unpack_q6k, wide_q6k);
