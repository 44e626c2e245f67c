use std::path::PathBuf;

/// Why a checkpoint cannot be served. Every variant names the file, and the tensor or field
/// when there is one, so the message alone tells the user what to fix.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a checkpoint directory (no config.json)", path.display())]
    NotACheckpoint { path: PathBuf },
    #[error("{}: invalid JSON: {message}", path.display())]
    Json { path: PathBuf, message: String },
    #[error("{}: missing field `{field}`", path.display())]
    MissingField { path: PathBuf, field: String },
    #[error("{}: field `{field}`: {message}", path.display())]
    InvalidField {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{}: unsupported architecture `{name}` (ember serves {supported})", path.display())]
    UnsupportedArchitecture {
        path: PathBuf,
        name: String,
        supported: String,
    },
    #[error("{}: not a valid safetensors file: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    #[error("{}: not a valid GGUF file: {message}", path.display())]
    Gguf { path: PathBuf, message: String },
    #[error("{}: tensor `{name}` is missing", path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: tensor `{name}` has shape {found:?}, expected {expected:?}", path.display())]
    TensorShape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{}: tensor `{name}` has type {found}, which ember does not read", path.display())]
    TensorDtype {
        path: PathBuf,
        name: String,
        found: String,
    },
    #[error(transparent)]
    Memory(#[from] ember_tensor::Error),
}

pub type Result<T> = std::result::Result<T, CheckpointError>;
