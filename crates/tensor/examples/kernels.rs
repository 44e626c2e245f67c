//! Kernel micro-benchmarks: `cargo run --release -p ember-tensor --example kernels [threads]
//! [quant | hot [type [k [m]]] | choice | matvec | gemm [type] | attention[-step]
//! [positions [heads kv_heads head_dim]]]`. Prints the read bandwidth of the probe beside matrix-vector and
//! matrix-matrix rates; with `quant`, only the quantized ones. The "hot" lines run one thread
//! on a matrix of a million weights (0.56-1.06 MB: in L2 on Sapphire Rapids, mostly on Zen 4,
//! in L3 on Zen 3's 512 KB): what one core's kernel can consume, which must exceed its share
//! of the probe for decode to be bound by memory. `hot` runs only those (for `perf stat`),
//! optionally only for one type, row length and batch (`hot q4_k 1536 4`). `choice` prints
//! what the timing that picks each quantized type's kernels measured (the load log's line).
//! `matvec` runs decode's products at a 1.5B model's shapes from memory (in the layout a
//! model's weights take), each against a probe read just before it;
//! `gemm` one thread's prefill products (512 activation rows) at those shapes, in GMAC/s, in
//! plain rows and in the layout a model's weights take;
//! `attention` a 512-token (or `positions`) prompt's causal attention over an f16 and an f32
//! cache (a 1.5B model's 12 heads over 2 of 128, or the heads given), the fastest of 15 runs
//! (the least disturbed by neighbours); `attention-step` one decode step's over as many
//! positions.

use std::time::Instant;

use ember_tensor::cpu::{
    AttentionShape, KvSlice, MatRef, PagedKv, WeightLayout, attention_scratch_len,
    causal_attention, matmul, matmul_scratch_len, quant_kernel_report, read_sum,
};
use ember_tensor::{Buffer, BufferKind, BufferOwner, DType, ThreadPool};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2);
    let mode = std::env::args().nth(2).unwrap_or_default();
    let pool = ThreadPool::new(threads);
    let owner = BufferOwner::new();
    if mode == "hot" {
        let only = std::env::args().nth(3);
        hot_kernels(&owner, only.as_deref());
        return;
    }
    if mode == "choice" {
        println!("{}", quant_kernel_report());
        return;
    }
    if mode == "matvec" {
        model_matvecs(&pool, &owner, threads);
        return;
    }
    if mode == "attention" || mode == "attention-step" {
        let arg = |i: usize| std::env::args().nth(i).and_then(|a| a.parse().ok());
        // Qwen2.5-1.5B's heads by default; SmolLM2-135M's are 9 over 3 of 64.
        let shape = AttentionShape {
            n_heads: arg(4).unwrap_or(12),
            n_kv_heads: arg(5).unwrap_or(2),
            head_dim: arg(6).unwrap_or(128),
        };
        attention(
            &pool,
            arg(3).unwrap_or(512),
            shape,
            mode == "attention-step",
        );
        return;
    }
    if mode == "gemm" {
        let only = std::env::args().nth(3);
        gemm_kernels(&owner, only.as_deref());
        return;
    }
    let probe = owner.alloc(BufferKind::Scratch, "probe", 1 << 30).unwrap();
    let rates: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(read_sum(&pool, probe.as_slice()));
            (1u64 << 30) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    println!("probe read          {:6.1} GB/s", median(rates));
    drop(probe);
    if mode != "quant" {
        float_kernels(&pool, &owner, threads);
    }
    quant_kernels(&pool, &owner, threads);
    hot_kernels(&owner, None);
}

fn float_kernels(pool: &ThreadPool, owner: &BufferOwner, threads: usize) {
    // A 600 MB bf16 matrix: far past the 260 MB L3, as decode's weights are.
    let (n, k) = (300_000usize, 1024usize);
    let mut w = owner.alloc(BufferKind::Scratch, "w", n * k * 2).unwrap();
    for (i, v) in w.as_mut_slice::<u16>().iter_mut().enumerate() {
        *v = half::bf16::from_f32(((i * 7919) % 1000) as f32 * 1e-3 - 0.5).to_bits();
    }
    let x: Vec<f32> = (0..k * 512).map(|i| (i % 13) as f32 * 0.01).collect();
    let mut y = vec![0f32; n.max(512 * 4096)];
    let mut scratch = vec![0f32; matmul_scratch_len(threads, 512, 4096)];
    let mat = MatRef::new(DType::BF16, w.bytes(), n, k);
    let rates: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            matmul(pool, &x, 1, &mat, &mut y, &mut scratch);
            (n * k * 2) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    println!("bf16 matvec         {:6.1} GB/s of weights", median(rates));

    let (n, m) = (4096usize, 512usize);
    let small = MatRef::new(DType::BF16, &w.bytes()[..n * k * 2], n, k);
    let rates: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            matmul(pool, &x, m, &small, &mut y, &mut scratch);
            (2 * m * n * k) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    println!("bf16 gemm 512x4096x1024 {:6.1} GFLOP/s", median(rates));
}

