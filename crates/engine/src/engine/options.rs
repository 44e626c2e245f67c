//! How to load a model.

use std::path::PathBuf;

use ember_models::KvDtype;

use crate::draft::DraftOptions;
use crate::prompt_cache::CacheBudget;

/// How to load a model.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Compute threads, the calling thread included; `None` means every core this process may use.
    pub threads: Option<usize>,
    /// Positions of KV cache preallocated: the longest prompt plus reply. `None` takes the
    /// model's trained length, capped at [`DEFAULT_CONTEXT`](super::DEFAULT_CONTEXT).
    pub context: Option<usize>,
    /// Sequences that may run at once in the batched loop ([`Engine::submit`](super::Engine::submit)):
    /// the KV pool holds a whole context for each, and the CPU backend a row of logits.
    /// `None` takes the device's default: [`DEFAULT_PARALLEL_CPU`](super::DEFAULT_PARALLEL_CPU)
    /// on the CPU, [`DEFAULT_PARALLEL_CUDA`](super::DEFAULT_PARALLEL_CUDA) on CUDA. The
    /// library's default is `Some(1)`: embedders opt in.
    pub parallel: Option<usize>,
    /// Positions of KV cache the running sequences share. `None`: a whole `context` for each
    /// of `parallel`, so none ever waits for blocks. Fewer (at least one `context`) hold more
    /// sequences in less memory: a request is admitted when the pool has blocks for it, and
    /// when a running one needs a block the pool lacks, the last admitted is preempted (its
    /// blocks freed, its tokens recomputed when it resumes, through the prompt cache).
    pub kv_pool_tokens: Option<usize>,
    /// Tokens per forward pass in prefill; longer prompts run in chunks of this size. `None`
    /// takes [`DEFAULT_PREFILL_CHUNK_CPU`](super::DEFAULT_PREFILL_CHUNK_CPU) or
    /// [`DEFAULT_PREFILL_CHUNK_CUDA`](super::DEFAULT_PREFILL_CHUNK_CUDA).
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
    /// On CUDA, every product of 16-bit weights on the batch-invariant kernel
    /// (`--batch-invariant`), so a request's tokens do not depend on what shares its passes.
    /// Off by default while its prefill is slow (H100, qwen3-8b bf16: decode 0.91x the
    /// default's tokens/s alone and 0.92x at 64 streams, prefill 0.38x: issue 22); off, the
    /// products take matrix-vector kernels for decode batches of up to 8 and cuBLASLt past
    /// them.
    pub batch_invariant: bool,
    /// The prompt cache's share of the KV pool (`--prompt-cache-gib`): finished requests'
    /// blocks stay, and a request whose prompt starts with a cached prefix prefills only the
    /// rest.
    pub prompt_cache: CacheBudget,
    /// Host memory for blocks evicted from the pool (`--prompt-cache-host-gib`): on a GPU,
    /// pinned memory they come back from by copy. The CPU takes it only when asked.
    pub prompt_cache_host: CacheBudget,
    /// Speculative decoding in the batched loop (`--draft`, `--draft-max`, `--draft-min`):
    /// drafted tokens verified in the pass that would have made one, the output unchanged.
    /// Off by default; the CPU only for now.
    pub draft: DraftOptions,
    /// The draft model's checkpoint (`--draft-model`: a directory or a GGUF file) when
    /// `draft`'s kind is [`crate::draft::DraftKind::Model`]: the same vocabulary, run on the
    /// CPU beside the model, its buffers listed and held with the model's.
    pub draft_model: Option<PathBuf>,
    /// Ranks the model is split across (`--tensor-parallel`): each holds its share of the
    /// attention heads, the MLP's columns and the vocabulary, and the ranks add their
    /// partial sums twice a layer. 1: the model whole. On the CPU the ranks are threads; on
    /// CUDA each is a GPU ([`Collectives`] says how they meet).
    pub tensor_parallel: usize,
    /// How the GPUs of a split model meet (`--collectives`).
    pub collectives: Collectives,
    /// With `tensor_parallel` above 1, a mixture of experts' experts shared out whole, each
    /// rank holding a share of them (`--expert-parallel`), instead of every rank holding its
    /// share of every expert's columns.
    pub expert_parallel: bool,
    /// A split model's rank made to fail on purpose (`--fail-rank`, hidden): the tests of
    /// what a lost rank does to the engine and the server.
    pub rank_fault: Option<RankFault>,
}

/// How the ranks of a model split across GPUs add up their partial sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Collectives {
    /// NCCL, each rank on a GPU of its own: the collectives run on the GPUs' streams and are
    /// recorded with the decode steps. Without NCCL, or with fewer GPUs than ranks, the load
    /// fails saying so.
    #[default]
    Nccl,
    /// Through host memory: every collective waits for its GPU, and the decode steps are not
    /// recorded (slow). Ranks may share a GPU, taken in turn: a split checked on one GPU, or
    /// a machine without NCCL.
    Host,
}

impl std::str::FromStr for Collectives {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "nccl" => Ok(Collectives::Nccl),
            "host" => Ok(Collectives::Host),
            _ => Err(format!("{s:?}: expected nccl or host")),
        }
    }
}

/// Rank `rank` (not 0: the engine's own thread) fails its forward pass number `pass` (from
/// 1) with an error, as a rank whose device was lost would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankFault {
    pub rank: usize,
    pub pass: usize,
}

impl std::str::FromStr for RankFault {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let parsed = s
            .split_once(':')
            .and_then(|(r, p)| Some((r.parse().ok()?, p.parse().ok()?)));
        match parsed {
            Some((rank, pass)) if rank > 0 && pass > 0 => Ok(RankFault { rank, pass }),
            _ => Err(format!("{s:?}: expected RANK:PASS, both from 1")),
        }
    }
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
            parallel: Some(1),
            kv_pool_tokens: None,
            prefill_chunk: None,
            kv_dtype: None,
            residency: ResidencyMode::Off,
            load_limit_gib: None,
            device: Device::Cpu,
            cuda_graphs: true,
            draft: DraftOptions::default(),
            draft_model: None,
            batch_invariant: false,
            prompt_cache: CacheBudget::Off,
            prompt_cache_host: CacheBudget::Off,
            tensor_parallel: 1,
            collectives: Collectives::Nccl,
            expert_parallel: false,
            rank_fault: None,
        }
    }
}
