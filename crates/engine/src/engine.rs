//! A loaded model ready to generate: weights, tokenizer, template, KV cache and activations.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ember_checkpoint::{GgufFile, SafetensorsSet, TensorSource, read_json};
use ember_models::{
    Arithmetic, BlockTable, CpuBackend, CudaBackend, CudaKvPool, KV_BLOCK_SIZE, KvDtype, KvLayout,
    KvPool, Logits, ModelConfig, PassInput, Transformer,
};
use ember_residency::{
    Bound, CODE_ID_BASE, MlockBackend, Region, ResidencySet, executable_regions,
};
use ember_tensor::cuda::{self, CudaDevice, CudaResidency, DeviceBuffer};
use ember_tensor::{Buffer, BufferInfo, BufferKind, BufferOwner, ThreadPool};
use serde_json::Value;

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{Error, Result};
use crate::gguf_tokenizer::tokenizer_from_gguf;
use crate::kv::{BlockManager, Transfer};
use crate::prompt_cache::{
    CacheBudget, DEFAULT_CACHE_GIB_CPU, DEFAULT_CACHE_GIB_GPU, DEFAULT_HOST_TIER_GIB_GPU,
    PromptCacheStats, budget_blocks,
};
use crate::runner::{ModelRunner, Runner};
use crate::sampler::{Sampler, SamplingParams};
use crate::tokenizer::Tokenizer;

/// The context when none is asked for: enough for real chats, without preallocating a model's
/// whole trained length (often 32k-128k positions, gigabytes of KV cache).
pub const DEFAULT_CONTEXT: usize = 4096;

/// Prompt tokens a forward pass takes by default on the CPU (llama.cpp's ubatch).
pub const DEFAULT_PREFILL_CHUNK_CPU: usize = 512;
/// On CUDA: longer chunks keep cuBLASLt's GEMMs busier (H200, qwen3-8b, a 2048-token prompt:
/// 34.7k tok/s in chunks of 512, 39.4k in one of 2048), for activation buffers of a few
/// hundred MB of device memory.
pub const DEFAULT_PREFILL_CHUNK_CUDA: usize = 2048;

/// The keepalive scratch: a source and a destination of 16 bytes.
const KEEPALIVE_SCRATCH_BYTES: usize = 32;

/// How to load a model.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Compute threads, the calling thread included; `None` means every core this process may use.
    pub threads: Option<usize>,
    /// Positions of KV cache preallocated: the longest prompt plus reply. `None` takes the
    /// model's trained length, capped at [`DEFAULT_CONTEXT`].
    pub context: Option<usize>,
    /// Tokens per forward pass in prefill; longer prompts run in chunks of this size. `None`
    /// takes [`DEFAULT_PREFILL_CHUNK_CPU`] or [`DEFAULT_PREFILL_CHUNK_CUDA`].
    pub prefill_chunk: Option<usize>,
    /// How the KV cache stores keys and values; `None` takes f16 for GGUF models (as
    /// llama.cpp does), a 16-bit checkpoint's own type on CUDA, and f32 otherwise (exact
    /// against transformers' float32): see `default_kv_dtype`.
    pub kv_dtype: Option<KvDtype>,
    /// Whether to hold every engine buffer (and the program's code) resident between requests.
    pub residency: ResidencyMode,
    /// Replaces the 70% of RAM that bounds the residency set (the 2 GiB margin stays).
    pub load_limit_gib: Option<f64>,
    /// Where the model runs.
    pub device: Device,
    /// On CUDA, record decode steps as graphs and replay them (off: op by op, same results).
    pub cuda_graphs: bool,
    /// The prompt cache's share of the KV pool (`--prompt-cache-gib`): finished requests'
    /// blocks stay, and a request whose prompt starts with a cached prefix prefills only the
    /// rest.
    pub prompt_cache: CacheBudget,
    /// Host memory for blocks evicted from the pool (`--prompt-cache-host-gib`): on a GPU,
    /// pinned memory they come back from by copy. The CPU takes it only when asked.
    pub prompt_cache_host: CacheBudget,
}

/// Where the model runs (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA device N.
    Cuda(usize),
    /// The first CUDA device when one is usable and the model's weights can run there, else
    /// the CPU; the log says which and why.
    Auto,
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "auto" => Ok(Device::Auto),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("{s:?}: expected auto, cpu, cuda or cuda:N")),
        }
    }
}

