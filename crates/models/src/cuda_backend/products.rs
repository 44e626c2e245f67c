//! Matrix products on the device. With `batch_invariant` every product of 16-bit weights, a
//! decode row's as a prompt's, runs on the batch-invariant tensor-core kernel
//! ([`cuda::SlicedGemm`]) over a 16-bit copy of its input, so a row's result never depends on
//! its batch. Without (for now the default), decode batches take matrix-vector kernels (the
//! norm and the epilogue inside them where they fuse) and longer ones cuBLASLt. f32 weights
//! always take the matrix-vector kernels, whose sums follow the matrix alone.

use std::ops::Range;

use ember_tensor::DType;
use ember_tensor::cuda::{
    self, DevSliceMut, DeviceBuffer, Epilogue, Float, MatvecNorm, MatvecOutput,
};
use half::{bf16, f16};

use super::CudaBackend;
use super::weights::{CudaMatrix, CudaVector};
use crate::backend::{Projection, Slot, distinct_slots};
use crate::error::Result;

impl CudaBackend {
    /// `dst[offset..][..rows·out] = src[..rows·in] · Wᵀ` (`+=` with `accumulate`), by
    /// matrix-vector kernels for decode and a GEMM for longer batches.
    pub(super) fn project(
        &mut self,
        w: &CudaMatrix,
        src: Slot,
        rows: usize,
        dst: Slot,
        offset: usize,
        accumulate: bool,
    ) -> Result<()> {
        let mat = w.as_mat()?;
        let (n_in, n_out) = (w.cols, w.rows);
        let [s, d] = self
            .slots
            .get_disjoint_mut([src.index(), dst.index()])
            .expect("distinct slots");
        let x = s.as_slice::<f32>().slice(0..rows * n_in);
        let mut y = d.as_mut_slice::<f32>();
        let mut y = y.slice_mut(offset..offset + rows * n_out);
        let (device, gemm, staging) = (&self.device, &mut self.gemm, &mut self.gemm_input);
        product(device, gemm, staging, &mat, x, rows, &mut y, accumulate)
    }

    /// [`crate::Backend::project_logits`]: `logits[..rows] = Normed[..rows] · headᵀ`, the
    /// same roads as [`Self::project`].
    pub(super) fn logits_product(&mut self, head: &CudaMatrix, rows: usize) -> Result<()> {
        let mat = head.as_mat()?;
        let x = self.slots[Slot::Normed.index()]
            .as_slice::<f32>()
            .slice(0..rows * head.cols);
        let mut y = self.logits.as_mut_slice::<f32>();
        let mut y = y.slice_mut(0..rows * head.rows);
        let (device, gemm, staging) = (&self.device, &mut self.gemm, &mut self.gemm_input);
        product(device, gemm, staging, &mat, x, rows, &mut y, false)
    }
}

/// The longest batch whose adjacent f32 products (q, k and v) cuBLASLt runs as one, into
/// [`Gemms::Fast`]'s `together` and then cut into their slots: decode batches, where the
/// small products and their split-K reductions cost most; a prompt chunk runs them apart.
const TOGETHER_MOST_ROWS: usize = 256;

/// The GEMM 16-bit weights take: the batch-invariant kernel (`--batch-invariant`), or
/// cuBLASLt with matrix-vector kernels for decode batches.
pub(super) enum Gemms {
    Invariant(cuda::SlicedGemm),
    Fast {
        gemm: cuda::Gemm,
        /// f32 rows of adjacent products run as one (q, k and v), before they are cut into
        /// their slots: [`TOGETHER_MOST_ROWS`] of the widest such group.
        together: DeviceBuffer,
    },
}

impl Gemms {
    /// `together_width`: the widest group of matrices loaded adjacent with f32 outputs
    /// (q, k and v).
    pub(super) fn new(
        device: &cuda::CudaDevice,
        owner: &ember_tensor::BufferOwner,
        invariant: bool,
        together_width: usize,
    ) -> Result<Gemms> {
        Ok(if invariant {
            Gemms::Invariant(cuda::SlicedGemm::new(device, owner)?)
        } else {
            Gemms::Fast {
                gemm: cuda::Gemm::new(device, owner)?,
                together: owner.alloc_device(
                    ember_tensor::BufferKind::Activations,
                    "adjacent products (f32)",
                    device,
                    TOGETHER_MOST_ROWS * together_width * 4,
                )?,
            }
        })
    }

    pub(super) fn matmul<A: cuda::FloatElem, O: cuda::FloatElem>(
        &mut self,
        a: cuda::DevSlice<'_, A>,
        w: &cuda::DevMat<'_>,
        out: &mut DevSliceMut<'_, O>,
        accumulate: bool,
    ) -> Result<()> {
        match self {
            Gemms::Invariant(g) => g.matmul(a, w, out, accumulate)?,
            Gemms::Fast { gemm, .. } => gemm.matmul(a, w, out, accumulate)?,
        }
        Ok(())
    }

