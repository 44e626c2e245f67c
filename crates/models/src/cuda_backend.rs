//! The CUDA backend: weights uploaded to device memory in their checkpoint dtype (f32, bf16,
//! f16), f32 activation slots on the device, a device KV cache, and `ember_tensor::cuda`'s
//! kernels on the device's one stream. Only the logits come back to the host.
//!
//! Decode (≤ [`cuda::MAX_BATCH`] rows) runs matrix-vector kernels that stream each weight
//! once; longer batches (prefill) run cuBLASLt GEMMs on bf16/f16 copies of the activations
//! with f32 accumulation (f32 weights stay on the matrix-vector path, 8 rows at a time).
//!
//! A pass's positions and token ids go to the device first ([`Backend::begin_pass`]) and the
//! kernels read them there, so a one-token pass is recorded as a CUDA graph the second time
//! its shape and cache are seen and replayed from then on: one launch instead of hundreds,
//! with the same arithmetic as the unrecorded pass.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use ember_checkpoint::TensorSource;
use ember_tensor::cpu::{AttentionShape, RopeLayout};
use ember_tensor::cuda::{
    self, AttentionPrecision, CudaDevice, DevMat, DevSlice, DevSliceMut, DeviceBuffer, Epilogue,
    ExpertRoad, ExpertTable, Float, Gemm, Graph, MatvecNorm, MatvecOutput, Position, RopeHeads,
    RopeNorm, Routes, Routing, StreamEvent,
};
use ember_tensor::quant::dequantize_row;
use ember_tensor::{Buffer, BufferId, BufferKind, BufferOwner, DType};
use half::{bf16, f16};

use crate::backend::{
    AttentionParams, Backend, KvFill, KvStore, PICKS_AHEAD, PassShape, Projection, RopeStyle, Slot,
    WeightMatrix, add_to_residual, norm_linears_step_by_step, norm_mlp_step_by_step,
};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::KvDtype;
use crate::rope::RopeTable;
use crate::transformer::{Mlp, Moe};

/// Weights on the device, in their stored dtype.
pub struct CudaMatrix {
    buffer: Arc<DeviceBuffer>,
    /// Byte offset of row 0 in `buffer`.
    offset: usize,
    dtype: DType,
    rows: usize,
    cols: usize,
}

impl CudaMatrix {
    fn bytes(&self) -> Range<usize> {
        self.offset..self.offset + self.size_in_bytes()
    }

    fn as_mat(&self) -> Result<DevMat<'_>> {
        let data = self.buffer.as_slice::<u8>().slice(self.bytes());
        Ok(DevMat::new(self.dtype, data, self.rows, self.cols)?)
    }
}

impl WeightMatrix for CudaMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn size_in_bytes(&self) -> usize {
        self.rows * self.dtype.row_bytes(self.cols)
    }

    fn slice_rows(&self, start: usize, end: usize) -> Self {
        CudaMatrix {
            buffer: Arc::clone(&self.buffer),
            offset: self.offset + start * self.dtype.row_bytes(self.cols),
            dtype: self.dtype,
            rows: end - start,
            cols: self.cols,
        }
    }
}

/// An f32 vector on the device.
pub struct CudaVector(DeviceBuffer);

impl CudaVector {
    fn slice(&self) -> DevSlice<'_, f32> {
        self.0.as_slice()
    }
}

/// Rotary tables on the device, `[positions, head_dim / 2]`.
pub struct CudaRope {
    cos: DeviceBuffer,
    sin: DeviceBuffer,
}

/// A sequence's keys and values on the device, `[layer][position][kv_dim]` as on the CPU.
pub struct CudaKv {
    keys: DeviceBuffer,
    values: DeviceBuffer,
    dtype: KvDtype,
    kv_dim: usize,
    fill: KvFill,
}

impl CudaKv {
    pub fn new(
        device: &CudaDevice,
        owner: &BufferOwner,
        config: &ModelConfig,
        capacity: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        let kv_dim = config.kv_dim();
        let bytes = config.num_hidden_layers * capacity * kv_dim * dtype.size_in_bytes();
        let alloc = |label| owner.alloc_device(BufferKind::KvCache, label, device, bytes);
        Ok(CudaKv {
            keys: alloc("kv cache keys")?,
            values: alloc("kv cache values")?,
            dtype,
            kv_dim,
            fill: KvFill::empty(capacity),
        })
    }

    /// Elements of the cache buffers that hold `layer`.
    fn layer_range(&self, layer: usize) -> std::ops::Range<usize> {
        let layer_elems = self.capacity() * self.kv_dim;
        layer * layer_elems..(layer + 1) * layer_elems
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
}

impl KvStore for CudaKv {
    fn fill(&self) -> &KvFill {
        &self.fill
    }

