//! Loading: the files, the device, the model on its backend, the KV pool and prompt cache, and
//! the residency set that holds it all.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ember_checkpoint::{GgufFile, SafetensorsSet, TensorSource, read_json};
use ember_models::{
    Arithmetic, BlockTable, CpuBackend, CudaBackend, CudaKvPool, CudaOptions, KV_BLOCK_SIZE,
    KvDtype, KvLayout, KvPool, Logits, ModelConfig, Transformer,
};
use ember_residency::{
    Bound, CODE_ID_BASE, MlockBackend, Region, ResidencySet, executable_regions,
};
use ember_tensor::cpu::{self, WeightLayout};
use ember_tensor::cuda::{self, CudaDevice, CudaResidency};
use ember_tensor::{BufferKind, BufferOwner, DType, ThreadPool};
use serde_json::Value;

use super::load_draft::{DraftDevice, DraftTarget, load_draft_model};
use super::load_ranks::{RankDevices, RankShapes, load_cpu_ranks, load_cuda_ranks};
use super::pool_plan::PoolPlan;
use super::{
    DEFAULT_CONTEXT, DEFAULT_PARALLEL_CPU, DEFAULT_PARALLEL_CUDA, DEFAULT_PREFILL_CHUNK_CPU,
    DEFAULT_PREFILL_CHUNK_CUDA, Device, Engine, EngineOptions, KEEPALIVE_SCRATCH_BYTES,
    KeepaliveScratch, PromptEncoder, ResidencyMode,
};
use crate::chat_template::ChatTemplate;
use crate::draft::{DraftKind, DraftOptions};
use crate::error::{Error, Result};
use crate::gguf_tokenizer::tokenizer_from_gguf;
use crate::kv::BlockManager;
use crate::prompt_cache::PromptCacheStats;
use crate::runner::{ModelRunner, Runner};
use crate::tokenizer::Tokenizer;

impl Engine {
    /// Loads a Hugging Face model directory.
    pub fn load(dir: &Path, options: &EngineOptions) -> Result<Engine> {
        Self::load_with_owner(dir, options, BufferOwner::new())
    }

