//! A matrix of stored weights as the products read it: its type, shape and how its rows lie
//! in memory (plain, or interleaved for the quantized kernels).

use super::quant_dot;
use crate::dtype::DType;
use crate::quant::dequantize_row;

/// A read-only matrix of stored weights, `rows × cols`. A quantized row is `cols /
/// block_size` blocks, consecutive unless `layout` interleaves rows.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub dtype: DType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub layout: WeightLayout,
}

/// How a matrix's rows lie in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightLayout {
    /// Row after row, as checkpoints store them.
    #[default]
    Rows,
    /// Q4_K, Q5_K, Q8_0, Q4_0, Q4_1 or Q6_K rows interleaved sixteen at a time, in as many
    /// bytes (`quant_dot::x16`): what the kernels read fastest with AVX-512 VNNI (and Q8_0,
    /// Q4_0, Q4_1 with AVX2), products of a few activation rows most.
    Interleaved16,
}

impl WeightLayout {
    /// The layout this CPU's kernels read a matrix of `rows` rows of `dtype` best in.
    pub fn best_for(dtype: DType, rows: usize) -> WeightLayout {
        let chosen = quant_dot::interleaves(dtype) && quant_dot::choice(dtype).interleaved;
        if chosen && rows.is_multiple_of(quant_dot::X16) {
            WeightLayout::Interleaved16
        } else {
            WeightLayout::Rows
        }
    }

    /// Rows that stay together: a matrix in this layout is cut only at multiples of it.
    pub fn row_group(self) -> usize {
        match self {
            WeightLayout::Rows => 1,
            WeightLayout::Interleaved16 => quant_dot::X16,
        }
    }

    /// Writes the plain rows `src` of a `rows × cols` matrix of `dtype` in this layout into
    /// `dst` (as long as `src`).
    ///
    /// # Panics
    /// When the layout cannot hold the matrix (see [`WeightLayout::best_for`]) or the lengths
    /// do not match.
    pub fn write(self, dtype: DType, src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
        match self {
            WeightLayout::Rows => dst.copy_from_slice(src),
            WeightLayout::Interleaved16 => {
                assert!(quant_dot::interleaves(dtype), "{dtype} does not interleave");
                quant_dot::interleave(dtype, src, rows, cols, dst);
            }
        }
    }
}

impl<'a> MatRef<'a> {
    /// # Panics
    /// When `data` is not `rows` rows of `dtype.row_bytes(cols)` (which needs `cols` to be a
    /// whole number of blocks), or float data is not aligned to its element.
    pub fn new(dtype: DType, data: &'a [u8], rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * dtype.row_bytes(cols),
            "matrix bytes must match its shape"
        );
        assert_eq!(
            data.as_ptr() as usize % dtype.alignment(),
            0,
            "matrix data must be aligned to its element"
        );
        MatRef {
            dtype,
            data,
            rows,
            cols,
            layout: WeightLayout::Rows,
        }
    }

    /// The same bytes read as `layout` (written by [`WeightLayout::write`]).
    ///
    /// # Panics
    /// When the rows are not whole groups of the layout.
    pub fn with_layout(self, layout: WeightLayout) -> Self {
        assert!(
            self.rows.is_multiple_of(layout.row_group()),
            "a {layout:?} matrix has whole groups of rows"
        );
        MatRef { layout, ..self }
    }

    /// Rows `start..end` as a matrix of their own.
    ///
    /// # Panics
    /// When the layout interleaves rows across `start` or `end`.
    pub fn slice_rows(&self, start: usize, end: usize) -> MatRef<'a> {
        let group = self.layout.row_group();
        assert!(
            start.is_multiple_of(group) && end.is_multiple_of(group),
            "rows {start}..{end} cut a {:?} matrix inside a group",
            self.layout
        );
        let row_bytes = self.dtype.row_bytes(self.cols);
        MatRef {
            data: &self.data[start * row_bytes..end * row_bytes],
            rows: end - start,
            ..*self
        }
    }

    /// Row `row` converted to f32 (an embedding lookup), whatever the layout.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let row_bytes = self.dtype.row_bytes(self.cols);
        let out = &mut out[..self.cols];
        match self.layout {
            WeightLayout::Rows => {
                dequantize_row(self.dtype, &self.data[row * row_bytes..][..row_bytes], out)
            }
            WeightLayout::Interleaved16 => {
                let group = row / quant_dot::X16 * quant_dot::X16;
                let bytes = &self.data[group * row_bytes..][..quant_dot::X16 * row_bytes];
                let mut plain = vec![0u8; row_bytes];
                quant_dot::plain_row(self.dtype, bytes, self.cols, row - group, &mut plain);
                dequantize_row(self.dtype, &plain, out);
            }
        }
    }
}
