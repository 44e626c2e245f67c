//! What holding a region resident means on a CUDA machine ([`CudaResidency`]): device memory is
//! resident by nature and only counted; staging memory (host buffers the GPU copies to and
//! from) is page-locked with the driver, so transfers run straight from it instead of through
//! the driver's own bounce buffer; other host memory (the program's code, host-side caches) is
//! locked by mlock as on any machine.

use cudarc::driver::sys;
use ember_residency::{Backend, BackendError, BackendOp, MlockBackend, Region, RegionKind};

use super::CudaDevice;

/// The residency backend of an engine running on a CUDA device.
pub struct CudaResidency {
    device: CudaDevice,
    host: MlockBackend,
}

impl CudaResidency {
    pub fn new(device: CudaDevice) -> Self {
        CudaResidency {
            device,
            host: MlockBackend::new(),
        }
    }

    fn refused(
        &self,
        op: BackendOp,
        call: &str,
        r: &Region,
        e: impl std::fmt::Display,
    ) -> BackendError {
        BackendError {
            op,
            errno: None,
            message: format!("{call} of {} bytes at {:#x}: {e}", r.len, r.addr),
            hint: "the CUDA driver refused to page-lock host memory".into(),
            advice: "run without --residency required (transfers then go through the driver's own buffer)"
                .into(),
        }
    }
}

impl Backend for CudaResidency {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn prepare(&self, host_bytes: usize) -> Result<(), BackendError> {
        self.host.prepare(host_bytes)
    }

    fn hold(&self, r: &Region) -> Result<(), BackendError> {
        match r.kind {
            RegionKind::Device => Ok(()),
            RegionKind::Host => self.host.hold(r),
            RegionKind::Staging if r.len == 0 => Ok(()),
            RegionKind::Staging => {
                let call = "cuMemHostRegister";
                self.device
                    .bind()
                    .map_err(|e| self.refused(BackendOp::Hold, call, r, e))?;
                // Portable: page-locked for every context, so each GPU of a split model copies
                // straight from it.
                let portable = sys::CU_MEMHOSTREGISTER_PORTABLE;
                // SAFETY: a staging region is whole pages of a live heap buffer of its own (the
                // owner makes it so), registered once here and unregistered before it is freed.
                unsafe { sys::cuMemHostRegister_v2(r.addr as *mut _, r.len, portable) }
                    .result()
                    .map_err(|e| self.refused(BackendOp::Hold, call, r, e))
            }
        }
    }

    fn release(&self, r: &Region) -> Result<(), BackendError> {
        match r.kind {
            RegionKind::Device => Ok(()),
            RegionKind::Host => self.host.release(r),
            RegionKind::Staging if r.len == 0 => Ok(()),
            RegionKind::Staging => {
                let call = "cuMemHostUnregister";
                self.device
                    .bind()
                    .map_err(|e| self.refused(BackendOp::Release, call, r, e))?;
                // The device may still be copying from it: wait, then unregister.
                self.device
                    .synchronize()
                    .map_err(|e| self.refused(BackendOp::Release, call, r, e))?;
                // SAFETY: the region was registered by `hold` and is still allocated.
                unsafe { sys::cuMemHostUnregister(r.addr as *mut _) }
                    .result()
                    .map_err(|e| self.refused(BackendOp::Release, call, r, e))
            }
        }
    }

    fn warm(&self, r: &Region, skip: usize, stop: &dyn Fn() -> bool) -> usize {
        self.host.warm(r, skip, stop)
    }
}
