//! Causal attention of new queries over a sequence's cached keys and values.
//!
//! A unit of work is a query's heads that read one kv head (or, for a few queries on many
//! threads, one head): scores against every visible key, a softmax, a weighted sum of values.
//! A unit walks the keys and values in blocks that every one of its heads takes in turn, so a
//! block read from L2 once serves the whole group from L1 (grouped-query attention's reuse;
//! L2 bandwidth bounds a head that streams its prefix alone). Each (query, head) pair's sums
//! run in the same order in either unit. Over an f32 or bf16 cache the sums run in key order
//! and prefill and decode run the same sums, so a token's output is the same whichever way it
//! was computed (bf16 is widened on load: the same sums as an f32 cache holding the same
//! values).
//! Over an f16 cache the unit is llama.cpp's for a lone query (see `attend_items_f16`), and
//! every query takes it, alone or in a batch.
//!
//! By job: this file holds the types, the dispatch and the f32/bf16 unit; [`f16`] llama.cpp's
//! one-token order over an f16 cache.

use super::simd::{Bf16, Simd, WeightElem};
use super::{Isa, SharedPtr, simd_dispatch};
use crate::pool::ThreadPool;

mod f16;
#[cfg(test)]
mod tests;

use f16::attend_items_f16;

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

impl AttentionShape {
    /// The heads one unit computes when units are kv heads: the largest divisor of the group
    /// up to [`MAX_UNIT_HEADS`] (a unit's scores are that many rows of scratch).
    fn unit_heads(&self) -> usize {
        let group = self.n_heads / self.n_kv_heads.max(1);
        (1..=group.min(MAX_UNIT_HEADS))
            .rev()
            .find(|h| group.is_multiple_of(*h))
            .unwrap_or(1)
    }
}

/// The widest head the kernel takes (queries are copied to the stack to round them).
const MAX_HEAD_DIM: usize = 512;

/// The most heads one unit computes.
const MAX_UNIT_HEADS: usize = 8;

/// Keys a unit's heads take in turn: 8-16 KB of a kv head's keys or values at 128 wide, so
/// the block stays in L1 while every head of the unit reads it.
const KEY_BLOCK: usize = 32;

/// Units per thread below which each head is its own unit, so that every thread has work
/// (one query on more threads than kv heads). One is enough: a decode step over 8k f16
/// positions (12 heads over 2) took 2.2-3.0 ms in two units on two threads against 2.7-4.2
/// in twelve, and 2.2 against 4.1 on one thread (`kernels N attention-step 8192`).
const UNITS_PER_THREAD: usize = 1;

/// f32 elements of scratch [`causal_attention`] needs for `context` positions.
pub fn attention_scratch_len(n_threads: usize, context: usize, shape: AttentionShape) -> usize {
    n_threads * context * shape.unit_heads()
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
    // Whole groups when there are enough of them to keep every thread busy; the bits are
    // the same either way.
    let grouped = shape.unit_heads();
    let heads = if n * (shape.n_heads / grouped) >= UNITS_PER_THREAD * pool.n_threads() {
        grouped
    } else {
        1
    };
    let isa = Isa::detect();
    attention_units(isa, pool, q, kv, pos0, n, shape, scale, out, scratch, heads);
}

