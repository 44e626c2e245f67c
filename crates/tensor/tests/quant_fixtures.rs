//! `dequantize_row` against gguf-py's numpy dequantizers, an implementation ember shares no
//! code with; and products over those blocks, each row the same bits alone as in any batch.
//! The fixtures come from `scripts/make_quant_fixtures.py`.

use ember_tensor::cpu::{MatRef, matmul, matmul_scratch_len};
use ember_tensor::quant::dequantize_row;
use ember_tensor::{DType, ThreadPool};

fn fixture(name: &str, ext: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/quant/{name}.{ext}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn dequantize_row_matches_gguf_py_bit_for_bit() {
    for dtype in [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ] {
        let name = dtype.name().to_ascii_lowercase();
        let bytes = fixture(&name, "bin");
        let want: Vec<f32> = fixture(&name, "f32")
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let blocks = bytes.len() / dtype.block_bytes();
        assert!(blocks >= 4, "{dtype}: fixture too small");
        assert_eq!(want.len(), blocks * dtype.block_size());
        // The whole fixture as one row, and block by block as rows of their own.
        let mut got = vec![f32::NAN; want.len()];
        dequantize_row(dtype, &bytes, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{dtype} element {i}: {g} vs {w}");
        }
        for b in 0..blocks {
            let mut one = vec![0f32; dtype.block_size()];
            dequantize_row(
                dtype,
                &bytes[b * dtype.block_bytes()..(b + 1) * dtype.block_bytes()],
                &mut one,
            );
            assert_eq!(
                one,
                &want[b * dtype.block_size()..(b + 1) * dtype.block_size()]
            );
        }
    }
}

/// A quantized product gives every activation row the same bits alone (a decode step) as at
/// every place of a batch of 2 to 20 rows (a prompt chunk), on one thread and two, with the
/// instruction set `EMBER_CPU_ISA` picks (CI runs AVX2 and portable too). The weights are
/// the fixture's blocks, nine rows of them in rotated orders.
#[test]
fn a_row_gives_the_same_bits_alone_and_in_any_batch() {
    const ROWS: usize = 20;
    for dtype in [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ] {
        let name = dtype.name().to_ascii_lowercase();
        let bytes = fixture(&name, "bin");
        let blocks: Vec<&[u8]> = bytes.chunks_exact(dtype.block_bytes()).collect();
        let (n, k) = (9, blocks.len() * dtype.block_size());
        // Row `j` is the blocks from `j` on, cyclically.
        let nb = blocks.len();
        let w: Vec<u8> = (0..n * nb)
            .flat_map(|i| blocks[(i % nb + i / nb) % nb])
            .copied()
            .collect();
        let w = MatRef::new(dtype, &w, n, k);
        let mut seed = 7u64;
        let x: Vec<f32> = (0..ROWS * k)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect();
        let row = |i: usize| &x[i * k..(i + 1) * k];
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            let mut scratch = vec![0f32; matmul_scratch_len(threads, ROWS, k)];
            let mut product = |xs: &[f32], m: usize| {
                let mut y = vec![f32::NAN; m * n];
                matmul(&pool, xs, m, &w, &mut y, &mut scratch);
                y.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            let alone: Vec<Vec<u32>> = (0..ROWS).map(|i| product(row(i), 1)).collect();
            for m in 2..=ROWS {
                for start in 0..ROWS {
                    let ids: Vec<usize> = (0..m).map(|j| (start + j) % ROWS).collect();
                    let xs: Vec<f32> = ids.iter().flat_map(|&i| row(i)).copied().collect();
                    let y = product(&xs, m);
                    for (place, &i) in ids.iter().enumerate() {
                        assert_eq!(
                            y[place * n..(place + 1) * n],
                            alone[i],
                            "{dtype}, {threads} threads: row {i} at place {place} of {m}"
                        );
                    }
                }
            }
        }
    }
}
