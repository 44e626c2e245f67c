//! Element types of stored weights: plain floats and ggml's block-quantized formats.

use std::fmt;

/// The element types ember reads from checkpoints. Activations are always f32.
///
/// The quantized types store a row as consecutive blocks of [`DType::block_size`] elements,
/// [`DType::block_bytes`] bytes each, laid out exactly as ggml lays them out (see
/// [`crate::quant`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32 elements: f16 `d`, 32 × i8. `x = q·d`.
    Q8_0,
    /// 32 elements: f16 `d`, 16 bytes of nibbles. `x = (q − 8)·d`.
    Q4_0,
    /// 32 elements: f16 `d`, f16 `m`, 16 bytes of nibbles. `x = q·d + m`.
    Q4_1,
    /// 256 elements: f16 `d`, `dmin`, 8 6-bit scales and mins, 4-bit values.
    Q4_K,
    /// 256 elements: as Q4_K with a fifth bit per value.
    Q5_K,
    /// 256 elements: 6-bit values, 16 i8 scales, f16 `d`.
    Q6_K,
}

impl DType {
    /// Every type, floats first.
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ];

    /// Bytes of one element of a float type.
    ///
    /// # Panics
    /// For a quantized type, whose elements have no size of their own: use
    /// [`DType::row_bytes`].
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            _ => panic!("{self} is block-quantized: use row_bytes, not size_in_bytes"),
        }
    }

    /// Elements per block: 1 for float types, 32 or 256 for quantized ones.
    pub fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
            DType::Q4_K | DType::Q5_K | DType::Q6_K => 256,
        }
    }

    /// Bytes per block (per element for float types).
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
        }
    }

    /// Bytes of a row of `cols` elements.
    ///
    /// # Panics
    /// When `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> usize {
        assert!(
            cols.is_multiple_of(self.block_size()),
            "{self} rows hold whole blocks of {} elements, not {cols}",
            self.block_size()
        );
        cols / self.block_size() * self.block_bytes()
    }

    /// The alignment stored data must have for the kernels: the element size for float types,
    /// 1 for quantized types (their kernels read blocks unaligned).
    pub fn alignment(self) -> usize {
        if self.is_quantized() {
            1
        } else {
            self.size_in_bytes()
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// The type with ggml's type id `id` (as stored in GGUF tensor infos), if ember reads it.
    pub fn from_ggml_type(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            8 => DType::Q8_0,
            12 => DType::Q4_K,
            13 => DType::Q5_K,
            14 => DType::Q6_K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// ggml's type id of this type.
    pub fn ggml_type(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::BF16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
        }
    }
}

/// A ggml type id as a person reads it in an error message, e.g. `"Q5_0 (ggml type 6)"`.
pub fn ggml_type_name(id: u32) -> String {
    let name = match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("unknown (ggml type {id})"),
    };
    format!("{name} (ggml type {id})")
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// bf16 bits to f32: the high half of an f32, so a shift is exact.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits, rounding to nearest even (NaN stays NaN).
#[inline(always)]
pub fn f32_to_bf16(value: f32) -> u16 {
    half::bf16::from_f32(value).to_bits()
}

#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 to f16 bits, rounding to nearest even (as ggml's `GGML_FP32_TO_FP16` does on x86).
#[inline(always)]
pub fn f32_to_f16(value: f32) -> u16 {
    half::f16::from_f32(value).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip_and_sizes_match_ggml() {
        for dtype in DType::ALL {
            assert_eq!(DType::from_ggml_type(dtype.ggml_type()), Some(dtype));
            assert_eq!(dtype.is_quantized(), dtype.block_size() > 1);
        }
        // ggml's type_traits: (block size, type size).
        for (dtype, block, bytes) in [
            (DType::Q8_0, 32, 34),
            (DType::Q4_0, 32, 18),
            (DType::Q4_1, 32, 20),
            (DType::Q4_K, 256, 144),
            (DType::Q5_K, 256, 176),
            (DType::Q6_K, 256, 210),
            (DType::BF16, 1, 2),
        ] {
            assert_eq!((dtype.block_size(), dtype.block_bytes()), (block, bytes));
        }
        assert_eq!(DType::Q4_K.row_bytes(4096), 16 * 144);
        assert_eq!(DType::F16.row_bytes(3), 6);
        assert_eq!(DType::from_ggml_type(6), None);
        assert_eq!(ggml_type_name(6), "Q5_0 (ggml type 6)");
        assert_eq!(ggml_type_name(12), "Q4_K (ggml type 12)");
        assert_eq!(ggml_type_name(999), "unknown (ggml type 999)");
    }
}
