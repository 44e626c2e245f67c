use ember_checkpoint::CheckpointError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Memory(#[from] ember_tensor::Error),
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error(
        "the context is full: {used} positions used, {requested} more requested, room for {capacity}"
    )]
    ContextFull {
        used: usize,
        requested: usize,
        capacity: usize,
    },
    #[error(transparent)]
    Cuda(#[from] ember_tensor::cuda::CudaError),
    #[error("{what} is not supported on {backend} yet")]
    Unsupported { what: String, backend: &'static str },
    #[error("a forward pass of {requested} tokens exceeds the batch capacity of {capacity}")]
    BatchTooLarge { requested: usize, capacity: usize },
    #[error("a forward pass that must give a token was given none")]
    NoTokens,
    /// A split (tensor parallelism) the model's shapes do not allow.
    #[error("cannot split the model (tensor parallelism): {0}")]
    CannotSplit(String),
    #[error("a rank of the tensor-parallel group failed: {0}")]
    RankFailed(#[from] crate::parallel::GroupAborted),
}

pub type Result<T> = std::result::Result<T, Error>;
