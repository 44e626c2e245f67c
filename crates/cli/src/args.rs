//! Command-line flags, as typed. Each subcommand's module turns them into engine options.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::cmd::bench_quality::BenchQualityArgs;

#[derive(Parser, Debug)]
#[command(name = "ember", version, about = "A local LLM inference engine that stays warm", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a completion for one prompt; the text goes to stdout, timings to stderr.
    Run(RunArgs),
    /// Serve an OpenAI-compatible HTTP API (chat and text completions, streaming or not).
    // Boxed: its many flags would make every command as large.
    Serve(Box<ServeArgs>),
    /// Measure speed.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write a checkpoint with random weights at a real model's shapes (for benchmarks).
    GenCheckpoint(GenCheckpointArgs),
}

/// Flags every command that loads a model shares.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file, or a directory in the Hugging Face layout (config.json, *.safetensors,
    /// tokenizer.json) [default: SmolLM2-135M-Instruct Q4_1 from `scripts/fetch-model smollm2`].
    #[arg(long, short = 'm', env = "EMBER_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute threads [default: the cores this process may use].
    #[arg(long, short = 't', env = "EMBER_THREADS")]
    pub threads: Option<usize>,
    /// Context length in tokens: the KV cache is preallocated for this many [default: the
    /// model's trained length, at most 4096].
    #[arg(long, short = 'c', env = "EMBER_CONTEXT")]
    pub context: Option<usize>,
    /// KV cache element type: f32, f16 or bf16 [default: f16 for GGUF models; on CUDA a bf16
    /// or f16 checkpoint's own type; f32 otherwise].
    #[arg(long, value_parser = ["f32", "f16", "bf16"])]
    pub kv_type: Option<String>,
    /// Tokens per forward pass in prefill (llama.cpp's --ubatch-size): longer prompts run in
    /// chunks of this many; larger chunks feed the GEMMs better and hold larger activation
    /// buffers [default: 512 on the CPU, 2048 on CUDA].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub prefill_chunk: Option<u32>,
    /// Hold every engine buffer and the program's code resident between requests: `auto`
    /// holds them when they fit and the OS allows (else runs without, saying why);
    /// `required` refuses to start without.
    #[arg(long, value_parser = ["auto", "required"], default_value = "auto")]
    pub residency: String,
    /// Turn residency off.
    #[arg(long, env = "EMBER_NO_RESIDENCY", value_parser = clap::builder::FalseyValueParser::new())]
    pub no_residency: bool,
    /// Replaces the 70% of RAM that bounds what is held resident (a 2 GiB margin stays).
    #[arg(long, env = "EMBER_LOAD_LIMIT_GB")]
    pub load_limit_gib: Option<f64>,
    /// Where the model runs: auto (a usable CUDA GPU when the weights can run there, else the
    /// CPU; the log says which and why), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", env = "EMBER_DEVICE")]
    pub device: ember_engine::Device,
    /// On CUDA, launch every decode step op by op instead of replaying it as a recorded CUDA
    /// graph (same results, slower; for debugging and comparison).
    #[arg(long, env = "EMBER_NO_CUDA_GRAPHS", value_parser = clap::builder::FalseyValueParser::new())]
    pub no_cuda_graphs: bool,
    /// On CUDA, every product of 16-bit weights on the batch-invariant tensor-core kernel, so
    /// a request's greedy tokens are the same bits alone or among others (on an H100, qwen3-8b:
    /// decode about 0.9x the default's speed, prefill 0.4x).
    #[arg(long, env = "EMBER_BATCH_INVARIANT", value_parser = clap::builder::FalseyValueParser::new())]
    pub batch_invariant: bool,
    /// Split the model across N ranks (tensor parallelism: each holds its share of the
    /// attention heads, MLP columns and vocabulary, and the ranks add their partial sums
    /// twice a layer). On the CPU the ranks are threads sharing --threads; on CUDA each is a
    /// GPU (from the one --device names). The attention heads must divide by N, and N by the
    /// key-value heads or they by N.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64), env = "EMBER_TENSOR_PARALLEL")]
    pub tensor_parallel: u32,
    /// How the GPUs of --tensor-parallel meet: nccl (a GPU for each rank; libnccl.so.2 on the
    /// loader's path or EMBER_NCCL_LIBRARY) or host (through host memory: slow, but ranks may
    /// share GPUs, e.g. to check a split on one).
    #[arg(long, default_value = "nccl", env = "EMBER_COLLECTIVES")]
    pub collectives: ember_engine::Collectives,
    /// With --tensor-parallel, a mixture of experts' experts shared out whole among the ranks
    /// (expert parallelism) instead of each rank holding its share of every expert.
    #[arg(long, env = "EMBER_EXPERT_PARALLEL", value_parser = clap::builder::FalseyValueParser::new())]
    pub expert_parallel: bool,
    /// RANK:PASS: that rank of a split model fails its PASSth forward pass on purpose (tests
    /// of what a lost rank does).
    #[arg(long, hide = true)]
    pub fail_rank: Option<ember_engine::RankFault>,
}

