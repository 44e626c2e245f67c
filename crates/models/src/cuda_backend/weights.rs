//! Weights in device memory: matrices in their checkpoint dtype, f32 vectors, rope tables.

use std::ops::Range;
use std::sync::Arc;

use ember_tensor::cuda::{DevMat, DevSlice, DeviceBuffer};
use ember_tensor::{BufferKind, DType};

use super::CudaBackend;
use crate::backend::WeightMatrix;
use crate::error::{Error, Result};

/// Weights on the device, in their stored dtype (a view of a shared buffer: clones are views
/// of the same bytes).
#[derive(Clone)]
pub struct CudaMatrix {
    pub(super) buffer: Arc<DeviceBuffer>,
    /// Byte offset of row 0 in `buffer`.
    pub(super) offset: usize,
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl CudaMatrix {
    pub(super) fn bytes(&self) -> Range<usize> {
        self.offset..self.offset + self.size_in_bytes()
    }

    pub(super) fn as_mat(&self) -> Result<DevMat<'_>> {
        let data = self.buffer.as_slice::<u8>().slice(self.bytes());
        Ok(DevMat::new(self.dtype, data, self.rows, self.cols)?)
    }
}

impl CudaMatrix {
    /// `matrices` as one: views of one buffer, their rows end to end in this order, of one
    /// dtype and width ([`CudaBackend::adjacent_matrices`]); `None` where they are not.
    pub(super) fn adjacent(matrices: &[&CudaMatrix]) -> Option<CudaMatrix> {
        let first = matrices.first()?;
        let mut end = first.offset;
        for m in matrices {
            let together = Arc::ptr_eq(&m.buffer, &first.buffer)
                && m.offset == end
                && m.dtype == first.dtype
                && m.cols == first.cols;
            if !together {
                return None;
            }
            end += m.size_in_bytes();
        }
        Some(CudaMatrix {
            buffer: Arc::clone(&first.buffer),
            offset: first.offset,
            dtype: first.dtype,
            rows: matrices.iter().map(|m| m.rows).sum(),
            cols: first.cols,
        })
    }
}

impl WeightMatrix for CudaMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn size_in_bytes(&self) -> usize {
        self.rows * self.dtype.row_bytes(self.cols)
    }

    fn slice_rows(&self, start: usize, end: usize) -> Self {
        CudaMatrix {
            buffer: Arc::clone(&self.buffer),
            offset: self.offset + start * self.dtype.row_bytes(self.cols),
            dtype: self.dtype,
            rows: end - start,
            cols: self.cols,
        }
    }
}

/// An f32 vector on the device.
pub struct CudaVector(pub(super) DeviceBuffer);

impl CudaVector {
    pub(super) fn slice(&self) -> DevSlice<'_, f32> {
        self.0.as_slice()
    }
}

/// Rotary tables on the device, `[positions, head_dim / 2]`.
pub struct CudaRope {
    pub(super) cos: DeviceBuffer,
    pub(super) sin: DeviceBuffer,
}

impl CudaBackend {
    pub(super) fn upload(
        &self,
        name: &str,
        kind: BufferKind,
        bytes: &[u8],
    ) -> Result<DeviceBuffer> {
        let mut buffer = self
            .owner
            .alloc_device(kind, name, &self.device, bytes.len())?;
        buffer.upload(bytes)?;
        Ok(buffer)
    }

    pub(super) fn matrix_from(
        &self,
        name: &str,
        dtype: DType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<CudaMatrix> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Unsupported {
                what: format!("{name}: {dtype} weights"),
                backend: "CUDA",
            });
        }
        let buffer = self.upload(name, BufferKind::Weights, bytes)?;
        Ok(CudaMatrix {
            buffer: Arc::new(buffer),
            offset: 0,
            dtype,
            rows,
            cols,
        })
    }

    /// Matrices of one 16-bit `dtype` and `cols` columns, `parts[i]` holding `rows[i]` rows,
    /// their rows end to end in one buffer: each a view of it ([`CudaMatrix::adjacent`] finds
    /// them together again).
    pub(super) fn adjacent_matrices(
        &self,
        name: &str,
        dtype: DType,
        parts: &[&[u8]],
        rows: &[usize],
        cols: usize,
    ) -> Result<Vec<CudaMatrix>> {
        let total = parts.iter().map(|p| p.len()).sum();
        let mut buffer = self
            .owner
            .alloc_device(BufferKind::Weights, name, &self.device, total)?;
        let mut offset = 0;
        let mut matrices = Vec::with_capacity(parts.len());
        for (bytes, &rows) in parts.iter().zip(rows) {
            let mut all = buffer.as_mut_slice::<u8>();
            let mut dst = all.slice_mut(offset..offset + bytes.len());
            self.device.upload(&mut dst, bytes)?;
            matrices.push((offset, rows));
            offset += bytes.len();
        }
        let buffer = Arc::new(buffer);
        Ok(matrices
            .into_iter()
            .map(|(offset, rows)| CudaMatrix {
                buffer: Arc::clone(&buffer),
                offset,
                dtype,
                rows,
                cols,
            })
            .collect())
    }
}
