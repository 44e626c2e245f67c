//! The CUDA backend: weights uploaded to device memory in their checkpoint dtype (f32, bf16,
//! f16), f32 activation slots on the device, a device KV pool, and `ember_tensor::cuda`'s
//! kernels on the device's one stream. Only the logits come back to the host.
//!
//! Decode (≤ [`cuda::MAX_BATCH`] rows) runs matrix-vector kernels that stream each weight
//! once; longer batches (prefill) run cuBLASLt GEMMs on bf16/f16 copies of the activations
//! with f32 accumulation (f32 weights stay on the matrix-vector path, 8 rows at a time).
//!
//! Split by job: [`weights`] (device matrices and vectors), [`products`] (the matrix
//! products), [`kv`] (the KV pool, its host tier, attention), [`moe`] (mixture-of-experts
//! layers), [`pass`] (a pass's inputs on the device, picks ahead of the host, graphs); this
//! file holds the activations and the [`Backend`] implementation that dispatches to them.

mod group;
mod kv;
mod moe;
mod pass;
mod products;
mod tuning;
mod weights;

use std::collections::HashMap;
use std::ops::Range;

use ember_checkpoint::TensorSource;
use ember_tensor::cpu::{AttentionShape, RopeLayout};
use ember_tensor::cuda::{self, AttentionPrecision, CudaDevice, DeviceBuffer, Epilogue, RopeHeads};
use ember_tensor::quant::dequantize_row;
use ember_tensor::{Buffer, BufferKind, BufferOwner, DType};
use half::{bf16, f16};

pub use group::{CudaCollectives, NcclRanks};
pub use kv::CudaKvPool;
pub use moe::CudaExperts;
pub use weights::{CudaMatrix, CudaRope, CudaVector};

use self::group::RankGroup;
use self::kv::{PromptAttention, rope_norm};
use self::moe::{MoeSum, MoeWorkspace};
use self::pass::{GraphKey, PassInputs, PicksAhead, Recording};
use self::products::Gemms;
use crate::backend::{
    AttentionParams, Backend, PICKS_AHEAD, PassSegment, PassShape, Projection, RopeStyle, Slot,
    TunedProduct, add_to_residual, norm_linears_step_by_step, norm_mlp_step_by_step,
};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::BlockTable;
use crate::rope::RopeTable;
use crate::transformer::{Mlp, Moe};

/// Prompt rows a launch of the decode kernel takes when they attend as decode rows.
const PROMPT_ROWS_A_LAUNCH: usize = 64;
/// (row, chunk) pairs of prompt rows the batch-invariant prompt attention's scratch holds:
/// 512 rows of a 2,048-token prompt's end a launch (each of its 16 chunks kept for the merge),
/// so that a launch has waves enough to hide its tail (136 MiB for qwen3-8b's 32 heads).
const PROMPT_ROW_CHUNKS: usize = 8192;

/// Choices of how a CUDA backend runs; every one gives a request's greedy tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Record decode passes and replay them (off, every pass is launched op by op: for
    /// comparing the two, and for debugging). Same bits either way.
    pub graphs: bool,
    /// Every product of 16-bit weights on the batch-invariant kernel, so a request's tokens
    /// do not depend on what shares its passes. Off (the default until the kernel has been
    /// measured on a GPU): matrix-vector kernels for decode batches of up to 8 and cuBLASLt
    /// past them, whose rows' bits follow their batch past 8.
    pub batch_invariant: bool,
    /// Drafted tokens a sequence's pass may verify (speculative decoding): a row of logits
    /// for each, beside its own.
    pub draft_rows: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            graphs: true,
            batch_invariant: false,
            draft_rows: 0,
        }
    }
}

