//! Mixture-of-experts layers on the device: the experts' address tables, the routing
//! buffers, and the layer itself (routing, the routed pairs' products, their weighted sum).

use std::ops::Range;
use std::sync::Arc;

use ember_tensor::cuda::{
    self, CudaDevice, DevMat, DeviceBuffer, Epilogue, ExpertRoad, ExpertTable, MatvecNorm,
    MatvecOutput, Routes, Routing,
};
use ember_tensor::{BufferKind, BufferOwner};

use super::CudaBackend;
use super::weights::{CudaMatrix, CudaVector};
use crate::backend::{Backend, Slot};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::transformer::{Mlp, Moe};

/// A MoE layer's experts as the device kernels address them: tables of each expert's gate
/// and up (together, for one SwiGLU product) and down matrices.
pub struct CudaExperts {
    gate_up: ExpertTable,
    down: ExpertTable,
    /// The buffers the tables point into, kept alive as long as the tables.
    _weights: Vec<Arc<DeviceBuffer>>,
}

/// A MoE layer's buffers besides the slots, for the longest batch: router logits, the routes
/// (expert, weight, grouping and tiles per routed pair), and each pair's SwiGLU activations
/// and expert output.
pub(super) struct MoeWorkspace {
    router: DeviceBuffer,
    ids: DeviceBuffer,
    weights: DeviceBuffer,
    order: DeviceBuffer,
    tiles: DeviceBuffer,
    act: DeviceBuffer,
    expert_out: DeviceBuffer,
}

impl MoeWorkspace {
    pub(super) fn new(
        device: &CudaDevice,
        owner: &BufferOwner,
        config: &ModelConfig,
        tokens: usize,
    ) -> Result<Option<Self>> {
        let Some(moe) = &config.moe else {
            return Ok(None);
        };
        // Tiles for every expert: a bound for any share of them a rank holds.
        let routing = Routing::new(moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob);
        let pairs = tokens * routing.top_k;
        // One token takes a tile per pair, more take tiles of 8 or 64: the most tiles.
        let tiles = routing
            .tiles_len(1, ExpertRoad::Decode)
            .max(routing.tiles_len(tokens, ExpertRoad::Matvec));
        let alloc = |label: &str, n: usize| {
            owner.alloc_device(BufferKind::Activations, label, device, n * 4)
        };
        Ok(Some(MoeWorkspace {
            router: alloc("moe router logits", tokens * routing.experts)?,
            ids: alloc("moe routed experts", pairs)?,
            weights: alloc("moe routed weights", pairs)?,
            order: alloc("moe pairs by expert", pairs)?,
            tiles: alloc("moe expert tiles", tiles)?,
            act: alloc("moe expert activations", pairs * moe.moe_intermediate_size)?,
            expert_out: alloc("moe expert outputs", pairs * config.hidden_size)?,
        }))
    }
}

/// Where a MoE layer's weighted sum of its experts' outputs goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum MoeSum {
    /// Added to the layer's rows of the residual stream.
    ToResidual,
    /// Added to the first rows of `BlockOut`, zeroed by the caller: a rank's partial sum.
    Partial,
}

impl CudaBackend {
    /// [`crate::Backend::prepare_experts`].
    pub(super) fn experts_from(&self, experts: &[Mlp<Self>]) -> Result<CudaExperts> {
        if experts
            .iter()
            .any(|e| [&e.gate, &e.up, &e.down].iter().any(|l| l.bias.is_some()))
        {
            return Err(Error::Unsupported {
                what: "experts with biases".into(),
                backend: "CUDA",
            });
        }
        let mats = |pick: &dyn Fn(&Mlp<Self>) -> Vec<&CudaMatrix>| {
            experts
                .iter()
                .map(|e| pick(e).into_iter().map(CudaMatrix::as_mat).collect())
                .collect::<Result<Vec<Vec<DevMat<'_>>>>>()
        };
        let gate_up = mats(&|e| vec![&e.gate.weight, &e.up.weight])?;
        let down = mats(&|e| vec![&e.down.weight])?;
        let (device, owner) = (&self.device, &self.owner);
        // SAFETY: the tables point into the experts' buffers, which `_weights` keeps alive for
        // as long as the tables.
        let (gate_up, down) = unsafe {
            (
                ExpertTable::new(device, owner, "moe gate/up table", &gate_up)?,
                ExpertTable::new(device, owner, "moe down table", &down)?,
            )
        };
        let weights = experts
            .iter()
            .flat_map(|e| [&e.gate.weight, &e.up.weight, &e.down.weight])
            .map(|w| Arc::clone(&w.buffer))
            .collect();
        Ok(CudaExperts {
            gate_up,
            down,
            _weights: weights,
        })
    }

