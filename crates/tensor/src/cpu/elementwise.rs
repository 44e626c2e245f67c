//! Row-wise kernels: normalisation, rotary embedding, activation, residual adds.
//!
//! Each works on one row at a time with a fixed order of operations, so a row's result does
//! not depend on how many rows are processed together.

use super::simd::Simd;
use super::{Isa, SharedPtr, simd_dispatch};
use crate::pool::ThreadPool;

/// Rows below this many elements in all are not worth waking the other threads for.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 15;

fn for_rows(pool: &ThreadPool, rows: usize, row_len: usize, f: impl Fn(usize) + Sync) {
    if rows * row_len < PARALLEL_MIN_ELEMENTS || rows == 1 {
        (0..rows).for_each(f);
    } else {
        pool.for_each_range(rows, |range| range.for_each(&f));
    }
}

/// `out[r] = x[r] / rms(x[r]) * weight` for each row of `weight.len()` values.
pub fn rms_norm(pool: &ThreadPool, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let rows = x.len() / d;
    assert!(out.len() >= rows * d);
    let out_ptr = SharedPtr(out.as_mut_ptr());
    for_rows(pool, rows, d, |r| {
        let row = &x[r * d..(r + 1) * d];
        // SAFETY: each row index is visited by one thread only.
        let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(r * d), d) };
        norm_row(row, weight, eps, dst);
    });
}

/// [`rms_norm`] over rows of `weight.len()` values, in place (per-head q/k norms).
pub fn rms_norm_in_place(pool: &ThreadPool, x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    let rows = x.len() / d;
    let ptr = SharedPtr(x.as_mut_ptr());
    for_rows(pool, rows, d, |r| {
        // SAFETY: each row index is visited by one thread only.
        let row = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r * d), d) };
        let scale = inv_rms(row, eps);
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *w * (*v * scale);
        }
    });
}

/// `1 / sqrt(mean(x²) + eps)` as llama.cpp's `ggml_compute_forward_rms_norm_f32` computes
/// it: each square rounded to f32, summed in order in f64, the mean rounded to f32. The f64
/// sum makes it at least as exact as any f32 order, and the result is llama.cpp's to the bit.
#[inline]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mut sum = 0f64;
    for v in row {
        sum += (v * v) as f64;
    }
    let mean = (sum / row.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

#[inline]
fn norm_row(row: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let scale = inv_rms(row, eps);
    for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
        *o = *w * (*v * scale);
    }
}

/// Which elements of a head RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Element `i` with `i + head_dim/2` ("rotate half", HF Llama/Qwen, GGUF Qwen).
    Halves,
    /// Element `2i` with `2i + 1` (GGUF Llama, whose q/k rows are stored permuted for it).
    Pairs,
}

/// cos and sin of every (position, frequency), `head_dim/2` values per position.
#[derive(Clone, Copy, Debug)]
pub struct RopeTables<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub layout: RopeLayout,
    /// Rotate as llama.cpp's `rotate_pairs` is compiled (GCC contracts `x0·cos − x1·sin` to
    /// `fma(x0, cos, −(x1·sin))`), rather than with two rounded products as transformers does.
    pub fused: bool,
}

/// Rotary embedding of rows of `n_heads` heads of `head_dim`; row `r` is at position `pos0 + r`.
pub fn rope_in_place(
    pool: &ThreadPool,
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos0: usize,
    tables: RopeTables<'_>,
) {
    let half = head_dim / 2;
    let row_len = n_heads * head_dim;
    let rows = x.len() / row_len;
    assert!(
        (pos0 + rows) * half <= tables.cos.len(),
        "rope: positions beyond the table"
    );
    let ptr = SharedPtr(x.as_mut_ptr());
    let isa = Isa::detect();
    for_rows(pool, rows, row_len, |r| {
        let pos = pos0 + r;
        // SAFETY: each row index is visited by one thread only.
        let row = unsafe { SharedPtr(ptr.get().add(r * row_len)) };
        rope_row(isa, row, row_len, head_dim, pos, tables);
    });
}

