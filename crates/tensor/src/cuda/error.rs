use cudarc::cublaslt::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// Errors of the CUDA layer. A machine without CUDA gets [`CudaError::Unavailable`], never a
/// panic: the caller runs on the CPU instead.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// One or more of the libraries CUDA needs could not be loaded.
    #[error("CUDA unavailable: {missing} not found")]
    Unavailable { missing: String },
    #[error("no CUDA device {ordinal} (found {count})")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA driver: {op}: {source}")]
    Driver {
        op: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("launching {kernel}: {source}")]
    Launch {
        kernel: String,
        #[source]
        source: DriverError,
    },
    #[error("NVRTC: {op}: {source}")]
    Nvrtc {
        op: &'static str,
        #[source]
        source: NvrtcError,
    },
    #[error("NVRTC could not compile {module}.cu for {arch}:\n{log}")]
    Compile {
        module: &'static str,
        arch: String,
        log: String,
    },
    #[error("cuBLASLt: {op}: {source}")]
    Blas {
        op: &'static str,
        #[source]
        source: CublasError,
    },
    #[error("could not allocate {bytes} bytes of device memory for {label}: {source}")]
    Alloc {
        label: String,
        bytes: usize,
        #[source]
        source: DriverError,
    },
    /// Arguments an op cannot take (sizes that disagree, a head too wide, a quantized weight).
    #[error("{op}: {message}")]
    Invalid { op: &'static str, message: String },
    /// A panic inside the CUDA bindings, caught (the libraries are loaded lazily and a missing
    /// symbol panics).
    #[error("CUDA panicked while {op}: {message}")]
    Panicked { op: &'static str, message: String },
}

impl CudaError {
    /// Wraps a driver error with the call that returned it.
    pub(crate) fn driver(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |source| CudaError::Driver { op, source }
    }

    pub(crate) fn blas(op: &'static str) -> impl FnOnce(CublasError) -> CudaError {
        move |source| CudaError::Blas { op, source }
    }

    pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> CudaError {
        CudaError::Invalid {
            op,
            message: message.into(),
        }
    }
}

/// Fails with [`CudaError::Invalid`] naming `op` unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $op:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::cuda::CudaError::invalid($op, format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;
