//! Attention over an f16 cache in llama.cpp's one-token order, for every query.

use super::super::simd::{F16, Simd, WeightElem};
use super::{AttentionShape, Job, KEY_BLOCK, softmax};

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
pub(super) unsafe fn attend_items_f16<S: Simd>(job: Job) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim: d,
    } = job.shape;
    let kv_row = n_kv_heads * d;
    let scores = unsafe { job.scratch.get().add(job.thread * job.per_thread) };
    // `ggml_vec_dot_f16`'s partial sums, for the scores and the weighted sum alike.
    const LANES: usize = 64;
    let heads = job.heads;
    // Per head: its query rounded to f16, then the weighted sum's partial sums.
    let mut buf = vec![0f32; heads * (d + LANES / 4 * d)];
    let (q16, partial) = buf.split_at_mut(heads * d);
    for item in job.first..job.end {
        let unit = job.unit(item);
        let visible = unit.visible;
        unsafe {
            for hh in 0..heads {
                let q = job.q.get().add((unit.query * n_heads + unit.head + hh) * d);
                let q16 = q16.as_mut_ptr().add(hh * d);
                std::ptr::copy_nonoverlapping(q as *const f32, q16, d);
                round_f16_in_place::<S>(q16, d);
            }
            let key =
                |t: usize| (job.keys.get() as *const F16).add(job.row(t, kv_row) + unit.kv_offset);
            let mut block = 0;
            while block < visible {
                let end = (block + KEY_BLOCK).min(visible);
                for hh in 0..heads {
                    let q = q16.as_ptr().add(hh * d);
                    let row = scores.add(hh * job.context);
                    let mut t = block;
                    while t < end {
                        let k = std::array::from_fn(|j| key((t + j).min(end - 1)));
                        // 64 lanes as 4 or 8 vectors (every set's `S::LANES` is 16 or 8).
                        let dots = if LANES / S::LANES == 4 {
                            dot4_lanes::<S, 4>(q, k, d)
                        } else {
                            dot4_lanes::<S, 8>(q, k, d)
                        };
                        for (j, dot) in dots.into_iter().enumerate().take(end - t) {
                            *row.add(t + j) = dot * job.scale;
                        }
                        t += 4;
                    }
                }
                block = end;
            }
            for hh in 0..heads {
                softmax::<S>(scores.add(hh * job.context), visible);
                round_f16_in_place::<S>(scores.add(hh * job.context), visible);
            }
            let value = |t: usize| {
                (job.values.get() as *const F16).add(job.row(t, kv_row) + unit.kv_offset)
            };
            let sums = WeightedSums {
                w: scores,
                w_stride: job.context,
                n: visible,
                out: job.out.get().add((unit.query * n_heads + unit.head) * d),
                d,
                lanes: LANES,
                partial: partial.as_mut_ptr(),
            };
            weighted_sums_lanes::<S>(&sums, heads, &value);
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
        let mut out = S::hsum4([
            fold_halves::<S, NV>(&acc[0]),
            fold_halves::<S, NV>(&acc[1]),
            fold_halves::<S, NV>(&acc[2]),
            fold_halves::<S, NV>(&acc[3]),
        ]);
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

/// The weighted sums of one unit's heads: score rows `w_stride` apart, outputs `d` apart,
/// `lanes / 4 · d` elements of `partial` per head.
struct WeightedSums {
    w: *mut f32,
    w_stride: usize,
    n: usize,
    out: *mut f32,
    d: usize,
    lanes: usize,
    partial: *mut f32,
}

/// Every head's [`weighted_sum_lanes`], in sets of heads whose sums fit the registers
/// together (a value row's vectors are loaded once for the set): as many heads as fit with
/// one vector of each sum, or fewer heads with wider pieces of the row.
#[inline(always)]
unsafe fn weighted_sums_lanes<S: Simd>(
    sums: &WeightedSums,
    heads: usize,
    v: &impl Fn(usize) -> *const F16,
) {
    // Four sums (`j + m·lanes/4`) per head and vector: 24 of AVX-512's 32 registers, 12 of
    // AVX2's 16.
    let most = if S::LANES >= 16 { 6 } else { 3 };
    let sets = heads.div_ceil(most);
    let mut first = 0;
    for set in 0..sets {
        let size = (heads - first) / (sets - set);
        let at = |x: *mut f32, stride: usize| unsafe { x.add(first * stride) };
        let part = WeightedSums {
            w: at(sums.w, sums.w_stride),
            out: at(sums.out, sums.d),
            partial: at(sums.partial, sums.lanes / 4 * sums.d),
            ..*sums
        };
        unsafe {
            match size {
                1 => weighted_sum_lanes::<S, 1, 4>(&part, v),
                2 => weighted_sum_lanes::<S, 2, 2>(&part, v),
                3 => weighted_sum_lanes::<S, 3, 1>(&part, v),
                4 => weighted_sum_lanes::<S, 4, 1>(&part, v),
                5 => weighted_sum_lanes::<S, 5, 1>(&part, v),
                6 => weighted_sum_lanes::<S, 6, 1>(&part, v),
                _ => unreachable!("weighted sums: {size} heads at once"),
            }
        }
        first += size;
    }
}

/// `out[h] = Σ_t w[h][t] · v(t)` for `HG` heads with `lanes` partial sums per output
/// element (sum `l` takes the keys `t ≡ l mod lanes`, one FMA each in key order), folded by
/// halves: the order of llama.cpp's `mul_mat(v, kq)` over its transposed f16 value cache. The
/// sums of each group `{j, j + lanes/4, j + lanes/2, j + 3·lanes/4}` stay in registers, `NV`
/// vectors of each head's, while their keys stream past and take the fold's first two halvings
/// there; `partial` holds the groups' results for the rest of the fold.
#[inline(always)]
unsafe fn weighted_sum_lanes<S: Simd, const HG: usize, const NV: usize>(
    sums: &WeightedSums,
    v: &impl Fn(usize) -> *const F16,
) {
    let &WeightedSums {
        w,
        w_stride,
        n,
        out,
        d,
        lanes,
        partial,
    } = sums;
    unsafe {
        let used = lanes.min(n);
        let quarter = lanes / 4;
        let part = |g: usize, j: usize| partial.add((g * quarter + j) * d);
        let mut e0 = 0;
        while e0 < d {
            let width = (NV * S::LANES).min(d - e0);
            let len = |c: usize| S::LANES.min(width.saturating_sub(c * S::LANES));
            for j in 0..quarter.min(used) {
                // Head `g`'s sum `j + m·quarter` in `acc[g][m]`.
                let mut acc = [[[S::zero(); NV]; 4]; HG];
                let mut t0 = 0;
                while t0 < n {
                    for m in 0..4 {
                        let t = t0 + j + m * quarter;
                        if t >= n {
                            break;
                        }
                        let row = v(t).add(e0);
                        for c in 0..NV {
                            let l = len(c);
                            let x = if l == S::LANES {
                                F16::load::<S>(row.add(c * S::LANES))
                            } else if l > 0 {
                                F16::load_partial::<S>(row.add(c * S::LANES), l)
                            } else {
                                continue;
                            };
                            for (g, a) in acc.iter_mut().enumerate() {
                                let wt = S::splat(*w.add(g * w_stride + t));
                                a[m][c] = S::fma(wt, x, a[m][c]);
                            }
                        }
                    }
                    t0 += lanes;
                }
                // The halvings by `lanes/2` and `lanes/4`, adding only the sums that hold
                // keys (past the last key llama.cpp's padded cache gives zeros, which change
                // nothing).
                let has = |m: usize| j + m * quarter < used;
                for (g, [a0, a1, a2, a3]) in acc.into_iter().enumerate() {
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
                            S::store_partial(part(g, j).add(e0 + c * S::LANES), lo, l);
                        }
                    }
                }
            }
            e0 += width;
        }
        // The rest of the fold, from `lanes/8` on.
        for g in 0..HG {
            let mut half = quarter / 2;
            while half > 0 {
                for j in 0..half.min(used) {
                    if j + half < used {
                        let (dst, src) = (part(g, j), part(g, j + half) as *const f32);
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
            std::ptr::copy_nonoverlapping(part(g, 0) as *const f32, out.add(g * d), d);
        }
    }
}
