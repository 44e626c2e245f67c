//! ember-checkpoint: reads Hugging Face checkpoint files, in place.
//!
//! The principal types are [`SafetensorsSet`] (every `.safetensors` file of a checkpoint) and
//! [`GgufFile`], both mapped through the engine's [`BufferOwner`](ember_tensor::BufferOwner)
//! and both a [`TensorSource`]: each tensor's dtype, shape and bytes looked up by its Hugging
//! Face name. [`read_json`] loads the JSON side files with errors that
//! name the file. This crate knows formats, not architectures.

mod error;
pub mod gguf;
mod json;
mod safetensors_set;

pub use error::{CheckpointError, Result};
pub use gguf::GgufFile;
pub use json::read_json;
pub use safetensors_set::{SafetensorsSet, TensorEntry, TensorRef};

/// Tensors by their Hugging Face names, whatever the file format.
pub trait TensorSource {
    fn get(&self, name: &str) -> Result<TensorRef<'_>>;

    fn contains(&self, name: &str) -> bool;

    /// Looks a tensor up and checks its shape (rows-major, as in PyTorch).
    fn get_shaped(&self, name: &str, expected: &[usize]) -> Result<TensorRef<'_>> {
        let tensor = self.get(name)?;
        if tensor.shape != expected {
            return Err(CheckpointError::TensorShape {
                path: tensor.path.into(),
                name: tensor.name.into(),
                expected: expected.to_vec(),
                found: tensor.shape.to_vec(),
            });
        }
        Ok(tensor)
    }
}

impl TensorSource for SafetensorsSet {
    fn get(&self, name: &str) -> Result<TensorRef<'_>> {
        SafetensorsSet::get(self, name)
    }

    fn contains(&self, name: &str) -> bool {
        SafetensorsSet::contains(self, name)
    }
}

impl TensorSource for GgufFile {
    fn get(&self, name: &str) -> Result<TensorRef<'_>> {
        match gguf::hf_to_gguf_name(name) {
            Some(gguf_name) => self.get_gguf(&gguf_name, name),
            None => Err(CheckpointError::MissingTensor {
                path: self.path().into(),
                name: name.into(),
            }),
        }
    }

    fn contains(&self, name: &str) -> bool {
        gguf::hf_to_gguf_name(name).is_some_and(|n| self.contains_gguf(&n))
    }
}