    /// Loads with a given buffer owner (tests inspect its list).
    pub fn load_with_owner(
        dir: &Path,
        options: &EngineOptions,
        owner: BufferOwner,
    ) -> Result<Engine> {
        // A GGUF file (or a directory holding one) carries config, tokenizer and weights
        // together; a Hugging Face directory spreads them over several files.
        let gguf = match gguf_path(dir) {
            Some(path) => Some(GgufFile::open(&path, &owner)?),
            None if dir.is_dir() => None,
            None => return Err(Error::ModelDirMissing(dir.to_path_buf())),
        };
        let (config, tokenizer) = match &gguf {
            Some(file) => (ModelConfig::from_gguf(file)?, tokenizer_from_gguf(file)?),
            None => (ModelConfig::from_dir(dir)?, Tokenizer::from_dir(dir)?),
        };
        let tokenizer = Arc::new(tokenizer);
        let template = match tokenizer.chat_template() {
            Some(source) => {
                let (bos, eos) = (
                    tokenizer.bos_token().map(str::to_owned),
                    tokenizer.eos_token().map(str::to_owned),
                );
                Some(Arc::new(ChatTemplate::new(source, bos, eos)?))
            }
            None => None,
        };
        let eos_ids = match gguf {
            Some(_) => unique(
                config
                    .eos_token_ids
                    .iter()
                    .copied()
                    .chain(tokenizer.eos_token_id()),
            ),
            None => eos_token_ids(dir, &config, &tokenizer)?,
        };
        let sampling_defaults = super::defaults::sampling_defaults(dir, gguf.is_some())?;
        let context = options
            .context
            .unwrap_or(DEFAULT_CONTEXT.min(config.max_position_embeddings))
            .max(1);
        if context > config.max_position_embeddings {
            tracing::warn!(
                context,
                max_position_embeddings = config.max_position_embeddings,
                "the context is longer than the model was trained for; quality may drop past it"
            );
        }
        let threads = options
            .threads
            .unwrap_or_else(ThreadPool::available_parallelism)
            .max(1);
        let weights = match gguf {
            Some(file) => WeightFiles::Gguf(file),
            None => WeightFiles::Safetensors(SafetensorsSet::open(dir, &owner)?),
        };
        let source = weights.source();
        let cuda = choose_device(options, &weights, &config)?;
        let kv_dtype = options
            .kv_dtype
            .unwrap_or_else(|| default_kv_dtype(&weights, &config, cuda.is_some()));
        let default_chunk = match cuda {
            Some(_) => DEFAULT_PREFILL_CHUNK_CUDA,
            None => DEFAULT_PREFILL_CHUNK_CPU,
        };
        // A chunk never needs more rows than the context holds positions.
        let max_batch = options
            .prefill_chunk
            .unwrap_or(default_chunk)
            .clamp(1, context);
        let parallel = match &cuda {
            Some(_) => options.parallel.unwrap_or(DEFAULT_PARALLEL_CUDA),
            None => options.parallel.unwrap_or(DEFAULT_PARALLEL_CPU),
        }
        // A pass holds a row for each sequence in it.
        .clamp(1, max_batch);
        // Verified rows must be the bits of decode steps: the CPU's always are, CUDA's with
        // the batch-invariant kernels only.
        let rows_exact = cuda.is_none() || options.batch_invariant;
        let draft = draft_options(options, rows_exact)?;
        let drafting = draft.kind != DraftKind::None;
        if drafting && !rows_exact {
            return Err(Error::NotOnCuda(
                "speculative decoding (--draft) on CUDA needs --batch-invariant, whose verified \
                 rows are the bits of decode steps",
            ));
        }
        if drafting {
            tracing::info!(
                "drafting (speculative decoding): {:?}, {} to {} tokens a pass",
                draft.kind,
                draft.min,
                draft.max
            );
        }
        // A row of logits for each sequence a pass may sample, and for each token it drafts.
        let logit_rows = match drafting {
            true => (parallel * (1 + draft.max)).min(max_batch),
            false => parallel,
        };
        let mut drafter = draft.source();
        let ranks = options.tensor_parallel.max(1);
        if options.expert_parallel {
            let refused = match (ranks, &config.moe) {
                (1, _) => Some("--expert-parallel shares the experts among ranks: it needs N > 1"),
                (_, None) => Some("--expert-parallel: the model has no experts (it is dense)"),
                _ => None,
            };
            if let Some(why) = refused {
                return Err(Error::TensorParallel(why.into()));
            }
        }
        if let Some(fault) = options.rank_fault.filter(|f| f.rank >= ranks) {
            return Err(Error::TensorParallel(format!(
                "--fail-rank names rank {} of a model split {ranks} way(s)",
                fault.rank
            )));
        }
        // The device the residency set registers staging memory with, and the memory it
        // bounds each GPU's buffers by.
        let mut residency_device = None;
        let shapes = RankShapes {
            max_batch,
            context,
            logit_rows,
            parallel,
            kv_dtype,
        };
        let (runner, keepalive_scratch, weights, plan): (Box<dyn Runner>, _, _, PoolPlan) =
            match cuda {
                None if ranks > 1 => {
                    let (runner, plan, owned) =
                        load_cpu_ranks(&config, &weights, &owner, options, threads, ranks, shapes)?;
                    if let (DraftKind::Model, Some(path)) = (draft.kind, &options.draft_model) {
                        let target = DraftTarget {
                            tokenizer: &tokenizer,
                            config: &config,
                            device: DraftDevice::Cpu(Arc::new(ThreadPool::new(threads))),
                            context,
                            parallel,
                            max_batch,
                        };
                        drafter = Some(Box::new(load_draft_model(path, target, &owner)?));
                    }
                    let scratch = host_keepalive_scratch(&owner)?;
                    (runner, scratch, (!owned).then_some(weights), plan)
                }
                None => {
                    let pool = Arc::new(ThreadPool::new(threads));
                    let (backend, owned) = cpu_backend(
                        &config,
                        Arc::clone(&pool),
                        &owner,
                        [max_batch, context, logit_rows],
                        kv_dtype,
                        &weights,
                    )?;
                    let model = Transformer::load(&backend, config, source, context)?;
                    if !backend.quantized_types().is_empty() {
                        tracing::info!("cpu kernels, by timing: {}", cpu::quant_kernel_report());
                    }
                    // Before the pool's plan, which sizes the cache from what is listed.
                    if let (DraftKind::Model, Some(path)) = (draft.kind, &options.draft_model) {
                        let target = DraftTarget {
                            tokenizer: &tokenizer,
                            config: &model.config,
                            device: DraftDevice::Cpu(pool),
                            context,
                            parallel,
                            max_batch,
                        };
                        drafter = Some(Box::new(load_draft_model(path, target, &owner)?));
                    }
                    let plan = PoolPlan::new(
                        options,
                        KvLayout::new(&model.config, kv_dtype),
                        context,
                        parallel,
                        &owner,
                        None,
                        1,
                    );
                    let kv = KvPool::new(plan.layout, plan.blocks, plan.host_blocks, &owner)?;
                    let scratch = host_keepalive_scratch(&owner)?;
                    let runner = ModelRunner {
                        backend,
                        model,
                        kv,
                        context,
                    };
                    // Owned weights need the file's mapping no more: it goes, and with it
                    // the pages the residency set would otherwise hold twice.
                    (Box::new(runner), scratch, (!owned).then_some(weights), plan)
                }
                Some(device) => {
                    // Every kernel compiled (or read from the disk cache) now, not inside the
                    // first request: a fresh machine's NVRTC pass takes tens of seconds.
                    let started = std::time::Instant::now();
                    device.load_all().map_err(Error::Cuda)?;
                    tracing::info!(
                        "cuda kernels ready in {:.2} s",
                        started.elapsed().as_secs_f64()
                    );
                    let cuda_options = CudaOptions {
                        graphs: options.cuda_graphs,
                        batch_invariant: options.batch_invariant,
                        draft_rows: if drafting { draft.max } else { 0 },
                    };
                    let draft_target = |config| DraftTarget {
                        tokenizer: &tokenizer,
                        config,
                        device: DraftDevice::Cuda {
                            device: device.clone(),
                            graphs: options.cuda_graphs,
                        },
                        context,
                        parallel,
                        max_batch,
                    };
                    let scratch = owner
                        .alloc_device(
                            BufferKind::Scratch,
                            "keepalive scratch",
                            &device,
                            KEEPALIVE_SCRATCH_BYTES,
                        )
                        .map_err(Error::Cuda)?;
                    let scratch =
                        KeepaliveScratch::Device(device.clone(), Arc::new(Mutex::new(scratch)));
                    if ranks > 1 {
                        let gpus = RankDevices::open(options, &device, ranks)?;
                        // The draft model on rank 0's GPU, listed before the pools' plan.
                        if let (DraftKind::Model, Some(path)) = (draft.kind, &options.draft_model) {
                            let target = draft_target(&config);
                            drafter = Some(Box::new(load_draft_model(path, target, &owner)?));
                        }
                        let (runner, plan) = load_cuda_ranks(
                            &config,
                            source,
                            &owner,
                            options,
                            &gpus,
                            cuda_options,
                            shapes,
                        )?;
                        residency_device = Some((device, gpus.gpu_memory_bytes));
                        drop(weights);
                        (runner, scratch, None, plan)
                    } else {
                        let mut backend = CudaBackend::new(
                            device.clone(),
                            &config,
                            &owner,
                            max_batch,
                            context.div_ceil(KV_BLOCK_SIZE),
                            parallel,
                            cuda_options,
                        )?;
                        let model = Transformer::load(&backend, config, source, context)?;
                        // Its outputs' scratch comes and goes before the pool's plan below.
                        model.tune_products(&mut backend)?;
                        // Before the pool's plan, which sizes the cache from the device memory
                        // left.
                        if let (DraftKind::Model, Some(path)) = (draft.kind, &options.draft_model) {
                            let target = draft_target(&model.config);
                            drafter = Some(Box::new(load_draft_model(path, target, &owner)?));
                        }
                        let memory_bytes = device.info().memory_bytes as u64;
                        let plan = PoolPlan::new(
                            options,
                            KvLayout::new(&model.config, kv_dtype),
                            context,
                            parallel,
                            &owner,
                            Some(memory_bytes),
                            1,
                        );
                        let kv = CudaKvPool::new(
                            &device,
                            &owner,
                            plan.layout,
                            plan.blocks,
                            plan.host_blocks,
                        )?;
                        let mut runner = ModelRunner {
                            backend,
                            model,
                            kv,
                            context,
                        };
                        warm_up(&mut runner)?;
                        residency_device = Some((device, memory_bytes));
                        // The weights live on the device now: unmap the files.
                        drop(weights);
                        (Box::new(runner), scratch, None, plan)
                    }
                }
            };
        plan.log();
        let residency =
            establish_residency(&owner, options, residency_device, plan.caching(), parallel)?;
        let encoder = PromptEncoder {
            dir: dir.to_path_buf(),
            tokenizer,
            template,
        };
        Ok(Engine {
            dir: dir.to_path_buf(),
            owner,
            runner,
            blocks: BlockManager::new(plan.blocks, plan.host_blocks, KV_BLOCK_SIZE),
            seq: BlockTable::new(),
            batch: super::batch::Batch::new(parallel, max_batch, draft, drafter),
            cache_enabled: plan.cache_blocks > 0,
            cache_stats: Arc::new(PromptCacheStats::new(
                plan.block_bytes(),
                plan.cache_blocks,
                plan.host_blocks,
            )),
            transfers: Vec::new(),
            kv_dtype,
            encoder,
            eos_ids,
            sampling_defaults,
            residency,
            keepalive_scratch,
            _weights: weights,
        })
    }
}

