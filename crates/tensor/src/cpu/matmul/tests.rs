//! The products' bits against f64 references, across batches, threads and layouts.

use super::*;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    }
}

fn decode(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        DType::BF16 => bytes
            .chunks(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => unreachable!(),
    }
}

/// A 4-aligned copy, since `Vec<u8>` makes no alignment promise.
fn aligned(bytes: &[u8]) -> Vec<u32> {
    let mut words = vec![0u32; bytes.len().div_ceil(4)];
    bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
    words
}

fn check(m: usize, n: usize, k: usize, dtype: DType, threads: usize) {
    let mut seed = (m * 1000 + n * 10 + k) as u64;
    let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
    let w_values: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
    let w_bytes = encode(&w_values, dtype);
    let w_words = aligned(&w_bytes);
    let w_stored = &bytemuck::cast_slice::<u32, u8>(&w_words)[..w_bytes.len()];
    let w_exact = decode(w_stored, dtype);
    let pool = ThreadPool::new(threads);
    let mut scratch = vec![0f32; matmul_scratch_len(threads, m, k)];
    let mut y = vec![f32::NAN; m * n];
    matmul(
        &pool,
        &x,
        m,
        &MatRef::new(dtype, w_stored, n, k),
        &mut y,
        &mut scratch,
    );
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k)
                .map(|p| x[i * k + p] as f64 * w_exact[j * k + p] as f64)
                .sum();
            let got = y[i * n + j] as f64;
            assert!(
                (got - want).abs() <= 1e-4 * (k as f64).sqrt(),
                "m={m} n={n} k={k} {dtype}: y[{i},{j}] = {got}, want {want}"
            );
        }
    }
    // Row independence: each row alone gives the very same bits as inside the batch.
    for i in [0, m / 2, m - 1] {
        let mut y1 = vec![0f32; n];
        matmul(
            &pool,
            &x[i * k..(i + 1) * k],
            1,
            &MatRef::new(dtype, w_stored, n, k),
            &mut y1,
            &mut scratch,
        );
        assert_eq!(
            y1,
            &y[i * n..(i + 1) * n],
            "row {i} alone differs from row {i} in a batch of {m}"
        );
    }
}

#[test]
fn matches_f64_reference_and_is_batch_invariant() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 7, 33),
            (3, 9, 16),
            (4, 4, 64),
            (5, 13, 100),
            (37, 21, 200),
            (9, 64, 17),
        ] {
            for threads in [1, 2, 3] {
                check(m, n, k, dtype, threads);
            }
        }
    }
}

/// Quantized weights through `matmul`: against the f64 reference of the dequantized
/// weights and quantized-then-dequantized activations, and row by row bit-identical to the
/// same row alone, whatever the thread count.
fn check_quantized(m: usize, n: usize, k: usize, dtype: DType, threads: usize) {
    let mut seed = (m * 1000 + n * 10 + k + dtype.ggml_type() as usize) as u64;
    let w: Vec<u8> = (0..n)
        .flat_map(|_| super::super::quant_dot::tests::random_row(dtype, k, &mut seed, false))
        .collect();
    let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) * 2.0).collect();
    let pool = ThreadPool::new(threads);
    let mut scratch = vec![0f32; matmul_scratch_len(threads, m, k)];
    let mat = MatRef::new(dtype, &w, n, k);
    let mut y = vec![f32::NAN; m * n];
    matmul(&pool, &x, m, &mat, &mut y, &mut scratch);
    let rb = dtype.row_bytes(k);
    for i in 0..m {
        for j in 0..n {
            let (want, size) = super::super::quant_dot::tests::reference(
                dtype,
                &w[j * rb..(j + 1) * rb],
                &x[i * k..(i + 1) * k],
            );
            let got = y[i * n + j] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * size + 1e-6,
                "m={m} n={n} k={k} {dtype} threads={threads}: y[{i},{j}] = {got}, want {want}"
            );
        }
    }
    for i in [0, m / 2, m - 1] {
        let mut y1 = vec![0f32; n];
        matmul(
            &pool,
            &x[i * k..(i + 1) * k],
            1,
            &mat,
            &mut y1,
            &mut scratch,
        );
        let same = y1
            .iter()
            .zip(&y[i * n..(i + 1) * n])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{dtype}: row {i} alone differs from row {i} in a batch of {m} on {threads} threads"
        );
    }
}

#[test]
fn quantized_matches_reference_and_is_batch_invariant() {
    for dtype in [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ] {
        let b = dtype.block_size();
        for &(m, n, blocks) in &[
            (1, 1, 1),
            (1, 19, 3),
            (2, 8, 2),
            (3, 17, 1),
            (5, 13, 2),
            // From 16 rows the wide road (Q4_K, Q6_K with VNNI), its tiles split over
            // the threads.
            (17, 9, 2),
            (37, 21, 2),
        ] {
            for threads in [1, 2, 3] {
                check_quantized(m, n, blocks * b, dtype, threads);
            }
        }
    }
}