    /// Routed on the device: router logits in f32 from the f32 normed rows (normalised inside
    /// the router's and gate/up's products off the tensor cores), top-k and grouping by expert
    /// in one block, each routed pair of the experts held here through its SwiGLU and down
    /// products in one launch each (tensor cores for the prompts of bf16 experts), and the
    /// weighted sum added where `sum` says.
    pub(super) fn moe_layer(
        &mut self,
        moe: &Moe<Self>,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
        sum: MoeSum,
    ) -> Result<()> {
        let (offset, n) = (rows.start, rows.len());
        let experts = &moe.prepared;
        // The router scores every expert; this rank's tables hold `moe.experts` of them.
        let routing = Routing::new(moe.router.rows, moe.top_k, moe.norm_topk_prob)
            .holding(moe.first_expert, moe.experts.len());
        let (hidden, width) = (experts.down.rows(), experts.gate_up.rows());
        let pairs = n * routing.top_k;
        // Prompts of bf16 experts on the tensor cores (their input rounded to bf16, as the
        // prompt GEMMs round theirs); decode and other dtypes in f32 activations. Batch
        // invariance keeps every batch on the matrix-vector kernels, whose pair's sums do not
        // depend on its tile (decode's one-pair tiles included).
        let road = if n == 1 {
            ExpertRoad::Decode
        } else if n > cuda::MAX_BATCH
            && !self.gemm.is_invariant()
            && experts.gate_up.takes_tensor_cores()
            && experts.down.takes_tensor_cores()
        {
            ExpertRoad::TensorCores
        } else {
            ExpertRoad::Matvec
        };
        // The matrix-vector roads normalise inside the router's and gate/up's products, which
        // read the residual stream itself (a launch fewer per decoded layer); the tensor cores
        // take the normalised rows from `Normed`.
        let norm_inside = road != ExpertRoad::TensorCores;
        if !norm_inside {
            self.rms_norm(Slot::Residual, rows.clone(), norm, eps, Slot::Normed)?;
        }
        let norm = norm_inside.then(|| MatvecNorm {
            weight: norm.slice(),
            eps,
        });
        let ws = self
            .moe
            .as_mut()
            .expect("a MoE model's backend has MoE buffers");
        let dev = &self.device;
        let [normed, residual, block_out] = self
            .slots
            .get_disjoint_mut([
                Slot::Normed.index(),
                Slot::Residual.index(),
                Slot::BlockOut.index(),
            ])
            .expect("distinct slots");
        let x = if norm_inside {
            residual
                .as_slice::<f32>()
                .slice(offset * hidden..(offset + n) * hidden)
        } else {
            normed.as_slice::<f32>().slice(0..n * hidden)
        };
        let mut logits = ws.router.as_mut_slice::<f32>();
        let mut logits = logits.slice_mut(0..n * routing.experts);
        let router = MatvecOutput {
            w: &moe.router.as_mat()?,
            bias: None,
            y: logits.reborrow(),
        };
        cuda::matvec_fused(dev, &mut [router], x, n, norm, Epilogue::Store)?;
        let mut routes = Routes {
            ids: ws.ids.as_mut_slice(),
            weights: ws.weights.as_mut_slice(),
            order: ws.order.as_mut_slice(),
            tiles: ws.tiles.as_mut_slice(),
            road,
        };
        cuda::moe_route(dev, logits.as_slice(), n, &routing, &mut routes)?;
        let tiles = routes.tiles(&routing, n);
        let mut act = ws.act.as_mut_slice::<f32>();
        let mut act = act.slice_mut(0..pairs * width);
        let mut expert_out = ws.expert_out.as_mut_slice::<f32>();
        let mut expert_out = expert_out.slice_mut(0..pairs * hidden);
        let top_k = routing.top_k;
        if road == ExpertRoad::TensorCores {
            cuda::experts_mma(dev, &experts.gate_up, tiles, x, top_k, &mut act)?;
            cuda::experts_mma(
                dev,
                &experts.down,
                tiles,
                act.as_slice(),
                1,
                &mut expert_out,
            )?;
        } else {
            cuda::matvec_experts(dev, &experts.gate_up, tiles, x, top_k, norm, &mut act)?;
            cuda::matvec_experts(
                dev,
                &experts.down,
                tiles,
                act.as_slice(),
                1,
                None,
                &mut expert_out,
            )?;
        }
        let weights = routes.weights.as_slice().slice(0..pairs);
        let ids = routes.ids.as_slice().slice(0..pairs);
        let (mut out, out_rows) = match sum {
            MoeSum::ToResidual => (residual.as_mut_slice::<f32>(), offset..offset + n),
            MoeSum::Partial => (block_out.as_mut_slice::<f32>(), 0..n),
        };
        let mut out = out.slice_mut(out_rows.start * hidden..out_rows.end * hidden);
        cuda::moe_combine(
            dev,
            (weights, ids),
            routing.held,
            expert_out.as_slice(),
            routing.top_k,
            &mut out,
            hidden,
        )?;
        Ok(())
    }
}
