//! Activation rows quantized as llama.cpp quantizes them, stored in the orders the weight
//! kernels unpack their nibbles to, so that a weight vector and an activation vector loaded at
//! the same offset multiply value by value.

use crate::dtype::DType;
use crate::quant::{quantize_block_q8, quantize_block_q8k};

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
    /// The kind for weights of `dtype` interleaved sixteen rows at a time (`super::x16`):
    /// Q8_0's, Q4_0's and Q4_1's kernels there read values in order.
    pub(crate) fn for_interleaved(dtype: DType) -> ActKind {
        match dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => ActKind::Q8,
            _ => ActKind::for_weights(dtype),
        }
    }

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

super::super::simd_dispatch!(pub(crate) fn quantize_activations(job: ActJob) => quantize_activations_generic);

/// Plain Rust; compiled inside each instruction set's entry point so that it vectorises with
/// it. Every step is exact or correctly rounded, so each set gives the same bytes.
#[inline(always)]
unsafe fn quantize_activations_generic<S: super::super::simd::Simd>(job: ActJob) {
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
