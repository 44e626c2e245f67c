//! Causal attention of new queries over a sequence's cached keys and values.
//!
//! One (query, head) pair is one unit of work: scores against every visible key, a softmax,
//! a weighted sum of values, always in key order. Prefill and decode run the same unit, so a
//! token's output is the same whichever way it was computed.

use super::simd::Simd;
use super::{Isa, SharedPtr, simd_dispatch};
use crate::pool::{ThreadPool, split_range};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// f32 elements of scratch [`causal_attention`] needs for `context` positions.
pub fn attention_scratch_len(n_threads: usize, context: usize) -> usize {
    n_threads * context
}

/// `out[i, h] = softmax(q[i, h] · K[..=pos0+i]ᵀ · scale) · V[..=pos0+i]`.
///
/// `q` and `out` are `[n, n_heads·head_dim]`; `keys` and `values` are one layer's cache,
/// `[positions, n_kv_heads·head_dim]`, holding at least `pos0 + n` positions. Query head `h`
/// reads kv head `h / (n_heads / n_kv_heads)` (grouped-query attention).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    pool: &ThreadPool,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    pos0: usize,
    n: usize,
    shape: AttentionShape,
    scale: f32,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let AttentionShape { n_heads, n_kv_heads, head_dim } = shape;
    assert!(n_heads % n_kv_heads == 0, "attention: {n_heads} heads over {n_kv_heads} kv heads");
    let kv_row = n_kv_heads * head_dim;
    let context = pos0 + n;
    assert!(keys.len() >= context * kv_row && values.len() >= context * kv_row, "attention: cache too short");
    assert!(q.len() >= n * n_heads * head_dim && out.len() >= n * n_heads * head_dim);
    let per_thread = scratch.len() / pool.n_threads();
    assert!(per_thread >= context, "attention: scratch too small");
    let items = n * n_heads;
    let parts = pool.n_threads().min(items);
    let job = Job {
        q: SharedPtr(q.as_ptr() as *mut f32),
        keys: SharedPtr(keys.as_ptr() as *mut f32),
        values: SharedPtr(values.as_ptr() as *mut f32),
        out: SharedPtr(out.as_mut_ptr()),
        scratch: SharedPtr(scratch.as_mut_ptr()),
        per_thread,
        pos0,
        shape,
        scale,
        items,
        parts,
        thread: 0,
    };
    let isa = Isa::detect();
    pool.broadcast(&|thread| {
        if thread < parts {
            attend(isa, Job { thread, ..job });
        }
    });
}

#[derive(Clone, Copy)]
struct Job {
    q: SharedPtr<f32>,
    keys: SharedPtr<f32>,
    values: SharedPtr<f32>,
    out: SharedPtr<f32>,
    scratch: SharedPtr<f32>,
    per_thread: usize,
    pos0: usize,
    shape: AttentionShape,
    scale: f32,
    items: usize,
    parts: usize,
    thread: usize,
}

simd_dispatch!(fn attend(job: Job) => attend_items);

#[inline(always)]
unsafe fn attend_items<S: Simd>(job: Job) {
    let AttentionShape { n_heads, n_kv_heads, head_dim: d } = job.shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * d;
    let scores = unsafe { job.scratch.get().add(job.thread * job.per_thread) };
    for item in split_range(job.items, job.parts, job.thread) {
        let (i, h) = (item / n_heads, item % n_heads);
        let visible = job.pos0 + i + 1;
        let kv_offset = (h / group) * d;
        unsafe {
            let q = job.q.get().add((i * n_heads + h) * d);
            let mut max = f32::NEG_INFINITY;
            for t in 0..visible {
                let s = dot::<S>(q, job.keys.get().add(t * kv_row + kv_offset), d) * job.scale;
                *scores.add(t) = s;
                max = max.max(s);
            }
            let mut sum = 0f32;
            for t in 0..visible {
                let e = (*scores.add(t) - max).exp();
                *scores.add(t) = e;
                sum += e;
            }
            let out = job.out.get().add((i * n_heads + h) * d);
            std::ptr::write_bytes(out, 0, d);
            let inv = 1.0 / sum;
            for t in 0..visible {
                axpy::<S>(*scores.add(t) * inv, job.values.get().add(t * kv_row + kv_offset), out, d);
            }
        }
    }
}

#[inline(always)]
unsafe fn dot<S: Simd>(a: *const f32, b: *const f32, d: usize) -> f32 {
    unsafe {
        let mut acc = S::zero();
        let full = d / S::LANES * S::LANES;
        let mut p = 0;
        while p < full {
            acc = S::fma(S::load(a.add(p)), S::load(b.add(p)), acc);
            p += S::LANES;
        }
        if p < d {
            acc = S::fma(S::load_partial(a.add(p), d - p), S::load_partial(b.add(p), d - p), acc);
        }
        S::hsum(acc)
    }
}

/// `out += alpha · v`.
#[inline(always)]
unsafe fn axpy<S: Simd>(alpha: f32, v: *const f32, out: *mut f32, d: usize) {
    unsafe {
        let a = S::splat(alpha);
        let full = d / S::LANES * S::LANES;
        let mut p = 0;
        while p < full {
            S::store(out.add(p), S::fma(a, S::load(v.add(p)), S::load(out.add(p))));
            p += S::LANES;
        }
        if p < d {
            let rest = d - p;
            S::store_partial(out.add(p), S::fma(a, S::load_partial(v.add(p), rest), S::load_partial(out.add(p), rest)), rest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_attention_and_decode_equals_prefill() {
        let shape = AttentionShape { n_heads: 6, n_kv_heads: 2, head_dim: 20 };
        let (n, kv_row, q_row) = (7usize, 40usize, 120usize);
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let q: Vec<f32> = (0..n * q_row).map(|_| next()).collect();
        let k: Vec<f32> = (0..n * kv_row).map(|_| next()).collect();
        let v: Vec<f32> = (0..n * kv_row).map(|_| next()).collect();
        let pool = ThreadPool::new(2);
        let mut scratch = vec![0f32; attention_scratch_len(2, n)];
        let mut out = vec![0f32; n * q_row];
        causal_attention(&pool, &q, &k, &v, 0, n, shape, 0.3, &mut out, &mut scratch);
        for i in 0..n {
            for h in 0..6 {
                let kvh = h / 3;
                let s: Vec<f64> = (0..=i)
                    .map(|t| (0..20).map(|e| q[i * q_row + h * 20 + e] as f64 * k[t * kv_row + kvh * 20 + e] as f64).sum::<f64>() * 0.3)
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for e in 0..20 {
                    let want: f64 = (0..=i).map(|t| (s[t] - m).exp() / z * v[t * kv_row + kvh * 20 + e] as f64).sum();
                    assert!((out[i * q_row + h * 20 + e] as f64 - want).abs() < 1e-5);
                }
            }
        }
        // The last query computed alone (decode) is bit-identical to its row in the prefill.
        let mut last = vec![0f32; q_row];
        causal_attention(&pool, &q[(n - 1) * q_row..], &k, &v, n - 1, 1, shape, 0.3, &mut last, &mut scratch);
        assert_eq!(last, &out[(n - 1) * q_row..]);
    }
}
