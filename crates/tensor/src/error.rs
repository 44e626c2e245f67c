use std::path::PathBuf;

/// Errors of the tensor layer: memory that could not be had, files that could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not allocate {bytes} bytes for {label}")]
    AllocFailed { label: String, bytes: usize },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;
