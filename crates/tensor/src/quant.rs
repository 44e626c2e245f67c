//! ggml's block-quantized weight formats: their layouts, dequantization, and the quantization
//! of activations that the integer dot kernels ([`crate::cpu::matmul`]) multiply them with.
//!
//! Every layout is ggml's, byte for byte (little-endian, f16 scales), so GGUF tensor data is
//! read in place. Activations are quantized as llama.cpp quantizes them, so that results track
//! llama.cpp's:
//! - Q4_0 and Q8_0 weights meet activations in Q8_0 blocks (`d = max|x|/127`,
//!   `q = round(x·127/max|x|)`, ties to even, as ggml's x86 path rounds);
//! - Q4_1 weights meet Q8_1 blocks (Q8_0 plus `s = d·Σq`);
//! - Q4_K, Q5_K and Q6_K weights meet Q8_K blocks (256 elements, f32 `d`, the largest-magnitude
//!   element quantized to −127, sums of each 16 values), exactly ggml's
//!   `quantize_row_q8_K_ref`.

use bytemuck::{Pod, Zeroable};

use crate::dtype::{DType, bf16_to_f32, f16_to_f32, f32_to_f16};

/// Elements per block of the 32-element formats (Q4_0, Q4_1, Q8_0, Q8_1).
pub const QK: usize = 32;
/// Elements per super-block of the K formats (Q4_K, Q5_K, Q6_K, Q8_K).
pub const QK_K: usize = 256;

/// Q4_0: `x[i] = (q[i] − 8)·d`; byte `j` holds element `j` (low nibble) and `j + 16` (high).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// f16 bits, little-endian.
    pub d: [u8; 2],
    pub qs: [u8; QK / 2],
}

/// Q4_1: `x[i] = q[i]·d + m`, nibbles as in Q4_0.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qs: [u8; QK / 2],
}

/// Q8_0: `x[i] = q[i]·d`. Also the activation format Q4_0 and Q8_0 weights meet.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [i8; QK],
}

/// Q8_1: Q8_0 plus `s = d·Σq` (f16): the activation format Q4_1 weights meet.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    pub d: [u8; 2],
    pub s: [u8; 2],
    pub qs: [i8; QK],
}

/// Q4_K: 8 sub-blocks of 32; `x = d·sc[j]·q − dmin·m[j]` with 6-bit `sc`, `m` packed in
/// `scales` (see [`scale_min_k4`]). Byte `l` of `qs[32c..32c+32]` holds element `64c + l`
/// (low nibble) and `64c + 32 + l` (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: Q4_K plus a fifth bit: bit `2c` of `qh[l]` is the high bit of element `64c + l`,
/// bit `2c + 1` that of element `64c + 32 + l`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: `x = d·sc[i/16]·(q − 32)`, q six bits: low four in `ql`, high two in `qh`. In each
/// 128-element half `h`, element `l < 32` takes the low nibble of `ql[64h + l]` and bits 0–1 of
/// `qh[32h + l]`; `l + 32`: low nibble of `ql[64h + 32 + l]`, bits 2–3; `l + 64`: high nibble
/// of `ql[64h + l]`, bits 4–5; `l + 96`: high nibble of `ql[64h + 32 + l]`, bits 6–7.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: [u8; 2],
}

/// Q8_K: the activation format the K weights meet. `d` is f32 and may be negative (the
/// largest-magnitude element is always −127); `bsums[j]` is the sum of `qs[16j..16j+16]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

const _: () = {
    assert!(size_of::<BlockQ4_0>() == 18);
    assert!(size_of::<BlockQ4_1>() == 20);
    assert!(size_of::<BlockQ8_0>() == 34);
    assert!(size_of::<BlockQ8_1>() == 36);
    assert!(size_of::<BlockQ4K>() == 144);
    assert!(size_of::<BlockQ5K>() == 176);
    assert!(size_of::<BlockQ6K>() == 210);
    assert!(size_of::<BlockQ8K>() == 292);
};

