//! [`CudaDevice`]: one GPU, opened without panicking whatever the machine lacks.

use std::collections::HashMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as blas, sys as blas_sys};
use cudarc::driver::sys::{
    self as drv_sys, CUdevice_attribute, CUevent_flags, CUfunction_attribute,
};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, LaunchConfig, result as drv,
};
use cudarc::nvrtc::Ptx;

use super::compile::{Compiler, arch_name, in_parallel, nvrtc_version};
use super::error::{CudaError, ensure};
use super::kernels::{Kernel, Module};
use super::memory::{DevSlice, DevSliceMut, DeviceElem, DeviceMemory};

/// What [`CudaDevice::probe`] and [`CudaDevice::info`] report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// Devices the driver sees.
    pub count: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: usize,
    pub memory_bytes: usize,
    pub l2_bytes: usize,
    /// Shared memory one block may take when its kernel asks for more than the default 48 KiB.
    pub max_shared_per_block: usize,
    /// `(major, minor)` of the CUDA version the driver supports.
    pub driver: (i32, i32),
    pub nvrtc: (i32, i32),
}

impl DeviceInfo {
    /// The NVRTC target for this device, `sm_90` on an H100/H200.
    pub fn arch(&self) -> String {
        arch_name(self.compute_capability)
    }
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (device {} of {}, {}, {} SMs, {:.1} GiB, driver CUDA {}.{}, NVRTC {}.{})",
            self.name,
            self.ordinal,
            self.count,
            self.arch(),
            self.multiprocessors,
            self.memory_bytes as f64 / (1u64 << 30) as f64,
            self.driver.0,
            self.driver.1,
            self.nvrtc.0,
            self.nvrtc.1,
        )
    }
}

/// cudarc's check that a library loads (it tries the same file names it loads later).
type Present = unsafe fn() -> bool;

/// The libraries CUDA needs, as [`CudaError::Unavailable`] names them.
const LIBRARIES: [(&str, Present); 4] = [
    (
        "libcuda.so.1 (the NVIDIA driver)",
        cudarc::driver::sys::is_culib_present,
    ),
    (
        "libnvrtc.so.13 (NVRTC, the CUDA run-time compiler)",
        cudarc::nvrtc::sys::is_culib_present,
    ),
    (
        "libcublas.so.13 (cuBLAS)",
        cudarc::cublas::sys::is_culib_present,
    ),
    (
        "libcublasLt.so.13 (cuBLASLt)",
        cudarc::cublaslt::sys::is_culib_present,
    ),
];

/// The error for the libraries that are missing, or `None` when all load.
fn missing_libraries() -> Option<CudaError> {
    let missing: Vec<&str> = LIBRARIES
        .iter()
        // SAFETY: the check only dlopens and closes the library.
        .filter(|(_, present)| !unsafe { present() })
        .map(|(name, _)| *name)
        .collect();
    unavailable(&missing)
}

fn unavailable(missing: &[&str]) -> Option<CudaError> {
    (!missing.is_empty()).then(|| CudaError::Unavailable {
        missing: missing.join(", "),
    })
}

/// One CUDA device: its context, the one stream every op runs on in order, the cuBLASLt
/// handle, and the kernel modules compiled for it (on first use). Cheap to clone; clones share
/// all of it.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

// Field order is drop order: modules and handles before the stream, the stream before the
// context.
struct Inner {
    kernels: Mutex<Kernels>,
    blas: BlasHandle,
    compiler: Compiler,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    /// Kernels are launched to overlap the one before ([`CudaDevice::launch_kernel`]).
    overlap_launches: bool,
}

#[derive(Default)]
struct Kernels {
    modules: HashMap<Module, Arc<CudaModule>>,
    functions: HashMap<Kernel, CudaFunction>,
}