/// What the keepalive's tick copies on a CPU engine.
fn host_keepalive_scratch(owner: &BufferOwner) -> Result<KeepaliveScratch> {
    let scratch = owner.alloc(
        BufferKind::Scratch,
        "keepalive scratch",
        KEEPALIVE_SCRATCH_BYTES,
    )?;
    Ok(KeepaliveScratch::Host(Arc::new(Mutex::new(scratch))))
}

/// The drafting the options ask for, where a pass's rows are (`rows_exact`) or are not the bits
/// of decode steps: `--draft-model` makes `auto` a draft model's; `--draft model` needs one,
/// and no other kind takes one.
fn draft_options(options: &EngineOptions, rows_exact: bool) -> Result<DraftOptions> {
    let mut draft = options.draft;
    if options.draft_model.is_some() && draft.kind == DraftKind::Auto {
        draft.kind = DraftKind::Model;
    }
    match (draft.kind, &options.draft_model) {
        (DraftKind::Model, None) => Err(Error::DraftOptions(
            "--draft model needs --draft-model DIR|FILE.gguf".into(),
        )),
        (DraftKind::Model, Some(_)) | (_, None) => Ok(draft.on(rows_exact)),
        (kind, Some(path)) => Err(Error::DraftOptions(format!(
            "--draft-model {} is for --draft model (or auto), not --draft {}",
            path.display(),
            kind.name()
        ))),
    }
}