#[inline(always)]
fn f16le(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

/// Scale and min `j < 8` of a Q4_K/Q5_K block's packed 12 bytes (ggml's `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All eight scales and mins of a Q4_K/Q5_K block at once: `(scales, mins)`.
#[inline(always)]
pub fn scales_mins_k4(q: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (sc, mn) = scales_mins_k4_u64(q);
    (sc.to_le_bytes(), mn.to_le_bytes())
}

/// [`scales_mins_k4`] as two little-endian words (byte `j` = scale or min `j`), kept in
/// registers by the kernels. ggml's word trick: a few u32 ops instead of sixteen byte ones.
#[inline(always)]
pub(crate) fn scales_mins_k4_u64(q: &[u8; 12]) -> (u64, u64) {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let w = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let sc_lo = u0 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let m_lo = u1 & KMASK1;
    let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        m_lo as u64 | (m_hi as u64) << 32,
    )
}

/// Decodes one row of `out.len()` elements stored as `dtype` (float or quantized) to f32,
/// exactly as ggml's `dequantize_row_*` does.
///
/// # Panics
/// When `bytes` is not `dtype.row_bytes(out.len())` long.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        bytes.len(),
        dtype.row_bytes(out.len()),
        "dequantize_row: {} bytes for {} {dtype} elements",
        bytes.len(),
        out.len()
    );
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        DType::Q8_0 => {
            let blocks: &[BlockQ8_0] = bytemuck::cast_slice(bytes);
            for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
                let d = f16le(b.d);
                for (y, &q) in y.iter_mut().zip(&b.qs) {
                    *y = q as f32 * d;
                }
            }
        }
        DType::Q4_0 => {
            let blocks: &[BlockQ4_0] = bytemuck::cast_slice(bytes);
            for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
                let d = f16le(b.d);
                for (j, &q) in b.qs.iter().enumerate() {
                    y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            let blocks: &[BlockQ4_1] = bytemuck::cast_slice(bytes);
            for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
                let (d, m) = (f16le(b.d), f16le(b.m));
                for (j, &q) in b.qs.iter().enumerate() {
                    y[j] = (q & 0xF) as f32 * d + m;
                    y[j + QK / 2] = (q >> 4) as f32 * d + m;
                }
            }
        }
        DType::Q4_K => {
            let blocks: &[BlockQ4K] = bytemuck::cast_slice(bytes);
            for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
                dequantize_k4(f16le(b.d), f16le(b.dmin), &b.scales, &b.qs, None, y);
            }
        }
        DType::Q5_K => {
            let blocks: &[BlockQ5K] = bytemuck::cast_slice(bytes);
            for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
                dequantize_k4(f16le(b.d), f16le(b.dmin), &b.scales, &b.qs, Some(&b.qh), y);
            }
        }
        DType::Q6_K => {
            let blocks: &[BlockQ6K] = bytemuck::cast_slice(bytes);
            for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
                let d = f16le(b.d);
                for h in 0..2 {
                    let (ql, qh) = (&b.ql[64 * h..64 * h + 64], &b.qh[32 * h..32 * h + 32]);
                    let sc = &b.scales[8 * h..8 * h + 8];
                    let y = &mut y[128 * h..128 * h + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * sc[is] as f32 * q1 as f32;
                        y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                        y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                        y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, for `|v| < 2^22`.
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let t = v + 12_582_912.0;
    (t.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `max |x|`, exact whatever the order (compares magnitudes' bits; no NaN expected).
#[inline(always)]
pub(crate) fn max_abs(x: &[f32]) -> f32 {
    f32::from_bits(x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff)))
}

/// Quantizes a 32-element block to `qs` as ggml's x86 `quantize_row_q8_0`/`_q8_1` do; returns
/// the f32 scale `d` (before f16 rounding) and `Σq`.
#[inline(always)]
pub(crate) fn quantize_block_q8(x: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let amax = max_abs(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let n = nearest_int(v * id);
        *q = n as i8;
        sum += n;
    }
    (d, sum)
}

/// Quantizes a 256-element block as ggml's `quantize_row_q8_K_ref`; returns `d` (f32).
#[inline(always)]
pub(crate) fn quantize_block_q8k(x: &[f32], qs: &mut [i8], bsums: &mut [i16]) -> f32 {
    let amax_bits = max_abs(x).to_bits();
    if amax_bits == 0 {
        qs.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    // The first element of largest magnitude, with its sign.
    let max = *x
        .iter()
        .find(|v| v.to_bits() & 0x7fff_ffff == amax_bits)
        .expect("the maximum is one of the values");
    let iscale = -127.0 / max;
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, q) in bsums.iter_mut().zip(qs.chunks_exact(16)) {
        *s = q.iter().map(|&q| q as i16).sum();
    }
    1.0 / iscale
}

/// Quantizes activations to Q8_0 blocks (`x.len()` a multiple of 32).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    assert_eq!(
        x.len(),
        out.len() * QK,
        "quantize_row_q8_0: length mismatch"
    );
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let (d, _) = quantize_block_q8(x, &mut b.qs);
        b.d = f32_to_f16(d).to_le_bytes();
    }
}

