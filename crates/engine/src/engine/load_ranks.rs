//! Loading a model split across ranks (`--tensor-parallel N`): each rank a backend of its own
//! holding its share of the weights ([`Transformer::load_shard`]) and a KV pool of its heads,
//! met in a group's collectives, driven as one runner ([`TensorParallelRunner`]).
//!
//! On the CPU the ranks are threads sharing the host's memory. On CUDA each rank is a GPU
//! (its thread drives it), meeting the others through NCCL or host memory
//! ([`Collectives`]). Either way one buffer owner lists every rank's buffers and one residency
//! set holds them, each GPU's bounded by its memory (the set counts them apart).

use std::sync::Arc;

use ember_checkpoint::TensorSource;
use ember_models::parallel::{ExpertSplit, HostGroup, Shard};
use ember_models::{
    CudaBackend, CudaCollectives, CudaKvPool, CudaOptions, KV_BLOCK_SIZE, KvDtype, KvLayout,
    KvPool, ModelConfig, NcclRanks, Transformer,
};
use ember_tensor::cuda::{CudaDevice, nccl_version};
use ember_tensor::{BufferOwner, ThreadPool, cpu};

use super::load::{WeightFiles, cpu_backend, warm_up};
use super::pool_plan::PoolPlan;
use super::{Collectives, EngineOptions};
use crate::error::{Error, Result};
use crate::runner::{AbortGroup, ModelRunner, Runner, TensorParallelRunner};

/// What every rank is made for: the same on each.
#[derive(Clone, Copy)]
pub(super) struct RankShapes {
    pub max_batch: usize,
    pub context: usize,
    pub logit_rows: usize,
    pub parallel: usize,
    pub kv_dtype: KvDtype,
}

/// `ranks` CPU ranks of `config` from `weights`, `threads` compute threads shared among
/// them, and the KV pools' plan (each rank's pool is a share of every block).
pub(super) fn load_cpu_ranks(
    config: &ModelConfig,
    weights: &WeightFiles,
    owner: &BufferOwner,
    options: &EngineOptions,
    threads: usize,
    ranks: usize,
    shapes: RankShapes,
) -> Result<(Box<dyn Runner>, PoolPlan, bool)> {
    let experts = expert_split(options);
    let shard = |rank| Ok::<_, Error>(Shard::new(rank, ranks)?.with_experts(experts));
    check_splits(config, ranks, experts)?;
    let source: &dyn TensorSource = weights.source();
    let group = Arc::new(HostGroup::new(ranks));
    let mut loaded = Vec::with_capacity(ranks);
    let mut owned = false;
    for rank in 0..ranks {
        let shard = shard(rank)?;
        // The cores shared out, each rank's pool its own (a pool's threads wait for its
        // rank's work only).
        let pool = Arc::new(ThreadPool::new((threads / ranks).max(1)));
        let (backend, owns) = cpu_backend(
            &config.for_shard(shard)?,
            pool,
            owner,
            [shapes.max_batch, shapes.context, shapes.logit_rows],
            shapes.kv_dtype,
            weights,
        )?;
        owned = owns;
        let backend = backend.join_group(Arc::clone(&group), shard);
        let model =
            Transformer::load_shard(&backend, config, source, shapes.context, shard, owner)?;
        if rank == 0 && !backend.quantized_types().is_empty() {
            tracing::info!("cpu kernels, by timing: {}", cpu::quant_kernel_report());
        }
        loaded.push((backend, model));
    }
    // After every rank's weights: the pools take what room they leave.
    let plan = rank_pools_plan(options, &loaded[0].1.config, shapes, owner, None, ranks);
    let mut runners: Vec<Box<dyn Runner>> = Vec::with_capacity(ranks);
    for (backend, model) in loaded {
        let kv = KvPool::new(plan.layout, plan.blocks, plan.host_blocks, owner)?;
        runners.push(Box::new(ModelRunner {
            backend,
            model,
            kv,
            context: shapes.context,
        }));
    }
    let abort: AbortGroup = Arc::new(move |why: &str| group.abort(why));
    let runner = TensorParallelRunner::new(runners, config.clone(), abort, options.rank_fault)?;
    tracing::info!(
        "tensor parallel: {ranks} ranks of {} threads each; {}",
        (threads / ranks).max(1),
        split_summary(config, ranks, experts)?
    );
    Ok((Box::new(runner), plan, owned))
}