fn quant_kernels(pool: &ThreadPool, owner: &BufferOwner, threads: usize) {
    // Quantized weights: bytes of a pseudo-random pattern with sane f16 scales, ~460-510 MB.
    let (n, k) = (200_000usize, 4096usize);
    let x: Vec<f32> = (0..k * 512)
        .map(|i| (i % 13) as f32 * 0.01 - 0.06)
        .collect();
    let mut y = vec![0f32; n.max(512 * 4096)];
    let mut scratch = vec![0f32; matmul_scratch_len(threads, 512, 4096)];
    for dtype in [DType::Q4_K, DType::Q6_K, DType::Q4_1] {
        let w = quantized(owner, dtype, n, k);
        let mat = MatRef::new(dtype, w.bytes(), n, k);
        let bytes = w.bytes().len();
        let rates: Vec<f64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                matmul(pool, &x, 1, &mat, &mut y, &mut scratch);
                bytes as f64 / t.elapsed().as_secs_f64() / 1e9
            })
            .collect();
        println!(
            "{:<4} matvec         {:6.1} GB/s of weights",
            dtype.name().to_lowercase(),
            median(rates)
        );
        if dtype == DType::Q4_K {
            let (n, m) = (4096usize, 512usize);
            let rb = dtype.row_bytes(k);
            let small = MatRef::new(dtype, &w.bytes()[..n * rb], n, k);
            let rates: Vec<f64> = (0..3)
                .map(|_| {
                    let t = Instant::now();
                    matmul(pool, &x, m, &small, &mut y, &mut scratch);
                    (2 * m * n * k) as f64 / t.elapsed().as_secs_f64() / 1e9
                })
                .collect();
            println!("q4_k gemm 512x4096x4096 {:6.1} GFLOP/s", median(rates));
        }
    }
}

/// One core, weights in cache (L2 or L3, see the module docs): the kernels' compute rate.
fn hot_kernels(owner: &BufferOwner, only: Option<&str>) {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let (k, m) = (arg(4, 4096), arg(5, 1));
    let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
    let mut y = vec![0f32; m * 4096];
    let one = ThreadPool::new(1);
    let mut scratch = vec![0f32; matmul_scratch_len(1, 512, 4096)];
    let (n, reps) = (256usize * 4096 / k / 16 * 16, 400usize);
    for dtype in [
        DType::Q4_K,
        DType::Q6_K,
        DType::Q4_1,
        DType::Q5_K,
        DType::Q8_0,
        DType::Q4_0,
    ] {
        if only.is_some_and(|o| o != dtype.name().to_lowercase()) {
            continue;
        }
        let w = quantized(owner, dtype, n, k);
        let best = WeightLayout::best_for(dtype, n);
        let mut layouts = vec![(WeightLayout::Rows, w)];
        if best != WeightLayout::Rows {
            let mut copy = owner
                .alloc(BufferKind::Scratch, "w", layouts[0].1.len())
                .unwrap();
            best.write(dtype, layouts[0].1.bytes(), n, k, copy.bytes_mut());
            layouts.push((best, copy));
        }
        for (layout, w) in &layouts {
            let mat = MatRef::new(dtype, w.bytes(), n, k).with_layout(*layout);
            let bytes = w.bytes().len() * reps;
            let rates: Vec<f64> = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..reps {
                        matmul(&one, &x, m, &mat, &mut y, &mut scratch);
                    }
                    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
                })
                .collect();
            println!(
                "{:<4} {} hot, 1 thread {:6.1} GB/s of weights{}",
                dtype.name().to_lowercase(),
                if m == 1 {
                    "matvec".to_string()
                } else {
                    format!("{m} rows")
                },
                median(rates),
                match layout {
                    WeightLayout::Rows => "",
                    WeightLayout::Interleaved16 => " (interleaved)",
                }
            );
        }
    }
}