/// Quantizes activations to Q8_1 blocks (`x.len()` a multiple of 32).
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    assert_eq!(
        x.len(),
        out.len() * QK,
        "quantize_row_q8_1: length mismatch"
    );
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let (d, sum) = quantize_block_q8(x, &mut b.qs);
        b.d = f32_to_f16(d).to_le_bytes();
        b.s = f32_to_f16(d * sum as f32).to_le_bytes();
    }
}

/// Quantizes activations to Q8_K blocks (`x.len()` a multiple of 256).
pub fn quantize_row_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(
        x.len(),
        out.len() * QK_K,
        "quantize_row_q8_k: length mismatch"
    );
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        b.d = quantize_block_q8k(x, &mut b.qs, &mut b.bsums);
    }
}

/// Quantizes a row of weights to Q8_0, Q4_0 or Q4_1 as ggml's reference quantizers do (for
/// tests, benchmarks and synthetic checkpoints; the K formats need ggml's search for scales
/// and are not made here).
///
/// # Panics
/// For other types, or when `x.len()` is not a multiple of 32.
pub fn quantize_row(dtype: DType, x: &[f32]) -> Vec<u8> {
    assert!(
        x.len().is_multiple_of(QK),
        "quantize_row: {} values",
        x.len()
    );
    let nb = x.len() / QK;
    match dtype {
        DType::Q8_0 => {
            let mut out = vec![BlockQ8_0::zeroed(); nb];
            for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
                let amax = max_abs(x);
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                for (q, &v) in b.qs.iter_mut().zip(x) {
                    *q = (v * id).round() as i8;
                }
                b.d = f32_to_f16(d).to_le_bytes();
            }
            bytemuck::cast_slice(&out).to_vec()
        }
        DType::Q4_0 => {
            let mut out = vec![BlockQ4_0::zeroed(); nb];
            for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
                let (mut amax, mut max) = (0f32, 0f32);
                for &v in x {
                    if amax < v.abs() {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                for j in 0..QK / 2 {
                    b.qs[j] = q(x[j]) | (q(x[j + QK / 2]) << 4);
                }
                b.d = f32_to_f16(d).to_le_bytes();
            }
            bytemuck::cast_slice(&out).to_vec()
        }
        DType::Q4_1 => {
            let mut out = vec![BlockQ4_1::zeroed(); nb];
            for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
                let min = x.iter().copied().fold(f32::MAX, f32::min);
                let max = x.iter().copied().fold(-f32::MAX, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
                for j in 0..QK / 2 {
                    b.qs[j] = q(x[j]) | (q(x[j + QK / 2]) << 4);
                }
                b.d = f32_to_f16(d).to_le_bytes();
                b.m = f32_to_f16(min).to_le_bytes();
            }
            bytemuck::cast_slice(&out).to_vec()
        }
        _ => panic!("quantize_row: ember does not quantize to {dtype}"),
    }
}