/// What to do about holding memory resident.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ResidencyMode {
    /// No set (the library's default, so tests measure plain memory).
    #[default]
    Off,
    /// Hold the whole set if it fits and the OS allows; otherwise run without, saying why.
    Auto,
    /// Refuse to load without a whole set.
    Required,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: None,
            context: None,
            prefill_chunk: None,
            kv_dtype: None,
            residency: ResidencyMode::Off,
            load_limit_gib: None,
            device: Device::Cpu,
            cuda_graphs: true,
            prompt_cache: CacheBudget::Off,
            prompt_cache_host: CacheBudget::Off,
        }
    }
}

/// One generation request.
#[derive(Clone, Copy, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep going past end-of-sequence tokens until `max_tokens`.
    pub ignore_eos: bool,
    /// Hand each step's logits to the caller ([`Step::logits`]; for log-probabilities). Off,
    /// a greedy generation on a GPU picks each token on the device and brings back only it.
    pub step_logits: bool,
    /// Take the longest cached prefix of the prompt and keep this request's blocks when it
    /// ends (llama.cpp's `cache_prompt`); off, the request neither reads nor feeds the cache.
    pub cache_prompt: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, or the caller asked to stop.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
}

/// What one generated token looked like, handed to the caller as it is produced.
pub struct Step<'a> {
    pub token: u32,
    /// The logits it was sampled from; `None` when they stayed where they were made (a
    /// greedy generation without [`GenerateParams::step_logits`]).
    pub logits: Option<&'a [f32]>,
    /// Whether it ends the sequence (it is still reported; callers usually do not print it).
    pub is_eos: bool,
    /// Prompt tokens of this request that came from the prompt cache (the same every step):
    /// a server reports them before the first token is out.
    pub cached_tokens: usize,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prompt cache, not a prefill.
    pub cached_tokens: usize,
    /// Prompt processing up to the first token.
    pub prefill_time: Duration,
    /// From the first token to the last.
    pub decode_time: Duration,
}

/// Turns prompts and chats into token ids; cheap to clone and usable from any thread, so a
/// server can validate requests while the engine generates.
#[derive(Clone)]
pub struct PromptEncoder {
    dir: PathBuf,
    tokenizer: Arc<Tokenizer>,
    template: Option<Arc<ChatTemplate>>,
}

impl PromptEncoder {
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.tokenizer.chat_template()
    }

    /// Tokens of a raw prompt, with the tokenizer's own special tokens (a BOS, for Llama).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(text, true)?)
    }

    /// Renders messages with the model's chat template and tokenizes the result as is.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, kwargs)?;
        Ok(self.tokenizer.encode(&text, false)?)
    }

    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| Error::NoChatTemplate(self.dir.clone()))?;
        Ok(template.render(messages, true, kwargs)?)
    }
}

