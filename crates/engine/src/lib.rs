//! ember-engine: a model loaded and generating.
//!
//! The principal type is [`Engine`]: weights mapped in place, tokenizer, chat template, KV
//! cache and activations, all made through one [`BufferOwner`](ember_tensor::BufferOwner).
//! Around it: [`tokenizer`], [`chat_template`], streaming [`detokenizer`], [`sampler`], the
//! [`mod@bench`] measurements and [`synthetic`] random-weight checkpoints.

pub mod bench;
pub mod chat_template;
pub mod constraint;
pub mod detokenizer;
pub mod draft;
mod engine;
mod error;
mod gguf_tokenizer;
pub(crate) mod kv;
pub mod prompt_cache;
mod runner;
pub mod sampler;
pub mod scheduler;
pub mod synthetic;
pub mod tokenizer;

pub use ember_models::KvDtype;
pub use engine::{
    BatchEvent, Collectives, DEFAULT_CONTEXT, DEFAULT_PARALLEL_CPU, DEFAULT_PARALLEL_CUDA,
    DEFAULT_PREFILL_CHUNK_CPU, DEFAULT_PREFILL_CHUNK_CUDA, DefaultsSource, Device, DraftStats,
    Engine, EngineOptions, FinishReason, GenerateParams, Generation, LLAMA_SERVER_DEFAULTS,
    OPENAI_DEFAULTS, PromptEncoder, RankFault, ResidencyMode, SamplingDefaults, Step, StepTiming,
};
pub use error::{Error, Result};
