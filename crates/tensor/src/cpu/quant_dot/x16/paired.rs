//! The group layout Q8_0 and Q4_0 share: blocks in pairs, the values first, so that every
//! 64-byte step of a kernel lies on a cache line of its own (a group block of 16 × 34 or
//! 16 × 18 bytes left every other block's steps across two lines, which read L2 at half the
//! rate). A pair is the two blocks' `QS` bytes of values, then their [`SCALES`] bytes of
//! f16 scales (one a row); a last, unpaired block is its values, then its scales.

/// Bytes of a group block's scales: one f16 for each of the 16 rows.
const SCALES: usize = 32;

/// Where block `b` of a group of `nb` blocks keeps its values and its scales, for blocks of
/// `QS` bytes of values.
#[inline(always)]
pub(super) fn block_at<const QS: usize>(b: usize, nb: usize) -> (usize, usize) {
    let base = b / 2 * 2 * (QS + SCALES);
    let in_pair = (nb - b / 2 * 2).min(2);
    (base + QS * (b % 2), base + QS * in_pair + SCALES * (b % 2))
}

/// Calls `block(qs, d, b)` for each block `b` of the group at `g` (`nb` blocks of `QS` bytes
/// of values) in order, with where its values and scales lie ([`block_at`]), the offsets
/// constant within a pair (a loop that computed them block by block ran Q8_0's AVX2 kernel 30%
/// slower). Prefetches each pair's scales `ahead`; the kernels prefetch their values. The
/// kernels' `block`s are `#[inline(always)]`: left to LLVM, the VNNI ones for 4 rows stayed a
/// call per block.
#[inline(always)]
pub(super) unsafe fn each_block<const QS: usize>(
    g: *const u8,
    nb: usize,
    ahead: usize,
    mut block: impl FnMut(*const u8, *const u8, usize),
) {
    unsafe {
        for p in 0..nb / 2 {
            let base = g.add(p * 2 * (QS + SCALES));
            #[cfg(target_arch = "x86_64")]
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                base.add(ahead + 2 * QS).cast(),
            );
            block(base, base.add(2 * QS), 2 * p);
            block(base.add(QS), base.add(2 * QS + SCALES), 2 * p + 1);
        }
        if nb % 2 == 1 {
            let base = g.add(nb / 2 * 2 * (QS + SCALES));
            block(base, base.add(QS), nb - 1);
        }
    }
}
