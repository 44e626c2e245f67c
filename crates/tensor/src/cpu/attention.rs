//! Causal attention of new queries over a sequence's cached keys and values.
//!
//! One (query, head) pair is one unit of work: scores against every visible key, a softmax,
//! a weighted sum of values, always in key order. Prefill and decode run the same unit, so a
//! token's output is the same whichever way it was computed.

use super::simd::{F16, Simd, WeightElem};
use super::{Isa, SharedPtr, simd_dispatch};
use crate::pool::ThreadPool;

/// One layer's cached keys or values, `[positions, n_kv_heads·head_dim]`, in f32 or as f16
/// bits (half the memory and bandwidth; what llama.cpp keeps by default).
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

impl KvSlice<'_> {
    fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
        }
    }

    fn ptr(&self) -> *mut u8 {
        match self {
            KvSlice::F32(s) => s.as_ptr() as *mut u8,
            KvSlice::F16(s) => s.as_ptr() as *mut u8,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// The widest head the kernel takes (queries are copied to the stack to round them).
const MAX_HEAD_DIM: usize = 512;

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
    keys: KvSlice<'_>,
    values: KvSlice<'_>,
    pos0: usize,
    n: usize,
    shape: AttentionShape,
    scale: f32,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    assert!(
        n_heads % n_kv_heads == 0,
        "attention: {n_heads} heads over {n_kv_heads} kv heads"
    );
    assert!(
        head_dim <= MAX_HEAD_DIM,
        "attention: head_dim {head_dim} > {MAX_HEAD_DIM}"
    );
    let kv_row = n_kv_heads * head_dim;
    let context = pos0 + n;
    assert!(
        keys.len() >= context * kv_row && values.len() >= context * kv_row,
        "attention: cache too short"
    );
    assert!(q.len() >= n * n_heads * head_dim && out.len() >= n * n_heads * head_dim);
    let per_thread = scratch.len() / pool.n_threads();
    assert!(per_thread >= context, "attention: scratch too small");
    let items = n * n_heads;
    let parts = pool.n_threads().min(items);
    let job = Job {
        q: SharedPtr(q.as_ptr() as *mut f32),
        keys: SharedPtr(keys.ptr()),
        values: SharedPtr(values.ptr()),
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
            match keys {
                KvSlice::F32(_) => attend_f32(isa, Job { thread, ..job }),
                KvSlice::F16(_) => attend_f16(isa, Job { thread, ..job }),
            }
        }
    });
}

#[derive(Clone, Copy)]
struct Job {
    q: SharedPtr<f32>,
    keys: SharedPtr<u8>,
    values: SharedPtr<u8>,
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

simd_dispatch!(fn attend_f32(job: Job) => attend_items_f32);
simd_dispatch!(fn attend_f16(job: Job) => attend_items_f16);

#[inline(always)]
unsafe fn attend_items_f32<S: Simd>(job: Job) {
    unsafe { attend_items::<S, f32>(job) }
}

#[inline(always)]
unsafe fn attend_items_f16<S: Simd>(job: Job) {
    unsafe { attend_items::<S, F16>(job) }
}

#[inline(always)]
unsafe fn attend_items<S: Simd, E: WeightElem>(job: Job) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim: d,
    } = job.shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * d;
    let scores = unsafe { job.scratch.get().add(job.thread * job.per_thread) };
    // Items go head by head, so one head's keys and values stay in cache across its queries;
    // they are dealt out in turn, since a later query sees more keys and contiguous shares of
    // a prompt would leave the first thread idle while the last works.
    let n = job.items / n_heads;
    for item in (job.thread..job.items).step_by(job.parts) {
        let (h, i) = (item / n, item % n);
        let visible = job.pos0 + i + 1;
        let kv_offset = (h / group) * d;
        unsafe {
            // An f16 cache multiplies f16 queries and f16 weights, as llama.cpp's attention
            // does: ember then computes what that reference computes, not something close.
            let mut q_rounded = [0f32; MAX_HEAD_DIM];
            let mut q = job.q.get().add((i * n_heads + h) * d) as *const f32;
            if E::round_operand(1.0 + f32::EPSILON) != 1.0 + f32::EPSILON {
                for (e, r) in q_rounded.iter_mut().enumerate().take(d) {
                    *r = E::round_operand(*q.add(e));
                }
                q = q_rounded.as_ptr();
            }
            let key = |t: usize| (job.keys.get() as *const E).add(t * kv_row + kv_offset);
            let mut t = 0;
            while t + 4 <= visible {
                let s = dot4::<S, E>(q, [key(t), key(t + 1), key(t + 2), key(t + 3)], d);
                for (j, value) in s.into_iter().enumerate() {
                    *scores.add(t + j) = value * job.scale;
                }
                t += 4;
            }
            while t < visible {
                *scores.add(t) = dot4::<S, E>(q, [key(t); 4], d)[0] * job.scale;
                t += 1;
            }
            softmax::<S>(scores, visible);
            for t in 0..visible {
                *scores.add(t) = E::round_operand(*scores.add(t));
            }
            let value = |t: usize| (job.values.get() as *const E).add(t * kv_row + kv_offset);
            weighted_sum::<S, E>(
                scores,
                visible,
                value,
                job.out.get().add((i * n_heads + h) * d),
                d,
            );
        }
    }
}

