//! Causal attention of new queries over a sequence's cached keys and values.
//!
//! One (query, head) pair is one unit of work: scores against every visible key, a softmax,
//! a weighted sum of values. Over an f32 or bf16 cache the sums run in key order and prefill
//! and decode run the same unit, so a token's output is the same whichever way it was computed
//! (bf16 is widened on load: the same sums as an f32 cache holding the same values).
//! Over an f16 cache the unit is llama.cpp's for a lone query (see `attend_items_f16`), and
//! every query takes it, alone or in a batch.

use super::simd::{Bf16, F16, Simd, WeightElem};
use super::{Isa, SharedPtr, simd_dispatch};
use crate::pool::ThreadPool;

/// One layer's cached keys or values, `[positions, n_kv_heads·head_dim]`, in f32 or as f16
/// or bf16 bits (half the memory and bandwidth; f16 is what llama.cpp keeps by default, bf16
/// what transformers and vLLM keep for bf16 checkpoints).
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

impl KvSlice<'_> {
    fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) | KvSlice::Bf16(s) => s.len(),
        }
    }

    fn ptr(&self) -> *mut u8 {
        match self {
            KvSlice::F32(s) => s.as_ptr() as *mut u8,
            KvSlice::F16(s) | KvSlice::Bf16(s) => s.as_ptr() as *mut u8,
        }
    }
}

/// One layer's keys and values of a sequence, in a pool of blocks of `block_size` positions:
/// position `t` is row `t % block_size` of block `table[t / block_size]`, and block `b`'s
/// rows start `b · block_stride` elements into `keys` and `values`. A paged cache lets
/// sequences share their common prefix's blocks and lets blocks move between sequences and
/// a prompt cache without copying.
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub keys: KvSlice<'a>,
    pub values: KvSlice<'a>,
    /// The sequence's blocks, in position order.
    pub table: &'a [u32],
    /// Positions a block holds: a power of two.
    pub block_size: usize,
    /// Elements from one block's first row to the next block's.
    pub block_stride: usize,
}

impl<'a> PagedKv<'a> {
    /// An unpaged cache, `[positions, kv_row]` in one run: a single block holding them all.
    pub fn contiguous(keys: KvSlice<'a>, values: KvSlice<'a>, kv_row: usize) -> Self {
        let positions = keys.len() / kv_row.max(1);
        PagedKv {
            keys,
            values,
            table: &[0],
            block_size: positions.max(1).next_power_of_two(),
            block_stride: 0,
        }
    }

    /// Checks that every position below `context` lies inside both slices.
    fn check(&self, context: usize, kv_row: usize) {
        assert!(
            self.block_size.is_power_of_two(),
            "attention: block size {} is not a power of two",
            self.block_size
        );
        let blocks = context.div_ceil(self.block_size);
        assert!(
            self.table.len() >= blocks,
            "attention: {} blocks in the table for {context} positions",
            self.table.len()
        );
        for (i, &block) in self.table[..blocks].iter().enumerate() {
            let rows = self.block_size.min(context - i * self.block_size);
            let end = block as usize * self.block_stride + rows * kv_row;
            assert!(
                end <= self.keys.len() && end <= self.values.len(),
                "attention: block {block} lies past the cache"
            );
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
/// `q` and `out` are `[n, n_heads·head_dim]`; `kv` is one layer's cache, rows of
/// `n_kv_heads·head_dim`, holding at least `pos0 + n` positions. Query head `h` reads kv head
/// `h / (n_heads / n_kv_heads)` (grouped-query attention).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    pool: &ThreadPool,
    q: &[f32],
    kv: PagedKv<'_>,
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
    kv.check(context, kv_row);
    assert!(q.len() >= n * n_heads * head_dim && out.len() >= n * n_heads * head_dim);
    let per_thread = scratch.len() / pool.n_threads();
    assert!(per_thread >= context, "attention: scratch too small");
    let items = n * n_heads;
    let parts = pool.n_threads().min(items);
    let job = Job {
        q: SharedPtr(q.as_ptr() as *mut f32),
        keys: SharedPtr(kv.keys.ptr()),
        values: SharedPtr(kv.values.ptr()),
        table: SharedPtr(kv.table.as_ptr() as *mut u32),
        block_shift: kv.block_size.trailing_zeros(),
        block_stride: kv.block_stride,
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
            match kv.keys {
                KvSlice::F32(_) => attend_f32(isa, Job { thread, ..job }),
                KvSlice::F16(_) => attend_f16(isa, Job { thread, ..job }),
                KvSlice::Bf16(_) => attend_bf16(isa, Job { thread, ..job }),
            }
        }
    });
}

