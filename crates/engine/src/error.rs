use std::path::PathBuf;

use crate::chat_template::TemplateError;
use crate::sampler::SamplingError;
use crate::tokenizer::TokenizerError;

/// Errors of loading and generation; each names what to fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: no such model directory", .0.display())]
    ModelDirMissing(PathBuf),
    #[error(transparent)]
    Model(#[from] ember_models::Error),
    #[error(transparent)]
    Checkpoint(#[from] ember_checkpoint::CheckpointError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// A request's output constraint: a grammar that does not compile, or a matcher that
    /// failed while generating.
    #[error(transparent)]
    Constraint(#[from] crate::constraint::ConstraintError),
    #[error(transparent)]
    Memory(#[from] ember_tensor::Error),
    #[error("{}: the model has no chat template (tokenizer_config.json or chat_template.jinja)", .0.display())]
    NoChatTemplate(PathBuf),
    #[error(transparent)]
    Cuda(#[from] ember_tensor::cuda::CudaError),
    #[error("--device cuda: {0} (use --device cpu or auto)")]
    NotOnCuda(&'static str),
    #[error("{0} (--residency required)")]
    ResidencyRequired(String),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt_tokens} tokens; the context holds {context} (raise --context)")]
    PromptTooLong {
        prompt_tokens: usize,
        context: usize,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
    #[error("max_tokens is 0: a request must ask for at least one token")]
    NothingToGenerate,
    /// A batched pass failed; every request in it ends with this.
    #[error("a forward pass of this and other requests failed: {0}")]
    BatchFailed(String),
    /// The KV pool cannot hold the request even with nothing else running.
    #[error(
        "the request needs {positions} positions of KV cache and the pool cannot hold them \
         even alone (raise --context or --prompt-cache-gib)"
    )]
    PoolTooSmall { positions: usize },
    /// The caller asked to stop before the prompt was in (a client gone mid-prefill).
    #[error("the request was cancelled")]
    Cancelled,
    /// A `generation_config.json` that does not parse, or asks for sampling out of range.
    #[error("{0}")]
    GenerationConfig(String),
    /// A final assistant message the chat template does not reproduce, so it cannot be
    /// continued.
    #[error(
        "the chat template does not render the final assistant message's text as it is, so the \
         reply cannot continue it; end the messages with a user turn instead"
    )]
    PrefillNotRendered,
    /// `--draft-model` whose tokenizer is not the model's: its drafts would be other tokens.
    #[error("--draft-model {}: {what}; a draft model must share the model's vocabulary", .path.display())]
    DraftVocabulary { path: PathBuf, what: String },
    /// `--draft model` without a draft model, or a draft model with another `--draft`.
    #[error("{0}")]
    DraftOptions(String),
    /// The draft model's KV pool has no free block (more drafting sequences than it was
    /// made for); the sequence is not drafted for.
    #[error("the draft model's KV pool is full")]
    DraftPoolFull,
    /// A rank of the tensor-parallel group failed (`--tensor-parallel`): its ranks have left
    /// their lock-step, so the engine serves no more.
    #[error("the tensor-parallel group stopped ({0}); the engine must be restarted")]
    GroupFailed(String),
    /// `--tensor-parallel` where it cannot run, or over shapes that do not split.
    #[error("--tensor-parallel: {0}")]
    TensorParallel(String),
    /// More sequences at once than the engine was loaded for.
    #[error("{wanted} sequences at once need --parallel {wanted} (the engine runs {parallel})")]
    TooManySequences { wanted: usize, parallel: usize },
}

impl Error {
    /// Whether the caller stopped the work, rather than it failing.
    pub fn is_cancellation(&self) -> bool {
        matches!(self, Error::Cancelled)
    }

    /// Whether the engine can serve no more after this error (a tensor-parallel group that
    /// lost a rank): the server stops rather than fail every request after it.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::GroupFailed(_) | Error::Model(ember_models::Error::RankFailed(_))
        )
    }
}

pub type Result<T> = std::result::Result<T, Error>;