struct BlasHandle(blas_sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle may be used from any thread, one call at a time; ember's ops take
// it from one thread per device.
unsafe impl Send for BlasHandle {}
unsafe impl Sync for BlasHandle {}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtCreate, destroyed once here.
        if let Err(e) = unsafe { blas::destroy_handle(self.0) } {
            tracing::warn!("cublasLtDestroy failed: {e}");
        }
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaDevice({})", self.inner.info)
    }
}

impl CudaDevice {
    /// Opens device `ordinal`. Fails, never panics, when a CUDA library is missing (the error
    /// names which), when there is no such device, or when the driver refuses.
    pub fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        if let Some(e) = missing_libraries() {
            return Err(e);
        }
        // The libraries resolve symbols lazily and panic on a missing one; a driver older than
        // the bindings expect must still be an error.
        catch_unwind(AssertUnwindSafe(|| Self::open_checked(ordinal))).unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(CudaError::Panicked {
                op: "opening the device",
                message,
            })
        })
    }

    /// Which GPU `--device auto` would take (device 0), or why there is none; for the log.
    pub fn probe() -> Result<DeviceInfo, CudaError> {
        CudaDevice::open(0).map(|d| d.info().clone())
    }

    fn open_checked(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let count =
            CudaContext::device_count().map_err(CudaError::driver("cuDeviceGetCount"))? as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("creating the context"))?;
        // cudarc's event tracking orders its own `CudaSlice`s across streams, and to start it
        // the first `new_stream` synchronises the whole context: an error while another
        // engine in this process records a graph on the same (primary) context, as parallel
        // tests do. ember makes no `CudaSlice`: its buffers are raw allocations used on one
        // stream, freed after that stream drains (`free`), so the tracking has nothing to do.
        // SAFETY: no `CudaSlice` is made on this context by ember; the rules it lifts are
        // for those.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(CudaError::driver("creating a stream"))?;
        let attribute = |a| {
            ctx.attribute(a)
                .map_err(CudaError::driver("cuDeviceGetAttribute"))
        };
        let mut driver = 0;
        // SAFETY: a valid out-pointer.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(CudaError::driver("cuDriverGetVersion"))?;
        let info = DeviceInfo {
            ordinal,
            count,
            name: ctx.name().map_err(CudaError::driver("cuDeviceGetName"))?,
            compute_capability: ctx
                .compute_capability()
                .map_err(CudaError::driver("reading the compute capability"))?,
            multiprocessors: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )? as usize,
            memory_bytes: ctx
                .total_mem()
                .map_err(CudaError::driver("cuDeviceTotalMem"))?,
            l2_bytes: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            max_shared_per_block: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as usize,
            driver: (driver / 1000, driver % 1000 / 10),
            nvrtc: nvrtc_version()?,
        };
        let blas = BlasHandle(blas::create_handle().map_err(CudaError::blas("cublasLtCreate"))?);
        // Programmatic dependent launch came with compute capability 9.0. EMBER_NO_PDL=1 turns
        // it off, to measure what it brings or to rule it out.
        let overlap_launches = info.compute_capability >= (9, 0)
            && std::env::var_os("EMBER_NO_PDL").is_none_or(|v| v.is_empty() || v == "0");
        tracing::debug!("overlapping kernel launches: {overlap_launches}");
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                kernels: Mutex::default(),
                blas,
                compiler: Compiler::new(info.arch(), info.nvrtc),
                stream,
                ctx,
                info,
                overlap_launches,
            }),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    pub fn ordinal(&self) -> usize {
        self.inner.info.ordinal
    }

    /// The stream every op of this device is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    pub(crate) fn blas_handle(&self) -> blas_sys::cublasLtHandle_t {
        self.inner.blas.0
    }

    /// Compiles (or loads from the cache) every kernel module now, and looks up every entry
    /// point, so that no op compiles or loads code on first use (the driver loads a function's
    /// code when it is first looked up: lazy module loading is CUDA's default), and none does
    /// while a graph is being captured.
    pub fn load_all(&self) -> Result<(), CudaError> {
        let capability = self.info().compute_capability;
        {
            let mut kernels = self.kernels();
            let modules: Vec<Module> = Module::ALL
                .into_iter()
                .filter(|m| capability >= m.min_compute_capability())
                .filter(|m| !kernels.modules.contains_key(m))
                .collect();
            let compiler = &self.inner.compiler;
            let images = in_parallel(&modules, |m| compiler.cubin(m, false));
            for (module, image) in modules.into_iter().zip(images) {
                self.load_module(&mut kernels, module, image?)?;
            }
        }
        for kernel in Kernel::all() {
            if capability < kernel.module().min_compute_capability() {
                continue;
            }
            // One this device cannot run (more shared memory than it has) fails when used,
            // with the same error, not here: the model may never need it.
            if let Err(e) = self.function(kernel) {
                tracing::debug!("kernel {} not loaded: {e}", kernel.symbol());
            }
        }
        Ok(())
    }

    fn kernels(&self) -> std::sync::MutexGuard<'_, Kernels> {
        // A panic while holding the lock leaves at worst a module loaded but not listed.
        self.inner.kernels.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn module(&self, kernels: &mut Kernels, module: Module) -> Result<Arc<CudaModule>, CudaError> {
        if let Some(m) = kernels.modules.get(&module) {
            return Ok(Arc::clone(m));
        }
        let cubin = self.inner.compiler.cubin(module, false)?;
        self.load_module(kernels, module, cubin)
    }

    /// Loads a module from its compiled (or cached) image and lists it.
    fn load_module(
        &self,
        kernels: &mut Kernels,
        module: Module,
        cubin: Vec<u8>,
    ) -> Result<Arc<CudaModule>, CudaError> {
        let load = |cubin: Vec<u8>| self.inner.ctx.load_module(Ptx::from_binary(cubin));
        let loaded = match load(cubin) {
            Ok(m) => m,
            // A cached image the driver refuses (damaged, or from another driver): rebuild it.
            Err(e) => {
                tracing::warn!(
                    "cached {}.cu did not load ({e}); recompiling",
                    module.name()
                );
                load(self.inner.compiler.cubin(module, true)?)
                    .map_err(CudaError::driver("cuModuleLoadData"))?
            }
        };
        kernels.modules.insert(module, Arc::clone(&loaded));
        Ok(loaded)
    }

    /// The loaded entry point of `kernel`.
    pub(crate) fn function(&self, kernel: Kernel) -> Result<CudaFunction, CudaError> {
        let mut kernels = self.kernels();
        if let Some(f) = kernels.functions.get(&kernel) {
            return Ok(f.clone());
        }
        let module = self.module(&mut kernels, kernel.module())?;
        let function = module
            .load_function(&kernel.symbol())
            .map_err(CudaError::driver("cuModuleGetFunction"))?;
        // A block takes up to 48 KB of shared memory, static and dynamic together, without
        // asking; past that the function must be opted in, even when its dynamic part alone is
        // under 48 KB.
        let dynamic = kernel.dynamic_smem_bytes().filter(|&b| b > 0);
        let fixed = match dynamic {
            Some(_) => function
                .shared_size_bytes()
                .map_err(CudaError::driver("reading a kernel's shared memory"))?
                as usize,
            None => 0,
        };
        if let Some(bytes) = dynamic.filter(|&b| fixed + b > 48 * 1024) {
            // As much as asked for, or as much as this device gives a block beside the
            // kernel's static shared memory: the launch asks for what it needs (more fails
            // with the driver's error, naming the kernel).
            let bytes = bytes.min(self.info().max_shared_per_block.saturating_sub(fixed));
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(CudaError::driver("raising the shared-memory limit"))?;
        }
        kernels.functions.insert(kernel, function.clone());
        Ok(function)
    }

    /// Enqueues `kernel` on the stream, `params` pointing at its arguments.
    ///
    /// From compute capability 9.0 the launch lets the kernel start while the one before it
    /// is still running (programmatic dependent launch): its blocks are scheduled as the
    /// other's last ones finish, and wait in `grid_dependency_wait()` (common.cuh), which
    /// every kernel calls before it touches memory, until the one before has finished and its
    /// writes are visible. So the results are those of plain stream order, and what overlaps
    /// is the launch and the ramp up of the next kernel (a few microseconds of each of a
    /// decode step's hundreds of launches). Graph capture records the same overlap.
    ///
    /// # Safety
    /// `params` point at live values of the kernel's parameter types, in order, and every
    /// range the kernel reads or writes is live device memory.
    pub(crate) unsafe fn launch_kernel(
        &self,
        kernel: Kernel,
        config: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        let function = self.function(kernel)?;
        self.bind()?;
        let mut overlap = drv_sys::CUlaunchAttribute {
            id: drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: drv_sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let launch = drv_sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.inner.stream.cu_stream(),
            attrs: &mut overlap,
            numAttrs: u32::from(self.inner.overlap_launches),
        };
        // SAFETY: a loaded function of a live module, a live stream, and the caller's promise
        // on the parameters.
        unsafe {
            drv_sys::cuLaunchKernelEx(
                &launch,
                function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|source| CudaError::Launch {
            kernel: kernel.symbol(),
            source,
        })
    }

    /// Makes the device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))
    }

    /// Raw device memory; [`crate::BufferOwner::alloc_device`] is the way in.
    pub(crate) fn malloc(&self, label: &str, bytes: usize) -> Result<DeviceMemory, CudaError> {
        if bytes == 0 {
            return Ok(DeviceMemory::new(0, 0, self.clone()));
        }
        self.bind()?;
        // SAFETY: the context is current; the pointer is freed once, by DeviceMemory.
        let ptr = unsafe { drv::malloc_sync(bytes) }.map_err(|source| CudaError::Alloc {
            label: label.into(),
            bytes,
            source,
        })?;
        Ok(DeviceMemory::new(ptr, bytes, self.clone()))
    }

    /// Frees memory from [`Self::malloc`] once the work enqueued before has finished.
    pub(crate) fn free(&self, ptr: u64) {
        let result = self
            .bind()
            .and_then(|()| self.synchronize())
            .and_then(|()| {
                // SAFETY: allocated by cuMemAlloc, freed once; no enqueued work is left to use it.
                unsafe { drv::free_sync(ptr) }.map_err(CudaError::driver("cuMemFree"))
            });
        if let Err(e) = result {
            tracing::warn!("freeing device memory at {ptr:#x} failed: {e}");
        }
    }

    /// Waits for everything enqueued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.inner
            .stream
            .synchronize()
            .map_err(CudaError::driver("cuStreamSynchronize"))
    }

    /// Copies host data into device memory of the same length, and waits for it.
    pub fn upload<T: DeviceElem>(
        &self,
        dst: &mut DevSliceMut<'_, T>,
        src: &[T],
    ) -> Result<(), CudaError> {
        // SAFETY: the wait below keeps `src` borrowed until the copy is done.
        unsafe { self.upload_async(dst, src) }?;
        self.synchronize()
    }

    /// Enqueues a copy of host data into device memory of the same length, before the work
    /// enqueued after it, and returns without waiting. From page-locked memory the copy runs
    /// while the host goes on; from pageable memory the driver stages it before returning.
    ///
    /// # Safety
    ///
    /// `src` must stay allocated and unwritten until the stream has passed the copy (an event
    /// recorded after it has completed, or the stream has been synchronised).
    pub unsafe fn upload_async<T: DeviceElem>(
        &self,
        dst: &mut DevSliceMut<'_, T>,
        src: &[T],
    ) -> Result<(), CudaError> {
        ensure!(
            dst.len() == src.len(),
            "upload",
            "{} elements into {}",
            src.len(),
            dst.len()
        );
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` is a live device range of `src.len()` elements; the caller keeps `src`
        // alive and unwritten until the copy is done.
        unsafe { drv::memcpy_htod_async(dst.device_ptr(), src, self.inner.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    /// Copies device memory into a host slice of the same length, after the work before it.
    pub fn download<T: DeviceElem>(
        &self,
        src: DevSlice<'_, T>,
        dst: &mut [T],
    ) -> Result<(), CudaError> {
        // SAFETY: the wait below keeps `dst` borrowed until the copy has landed.
        unsafe { self.download_async(src, dst) }?;
        self.synchronize()
    }

    /// Enqueues a copy of device memory into a host slice of the same length, after the work
    /// before it, and returns without waiting: the copy has landed once an event recorded
    /// after it ([`Self::mark`]) has completed. From page-locked memory (staging buffers
    /// the residency set holds) it runs while the host goes on; from pageable memory the
    /// driver finishes it before returning.
    ///
    /// # Safety
    ///
    /// `dst` must stay allocated, and be neither read nor written, until that event has
    /// completed or the stream has been synchronised.
    pub unsafe fn download_async<T: DeviceElem>(
        &self,
        src: DevSlice<'_, T>,
        dst: &mut [T],
    ) -> Result<(), CudaError> {
        ensure!(
            dst.len() == src.len(),
            "download",
            "{} elements into {}",
            src.len(),
            dst.len()
        );
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `src` is live device memory of `dst.len()` elements; the caller keeps `dst`
        // alive and untouched until the copy is known to have landed.
        unsafe { drv::memcpy_dtoh_async(dst, src.device_ptr(), self.inner.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyDtoHAsync"))
    }

    /// An event for marking points of the stream the host waits for ([`Self::mark`]).
    pub fn new_event(&self) -> Result<StreamEvent, CudaError> {
        let event = self
            .inner
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(CudaError::driver("cuEventCreate"))?;
        Ok(StreamEvent(event))
    }

    /// Marks the stream's current end: `event` completes once the work enqueued so far has.
    pub fn mark(&self, event: &StreamEvent) -> Result<(), CudaError> {
        event
            .0
            .record(&self.inner.stream)
            .map_err(CudaError::driver("cuEventRecord"))
    }

    /// Enqueues a device-to-device copy between slices of the same length.
    pub fn copy<T: DeviceElem>(
        &self,
        src: DevSlice<'_, T>,
        dst: &mut DevSliceMut<'_, T>,
    ) -> Result<(), CudaError> {
        ensure!(
            dst.len() == src.len(),
            "copy",
            "{} elements into {}",
            src.len(),
            dst.len()
        );
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges are live device memory of `size_of_val` bytes.
        unsafe {
            drv::memcpy_dtod_async(
                dst.device_ptr(),
                src.device_ptr(),
                src.len() * size_of::<T>(),
                self.inner.stream.cu_stream(),
            )
        }
        .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
    }

    /// Enqueues a copy of `rows` rows of `width` elements from `src`, whose rows start
    /// `src_pitch` elements apart, into `dst`, whose rows start `dst_pitch` apart: a block of
    /// columns moved between matrices of different widths (a rank's part of the logits into
    /// whole rows).
    pub fn copy_rows<T: DeviceElem>(
        &self,
        src: DevSlice<'_, T>,
        src_pitch: usize,
        dst: &mut DevSliceMut<'_, T>,
        dst_pitch: usize,
        [rows, width]: [usize; 2],
    ) -> Result<(), CudaError> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let span = |pitch: usize| (rows - 1) * pitch + width;
        ensure!(
            width <= src_pitch.min(dst_pitch)
                && src.len() >= span(src_pitch)
                && dst.len() >= span(dst_pitch),
            "copy_rows",
            "{rows} rows of {width} from {} elements {src_pitch} a row into {} {dst_pitch} a row",
            src.len(),
            dst.len()
        );
        self.bind()?;
        let t = size_of::<T>();
        // Every field named: the memory types are enums with no zero value, so the struct has
        // no all-zero form to start from.
        let copy = drv_sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: drv_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src.device_ptr(),
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch * t,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: drv_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst.device_ptr(),
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch * t,
            WidthInBytes: width * t,
            Height: rows,
        };
        // SAFETY: both spans were checked against live device ranges above.
        unsafe { drv_sys::cuMemcpy2DAsync_v2(&copy, self.inner.stream.cu_stream()) }
            .result()
            .map_err(CudaError::driver("cuMemcpy2DAsync"))
    }

    /// Enqueues setting every byte of `dst` to `byte` (tests poison outputs with it).
    pub fn fill_bytes<T: DeviceElem>(
        &self,
        dst: &mut DevSliceMut<'_, T>,
        byte: u8,
    ) -> Result<(), CudaError> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: a live device range.
        unsafe {
            drv::memset_d8_async(
                dst.device_ptr(),
                byte,
                dst.len() * size_of::<T>(),
                self.inner.stream.cu_stream(),
            )
        }
        .map_err(CudaError::driver("cuMemsetD8Async"))
    }

    /// Starts (`on`) or stops what a profiler started with `--profile-from-start off` (Nsight
    /// Compute's, Nsight Systems' `--capture-range cudaProfilerApi`) records, after the work
    /// enqueued so far has finished, so that a window of steps can be profiled alone.
    pub fn profiler_capture(&self, on: bool) -> Result<(), CudaError> {
        self.bind()?;
        self.synchronize()?;
        // SAFETY: the device's context is current on this thread; the calls take no pointers.
        let (op, status) = unsafe {
            if on {
                ("cuProfilerStart", drv_sys::cuProfilerStart())
            } else {
                ("cuProfilerStop", drv_sys::cuProfilerStop())
            }
        };
        status.result().map_err(CudaError::driver(op))
    }

    /// Milliseconds of device time `work` enqueues, measured with events on the stream.
    pub fn time_ms(&self, work: impl FnOnce() -> Result<(), CudaError>) -> Result<f32, CudaError> {
        let event = || {
            self.inner
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(CudaError::driver("cuEventCreate"))
        };
        let (start, end) = (event()?, event()?);
        let stream = &self.inner.stream;
        start
            .record(stream)
            .map_err(CudaError::driver("cuEventRecord"))?;
        work()?;
        end.record(stream)
            .map_err(CudaError::driver("cuEventRecord"))?;
        end.synchronize()
            .map_err(CudaError::driver("cuEventSynchronize"))?;
        start
            .elapsed_ms(&end)
            .map_err(CudaError::driver("cuEventElapsedTime"))
    }
}

/// A point in the device's stream that the host can wait for ([`CudaDevice::mark`]).
pub struct StreamEvent(CudaEvent);

impl StreamEvent {
    /// Waits until the work before the point last recorded has finished (at once if none was).
    pub fn wait(&self) -> Result<(), CudaError> {
        self.0
            .synchronize()
            .map_err(CudaError::driver("cuEventSynchronize"))
    }
}

/// Enqueues `kernel` on the device's stream ([`CudaDevice::launch_kernel`]) with the given
/// arguments (locals, so each lives until the launch has copied it).
macro_rules! launch {
    ($device:expr, $kernel:expr, $config:expr; $($arg:ident),+ $(,)?) => {{
        let mut params = [$( (&$arg) as *const _ as *mut ::std::ffi::c_void ),+];
        // SAFETY: the arguments match the kernel's parameters in order and type (u64 device
        // pointers, i32/i64 sizes, f32 scalars, repr(C) argument structs), and the op checked
        // every range it reads or writes against the shapes it passes.
        unsafe { $device.launch_kernel($kernel, $config, &mut params) }
    }};
}
pub(crate) use launch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_names_each_missing_library() {
        assert!(unavailable(&[]).is_none());
        let e = unavailable(&[LIBRARIES[0].0, LIBRARIES[3].0]).unwrap();
        assert_eq!(
            e.to_string(),
            "CUDA unavailable: libcuda.so.1 (the NVIDIA driver), libcublasLt.so.13 (cuBLASLt) not found"
        );
    }
}