pub struct CudaBackend {
    device: CudaDevice,
    owner: BufferOwner,
    gemm: Gemms,
    max_batch: usize,
    logit_rows: usize,
    /// f32, indexed by [`Slot::index`].
    slots: [DeviceBuffer; Slot::COUNT],
    /// A GEMM's 16-bit copy of its input activations.
    gemm_input: DeviceBuffer,
    /// The pass's positions, token ids and block table as the kernels read them.
    inputs: PassInputs,
    /// Decode attention's splits and their tickets.
    attention_scratch: DeviceBuffer,
    /// Rows `attention_scratch` has room for: the sequences a pass may have, or with
    /// [`PromptAttention::AsDecodeRows`] a prompt chunk's rows a launch.
    decode_scratch_rows: usize,
    /// Prompt attention's splits (a short chunk over a long cache), or with
    /// [`PromptAttention::AsDecodeRows`] the prompt rows' chunks.
    prompt_attention_scratch: DeviceBuffer,
    prompt_attention: PromptAttention,
    logits: DeviceBuffer,
    /// The host side of `logits`: a staging buffer, page-locked with the driver while the
    /// residency set holds it.
    logits_host: Buffer,
    /// The greedy token of each row of the last pass's logits (u32), and its host side:
    /// [`Backend::greedy_token`] brings back 4 bytes, not a row of logits;
    /// [`Backend::pick_ahead`] one slot per pick that may wait unread.
    greedy: DeviceBuffer,
    greedy_host: Buffer,
    /// The argmax's chunk bests and ticket (`cuda::argmax_scratch_len`).
    argmax_scratch: DeviceBuffer,
    ahead: PicksAhead,
    moe: Option<MoeWorkspace>,
    /// Recorded one-token passes; `None` turns recording off.
    graphs: Option<HashMap<GraphKey, Recording>>,
    /// Attention on the tensor cores with 16-bit operands (prompt chunks on the GEMM road,
    /// decode over a 16-bit cache): for 16-bit checkpoints, whose products already run in 16
    /// bits; f32 checkpoints keep f32 attention.
    attention_precision: AttentionPrecision,
    /// The tensor-parallel group this backend is a rank of ([`CudaBackend::join_group`]).
    group: Option<RankGroup>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // An unread pick may still be on its way into the staging buffer about to be freed.
        if self.ahead.enqueued > self.ahead.read
            && let Err(e) = self.device.synchronize()
        {
            tracing::warn!("waiting for the device before freeing its buffers failed: {e}");
        }
    }
}