#[derive(Args, Debug)]
// Negative numbers are values, so `--temperature -1` is rejected by validation with a message
// that names the field, not by the parser as an unknown flag.
#[command(allow_negative_numbers = true)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt: raw text, or with --chat one user message.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Render the prompt as one user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy (deterministic).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Random seed for sampling; the same seed gives the same tokens [default: random].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Divide the logits of tokens already in the prompt or reply by this (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Subtract this from the logits of tokens already in the reply (0 = off, -2..2).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Subtract this times a token's count in the reply from its logit (0 = off, -2..2).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Disable thinking in templates that support it (passes enable_thinking=false).
    #[arg(long)]
    pub no_think: bool,
    #[command(flatten)]
    pub draft: DraftArgs,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on; loopback by default, so nothing outside this machine can reach it.
    #[arg(long, default_value = "127.0.0.1", env = "EMBER_HOST")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the log line says which).
    #[arg(long, default_value_t = 8026, env = "EMBER_PORT")]
    pub port: u16,
    /// Sampling temperature of a request that sets none [default: the model's:
    /// generation_config.json's for a checkpoint, 0.8 for a GGUF model, else 1].
    #[arg(long, value_parser = parse_temperature)]
    pub temp: Option<f32>,
    /// Top-k of a request that sets none (0: off) [default: the model's, as for --temp; 40 for
    /// a GGUF model].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Top-p of a request that sets none [default: the model's; 0.95 for a GGUF model].
    #[arg(long, value_parser = parse_unit_open)]
    pub top_p: Option<f32>,
    /// Min-p of a request that sets none [default: the model's; 0.05 for a GGUF model].
    #[arg(long, value_parser = parse_unit)]
    pub min_p: Option<f32>,
    /// Seed of a request that sets none [default: none, a fresh one per request].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Repetition penalty of a request that sets none (1: off) [default: the model's
    /// generation_config.json `repetition_penalty`, else 1].
    #[arg(long, value_parser = parse_positive)]
    pub repeat_penalty: Option<f32>,
    /// Presence penalty of a request that sets none (-2..2; 0: off).
    #[arg(long, value_parser = parse_penalty, allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty of a request that sets none (-2..2; 0: off).
    #[arg(long, value_parser = parse_penalty, allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    /// Connections open at once; one more gets a 503 and is closed [default: the process's
    /// file descriptor limit less 64, at most 1024].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: Option<u64>,
    /// Seconds a connection has to send a request's headers, and that an idle keep-alive
    /// connection stays open.
    #[arg(long, default_value_t = 15.0)]
    pub header_timeout: f64,
    /// A web origin whose pages may call the server from a browser (`https://host:port`;
    /// repeat for more, `*` for any) [default: none].
    #[arg(long)]
    pub cors_origin: Vec<String>,
    /// File of API keys, one per line; then /v1/* requires `Authorization: Bearer KEY`.
    #[arg(long, env = "EMBER_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Model name reported by /v1/models and in responses [default: the model directory's name].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Seconds in-flight requests may run on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 5.0)]
    pub shutdown_timeout: f64,
    /// Requests generated at once, sharing each forward pass (continuous batching); the KV
    /// pool holds a whole --context for each [default: 4 on the CPU, 16 on CUDA].
    #[arg(long, env = "EMBER_PARALLEL", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub parallel: Option<u64>,
    /// Positions of KV cache the running requests share [default: --parallel × --context].
    /// Fewer (at least one --context) fit more requests in less memory: a request starts when
    /// the pool has blocks for it, and when it runs out the last one started is preempted and
    /// later recomputes its tokens (from the prompt cache where it can).
    #[arg(long, env = "EMBER_KV_POOL_TOKENS")]
    pub kv_pool_tokens: Option<usize>,
    /// Requests that may wait beyond the --parallel running ones; more get 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Tokens a request that sets no limit (`max_tokens`, `n_predict`) may generate, within the
    /// context; -1: to the end of the context (llama-server's `--n-predict`).
    #[arg(long, default_value_t = 4096, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..))]
    pub n_predict: i64,
    /// Largest request body in bytes; larger bodies get 413.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Seconds after the last request during which the idle keepalive ticks, keeping held
    /// memory warm (0: never tick).
    #[arg(long, default_value_t = 900.0, env = "EMBER_KEEP_WARM")]
    pub keep_warm: f64,
    /// Milliseconds between keepalive ticks (at most 500: the OS reclaims idle memory within
    /// a second or two).
    #[arg(long, default_value_t = 250, env = "EMBER_KEEPALIVE_INTERVAL_MS",
          value_parser = clap::value_parser!(u64).range(1..=500))]
    pub keepalive_interval_ms: u64,
    /// Keepalive ticks only commit and copy 16 bytes, without reading a byte of every held
    /// page (the warm pass that keeps the first token after a pause as fast as back to back).
    #[arg(long, env = "EMBER_NO_KEEPALIVE_WARM", value_parser = clap::builder::FalseyValueParser::new())]
    pub no_keepalive_warm: bool,
    /// GiB of the KV pool kept for the prompt cache: finished requests' prompts and replies
    /// stay, and a request that starts with a cached prefix prefills only the rest (0: off)
    /// [default: auto, 2 GiB of RAM on the CPU and 8 GiB of device memory on a GPU, at most
    /// half of what the residency bound leaves].
    #[arg(long, default_value = "auto", env = "EMBER_PROMPT_CACHE_GIB")]
    pub prompt_cache_gib: ember_engine::prompt_cache::CacheBudget,
    /// On a GPU, GiB of pinned host memory for cached blocks evicted from device memory;
    /// they come back by copy when their prefix returns (0: off) [default: auto, 16 GiB on a
    /// GPU, at most half of what the residency bound leaves; none on the CPU].
    #[arg(long, default_value = "auto", env = "EMBER_PROMPT_CACHE_HOST_GIB")]
    pub prompt_cache_host_gib: ember_engine::prompt_cache::CacheBudget,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// Speculative decoding's flags (`ember serve`, `ember run`).
