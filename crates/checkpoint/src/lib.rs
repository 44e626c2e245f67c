//! ember-checkpoint: reads Hugging Face checkpoint files, in place.
//!
//! The principal type is [`SafetensorsSet`]: every `.safetensors` file of a checkpoint mapped
//! through the engine's [`BufferOwner`](ember_tensor::BufferOwner), with each tensor's dtype,
//! shape and bytes looked up by name. [`read_json`] loads the JSON side files with errors that
//! name the file. This crate knows formats, not architectures.

mod error;
mod json;
mod safetensors_set;

pub use error::{CheckpointError, Result};
pub use json::read_json;
pub use safetensors_set::{SafetensorsSet, TensorEntry, TensorRef};