/// [`causal_attention`] on `isa` in units of `heads` heads (a divisor of the group).
#[allow(clippy::too_many_arguments)]
fn attention_units(
    isa: Isa,
    pool: &ThreadPool,
    q: &[f32],
    kv: PagedKv<'_>,
    pos0: usize,
    n: usize,
    shape: AttentionShape,
    scale: f32,
    out: &mut [f32],
    scratch: &mut [f32],
    heads: usize,
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
    assert!(
        per_thread >= heads * context,
        "attention: scratch too small"
    );
    let items = n * (shape.n_heads / heads);
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
        context,
        shape,
        heads,
        scale,
        items,
        first: 0,
        end: 0,
        thread: 0,
    };
    // Pieces of items claimed by whichever thread is free: a later query sees more keys, so
    // free threads taking the next piece keep the work even (and a thread held off its core
    // by another process leaves its share to the others). An item's result never depends on
    // its piece.
    let piece = items.div_ceil(pool.n_threads() * 4).max(1);
    pool.share(items, piece, &|thread, range| {
        let job = Job {
            thread,
            first: range.start,
            end: range.end,
            ..job
        };
        match kv.keys {
            KvSlice::F32(_) => attend_f32(isa, job),
            KvSlice::F16(_) => attend_f16(isa, job),
            KvSlice::Bf16(_) => attend_bf16(isa, job),
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
    /// Positions the call sees; also the stride of a unit's score rows.
    context: usize,
    shape: AttentionShape,
    /// Heads a unit computes (they read the same kv head).
    heads: usize,
    scale: f32,
    /// Units: `n` queries times `n_heads / heads`, unit-head-major.
    items: usize,
    /// The items this call computes, and the thread whose scratch it uses.
    first: usize,
    end: usize,
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

    /// Unit `item`'s query, first head and the visible positions.
    fn unit(&self, item: usize) -> Unit {
        let n = self.items / (self.shape.n_heads / self.heads);
        let (unit_head, query) = (item / n, item % n);
        let head = unit_head * self.heads;
        let group = self.shape.n_heads / self.shape.n_kv_heads;
        Unit {
            query,
            head,
            visible: self.pos0 + query + 1,
            kv_offset: (head / group) * self.shape.head_dim,
        }
    }
}

/// One unit of work: heads `head..head + Job::heads` of query `query`.
struct Unit {
    query: usize,
    head: usize,
    visible: usize,
    /// Elements from a cache row's start to the unit's kv head.
    kv_offset: usize,
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
    let kv_row = n_kv_heads * d;
    let scores = unsafe { job.scratch.get().add(job.thread * job.per_thread) };
    // Units go head by head, so one kv head's keys and values stay in cache across queries.
    for item in job.first..job.end {
        let unit = job.unit(item);
        let visible = unit.visible;
        unsafe {
            let key =
                |t: usize| (job.keys.get() as *const E).add(job.row(t, kv_row) + unit.kv_offset);
            let mut block = 0;
            while block < visible {
                let end = (block + KEY_BLOCK).min(visible);
                for hh in 0..job.heads {
                    let q = job.q.get().add((unit.query * n_heads + unit.head + hh) * d);
                    let row = scores.add(hh * job.context);
                    let mut t = block;
                    while t + 4 <= end {
                        let s = dot4::<S, E>(q, [key(t), key(t + 1), key(t + 2), key(t + 3)], d);
                        for (j, value) in s.into_iter().enumerate() {
                            *row.add(t + j) = value * job.scale;
                        }
                        t += 4;
                    }
                    while t < end {
                        *row.add(t) = dot4::<S, E>(q, [key(t); 4], d)[0] * job.scale;
                        t += 1;
                    }
                }
                block = end;
            }
            for hh in 0..job.heads {
                softmax::<S>(scores.add(hh * job.context), visible);
            }
            let value =
                |t: usize| (job.values.get() as *const E).add(job.row(t, kv_row) + unit.kv_offset);
            weighted_sum::<S, E>(
                scores,
                job.context,
                job.heads,
                visible,
                value,
                job.out.get().add((unit.query * n_heads + unit.head) * d),
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
        S::hsum4(acc)
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

/// `out[h] = Σ_t w[h][t] · v(t)` for `heads` heads (score rows `w_stride` apart, outputs `d`
/// apart), each element summed in key order. The accumulators stay in registers over a block
/// of keys and in `out` between blocks, so each block of values serves every head from L1.
#[inline(always)]
unsafe fn weighted_sum<S: Simd, E: WeightElem>(
    w: *const f32,
    w_stride: usize,
    heads: usize,
    n: usize,
    v: impl Fn(usize) -> *const E,
    out: *mut f32,
    d: usize,
) {
    const BLOCK: usize = 8;
    unsafe {
        let mut base = 0;
        while base + BLOCK * S::LANES <= d {
            let mut block = 0;
            while block < n {
                let end = (block + KEY_BLOCK).min(n);
                for h in 0..heads {
                    let (wh, oh) = (w.add(h * w_stride), out.add(h * d + base));
                    let mut acc = [S::zero(); BLOCK];
                    if block > 0 {
                        for (j, a) in acc.iter_mut().enumerate() {
                            *a = S::load(oh.add(j * S::LANES));
                        }
                    }
                    for t in block..end {
                        let wt = S::splat(*wh.add(t));
                        let row = v(t).add(base);
                        for (j, a) in acc.iter_mut().enumerate() {
                            *a = S::fma(wt, E::load::<S>(row.add(j * S::LANES)), *a);
                        }
                    }
                    for (j, a) in acc.iter().enumerate() {
                        S::store(oh.add(j * S::LANES), *a);
                    }
                }
                block = end;
            }
            base += BLOCK * S::LANES;
        }
        while base < d {
            let len = S::LANES.min(d - base);
            let mut block = 0;
            while block < n {
                let end = (block + KEY_BLOCK).min(n);
                for h in 0..heads {
                    let (wh, oh) = (w.add(h * w_stride), out.add(h * d + base));
                    let mut acc = if block > 0 {
                        S::load_partial(oh, len)
                    } else {
                        S::zero()
                    };
                    for t in block..end {
                        acc = S::fma(
                            S::splat(*wh.add(t)),
                            E::load_partial::<S>(v(t).add(base), len),
                            acc,
                        );
                    }
                    S::store_partial(oh, acc, len);
                }
                block = end;
            }
            base += len;
        }
    }
}