#[derive(Args, Debug)]
pub struct DraftArgs {
    /// Speculative decoding: where drafted tokens come from, verified in the pass that makes
    /// the next one, the output the same bits either way (a request opts out with `"draft":
    /// false`). ngram: the continuation of the reply's last few tokens where they appeared
    /// before in the prompt or reply (prompt lookup); model: a draft model's greedy picks
    /// (--draft-model); none: one token a pass; auto: model with --draft-model, else ngram
    /// where a pass's rows are the bits of decode steps (the CPU, and CUDA with
    /// --batch-invariant, which drafting on CUDA needs), else none.
    #[arg(long = "draft", default_value = "auto", env = "EMBER_DRAFT")]
    pub kind: ember_engine::draft::DraftKind,
    /// The draft model for --draft model (or auto): a smaller model of the same vocabulary (a
    /// Hugging Face directory or a GGUF file), run beside the model on its device (on the CPU
    /// on the same threads), its weights and KV cache (a whole context for each of --parallel
    /// sequences) held with the model's.
    #[arg(long, env = "EMBER_DRAFT_MODEL")]
    pub draft_model: Option<std::path::PathBuf>,
    /// Most tokens drafted for one pass; a sequence's depth follows how many the model keeps.
    #[arg(long, default_value_t = ember_engine::draft::DEFAULT_DRAFT_MAX,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub draft_max: usize,
    /// Fewest drafted tokens worth verifying; shorter guesses are dropped.
    #[arg(long, default_value_t = ember_engine::draft::DEFAULT_DRAFT_MIN,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub draft_min: usize,
}