pub struct Engine {
    dir: PathBuf,
    owner: BufferOwner,
    /// The model on its backend, with its KV pool.
    runner: Box<dyn Runner>,
    /// Which of the pool's blocks the sequence and the prompt cache hold.
    blocks: BlockManager,
    /// The sequence the low-level calls ([`Self::prefill`], [`Self::step`]) extend.
    seq: BlockTable,
    /// Whether the prompt cache has any room (`--prompt-cache-gib` above 0).
    cache_enabled: bool,
    cache_stats: Arc<PromptCacheStats>,
    /// Copies between the pool and its host tier, made by the block manager, run before the
    /// next pass (kept, so that no request allocates for them).
    transfers: Vec<Transfer>,
    kv_dtype: KvDtype,
    encoder: PromptEncoder,
    eos_ids: Vec<u32>,
    /// Holds the buffers resident between requests (inactive when off or refused).
    residency: Arc<ResidencySet>,
    /// Where the keepalive tick does its 16-byte copy; a member of the set like any buffer.
    keepalive_scratch: KeepaliveScratch,
    /// Keeps the mapped files listed for as long as the weights are read from them (the CPU;
    /// a GPU has its own copy, and the files are unmapped after load).
    _weights: Option<WeightFiles>,
}

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
        let cuda = choose_device(options.device, &weights, &config)?;
        let kv_dtype = options
            .kv_dtype
            .unwrap_or_else(|| default_kv_dtype(&weights, &config, cuda.is_some()));
        let residency_device = cuda.clone();
        let default_chunk = match cuda {
            Some(_) => DEFAULT_PREFILL_CHUNK_CUDA,
            None => DEFAULT_PREFILL_CHUNK_CPU,
        };
        // A chunk never needs more rows than the context holds positions.
        let max_batch = options
            .prefill_chunk
            .unwrap_or(default_chunk)
            .clamp(1, context);
        let (runner, keepalive_scratch, weights, plan): (Box<dyn Runner>, _, _, PoolPlan) =
            match cuda {
                None => {
                    let pool = ThreadPool::new(threads);
                    // An f16 cache is the GGUF path, checked against llama.cpp: imitate its
                    // arithmetic there; elsewhere transformers' (the golden fixtures, and its bf16
                    // cache for bf16 checkpoints).
                    let arithmetic = match kv_dtype {
                        KvDtype::F16 => Arithmetic::LlamaCpp,
                        KvDtype::F32 | KvDtype::Bf16 => Arithmetic::Transformers,
                    };
                    let backend =
                        CpuBackend::new(&config, pool, &owner, max_batch, context, 1, arithmetic)?;
                    let model = Transformer::load(&backend, config, source, context)?;
                    let plan =
                        PoolPlan::new(options, &model.config, kv_dtype, context, &owner, None);
                    let kv = KvPool::new(plan.layout, plan.blocks, plan.host_blocks, &owner)?;
                    let scratch = owner.alloc(
                        BufferKind::Scratch,
                        "keepalive scratch",
                        KEEPALIVE_SCRATCH_BYTES,
                    )?;
                    let runner = ModelRunner {
                        backend,
                        model,
                        kv,
                        context,
                    };
                    let scratch = KeepaliveScratch::Host(Arc::new(Mutex::new(scratch)));
                    (Box::new(runner), scratch, Some(weights), plan)
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
                    let backend = CudaBackend::new(
                        device.clone(),
                        &config,
                        &owner,
                        max_batch,
                        context.div_ceil(KV_BLOCK_SIZE),
                        1,
                        options.cuda_graphs,
                    )?;
                    let model = Transformer::load(&backend, config, source, context)?;
                    let plan = PoolPlan::new(
                        options,
                        &model.config,
                        kv_dtype,
                        context,
                        &owner,
                        Some(&device),
                    );
                    let kv = CudaKvPool::new(
                        &device,
                        &owner,
                        plan.layout,
                        plan.blocks,
                        plan.host_blocks,
                    )?;
                    let scratch = owner
                        .alloc_device(
                            BufferKind::Scratch,
                            "keepalive scratch",
                            &device,
                            KEEPALIVE_SCRATCH_BYTES,
                        )
                        .map_err(Error::Cuda)?;
                    let mut runner = ModelRunner {
                        backend,
                        model,
                        kv,
                        context,
                    };
                    warm_up(&mut runner)?;
                    let scratch = KeepaliveScratch::Device(device, Arc::new(Mutex::new(scratch)));
                    // The weights live on the device now: unmap the files.
                    drop(weights);
                    (Box::new(runner), scratch, None, plan)
                }
            };
        plan.log();
        let residency = establish_residency(&owner, options, residency_device, plan.caching())?;
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
            cache_enabled: plan.cache_blocks > 0,
            cache_stats: Arc::new(PromptCacheStats::new(
                plan.layout.block_bytes(),
                plan.cache_blocks,
                plan.host_blocks,
            )),
            transfers: Vec::new(),
            kv_dtype,
            encoder,
            eos_ids,
            residency,
            keepalive_scratch,
            _weights: weights,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &ModelConfig {
        self.runner.config()
    }

    /// Weight bytes one decoded token reads.
    pub fn weight_bytes_per_token(&self) -> usize {
        self.runner.weight_bytes_per_token()
    }

    /// What runs the model: "cpu (avx512, 2 threads)", "cuda (NVIDIA H200 …)".
    pub fn device_label(&self) -> String {
        self.runner.device_label()
    }

    /// The memory bandwidth that bounds decode on this engine's device, in GB/s.
    pub fn measure_bandwidth(&self, bytes: usize, passes: usize) -> Result<f64> {
        self.runner.measure_bandwidth(&self.owner, bytes, passes)
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.encoder.tokenizer
    }

    /// A handle that tokenizes prompts and chats for this model, usable from other threads.
    pub fn encoder(&self) -> &PromptEncoder {
        &self.encoder
    }

    /// Compute threads (CPU), or 1 on a GPU.
    pub fn threads(&self) -> usize {
        self.runner.threads()
    }

    pub fn owner(&self) -> &BufferOwner {
        &self.owner
    }

    /// Every buffer the engine holds.
    pub fn buffers(&self) -> Vec<BufferInfo> {
        self.owner.list()
    }

    /// Positions a sequence may hold: the longest prompt plus reply.
    pub fn context(&self) -> usize {
        self.runner.context()
    }

    /// The prompt cache's figures, shared: `/metrics` and `/health` read them while requests
    /// run.
    pub fn prompt_cache_stats(&self) -> Arc<PromptCacheStats> {
        Arc::clone(&self.cache_stats)
    }

    /// Whether requests may take cached prefixes (`--prompt-cache-gib` above 0).
    pub fn prompt_cache_enabled(&self) -> bool {
        self.cache_enabled
    }

    /// Drops every cached prefix not in use.
    pub fn clear_prompt_cache(&mut self) {
        self.blocks.clear_cache();
        self.publish_cache_stats();
    }

    /// The residency set over the engine's buffers.
    pub fn residency(&self) -> &Arc<ResidencySet> {
        &self.residency
    }

    /// The keepalive's tick: a real 16-byte copy inside a scratch buffer that the residency set
    /// holds, so each idle tick touches held memory (on a GPU, it is work the device must run).
    /// Runs on the keepalive thread, never during a request.
    pub fn keepalive_tick(&self) -> Box<dyn Fn() + Send + Sync + 'static> {
        match &self.keepalive_scratch {
            KeepaliveScratch::Host(scratch) => {
                let scratch = Arc::clone(scratch);
                Box::new(move || {
                    let mut buffer = scratch.lock().unwrap_or_else(|p| p.into_inner());
                    let bytes = buffer.bytes_mut();
                    // A counter in the first 16 bytes makes every copy move new data.
                    let (src, dst) = bytes.split_at_mut(16);
                    let count = u64::from_le_bytes(src[..8].try_into().expect("8 bytes")) + 1;
                    src[..8].copy_from_slice(&count.to_le_bytes());
                    dst[..16].copy_from_slice(src);
                    std::hint::black_box(&dst[..16]);
                })
            }
            KeepaliveScratch::Device(device, scratch) => {
                let (device, scratch) = (device.clone(), Arc::clone(scratch));
                Box::new(move || {
                    let mut buffer = scratch.lock().unwrap_or_else(|p| p.into_inner());
                    let bytes = buffer.as_mut_slice::<u8>();
                    let (src, mut dst) = bytes.split_at_mut(16);
                    // On the engine's stream, waited for: the tick is work the GPU really ran.
                    let copied = device
                        .copy(src.as_slice(), &mut dst.slice_mut(0..16))
                        .and_then(|()| device.synchronize());
                    if let Err(e) = copied {
                        tracing::warn!("keepalive tick on the GPU failed: {e}");
                    }
                })
            }
        }
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn has_chat_template(&self) -> bool {
        self.encoder.has_chat_template()
    }

    /// See [`PromptEncoder::encode_prompt`].
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.encoder.encode_prompt(text)
    }

    /// See [`PromptEncoder::encode_chat`].
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<Vec<u32>> {
        self.encoder.encode_chat(messages, kwargs)
    }

    /// See [`PromptEncoder::render_chat`].
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        self.encoder.render_chat(messages, kwargs)
    }

    /// Prompt tokens one forward pass takes (`EngineOptions::prefill_chunk`).
    pub fn prefill_chunk(&self) -> usize {
        self.runner.max_batch()
    }

    /// Forgets the sequence: the next prefill starts at position 0. Its blocks go back to the
    /// pool, not to the prompt cache.
    pub fn reset(&mut self) {
        let mut seq = std::mem::take(&mut self.seq);
        self.blocks.finish(&mut seq, &[], false);
        self.seq = seq;
    }

    /// Positions of the current sequence.
    pub fn position(&self) -> usize {
        self.seq.len()
    }

    /// Gives the sequence blocks for `n` more positions (evicting cached prefixes if it must)
    /// and runs the copies that makes between the pool and its host tier.
    fn reserve(&mut self, n: usize) -> Result<()> {
        let positions = self.seq.len() + n;
        if positions > self.context() {
            return Err(Error::Model(ember_models::Error::ContextFull {
                used: self.seq.len(),
                requested: n,
                capacity: self.context(),
            }));
        }
        self.blocks
            .reserve(&mut self.seq, positions, &mut self.transfers)?;
        self.run_transfers()
    }

    /// Enqueues the block manager's copies, in order, ahead of the next pass.
    fn run_transfers(&mut self) -> Result<()> {
        let kv = self.runner.kv();
        for transfer in self.transfers.drain(..) {
            match transfer {
                Transfer::ToHost { block, slot } => kv.save_to_host(block, slot)?,
                Transfer::FromHost { slot, block } => kv.load_from_host(slot, block)?,
            }
        }
        Ok(())
    }

    fn forward(&mut self, tokens: &[u32], logits: Logits) -> Result<&[f32]> {
        self.reserve(tokens.len())?;
        self.runner.forward(&mut self.seq, tokens, logits)
    }

    fn forward_greedy(&mut self, tokens: &[u32]) -> Result<u32> {
        self.reserve(tokens.len())?;
        self.runner.forward_greedy(&mut self.seq, tokens)
    }

    fn forward_ahead(&mut self, input: PassInput<'_>) -> Result<()> {
        let n = match input {
            PassInput::Tokens(tokens) => tokens.len(),
            PassInput::Fed => 1,
        };
        self.reserve(n)?;
        self.runner.forward_ahead(&mut self.seq, input)
    }

    /// Appends `tokens` to the sequence, in chunks of the batch size, and returns the logits
    /// after the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        let last = self.prefill_all_but_the_last_chunk(tokens, &|| false)?;
        self.forward(last, Logits::Last)
    }

    /// [`Self::prefill`], returning the greedy choice after the last token (the index of the
    /// largest logit, by `ember_tensor::cpu::argmax`'s rule) instead of the logits, which a
    /// GPU keeps.
    pub fn prefill_greedy(&mut self, tokens: &[u32]) -> Result<u32> {
        let last = self.prefill_all_but_the_last_chunk(tokens, &|| false)?;
        self.forward_greedy(last)
    }

    /// Runs every chunk of a non-empty prompt but the last, and returns the last; `None` when
    /// `stop` asked to stop between two chunks.
    fn prefill_all_but_the_last_chunk<'t>(
        &mut self,
        tokens: &'t [u32],
        stop: &dyn Fn() -> bool,
    ) -> Result<&'t [u32]> {
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let chunk = self.runner.max_batch();
        let last = (tokens.len() - 1) / chunk * chunk;
        for part in tokens[..last].chunks(chunk) {
            if stop() {
                return Err(Error::Cancelled);
            }
            self.forward(part, Logits::Last)?;
        }
        Ok(&tokens[last..])
    }

    /// Appends one token and returns the logits after it.
    pub fn step(&mut self, token: u32) -> Result<&[f32]> {
        self.forward(&[token], Logits::Last)
    }

    /// Appends one token and returns the greedy choice after it ([`Self::prefill_greedy`]).
    pub fn step_greedy(&mut self, token: u32) -> Result<u32> {
        self.forward_greedy(&[token])
    }

    /// Prefills `prompt` and decodes greedily (the picks of [`Self::prefill_greedy`]) up to
    /// `limit` tokens, each handed to `on_token` once it is on the host; `on_token` stops the
    /// decode by returning `ControlFlow::Break`. Each step is enqueued before the token it
    /// takes has reached the host, fed by the pick where it was made
    /// ([`ember_models::Backend::pick_ahead`]), so a GPU does not idle while the host reads a
    /// token and launches the next step; a step run for a token that ended the decode is
    /// dropped, its position too. The tokens are those of [`Self::step_greedy`] one by one.
    pub fn decode_greedy(
        &mut self,
        prompt: &[u32],
        limit: usize,
        on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<()> {
        self.decode_greedy_until(prompt, limit, &|| false, on_token)
    }

    /// [`Self::decode_greedy`] that also stops, with [`Error::Cancelled`], when `stop` says so
    /// between two prompt chunks.
    fn decode_greedy_until(
        &mut self,
        prompt: &[u32],
        limit: usize,
        stop: &dyn Fn() -> bool,
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<()> {
        if limit == 0 {
            return Ok(());
        }
        let last = self.prefill_all_but_the_last_chunk(prompt, stop)?;
        self.forward_ahead(PassInput::Tokens(last))?;
        let mut made = 0;
        loop {
            // One pick is in flight; the step that takes it goes first if it may be needed.
            let ahead = made + 1 < limit;
            if ahead {
                self.forward_ahead(PassInput::Fed)?;
            }
            let token = self.runner.read_pick()?;
            made += 1;
            if on_token(token).is_break() || made >= limit {
                if ahead {
                    // That step's token ended the decode: its pick and position go.
                    self.runner.read_pick()?;
                    let len = self.seq.len() - 1;
                    self.seq.truncate(len);
                }
                return Ok(());
            }
        }
    }

    /// Generates from `prompt` on a fresh sequence. `on_step` sees every token as it is made and
    /// may stop generation early by returning `ControlFlow::Break`.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_step: impl FnMut(Step<'_>) -> ControlFlow<()>,
    ) -> Result<Generation> {
        self.generate_until(prompt, params, &|| false, on_step)
    }

    /// [`Self::generate`] that also gives up, with [`Error::Cancelled`], when `stop` says so
    /// between two prompt chunks (a client gone mid-prefill); `on_step` stops it once tokens
    /// come.
    ///
    /// With [`GenerateParams::cache_prompt`] (and a prompt cache), the prompt's longest cached
    /// prefix is taken instead of prefilled (at least its last token is always computed, for
    /// its logits), and when the request ends, however it ends, the full blocks of its prompt
    /// and reply are left to the cache.
    pub fn generate_until(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        stop: &dyn Fn() -> bool,
        on_step: impl FnMut(Step<'_>) -> ControlFlow<()>,
    ) -> Result<Generation> {
        params.sampling.validate()?;
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if prompt.len() >= self.context() {
            return Err(Error::PromptTooLong {
                prompt_tokens: prompt.len(),
                context: self.context(),
            });
        }
        self.reset();
        let cache = params.cache_prompt && self.cache_enabled;
        let mut seq = self.blocks.start(prompt, cache, &mut self.transfers)?;
        std::mem::swap(&mut self.seq, &mut seq);
        let started = self.run_transfers();
        let cached = self.seq.len();
        if cache {
            self.cache_stats.record_lookup(cached);
        }
        let mut tokens = Vec::with_capacity(prompt.len() + params.max_tokens);
        tokens.extend_from_slice(prompt);
        let result =
            started.and_then(|()| self.run_generation(&mut tokens, cached, params, stop, on_step));
        // The positions filled hold `tokens`' keys and values: the prompt's, then the reply's
        // but its last token's (never run). A failed pass may have left garbage past them,
        // and a device error anything anywhere: then nothing new is cached.
        let filled = self.seq.len().min(tokens.len());
        let keep = cache && !matches!(&result, Err(e) if !e.is_cancellation());
        let mut seq = std::mem::take(&mut self.seq);
        self.blocks.finish(&mut seq, &tokens[..filled], keep);
        self.seq = seq;
        self.publish_cache_stats();
        let mut generation = result?;
        generation.cached_tokens = cached;
        Ok(generation)
    }

    /// The prefill of `prompt[cached..]` (`tokens` holds the prompt) and the decode, each
    /// token appended to `tokens`.
    fn run_generation(
        &mut self,
        tokens: &mut Vec<u32>,
        cached: usize,
        params: &GenerateParams,
        stop: &dyn Fn() -> bool,
        mut on_step: impl FnMut(Step<'_>) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let prompt_len = tokens.len();
        let mut sampler = Sampler::new(params.sampling);
        let (eos_ids, context) = (self.eos_ids.clone(), self.context());
        let start = Instant::now();
        let mut finish_reason = FinishReason::Length;
        let mut first_token_at = None;
        // Each token as it comes: whether generation goes on after it.
        let mut accept = |tokens: &mut Vec<u32>, token: u32, logits: Option<&[f32]>| {
            first_token_at.get_or_insert_with(Instant::now);
            let is_eos = eos_ids.contains(&token);
            tokens.push(token);
            let flow = on_step(Step {
                token,
                logits,
                is_eos,
                cached_tokens: cached,
            });
            if flow.is_break() || (is_eos && !params.ignore_eos) {
                finish_reason = FinishReason::Stop;
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        };
        // At most this many, and the last one's position inside the context.
        let limit = params.max_tokens.min(context - prompt_len);
        let rest = tokens[cached..].to_vec();
        if params.sampling.is_greedy() && !params.step_logits {
            // Greedy without logits for the caller: the choice is made where the logits are.
            self.decode_greedy_until(&rest, limit, stop, |token| accept(tokens, token, None))?;
        } else if limit > 0 {
            let last = self.prefill_all_but_the_last_chunk(&rest, stop)?;
            let mut logits = self.forward(last, Logits::Last)?;
            for made in 1.. {
                let token = sampler.sample(logits);
                if accept(tokens, token, Some(logits)).is_break() || made >= limit {
                    break;
                }
                logits = self.forward(&[token], Logits::Last)?;
            }
        }
        let first = first_token_at.unwrap_or_else(Instant::now);
        Ok(Generation {
            tokens: tokens[prompt_len..].to_vec(),
            finish_reason,
            prompt_tokens: prompt_len,
            cached_tokens: cached,
            prefill_time: first - start,
            decode_time: first.elapsed(),
        })
    }

    /// The cache's contents and counters, for `/metrics` and `/health`.
    fn publish_cache_stats(&self) {
        let b = self.blocks.stats();
        self.cache_stats.record_contents(
            b.cached_blocks,
            b.host_cached,
            b.evictions,
            b.host_evictions,
        );
    }
}

/// Holds every listed buffer and the program's own code in one set, whole or not at all, logs
/// the one load line that says which way it went, and attaches the set to the owner so later
/// buffers join it.
fn establish_residency(
    owner: &BufferOwner,
    options: &EngineOptions,
    cuda: Option<CudaDevice>,
    caching: bool,
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
            if caching {
                // The prompt cache is the part an operator sizes most freely.
                bound = bound
                    .with_advice("lower --prompt-cache-gib or --context, or set --load-limit-gib")
                    .with_device_advice("lower --prompt-cache-gib or --context");
            }
            match cuda {
                // Device buffers are resident by nature; the bound keeps later joins (KV
                // growth, caches) inside the GPU's memory. Staging buffers are page-locked
                // with the driver.
                Some(device) => {
                    let bound = bound.with_device_limit(device.info().memory_bytes as u64);
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

/// The KV pool made at load: one sequence's context of blocks plus the prompt cache's budget,
/// and the host tier's slots, with the figures for the load line.
struct PoolPlan {
    layout: KvLayout,
    /// Blocks in the pool, and how many of them are the cache's beyond the sequence's.
    blocks: usize,
    cache_blocks: usize,
    host_blocks: usize,
    on_gpu: bool,
}

impl PoolPlan {
    /// Sizes the budgets against the room the residency bound leaves once what `owner` lists
    /// (the weights and activations) and the sequence's blocks are counted: `auto` takes the
    /// device's default share, clamped to half that room; a size asked for is taken as is
    /// (the residency load line says when it does not fit).
    fn new(
        options: &EngineOptions,
        config: &ModelConfig,
        kv_dtype: KvDtype,
        context: usize,
        owner: &BufferOwner,
        device: Option<&CudaDevice>,
    ) -> PoolPlan {
        let layout = KvLayout::new(config, kv_dtype);
        let seq_blocks = layout.blocks_for(context);
        let seq_bytes = (seq_blocks * layout.block_bytes()) as u64;
        let bound = Bound::from_system(options.load_limit_gib);
        let (mut host_listed, mut device_listed) = (0u64, 0u64);
        for b in owner.list() {
            match b.location {
                ember_tensor::Location::Host => host_listed += b.bytes as u64,
                _ => device_listed += b.bytes as u64,
            }
        }
        let host_room = bound.host_bytes().saturating_sub(host_listed);
        let (cache_room, cache_default, host_default) = match device {
            Some(d) => (
                (d.info().memory_bytes as u64).saturating_sub(device_listed + seq_bytes),
                DEFAULT_CACHE_GIB_GPU,
                DEFAULT_HOST_TIER_GIB_GPU,
            ),
            None => (
                host_room.saturating_sub(seq_bytes),
                DEFAULT_CACHE_GIB_CPU,
                0.0,
            ),
        };
        let block_bytes = layout.block_bytes();
        let cache_blocks =
            budget_blocks(options.prompt_cache, cache_default, cache_room, block_bytes);
        let cache_bytes = (cache_blocks * block_bytes) as u64;
        // On the CPU the host tier shares the RAM the cache already took.
        let host_room = match device {
            Some(_) => host_room,
            None => host_room.saturating_sub(seq_bytes + cache_bytes),
        };
        // Without a cache there is nothing to keep on the host either.
        let host_blocks = if cache_blocks == 0 {
            0
        } else {
            budget_blocks(
                options.prompt_cache_host,
                host_default,
                host_room,
                block_bytes,
            )
        };
        PoolPlan {
            layout,
            blocks: seq_blocks + cache_blocks,
            cache_blocks,
            host_blocks,
            on_gpu: device.is_some(),
        }
    }

    fn caching(&self) -> bool {
        self.cache_blocks > 0
    }

    /// One line: the pool, the cache's share and the host tier, or that the cache is off.
    fn log(&self) {
        let gib = |blocks: usize| (blocks * self.layout.block_bytes()) as f64 / (1u64 << 30) as f64;
        let memory = if self.on_gpu { "device memory" } else { "RAM" };
        if !self.caching() {
            tracing::info!(
                "kv pool: {} blocks of {} positions ({:.2} GiB of {memory}); prompt cache off",
                self.blocks,
                self.layout.block_size,
                gib(self.blocks)
            );
            return;
        }
        let host = if self.host_blocks > 0 {
            format!(
                ", host tier {:.2} GiB ({} blocks)",
                gib(self.host_blocks),
                self.host_blocks
            )
        } else {
            String::new()
        };
        tracing::info!(
            "kv pool: {} blocks of {} positions ({:.2} GiB of {memory}); prompt cache {:.2} GiB \
             ({} blocks, {} KiB each){host}",
            self.blocks,
            self.layout.block_size,
            gib(self.blocks),
            gib(self.cache_blocks),
            self.cache_blocks,
            self.layout.block_bytes() / 1024
        );
    }
}

/// Where the keepalive tick copies its 16 bytes: host memory, or device memory on a GPU.
enum KeepaliveScratch {
    Host(Arc<Mutex<Buffer>>),
    Device(CudaDevice, Arc<Mutex<DeviceBuffer>>),
}

/// Prompt passes of a whole chunk, a quarter of it, and so on down to a few tokens, then a
/// decode step, each forgotten. A CUDA engine's first pass of a size loads the cuBLASLt kernels
/// that size picks (the driver loads kernels lazily, on first use) and its GEMM plans, and the
/// first step records the decode graph: H200, the first 2048-token prompt of qwen3-8b after
/// load took 223 ms against 59 ms for the next, and a 512-token prompt after a warm-up of
/// 2048 alone still paid 14 ms more on qwen3-0.6b. Paid at load, not by the first request.
fn warm_up(runner: &mut dyn Runner) -> Result<()> {
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
fn default_kv_dtype(weights: &WeightFiles, config: &ModelConfig, on_cuda: bool) -> KvDtype {
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
    device: Device,
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
    match device {
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

/// The checkpoint files a model was loaded from.
enum WeightFiles {
    Safetensors(SafetensorsSet),
    Gguf(GgufFile),
}

impl WeightFiles {
    fn source(&self) -> &dyn TensorSource {
        match self {
            WeightFiles::Safetensors(set) => set,
            WeightFiles::Gguf(file) => file,
        }
    }
}

/// The GGUF file `path` names: the file itself, or the only `.gguf` in a directory that has no
/// `config.json`.
fn gguf_path(path: &Path) -> Option<PathBuf> {
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
