//! CUDA: the device, its memory, and the kernels the model code calls.
//!
//! Everything is loaded at run time (cudarc with `dynamic-loading`): building and testing
//! need no CUDA, and a machine without it gets a [`CudaError::Unavailable`] naming the missing
//! library from [`CudaDevice::open`], never a panic.
//!
//! - [`CudaDevice`]: context, one stream, the cuBLASLt handle, kernels compiled by NVRTC for
//!   the device's architecture on first use and cached on disk ([`compile`]).
//! - Memory: [`BufferOwner::alloc_device`](crate::BufferOwner::alloc_device) makes a
//!   [`DeviceBuffer`], listed with the host buffers; ops take typed views of it
//!   ([`DevSlice`], [`DevSliceMut`], [`DevMat`] for weights).
//! - Ops, one file per family, each a `.cu` in `kernels/` with a typed launcher here:
//!   [`SlicedGemm`] (batch-invariant products of every batch size, on the tensor cores),
//!   [`matvec()`] (decode), [`Gemm`] (prefill, cuBLASLt), [`rms_norm()`], [`rope()`],
//!   [`silu_mul()`], [`add()`], [`convert()`], [`embedding()`], [`argmax()`],
//!   [`attention_decode()`] and [`attention_prefill()`]; a mixture-of-experts layer's
//!   [`moe_route()`], [`matvec_experts()`] or [`experts_mma()`], and [`moe_combine()`].
//!
//! Numerics: every sum is f32. Weights are f32, bf16 or f16 as stored; the residual stream,
//! norms, RoPE, attention queries and outputs are f32; the KV cache is f32, bf16 or f16
//! (written with [`convert()`]); prefill GEMMs take bf16 activations ([`rms_norm()`] and
//! [`silu_mul()`] can write them directly) and give f32 or bf16.
//!
//! Ops enqueue on the device's stream and return at once, so a sequence of them can be
//! recorded once and replayed ([`Graph`], [`CudaDevice::record`]); [`CudaDevice::download`] (or
//! [`CudaDevice::synchronize`]) waits. A failed launch is an `Err`; a fault inside a kernel
//! shows at the next wait.

pub mod compile;
mod device;
mod error;
mod graph;
pub(crate) mod kernels;
mod memory;

mod argmax;
mod attention;
mod elementwise;
mod embedding;
mod gemm;
mod matvec;
mod moe;
mod nccl;
mod residency;
mod rms_norm;
mod rope;
mod sliced_gemm;
mod tensor_map;

pub use argmax::{argmax, argmax_scratch_len};
pub use attention::{
    AttentionPrecision, DecodeContext, DecodeRope, DecodeRows, MAX_HEAD_DIM, PagedCache,
    PagedCacheMut, attention_decode, attention_decode_rope, attention_decode_rope_fits,
    attention_decode_scratch_len, attention_decode_scratch_reset, attention_prefill,
    attention_prefill_scratch_len, attention_prompt_rows, attention_prompt_rows_max_context,
    kv_store,
};
pub use device::{CudaDevice, DeviceInfo, StreamEvent};
pub use elementwise::{
    SPLIT_MAX_OUTPUTS, add, convert, silu_mul, silu_mul_in_place, split_columns, sum_parts,
};
pub use embedding::{embedding, embedding_part};
pub use error::CudaError;
pub use gemm::Gemm;
pub use graph::Graph;
pub use kernels::{Float, Module};
pub use matvec::{
    Epilogue, MAX_BATCH, MAX_OUTPUTS, MatvecNorm, MatvecOutput, matvec, matvec_bytes,
    matvec_experts, matvec_fused,
};
pub use memory::{DevMat, DevSlice, DevSliceMut, DeviceBuffer, DeviceElem, FloatElem};
pub use moe::{
    EXPERT_MMA_PAIRS, ExpertRoad, ExpertTable, ExpertTiles, MAX_EXPERTS, MAX_TOP_K, Routes,
    Routing, experts_mma, moe_combine, moe_route,
};
pub use nccl::{NcclGroup, nccl_version};
pub use residency::CudaResidency;
pub use rms_norm::{add_rms_norm, rms_norm, rms_norm_in_place};
pub use rope::{RopeHeads, RopeNorm, rope, rope_qk};
pub use sliced_gemm::{
    MAX_OUTPUTS as SLICED_MAX_OUTPUTS, SlicedGemm, SlicedTile, TunedPlan, slice_len,
};

use error::ensure;

/// A position (or a count of positions) a kernel needs: known on the host when the launch is
/// enqueued, or read by the kernel from device memory when it runs, so that a recorded CUDA
/// graph replays with the value of the step at hand. Both give the same arithmetic.
#[derive(Clone, Copy, Debug)]
pub enum Position<'a> {
    Host(usize),
    /// One `i32`.
    Device(DevSlice<'a, i32>),
}

impl Position<'_> {
    /// The kernel's `(int host, const int* device)` pair; the pointer is null for `Host`.
    fn args(self, op: &'static str, what: &str) -> Result<(i32, u64), CudaError> {
        match self {
            Position::Host(v) => Ok((int(op, what, v)?, 0)),
            Position::Device(slot) => {
                ensure!(
                    slot.len() == 1,
                    op,
                    "{what} in {} values, not one",
                    slot.len()
                );
                Ok((0, slot.device_ptr()))
            }
        }
    }

    /// The value, where the host knows it.
    fn host(self) -> Option<usize> {
        match self {
            Position::Host(v) => Some(v),
            Position::Device(_) => None,
        }
    }
}

/// Threads of the element-wise and row kernels.
const THREADS: u32 = 256;

/// `v` as a kernel's `int`, or an error naming the op and the quantity.
fn int(op: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::invalid(op, format!("{what} = {v} passes i32")))
}

/// Blocks for a grid-stride loop over `n` elements: enough to fill the device, no more.
fn stride_blocks(device: &CudaDevice, n: usize) -> u32 {
    let full = n.div_ceil(THREADS as usize);
    full.clamp(1, device.info().multiprocessors * 8) as u32
}

fn config(grid: (u32, u32), threads: u32, smem: usize) -> cudarc::driver::LaunchConfig {
    config3((grid.0, grid.1, 1), threads, smem)
}

/// [`config`] with a third grid dimension.
fn config3(grid: (u32, u32, u32), threads: u32, smem: usize) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}