#[derive(Clone, Copy)]
struct Job {
    q: SharedPtr<f32>,
    keys: SharedPtr<u8>,
    values: SharedPtr<u8>,
    table: SharedPtr<u32>,
    block_shift: u32,
    block_stride: usize,
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

impl Job {
    /// Elements from the start of the cache slices to position `t`'s row.
    ///
    /// # Safety
    /// `t` is below the context [`PagedKv::check`] was given.
    #[inline(always)]
    unsafe fn row(&self, t: usize, kv_row: usize) -> usize {
        let block = unsafe { *self.table.get().add(t >> self.block_shift) } as usize;
        let within = t & ((1 << self.block_shift) - 1);
        block * self.block_stride + within * kv_row
    }
}

simd_dispatch!(fn attend_f32(job: Job) => attend_items_f32);
simd_dispatch!(fn attend_bf16(job: Job) => attend_items_bf16);
simd_dispatch!(fn attend_f16(job: Job) => attend_items_f16);

#[inline(always)]
unsafe fn attend_items_f32<S: Simd>(job: Job) {
    unsafe { attend_items::<S, f32>(job) }
}
#[inline(always)]
unsafe fn attend_items_bf16<S: Simd>(job: Job) {
    unsafe { attend_items::<S, Bf16>(job) }
}

/// Attention over an f32 or bf16 cache: scores by [`dot4`], softmax, weighted sum in key
/// order.
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
            let q = job.q.get().add((i * n_heads + h) * d) as *const f32;
            let key = |t: usize| (job.keys.get() as *const E).add(job.row(t, kv_row) + kv_offset);
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
            let value =
                |t: usize| (job.values.get() as *const E).add(job.row(t, kv_row) + kv_offset);
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

/// Attention over an f16 cache computes what llama.cpp's CPU backend computes for one token
/// (a decode step) with its default f16 cache and without flash attention, to the bit:
/// `kq = mul_mat(k, q)` with `q` rounded to f16, `soft_max_ext`, then `kqv = mul_mat(v, kq)`
/// with the weights rounded to f16, each dot product as `ggml_vec_dot_f16` sums it (64 lanes,
/// leftovers in f64). llama.cpp takes llamafile's `tinyBLAS` instead when a batch has two
/// tokens or more (16 lanes); here every query takes the one-token order, so a query's result
/// is the same alone or anywhere in a batch (a prompt resumed from a cache, a reply computed
/// token by token, give the bits of the same tokens computed at once). The one-token order,
/// because most tokens are decoded one at a time, where it is llama.cpp's; a prompt's last bits
/// differ from llama.cpp's batched ones.
#[inline(always)]
unsafe fn attend_items_f16<S: Simd>(job: Job) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim: d,
    } = job.shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * d;
    let scores = unsafe { job.scratch.get().add(job.thread * job.per_thread) };
    let n = job.items / n_heads;
    // `ggml_vec_dot_f16`'s partial sums, for the scores and the weighted sum alike.
    const LANES: usize = 64;
    let mut acc = vec![0f32; LANES / 4 * d];
    for item in (job.thread..job.items).step_by(job.parts) {
        let (h, i) = (item / n, item % n);
        let visible = job.pos0 + i + 1;
        let kv_offset = (h / group) * d;
        unsafe {
            let mut q16 = [0f32; MAX_HEAD_DIM];
            let q = job.q.get().add((i * n_heads + h) * d) as *const f32;
            std::ptr::copy_nonoverlapping(q, q16.as_mut_ptr(), d);
            round_f16_in_place::<S>(q16.as_mut_ptr(), d);
            let key = |t: usize| (job.keys.get() as *const F16).add(job.row(t, kv_row) + kv_offset);
            let mut t = 0;
            while t < visible {
                let k = std::array::from_fn(|j| key((t + j).min(visible - 1)));
                // 64 lanes as 4 or 8 vectors (every set's `S::LANES` is 16 or 8).
                let dots = if LANES / S::LANES == 4 {
                    dot4_lanes::<S, 4>(q16.as_ptr(), k, d)
                } else {
                    dot4_lanes::<S, 8>(q16.as_ptr(), k, d)
                };
                for (j, dot) in dots.into_iter().enumerate().take(visible - t) {
                    *scores.add(t + j) = dot * job.scale;
                }
                t += 4;
            }
            softmax::<S>(scores, visible);
            round_f16_in_place::<S>(scores, visible);
            let value =
                |t: usize| (job.values.get() as *const F16).add(job.row(t, kv_row) + kv_offset);
            weighted_sum_lanes::<S>(
                scores,
                visible,
                value,
                job.out.get().add((i * n_heads + h) * d),
                d,
                LANES,
                &mut acc,
            );
        }
    }
}

