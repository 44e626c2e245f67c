//! A loaded model ready to generate: weights, tokenizer, template, KV cache and activations.
//!
//! By job: [`options`] says how to load; [`load`] loads (the device, the KV pool and prompt
//! cache, the residency set), [`load_ranks`] a model split across ranks, [`pool_plan`] sizes
//! the KV pool and cache; [`generate`] runs prompts and decode steps through the prompt
//! cache; this file holds the engine and what it tells about itself.

mod batch;
mod defaults;
mod generate;
mod load;
mod load_draft;
mod load_ranks;
mod options;
mod picker;
mod pool_plan;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ember_models::{BlockTable, KvDtype, ModelConfig};
use ember_residency::ResidencySet;
use ember_tensor::cuda::{CudaDevice, DeviceBuffer};
use ember_tensor::{Buffer, BufferInfo, BufferOwner};
use serde_json::Value;

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{Error, Result};
use crate::kv::{BlockManager, Transfer};
use crate::prompt_cache::PromptCacheStats;
use crate::runner::Runner;
use crate::tokenizer::Tokenizer;

pub use batch::{BatchEvent, DraftStats, StepTiming};
pub use defaults::{DefaultsSource, LLAMA_SERVER_DEFAULTS, OPENAI_DEFAULTS, SamplingDefaults};
pub use generate::{FinishReason, GenerateParams, Generation, Step};
use load::WeightFiles;
pub use options::{Collectives, Device, EngineOptions, RankFault, ResidencyMode};

/// The context when none is asked for: enough for real chats, without preallocating a model's
/// whole trained length (often 32k-128k positions, gigabytes of KV cache).
pub const DEFAULT_CONTEXT: usize = 4096;

/// Prompt tokens a forward pass takes by default on the CPU (llama.cpp's ubatch).
pub const DEFAULT_PREFILL_CHUNK_CPU: usize = 512;
/// On CUDA: longer chunks keep cuBLASLt's GEMMs busier (H200, qwen3-8b, a 2048-token prompt:
/// 34.7k tok/s in chunks of 512, 39.4k in one of 2048), for activation buffers of a few
/// hundred MB of device memory.
pub const DEFAULT_PREFILL_CHUNK_CUDA: usize = 2048;

/// Requests a CPU engine runs at once by default (`--parallel`): a few streams share each
/// pass's reading of the weights; more would slow every stream's tokens on a few cores.
pub const DEFAULT_PARALLEL_CPU: usize = 4;
/// On CUDA: a decode step reads the weights once for every sequence in it, so tens of
/// streams cost little more than one; each holds a whole context of KV blocks.
pub const DEFAULT_PARALLEL_CUDA: usize = 16;

/// The keepalive scratch: a source and a destination of 16 bytes.
const KEEPALIVE_SCRATCH_BYTES: usize = 32;

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

    /// The messages rendered by the model's template with a generation prompt, exactly as
    /// transformers' `apply_chat_template(messages, add_generation_prompt=True)`: a final
    /// assistant message is closed and a new reply begun.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        Ok(self.template()?.render(messages, true, kwargs)?)
    }

    /// The prompt a server runs for a chat: [`Self::render_chat`], except that when the last
    /// message is the assistant's the reply continues it (assistant prefill, as llama-server
    /// does and vLLM's `continue_final_message`): the template renders it without a
    /// generation prompt and the text is cut right after its content, before whatever closes
    /// the turn; an empty one prompts a new reply.
    pub fn render_chat_continuing(
        &self,
        messages: &[ChatMessage],
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let template = self.template()?;
        match messages.split_last() {
            Some((last, earlier)) if last.role == "assistant" => {
                if last.content.is_empty() {
                    // Nothing to continue: the reply starts where a new one would.
                    return Ok(template.render(earlier, true, kwargs)?);
                }
                let rendered = template.render(messages, false, kwargs)?;
                let end = rendered
                    .rfind(&last.content)
                    .ok_or(Error::PrefillNotRendered)?
                    + last.content.len();
                Ok(rendered[..end].to_owned())
            }
            _ => Ok(template.render(messages, true, kwargs)?),
        }
    }

    fn template(&self) -> Result<&ChatTemplate> {
        self.template
            .as_deref()
            .ok_or_else(|| Error::NoChatTemplate(self.dir.clone()))
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
    /// The requests of the batched loop ([`Self::submit`], [`Self::step_batch`]).
    batch: batch::Batch,
    /// Whether the prompt cache has any room (`--prompt-cache-gib` above 0).
    cache_enabled: bool,
    cache_stats: Arc<PromptCacheStats>,
    /// Copies between the pool and its host tier, made by the block manager, run before the
    /// next pass (kept, so that no request allocates for them).
    transfers: Vec<Transfer>,
    kv_dtype: KvDtype,
    encoder: PromptEncoder,
    eos_ids: Vec<u32>,
    /// The sampling of a request that names none ([`defaults`]).
    sampling_defaults: SamplingDefaults,
    /// Holds the buffers resident between requests (inactive when off or refused).
    residency: Arc<ResidencySet>,
    /// Where the keepalive tick does its 16-byte copy; a member of the set like any buffer.
    keepalive_scratch: KeepaliveScratch,
    /// Keeps the mapped files listed for as long as the weights are read from them (the CPU;
    /// a GPU has its own copy, and the files are unmapped after load).
    _weights: Option<WeightFiles>,
}

impl Engine {
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

    /// Starts or stops a GPU profiler's capture (see `bench batch --profile-steps`).
    pub fn profiler_capture(&self, on: bool) -> Result<()> {
        self.runner.profiler_capture(on)
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.encoder.tokenizer
    }

    /// A handle that tokenizes prompts and chats for this model, usable from other threads.
    /// The sampling a request gets for the parameters it leaves out, and where it came from.
    pub fn sampling_defaults(&self) -> SamplingDefaults {
        self.sampling_defaults
    }

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
}

/// Where the keepalive tick copies its 16 bytes: host memory, or device memory on a GPU.
enum KeepaliveScratch {
    Host(Arc<Mutex<Buffer>>),
    Device(CudaDevice, Arc<Mutex<DeviceBuffer>>),
}
