//! The wide batched road (Q4_K, Q6_K with VNNI, batches of [`WIDE_MIN_ROWS`] rows or more).
//!
//! The tiles hold one weight row per lane, so every (weight row, activation row) sum must be
//! reduced across lanes before its float step. Here a lane holds an activation row instead:
//! [`TM`] activation rows are interleaved four bytes at a time ([`build_tiles`]), each four
//! weight values are broadcast to all lanes, and one `vpdpbusd` adds the four products of every
//! row, so no sum is ever reduced. The weights are unpacked to bytes once per activation block
//! ([`Kernel::unpack`](super::tiles::Kernel::unpack)). The integer sums are the tiles' exact
//! sums and the float steps the tiles' own, lane for lane, so a row gives the same bits here as
//! alone.

use super::QR;
use super::act::{ActKind, ActLayout};
use super::qv::{Qv, rd16};
use super::rows::QIsa;
use super::tiles::{Kernel, rdf32};
use super::x16::{X16, plain_rows8};
use crate::dtype::DType;
use crate::quant::scales_mins_k4_u64;

/// Activation rows a wide tile holds, one i32 lane each.
pub(crate) const TM: usize = 16;

/// One super-block of a wide activation tile: the rows' `qs` bytes (below), then each row's
/// `d`, then the pairs of `bsums` (of 16 values, then of 32) as the i16 pairs `vpdpwssd` takes,
/// `[i][lane]`. The `qs` bytes, in the stored order of [`ActKind::Q8K`] or [`ActKind::Q8KI`]:
///
/// - Q4_K (`Q8KI`): `[g][lane]` the row's bytes `4g..4g+4`, lane `l` row `l`;
/// - Q6_K (`Q8K`): per pair `p = 8j + l` of four-value groups `16j + l` and `16j + 8 + l` (the
///   two that [`wide_q6k`] scales together), two vectors, rows `0..8` then `8..16`, each row's
///   two groups side by side; the `vpackssdw` that joins the two vectors' sums leaves lane `l`
///   holding row [`tile_row`]`(Q8K, l)`, and so do the per-lane parts.
const TILE_D: usize = 64 * TM * 4;
const TILE_BS16: usize = TILE_D + TM * 4;
const TILE_BS32: usize = TILE_BS16 + 8 * TM * 4;
pub(super) const TILE_SB: usize = TILE_BS32 + 4 * TM * 4;

/// The activation row (within its tile) that lane `lane` of a wide result holds.
#[inline(always)]
pub(super) fn tile_row(kind: ActKind, lane: usize) -> usize {
    match kind {
        // Per 128 bits, `vpackssdw` keeps two rows of each of its inputs.
        ActKind::Q8K => [0, 1, 8, 9][lane % 4] + 2 * (lane / 4),
        _ => lane,
    }
}

/// One super-block of [`QR`] unpacked weight rows: `[row][256]` the values as bytes (Q4_K: in
/// the activations' stored order; Q6_K: per pair of groups, as the tile pairs them), then the
/// scales `[i][row]` (Q4_K: sub-block `i`'s as i32, for `vpmulld`; Q6_K: those of the pairs'
/// sub-blocks `4j + h` and `4j + 2 + h` as two i16 at `i = 2j + h`, for `vpdpwssd`), `[pair][row]`
/// two i16 (Q4_K: the mins of sub-blocks `2j`, `2j+1`; Q6_K: `-32·` the scales of `2p`,
/// `2p+1`), then each row's `d` and `dmin` as f32.
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

/// The activation rows of a batch of `m` that the wide road computes: for Q4_K and Q6_K with
/// VNNI, those that fill its tiles at least [`WIDE_MIN_FILL`] full; the rest take the tiles
/// ([`super::tiles`]).
///
/// Interleaved Q4_K rows ([`super::x16`]) run every batch faster on their own kernel (a third
/// faster for 16 to 128 rows, one core, weights in L2); interleaved Q6_K rows take the wide
/// road as plain ones do (one core, 1536 wide: 16 rows 94 against 61 GB/s of weights a row,
/// 64 rows 128 against 58).
pub(crate) fn wide_rows(isa: QIsa, dtype: DType, m: usize, interleaved: bool) -> usize {
    match dtype {
        DType::Q4_K if interleaved => 0,
        DType::Q4_K | DType::Q6_K if isa == QIsa::Avx512Vnni => {
            if m % TM >= WIDE_MIN_FILL {
                m
            } else {
                m / TM * TM
            }
        }
        _ => 0,
    }
}