/// Holds every listed buffer and the program's own code in one set, whole or not at all, logs
/// the one load line that says which way it went, and attaches the set to the owner so later
/// buffers join it.
fn establish_residency(
    owner: &BufferOwner,
    options: &EngineOptions,
    cuda: Option<(CudaDevice, u64)>,
    caching: bool,
    parallel: usize,
) -> Result<Arc<ResidencySet>> {
    let (set, report) = match options.residency {
        ResidencyMode::Off => ResidencySet::disabled(),
        ResidencyMode::Auto | ResidencyMode::Required => {
            let mut regions: Vec<(u64, Region)> = owner
                .list()
                .iter()
                .filter(|b| b.bytes > 0)
                .map(|b| (b.id.raw(), b.region()))
                .collect();
            regions.extend(
                executable_regions()
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| (CODE_ID_BASE + i as u64, r)),
            );
            let mut bound = Bound::from_system(options.load_limit_gib);
            // The KV pool is the part an operator sizes most freely: the prompt cache's share,
            // and a context for each parallel sequence.
            let mut flags: Vec<&str> = Vec::new();
            if caching {
                flags.push("--prompt-cache-gib");
            }
            if options.kv_pool_tokens.is_some() {
                flags.push("--kv-pool-tokens");
            } else if parallel > 1 {
                flags.push("--parallel");
            }
            if !flags.is_empty() {
                let flags = format!("{} or --context", flags.join(", "));
                bound = bound
                    .with_advice(format!("lower {flags}, or set --load-limit-gib"))
                    .with_device_advice(format!("lower {flags}"));
            }
            match cuda {
                // Device buffers are resident by nature; the bound keeps later joins (KV
                // growth, caches) inside the GPU's memory. Staging buffers are page-locked
                // with the driver. Each GPU of a split model is bounded apart.
                Some((device, memory_bytes)) => {
                    let bound = bound.with_device_limit(memory_bytes);
                    let backend = Arc::new(CudaResidency::new(device));
                    ResidencySet::establish(backend, bound, regions)
                }
                None => ResidencySet::establish(Arc::new(MlockBackend::new()), bound, regions),
            }
        }
    };
    if options.residency != ResidencyMode::Off {
        report.log();
    }
    if options.residency == ResidencyMode::Required && !report.held {
        return Err(Error::ResidencyRequired(report.line()));
    }
    owner.attach_residency(Arc::clone(&set));
    Ok(set)
}