#[test]
fn quantized_prefill_blocks_and_threads_give_the_same_bits() {
    // Enough rows for several activation blocks (of wide tiles with VNNI): the results of
    // one thread, of two and of three, and each row alone, are the same bits.
    for dtype in [DType::Q4_K, DType::Q6_K] {
        let (m, n, k) = (300, 24, 256 * 8);
        let mut seed = 99u64;
        let w: Vec<u8> = (0..n)
            .flat_map(|_| super::super::quant_dot::tests::random_row(dtype, k, &mut seed, false))
            .collect();
        let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
        let mat = MatRef::new(dtype, &w, n, k);
        let mut results = Vec::new();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            let mut scratch = vec![0f32; matmul_scratch_len(threads, m, k)];
            let mut y = vec![0f32; m * n];
            matmul(&pool, &x, m, &mat, &mut y, &mut scratch);
            results.push(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        assert_eq!(results[0], results[1], "{dtype}: two threads");
        assert_eq!(results[0], results[2], "{dtype}: three threads");
        let pool = ThreadPool::new(2);
        let mut scratch = vec![0f32; matmul_scratch_len(2, 1, k)];
        for i in [0, 151, m - 1] {
            let mut y1 = vec![0f32; n];
            matmul(
                &pool,
                &x[i * k..(i + 1) * k],
                1,
                &mat,
                &mut y1,
                &mut scratch,
            );
            let y1: Vec<u32> = y1.iter().map(|v| v.to_bits()).collect();
            assert_eq!(y1, results[0][i * n..(i + 1) * n], "{dtype}: row {i} alone");
        }
    }
}

/// Matrices sharing their input in one share of the threads give each output the bits
/// of its own product: plain and interleaved rows, decode and prompt batches, 1 to 3
/// threads, and a group whose types differ (one product at a time).
#[test]
fn products_sharing_their_input_give_the_bits_of_each_alone() {
    use super::super::mat_ref::WeightLayout;
    let k = 256 * 2;
    let mut seed = 7u64;
    for dtype in [DType::Q4_K, DType::Q6_K, DType::Q8_0, DType::Q4_0] {
        for layout in [WeightLayout::Rows, WeightLayout::Interleaved16] {
            let shapes = [48, 16, 32];
            let stored: Vec<Vec<u8>> = shapes
                .iter()
                .map(|&n| {
                    let plain: Vec<u8> = (0..n)
                        .flat_map(|_| {
                            super::super::quant_dot::tests::random_row(dtype, k, &mut seed, false)
                        })
                        .collect();
                    let mut out = vec![0u8; plain.len()];
                    layout.write(dtype, &plain, n, k, &mut out);
                    out
                })
                .collect();
            let mats: Vec<MatRef<'_>> = stored
                .iter()
                .zip(shapes)
                .map(|(w, n)| MatRef::new(dtype, w, n, k).with_layout(layout))
                .collect();
            for (m, threads) in [(1, 1), (1, 2), (3, 3), (20, 2)] {
                let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
                let pool = ThreadPool::new(threads);
                let mut scratch = vec![0f32; matmul_scratch_len(threads, m, k)];
                let alone: Vec<Vec<u32>> = mats
                    .iter()
                    .map(|w| {
                        let mut y = vec![0f32; m * w.rows];
                        matmul(&pool, &x, m, w, &mut y, &mut scratch);
                        y.iter().map(|v| v.to_bits()).collect()
                    })
                    .collect();
                let mut outs: Vec<Vec<f32>> =
                    mats.iter().map(|w| vec![f32::NAN; m * w.rows]).collect();
                let mut ys: Vec<&mut [f32]> = outs.iter_mut().map(|y| &mut y[..]).collect();
                matmul_shared_input(&pool, &x, m, &mats, &mut ys, &mut scratch);
                for (i, y) in outs.iter().enumerate() {
                    let bits: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(
                        bits, alone[i],
                        "{dtype} {layout:?}: output {i} of {m} rows on {threads} threads"
                    );
                }
            }
        }
    }
    // Types that differ (Q4_K_M's q and k, then a Q6_K v, then a float matrix): the
    // neighbours that match go together, the rest alone, the same bits.
    let types = [DType::Q4_K, DType::Q4_K, DType::Q6_K, DType::Q4_K];
    let rows: Vec<Vec<u8>> = types
        .iter()
        .map(|&t| super::super::quant_dot::tests::random_row(t, k, &mut seed, false))
        .collect();
    let floats: Vec<f32> = (0..k).map(|_| lcg(&mut seed)).collect();
    let mut mats: Vec<MatRef<'_>> = types
        .iter()
        .zip(&rows)
        .map(|(&t, r)| MatRef::new(t, r, 1, k))
        .collect();
    mats.push(MatRef::new(DType::F32, bytemuck::cast_slice(&floats), 1, k));
    let x: Vec<f32> = (0..k).map(|_| lcg(&mut seed)).collect();
    let pool = ThreadPool::new(2);
    let mut scratch = vec![0f32; matmul_scratch_len(2, 1, k)];
    let mut alone = vec![0f32; mats.len()];
    for (w, y) in mats.iter().zip(alone.iter_mut()) {
        matmul(&pool, &x, 1, w, std::slice::from_mut(y), &mut scratch);
    }
    let mut together = vec![f32::NAN; mats.len()];
    let mut ys: Vec<&mut [f32]> = together.chunks_mut(1).collect();
    matmul_shared_input(&pool, &x, 1, &mats, &mut ys, &mut scratch);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&together), bits(&alone));
}