/// `x[..n]` rounded to f16 values, as llama.cpp rounds an f32 operand of an f16 product.
#[inline(always)]
unsafe fn round_f16_in_place<S: Simd>(x: *mut f32, n: usize) {
    unsafe {
        let mut t = 0;
        while t < n {
            let len = S::LANES.min(n - t);
            S::store_partial(x.add(t), S::round_f16(S::load_partial(x.add(t), len)), len);
            t += len;
        }
    }
}

/// `Σ_e q[e]·k[e]` for four keys, each with `NV·S::LANES` f32 accumulators (lane `l` takes
/// `e ≡ l mod lanes`, one FMA each in order), folded by halves (lane `l` with `l + lanes/2`,
/// …) as ggml's reductions and `_mm512_reduce_add_ps` fold; the `d % lanes` leftovers are
/// added in f64 after, as `ggml_vec_dot_f16` adds them.
#[inline(always)]
unsafe fn dot4_lanes<S: Simd, const NV: usize>(
    q: *const f32,
    k: [*const F16; 4],
    d: usize,
) -> [f32; 4] {
    unsafe {
        let lanes = NV * S::LANES;
        let mut acc = [[S::zero(); NV]; 4];
        let full = d / lanes * lanes;
        let mut p = 0;
        while p < full {
            for j in 0..NV {
                let e = p + j * S::LANES;
                let qv = S::load(q.add(e));
                for (a, kk) in acc.iter_mut().zip(k) {
                    a[j] = S::fma(qv, F16::load::<S>(kk.add(e)), a[j]);
                }
            }
            p += lanes;
        }
        // Written out, not closures: a closure may not be inlined into the caller's instruction
        // set; and folded before the leftovers' loop, so that the sums never leave registers.
        let mut out = [
            S::hsum(fold_halves::<S, NV>(&acc[0])),
            S::hsum(fold_halves::<S, NV>(&acc[1])),
            S::hsum(fold_halves::<S, NV>(&acc[2])),
            S::hsum(fold_halves::<S, NV>(&acc[3])),
        ];
        if full < d {
            for (o, kk) in out.iter_mut().zip(k) {
                let mut sum = *o as f64;
                for e in full..d {
                    sum += (*q.add(e) * (*kk.add(e)).to_f32()) as f64;
                }
                *o = sum as f32;
            }
        }
        out
    }
}

/// `a[0] + a[NV/2]`, …: the vectors folded by halves, written out so that they stay in
/// registers.
#[inline(always)]
unsafe fn fold_halves<S: Simd, const NV: usize>(a: &[S::V; NV]) -> S::V {
    unsafe {
        match NV {
            1 => a[0],
            2 => S::add(a[0], a[1]),
            4 => S::add(S::add(a[0], a[2]), S::add(a[1], a[3])),
            8 => {
                let b = [
                    S::add(a[0], a[4]),
                    S::add(a[1], a[5]),
                    S::add(a[2], a[6]),
                    S::add(a[3], a[7]),
                ];
                S::add(S::add(b[0], b[2]), S::add(b[1], b[3]))
            }
            _ => unreachable!("fold_halves: {NV} vectors"),
        }
    }
}