    fn fill_mut(&mut self) -> &mut KvFill {
        &mut self.fill
    }
}

/// A MoE layer's experts as the device kernels address them: tables of each expert's gate
/// and up (together, for one SwiGLU product) and down matrices.
pub struct CudaExperts {
    gate_up: ExpertTable,
    down: ExpertTable,
    /// The buffers the tables point into, kept alive as long as the tables.
    _weights: Vec<Arc<DeviceBuffer>>,
}

/// A MoE layer's buffers besides the slots, for the longest batch: router logits, the routes
/// (expert, weight, grouping and tiles per routed pair), and each pair's SwiGLU activations
/// and expert output.
struct MoeWorkspace {
    router: DeviceBuffer,
    ids: DeviceBuffer,
    weights: DeviceBuffer,
    order: DeviceBuffer,
    tiles: DeviceBuffer,
    act: DeviceBuffer,
    expert_out: DeviceBuffer,
}

impl MoeWorkspace {
    fn new(
        device: &CudaDevice,
        owner: &BufferOwner,
        config: &ModelConfig,
        tokens: usize,
    ) -> Result<Option<Self>> {
        let Some(moe) = &config.moe else {
            return Ok(None);
        };
        let routing = Routing {
            experts: moe.num_experts,
            top_k: moe.num_experts_per_tok,
            normalize: moe.norm_topk_prob,
        };
        let pairs = tokens * routing.top_k;
        // One token takes a tile per pair, more take tiles of 8 or 64: the most tiles.
        let tiles = routing
            .tiles_len(1, ExpertRoad::Decode)
            .max(routing.tiles_len(tokens, ExpertRoad::Matvec));
        let alloc = |label: &str, n: usize| {
            owner.alloc_device(BufferKind::Activations, label, device, n * 4)
        };
        Ok(Some(MoeWorkspace {
            router: alloc("moe router logits", tokens * routing.experts)?,
            ids: alloc("moe routed experts", pairs)?,
            weights: alloc("moe routed weights", pairs)?,
            order: alloc("moe pairs by expert", pairs)?,
            tiles: alloc("moe expert tiles", tiles)?,
            act: alloc("moe expert activations", pairs * moe.moe_intermediate_size)?,
            expert_out: alloc("moe expert outputs", pairs * config.hidden_size)?,
        }))
    }
}

pub struct CudaBackend {
    device: CudaDevice,
    owner: BufferOwner,
    gemm: Gemm,
    max_batch: usize,
    logit_rows: usize,
    /// f32, indexed by [`Slot::index`].
    slots: [DeviceBuffer; Slot::COUNT],
    /// A GEMM's 16-bit copy of its input activations.
    gemm_input: DeviceBuffer,
    /// The pass's inputs as the kernels read them, i32: `[pos0, pos0 + n, token ids...]`.
    step: DeviceBuffer,
    /// The host side of `step` and `logits`: staging buffers, page-locked with the driver
    /// while the residency set holds them.
    step_host: Buffer,
    attention_scratch: DeviceBuffer,
    logits: DeviceBuffer,
    logits_host: Buffer,
    /// The greedy token of the last pass (u32), and its host side: [`Backend::greedy_token`]
    /// brings back 4 bytes, not a row of logits; [`Backend::pick_ahead`] one slot per pick
    /// that may wait unread.
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
}

/// The picks of [`Backend::pick_ahead`]: pick `i` lands in slot `i % PICKS_AHEAD` of
/// `greedy_host`, and `landed[slot]` completes when it has.
struct PicksAhead {
    landed: [StreamEvent; PICKS_AHEAD],
    /// Picks enqueued and picks read since the last pass of host tokens.
    enqueued: usize,
    read: usize,
}

impl CudaBackend {
    /// Enqueues the greedy pick of the last pass's first row of logits into `greedy`; with
    /// `feed`, also as the token of the next pass (`cuda::argmax`'s feed).
    fn pick_greedy(&mut self, vocab: usize, feed: bool) -> Result<()> {
        let logits = self.logits.as_slice::<f32>().slice(0..vocab);
        let mut step = self.step.as_mut_slice::<i32>();
        cuda::argmax(
            &self.device,
            logits,
            vocab,
            &mut self.greedy.as_mut_slice::<u32>(),
            feed.then_some(&mut step),
            &mut self.argmax_scratch.as_mut_slice::<u32>(),
        )?;
        Ok(())
    }

