//! ember-tensor: the memory the engine computes in, and the kernels that compute.
//!
//! - [`buffer`]: [`BufferOwner`], the one place engine memory is made, listed and freed.
//! - [`pool`]: [`ThreadPool`], the compute threads kernels split their work over.
//! - [`cuda`]: the CUDA device, its listed memory and kernels (loaded at run time; absent
//!   CUDA is an error value, never a build or link requirement).
//! - [`cpu`]: CPU kernels (matrix products, attention, norms), dispatched at run time over
//!   AVX-512, AVX2 and a portable fallback.
//! - [`dtype`]: the stored element types.
//! - [`quant`]: ggml's block-quantized formats (layouts, dequantization, activation
//!   quantization).
//!
//! Architecture invariant: this crate knows no model and no file format beyond "a file that is
//! mapped". Only this crate allocates or maps engine memory.

pub mod buffer;
pub mod cpu;
pub mod cuda;
pub mod dtype;
mod error;
pub mod pool;
pub mod quant;

pub use buffer::{Buffer, BufferId, BufferInfo, BufferKind, BufferOwner, Location};
pub use dtype::DType;
pub use error::{Error, Result};
pub use pool::ThreadPool;
