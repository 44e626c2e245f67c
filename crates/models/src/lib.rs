//! ember-models: one decoder-only transformer for Llama, Qwen2, Qwen3 and Qwen3-MoE.
//!
//! - [`ModelConfig`] reads `config.json` in any of its spellings.
//! - [`Transformer`] holds the weights in a [`Backend`]'s memory and runs one forward pass,
//!   written once, through the backend's kernels over its KV cache and activation slots.
//! - [`CpuBackend`]: weights read in place from the mapped checkpoint, the CPU kernels, a
//!   [`KvPool`] of blocks and a [`Workspace`] of host buffers.
//!
//! Architecture invariant: the model names no kernel instruction set and no file format
//! beyond tensor names; it holds no per-sequence state (the KV cache is passed in).

pub mod backend;
pub mod config;
mod cpu_backend;
mod cuda_backend;
mod error;
mod kv_cache;
pub mod parallel;
mod rope;
mod transformer;
mod weights;
mod workspace;

pub use backend::{Backend, KvStore, PICKS_AHEAD, PassSegment, PassShape, Slot, TunedProduct};
pub use config::{Architecture, ModelConfig, MoeConfig};
pub use cpu_backend::{Arithmetic, CpuBackend};
pub use cuda_backend::{CudaBackend, CudaCollectives, CudaKvPool, CudaOptions, NcclRanks};
pub use error::{Error, Result};
pub use kv_cache::{BlockTable, KV_BLOCK_SIZE, KvDtype, KvLayout, KvPool};
pub use transformer::{
    Attention, FeedForward, Layer, Linear, Logits, Mlp, Moe, PassInput, SequencePass, Transformer,
};
pub use weights::{Matrix, Vector};
pub use workspace::Workspace;