/// The plan of `ranks` pools alike, each of a rank's heads (`rank_config`'s), in the host's
/// memory or `device_memory`.
fn rank_pools_plan(
    options: &EngineOptions,
    rank_config: &ModelConfig,
    shapes: RankShapes,
    owner: &BufferOwner,
    device_memory: Option<u64>,
    ranks: usize,
) -> PoolPlan {
    let layout = KvLayout::new(rank_config, shapes.kv_dtype);
    let (context, parallel) = (shapes.context, shapes.parallel);
    PoolPlan::new(
        options,
        layout,
        context,
        parallel,
        owner,
        device_memory,
        ranks,
    )
}

fn expert_split(options: &EngineOptions) -> ExpertSplit {
    match options.expert_parallel {
        true => ExpertSplit::Experts,
        false => ExpertSplit::Columns,
    }
}

/// Refuses shapes that do not split before anything is loaded.
fn check_splits(config: &ModelConfig, ranks: usize, experts: ExpertSplit) -> Result<()> {
    for rank in 0..ranks {
        config.for_shard(Shard::new(rank, ranks)?.with_experts(experts))?;
    }
    Ok(())
}

/// What a rank holds, for the load line: "a rank holds 4 attention heads, 1536 of the MLP's
/// 6144 columns, every expert's 384 of 768 columns".
fn split_summary(config: &ModelConfig, ranks: usize, experts: ExpertSplit) -> Result<String> {
    let experts = match (&config.moe, experts) {
        (Some(moe), ExpertSplit::Experts) => format!(
            ", {} of the {} experts whole",
            Shard::new(0, ranks)?
                .with_experts(experts)
                .held_experts(moe.num_experts)
                .len(),
            moe.num_experts
        ),
        (Some(moe), ExpertSplit::Columns) => format!(
            ", every expert's {} of {} columns",
            moe.moe_intermediate_size / ranks,
            moe.moe_intermediate_size
        ),
        (None, _) => String::new(),
    };
    Ok(format!(
        "a rank holds {} attention heads, {} of the MLP's {} columns{experts}",
        config.num_attention_heads / ranks,
        config.intermediate_size / ranks,
        config.intermediate_size,
    ))
}

/// The GPUs of a split model's ranks, from `lead` (rank 0's, open) on, and how they meet.
pub(super) struct RankDevices {
    pub devices: Vec<CudaDevice>,
    pub collectives: CudaCollectives,
    /// The memory of the GPUs they take, together (each counted once): the pools' plan
    /// shares it among ranks that are alike.
    pub memory_bytes: u64,
    /// The smallest of those GPUs' memory: the residency set's bound for each.
    pub gpu_memory_bytes: u64,
    /// How they meet, for the load line.
    how: String,
}