impl DraftArgs {
    /// The engine's drafting options; `--draft-min` past `--draft-max` is refused.
    pub fn options(&self) -> anyhow::Result<ember_engine::draft::DraftOptions> {
        if self.draft_min > self.draft_max {
            anyhow::bail!(
                "--draft-min {} is more than --draft-max {}",
                self.draft_min,
                self.draft_max
            );
        }
        Ok(ember_engine::draft::DraftOptions {
            kind: self.kind,
            max: self.draft_max,
            min: self.draft_min,
        })
    }
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and decode speed, against a memory-bandwidth bound measured in the same run.
    Decode(BenchDecodeArgs),
    /// First-token latency after idle gaps, against back to back, on any OpenAI-compatible
    /// server (one JSON line per gap).
    Idle(BenchIdleArgs),
    /// A chat's next turn: time to first token with the prompt cache against without.
    Turn(BenchTurnArgs),
    /// Load on any OpenAI-compatible server: many streams at once (a concurrency sweep) or
    /// requests arriving at a rate; one JSON line per setting with throughput, time to first
    /// token and inter-token latency percentiles.
    Serve(BenchServeArgs),
    /// Many sequences at once in the engine alone (no HTTP), as llama.cpp's
    /// llama-batched-bench: aggregate prefill and decode speed per count of sequences, one
    /// JSON line each, against the bound of one batched step.
    Batch(BenchBatchArgs),
    /// The equalities a trustworthy OpenAI-compatible server keeps (a reply the same with or
    /// without speculative decoding, alone or among others, streamed or not, from the prompt
    /// cache or not; exact stop strings and max_tokens): one JSON line per check, exit status
    /// 1 when any fails.
    Quality(BenchQualityArgs),
}

#[derive(Args, Debug)]
pub struct BenchBatchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Each sequence's prompt, distinct from the others'.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens each sequence generates.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Sequences at once, one setting each, comma-separated (the engine runs with --parallel
    /// set to the largest).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub sequences: Vec<usize>,
    /// Size of the memory read probe in MiB (well past the last-level cache).
    #[arg(long, default_value_t = 1024)]
    pub probe_mib: usize,
    /// On CUDA, the decode steps a profiler started with `--profile-from-start off` records
    /// (e.g. `ncu --profile-from-start off`), from the middle of each setting's decode; the
    /// capture waits for the device at its ends, so time a run without it.
    #[arg(long, default_value_t = 0)]
    pub profile_steps: usize,
    /// On CUDA, the profiler records each setting's prefill (until every sequence has its
    /// first token) instead of decode steps.
    #[arg(long)]
    pub profile_prefill: bool,
}

#[derive(Args, Debug)]
pub struct BenchServeArgs {
    /// The server: http://host:port (an OpenAI base URL ending in /v1 works too).
    #[arg(long)]
    pub api: String,
    /// Streams kept in flight, one setting each, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub concurrency: Vec<usize>,
    /// Instead of a concurrency sweep: requests per second arriving as a Poisson process, one
    /// setting each, comma-separated (nothing caps how many are in flight).
    #[arg(long, value_delimiter = ',')]
    pub rate: Vec<f64>,
    /// Requests per setting [default: 4 per stream of the concurrency, at least 8; 32 for a
    /// rate].
    #[arg(long)]
    pub requests: Option<usize>,
    /// Words of each synthetic prompt (about 1.3 tokens each in English tokenizers; the report
    /// gives the server's own count). Every prompt is distinct, so no prompt cache helps.
    #[arg(long, default_value_t = 384)]
    pub prompt_words: usize,
    /// With this, each prompt's length is drawn uniformly from --prompt-words to this many.
    #[arg(long)]
    pub prompt_words_max: Option<usize>,
    /// Tokens each reply generates (end-of-sequence ignored, so every reply is this long).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Seeds the prompts and the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Bearer key for servers that require one.
    #[arg(long, env = "EMBER_API_KEY")]
    pub api_key: Option<String>,
    /// Model name sent with each request [default: the first of /v1/models].
    #[arg(long)]
    pub model: Option<String>,
}

