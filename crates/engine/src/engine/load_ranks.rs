//! Loading a model split across ranks (`--tensor-parallel N`): each rank a backend of its own
//! holding its share of the weights ([`Transformer::load_shard`]) and a KV pool of its heads,
//! met in a group's collectives, driven as one runner ([`TensorParallelRunner`]).
//!
//! On the CPU the ranks are threads sharing the host's memory: one buffer owner lists every
//! rank's buffers, and one residency set holds them, bounded by the RAM they share. (GPUs,
//! each with its own memory and bound, come with NCCL.)

use std::sync::Arc;

use ember_checkpoint::TensorSource;
use ember_models::parallel::{ExpertSplit, HostGroup, Shard};
use ember_models::{KvDtype, KvLayout, KvPool, ModelConfig, Transformer};
use ember_tensor::{BufferOwner, ThreadPool, cpu};

use super::EngineOptions;
use super::load::{WeightFiles, cpu_backend};
use super::pool_plan::PoolPlan;
use crate::error::{Error, Result};
use crate::runner::{AbortGroup, ModelRunner, Runner, TensorParallelRunner};

/// What every rank is made for: the same on each.
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
    let experts = match options.expert_parallel {
        true => ExpertSplit::Experts,
        false => ExpertSplit::Columns,
    };
    let shard = |rank| Ok::<_, Error>(Shard::new(rank, ranks)?.with_experts(experts));
    // Shapes that do not split are refused before anything is loaded.
    for rank in 0..ranks {
        config.for_shard(shard(rank)?)?;
    }
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
    let plan = PoolPlan::new(
        options,
        KvLayout::new(&loaded[0].1.config, shapes.kv_dtype),
        shapes.context,
        shapes.parallel,
        owner,
        None,
        ranks,
    );
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
    tracing::info!(
        "tensor parallel: {ranks} ranks of {} threads each; a rank holds {} attention heads, \
         {} of the MLP's {} columns{experts}",
        (threads / ranks).max(1),
        config.num_attention_heads / ranks,
        config.intermediate_size / ranks,
        config.intermediate_size,
    );
    Ok((Box::new(runner), plan, owned))
}
