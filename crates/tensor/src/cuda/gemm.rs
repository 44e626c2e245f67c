//! Prefill products through cuBLASLt: 16-bit operands, f32 accumulation.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::{result as lt, sys};

use super::kernels::Float;
use super::{
    CudaDevice, CudaError, DevMat, DevSlice, DevSliceMut, DeviceBuffer, FloatElem, ensure,
};
use crate::buffer::{BufferKind, BufferOwner};

/// cuBLASLt's workspace; 32 MiB is NVIDIA's advice for Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

/// Runs `out = a · Wᵀ` for activations `a` `[m, k]` and weights `W` `[n, k]` (a HF Linear),
/// both bf16 (or both f16), into f32 or bf16 `out` `[m, n]`.
///
/// Holds the workspace (listed by the buffer owner) and one plan per shape: layouts and the
/// algorithm cuBLASLt's heuristic picked, so a repeated shape costs only the launch.
pub struct Gemm {
    device: CudaDevice,
    workspace: DeviceBuffer,
    plans: Mutex<HashMap<PlanKey, Plan>>,
}

impl std::fmt::Debug for Gemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gemm")
            .field("device", &self.device.ordinal())
            .field("workspace", &self.workspace.len())
            .finish()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    input: Float,
    output: Float,
}

impl Gemm {
    pub fn new(device: &CudaDevice, owner: &BufferOwner) -> Result<Gemm, CudaError> {
        let workspace = owner.alloc_device(
            BufferKind::Scratch,
            "cublaslt workspace",
            device,
            WORKSPACE_BYTES,
        )?;
        Ok(Gemm {
            device: device.clone(),
            workspace,
            plans: Mutex::default(),
        })
    }

    /// `out = a · Wᵀ`, or `out += a · Wᵀ` with `accumulate` (straight into the residual
    /// stream). `a` has `w.cols` values per row; `out` has `w.rows`.
    pub fn matmul<A: FloatElem, O: FloatElem>(
        &self,
        a: DevSlice<'_, A>,
        w: &DevMat<'_>,
        out: &mut DevSliceMut<'_, O>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let input = A::FLOAT;
        let m = product_rows("gemm", &a, w, out)?;
        let (n, k) = (w.rows, w.cols);
        if m == 0 || n == 0 {
            return Ok(());
        }
        let key = PlanKey {
            m,
            n,
            k,
            input,
            output: O::FLOAT,
        };
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        let plan = match plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                e.insert(Plan::new(self.device.blas_handle(), key, WORKSPACE_BYTES)?)
            }
        };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        self.device
            .stream()
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let out_ptr = out.device_ptr() as *mut c_void;
        // SAFETY: the plan's layouts match the checked lengths of `w`, `a` and `out`; the
        // workspace is WORKSPACE_BYTES of device memory that only this stream uses.
        unsafe {
            lt::matmul(
                self.device.blas_handle(),
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w.data.device_ptr() as *const c_void,
                plan.weights.0,
                a.device_ptr() as *const c_void,
                plan.activations.0,
                out_ptr,
                plan.out.0,
                out_ptr,
                plan.out.0,
                &plan.algo,
                self.workspace.device_ptr() as *mut c_void,
                WORKSPACE_BYTES,
                self.device.stream().cu_stream().cast(),
            )
        }
        .map_err(CudaError::blas("cublasLtMatmul"))
    }
}

/// The rows `m` of a product `out [m, n] = a [m, k] · W [n, k]ᵀ` of 16-bit activations and
/// weights of the same type, after checking the shapes agree (errors name `op`).
pub(super) fn product_rows<A: FloatElem, O: FloatElem>(
    op: &'static str,
    a: &DevSlice<'_, A>,
    w: &DevMat<'_>,
    out: &DevSliceMut<'_, O>,
) -> Result<usize, CudaError> {
    let input = A::FLOAT;
    ensure!(
        input != Float::F32 && w.dtype == input,
        op,
        "activations {input} and weights {} (both bf16 or both f16)",
        w.dtype
    );
    let (n, k) = (w.rows, w.cols);
    ensure!(
        k > 0 && a.len().is_multiple_of(k),
        op,
        "{} activations in rows of {k}",
        a.len()
    );
    let m = a.len() / k;
    ensure!(
        out.len() == m * n,
        op,
        "out of {} values for {m}×{n}",
        out.len()
    );
    Ok(m)
}

fn data_type(f: Float) -> sys::cudaDataType {
    match f {
        Float::F32 => sys::cudaDataType::CUDA_R_32F,
        Float::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        Float::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// Column-major, as cuBLAS sees it: row-major `W [n, k]` is `k × n` (ld k), transposed to
/// `n × k`; row-major `a [m, k]` is `k × m` (ld k); row-major `out [m, n]` is `n × m` (ld n).
/// So `outᵀ = W · aᵀ` is a "TN" product, the layout the tensor-core kernels like best.
struct Plan {
    desc: Desc,
    weights: Layout,
    activations: Layout,
    out: Layout,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host-side objects, used under the plans' lock.
unsafe impl Send for Plan {}

impl Plan {
    fn new(
        handle: sys::cublasLtHandle_t,
        key: PlanKey,
        workspace: usize,
    ) -> Result<Plan, CudaError> {
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let input = data_type(key.input);
        let desc = Desc(
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            )
            .map_err(CudaError::blas("cublasLtMatmulDescCreate"))?,
        );
        let transpose = cublasOperation_t::CUBLAS_OP_T as i32;
        // SAFETY: a live descriptor; the attribute is an i32 operation.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transpose as *const i32).cast(),
                size_of::<i32>(),
            )
        }
        .map_err(CudaError::blas("setting TRANSA"))?;
        let layout = |t, rows, cols, ld| {
            lt::create_matrix_layout(t, rows, cols, ld)
                .map(Layout)
                .map_err(CudaError::blas("cublasLtMatrixLayoutCreate"))
        };
        let weights = layout(input, k, n, k as i64)?;
        let activations = layout(input, k, m, k as i64)?;
        let out = layout(data_type(key.output), n, m, n as i64)?;
        let pref = Pref(
            lt::create_matmul_pref().map_err(CudaError::blas("cublasLtMatmulPreferenceCreate"))?,
        );
        let bytes = workspace as u64;
        // SAFETY: a live preference; the attribute is a u64 byte count.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                size_of::<u64>(),
            )
        }
        .map_err(CudaError::blas("setting the workspace size"))?;
        // SAFETY: every descriptor is live.
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(
                handle,
                desc.0,
                weights.0,
                activations.0,
                out.0,
                out.0,
                pref.0,
            )
        }
        .map_err(CudaError::blas(
            "finding an algorithm (cublasLtMatmulAlgoGetHeuristic)",
        ))?;
        Ok(Plan {
            desc,
            weights,
            activations,
            out,
            algo: heuristic.algo,
        })
    }
}

struct Desc(sys::cublasLtMatmulDesc_t);
struct Layout(sys::cublasLtMatrixLayout_t);
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        if let Err(e) = unsafe { lt::destroy_matmul_desc(self.0) } {
            tracing::warn!("cublasLtMatmulDescDestroy failed: {e}");
        }
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        if let Err(e) = unsafe { lt::destroy_matrix_layout(self.0) } {
            tracing::warn!("cublasLtMatrixLayoutDestroy failed: {e}");
        }
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        if let Err(e) = unsafe { lt::destroy_matmul_pref(self.0) } {
            tracing::warn!("cublasLtMatmulPreferenceDestroy failed: {e}");
        }
    }
}