/// One Q4_K super-block (or Q5_K, whose `qh` adds a fifth bit to every value): 8 sub-blocks
/// of 32 with 6-bit scales and mins, low nibbles of 32 bytes first, then their high nibbles.
fn dequantize_k4(
    d: f32,
    dmin: f32,
    scales: &[u8; 12],
    qs: &[u8],
    qh: Option<&[u8; 32]>,
    y: &mut [f32],
) {
    for c in 0..4 {
        let (sc0, m0) = scale_min_k4(2 * c, scales);
        let (sc1, m1) = scale_min_k4(2 * c + 1, scales);
        let (d0, m0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let ql = &qs[32 * c..32 * c + 32];
        for l in 0..32 {
            let (h0, h1) = match qh {
                Some(qh) => (
                    ((qh[l] >> (2 * c)) & 1) << 4,
                    ((qh[l] >> (2 * c + 1)) & 1) << 4,
                ),
                None => (0, 0),
            };
            y[64 * c + l] = d0 * ((ql[l] & 0xF) | h0) as f32 - m0;
            y[64 * c + 32 + l] = d1 * ((ql[l] >> 4) | h1) as f32 - m1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn word_trick_unpacks_scales_as_get_scale_min_k4() {
        let mut seed = 7u64;
        for _ in 0..200 {
            let q: [u8; 12] = std::array::from_fn(|_| (lcg(&mut seed) * 1000.0) as i32 as u8);
            let (sc, mn) = scales_mins_k4(&q);
            for j in 0..8 {
                assert_eq!((sc[j], mn[j]), scale_min_k4(j, &q));
            }
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (v, want) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.6, 127),
            (-127.0, -127),
            (0.49999997, 0),
        ] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
    }

    /// ggml's `quantize_row_q8_K_ref`, transcribed line by line.
    fn q8k_ggml(x: &[f32]) -> BlockQ8K {
        let mut y = BlockQ8K::zeroed();
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            return y;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for j in 0..16 {
            y.bsums[j] = (0..16).map(|i| y.qs[16 * j + i] as i16).sum();
        }
        y.d = 1.0 / iscale;
        y
    }

    #[test]
    fn q8_k_matches_ggml_reference_including_sign_of_max() {
        let mut seed = 3u64;
        for case in 0..6 {
            let mut x: Vec<f32> = (0..2 * QK_K).map(|_| lcg(&mut seed) * 3.0).collect();
            match case {
                1 => x[..QK_K].fill(0.0),
                2 => x[17] = 9.0,
                3 => x[17] = -9.0,
                4 => {
                    // Ties in magnitude: the first one sets the sign.
                    x[5] = -9.0;
                    x[6] = 9.0;
                }
                5 => x.iter_mut().for_each(|v| *v *= 1e-30),
                _ => {}
            }
            let mut got = vec![BlockQ8K::zeroed(); 2];
            quantize_row_q8_k(&x, &mut got);
            for (b, x) in got.iter().zip(x.chunks_exact(QK_K)) {
                let want = q8k_ggml(x);
                assert_eq!(b.d.to_bits(), want.d.to_bits(), "case {case}");
                assert_eq!(b.qs, want.qs, "case {case}");
                assert_eq!(b.bsums, want.bsums, "case {case}");
            }
            match case {
                2 => assert!(got[0].d < 0.0 && got[0].qs[17] == -127),
                3 => assert!(got[0].d > 0.0 && got[0].qs[17] == -127),
                4 => assert!(got[0].qs[5] == -127 && got[0].qs[6] == 127),
                _ => {}
            }
        }
    }

    #[test]
    fn q8_0_and_q8_1_blocks_round_trip_within_half_a_step() {
        let mut seed = 5u64;
        let x: Vec<f32> = (0..4 * QK).map(|_| lcg(&mut seed) * 2.0).collect();
        let mut b0 = vec![BlockQ8_0::zeroed(); 4];
        let mut b1 = vec![BlockQ8_1::zeroed(); 4];
        quantize_row_q8_0(&x, &mut b0);
        quantize_row_q8_1(&x, &mut b1);
        for i in 0..4 {
            assert_eq!(b0[i].qs, b1[i].qs);
            let d = f16le(b0[i].d);
            let sum: i32 = b1[i].qs.iter().map(|&q| q as i32).sum();
            assert_eq!(
                f16le(b1[i].s),
                half::f16::from_f32(d_raw(&x[i * QK..][..QK]) * sum as f32).to_f32()
            );
            for j in 0..QK {
                assert!((b0[i].qs[j] as f32 * d - x[i * QK + j]).abs() <= d * 0.5 + 1e-3);
            }
            assert_eq!(b0[i].qs.iter().map(|q| q.unsigned_abs()).max(), Some(127));
        }
    }

    fn d_raw(x: &[f32]) -> f32 {
        max_abs(x) / 127.0
    }

    #[test]
    fn weight_quantizers_round_trip() {
        let mut seed = 9u64;
        let x: Vec<f32> = (0..3 * QK).map(|_| lcg(&mut seed)).collect();
        for (dtype, tol) in [
            (DType::Q8_0, 0.005),
            (DType::Q4_0, 0.15),
            (DType::Q4_1, 0.075),
        ] {
            let bytes = quantize_row(dtype, &x);
            assert_eq!(bytes.len(), dtype.row_bytes(x.len()));
            let mut y = vec![0f32; x.len()];
            dequantize_row(dtype, &bytes, &mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b}");
            }
        }
    }
}