/// Decode's products at a 1.5B model's shapes, each matrix far past the last-level cache.
fn model_matvecs(pool: &ThreadPool, owner: &BufferOwner, threads: usize) {
    // The machine's bandwidth drifts: each run is set against a probe read just before it.
    let probe = owner
        .alloc(BufferKind::Scratch, "probe", 256 << 20)
        .unwrap();
    let probe_rate = || {
        let t = Instant::now();
        std::hint::black_box(read_sum(pool, probe.as_slice()));
        (256u64 << 20) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    for (dtype, n, k) in [
        (DType::Q4_K, 120_000usize, 1536usize),
        (DType::Q4_K, 20_000, 8960),
        (DType::Q6_K, 151_936, 1536),
        (DType::Q6_K, 20_000, 8960),
        // A 135M model's (SmolLM2): 576 wide, the MLP output 1536 wide, a Q8_0 output layer.
        (DType::Q4_1, 300_000, 576),
        (DType::Q4_1, 100_000, 1536),
        (DType::Q8_0, 200_000, 576),
        (DType::Q4_0, 300_000, 576),
        (DType::Q5_K, 100_000, 1536),
        // A Hugging Face checkpoint's 16-bit rows.
        (DType::BF16, 20_000, 1536),
        (DType::F16, 20_000, 1536),
    ] {
        let x: Vec<f32> = (0..k).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
        let mut y = vec![0f32; n];
        let mut scratch = vec![0f32; matmul_scratch_len(threads, 1, k)];
        let w = quantized(owner, dtype, n, k);
        // In the layout a model's weights take on this CPU.
        let layout = WeightLayout::best_for(dtype, n);
        let mut laid = owner.alloc(BufferKind::Scratch, "w", w.len()).unwrap();
        layout.write(dtype, w.bytes(), n, k, laid.bytes_mut());
        let mat = MatRef::new(dtype, laid.bytes(), n, k).with_layout(layout);
        let bytes = w.bytes().len();
        let (rates, ratios): (Vec<f64>, Vec<f64>) = (0..9)
            .map(|_| {
                let probe = probe_rate();
                let t = Instant::now();
                matmul(pool, &x, 1, &mat, &mut y, &mut scratch);
                let rate = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
                (rate, rate / probe)
            })
            .unzip();
        println!(
            "{:<4} matvec {n}x{k} {:6.1} GB/s of weights, {:5.2} of the probe",
            dtype.name().to_lowercase(),
            median(rates),
            median(ratios)
        );
    }
}

/// One core, 512 activation rows: the prefill kernels' rate at a 1.5B model's shapes (the
/// attention and MLP inputs, 1536 wide, and the MLP output, 8960 wide).
fn gemm_kernels(owner: &BufferOwner, only: Option<&str>) {
    let one = ThreadPool::new(1);
    let m = 512;
    for dtype in [
        DType::Q4_K,
        DType::Q6_K,
        DType::Q4_1,
        DType::Q4_0,
        DType::Q8_0,
        DType::Q5_K,
    ] {
        if only.is_some_and(|o| o != dtype.name().to_lowercase()) {
            continue;
        }
        for (n, k) in [(2048usize, 1536usize), (512, 8960)] {
            let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
            let mut y = vec![0f32; m * n];
            let mut scratch = vec![0f32; matmul_scratch_len(1, m, k)];
            let w = quantized(owner, dtype, n, k);
            // Plain rows, and the layout a model's weights take when it is another.
            let mut layouts = vec![WeightLayout::Rows];
            let best = WeightLayout::best_for(dtype, n);
            let mut laid = owner.alloc(BufferKind::Scratch, "w", w.len()).unwrap();
            if best != WeightLayout::Rows {
                best.write(dtype, w.bytes(), n, k, laid.bytes_mut());
                layouts.push(best);
            }
            for layout in layouts {
                let data = match layout {
                    WeightLayout::Rows => w.bytes(),
                    WeightLayout::Interleaved16 => laid.bytes(),
                };
                let mat = MatRef::new(dtype, data, n, k).with_layout(layout);
                let rates: Vec<f64> = (0..5)
                    .map(|_| {
                        let t = Instant::now();
                        matmul(&one, &x, m, &mat, &mut y, &mut scratch);
                        (m * n * k) as f64 / t.elapsed().as_secs_f64() / 1e9
                    })
                    .collect();
                println!(
                    "{:<4} gemm 1 thread {m}x{n}x{k} {:6.1} GMAC/s{}",
                    dtype.name().to_lowercase(),
                    median(rates),
                    match layout {
                        WeightLayout::Rows => "",
                        WeightLayout::Interleaved16 => " (interleaved)",
                    }
                );
            }
        }
    }
}

/// `n × k` weights of `dtype`: pseudo-random bytes, every block's f16 scales set to small
/// normal values so that no float in the kernels is subnormal or infinite.
fn quantized(owner: &BufferOwner, dtype: DType, n: usize, k: usize) -> Buffer {
    let mut w = owner
        .alloc(BufferKind::Scratch, dtype.name(), n * dtype.row_bytes(k))
        .unwrap();
    let bytes = w.as_mut_slice::<u8>();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in bytes.chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
    if matches!(dtype, DType::BF16 | DType::F16) {
        // Finite values, none subnormal (random bits would give NaNs and slow assists).
        for (i, v) in bytes.chunks_exact_mut(2).enumerate() {
            let x = ((i * 7919) % 200) as f32 * 0.001 - 0.1 + 0.0005;
            v.copy_from_slice(&match dtype {
                DType::BF16 => half::bf16::from_f32(x).to_le_bytes(),
                _ => half::f16::from_f32(x).to_le_bytes(),
            });
        }
        return w;
    }
    let scale = half::f16::from_f32(0.01).to_le_bytes();
    let offsets: &[usize] = match dtype {
        DType::Q6_K => &[208],
        DType::Q8_0 | DType::Q4_0 => &[0],
        _ => &[0, 2],
    };
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        for &o in offsets {
            block[o..o + 2].copy_from_slice(&scale);
        }
    }
    w
}