/// Rows a last, partly empty wide tile must have to beat the tiles, which take rows in fours
/// and the rest one by one (Qwen2.5-1.5B Q4_K_M prompts of 17, 20 and 28 tokens ran 10-30%
/// faster with their last 1, 4 and 12 rows in tiles, 24 as fast, 31 and 15 faster or as fast
/// all on the wide road).
const WIDE_MIN_FILL: usize = 13;

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
        let row = |i: usize| unsafe { acts.add((tile * TM + i).min(rows - 1) * layout.stride) };
        for sb in 0..nsb {
            let put =
                |off: usize, v: u32| unsafe { base.add(sb * TILE_SB + off).cast::<u32>().write(v) };
            for i in 0..TM {
                let x = row(i);
                for g in 0..64 {
                    let at = if layout.kind == ActKind::Q8K {
                        let (j, l, second) = (g / 16, g % 8, g % 16 >= 8);
                        128 * (8 * j + l) + 64 * (i / 8) + 8 * (i % 8) + 4 * second as usize
                    } else {
                        4 * (g * TM + i)
                    };
                    put(at, word(x, 64 * sb + g));
                }
            }
            for lane in 0..TM {
                let x = row(tile_row(layout.kind, lane));
                unsafe {
                    put(TILE_D + 4 * lane, word(x.add(layout.d), sb));
                    for p in 0..8 {
                        put(
                            TILE_BS16 + 4 * (p * TM + lane),
                            word(x.add(layout.a), 8 * sb + p),
                        );
                    }
                    for j in 0..4 {
                        put(
                            TILE_BS32 + 4 * (j * TM + lane),
                            word(x.add(layout.b), 4 * sb + j),
                        );
                    }
                }
            }
        }
    }
}