    /// Whether every row's result must not depend on its batch (`--batch-invariant`).
    pub(super) fn is_invariant(&self) -> bool {
        matches!(self, Gemms::Invariant(_))
    }

    /// Whether `rows` rows of `dtype` weights take the matrix-vector kernels: f32 weights
    /// always; 16-bit ones for decode batches on the fast road only.
    pub(super) fn matvec_road(&self, dtype: Float, rows: usize) -> bool {
        dtype == Float::F32 || (!self.is_invariant() && rows <= cuda::MAX_BATCH)
    }
}

/// The first `rows` rows of slots `dsts` (distinct), `widths[i]` values a row, in that order.
fn slot_rows<'a, O: cuda::FloatElem>(
    slots: &'a mut [DeviceBuffer],
    dsts: &[usize],
    widths: &[usize],
    rows: usize,
) -> Vec<DevSliceMut<'a, O>> {
    let mut by_slot: Vec<(usize, DevSliceMut<'a, O>)> = slots
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| dsts.contains(i))
        .map(|(i, slot)| (i, slot.as_mut_slice::<O>()))
        .collect();
    dsts.iter()
        .zip(widths)
        .map(|(dst, &width)| {
            let at = by_slot
                .iter()
                .position(|(i, _)| i == dst)
                .expect("a slot each");
            by_slot.swap_remove(at).1.split_at_mut(rows * width).0
        })
        .collect()
}

/// `y (+)= x · Wᵀ` for `rows` rows of f32 `x`: matrix-vector kernels where [`Gemms`] says,
/// else a GEMM on a copy of `x` in the weights' 16-bit type (`staging`).
#[allow(clippy::too_many_arguments)]
fn product(
    device: &cuda::CudaDevice,
    gemm: &mut Gemms,
    staging: &mut DeviceBuffer,
    mat: &cuda::DevMat<'_>,
    x: cuda::DevSlice<'_, f32>,
    rows: usize,
    y: &mut DevSliceMut<'_, f32>,
    accumulate: bool,
) -> Result<()> {
    if gemm.matvec_road(mat.dtype, rows) {
        return Ok(cuda::matvec(device, mat, x, rows, y, accumulate)?);
    }
    match mat.dtype {
        Float::Bf16 => {
            let mut a = staging.as_mut_slice::<bf16>();
            let mut a = a.slice_mut(0..x.len());
            cuda::convert(device, x, &mut a)?;
            gemm.matmul(a.as_slice(), mat, y, accumulate)?;
        }
        Float::F16 => {
            let mut a = staging.as_mut_slice::<f16>();
            let mut a = a.slice_mut(0..x.len());
            cuda::convert(device, x, &mut a)?;
            gemm.matmul(a.as_slice(), mat, y, accumulate)?;
        }
        Float::F32 => unreachable!("f32 weights take the matrix-vector path"),
    }
    Ok(())
}

impl CudaBackend {
    /// `gemm_input[..rows.len()] = rms_norm(src[rows])` in bf16: a prefill GEMM's input made
    /// by the norm itself.
    pub(super) fn norm_into_gemm_input(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
    ) -> Result<()> {
        let width = norm.0.len() / 4;
        let x = self.slots[src.index()]
            .as_slice::<f32>()
            .slice(rows.start * width..rows.end * width);
        let mut a = self.gemm_input.as_mut_slice::<bf16>();
        let mut a = a.slice_mut(0..rows.len() * width);
        cuda::rms_norm(&self.device, x, norm.slice(), eps, &mut a)?;
        Ok(())
    }

    /// `dst[offset..] (+)= gemm_input[..rows] · Wᵀ` for bf16 weights whose input the caller
    /// left in `gemm_input` as bf16; `dst` holds `O` (f32, or bf16 for gate and up).
    pub(super) fn gemm_from_input<O: cuda::FloatElem>(
        &mut self,
        w: &CudaMatrix,
        rows: usize,
        dst: Slot,
        offset: usize,
        accumulate: bool,
    ) -> Result<()> {
        let mat = w.as_mat()?;
        let a = self.gemm_input.as_slice::<bf16>().slice(0..rows * w.cols);
        let mut y = self.slots[dst.index()].as_mut_slice::<O>();
        let mut y = y.slice_mut(offset..offset + rows * w.rows);
        self.gemm.matmul(a, &mat, &mut y, accumulate)?;
        Ok(())
    }