#[derive(Args, Debug)]
pub struct BenchTurnArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The first turn's prompt: the conversation so far.
    #[arg(long, default_value_t = 2048)]
    pub history_tokens: usize,
    /// The first turn's reply, repeated in the second turn's prompt.
    #[arg(long, default_value_t = 64)]
    pub reply_tokens: usize,
    /// Tokens the second turn adds.
    #[arg(long, default_value_t = 30)]
    pub new_tokens: usize,
    /// Runs; the report gives medians.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// GiB of the KV pool for the prompt cache: `auto` (serve's default: 2 GiB on the CPU,
    /// 8 GiB on a GPU, at most half the residency room) or a size; the report says when it
    /// held less than the history.
    #[arg(long, default_value = "auto")]
    pub prompt_cache_gib: ember_engine::prompt_cache::CacheBudget,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchIdleArgs {
    /// The server: http://host:port (an OpenAI base URL ending in /v1 works too).
    #[arg(long)]
    pub api: String,
    /// Idle gaps to measure, in seconds, comma-separated; a back-to-back series (gap 0) is
    /// always measured first as the baseline.
    #[arg(long, value_delimiter = ',', default_value = "0.2,1,2,5,10")]
    pub gaps: Vec<f64>,
    /// Requests per gap.
    #[arg(long, default_value_t = 4)]
    pub repeats: usize,
    /// Bearer key for servers that require one.
    #[arg(long, env = "EMBER_API_KEY")]
    pub api_key: Option<String>,
    /// During each gap, page out every mapping of the server (process_madvise MADV_PAGEOUT),
    /// as the kernel does to an idle process under memory pressure; locked pages stay.
    #[arg(long)]
    pub evict: bool,
    /// The server's pid, for major-fault counts and --evict [default: the process listening
    /// on the --api port, when the server is on this machine].
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Model name sent with each request [default: the first of /v1/models].
    #[arg(long)]
    pub model: Option<String>,
    /// Tokens per reply.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
}

#[derive(Args, Debug)]
pub struct BenchDecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens decoded after the prompt.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Runs; the report gives medians.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Size of the memory read probe in MiB (well past the last-level cache).
    #[arg(long, default_value_t = 1024)]
    pub probe_mib: usize,
    /// Bring each step's logits to the host and pick the token there, as a request asking for
    /// log-probabilities runs (the default picks it where the logits are, on the GPU).
    #[arg(long)]
    pub step_logits: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct GenCheckpointArgs {
    /// Model shape: qwen3-0.6b, qwen3-1.7b, qwen3-8b or qwen3-30b-a3b.
    #[arg(long)]
    pub shape: String,
    /// Weight dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Output directory (created).
    #[arg(long, short = 'o')]
    pub out: PathBuf,
}

/// A temperature in 0..=2, as the API takes it.
fn parse_temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if (0.0..=2.0).contains(&t) => Ok(t),
        _ => Err(format!("{s}: a temperature between 0 and 2")),
    }
}

/// A probability in 0..=1 (min-p).
fn parse_unit(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("{s}: a number between 0 and 1")),
    }
}

/// A finite number above 0 (the repetition penalty).
fn parse_positive(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!("{s}: a number above 0 (1 is off)")),
    }
}

/// A presence or frequency penalty, in -2..=2 as OpenAI's.
fn parse_penalty(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if (-2.0..=2.0).contains(&x) => Ok(x),
        _ => Err(format!("{s}: a number between -2 and 2 (0 is off)")),
    }
}

/// A probability in (0, 1] (top-p).
fn parse_unit_open(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("{s}: a number above 0 and at most 1")),
    }
}
