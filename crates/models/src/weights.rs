//! Weights as views into the mapped checkpoint, or copies the backend owns (repacked into the
//! layout its kernels read best), checked against the shapes the model expects.

use std::sync::Arc;

use ember_checkpoint::{TensorRef, TensorSource};
use ember_tensor::cpu::{MatRef, WeightLayout};
use ember_tensor::quant::dequantize_row;
use ember_tensor::{Buffer, BufferKind, BufferOwner, DType};

use crate::backend::WeightMatrix;
use crate::error::Result;

/// A `rows × cols` weight matrix, read in place from its file (or from a copy: when the file
/// stores it misaligned for its element type, or the backend owns its weights).
pub struct Matrix {
    buffer: Arc<Buffer>,
    offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub layout: WeightLayout,
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
        .with_layout(self.layout)
    }

    /// Rows `start..end` as a matrix of their own (one expert of a stacked tensor), sharing
    /// the storage.
    pub fn slice_rows(&self, start: usize, end: usize) -> Matrix {
        let group = self.layout.row_group();
        assert!(start.is_multiple_of(group) && end.is_multiple_of(group));
        let row_bytes = self.dtype.row_bytes(self.cols);
        Matrix {
            buffer: Arc::clone(&self.buffer),
            offset: self.offset + start * row_bytes,
            rows: end - start,
            ..*self
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        self.rows * self.dtype.row_bytes(self.cols)
    }

    /// One row converted to f32 (an embedding lookup).
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        self.as_mat().dequantize_row(row, out);
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
    /// Copy every matrix into a buffer of its own, in the layout the CPU's kernels read best
    /// ([`WeightLayout::best_for`]), so that the checkpoint's mapping need not stay.
    pub own: bool,
}

impl WeightLoader<'_> {
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.set.get_shaped(name, &[rows, cols])?;
        self.place(&t, rows, cols, WeightLayout::best_for(t.dtype, rows))
    }

    /// A 3-d tensor `[experts, rows, cols]`, as one `experts·rows × cols` matrix (rows after
    /// rows: experts are cut out of it at any row).
    pub fn stacked(&self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.set.get_shaped(name, &[experts, rows, cols])?;
        self.place(&t, experts * rows, cols, WeightLayout::Rows)
    }

    /// The matrix in place, or (when the loader owns its weights) copied in `owned_layout`.
    fn place(
        &self,
        t: &TensorRef<'_>,
        rows: usize,
        cols: usize,
        owned_layout: WeightLayout,
    ) -> Result<Matrix> {
        if self.own {
            let layout = owned_layout;
            let how = match layout {
                WeightLayout::Rows => "copied",
                WeightLayout::Interleaved16 => "interleaved",
            };
            let mut copy = self.owner.alloc(
                BufferKind::Repacked,
                format!("{} ({how})", t.name),
                t.bytes.len(),
            )?;
            layout.write(t.dtype, t.bytes, rows, cols, copy.bytes_mut());
            return Ok(Matrix {
                buffer: Arc::new(copy),
                offset: 0,
                dtype: t.dtype,
                rows,
                cols,
                layout,
            });
        }
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
            layout: WeightLayout::Rows,
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