    /// [`Self::gemm_from_input`] for each `(weight, dst)` of `parts` as one product, where
    /// their weights lie end to end in one buffer (q, k and v; gate and up:
    /// [`CudaBackend::adjacent_matrices`]): on the batch-invariant kernel, which writes each
    /// slot itself and sums a row as it would alone, or for f32 outputs of a decode batch
    /// on cuBLASLt into `together`, then cut into the slots. Returns whether it did.
    pub(super) fn adjacent_gemm_from_input<O: cuda::FloatElem>(
        &mut self,
        rows: usize,
        parts: &[(&CudaMatrix, Slot)],
    ) -> Result<bool> {
        let weights: Vec<&CudaMatrix> = parts.iter().map(|&(w, _)| w).collect();
        let Some(stacked) = CudaMatrix::adjacent(&weights) else {
            return Ok(false);
        };
        let most = cuda::SLICED_MAX_OUTPUTS.min(cuda::SPLIT_MAX_OUTPUTS);
        let Some(dsts) = distinct_slots(parts.iter().map(|&(_, dst)| dst)) else {
            return Ok(false);
        };
        if parts.len() > most {
            return Ok(false);
        }
        let widths: Vec<usize> = weights.iter().map(|w| w.rows).collect();
        let a = self
            .gemm_input
            .as_slice::<bf16>()
            .slice(0..rows * stacked.cols);
        let mat = stacked.as_mat()?;
        match &mut self.gemm {
            Gemms::Invariant(sliced) => {
                let mut outs = slot_rows::<O>(&mut self.slots, &dsts, &widths, rows);
                sliced.matmul_parts(a, &mat, &mut outs, &widths, false)?;
            }
            Gemms::Fast { gemm, together } => {
                let len = rows * stacked.rows;
                if O::FLOAT != Float::F32 || rows > TOGETHER_MOST_ROWS || len * 4 > together.len() {
                    return Ok(false);
                }
                let mut all = together.as_mut_slice::<f32>();
                let mut all = all.slice_mut(0..len);
                gemm.matmul(a, &mat, &mut all, false)?;
                let mut outs = slot_rows::<f32>(&mut self.slots, &dsts, &widths, rows);
                cuda::split_columns(&self.device, all.as_slice(), &mut outs, &widths)?;
            }
        }
        Ok(true)
    }

    /// `dst[r] += bias` for each of `rows` rows of `width`.
    pub(super) fn add_bias(
        &mut self,
        bias: &CudaVector,
        dst: Slot,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let mut y = self.slots[dst.index()].as_mut_slice::<f32>();
        for r in 0..rows {
            let mut row = y.slice_mut(r * width..(r + 1) * width);
            cuda::add(&self.device, &mut row, bias.slice())?;
        }
        Ok(())
    }

    /// Whether [`Self::fused_products`] takes these: the matrix-vector road ([`Gemms`]), and
    /// matrices that can share a launch.
    pub(super) fn fusible(&self, rows: usize, weights: &[&CudaMatrix]) -> bool {
        let first = weights[0];
        let float = match first.dtype {
            DType::F32 => Float::F32,
            DType::BF16 => Float::Bf16,
            DType::F16 => Float::F16,
            _ => return false,
        };
        weights.len() <= cuda::MAX_OUTPUTS
            && self.gemm.matvec_road(float, rows)
            && weights
                .iter()
                .all(|w| w.dtype == first.dtype && w.cols == first.cols)
    }

    /// `dst_i[..] = rms_norm(src[rows]) · W_iᵀ + bias_i` by matrix-vector kernels (the norm
    /// computed inside them), finished by `epilogue`.
    pub(super) fn fused_products(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
        projections: &[Projection<'_, Self>],
        epilogue: Epilogue,
    ) -> Result<()> {
        let width = norm.0.len() / 4;
        let mats = projections
            .iter()
            .map(|p| p.weight.as_mat())
            .collect::<Result<Vec<_>>>()?;
        // Disjoint borrows of the source and each destination slot.
        let mut slots: Vec<Option<&mut DeviceBuffer>> = self.slots.iter_mut().map(Some).collect();
        let x = slots[src.index()].take().expect("a slot").as_slice::<f32>();
        let x = x.slice(rows.start * width..rows.end * width);
        let mut ys: Vec<DevSliceMut<'_, f32>> = projections
            .iter()
            .map(|p| {
                let len = rows.len() * p.weight.rows;
                let buffer = slots[p.dst.index()].take().expect("distinct slots");
                buffer.as_mut_slice::<f32>().split_at_mut(len).0
            })
            .collect();
        let norm = MatvecNorm {
            weight: norm.slice(),
            eps,
        };
        let mut outputs: Vec<MatvecOutput<'_, '_>> = projections
            .iter()
            .zip(&mats)
            .zip(&mut ys)
            .map(|((p, w), y)| MatvecOutput {
                w,
                bias: p.bias.map(|b| b.slice()),
                y: y.reborrow(),
            })
            .collect();
        let batch = rows.len();
        cuda::matvec_fused(&self.device, &mut outputs, x, batch, Some(norm), epilogue)?;
        Ok(())
    }
}