/// Dot products of `q` with four keys; each is the same lane-wise FMA chain and sum tree as
/// every other dot product in the kernels, so one key alone gives the same bits.
#[inline(always)]
unsafe fn dot4<S: Simd, E: WeightElem>(q: *const f32, k: [*const E; 4], d: usize) -> [f32; 4] {
    unsafe {
        let mut acc = [S::zero(); 4];
        let full = d / S::LANES * S::LANES;
        let mut p = 0;
        while p < full {
            let qv = S::load(q.add(p));
            for j in 0..4 {
                acc[j] = S::fma(qv, E::load::<S>(k[j].add(p)), acc[j]);
            }
            p += S::LANES;
        }
        if p < d {
            let qv = S::load_partial(q.add(p), d - p);
            for j in 0..4 {
                acc[j] = S::fma(qv, E::load_partial::<S>(k[j].add(p), d - p), acc[j]);
            }
        }
        [
            S::hsum(acc[0]),
            S::hsum(acc[1]),
            S::hsum(acc[2]),
            S::hsum(acc[3]),
        ]
    }
}

/// `x = softmax(x)` over `n` scores, exponentials vectorised.
#[inline(always)]
unsafe fn softmax<S: Simd>(x: *mut f32, n: usize) {
    unsafe {
        let mut max = f32::NEG_INFINITY;
        for t in 0..n {
            max = max.max(*x.add(t));
        }
        let neg_max = S::splat(-max);
        let mut sum = 0f32;
        let mut t = 0;
        while t < n {
            let len = S::LANES.min(n - t);
            let e = S::exp(S::add(S::load_partial(x.add(t), len), neg_max));
            S::store_partial(x.add(t), e, len);
            for j in 0..len {
                sum += *x.add(t + j);
            }
            t += len;
        }
        let inv = 1.0 / sum;
        for t in 0..n {
            *x.add(t) *= inv;
        }
    }
}

/// `out = Σ_t w[t] · v(t)`, summed in key order with the accumulators kept in registers.
#[inline(always)]
unsafe fn weighted_sum<S: Simd, E: WeightElem>(
    w: *const f32,
    n: usize,
    v: impl Fn(usize) -> *const E,
    out: *mut f32,
    d: usize,
) {
    const BLOCK: usize = 8;
    unsafe {
        let mut base = 0;
        while base + BLOCK * S::LANES <= d {
            let mut acc = [S::zero(); BLOCK];
            for t in 0..n {
                let wt = S::splat(*w.add(t));
                let row = v(t).add(base);
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = S::fma(wt, E::load::<S>(row.add(j * S::LANES)), *a);
                }
            }
            for (j, a) in acc.iter().enumerate() {
                S::store(out.add(base + j * S::LANES), *a);
            }
            base += BLOCK * S::LANES;
        }
        while base < d {
            let len = S::LANES.min(d - base);
            let mut acc = S::zero();
            for t in 0..n {
                acc = S::fma(
                    S::splat(*w.add(t)),
                    E::load_partial::<S>(v(t).add(base), len),
                    acc,
                );
            }
            S::store_partial(out.add(base), acc, len);
            base += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_attention_and_decode_equals_prefill() {
        let shape = AttentionShape {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 20,
        };
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
        causal_attention(
            &pool,
            &q,
            KvSlice::F32(&k),
            KvSlice::F32(&v),
            0,
            n,
            shape,
            0.3,
            &mut out,
            &mut scratch,
        );
        for i in 0..n {
            for h in 0..6 {
                let kvh = h / 3;
                let s: Vec<f64> = (0..=i)
                    .map(|t| {
                        (0..20)
                            .map(|e| {
                                q[i * q_row + h * 20 + e] as f64
                                    * k[t * kv_row + kvh * 20 + e] as f64
                            })
                            .sum::<f64>()
                            * 0.3
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for e in 0..20 {
                    let want: f64 = (0..=i)
                        .map(|t| (s[t] - m).exp() / z * v[t * kv_row + kvh * 20 + e] as f64)
                        .sum();
                    assert!((out[i * q_row + h * 20 + e] as f64 - want).abs() < 1e-5);
                }
            }
        }
        // The last query computed alone (decode) is bit-identical to its row in the prefill.
        let mut last = vec![0f32; q_row];
        causal_attention(
            &pool,
            &q[(n - 1) * q_row..],
            KvSlice::F32(&k),
            KvSlice::F32(&v),
            n - 1,
            1,
            shape,
            0.3,
            &mut last,
            &mut scratch,
        );
        assert_eq!(last, &out[(n - 1) * q_row..]);

        // An f16 cache computes over f16 keys and values, with queries and weights rounded to
        // f16 as llama.cpp does: close to the f32 result, and the same for decode and prefill.
        let to_f16 = |x: &[f32]| {
            x.iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect::<Vec<u16>>()
        };
        let (k16, v16) = (to_f16(&k), to_f16(&v));
        let mut out16 = vec![0f32; n * q_row];
        causal_attention(
            &pool,
            &q,
            KvSlice::F16(&k16),
            KvSlice::F16(&v16),
            0,
            n,
            shape,
            0.3,
            &mut out16,
            &mut scratch,
        );
        for (a, b) in out16.iter().zip(&out) {
            assert!((a - b).abs() < 2e-3, "f16 attention {a} vs f32 {b}");
        }
        let mut last16 = vec![0f32; q_row];
        causal_attention(
            &pool,
            &q[(n - 1) * q_row..],
            KvSlice::F16(&k16),
            KvSlice::F16(&v16),
            n - 1,
            1,
            shape,
            0.3,
            &mut last16,
            &mut scratch,
        );
        assert_eq!(last16, &out16[(n - 1) * q_row..]);
    }
}
