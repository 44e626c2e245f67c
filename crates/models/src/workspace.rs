//! Activation buffers of a CPU forward pass, made once for the largest batch and reused.

use ember_tensor::cpu::{attention_scratch_len, matmul_scratch_len};
use ember_tensor::{Buffer, BufferKind, BufferOwner};

use crate::backend::Slot;
use crate::config::ModelConfig;
use crate::error::Result;

/// Every buffer a forward pass writes besides the KV cache: one per [`Slot`], `max_batch`
/// tokens wide, plus logits and kernel scratch (`context` positions of attention scores per
/// thread). Made through the buffer owner, so all of it is listed and held resident.
pub struct Workspace {
    pub(crate) max_batch: usize,
    pub(crate) logit_rows: usize,
    /// Indexed by [`Slot::index`].
    pub(crate) slots: [Buffer; Slot::COUNT],
    pub(crate) logits: Buffer,
    pub(crate) matmul_scratch: Buffer,
    pub(crate) attention_scratch: Buffer,
    pub(crate) moe: Option<MoeWorkspace>,
}

/// What a mixture-of-experts layer needs besides the slots.
pub(crate) struct MoeWorkspace {
    pub(crate) router: Buffer,
    /// The tokens routed to one expert, gathered.
    pub(crate) rows: Buffer,
    pub(crate) out: Buffer,
}

impl Workspace {
    pub fn new(
        config: &ModelConfig,
        max_batch: usize,
        context: usize,
        logit_rows: usize,
        n_threads: usize,
        owner: &BufferOwner,
    ) -> Result<Self> {
        let b = max_batch.max(1);
        let alloc = |label: &str, n: usize| owner.alloc(BufferKind::Activations, label, n * 4);
        let widest_input = config
            .hidden_size
            .max(config.q_dim())
            .max(config.ffn_width());
        let moe = match &config.moe {
            Some(moe) => Some(MoeWorkspace {
                router: alloc("moe router", b * moe.num_experts)?,
                rows: alloc("moe expert rows", b * config.hidden_size)?,
                out: alloc("moe expert out", b * config.hidden_size)?,
            }),
            None => None,
        };
        let mut slots = Vec::with_capacity(Slot::COUNT);
        for slot in Slot::ALL {
            slots.push(alloc(slot.label(), b * slot.width(config))?);
        }
        Ok(Workspace {
            max_batch: b,
            logit_rows: logit_rows.max(1),
            slots: slots.try_into().expect("one buffer per slot"),
            logits: alloc("logits", logit_rows.max(1) * config.vocab_size)?,
            matmul_scratch: alloc(
                "matmul panels",
                matmul_scratch_len(n_threads, b, widest_input),
            )?,
            attention_scratch: alloc(
                "attention scores",
                attention_scratch_len(n_threads, context, config.attention_shape()),
            )?,
            moe,
        })
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }
}