    /// Drops the picks still unread after waiting for the device, so that the staging slots
    /// are free: a pass of host tokens, or a pick the host waits for, starts a fresh run.
    fn forget_picks_ahead(&mut self) -> Result<()> {
        if self.ahead.enqueued > self.ahead.read {
            self.device.synchronize()?;
        }
        self.ahead.enqueued = 0;
        self.ahead.read = 0;
        Ok(())
    }
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

/// What a recorded pass is bound to: its shape and the cache its kernels address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    shape: PassShape,
    keys: BufferId,
    values: BufferId,
}

enum Recording {
    /// Seen once, run unrecorded: every kernel it uses is loaded, so none loads while recording.
    Warm,
    Ready(Graph),
    /// Recording failed once (logged); this shape runs unrecorded.
    Failed,
}

/// Graphs kept at most: one per live cache, for the few caches a server keeps.
const MAX_GRAPHS: usize = 16;

/// Offsets in the step buffer.
const STEP_POS0: usize = 0;
const STEP_END: usize = 1;
const STEP_TOKENS: usize = 2;

impl CudaBackend {
    /// `graphs`: record one-token passes and replay them (off, every pass is launched op by
    /// op: for comparing the two, and for debugging).
    pub fn new(
        device: CudaDevice,
        config: &ModelConfig,
        owner: &BufferOwner,
        max_batch: usize,
        logit_rows: usize,
        graphs: bool,
    ) -> Result<Self> {
        let b = max_batch.max(1);
        let logit_rows = logit_rows.max(1);
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
        let step = owner.alloc_device(
            BufferKind::Activations,
            "pass inputs",
            &device,
            (STEP_TOKENS + b) * 4,
        )?;
        let mut attention_scratch = f32s(
            "attention splits",
            cuda::attention_decode_scratch_len(shape),
        )?;
        cuda::attention_decode_scratch_reset(
            &device,
            shape,
            &mut attention_scratch.as_mut_slice::<f32>(),
        )?;
        let logits = f32s("logits", logit_rows * config.vocab_size)?;
        let mut argmax_scratch = f32s("argmax chunks", cuda::argmax_scratch_len(1))?;
        device.fill_bytes(&mut argmax_scratch.as_mut_slice::<u32>(), 0)?;
        let gemm = Gemm::new(&device, owner)?;
        let moe = MoeWorkspace::new(&device, owner, config, b)?;
        Ok(CudaBackend {
            owner: owner.clone(),
            gemm,
            max_batch: b,
            logit_rows,
            slots: slots.try_into().expect("one buffer per slot"),
            gemm_input,
            step,
            step_host: owner.alloc_staging(
                BufferKind::Activations,
                "pass inputs (host)",
                (STEP_TOKENS + b) * 4,
            )?,
            attention_scratch,
            logits,
            logits_host: owner.alloc_staging(
                BufferKind::Activations,
                "logits (host)",
                logit_rows * config.vocab_size * 4,
            )?,
            greedy: owner.alloc_device(BufferKind::Activations, "greedy token", &device, 4)?,
            greedy_host: owner.alloc_staging(
                BufferKind::Activations,
                "greedy token (host)",
                PICKS_AHEAD * 4,
            )?,
            argmax_scratch,
            ahead: PicksAhead {
                landed: [device.new_event()?, device.new_event()?],
                enqueued: 0,
                read: 0,
            },
            moe,
            graphs: graphs.then(HashMap::new),
            attention_precision: match config.dtype.as_deref() {
                Some("bfloat16" | "float16") => AttentionPrecision::Bf16,
                _ => AttentionPrecision::F32,
            },
            device,
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    fn upload(&self, name: &str, kind: BufferKind, bytes: &[u8]) -> Result<DeviceBuffer> {
        let mut buffer = self
            .owner
            .alloc_device(kind, name, &self.device, bytes.len())?;
        buffer.upload(bytes)?;
        Ok(buffer)
    }

    fn matrix_from(
        &self,
        name: &str,
        dtype: DType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<CudaMatrix> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Unsupported {
                what: format!("{name}: {dtype} weights"),
                backend: "CUDA",
            });
        }
        let buffer = self.upload(name, BufferKind::Weights, bytes)?;
        Ok(CudaMatrix {
            buffer: Arc::new(buffer),
            offset: 0,
            dtype,
            rows,
            cols,
        })
    }

    /// `dst[offset..][..rows·out] = src[..rows·in] · Wᵀ` (`+=` with `accumulate`), by
    /// matrix-vector kernels for decode and a GEMM for longer batches.
    fn project(
        &mut self,
        w: &CudaMatrix,
        src: Slot,
        rows: usize,
        dst: Slot,
        offset: usize,
        accumulate: bool,
    ) -> Result<()> {
        let mat = w.as_mat()?;
        let (n_in, n_out) = (w.cols, w.rows);
        let [s, d] = self
            .slots
            .get_disjoint_mut([src.index(), dst.index()])
            .expect("distinct slots");
        let x = s.as_slice::<f32>().slice(0..rows * n_in);
        let mut y = d.as_mut_slice::<f32>();
        let mut y = y.slice_mut(offset..offset + rows * n_out);
        if rows <= cuda::MAX_BATCH || mat.dtype == Float::F32 {
            return Ok(cuda::matvec(
                &self.device,
                &mat,
                x,
                rows,
                &mut y,
                accumulate,
            )?);
        }
        match mat.dtype {
            Float::Bf16 => {
                let mut a = self.gemm_input.as_mut_slice::<bf16>();
                let mut a = a.slice_mut(0..rows * n_in);
                cuda::convert(&self.device, x, &mut a)?;
                self.gemm.matmul(a.as_slice(), &mat, &mut y, accumulate)?;
            }
            Float::F16 => {
                let mut a = self.gemm_input.as_mut_slice::<f16>();
                let mut a = a.slice_mut(0..rows * n_in);
                cuda::convert(&self.device, x, &mut a)?;
                self.gemm.matmul(a.as_slice(), &mat, &mut y, accumulate)?;
            }
            Float::F32 => unreachable!("f32 weights take the matrix-vector path"),
        }
        Ok(())
    }

    /// `gemm_input[..rows.len()] = rms_norm(src[rows])` in bf16: a prefill GEMM's input made
    /// by the norm itself.
    fn norm_into_gemm_input(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
    ) -> Result<()> {
        let width = norm.0.len() / 4;
        let x = self.slots[src.index()]
            .as_slice::<f32>()
            .slice(rows.start * width..rows.end * width);
        let mut a = self.gemm_input.as_mut_slice::<bf16>();
        let mut a = a.slice_mut(0..rows.len() * width);
        cuda::rms_norm(&self.device, x, norm.slice(), eps, &mut a)?;
        Ok(())
    }

    /// `dst[offset..] (+)= gemm_input[..rows] · Wᵀ` for bf16 weights whose input the caller
    /// left in `gemm_input` as bf16; `dst` holds `O` (f32, or bf16 for gate and up).
    fn gemm_from_input<O: cuda::FloatElem>(
        &mut self,
        w: &CudaMatrix,
        rows: usize,
        dst: Slot,
        offset: usize,
        accumulate: bool,
    ) -> Result<()> {
        let mat = w.as_mat()?;
        let a = self.gemm_input.as_slice::<bf16>().slice(0..rows * w.cols);
        let mut y = self.slots[dst.index()].as_mut_slice::<O>();
        let mut y = y.slice_mut(offset..offset + rows * w.rows);
        self.gemm.matmul(a, &mat, &mut y, accumulate)?;
        Ok(())
    }

    /// `dst[r] += bias` for each of `rows` rows of `width`.
    fn add_bias(&mut self, bias: &CudaVector, dst: Slot, rows: usize, width: usize) -> Result<()> {
        let mut y = self.slots[dst.index()].as_mut_slice::<f32>();
        for r in 0..rows {
            let mut row = y.slice_mut(r * width..(r + 1) * width);
            cuda::add(&self.device, &mut row, bias.slice())?;
        }
        Ok(())
    }

    /// Whether [`Self::fused_products`] takes these: the matrix-vector road (a decode batch,
    /// or f32 weights, which never take a GEMM), and matrices that can share a launch.
    fn fusible(&self, rows: usize, weights: &[&CudaMatrix]) -> bool {
        let first = weights[0];
        weights.len() <= cuda::MAX_OUTPUTS
            && (rows <= cuda::MAX_BATCH || first.dtype == DType::F32)
            && weights
                .iter()
                .all(|w| w.dtype == first.dtype && w.cols == first.cols)
    }

    /// `dst_i[..] = rms_norm(src[rows]) · W_iᵀ + bias_i` by matrix-vector kernels (the norm
    /// computed inside them), finished by `epilogue`.
    fn fused_products(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
        projections: &[Projection<'_, Self>],
        epilogue: Epilogue,
    ) -> Result<()> {
        let width = norm.0.len() / 4;
        let mats = projections
            .iter()
            .map(|p| p.weight.as_mat())
            .collect::<Result<Vec<_>>>()?;
        // Disjoint borrows of the source and each destination slot.
        let mut slots: Vec<Option<&mut DeviceBuffer>> = self.slots.iter_mut().map(Some).collect();
        let x = slots[src.index()].take().expect("a slot").as_slice::<f32>();
        let x = x.slice(rows.start * width..rows.end * width);
        let mut ys: Vec<DevSliceMut<'_, f32>> = projections
            .iter()
            .map(|p| {
                let len = rows.len() * p.weight.rows;
                let buffer = slots[p.dst.index()].take().expect("distinct slots");
                buffer.as_mut_slice::<f32>().split_at_mut(len).0
            })
            .collect();
        let norm = MatvecNorm {
            weight: norm.slice(),
            eps,
        };
        let mut outputs: Vec<MatvecOutput<'_, '_>> = projections
            .iter()
            .zip(&mats)
            .zip(&mut ys)
            .map(|((p, w), y)| MatvecOutput {
                w,
                bias: p.bias.map(|b| b.slice()),
                y: y.reborrow(),
            })
            .collect();
        let batch = rows.len();
        cuda::matvec_fused(&self.device, &mut outputs, x, batch, Some(norm), epilogue)?;
        Ok(())
    }
}

fn attention_shape(p: &AttentionParams) -> AttentionShape {
    AttentionShape {
        n_heads: p.n_heads,
        n_kv_heads: p.n_kv_heads,
        head_dim: p.head_dim,
    }
}

/// A layer's attention inputs and output for `rows` tokens, in their slots.
struct AttentionIo<'a> {
    q: DevSlice<'a, f32>,
    k: DevSlice<'a, f32>,
    v: DevSlice<'a, f32>,
    out: DevSliceMut<'a, f32>,
}

fn attention_io<'a>(
    slots: &'a mut [DeviceBuffer; Slot::COUNT],
    p: &AttentionParams,
    rows: usize,
    kv_dim: usize,
) -> AttentionIo<'a> {
    let [q, k, v, out] = slots
        .get_disjoint_mut([
            Slot::Queries.index(),
            Slot::Keys.index(),
            Slot::Values.index(),
            Slot::AttentionOut.index(),
        ])
        .expect("distinct slots");
    let q_len = rows * p.n_heads * p.head_dim;
    AttentionIo {
        q: q.as_slice::<f32>().slice(0..q_len),
        k: k.as_slice::<f32>().slice(0..rows * kv_dim),
        v: v.as_slice::<f32>().slice(0..rows * kv_dim),
        out: out.as_mut_slice::<f32>().split_at_mut(q_len).0,
    }
}