/// A CPU backend for `config` over `[max_batch, context, logit_rows]`, and whether it copies
/// the weights out of `weights` into its own buffers (the files' mapping then goes).
pub(super) fn cpu_backend(
    config: &ModelConfig,
    pool: Arc<ThreadPool>,
    owner: &BufferOwner,
    [max_batch, context, logit_rows]: [usize; 3],
    kv_dtype: KvDtype,
    weights: &WeightFiles,
) -> Result<(CpuBackend, bool)> {
    // An f16 cache is the GGUF path, checked against llama.cpp: imitate its arithmetic there;
    // elsewhere transformers' (the golden fixtures, and its bf16 cache for bf16 checkpoints).
    let arithmetic = match kv_dtype {
        KvDtype::F16 => Arithmetic::LlamaCpp,
        KvDtype::F32 | KvDtype::Bf16 => Arithmetic::Transformers,
    };
    let backend = CpuBackend::new(
        config, pool, owner, max_batch, context, logit_rows, arithmetic,
    )?;
    let owned = owns_weights(weights);
    let backend = if owned {
        backend.owning_weights()
    } else {
        backend
    };
    Ok((backend, owned))
}

/// Prompt passes of a whole chunk, a quarter of it, and so on down to a few tokens, then a
/// decode step, each forgotten. A CUDA engine's first pass of a size loads the cuBLASLt kernels
/// that size picks (the driver loads kernels lazily, on first use) and its GEMM plans, and the
/// first step records the decode graph: H200, the first 2048-token prompt of qwen3-8b after
/// load took 223 ms against 59 ms for the next, and a 512-token prompt after a warm-up of
/// 2048 alone still paid 14 ms more on qwen3-0.6b. Paid at load, not by the first request.
pub(super) fn warm_up(runner: &mut dyn Runner) -> Result<()> {
    let started = std::time::Instant::now();
    let capacity = runner.context();
    // At load no block is anyone's: the first ones serve, and are forgotten with the table.
    let layout = runner.kv_layout();
    let blocks = layout.blocks_for(capacity).min(runner.kv().blocks());
    let table = || BlockTable::with_blocks((0..blocks as u32).collect(), 0);
    let mut sizes = Vec::new();
    let mut size = runner.max_batch().min(capacity.saturating_sub(1)).max(1);
    loop {
        sizes.push(size);
        let mut seq = table();
        runner.forward(&mut seq, &vec![0; size], Logits::Last)?;
        if size < capacity {
            // Greedy, as most steps are served.
            runner.forward_greedy(&mut seq, &[0])?;
        }
        // Prompts this short take the matrix-vector kernels, no GEMM.
        if size <= cuda::MAX_BATCH {
            break;
        }
        size /= 4;
    }
    tracing::info!(
        "warm-up: prompts of {sizes:?} tokens, each with a step, in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The KV cache's type when the options name none. GGUF models: f16, as llama.cpp keeps it.
/// On CUDA, a bf16 or f16 checkpoint's own type, as transformers and vLLM keep it: half the
/// memory, and decode attention reads half the bytes on the tensor cores (H200, qwen3-8b
/// decode after 2048 tokens 195 -> 200 tok/s, after 8192 172 -> 188). Elsewhere f32, exact
/// against transformers' float32 (the golden fixtures).
pub(super) fn default_kv_dtype(
    weights: &WeightFiles,
    config: &ModelConfig,
    on_cuda: bool,
) -> KvDtype {
    if matches!(weights, WeightFiles::Gguf(_)) {
        return KvDtype::F16;
    }
    match (on_cuda, config.dtype.as_deref()) {
        (true, Some("bfloat16")) => KvDtype::Bf16,
        (true, Some("float16")) => KvDtype::F16,
        _ => KvDtype::F32,
    }
}

/// The CUDA device to run on, or `None` for the CPU; `auto` logs which and why.
fn choose_device(
    options: &EngineOptions,
    weights: &WeightFiles,
    config: &ModelConfig,
) -> Result<Option<CudaDevice>> {
    // What the CUDA backend cannot run yet, said before anything is uploaded.
    let cpu_only = if matches!(weights, WeightFiles::Gguf(_)) {
        Some("GGUF (quantized) models run on the CPU; quantized CUDA kernels come later")
    } else if config.moe.as_ref().is_some_and(|m| {
        m.num_experts > cuda::MAX_EXPERTS || m.num_experts_per_tok > cuda::MAX_TOP_K
    }) {
        Some("CUDA routes at most 1024 experts, and at most 32 per token")
    } else {
        None
    };
    match options.device {
        Device::Cpu => Ok(None),
        Device::Cuda(_) if cpu_only.is_some() => {
            Err(Error::NotOnCuda(cpu_only.unwrap_or_default()))
        }
        Device::Cuda(ordinal) => Ok(Some(CudaDevice::open(ordinal).map_err(Error::Cuda)?)),
        Device::Auto => {
            if let Some(reason) = cpu_only {
                tracing::info!("device: cpu ({reason})");
                return Ok(None);
            }
            match CudaDevice::open(0) {
                Ok(device) => {
                    tracing::info!("device: cuda ({})", device.info());
                    Ok(Some(device))
                }
                Err(e) => {
                    tracing::info!("device: cpu ({e})");
                    Ok(None)
                }
            }
        }
    }
}

/// Whether the CPU backend copies a checkpoint's matrices out of its mapping: a GGUF with
/// matrices of a type this CPU's kernels read interleaved ([`WeightLayout::best_for`]).
/// Copying the rest too lets the mapping go after load, instead of its pages being held
/// beside the interleaved copies.
pub(super) fn owns_weights(weights: &WeightFiles) -> bool {
    let WeightFiles::Gguf(file) = weights else {
        return false;
    };
    let interleaved = |dtype: DType| WeightLayout::best_for(dtype, 16) != WeightLayout::Rows;
    file.tensor_names().any(|name| {
        file.get_gguf(name, name)
            .is_ok_and(|t| interleaved(t.dtype))
    })
}

/// The checkpoint files a model was loaded from.
pub(super) enum WeightFiles {
    Safetensors(SafetensorsSet),
    Gguf(GgufFile),
}

impl WeightFiles {
    pub(super) fn source(&self) -> &dyn TensorSource {
        match self {
            WeightFiles::Safetensors(set) => set,
            WeightFiles::Gguf(file) => file,
        }
    }
}

/// The GGUF file `path` names: the file itself, or the only `.gguf` in a directory that has no
/// `config.json`.
pub(super) fn gguf_path(path: &Path) -> Option<PathBuf> {
    let is_gguf = |p: &Path| {
        p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    };
    if path.is_file() {
        return is_gguf(path).then(|| path.to_path_buf());
    }
    if !path.is_dir() || path.join("config.json").exists() {
        return None;
    }
    let mut found = std::fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| is_gguf(p));
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

fn unique(ids: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut out = Vec::new();
    for id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

/// End-of-sequence ids: generation_config.json's (an int or a list), config.json's, and the
/// tokenizer's eos token, together (as vLLM does; checkpoints disagree among these files).
fn eos_token_ids(dir: &Path, config: &ModelConfig, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    let generation_config = dir.join("generation_config.json");
    if generation_config.exists() {
        let value: Value = read_json(&generation_config)?;
        ids.extend(ember_models::config::token_ids(value.get("eos_token_id")));
    }
    ids.extend(&config.eos_token_ids);
    ids.extend(tokenizer.eos_token_id());
    Ok(unique(ids))
}
