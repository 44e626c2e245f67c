//! ember-models: one decoder-only transformer for Llama, Qwen2, Qwen3 and Qwen3-MoE.
//!
//! - [`ModelConfig`] reads `config.json` in any of its spellings.
//! - [`Transformer`] holds the weights (views into the mapped checkpoint) and runs a forward
//!   pass over a [`KvCache`] with a [`Workspace`] of activations.
//!
//! Architecture invariant: the model names no kernel instruction set and no file format
//! beyond tensor names; it holds no per-sequence state (the KV cache is passed in).

pub mod config;
mod error;
mod kv_cache;
mod rope;
mod transformer;
mod weights;
mod workspace;

pub use config::{Architecture, ModelConfig, MoeConfig};
pub use error::{Error, Result};
pub use kv_cache::{KvCache, KvDtype};
pub use transformer::{Logits, Transformer};
pub use weights::Matrix;
pub use workspace::Workspace;
