//! Activation buffers of a forward pass, made once for the largest batch and reused.

use ember_tensor::cpu::{attention_scratch_len, matmul_scratch_len};
use ember_tensor::{Buffer, BufferKind, BufferOwner};

use crate::config::ModelConfig;
use crate::error::Result;

/// Every buffer a forward pass writes besides the KV cache. Sized for `max_batch` tokens per
/// pass, `context` positions of attention and `logit_rows` rows of logits.
pub struct Workspace {
    pub(crate) max_batch: usize,
    pub(crate) logit_rows: usize,
    pub(crate) x: Buffer,
    pub(crate) h: Buffer,
    pub(crate) q: Buffer,
    pub(crate) k: Buffer,
    pub(crate) v: Buffer,
    pub(crate) attn: Buffer,
    pub(crate) proj: Buffer,
    pub(crate) gate: Buffer,
    pub(crate) up: Buffer,
    pub(crate) logits: Buffer,
    pub(crate) matmul_scratch: Buffer,
    pub(crate) attention_scratch: Buffer,
    pub(crate) moe: Option<MoeWorkspace>,
}

/// Extra buffers of a mixture-of-experts layer: router scores and one expert's batch.
pub(crate) struct MoeWorkspace {
    pub(crate) router: Buffer,
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
        let f32s = |n: usize| n * 4;
        let alloc = |label: &str, n: usize| owner.alloc(BufferKind::Activations, label, f32s(n));
        let ffn = config
            .intermediate_size
            .max(config.moe.as_ref().map_or(0, |m| m.moe_intermediate_size));
        let widest_input = config.hidden_size.max(config.q_dim()).max(ffn);
        let moe = match &config.moe {
            Some(moe) => Some(MoeWorkspace {
                router: alloc("moe router", b * moe.num_experts)?,
                rows: alloc("moe expert rows", b * config.hidden_size)?,
                out: alloc("moe expert out", b * config.hidden_size)?,
            }),
            None => None,
        };
        Ok(Workspace {
            max_batch: b,
            logit_rows: logit_rows.max(1),
            x: alloc("residual", b * config.hidden_size)?,
            h: alloc("normed", b * config.hidden_size)?,
            q: alloc("queries", b * config.q_dim())?,
            k: alloc("keys", b * config.kv_dim())?,
            v: alloc("values", b * config.kv_dim())?,
            attn: alloc("attention out", b * config.q_dim())?,
            proj: alloc("projection out", b * config.hidden_size)?,
            gate: alloc("mlp gate", b * ffn)?,
            up: alloc("mlp up", b * ffn)?,
            logits: alloc("logits", logit_rows.max(1) * config.vocab_size)?,
            matmul_scratch: alloc(
                "matmul panels",
                matmul_scratch_len(n_threads, b, widest_input),
            )?,
            attention_scratch: alloc(
                "attention scores",
                attention_scratch_len(n_threads, context),
            )?,
            moe,
        })
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }
}