/// `out = Σ_t w[t] · v(t)` with `lanes` partial sums per output element (sum `l` takes the keys
/// `t ≡ l mod lanes`, one FMA each in key order), folded by halves: the order of llama.cpp's
/// `mul_mat(v, kq)` over its transposed f16 value cache. The sums of each group
/// `{j, j + lanes/4, j + lanes/2, j + 3·lanes/4}` stay in registers while their keys stream
/// past and take the fold's first two halvings there; `partial` (`lanes/4 · d` values) holds
/// the groups' results for the rest of the fold.
#[inline(always)]
unsafe fn weighted_sum_lanes<S: Simd>(
    w: *const f32,
    n: usize,
    v: impl Fn(usize) -> *const F16,
    out: *mut f32,
    d: usize,
    lanes: usize,
    partial: &mut [f32],
) {
    const NV: usize = 4;
    unsafe {
        let used = lanes.min(n);
        let quarter = lanes / 4;
        let part = partial.as_mut_ptr();
        let mut e0 = 0;
        while e0 < d {
            let width = (NV * S::LANES).min(d - e0);
            let len = |c: usize| S::LANES.min(width.saturating_sub(c * S::LANES));
            for j in 0..quarter.min(used) {
                // Sum `j + m·quarter` in `acc[m]`.
                let mut acc = [[S::zero(); NV]; 4];
                let mut t0 = 0;
                while t0 < n {
                    for (m, a) in acc.iter_mut().enumerate() {
                        let t = t0 + j + m * quarter;
                        if t >= n {
                            break;
                        }
                        let wt = S::splat(*w.add(t));
                        let row = v(t).add(e0);
                        for (c, ac) in a.iter_mut().enumerate() {
                            let l = len(c);
                            if l == S::LANES {
                                *ac = S::fma(wt, F16::load::<S>(row.add(c * S::LANES)), *ac);
                            } else if l > 0 {
                                let x = F16::load_partial::<S>(row.add(c * S::LANES), l);
                                *ac = S::fma(wt, x, *ac);
                            }
                        }
                    }
                    t0 += lanes;
                }
                // The halvings by `lanes/2` and `lanes/4`, adding only the sums that hold
                // keys (past the last key llama.cpp's padded cache gives zeros, which change
                // nothing).
                let has = |m: usize| j + m * quarter < used;
                let [a0, a1, a2, a3] = acc;
                for c in 0..NV {
                    let mut lo = a0[c];
                    if has(2) {
                        lo = S::add(lo, a2[c]);
                    }
                    if has(1) {
                        let mut hi = a1[c];
                        if has(3) {
                            hi = S::add(hi, a3[c]);
                        }
                        lo = S::add(lo, hi);
                    }
                    let l = len(c);
                    if l > 0 {
                        S::store_partial(part.add(j * d + e0 + c * S::LANES), lo, l);
                    }
                }
            }
            e0 += width;
        }
        // The rest of the fold, from `lanes/8` on.
        let mut half = quarter / 2;
        while half > 0 {
            for j in 0..half.min(used) {
                if j + half < used {
                    let (dst, src) = (part.add(j * d), part.add((j + half) * d) as *const f32);
                    let mut e = 0;
                    while e + S::LANES <= d {
                        S::store(dst.add(e), S::add(S::load(dst.add(e)), S::load(src.add(e))));
                        e += S::LANES;
                    }
                    while e < d {
                        *dst.add(e) += *src.add(e);
                        e += 1;
                    }
                }
            }
            half /= 2;
        }
        std::ptr::copy_nonoverlapping(part as *const f32, out, d);
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

/// `x = softmax(x)` over `n` scores as llama.cpp's `ggml_vec_soft_max_f32` computes it with
/// AVX-512: exponentials of `x − max` ([`Simd::exp`]), summed 16 at a time by halves
/// (`_mm512_reduce_add_ps`) into an f64 total, then scaled by `(f32)(1 / total)`.
#[inline(always)]
unsafe fn softmax<S: Simd>(x: *mut f32, n: usize) {
    unsafe {
        let mut max = f32::NEG_INFINITY;
        for t in 0..n {
            max = max.max(*x.add(t));
        }
        let neg_max = S::splat(-max);
        let mut t = 0;
        while t < n {
            let len = S::LANES.min(n - t);
            let e = S::exp(S::add(S::load_partial(x.add(t), len), neg_max));
            S::store_partial(x.add(t), e, len);
            t += len;
        }
        let mut sum = 0f64;
        for chunk in (0..n).step_by(16) {
            // Past `n` llama.cpp's masked scores give exactly 0.
            let mut v = [0f32; 16];
            for (j, lane) in v.iter_mut().enumerate().take((n - chunk).min(16)) {
                *lane = *x.add(chunk + j);
            }
            let mut half = 8;
            while half > 0 {
                for j in 0..half {
                    v[j] += v[j + half];
                }
                half /= 2;
            }
            sum += v[0] as f64;
        }
        let inv = (1.0 / sum) as f32;
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
    use super::super::simd::Portable;
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
            PagedKv::contiguous(KvSlice::F32(&k), KvSlice::F32(&v), kv_row),
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
            PagedKv::contiguous(KvSlice::F32(&k), KvSlice::F32(&v), kv_row),
            n - 1,
            1,
            shape,
            0.3,
            &mut last,
            &mut scratch,
        );
        assert_eq!(last, &out[(n - 1) * q_row..]);

        // An f16 cache computes over f16 keys and values, with queries and weights rounded to
        // f16 as llama.cpp does: close to the f32 result, and the last query alone is its row
        // in the prefill to the bit.
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
            PagedKv::contiguous(KvSlice::F16(&k16), KvSlice::F16(&v16), kv_row),
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
            PagedKv::contiguous(KvSlice::F16(&k16), KvSlice::F16(&v16), kv_row),
            n - 1,
            1,
            shape,
            0.3,
            &mut last16,
            &mut scratch,
        );
        assert_eq!(last16, &out16[(n - 1) * q_row..]);
    }

    #[test]
    fn bf16_cache_equals_f32_cache_of_the_same_values() {
        // A head of 136 takes both the blocked and the leftover value loops, and 9 keys the
        // one-key tail of the scores, at every lane width.
        let shape = AttentionShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 136,
        };
        let (n, kv_row, q_row) = (9usize, 272usize, 544usize);
        let mut seed = 5u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let bits =
            |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| crate::dtype::f32_to_bf16(x)).collect() };
        let widen =
            |x: &[u16]| -> Vec<f32> { x.iter().map(|&b| crate::dtype::bf16_to_f32(b)).collect() };
        let q: Vec<f32> = (0..n * q_row).map(|_| next()).collect();
        let k16 = bits(&(0..n * kv_row).map(|_| next()).collect::<Vec<_>>());
        let v16 = bits(&(0..n * kv_row).map(|_| next()).collect::<Vec<_>>());
        let (k, v) = (widen(&k16), widen(&v16));
        let pool = ThreadPool::new(2);
        let mut scratch = vec![0f32; attention_scratch_len(2, n)];
        let mut run = |keys: KvSlice<'_>, values: KvSlice<'_>, pos0: usize, rows: usize| {
            let mut out = vec![0f32; rows * q_row];
            causal_attention(
                &pool,
                &q[pos0 * q_row..(pos0 + rows) * q_row],
                PagedKv::contiguous(keys, values, kv_row),
                pos0,
                rows,
                shape,
                0.2,
                &mut out,
                &mut scratch,
            );
            out
        };
        let prefill = run(KvSlice::Bf16(&k16), KvSlice::Bf16(&v16), 0, n);
        assert_eq!(prefill, run(KvSlice::F32(&k), KvSlice::F32(&v), 0, n));
        for i in 0..n {
            let alone = run(KvSlice::Bf16(&k16), KvSlice::Bf16(&v16), i, 1);
            assert_eq!(alone, run(KvSlice::F32(&k), KvSlice::F32(&v), i, 1));
            assert_eq!(alone, &prefill[i * q_row..(i + 1) * q_row]);
        }
    }

    /// llama.cpp's order for an f16 cache, written out plainly: `lanes` partial sums of fused
    /// products, folded by halves, leftovers in f64.
    fn ggml_dot(a: &[f32], b: &[f32], lanes: usize) -> f32 {
        let full = a.len() / lanes * lanes;
        let mut acc = vec![0f32; lanes];
        for e in 0..full {
            acc[e % lanes] = a[e].mul_add(b[e], acc[e % lanes]);
        }
        let mut half = lanes / 2;
        while half > 0 {
            for j in 0..half {
                acc[j] += acc[j + half];
            }
            half /= 2;
        }
        let mut sum = acc[0] as f64;
        for e in full..a.len() {
            sum += (a[e] * b[e]) as f64;
        }
        sum as f32
    }

    /// Attention over an f16 cache of `n` positions: `q` `[n, 2·d]`, two heads over one kv
    /// head, keys and values already f16 values.
    struct F16Case {
        d: usize,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
    }

    impl F16Case {
        fn new(d: usize, n: usize, seed: u64) -> F16Case {
            let mut seed = seed;
            let mut next = || {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            };
            let r16 = |x: f32| half::f16::from_f32(x).to_f32();
            let q = (0..n * 2 * d).map(|_| next() * 4.0).collect();
            let k = (0..n * d).map(|_| r16(next() * 4.0)).collect();
            let v = (0..n * d).map(|_| r16(next())).collect();
            F16Case { d, q, k, v }
        }

        /// Queries `pos0..pos0 + rows` over the first `pos0 + rows` positions.
        fn run(&self, pool: &ThreadPool, pos0: usize, rows: usize) -> Vec<f32> {
            let d = self.d;
            let bits = |x: &[f32]| -> Vec<u16> {
                x.iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect()
            };
            let (k16, v16) = (bits(&self.k), bits(&self.v));
            let shape = AttentionShape {
                n_heads: 2,
                n_kv_heads: 1,
                head_dim: d,
            };
            let mut scratch = vec![0f32; attention_scratch_len(pool.n_threads(), pos0 + rows)];
            let mut out = vec![0f32; rows * 2 * d];
            causal_attention(
                pool,
                &self.q[pos0 * 2 * d..(pos0 + rows) * 2 * d],
                PagedKv::contiguous(KvSlice::F16(&k16), KvSlice::F16(&v16), d),
                pos0,
                rows,
                shape,
                0.125,
                &mut out,
                &mut scratch,
            );
            out
        }
    }

    #[test]
    fn f16_cache_follows_llama_cpp_one_token_order() {
        // Heads of 64 (whole lanes) and 80 (16 leftovers, added in f64).
        for d in [64, 80] {
            let n = 150;
            let case = F16Case::new(d, n, 11);
            let pool = ThreadPool::new(2);
            let batched = case.run(&pool, 0, n);
            let r16 = |x: f32| half::f16::from_f32(x).to_f32();
            for i in [0, 70, n - 1] {
                let got = &batched[i * 2 * d..(i + 1) * 2 * d];
                for h in 0..2 {
                    let qh: Vec<f32> = case.q[(i * 2 + h) * d..(i * 2 + h + 1) * d]
                        .iter()
                        .map(|&x| r16(x))
                        .collect();
                    let mut p: Vec<f32> = (0..=i)
                        .map(|t| ggml_dot(&qh, &case.k[t * d..(t + 1) * d], 64) * 0.125)
                        .collect();
                    unsafe { softmax::<Portable>(p.as_mut_ptr(), p.len()) };
                    let p: Vec<f32> = p.iter().map(|&x| r16(x)).collect();
                    for e in 0..d {
                        // The value cache transposed and padded with zeros, as llama.cpp
                        // keeps it.
                        let mut col: Vec<f32> = (0..=i).map(|t| case.v[t * d + e]).collect();
                        let mut pp = p.clone();
                        col.resize(256, 0.0);
                        pp.resize(256, 0.0);
                        let want = ggml_dot(&col, &pp, 64);
                        assert_eq!(
                            got[h * d + e].to_bits(),
                            want.to_bits(),
                            "d {d} query {i} head {h} elem {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn f16_cache_gives_a_query_the_same_bits_alone_and_in_any_batch() {
        // Every query alone (decode) against the whole prompt at once and in chunks of 5 and
        // of 16 (a prompt resumed from a cache at another place): the same bits, on one
        // thread and two.
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        for d in [64, 80] {
            let n = 90;
            let case = F16Case::new(d, n, 3 + d as u64);
            let row = 2 * d;
            for threads in [1, 2] {
                let pool = ThreadPool::new(threads);
                let whole = case.run(&pool, 0, n);
                for chunk in [5, 16] {
                    let mut chunked = Vec::new();
                    for pos0 in (0..n).step_by(chunk) {
                        chunked.extend(case.run(&pool, pos0, chunk.min(n - pos0)));
                    }
                    assert!(
                        bits(&chunked) == bits(&whole),
                        "d {d}: chunks of {chunk} differ from the whole"
                    );
                }
                for i in 0..n {
                    let alone = case.run(&pool, i, 1);
                    assert!(
                        bits(&alone) == bits(&whole[i * row..(i + 1) * row]),
                        "d {d}, {threads} threads: query {i} alone differs from it in the batch"
                    );
                }
            }
        }
    }

    #[test]
    fn a_paged_cache_gives_the_bits_of_a_contiguous_one() {
        // Blocks of 4 positions stored out of order, with a foreign block between them: every
        // cache type, prefill and each position alone, the same bits as the unpaged cache.
        let shape = AttentionShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 32,
        };
        let (n, kv_row, q_row, block) = (11usize, 64usize, 128usize, 4usize);
        let mut seed = 3u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let q: Vec<f32> = (0..n * q_row).map(|_| next()).collect();
        let k: Vec<f32> = (0..n * kv_row).map(|_| next()).collect();
        let v: Vec<f32> = (0..n * kv_row).map(|_| next()).collect();
        // Pool blocks 0..5; the sequence's blocks are 3, 0, 4; blocks 1 and 2 hold garbage.
        let table = [3u32, 0, 4];
        let mut pk = vec![9.0f32; 5 * block * kv_row];
        let mut pv = vec![-9.0f32; 5 * block * kv_row];
        for t in 0..n {
            let at = table[t / block] as usize * block * kv_row + (t % block) * kv_row;
            pk[at..at + kv_row].copy_from_slice(&k[t * kv_row..(t + 1) * kv_row]);
            pv[at..at + kv_row].copy_from_slice(&v[t * kv_row..(t + 1) * kv_row]);
        }
        let pool = ThreadPool::new(2);
        let mut scratch = vec![0f32; attention_scratch_len(2, n)];
        let mut run = |kv: PagedKv<'_>, pos0: usize, rows: usize| {
            let mut out = vec![0f32; rows * q_row];
            let q = &q[pos0 * q_row..(pos0 + rows) * q_row];
            causal_attention(&pool, q, kv, pos0, rows, shape, 0.2, &mut out, &mut scratch);
            out
        };
        let f16 =
            |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| crate::dtype::f32_to_f16(x)).collect() };
        let bf16 =
            |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| crate::dtype::f32_to_bf16(x)).collect() };
        let (k16, v16, pk16, pv16) = (f16(&k), f16(&v), f16(&pk), f16(&pv));
        let (kb, vb, pkb, pvb) = (bf16(&k), bf16(&v), bf16(&pk), bf16(&pv));
        let cases: [(KvSlice<'_>, KvSlice<'_>, KvSlice<'_>, KvSlice<'_>); 3] = [
            (
                KvSlice::F32(&k),
                KvSlice::F32(&v),
                KvSlice::F32(&pk),
                KvSlice::F32(&pv),
            ),
            (
                KvSlice::F16(&k16),
                KvSlice::F16(&v16),
                KvSlice::F16(&pk16),
                KvSlice::F16(&pv16),
            ),
            (
                KvSlice::Bf16(&kb),
                KvSlice::Bf16(&vb),
                KvSlice::Bf16(&pkb),
                KvSlice::Bf16(&pvb),
            ),
        ];
        for (keys, values, pkeys, pvalues) in cases {
            let paged = PagedKv {
                keys: pkeys,
                values: pvalues,
                table: &table,
                block_size: block,
                block_stride: block * kv_row,
            };
            let flat = PagedKv::contiguous(keys, values, kv_row);
            assert_eq!(run(paged, 0, n), run(flat, 0, n));
            for pos in 0..n {
                assert_eq!(run(paged, pos, 1), run(flat, pos, 1));
            }
        }
    }
}
