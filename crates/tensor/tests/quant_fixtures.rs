//! `dequantize_row` against gguf-py's numpy dequantizers, an implementation ember shares no
//! code with. The fixtures come from `scripts/make_quant_fixtures.py`.

use ember_tensor::DType;
use ember_tensor::quant::dequantize_row;

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
