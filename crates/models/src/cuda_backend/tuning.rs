//! The batch-invariant products' tiles, timed at load on the model's own matrices
//! ([`ember_tensor::cuda::SlicedGemm::tune`]): every tile gives the same bits, so the plan
//! may follow the device. The built-in plan, swept on one H100, was up to 1.8× off the best
//! tile at 64 tokens on another after two kernel changes.

use std::time::Instant;

use ember_tensor::cuda::DevMat;
use ember_tensor::{BufferKind, DType};
use half::{bf16, f16};

use super::CudaBackend;
use super::products::Gemms;
use super::weights::CudaMatrix;
use crate::backend::{TunedProduct, WeightMatrix};
use crate::error::Result;

/// Bytes of weights a timing reads at least (the layers' matrices in turn, all layers where
/// they hold less): past an H100's 50 MiB of L2 and an H200's 60 twice over, so the weights
/// stream from memory as in a pass, not from L2 (four of qwen3-8b's o, 32 MiB each).
const TIMED_BYTES: usize = 128 << 20;

/// The batches a product is timed at: powers of two below `most_rows`, and `most_rows`.
fn tuning_batches(most_rows: usize) -> Vec<usize> {
    let mut batches: Vec<usize> = std::iter::successors(Some(1usize), |m| m.checked_mul(2))
        .take_while(|&m| m < most_rows)
        .collect();
    batches.push(most_rows);
    batches
}

impl CudaBackend {
    /// [`crate::Backend::tune_products`]: on the batch-invariant road, each 16-bit product
    /// timed at every batch of [`tuning_batches`] up to the rows a pass gives it.
    pub(super) fn tune_invariant_products(
        &mut self,
        products: &[TunedProduct<'_, Self>],
    ) -> Result<()> {
        let Gemms::Invariant(sliced) = &mut self.gemm else {
            return Ok(());
        };
        let started = Instant::now();
        let mut timed = 0;
        for product in products {
            // A product's parts run as one where they lie end to end (q/k/v, gate/up).
            let mut matrices: Vec<CudaMatrix> = Vec::new();
            let mut bytes = 0;
            for parts in &product.layers {
                if bytes >= TIMED_BYTES {
                    break;
                }
                let matrix = match parts[..] {
                    [one] => Some(one.clone()),
                    _ => CudaMatrix::adjacent(parts),
                };
                if let Some(m) = matrix {
                    bytes += m.size_in_bytes();
                    matrices.push(m);
                }
            }
            let Some(first) = matrices.first() else {
                continue;
            };
            let (dtype, n, k) = (first.dtype, first.rows, first.cols);
            if !matches!(dtype, DType::BF16 | DType::F16) {
                continue;
            }
            let most = product.most_rows.min(self.max_batch);
            let batches = tuning_batches(most);
            let mut out = self.owner.alloc_device(
                BufferKind::Scratch,
                "product tuning outputs",
                &self.device,
                most * n * 4,
            )?;
            let mats = matrices
                .iter()
                .map(CudaMatrix::as_mat)
                .collect::<Result<Vec<DevMat<'_>>>>()?;
            let mut y = out.as_mut_slice::<f32>();
            let tuned = if dtype == DType::BF16 {
                let a = self.gemm_input.as_slice::<bf16>().slice(0..most * k);
                sliced.tune(&mats, a, &mut y, &batches)?
            } else {
                let a = self.gemm_input.as_slice::<f16>().slice(0..most * k);
                sliced.tune(&mats, a, &mut y, &batches)?
            };
            timed += 1;
            let choices: Vec<String> = tuned
                .iter()
                .map(|t| {
                    let split = if t.split { " split" } else { "" };
                    format!("≤{} {}{split} {:.1} µs", t.most_rows, t.tile.name(), t.us)
                })
                .collect();
            tracing::info!("batch-invariant tiles for {n}×{k}: {}", choices.join(", "));
        }
        tracing::info!(
            "batch-invariant products: {timed} shapes timed in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_double_up_to_the_most_rows() {
        assert_eq!(tuning_batches(1), [1]);
        assert_eq!(tuning_batches(8), [1, 2, 4, 8]);
        assert_eq!(tuning_batches(100), [1, 2, 4, 8, 16, 32, 64, 100]);
        assert_eq!(tuning_batches(2048).len(), 12);
    }
}