impl RankDevices {
    /// Rank `r` on GPU `lead + r`: a GPU each, or, with `--collectives host`, in turn over the
    /// GPUs there are. Fewer GPUs than ranks is refused otherwise, saying so.
    pub(super) fn open(options: &EngineOptions, lead: &CudaDevice, ranks: usize) -> Result<Self> {
        let (first, count) = (lead.ordinal(), lead.info().count);
        let ordinals = rank_ordinals(first, count, ranks, options.collectives)?;
        let nccl = match options.collectives {
            Collectives::Host => None,
            Collectives::Nccl => Some(nccl_version().map_err(|e| {
                Error::TensorParallel(format!(
                    "GPU ranks meet through NCCL: {e} (--collectives host runs without it, \
                     slowly)"
                ))
            })?),
        };
        let mut devices = vec![lead.clone()];
        for &ordinal in &ordinals[1..] {
            let device = CudaDevice::open(ordinal).map_err(Error::Cuda)?;
            // The kernels come from the disk cache rank 0's compiled into.
            device.load_all().map_err(Error::Cuda)?;
            devices.push(device);
        }
        let gpus = devices
            .iter()
            .map(|d| d.ordinal().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        // Taken in turn from `first`: the first `min(ranks, count)` are the distinct ones.
        let memory = |d: &CudaDevice| d.info().memory_bytes as u64;
        let memory_bytes = devices[..ranks.min(count)].iter().map(memory).sum();
        let gpu_memory_bytes = devices.iter().map(memory).min().unwrap_or(0);
        let (collectives, how) = match nccl {
            Some(version) => (
                CudaCollectives::Nccl(Arc::new(NcclRanks::new(&devices)?)),
                format!("on GPUs {gpus} through NCCL {version}"),
            ),
            None => (
                CudaCollectives::Host(Arc::new(HostGroup::new(ranks))),
                format!("on GPUs {gpus} through host memory"),
            ),
        };
        Ok(RankDevices {
            devices,
            collectives,
            memory_bytes,
            gpu_memory_bytes,
            how,
        })
    }
}

/// The GPU of each rank: `first + r` for rank `r`, a GPU each; with host collectives, in turn
/// over the `count` GPUs there are. Fewer GPUs than ranks is refused otherwise, saying so.
fn rank_ordinals(
    first: usize,
    count: usize,
    ranks: usize,
    collectives: Collectives,
) -> Result<Vec<usize>> {
    if first + ranks > count && collectives != Collectives::Host {
        return Err(Error::TensorParallel(format!(
            "--tensor-parallel {ranks} needs {ranks} GPUs from cuda:{first}, and this machine \
             has {count} (--collectives host lets ranks share GPUs, slowly: for checking a \
             split)"
        )));
    }
    Ok((0..ranks).map(|rank| (first + rank) % count).collect())
}

/// A split model's ranks on their GPUs, joined to their collectives, each with a KV pool of
/// its heads, driven as one runner and warmed up; and the pools' plan. What is listed before
/// (a draft model) is counted in the plan.
pub(super) fn load_cuda_ranks(
    config: &ModelConfig,
    source: &dyn TensorSource,
    owner: &BufferOwner,
    options: &EngineOptions,
    gpus: &RankDevices,
    cuda_options: CudaOptions,
    shapes: RankShapes,
) -> Result<(Box<dyn Runner>, PoolPlan)> {
    let ranks = gpus.devices.len();
    let experts = expert_split(options);
    check_splits(config, ranks, experts)?;
    let mut loaded = Vec::with_capacity(ranks);
    for (rank, device) in gpus.devices.iter().enumerate() {
        let shard = Shard::new(rank, ranks)?.with_experts(experts);
        let backend = CudaBackend::new(
            device.clone(),
            &config.for_shard(shard)?,
            owner,
            shapes.max_batch,
            shapes.context.div_ceil(KV_BLOCK_SIZE),
            shapes.parallel,
            cuda_options,
        )?;
        let mut backend = backend.join_group(gpus.collectives.clone(), shard, config)?;
        let model =
            Transformer::load_shard(&backend, config, source, shapes.context, shard, owner)?;
        model.tune_products(&mut backend)?;
        loaded.push((backend, model));
    }
    let plan = rank_pools_plan(
        options,
        &loaded[0].1.config,
        shapes,
        owner,
        Some(gpus.memory_bytes),
        ranks,
    );
    let mut runners: Vec<Box<dyn Runner>> = Vec::with_capacity(ranks);
    for ((backend, model), device) in loaded.into_iter().zip(&gpus.devices) {
        let kv = CudaKvPool::new(device, owner, plan.layout, plan.blocks, plan.host_blocks)?;
        runners.push(Box::new(ModelRunner {
            backend,
            model,
            kv,
            context: shapes.context,
        }));
    }
    let collectives = gpus.collectives.clone();
    let abort: AbortGroup = Arc::new(move |why: &str| collectives.abort(why));
    let mut runner = TensorParallelRunner::new(runners, config.clone(), abort, options.rank_fault)?;
    tracing::info!(
        "tensor parallel: {ranks} ranks {}; {}",
        gpus.how,
        split_summary(config, ranks, experts)?
    );
    warm_up(&mut runner)?;
    Ok((Box::new(runner), plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_a_gpu_each_or_share_them_through_host_memory() {
        assert_eq!(
            rank_ordinals(0, 4, 4, Collectives::Nccl).unwrap(),
            [0, 1, 2, 3]
        );
        assert_eq!(rank_ordinals(2, 4, 2, Collectives::Nccl).unwrap(), [2, 3]);
        let refused = rank_ordinals(1, 2, 2, Collectives::Nccl)
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("needs 2 GPUs from cuda:1, and this machine has 2"),
            "{refused}"
        );
        assert!(refused.contains("--collectives host"), "{refused}");
        assert_eq!(
            rank_ordinals(0, 1, 4, Collectives::Host).unwrap(),
            [0, 0, 0, 0]
        );
        assert_eq!(
            rank_ordinals(1, 2, 3, Collectives::Host).unwrap(),
            [1, 0, 1]
        );
    }
}