/// A per-head norm as the rope kernels take it.
fn rope_norm(n: Option<(&CudaVector, f32)>) -> Option<RopeNorm<'_>> {
    n.map(|(w, eps)| RopeNorm {
        weight: w.slice(),
        eps,
    })
}

impl Backend for CudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Rope = CudaRope;
    type Kv = CudaKv;
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

    fn rope_tables(&self, config: &ModelConfig, positions: usize) -> Result<CudaRope> {
        // The CPU's tables, computed once on the host (the same angles on every device).
        let host = RopeTable::new(config, positions, &self.owner)?;
        let (cos, sin) = host.tables(false);
        Ok(CudaRope {
            cos: self.upload("rope cos", BufferKind::Scratch, bytemuck::cast_slice(cos))?,
            sin: self.upload("rope sin", BufferKind::Scratch, bytemuck::cast_slice(sin))?,
        })
    }

    fn begin_pass(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        self.forget_picks_ahead()?;
        let int = |v: usize| i32::try_from(v).expect("positions fit the kernels' int");
        let len = STEP_TOKENS + tokens.len();
        let host = &mut self.step_host.as_mut_slice::<i32>()[..len];
        host[STEP_POS0] = int(pos0);
        host[STEP_END] = int(pos0 + tokens.len());
        for (slot, &t) in host[STEP_TOKENS..].iter_mut().zip(tokens) {
            *slot = t as i32;
        }
        let mut step = self.step.as_mut_slice::<i32>();
        self.device.upload(&mut step.slice_mut(0..len), host)?;
        Ok(())
    }

    fn run_pass(
        &mut self,
        kv: &mut CudaKv,
        shape: PassShape,
        pass: &mut dyn FnMut(&mut Self, &mut CudaKv) -> Result<()>,
    ) -> Result<()> {
        let key = GraphKey {
            shape,
            keys: kv.keys.id(),
            values: kv.values.id(),
        };
        // Only decode steps: they are launch-bound, and their kernels never wait on the host.
        let Some(graphs) = self.graphs.as_mut().filter(|_| shape.tokens == 1) else {
            return pass(self, kv);
        };
        match graphs.get(&key) {
            Some(Recording::Ready(graph)) => return Ok(graph.launch()?),
            Some(Recording::Failed) => return pass(self, kv),
            Some(Recording::Warm) => {}
            None => {
                if graphs.len() >= MAX_GRAPHS {
                    // Caches come and go with requests; their graphs are cheap to record again.
                    graphs.clear();
                }
                graphs.insert(key, Recording::Warm);
                return pass(self, kv);
            }
        }
        let device = self.device.clone();
        let recorded = device.record(|| pass(self, kv));
        let graphs = self.graphs.as_mut().expect("recording is on");
        match recorded {
            Ok(graph) => {
                graph.launch()?;
                graphs.insert(key, Recording::Ready(graph));
                Ok(())
            }
            Err(e) => {
                tracing::warn!(
                    "recording a decode step as a CUDA graph failed, so it runs op by op: {e}"
                );
                graphs.insert(key, Recording::Failed);
                pass(self, kv)
            }
        }
    }

    fn embed(&mut self, table: &CudaMatrix, n: usize) -> Result<()> {
        let ids = self
            .step
            .as_slice::<u32>()
            .slice(STEP_TOKENS..STEP_TOKENS + n);
        let hidden = table.cols;
        let mut out = self.slots[Slot::Residual.index()].as_mut_slice::<f32>();
        let mut out = out.slice_mut(0..n * hidden);
        let bytes = table.buffer.as_slice::<u8>().slice(table.bytes());
        let dev = &self.device;
        match table.dtype {
            DType::BF16 => cuda::embedding(dev, bytes.cast::<bf16>(), hidden, ids, &mut out)?,
            DType::F16 => cuda::embedding(dev, bytes.cast::<f16>(), hidden, ids, &mut out)?,
            _ => cuda::embedding(dev, bytes.cast::<f32>(), hidden, ids, &mut out)?,
        }
        Ok(())
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
        // Prefill: normalised once, straight to bf16, then a GEMM per projection.
        let n = rows.len();
        self.norm_into_gemm_input(src, rows, norm, eps)?;
        for p in projections {
            self.gemm_from_input::<f32>(p.weight, n, p.dst, 0, false)?;
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
        self.gemm_from_input::<bf16>(gate.weight, n, Slot::Gate, 0, false)?;
        self.gemm_from_input::<bf16>(up.weight, n, Slot::Up, 0, false)?;
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
        rows: usize,
        norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        let norm = rope_norm(norm);
        let layout = RopeLayout::from(style);
        let mut x = self.slots[slot.index()].as_mut_slice::<f32>();
        let mut x = x.slice_mut(0..rows * n_heads * head_dim);
        let (cos, sin) = (tables.cos.as_slice(), tables.sin.as_slice());
        let pos0 = Position::Device(self.step.as_slice().slice(STEP_POS0..STEP_POS0 + 1));
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
        rows: usize,
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        let [q, k] = self
            .slots
            .get_disjoint_mut([Slot::Queries.index(), Slot::Keys.index()])
            .expect("distinct slots");
        let q = RopeHeads {
            x: q.as_mut_slice::<f32>()
                .split_at_mut(rows * p.n_heads * p.head_dim)
                .0,
            n_heads: p.n_heads,
            norm: rope_norm(q_norm),
        };
        let k = RopeHeads {
            x: k.as_mut_slice::<f32>()
                .split_at_mut(rows * p.n_kv_heads * p.head_dim)
                .0,
            n_heads: p.n_kv_heads,
            norm: rope_norm(k_norm),
        };
        let pos0 = Position::Device(self.step.as_slice().slice(STEP_POS0..STEP_POS0 + 1));
        let (cos, sin) = (tables.cos.as_slice(), tables.sin.as_slice());
        let layout = RopeLayout::from(style);
        cuda::rope_qk(&self.device, q, Some(k), p.head_dim, pos0, cos, sin, layout)?;
        Ok(())
    }

    fn attention(&mut self, kv: &mut CudaKv, p: AttentionParams, rows: usize) -> Result<()> {
        let (kv_dim, layer) = (kv.kv_dim, kv.layer_range(p.layer));
        let shape = attention_shape(&p);
        let AttentionIo { q, k, v, mut out } = attention_io(&mut self.slots, &p, rows, kv_dim);
        let step = self.step.as_slice::<i32>();
        let pos0 = Position::Device(step.slice(STEP_POS0..STEP_POS0 + 1));
        let end = Position::Device(step.slice(STEP_END..STEP_END + 1));
        let dev = &self.device;
        macro_rules! run {
            ($t:ty) => {{
                cuda::kv_store(
                    dev,
                    k,
                    v,
                    &mut kv.keys.as_mut_slice::<$t>().slice_mut(layer.clone()),
                    &mut kv.values.as_mut_slice::<$t>().slice_mut(layer.clone()),
                    kv_dim,
                    pos0,
                )?;
                let keys = kv.keys.as_slice::<$t>().slice(layer.clone());
                let values = kv.values.as_slice::<$t>().slice(layer.clone());
                if rows == 1 {
                    let mut scratch = self.attention_scratch.as_mut_slice::<f32>();
                    cuda::attention_decode(
                        dev,
                        q,
                        keys,
                        values,
                        end,
                        shape,
                        p.scale,
                        self.attention_precision,
                        &mut scratch,
                        &mut out,
                    )?;
                } else {
                    // Prompts are never recorded: the host's position is the step's. Chunks
                    // short enough for the matrix-vector products keep f32 activations
                    // throughout, attention included; 16-bit operands only where the GEMMs
                    // already round the activations to bf16.
                    let precision = if rows > cuda::MAX_BATCH {
                        self.attention_precision
                    } else {
                        AttentionPrecision::F32
                    };
                    cuda::attention_prefill(
                        dev, q, keys, values, p.pos0, rows, shape, p.scale, precision, &mut out,
                    )?;
                }
            }};
        }
        match kv.dtype {
            KvDtype::F32 => run!(f32),
            KvDtype::F16 => run!(f16),
            KvDtype::Bf16 => run!(bf16),
        }
        Ok(())
    }

    fn rope_attention(
        &mut self,
        kv: &mut CudaKv,
        tables: &CudaRope,
        style: RopeStyle,
        p: AttentionParams,
        rows: usize,
        q_norm: Option<(&CudaVector, f32)>,
        k_norm: Option<(&CudaVector, f32)>,
    ) -> Result<()> {
        let layout = RopeLayout::from(style);
        // A decode step rotates and stores its key inside the attention kernel; prompts, and
        // head shapes that kernel cannot rotate, take the two ops.
        if rows != 1 || !cuda::attention_decode_rope_fits(p.head_dim, layout) {
            self.rope_qk(tables, style, &p, rows, q_norm, k_norm)?;
            return self.attention(kv, p, rows);
        }
        let (kv_dim, layer) = (kv.kv_dim, kv.layer_range(p.layer));
        let shape = attention_shape(&p);
        let AttentionIo { q, k, v, mut out } = attention_io(&mut self.slots, &p, rows, kv_dim);
        let rope = cuda::DecodeRope {
            k_new: k,
            v_new: v,
            q_norm: rope_norm(q_norm),
            k_norm: rope_norm(k_norm),
            cos: tables.cos.as_slice(),
            sin: tables.sin.as_slice(),
            layout,
        };
        let step = self.step.as_slice::<i32>();
        let end = Position::Device(step.slice(STEP_END..STEP_END + 1));
        let mut scratch = self.attention_scratch.as_mut_slice::<f32>();
        macro_rules! run {
            ($t:ty) => {
                cuda::attention_decode_rope(
                    &self.device,
                    q,
                    rope,
                    &mut kv.keys.as_mut_slice::<$t>().slice_mut(layer.clone()),
                    &mut kv.values.as_mut_slice::<$t>().slice_mut(layer.clone()),
                    end,
                    shape,
                    p.scale,
                    self.attention_precision,
                    &mut scratch,
                    &mut out,
                )?
            };
        }
        match kv.dtype {
            KvDtype::F32 => run!(f32),
            KvDtype::F16 => run!(f16),
            KvDtype::Bf16 => run!(bf16),
        }
        Ok(())
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
        if experts
            .iter()
            .any(|e| [&e.gate, &e.up, &e.down].iter().any(|l| l.bias.is_some()))
        {
            return Err(Error::Unsupported {
                what: "experts with biases".into(),
                backend: "CUDA",
            });
        }
        let mats = |pick: &dyn Fn(&Mlp<Self>) -> Vec<&CudaMatrix>| {
            experts
                .iter()
                .map(|e| pick(e).into_iter().map(CudaMatrix::as_mat).collect())
                .collect::<Result<Vec<Vec<DevMat<'_>>>>>()
        };
        let gate_up = mats(&|e| vec![&e.gate.weight, &e.up.weight])?;
        let down = mats(&|e| vec![&e.down.weight])?;
        let (device, owner) = (&self.device, &self.owner);
        // SAFETY: the tables point into the experts' buffers, which `_weights` keeps alive for
        // as long as the tables.
        let (gate_up, down) = unsafe {
            (
                ExpertTable::new(device, owner, "moe gate/up table", &gate_up)?,
                ExpertTable::new(device, owner, "moe down table", &down)?,
            )
        };
        let weights = experts
            .iter()
            .flat_map(|e| [&e.gate.weight, &e.up.weight, &e.down.weight])
            .map(|w| Arc::clone(&w.buffer))
            .collect();
        Ok(CudaExperts {
            gate_up,
            down,
            _weights: weights,
        })
    }

    /// Routed on the device: router logits in f32 from the f32 normed rows (normalised inside
    /// the router's and gate/up's products off the tensor cores), top-k and grouping by expert
    /// in one block, each routed pair's SwiGLU and down products in one launch each (tensor
    /// cores for the prompts of bf16 experts), and the weighted sum added to the residual.
    fn norm_moe(
        &mut self,
        moe: &Moe<Self>,
        rows: Range<usize>,
        norm: &CudaVector,
        eps: f32,
    ) -> Result<()> {
        let (offset, n) = (rows.start, rows.len());
        let experts = &moe.prepared;
        let routing = Routing {
            experts: moe.experts.len(),
            top_k: moe.top_k,
            normalize: moe.norm_topk_prob,
        };
        let (hidden, width) = (experts.down.rows(), experts.gate_up.rows());
        let pairs = n * routing.top_k;
        // Prompts of bf16 experts on the tensor cores (their input rounded to bf16, as the
        // prompt GEMMs round theirs); decode and other dtypes in f32 activations.
        let road = if n == 1 {
            ExpertRoad::Decode
        } else if n > cuda::MAX_BATCH
            && experts.gate_up.takes_tensor_cores()
            && experts.down.takes_tensor_cores()
        {
            ExpertRoad::TensorCores
        } else {
            ExpertRoad::Matvec
        };
        // The matrix-vector roads normalise inside the router's and gate/up's products, which
        // read the residual stream itself (a launch fewer per decoded layer); the tensor cores
        // take the normalised rows from `Normed`.
        let norm_inside = road != ExpertRoad::TensorCores;
        if !norm_inside {
            self.rms_norm(Slot::Residual, rows.clone(), norm, eps, Slot::Normed)?;
        }
        let norm = norm_inside.then(|| MatvecNorm {
            weight: norm.slice(),
            eps,
        });
        let ws = self
            .moe
            .as_mut()
            .expect("a MoE model's backend has MoE buffers");
        let dev = &self.device;
        let [normed, residual] = self
            .slots
            .get_disjoint_mut([Slot::Normed.index(), Slot::Residual.index()])
            .expect("distinct slots");
        let x = if norm_inside {
            residual
                .as_slice::<f32>()
                .slice(offset * hidden..(offset + n) * hidden)
        } else {
            normed.as_slice::<f32>().slice(0..n * hidden)
        };
        let mut logits = ws.router.as_mut_slice::<f32>();
        let mut logits = logits.slice_mut(0..n * routing.experts);
        let router = MatvecOutput {
            w: &moe.router.as_mat()?,
            bias: None,
            y: logits.reborrow(),
        };
        cuda::matvec_fused(dev, &mut [router], x, n, norm, Epilogue::Store)?;
        let mut routes = Routes {
            ids: ws.ids.as_mut_slice(),
            weights: ws.weights.as_mut_slice(),
            order: ws.order.as_mut_slice(),
            tiles: ws.tiles.as_mut_slice(),
            road,
        };
        cuda::moe_route(dev, logits.as_slice(), n, &routing, &mut routes)?;
        let tiles = routes.tiles(&routing, n);
        let mut act = ws.act.as_mut_slice::<f32>();
        let mut act = act.slice_mut(0..pairs * width);
        let mut expert_out = ws.expert_out.as_mut_slice::<f32>();
        let mut expert_out = expert_out.slice_mut(0..pairs * hidden);
        let top_k = routing.top_k;
        if road == ExpertRoad::TensorCores {
            cuda::experts_mma(dev, &experts.gate_up, tiles, x, top_k, &mut act)?;
            cuda::experts_mma(
                dev,
                &experts.down,
                tiles,
                act.as_slice(),
                1,
                &mut expert_out,
            )?;
        } else {
            cuda::matvec_experts(dev, &experts.gate_up, tiles, x, top_k, norm, &mut act)?;
            cuda::matvec_experts(
                dev,
                &experts.down,
                tiles,
                act.as_slice(),
                1,
                None,
                &mut expert_out,
            )?;
        }
        let weights = routes.weights.as_slice().slice(0..pairs);
        let mut out = residual.as_mut_slice::<f32>();
        let mut out = out.slice_mut(offset * hidden..(offset + n) * hidden);
        cuda::moe_combine(
            dev,
            expert_out.as_slice(),
            weights,
            routing.top_k,
            &mut out,
            hidden,
        )?;
        Ok(())
    }

    fn logits(&mut self, len: usize) -> Result<&[f32]> {
        let host = &mut self.logits_host.as_mut_slice::<f32>()[..len];
        let logits = self.logits.as_slice::<f32>().slice(0..len);
        self.device.download(logits, host)?;
        Ok(&self.logits_host.as_slice::<f32>()[..len])
    }

    fn greedy_token(&mut self, vocab: usize) -> Result<u32> {
        self.forget_picks_ahead()?;
        self.pick_greedy(vocab, false)?;
        // Staging buffers are whole pages: the token is the first 4 bytes of this one.
        let host = &mut self.greedy_host.as_mut_slice::<u32>()[..1];
        self.device.download(self.greedy.as_slice::<u32>(), host)?;
        Ok(host[0])
    }

    fn pick_ahead(&mut self, vocab: usize) -> Result<()> {
        let ahead = &self.ahead;
        if ahead.enqueued - ahead.read >= PICKS_AHEAD {
            return Err(Error::Unsupported {
                what: format!("more than {PICKS_AHEAD} picks waiting unread"),
                backend: "cuda",
            });
        }
        let slot = ahead.enqueued % PICKS_AHEAD;
        self.pick_greedy(vocab, true)?;
        let host = &mut self.greedy_host.as_mut_slice::<u32>()[slot..slot + 1];
        // SAFETY: the slot is read (`read_pick`) only after its event, and not written again
        // before that read (at most PICKS_AHEAD wait); every path that drops or reuses the
        // staging buffer synchronises the stream first (`forget_picks_ahead`, Drop).
        unsafe {
            self.device
                .download_async(self.greedy.as_slice::<u32>(), host)?;
        }
        self.device.mark(&self.ahead.landed[slot])?;
        self.ahead.enqueued += 1;
        Ok(())
    }

    fn read_pick(&mut self) -> Result<u32> {
        let ahead = &mut self.ahead;
        if ahead.read == ahead.enqueued {
            return Err(Error::NoTokens);
        }
        let slot = ahead.read % PICKS_AHEAD;
        ahead.landed[slot].wait()?;
        ahead.read += 1;
        Ok(self.greedy_host.as_slice::<u32>()[slot])
    }

    fn begin_fed_pass(&mut self, _pos0: usize) -> Result<()> {
        // The pick before advanced the pass inputs on the device (`cuda::argmax`'s `feed`),
        // and the host cannot check their position without waiting for it.
        if self.ahead.enqueued == 0 {
            return Err(Error::NoTokens);
        }
        Ok(())
    }

    /// `logits[..rows] = Normed[..rows] · headᵀ` (matrix-vector: at most a few rows).
    fn project_logits(&mut self, head: &CudaMatrix, rows: usize) -> Result<()> {
        let mat = head.as_mat()?;
        let x = self.slots[Slot::Normed.index()]
            .as_slice::<f32>()
            .slice(0..rows * head.cols);
        let mut y = self.logits.as_mut_slice::<f32>();
        let mut y = y.slice_mut(0..rows * head.rows);
        cuda::matvec(&self.device, &mat, x, rows, &mut y, false)?;
        Ok(())
    }
}