fn attention(pool: &ThreadPool, n: usize, shape: AttentionShape, step: bool) {
    let (kv_heads, d) = (shape.n_kv_heads, shape.head_dim);
    let mut seed = 1u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let q: Vec<f32> = (0..n * shape.n_heads * d).map(|_| next()).collect();
    let k: Vec<f32> = (0..n * kv_heads * d).map(|_| next()).collect();
    let v: Vec<f32> = (0..n * kv_heads * d).map(|_| next()).collect();
    let f16 = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&x| half::f16::from_f32(x).to_bits())
            .collect()
    };
    let (k16, v16) = (f16(&k), f16(&v));
    let mut out = vec![0f32; q.len()];
    let mut scratch = vec![0f32; attention_scratch_len(pool.n_threads(), n, shape)];
    for (name, keys, values) in [
        ("f16", KvSlice::F16(&k16), KvSlice::F16(&v16)),
        ("f32", KvSlice::F32(&k), KvSlice::F32(&v)),
    ] {
        if step {
            let step_ms = (0..15)
                .map(|_| {
                    let t = Instant::now();
                    let kv = PagedKv::contiguous(keys, values, kv_heads * d);
                    let last = &q[(n - 1) * shape.n_heads * d..];
                    causal_attention(
                        pool,
                        last,
                        kv,
                        n - 1,
                        1,
                        shape,
                        0.088,
                        &mut out,
                        &mut scratch,
                    );
                    t.elapsed().as_secs_f64() * 1e3
                })
                .fold(f64::INFINITY, f64::min);
            let macs = (n * 2 * d * shape.n_heads) as f64;
            println!(
                "attention {name} cache, one query over {n}: {step_ms:6.3} ms, {:5.1} GMAC/s",
                macs / step_ms / 1e6
            );
            continue;
        }
        let ms = (0..15)
            .map(|_| {
                let t = Instant::now();
                let kv = PagedKv::contiguous(keys, values, kv_heads * d);
                causal_attention(pool, &q, kv, 0, n, shape, 0.088, &mut out, &mut scratch);
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min);
        // Two products of `d` MACs per (query, visible key) and head.
        let macs = (n * (n + 1) / 2 * 2 * d * shape.n_heads) as f64;
        println!(
            "attention {name} cache, {n} queries, {}/{kv_heads} heads of {d}: {ms:6.2} ms, {:5.1} GMAC/s",
            shape.n_heads,
            macs / ms / 1e6
        );
    }
}
