//! Weights as views into the mapped checkpoint, checked against the shapes the model expects.

use std::sync::Arc;

use ember_checkpoint::{TensorRef, TensorSource};
use ember_tensor::cpu::MatRef;
use ember_tensor::quant::dequantize_row;
use ember_tensor::{Buffer, BufferKind, BufferOwner, DType};

use crate::backend::WeightMatrix;
use crate::error::Result;

/// A `rows × cols` weight matrix, read in place from its file (or from a repacked copy when
/// the file stores it misaligned for its element type).
pub struct Matrix {
    buffer: Arc<Buffer>,
    offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl Matrix {
    pub fn as_mat(&self) -> MatRef<'_> {
        let len = self.size_in_bytes();
        MatRef::new(
            self.dtype,
            &self.buffer.bytes()[self.offset..self.offset + len],
            self.rows,
            self.cols,
        )
    }

    /// Rows `start..end` as a matrix of their own (one expert of a stacked tensor).
    /// Rows `start..end`, sharing the storage.
    pub fn slice_rows(&self, start: usize, end: usize) -> Matrix {
        let row_bytes = self.dtype.row_bytes(self.cols);
        Matrix {
            buffer: Arc::clone(&self.buffer),
            offset: self.offset + start * row_bytes,
            dtype: self.dtype,
            rows: end - start,
            cols: self.cols,
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        self.rows * self.dtype.row_bytes(self.cols)
    }

    /// One row converted to f32 (an embedding lookup).
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        let m = self.as_mat();
        let row_bytes = self.dtype.row_bytes(self.cols);
        let bytes = &m.data[row * row_bytes..(row + 1) * row_bytes];
        dequantize_row(self.dtype, bytes, &mut out[..self.cols]);
    }
}

/// A small f32 parameter (norm weight, bias), converted once at load.
pub struct Vector(Buffer);

impl Vector {
    pub fn as_slice(&self) -> &[f32] {
        self.0.as_slice()
    }
}

impl WeightMatrix for Matrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn size_in_bytes(&self) -> usize {
        Matrix::size_in_bytes(self)
    }

    fn slice_rows(&self, start: usize, end: usize) -> Self {
        Matrix::slice_rows(self, start, end)
    }
}

/// Reads tensors out of a checkpoint by name, checking shapes.
pub struct WeightLoader<'a> {
    pub set: &'a dyn TensorSource,
    pub owner: &'a BufferOwner,
}

impl WeightLoader<'_> {
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.set.get_shaped(name, &[rows, cols])?;
        self.place(&t, rows, cols)
    }

    /// A 3-d tensor `[experts, rows, cols]`, as one `experts·rows × cols` matrix.
    pub fn stacked(&self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.set.get_shaped(name, &[experts, rows, cols])?;
        self.place(&t, experts * rows, cols)
    }

    fn place(&self, t: &TensorRef<'_>, rows: usize, cols: usize) -> Result<Matrix> {
        let aligned = (t.bytes.as_ptr() as usize).is_multiple_of(t.dtype.alignment());
        let (buffer, offset) = if aligned {
            (Arc::clone(t.buffer), t.offset)
        } else {
            let copy = self.owner.alloc_copy(
                BufferKind::Repacked,
                format!("{} (realigned)", t.name),
                t.bytes,
            )?;
            (Arc::new(copy), 0)
        };
        Ok(Matrix {
            buffer,
            offset,
            dtype: t.dtype,
            rows,
            cols,
        })
    }

    pub fn vector(&self, name: &str, len: usize) -> Result<Vector> {
        let t = self.set.get_shaped(name, &[len])?;
        let mut buf = self.owner.alloc(BufferKind::Repacked, name, len * 4)?;
        let out = buf.as_mut_slice::<f32>();
        dequantize_row(t.dtype, t.bytes, out);
        Ok(Vector(buf))
    }
}