/// Rows `r0..r0 + QR` of an interleaved group ([`super::x16`], `nsb` super-blocks) to a
/// panel: each super-block's rows back to their plain bytes, then unpacked as plain rows are.
///
/// # Safety
/// `group` holds a group of `K`'s type; `panel` has room for `nsb` super-blocks.
#[inline(always)]
pub(super) unsafe fn unpack_interleaved<Q: Qv, K: Kernel>(
    group: *const u8,
    r0: usize,
    nsb: usize,
    panel: *mut u8,
) {
    const { assert!(QR == 8) };
    let block = K::DTYPE.row_bytes(256);
    let mut plain = [0u8; QR * 256];
    for sb in 0..nsb {
        unsafe {
            plain_rows8(
                K::DTYPE,
                group.add(sb * X16 * block),
                r0,
                plain.as_mut_ptr(),
            );
            let rows = std::array::from_fn(|r| plain.as_ptr().add(r * block));
            K::unpack::<Q>(rows, 1, panel.add(sb * PANEL_SB));
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
pub(super) unsafe fn unpack_q4k<Q: Qv>(w: [*const u8; QR], nsb: usize, panel: *mut u8) {
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

/// Q6_K rows to a panel, values `0..64` (the `+32` taken off through the bsums), each pair of
/// groups `16j + l`, `16j + 8 + l` as eight bytes at `8·(8j + l)`.
#[inline(always)]
pub(super) unsafe fn unpack_q6k<Q: Qv>(w: [*const u8; QR], nsb: usize, panel: *mut u8) {
    unsafe {
        let (low, top) = (Q::splat8(0x0F), Q::splat8(0x30));
        for sb in 0..nsb {
            let p = panel.add(sb * PANEL_SB);
            for (r, row) in w.iter().enumerate() {
                let blk = row.add(sb * 210);
                for h in 0..2 {
                    let ql = Q::load(blk.add(64 * h));
                    let hv = Q::dup_shr::<2>(blk.add(128 + 32 * h));
                    // Groups `32h..32h + 16` (the pairs of `j = 2h`), then the next 16.
                    let w0 = Q::or(Q::and(ql, low), Q::and(Q::shl4(hv), top));
                    let w1 = Q::or(Q::and(Q::shr4(ql), low), Q::and(hv, top));
                    Q::store(p.add(256 * r + 128 * h), Q::zip_halves(w0));
                    Q::store(p.add(256 * r + 128 * h + 64), Q::zip_halves(w1));
                }
                let sc = blk.add(192).cast::<i8>();
                for j in 0..4 {
                    for h in 0..2 {
                        let v = |s: usize| *sc.add(s) as i16 as u16 as u32;
                        put_panel(
                            p,
                            PANEL_SC,
                            2 * j + h,
                            r,
                            v(4 * j + h) | v(4 * j + 2 + h) << 16,
                        );
                    }
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

/// The scaled sum of one Q4_K sub-block for every panel row: eight four-value groups from
/// position `pos` of the panel's and the tile's values, added as `sc·Σ` to `s`.
#[inline(always)]
unsafe fn wide_sub_block<Q: Qv>(
    p: *const u8,
    t: *const u8,
    pos: usize,
    sub: usize,
    s: &mut [Q::V; QR],
) {
    unsafe {
        let mut part = [Q::zero(); QR];
        for g in 0..8 {
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

/// Q4_K: [`tile_q45k`](super::tiles)'s steps, per super-block `acc = fma(s, d_w·d_x, acc)` and
/// `acc_min = fma(m, dmin_w·d_x, acc_min)`, the result `acc − acc_min`.
#[inline(always)]
pub(super) unsafe fn wide_q4k<Q: Qv>(panel: *const u8, tile: *const u8, nsb: usize) -> [Q::F2; QR] {
    // Where sub-block `s` of a 128-value half lies in [`ActKind::Q8KI`]'s order.
    const POS: [usize; 4] = [0, 64, 32, 96];
    unsafe {
        let mut acc = [Q::f2zero(); QR];
        for sb in 0..nsb {
            let (p, t) = (panel.add(sb * PANEL_SB), tile.add(sb * TILE_SB));
            let mut s = [Q::zero(); QR];
            for sub in 0..8 {
                wide_sub_block::<Q>(p, t, 128 * (sub / 4) + POS[sub % 4], sub, &mut s);
            }
            let dx = Q::f2load(t.add(TILE_D));
            for (r, acc) in acc.iter_mut().enumerate() {
                let dd = Q::fmul2(Q::f2splat(rdf32(p.add(PANEL_D), r)), dx);
                *acc = Q::ffma2(Q::cvt2(s[r]), dd, *acc);
            }
        }
        // The mins' terms do not depend on the values: their own pass, after.
        let mut acc_min = [Q::f2zero(); QR];
        for sb in 0..nsb {
            let (p, t) = (panel.add(sb * PANEL_SB), tile.add(sb * TILE_SB));
            let mut m = [Q::zero(); QR];
            for j in 0..4 {
                let bs = Q::load(t.add(TILE_BS32 + 64 * j));
                for (r, m) in m.iter_mut().enumerate() {
                    let mins = Q::bcast32(p.add(PANEL_PAIRS + 4 * (j * QR + r)));
                    *m = Q::dpwssd(*m, mins, bs);
                }
            }
            let dx = Q::f2load(t.add(TILE_D));
            for (r, acc_min) in acc_min.iter_mut().enumerate() {
                let dm = Q::fmul2(Q::f2splat(rdf32(p.add(PANEL_DMIN), r)), dx);
                *acc_min = Q::ffma2(Q::cvt2(m[r]), dm, *acc_min);
            }
        }
        std::array::from_fn(|r| Q::fsub2(acc[r], acc_min[r]))
    }
}

/// Q6_K: [`tile_q6k`](super::tiles)'s eight lanes per output, each its own accumulator here.
/// Lane `l` of a super-block holds the four-value groups `g ≡ l (mod 8)`, group `g` (of
/// sub-block `g / 4`) scaled by its sub-block's scale, less `32·(sc·bsum)` of sub-blocks `2l`,
/// `2l + 1`; then `acc[l] = fma(d_x·d_w, lane, acc[l])`, and the result `hsum_float_8(acc)`.
///
/// Each group needs its own scale, so the groups go two at a time (`16j + l` and
/// `16j + 8 + l`, of the same lane): one `vpdpbusd` per eight rows gives both groups' sums
/// (eight bytes of weights broadcast), `vpackssdw` makes them i16 pairs (they fit: below
/// `4·63·128`), and one `vpdpwssd` scales and adds both. Lanes come out in
/// [`tile_row`] order.
// Indices name rows and lanes across several arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(super) unsafe fn wide_q6k<Q: Qv>(panel: *const u8, tile: *const u8, nsb: usize) -> [Q::F2; QR] {
    unsafe {
        let mut acc = [[Q::f2zero(); 8]; QR];
        for sb in 0..nsb {
            let (p, t) = (panel.add(sb * PANEL_SB), tile.add(sb * TILE_SB));
            let dx = Q::f2load(t.add(TILE_D));
            let d: [Q::F2; QR] =
                std::array::from_fn(|r| Q::fmul2(dx, Q::f2splat(rdf32(p.add(PANEL_D), r))));
            for l in 0..8 {
                // Lane `l` of every row: the mins' term, then the pairs of groups, each
                // activation vector loaded once for all the rows.
                let bs = Q::load(t.add(TILE_BS16 + 64 * l));
                let mut s: [Q::V; QR] = std::array::from_fn(|r| {
                    let pairs = Q::bcast32(p.add(PANEL_PAIRS + 4 * (l * QR + r)));
                    Q::dpwssd(Q::zero(), pairs, bs)
                });
                for j in 0..4 {
                    let pair = 8 * j + l;
                    let (x0, x1) = (Q::load(t.add(128 * pair)), Q::load(t.add(128 * pair + 64)));
                    for (r, s) in s.iter_mut().enumerate() {
                        let w = Q::bcast64(p.add(256 * r + 8 * pair));
                        let sums =
                            Q::packs32(Q::dpbusd(Q::zero(), w, x0), Q::dpbusd(Q::zero(), w, x1));
                        let sc = Q::bcast32(p.add(PANEL_SC + 4 * ((2 * j + l / 4) * QR + r)));
                        *s = Q::dpwssd(*s, sums, sc);
                    }
                }
                for r in 0..QR {
                    acc[r][l] = Q::ffma2(d[r], Q::cvt2(s[r]), acc[r][l]);
                }
            }
        }
        std::array::from_fn(|r| {
            let a = &acc[r];
            let (r0, r1) = (Q::fadd2(a[4], a[0]), Q::fadd2(a[5], a[1]));
            let (r2, r3) = (Q::fadd2(a[6], a[2]), Q::fadd2(a[7], a[3]));
            Q::fadd2(Q::fadd2(r0, r2), Q::fadd2(r1, r3))
        })
    }
}
