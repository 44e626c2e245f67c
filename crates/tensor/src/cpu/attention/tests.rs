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
    let mut scratch = vec![0f32; attention_scratch_len(2, n, shape)];
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
                            q[i * q_row + h * 20 + e] as f64 * k[t * kv_row + kvh * 20 + e] as f64
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
    let mut scratch = vec![0f32; attention_scratch_len(2, n, shape)];
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
        let mut scratch = vec![0f32; attention_scratch_len(pool.n_threads(), pos0 + rows, shape)];
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
    let mut scratch = vec![0f32; attention_scratch_len(2, n, shape)];
    let mut run = |kv: PagedKv<'_>, pos0: usize, rows: usize| {
        let mut out = vec![0f32; rows * q_row];
        let q = &q[pos0 * q_row..(pos0 + rows) * q_row];
        causal_attention(&pool, q, kv, pos0, rows, shape, 0.2, &mut out, &mut scratch);
        out
    };
    let f16 = |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| crate::dtype::f32_to_f16(x)).collect() };
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

#[test]
fn a_unit_of_a_whole_group_gives_each_head_the_bits_of_a_unit_of_one() {
    // Groups of 1 to 8 heads (7: sets of weighted sums of unequal sizes), heads of 20, 80
    // (f16 lanes' leftovers) and 136 (the f32 blocked and leftover loops), prompts of 1 to
    // 70 keys (three key blocks; more keys than f16 lanes): every cache type and every
    // instruction set here, prefill and a query resumed at 40, the bits of one head a unit.
    let mut seed = 17u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    let pool = ThreadPool::new(2);
    for (group, d, n) in [
        (1, 20, 5),
        (2, 80, 70),
        (3, 136, 33),
        (6, 80, 70),
        (7, 20, 66),
        (8, 136, 41),
    ] {
        let shape = AttentionShape {
            n_heads: 2 * group,
            n_kv_heads: 2,
            head_dim: d,
        };
        assert_eq!(shape.unit_heads(), group);
        let (kv_row, q_row) = (2 * d, 2 * group * d);
        let q: Vec<f32> = (0..n * q_row).map(|_| next() * 4.0).collect();
        let k: Vec<f32> = (0..n * kv_row).map(|_| next() * 4.0).collect();
        let v: Vec<f32> = (0..n * kv_row).map(|_| next()).collect();
        let f16 =
            |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| crate::dtype::f32_to_f16(x)).collect() };
        let bf16 =
            |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| crate::dtype::f32_to_bf16(x)).collect() };
        let (k16, v16, kb, vb) = (f16(&k), f16(&v), bf16(&k), bf16(&v));
        let caches = [
            (KvSlice::F32(&k), KvSlice::F32(&v)),
            (KvSlice::F16(&k16), KvSlice::F16(&v16)),
            (KvSlice::Bf16(&kb), KvSlice::Bf16(&vb)),
        ];
        let mut scratch = vec![0f32; attention_scratch_len(2, n, shape)];
        for isa in Isa::available() {
            for (keys, values) in caches {
                let mut run = |pos0: usize, heads: usize| {
                    let rows = n - pos0;
                    let mut out = vec![0f32; rows * q_row];
                    let kv = PagedKv::contiguous(keys, values, kv_row);
                    let q = &q[pos0 * q_row..];
                    attention_units(
                        isa,
                        &pool,
                        q,
                        kv,
                        pos0,
                        rows,
                        shape,
                        0.3,
                        &mut out,
                        &mut scratch,
                        heads,
                    );
                    out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                };
                for pos0 in [0, 40.min(n - 1)] {
                    assert!(
                        run(pos0, group) == run(pos0, 1),
                        "{isa:?}, cache {}: group {group}, head {d}, {n} keys from {pos0}",
                        ["f32", "f16", "bf16"][match keys {
                            KvSlice::F32(_) => 0,
                            KvSlice::F16(_) => 1,
                            KvSlice::Bf16(_) => 2,
                        }]
                    );
                }
            }
        }
    }
}