// Dispatched so that `mul_add` is one FMA instruction where the set has it.
simd_dispatch!(fn rope_row(row: SharedPtr<f32>, row_len: usize, head_dim: usize, pos: usize, tables: RopeTables<'_>) => rope_row_generic);

#[inline(always)]
unsafe fn rope_row_generic<S: Simd>(
    row: SharedPtr<f32>,
    row_len: usize,
    head_dim: usize,
    pos: usize,
    tables: RopeTables<'_>,
) {
    let half = head_dim / 2;
    let (c, s) = (
        &tables.cos[pos * half..(pos + 1) * half],
        &tables.sin[pos * half..(pos + 1) * half],
    );
    // SAFETY: the caller owns the row.
    let row = unsafe { std::slice::from_raw_parts_mut(row.get(), row_len) };
    for head in row.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (a, b) = match tables.layout {
                RopeLayout::Halves => (i, i + half),
                RopeLayout::Pairs => (2 * i, 2 * i + 1),
            };
            let (x1, x2) = (head[a], head[b]);
            if tables.fused {
                head[a] = x1.mul_add(c[i], -(x2 * s[i]));
                head[b] = x1.mul_add(s[i], x2 * c[i]);
            } else {
                head[a] = x1 * c[i] - x2 * s[i];
                head[b] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`, the SwiGLU activation.
pub fn silu_mul(pool: &ThreadPool, gate: &mut [f32], up: &[f32]) {
    let n = gate.len();
    assert!(up.len() >= n);
    const CHUNK: usize = 4096;
    let isa = Isa::detect();
    let (g, u) = (
        SharedPtr(gate.as_mut_ptr()),
        SharedPtr(up.as_ptr() as *mut f32),
    );
    for_rows(pool, n.div_ceil(CHUNK), CHUNK, |c| {
        let start = c * CHUNK;
        // SAFETY: each chunk is visited by one thread only.
        let (g, u) = unsafe { (SharedPtr(g.get().add(start)), SharedPtr(u.get().add(start))) };
        silu_mul_chunk(isa, g, u, CHUNK.min(n - start));
    });
}

simd_dispatch!(fn silu_mul_chunk(gate: SharedPtr<f32>, up: SharedPtr<f32>, n: usize) => silu_mul_generic);

#[inline(always)]
unsafe fn silu_mul_generic<S: Simd>(gate: SharedPtr<f32>, up: SharedPtr<f32>, n: usize) {
    let (g, u) = (gate.get(), up.get() as *const f32);
    let one = unsafe { S::splat(1.0) };
    let mut i = 0;
    while i < n {
        let len = S::LANES.min(n - i);
        unsafe {
            let x = S::load_partial(g.add(i), len);
            // silu(x) = x / (1 + e^-x)
            let e = S::exp(S::mul(x, S::splat(-1.0)));
            let silu = S::div(x, S::add(one, e));
            S::store_partial(g.add(i), S::mul(silu, S::load_partial(u.add(i), len)), len);
        }
        i += len;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to each row of `bias.len()` values.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// Softmax of one row, in place (max-subtracted).
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let pool = ThreadPool::new(2);
        let x = [1.0f32, -2.0, 3.0, 0.5, 4.0, 4.0, 4.0, 4.0];
        let w = [1.0f32, 2.0, 0.5, 1.0];
        let mut out = [0f32; 8];
        rms_norm(&pool, &x, &w, 1e-6, &mut out);
        let rms = ((1.0 + 4.0 + 9.0 + 0.25) / 4.0f32 + 1e-6).sqrt();
        assert!((out[1] - (-2.0 / rms * 2.0)).abs() < 1e-6);
        assert!((out[4] - 1.0).abs() < 1e-5);
        let mut y = x;
        rms_norm_in_place(&pool, &mut y, &w, 1e-6);
        assert_eq!(y, out);
    }

    #[test]
    fn rope_rotates_pairs_half_apart() {
        let pool = ThreadPool::new(1);
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        let (c, s) = ([0.0f32, 1.0, 0.5, 0.5], [1.0f32, 0.0, 0.5, 0.5]);
        let tables = RopeTables {
            cos: &c,
            sin: &s,
            layout: RopeLayout::Halves,
            fused: false,
        };
        rope_in_place(&pool, &mut x, 1, 4, 0, tables);
        assert_eq!(x, [1.0 * 0.0 - 3.0 * 1.0, 2.0, 3.0 * 0.0 + 1.0, 4.0]);
        let mut y = [1.0f32, 2.0, 3.0, 4.0];
        rope_in_place(
            &pool,
            &mut y,
            1,
            4,
            0,
            RopeTables {
                layout: RopeLayout::Pairs,
                ..tables
            },
        );
        assert_eq!(y, [1.0 * 0.0 - 2.0 * 1.0, 2.0 * 0.0 + 1.0, 3.0, 4.0]);
    }

    #[test]
    fn silu_and_softmax() {
        let pool = ThreadPool::new(2);
        let mut g = vec![0.0f32, 1.0, -1.0];
        silu_mul(&pool, &mut g, &[2.0, 2.0, 2.0]);
        assert!((g[1] - 2.0 * 0.731_058_6).abs() < 1e-6 && g[0] == 0.0);
        let mut p = vec![1.0f32, 2.0, 3.0];
        softmax_in_place(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6 && p[2] > p[1]);
    }
}
