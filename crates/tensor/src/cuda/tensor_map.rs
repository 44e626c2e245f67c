//! Tensor maps: how the tensor memory accelerator (TMA, Hopper on) reads a matrix in global
//! memory, box by box, into shared memory.

use cudarc::driver::sys as drv_sys;

use super::CudaError;
use super::kernels::Float;

/// A tensor map of the 16-bit row-major matrix `[rows, cols]` at `ptr`, read in boxes of
/// `boxes = (values, rows)` under the 128-byte swizzle (the layout wgmma's swizzled
/// descriptors read; a box's rows are at most 128 bytes); the TMA fills what lies past the
/// matrix with zeros, and counts those bytes as read.
pub(super) fn tensor_map(
    float: Float,
    ptr: u64,
    rows: usize,
    cols: usize,
    boxes: (u32, u32),
) -> Result<drv_sys::CUtensorMap, CudaError> {
    use drv_sys::{
        CUtensorMapDataType as Ty, CUtensorMapFloatOOBfill as Fill,
        CUtensorMapInterleave as Interleave, CUtensorMapL2promotion as L2,
        CUtensorMapSwizzle as Swizzle,
    };
    let ty = match float {
        Float::Bf16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        Float::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        Float::F32 => {
            return Err(CudaError::Invalid {
                op: "tensor_map",
                message: "f32 matrix (16-bit only)".into(),
            });
        }
    };
    let dims = [cols as u64, rows as u64];
    let strides = [(cols * 2) as u64];
    let boxes = [boxes.0, boxes.1];
    let element_strides = [1u32, 1];
    let mut map = drv_sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: valid out-pointer and arrays of the rank's lengths; the driver checks the
    // address's and the stride's alignment and returns an error for what it cannot map.
    unsafe {
        drv_sys::cuTensorMapEncodeTiled(
            &mut map,
            ty,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            Interleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            Fill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(CudaError::driver("cuTensorMapEncodeTiled"))?;
    Ok(map)
}