impl CudaBackend {
    /// Activations for passes of up to `max_batch` tokens of up to `max_sequences`
    /// sequences (a row of logits each) of up to `max_blocks` KV blocks.
    pub fn new(
        device: CudaDevice,
        config: &ModelConfig,
        owner: &BufferOwner,
        max_batch: usize,
        max_blocks: usize,
        max_sequences: usize,
        options: CudaOptions,
    ) -> Result<Self> {
        let b = max_batch.max(1);
        let max_sequences = max_sequences.clamp(1, b);
        let logit_rows = (max_sequences * (1 + options.draft_rows)).min(b);
        let f32s = |label: &str, n: usize| {
            owner.alloc_device(BufferKind::Activations, label, &device, n * 4)
        };
        let mut slots = Vec::with_capacity(Slot::COUNT);
        for slot in Slot::ALL {
            slots.push(f32s(slot.label(), b * slot.width(config))?);
        }
        let widest = config
            .hidden_size
            .max(config.q_dim())
            .max(config.ffn_width());
        let shape = AttentionShape {
            n_heads: config.num_attention_heads,
            n_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        let gemm_input = owner.alloc_device(
            BufferKind::Activations,
            "gemm input (16-bit)",
            &device,
            b * widest * 2,
        )?;
        let inputs = PassInputs::new(&device, owner, b, max_sequences, max_blocks)?;
        // Batch invariance holds a prompt row to the bits of a decode step: it attends as one.
        let prompt_attention = if options.batch_invariant {
            PromptAttention::AsDecodeRows
        } else {
            PromptAttention::Tiled
        };
        // Each row of a batched decode launch has its own splits. Prompt rows as decode rows
        // go PROMPT_ROWS_A_LAUNCH at a time (a launch a row would cost more than the rows).
        let decode_scratch_rows = match prompt_attention {
            PromptAttention::Tiled => max_sequences,
            PromptAttention::AsDecodeRows => max_sequences.max(PROMPT_ROWS_A_LAUNCH.min(b)),
        };
        let mut attention_scratch = f32s(
            "attention splits",
            cuda::attention_decode_scratch_len(shape) * decode_scratch_rows,
        )?;
        cuda::attention_decode_scratch_reset(
            &device,
            shape,
            &mut attention_scratch.as_mut_slice::<f32>(),
        )?;
        // Tiled prompt attention splits a short chunk's keys; the prompt rows' kernel keeps
        // every chunk of a row (the most rows a launch: PROMPT_ROW_CHUNKS over their chunks).
        let prompt_scratch_len = match prompt_attention {
            PromptAttention::Tiled => cuda::attention_prefill_scratch_len(shape),
            PromptAttention::AsDecodeRows => cuda::attention_prefill_scratch_len(shape)
                .max(PROMPT_ROW_CHUNKS * shape.n_heads * (shape.head_dim + 2)),
        };
        let prompt_attention_scratch = f32s("prompt attention splits", prompt_scratch_len)?;
        let logits = f32s("logits", logit_rows * config.vocab_size)?;
        let mut argmax_scratch = f32s("argmax chunks", cuda::argmax_scratch_len(logit_rows))?;
        device.fill_bytes(&mut argmax_scratch.as_mut_slice::<u32>(), 0)?;
        let gemm = Gemms::new(
            &device,
            owner,
            options.batch_invariant,
            config.q_dim() + 2 * config.kv_dim(),
        )?;
        let moe = MoeWorkspace::new(&device, owner, config, b)?;
        Ok(CudaBackend {
            owner: owner.clone(),
            gemm,
            max_batch: b,
            logit_rows,
            slots: slots.try_into().expect("one buffer per slot"),
            gemm_input,
            inputs,
            attention_scratch,
            decode_scratch_rows,
            prompt_attention_scratch,
            prompt_attention,
            logits,
            logits_host: owner.alloc_staging(
                BufferKind::Activations,
                "logits (host)",
                logit_rows * config.vocab_size * 4,
            )?,
            greedy: owner.alloc_device(
                BufferKind::Activations,
                "greedy tokens",
                &device,
                logit_rows * 4,
            )?,
            greedy_host: owner.alloc_staging(
                BufferKind::Activations,
                "greedy tokens (host)",
                logit_rows.max(PICKS_AHEAD) * 4,
            )?,
            argmax_scratch,
            ahead: pass::picks_ahead(&device)?,
            moe,
            graphs: options.graphs.then(HashMap::new),
            attention_precision: match config.dtype.as_deref() {
                Some("bfloat16" | "float16") => AttentionPrecision::Bf16,
                _ => AttentionPrecision::F32,
            },
            group: None,
            device,
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The pass's tokens' rows of `table` into the residual stream: of the whole vocabulary,
    /// or (`first`) of a rank's part of it, zeros for the tokens it does not hold.
    fn embed_rows(&mut self, table: &CudaMatrix, n: usize, first: Option<usize>) -> Result<()> {
        let ids = self.inputs.tokens(n);
        let hidden = table.cols;
        let mut out = self.slots[Slot::Residual.index()].as_mut_slice::<f32>();
        let mut out = out.slice_mut(0..n * hidden);
        let bytes = table.buffer.as_slice::<u8>().slice(table.bytes());
        let dev = &self.device;
        fn lookup<T: cuda::FloatElem>(
            dev: &CudaDevice,
            table: cuda::DevSlice<'_, T>,
            hidden: usize,
            ids: cuda::DevSlice<'_, u32>,
            first: Option<usize>,
            out: &mut cuda::DevSliceMut<'_, f32>,
        ) -> Result<()> {
            match first {
                None => cuda::embedding(dev, table, hidden, ids, out)?,
                Some(first) => cuda::embedding_part(dev, table, hidden, ids, first, out)?,
            }
            Ok(())
        }
        match table.dtype {
            DType::BF16 => lookup(dev, bytes.cast::<bf16>(), hidden, ids, first, &mut out),
            DType::F16 => lookup(dev, bytes.cast::<f16>(), hidden, ids, first, &mut out),
            _ => lookup(dev, bytes.cast::<f32>(), hidden, ids, first, &mut out),
        }
    }
}

impl Backend for CudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Rope = CudaRope;
    type Kv = CudaKvPool;
    type Experts = CudaExperts;

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn logit_rows(&self) -> usize {
        self.logit_rows
    }

    fn load_matrix(
        &self,
        source: &dyn TensorSource,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<CudaMatrix> {
        let t = source.get_shaped(name, &[rows, cols])?;
        self.matrix_from(name, t.dtype, t.bytes, rows, cols)
    }

    fn load_adjacent(
        &self,
        source: &dyn TensorSource,
        parts: &[(&str, usize)],
        cols: usize,
    ) -> Result<Vec<CudaMatrix>> {
        let tensors = parts
            .iter()
            .map(|&(name, rows)| source.get_shaped(name, &[rows, cols]))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let dtype = tensors[0].dtype;
        // One allocation only where one product can take them: 16-bit weights of one type.
        if !matches!(dtype, DType::BF16 | DType::F16) || tensors.iter().any(|t| t.dtype != dtype) {
            return parts
                .iter()
                .zip(&tensors)
                .map(|(&(name, rows), t)| self.matrix_from(name, t.dtype, t.bytes, rows, cols))
                .collect();
        }
        let names: Vec<&str> = parts.iter().map(|&(name, _)| name).collect();
        let rows: Vec<usize> = parts.iter().map(|&(_, rows)| rows).collect();
        let bytes: Vec<&[u8]> = tensors.iter().map(|t| t.bytes).collect();
        self.adjacent_matrices(&names.join(" + "), dtype, &bytes, &rows, cols)
    }

    fn load_stacked(
        &self,
        source: &dyn TensorSource,
        name: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<CudaMatrix> {
        let t = source.get_shaped(name, &[count, rows, cols])?;
        self.matrix_from(name, t.dtype, t.bytes, count * rows, cols)
    }

    fn load_vector(&self, source: &dyn TensorSource, name: &str, len: usize) -> Result<CudaVector> {
        let t = source.get_shaped(name, &[len])?;
        let mut values = vec![0f32; len];
        dequantize_row(t.dtype, t.bytes, &mut values);
        let buffer = self.upload(name, BufferKind::Repacked, bytemuck::cast_slice(&values))?;
        Ok(CudaVector(buffer))
    }

    fn tune_products(&mut self, products: &[TunedProduct<'_, Self>]) -> Result<()> {
        self.tune_invariant_products(products)
    }

    fn rope_tables(&self, config: &ModelConfig, positions: usize) -> Result<CudaRope> {
        // The CPU's tables, computed once on the host (the same angles on every device).
        let host = RopeTable::new(config, positions, &self.owner)?;
        let (cos, sin) = host.tables(false);
        Ok(CudaRope {
            cos: self.upload("rope cos", BufferKind::Scratch, bytemuck::cast_slice(cos))?,
            sin: self.upload("rope sin", BufferKind::Scratch, bytemuck::cast_slice(sin))?,
        })
    }

    fn begin_pass(&mut self, tokens: &[u32], table: &BlockTable) -> Result<()> {
        self.begin_host_pass(tokens, table)
    }

    fn begin_batch(&mut self, tokens: &[u32], segments: &[PassSegment<'_>]) -> Result<()> {
        match segments {
            [one] => self.begin_host_pass(tokens, one.table),
            _ => {
                self.forget_picks_ahead()?;
                self.inputs.set_batch(tokens, segments)
            }
        }
    }

    fn run_pass(
        &mut self,
        kv: &mut CudaKvPool,
        shape: PassShape,
        pass: &mut dyn FnMut(&mut Self, &mut CudaKvPool) -> Result<()>,
    ) -> Result<()> {
        self.run_recorded(kv, shape, pass)
    }

    fn embed(&mut self, table: &CudaMatrix, n: usize) -> Result<()> {
        self.embed_rows(table, n, None)
    }

    fn embed_part(&mut self, table: &CudaMatrix, n: usize, first: usize) -> Result<()> {
        self.embed_rows(table, n, Some(first))
    }

    fn all_reduce(&mut self, slot: Slot, offset: usize, len: usize) -> Result<()> {
        self.reduce_across_ranks(slot, offset, len)
    }

    fn gather_logits(&mut self, rows: usize, vocab: usize) -> Result<()> {
        self.gather_logit_parts(rows, vocab)
    }

    fn rms_norm(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        weight: &CudaVector,
        eps: f32,
        dst: Slot,
    ) -> Result<()> {
        let width = weight.0.len() / 4;
        let [s, d] = self
            .slots
            .get_disjoint_mut([src.index(), dst.index()])
            .expect("distinct slots");
        let x = s
            .as_slice::<f32>()
            .slice(rows.start * width..rows.end * width);
        let mut out = d.as_mut_slice::<f32>();
        let mut out = out.slice_mut(0..rows.len() * width);
        cuda::rms_norm(&self.device, x, weight.slice(), eps, &mut out)?;
        Ok(())
    }

    fn linear(
        &mut self,
        weight: &CudaMatrix,
        bias: Option<&CudaVector>,
        src: Slot,
        rows: usize,
        dst: Slot,
    ) -> Result<()> {
        self.project(weight, src, rows, dst, 0, false)?;
        if let Some(bias) = bias {
            self.add_bias(bias, dst, rows, weight.rows)?;
        }
        Ok(())
    }

    fn norm_linears(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
        projections: &[Projection<'_, Self>],
    ) -> Result<()> {
        let weights: Vec<&CudaMatrix> = projections.iter().map(|p| p.weight).collect();
        if self.fusible(rows.len(), &weights) {
            return self.fused_products(src, rows, norm, eps, projections, Epilogue::Store);
        }
        if !weights.iter().all(|w| w.dtype == DType::BF16) {
            return norm_linears_step_by_step(self, src, rows, norm, eps, projections);
        }
        // Normalised once, straight to bf16, then one GEMM for all where it can, else one a
        // projection.
        let n = rows.len();
        self.norm_into_gemm_input(src, rows, norm, eps)?;
        let parts: Vec<_> = projections.iter().map(|p| (p.weight, p.dst)).collect();
        let together = self.adjacent_gemm_from_input::<f32>(n, &parts)?;
        for p in projections {
            if !together {
                self.gemm_from_input::<f32>(p.weight, n, p.dst, 0, false)?;
            }
            if let Some(bias) = p.bias {
                self.add_bias(bias, p.dst, n, p.weight.rows)?;
            }
        }
        Ok(())
    }

    fn norm_mlp(
        &mut self,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
        gate: Projection<'_, Self>,
        up: Projection<'_, Self>,
        down: Projection<'_, Self>,
    ) -> Result<()> {
        let (n, width, hidden) = (rows.len(), gate.weight.rows, down.weight.rows);
        let offset = rows.start * hidden;
        let bf16 = [gate.weight, up.weight, down.weight]
            .iter()
            .all(|w| w.dtype == DType::BF16);
        if self.fusible(n, &[gate.weight, up.weight]) {
            let projections = [gate, up];
            self.fused_products(
                Slot::Residual,
                rows,
                norm,
                eps,
                &projections,
                Epilogue::SwiGlu,
            )?;
            return add_to_residual(self, &down, Slot::Gate, n, offset);
        }
        if !bf16 || [&gate, &up, &down].iter().any(|p| p.bias.is_some()) {
            return norm_mlp_step_by_step(self, rows, norm, eps, gate, up, down);
        }
        // Prefill in bf16 GEMMs, the activations converted only where they are made: the norm
        // and SwiGLU write bf16 for the next GEMM. Gate and up come out in bf16, as
        // transformers' bf16 Linear layers give them (half the bytes of f32 to write and to
        // read back), and SwiGLU multiplies them in f32.
        self.norm_into_gemm_input(Slot::Residual, rows, norm, eps)?;
        let len = n * width;
        let parts = [(gate.weight, Slot::Gate), (up.weight, Slot::Up)];
        if !self.adjacent_gemm_from_input::<bf16>(n, &parts)? {
            self.gemm_from_input::<bf16>(gate.weight, n, Slot::Gate, 0, false)?;
            self.gemm_from_input::<bf16>(up.weight, n, Slot::Up, 0, false)?;
        }
        {
            let [g, u] = self
                .slots
                .get_disjoint_mut([Slot::Gate.index(), Slot::Up.index()])
                .expect("distinct slots");
            let (g, u) = (
                g.as_slice::<bf16>().slice(0..len),
                u.as_slice::<bf16>().slice(0..len),
            );
            let mut a = self.gemm_input.as_mut_slice::<bf16>();
            cuda::silu_mul(&self.device, g, u, &mut a.slice_mut(0..len))?;
        }
        self.gemm_from_input::<f32>(down.weight, n, Slot::Residual, offset, true)
    }

    fn linear_into_residual(
        &mut self,
        weight: &CudaMatrix,
        src: Slot,
        rows: usize,
        offset: usize,
    ) -> Result<()> {
        self.project(weight, src, rows, Slot::Residual, offset, true)
    }

    fn rope(
        &mut self,
        tables: &CudaRope,
        style: RopeStyle,
        slot: Slot,
        n_heads: usize,
        head_dim: usize,
        _pos0: usize,
        rows: Range<usize>,
        norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        // The kernels take positions from the pass inputs: a pass of one sequence has its
        // first row's, a pass of several every row's.
        let pos0 = if self.inputs.is_batch() {
            self.inputs.row_position(rows.start)
        } else if rows.start == 0 {
            self.inputs.pos0()
        } else {
            return Err(Error::Unsupported {
                what: format!("rotating a pass of one sequence from row {}", rows.start),
                backend: "CUDA",
            });
        };
        let norm = rope_norm(norm);
        let layout = RopeLayout::from(style);
        let width = n_heads * head_dim;
        let mut x = self.slots[slot.index()].as_mut_slice::<f32>();
        let mut x = x.slice_mut(rows.start * width..rows.end * width);
        let (cos, sin) = (tables.cos.as_slice(), tables.sin.as_slice());
        cuda::rope(
            &self.device,
            &mut x,
            n_heads,
            head_dim,
            pos0,
            cos,
            sin,
            layout,
            norm,
        )?;
        Ok(())
    }

    fn rope_qk(
        &mut self,
        tables: &CudaRope,
        style: RopeStyle,
        p: &AttentionParams,
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        let (pos0, _) = self.inputs.segment(p.first_row, p.segment);
        let [q, k] = self
            .slots
            .get_disjoint_mut([Slot::Queries.index(), Slot::Keys.index()])
            .expect("distinct slots");
        let q = RopeHeads {
            x: segment_rows(q, p, p.n_heads),
            n_heads: p.n_heads,
            norm: rope_norm(q_norm),
        };
        let k = RopeHeads {
            x: segment_rows(k, p, p.n_kv_heads),
            n_heads: p.n_kv_heads,
            norm: rope_norm(k_norm),
        };
        let (cos, sin) = (tables.cos.as_slice(), tables.sin.as_slice());
        let layout = RopeLayout::from(style);
        cuda::rope_qk(&self.device, q, Some(k), p.head_dim, pos0, cos, sin, layout)?;
        Ok(())
    }

    fn attention(&mut self, kv: &mut CudaKvPool, p: AttentionParams) -> Result<()> {
        self.attention_of_segment(kv, p)
    }

    fn rope_attention(
        &mut self,
        kv: &mut CudaKvPool,
        tables: &CudaRope,
        style: RopeStyle,
        params: AttentionParams,
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        self.rope_attention_segments(kv, tables, style, &[params], q_norm, k_norm)
    }

    fn rope_attention_segments(
        &mut self,
        kv: &mut CudaKvPool,
        tables: &CudaRope,
        style: RopeStyle,
        segments: &[AttentionParams],
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        self.rope_attention_of_segments(kv, tables, style, segments, q_norm, k_norm)
    }

    fn silu_mul(&mut self, len: usize) -> Result<()> {
        let [gate, up] = self
            .slots
            .get_disjoint_mut([Slot::Gate.index(), Slot::Up.index()])
            .expect("distinct slots");
        let mut gate = gate.as_mut_slice::<f32>();
        let mut gate = gate.slice_mut(0..len);
        cuda::silu_mul_in_place(&self.device, &mut gate, up.as_slice::<f32>().slice(0..len))?;
        Ok(())
    }

    fn add(&mut self, dst: Slot, offset: usize, src: Slot, len: usize) -> Result<()> {
        let [s, d] = self
            .slots
            .get_disjoint_mut([src.index(), dst.index()])
            .expect("distinct slots");
        let mut d = d.as_mut_slice::<f32>();
        let mut d = d.slice_mut(offset..offset + len);
        cuda::add(&self.device, &mut d, s.as_slice::<f32>().slice(0..len))?;
        Ok(())
    }

    fn prepare_experts(&self, experts: &[Mlp<Self>]) -> Result<CudaExperts> {
        self.experts_from(experts)
    }

    fn norm_moe(
        &mut self,
        moe: &Moe<Self>,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
    ) -> Result<()> {
        if !self.in_group() {
            return self.moe_layer(moe, rows, norm, eps, MoeSum::ToResidual);
        }
        // A rank's experts hold its share of their columns, or it holds a share of the
        // experts: either way its weighted sum is a partial one, added up across the ranks
        // before the residual takes it.
        let len = rows.len() * moe.router.cols;
        let offset = rows.start * moe.router.cols;
        let mut partial = self.slots[Slot::BlockOut.index()].as_mut_slice::<f32>();
        self.device.fill_bytes(&mut partial.slice_mut(0..len), 0)?;
        self.moe_layer(moe, rows, norm, eps, MoeSum::Partial)?;
        self.reduce_across_ranks(Slot::BlockOut, 0, len)?;
        self.add(Slot::Residual, offset, Slot::BlockOut, len)
    }

    fn logits(&mut self, len: usize) -> Result<&[f32]> {
        let host = &mut self.logits_host.as_mut_slice::<f32>()[..len];
        let logits = self.logits.as_slice::<f32>().slice(0..len);
        self.device.download(logits, host)?;
        Ok(&self.logits_host.as_slice::<f32>()[..len])
    }

    fn greedy_tokens(&mut self, rows: usize, vocab: usize) -> Result<Vec<u32>> {
        self.pick_rows(rows, vocab)
    }

    fn greedy_token(&mut self, vocab: usize) -> Result<u32> {
        self.pick_now(vocab)
    }

    fn pick_ahead(&mut self, vocab: usize) -> Result<()> {
        self.enqueue_pick(vocab)
    }

    fn read_pick(&mut self) -> Result<u32> {
        self.take_pick()
    }

    fn begin_fed_pass(&mut self, table: &BlockTable) -> Result<()> {
        self.begin_fed(table)
    }

    fn gather_rows(&mut self, slot: Slot, width: usize, rows: &[usize]) -> Result<()> {
        // Row rows[j] to row j, in order: rows[j] >= j, and no row is read after a copy
        // before it wrote it (rows ascend), so the copies never overlap.
        let mut values = self.slots[slot.index()].as_mut_slice::<f32>();
        for (j, &row) in rows.iter().enumerate() {
            if row == j {
                continue;
            }
            debug_assert!(row > j, "rows ascend");
            let (mut to, from) = values.reborrow().split_at_mut(row * width);
            let from = from.as_slice().slice(0..width);
            self.device
                .copy(from, &mut to.slice_mut(j * width..(j + 1) * width))?;
        }
        Ok(())
    }

    fn project_logits(&mut self, head: &CudaMatrix, rows: usize) -> Result<()> {
        self.logits_product(head, rows)
    }
}

/// The rows of segment `p` in a slot of `heads` heads a row.
fn segment_rows<'a>(
    slot: &'a mut DeviceBuffer,
    p: &AttentionParams,
    heads: usize,
) -> cuda::DevSliceMut<'a, f32> {
    let width = heads * p.head_dim;
    let rows = p.row_range();
    let x = slot.as_mut_slice::<f32>().split_at_mut(rows.end * width).0;
    x.split_at_mut(rows.start * width).1
}
