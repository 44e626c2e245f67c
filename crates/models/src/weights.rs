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

    /// A 3-d tensor `[experts, rows, cols]`, as one `experts·rows × cols` matrix, experts one
    /// after another: an expert is cut out of it at its first row, so when one expert's rows
    /// suit the interleaved layout, the whole tensor takes it (each expert's rows then fill
    /// whole groups of their own).
    pub fn stacked(&self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.set.get_shaped(name, &[experts, rows, cols])?;
        self.place(
            &t,
            experts * rows,
            cols,
            WeightLayout::best_for(t.dtype, rows),
        )
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use ember_checkpoint::CheckpointError;
    use ember_tensor::ThreadPool;
    use ember_tensor::cpu::{matmul, matmul_scratch_len};

    use super::*;

    /// One tensor held in memory, as a checkpoint would map it.
    struct OneTensor {
        name: &'static str,
        dtype: DType,
        shape: Vec<usize>,
        buffer: Arc<Buffer>,
    }

    impl TensorSource for OneTensor {
        fn get(&self, name: &str) -> ember_checkpoint::Result<TensorRef<'_>> {
            if name != self.name {
                return Err(CheckpointError::MissingTensor {
                    path: "memory".into(),
                    name: name.into(),
                });
            }
            Ok(TensorRef {
                name: self.name,
                dtype: self.dtype,
                shape: &self.shape,
                bytes: self.buffer.bytes(),
                path: Path::new("memory"),
                buffer: &self.buffer,
                offset: 0,
            })
        }

        fn contains(&self, name: &str) -> bool {
            name == self.name
        }
    }

    /// Stacked Q4_K experts in the layout the kernels read best give each expert the bits of
    /// its plain rows read in place, whatever that layout is on this CPU.
    #[test]
    fn each_expert_of_a_stacked_tensor_gives_the_bits_of_its_plain_rows() {
        let (experts, rows, cols, m) = (3, 48, 512, 3);
        let owner = BufferOwner::new();
        let row_bytes = DType::Q4_K.row_bytes(cols);
        let mut bytes = owner
            .alloc(BufferKind::Scratch, "experts", experts * rows * row_bytes)
            .unwrap();
        // Random blocks with finite scales: d and dmin (the first four bytes) small f16s.
        let mut seed = 7u64;
        for (i, b) in bytes.bytes_mut().iter_mut().enumerate() {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let in_block = i % DType::Q4_K.row_bytes(256);
            *b = match in_block {
                1 | 3 => 0x1c,
                _ => (seed >> 56) as u8,
            };
        }
        let source = OneTensor {
            name: "experts",
            dtype: DType::Q4_K,
            shape: vec![experts, rows, cols],
            buffer: Arc::new(bytes),
        };
        let owned = WeightLoader {
            set: &source,
            owner: &owner,
            own: true,
        };
        let in_place = WeightLoader {
            set: &source,
            owner: &owner,
            own: false,
        };
        let stacked = owned.stacked("experts", experts, rows, cols).unwrap();
        let plain = in_place.stacked("experts", experts, rows, cols).unwrap();
        assert_eq!(stacked.layout, WeightLayout::best_for(DType::Q4_K, rows));
        assert_eq!(plain.layout, WeightLayout::Rows);

        let pool = ThreadPool::new(2);
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        for e in 0..experts {
            let run = |w: &Matrix| {
                let (mut y, mut scratch) = (
                    vec![0f32; m * rows],
                    vec![0f32; matmul_scratch_len(2, m, cols)],
                );
                let expert = w.slice_rows(e * rows, (e + 1) * rows);
                matmul(&pool, &x, m, &expert.as_mat(), &mut y, &mut scratch);
                y
            };
            let (got, want) = (run(&stacked), run(&plain));
            assert!(want.iter().all(|v| v.is_finite()));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "expert {e}");
        }
    }
}
