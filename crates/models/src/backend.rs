//! What a device must provide to run the transformer: weights in its memory, activation
//! buffers, a KV cache, and the handful of operations a forward pass is made of.
//!
//! The model is written once against this trait ([`crate::Transformer`]); a backend supplies
//! only storage and kernels. Activations live in named [`Slot`]s the backend owns, sized for
//! its largest batch, so the model never holds a device pointer and a backend can keep every
//! buffer resident, listed and (on a GPU) captured in a graph.

use std::ops::Range;

use ember_checkpoint::TensorSource;
use ember_tensor::cpu;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv_cache::{BlockTable, KvLayout};
use crate::transformer::{Mlp, Moe};

/// The activation buffers of one forward pass, each `max_batch` rows wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The residual stream, `hidden_size` per token.
    Residual,
    /// The normalised residual, input of attention and MLP, `hidden_size` per token.
    Normed,
    /// `q_dim` per token.
    Queries,
    /// This step's keys and values, `kv_dim` per token, before they enter the cache.
    Keys,
    Values,
    /// Attention output, `q_dim` per token.
    AttentionOut,
    /// Output of the attention or MLP block, `hidden_size` per token, added to the residual.
    BlockOut,
    /// MLP gate and up projections, `intermediate_size` per token.
    Gate,
    Up,
}

impl Slot {
    pub const COUNT: usize = 9;
    pub const ALL: [Slot; Slot::COUNT] = [
        Slot::Residual,
        Slot::Normed,
        Slot::Queries,
        Slot::Keys,
        Slot::Values,
        Slot::AttentionOut,
        Slot::BlockOut,
        Slot::Gate,
        Slot::Up,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    /// Elements per token, for a model's shapes.
    pub fn width(self, config: &ModelConfig) -> usize {
        match self {
            Slot::Residual | Slot::Normed | Slot::BlockOut => config.hidden_size,
            Slot::Queries | Slot::AttentionOut => config.q_dim(),
            Slot::Keys | Slot::Values => config.kv_dim(),
            Slot::Gate | Slot::Up => config.ffn_width(),
        }
    }

    /// What the buffer is called in the buffer list.
    pub fn label(self) -> &'static str {
        match self {
            Slot::Residual => "residual",
            Slot::Normed => "normed",
            Slot::Queries => "queries",
            Slot::Keys => "keys",
            Slot::Values => "values",
            Slot::AttentionOut => "attention out",
            Slot::BlockOut => "block out",
            Slot::Gate => "mlp gate",
            Slot::Up => "mlp up",
        }
    }
}

/// How q and k heads are rotated: which elements form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Element `i` with `i + head_dim/2` (Hugging Face's `rotate_half`).
    Halves,
    /// Element `2i` with `2i + 1` (GGUF Llama, whose q/k rows are stored permuted).
    Pairs,
}

impl From<RopeStyle> for ember_tensor::cpu::RopeLayout {
    fn from(style: RopeStyle) -> Self {
        match style {
            RopeStyle::Halves => Self::Halves,
            RopeStyle::Pairs => Self::Pairs,
        }
    }
}

/// The attention of one layer over one sequence of the pass, as the backend needs to know it.
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    pub layer: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Position of the sequence's first token in this pass; its cache holds `0..pos0` already.
    pub pos0: usize,
    /// Which of the pass's sequences ([`Backend::begin_batch`]'s segments, in order).
    pub segment: usize,
    /// The slots' row of the sequence's first token in this pass, and its tokens (rows).
    pub first_row: usize,
    pub rows: usize,
}

impl AttentionParams {
    /// The slots' rows of the sequence's tokens.
    pub fn row_range(&self) -> Range<usize> {
        self.first_row..self.first_row + self.rows
    }
}

/// One sequence's part of a forward pass over several ([`Backend::begin_batch`]): its block
/// table, whose blocks cover the positions `table.len()..table.len() + rows`, and how many of
/// the pass's tokens (rows) are its, following the segment before's.
#[derive(Clone, Copy, Debug)]
pub struct PassSegment<'a> {
    pub table: &'a BlockTable,
    pub rows: usize,
}

/// What one forward pass's work depends on besides its inputs ([`Backend::begin_pass`]) and
/// its cache: a backend may replay a recording of an earlier pass of the same shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PassShape {
    pub tokens: usize,
    /// Sequences the tokens belong to.
    pub sequences: usize,
    /// Rows of logits projected.
    pub logit_rows: usize,
}

impl PassShape {
    /// A decode step: one token of each sequence, each giving logits (so every row's work,
    /// the logits' included, is the same whatever the sequences).
    pub fn is_decode(&self) -> bool {
        self.tokens == self.sequences && self.logit_rows == self.tokens
    }
}

/// One projection of a group that reads the same input: its weight, bias and output slot.
pub struct Projection<'a, B: Backend> {
    pub weight: &'a B::Matrix,
    pub bias: Option<&'a B::Vector>,
    pub dst: Slot,
}

/// A weight matrix in a backend's memory: `rows × cols`, in its checkpoint dtype.
pub trait WeightMatrix {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn size_in_bytes(&self) -> usize;
    /// Rows `start..end` as a matrix of their own, sharing the storage (expert views).
    fn slice_rows(&self, start: usize, end: usize) -> Self;
}

/// A backend's pool of KV blocks ([`crate::kv_cache`]), and its host tier: slots in host
/// memory that hold copies of blocks evicted from the pool (on a GPU, pinned memory the
/// blocks come back from by copy instead of by recomputing them).
pub trait KvStore {
    fn layout(&self) -> &KvLayout;
    /// Blocks in the pool.
    fn blocks(&self) -> usize;
    /// Slots in the host tier.
    fn host_blocks(&self) -> usize;
    /// Copies pool block `block` into host slot `slot`, after the work enqueued before it.
    fn save_to_host(&mut self, block: u32, slot: u32) -> Result<()>;
    /// Copies host slot `slot` into pool block `block`, before the work enqueued after it.
    fn load_from_host(&mut self, slot: u32, block: u32) -> Result<()>;
}

/// Every operation enqueues its work and may fail (a device error, a launch refused); the CPU's
/// never do. A backend may run its work asynchronously: [`Backend::logits`] is where results
/// reach the host.
pub trait Backend {
    type Matrix: WeightMatrix;
    /// A small f32 vector (norm weights, biases).
    type Vector;
    /// Rotary cos/sin tables for the context.
    type Rope;
    type Kv: KvStore;
    /// What a mixture-of-experts layer needs besides its experts' matrices to run them (the
    /// CUDA backend: device tables of their addresses, so routing never visits the host).
    type Experts;

    /// Rows the activation slots hold: the longest batch one forward pass may run.
    fn max_batch(&self) -> usize;
    /// Rows of logits [`Backend::logits`] can return at once.
    fn logit_rows(&self) -> usize;

    fn load_matrix(
        &self,
        source: &dyn TensorSource,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Self::Matrix>;
    /// Matrices of `cols` columns that always take the same input (q, k and v), each
    /// `(name, rows)`, each returned as its own. A backend may lay their rows end to end in
    /// one allocation, so that one product runs them all ([`Backend::norm_linears`]); by
    /// default each is loaded apart.
    fn load_adjacent(
        &self,
        source: &dyn TensorSource,
        parts: &[(&str, usize)],
        cols: usize,
    ) -> Result<Vec<Self::Matrix>> {
        parts
            .iter()
            .map(|&(name, rows)| self.load_matrix(source, name, rows, cols))
            .collect()
    }
    /// A 3-d tensor `[count, rows, cols]` as one `count·rows × cols` matrix.
    fn load_stacked(
        &self,
        source: &dyn TensorSource,
        name: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Self::Matrix>;
    fn load_vector(
        &self,
        source: &dyn TensorSource,
        name: &str,
        len: usize,
    ) -> Result<Self::Vector>;
    fn rope_tables(&self, config: &ModelConfig, positions: usize) -> Result<Self::Rope>;

    /// Where the backend chooses among kernels of the same results by their speed (CUDA's
    /// batch-invariant products), times them once on the model's own matrices: each of
    /// `products` is one product's matrices in every layer. Changes no result, only which
    /// kernel computes it; by default nothing to time.
    fn tune_products(&mut self, products: &[TunedProduct<'_, Self>]) -> Result<()>
    where
        Self: Sized,
    {
        let _ = products;
        Ok(())
    }

    /// Takes the inputs of the next pass: its token ids, at the positions after the
    /// `table.len()` that `table`'s sequence holds, whose blocks cover them all.
    fn begin_pass(&mut self, tokens: &[u32], table: &BlockTable) -> Result<()>;
    /// Takes the inputs of a pass over several sequences: `tokens` are the segments' tokens
    /// one after another, each segment's at the positions after its table's. The model runs
    /// the products over every row at once and the attention per segment
    /// ([`Backend::rope_attention_segments`]); a row's result must not depend on the other
    /// rows of the pass (batch invariance).
    fn begin_batch(&mut self, tokens: &[u32], segments: &[PassSegment<'_>]) -> Result<()>;
    /// Runs `pass`, the device work of one forward pass from [`Backend::embed`] to
    /// [`Backend::project_logits`]. A backend may instead replay a recording of an earlier
    /// pass with the same shape over the same cache (CUDA graphs): the same work, on the
    /// inputs of [`Backend::begin_pass`]. So the operations inside a pass must take every
    /// position from those inputs, never from the host values they are also given.
    fn run_pass(
        &mut self,
        kv: &mut Self::Kv,
        _shape: PassShape,
        pass: &mut dyn FnMut(&mut Self, &mut Self::Kv) -> Result<()>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        pass(self, kv)
    }

    /// `Residual[i] = table[tokens[i]]` for the `n` tokens of the pass.
    fn embed(&mut self, table: &Self::Matrix, n: usize) -> Result<()>;
    /// `dst[r] = rms_norm(src[r]) · weight` for the rows in `rows`, written from row 0 of `dst`.
    fn rms_norm(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        weight: &Self::Vector,
        eps: f32,
        dst: Slot,
    ) -> Result<()>;
    /// `dst[..rows] = src[..rows] · weightᵀ + bias`.
    fn linear(
        &mut self,
        weight: &Self::Matrix,
        bias: Option<&Self::Vector>,
        src: Slot,
        rows: usize,
        dst: Slot,
    ) -> Result<()>;
    /// `dst_i[..rows.len()] = rms_norm(src[rows]) · weight_iᵀ + bias_i` for each projection:
    /// the projections that read one normalised input (q, k and v). The default normalises
    /// into `Normed` and projects from there ([`norm_linears_step_by_step`]); a backend may
    /// fuse the norm and the products into one pass over the weights.
    fn norm_linears(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        norm: &Self::Vector,
        eps: f32,
        projections: &[Projection<'_, Self>],
    ) -> Result<()>
    where
        Self: Sized,
    {
        norm_linears_step_by_step(self, src, rows, norm, eps, projections)
    }
    /// A SwiGLU MLP added into the residual stream: `Residual[rows] += down(silu(gate(h)) ·
    /// up(h))` with `h = rms_norm(Residual[rows])` (`gate` writes `Gate`, `up` writes `Up`;
    /// `down`'s slot is the residual's). The default runs it step by step
    /// ([`norm_mlp_step_by_step`]).
    fn norm_mlp(
        &mut self,
        rows: Range<usize>,
        norm: &Self::Vector,
        eps: f32,
        gate: Projection<'_, Self>,
        up: Projection<'_, Self>,
        down: Projection<'_, Self>,
    ) -> Result<()>
    where
        Self: Sized,
    {
        norm_mlp_step_by_step(self, rows, norm, eps, gate, up, down)
    }
    /// `Residual[offset..] += src[..rows] · weightᵀ`: an output projection added straight
    /// into the residual stream. The default goes through `BlockOut`; a backend whose kernels
    /// can accumulate saves the pass over it.
    fn linear_into_residual(
        &mut self,
        weight: &Self::Matrix,
        src: Slot,
        rows: usize,
        offset: usize,
    ) -> Result<()> {
        self.linear(weight, None, src, rows, Slot::BlockOut)?;
        self.add(Slot::Residual, offset, Slot::BlockOut, rows * weight.rows())
    }
    /// Rotates the tokens in `rows` of `slot`, `n_heads` heads each, row `rows.start + i` at
    /// position `pos0 + i`, after an RMS norm of each head by `norm`'s weight and epsilon where
    /// it is given (Qwen3's q and k norms).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &mut self,
        tables: &Self::Rope,
        style: RopeStyle,
        slot: Slot,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        rows: Range<usize>,
        norm: Option<(&Self::Vector, f32)>,
    ) -> Result<()>;
    /// [`Backend::rope`] of `Queries` (`p.n_heads` heads, normalised by `q_norm`) and `Keys`
    /// (`p.n_kv_heads`, by `k_norm`) of the segment's `p.rows` tokens, from row `p.first_row`,
    /// at `p.pos0..`; a backend may do both in one launch.
    fn rope_qk(
        &mut self,
        tables: &Self::Rope,
        style: RopeStyle,
        p: &AttentionParams,
        q_norm: Option<(&Self::Vector, f32)>,
        k_norm: Option<(&Self::Vector, f32)>,
    ) -> Result<()> {
        let (d, pos0) = (p.head_dim, p.pos0);
        let rows = p.row_range();
        self.rope(
            tables,
            style,
            Slot::Queries,
            p.n_heads,
            d,
            pos0,
            rows.clone(),
            q_norm,
        )?;
        self.rope(
            tables,
            style,
            Slot::Keys,
            p.n_kv_heads,
            d,
            pos0,
            rows,
            k_norm,
        )
    }
    /// Stores `Keys`/`Values` of the segment's `p.rows` tokens (from row `p.first_row`) in its
    /// sequence's blocks at `p.pos0..`, then causal attention of their `Queries` over the
    /// sequence into the same rows of `AttentionOut`.
    fn attention(&mut self, kv: &mut Self::Kv, p: AttentionParams) -> Result<()>;
    /// [`Backend::rope_qk`] then [`Backend::attention`]: a backend may do both in fewer passes
    /// (the CUDA decode step rotates and stores inside its attention kernel). `Queries` and
    /// `Keys` are not read afterwards, so they may be left unrotated.
    fn rope_attention(
        &mut self,
        kv: &mut Self::Kv,
        tables: &Self::Rope,
        style: RopeStyle,
        params: AttentionParams,
        q_norm: Option<(&Self::Vector, f32)>,
        k_norm: Option<(&Self::Vector, f32)>,
    ) -> Result<()> {
        self.rope_qk(tables, style, &params, q_norm, k_norm)?;
        self.attention(kv, params)
    }
    /// One layer's [`Backend::rope_attention`] for every sequence of the pass, `segments` in
    /// pass order. The default takes them one by one; a backend may take several at once (the
    /// CUDA backend: every sequence's decode row in one launch), each row's result still the
    /// one it gets alone.
    fn rope_attention_segments(
        &mut self,
        kv: &mut Self::Kv,
        tables: &Self::Rope,
        style: RopeStyle,
        segments: &[AttentionParams],
        q_norm: Option<(&Self::Vector, f32)>,
        k_norm: Option<(&Self::Vector, f32)>,
    ) -> Result<()> {
        for &p in segments {
            self.rope_attention(kv, tables, style, p, q_norm, k_norm)?;
        }
        Ok(())
    }
    /// `Gate[..len] = silu(Gate[..len]) · Up[..len]`.
    fn silu_mul(&mut self, len: usize) -> Result<()>;
    /// `dst[offset..offset + len] += src[..len]`.
    fn add(&mut self, dst: Slot, offset: usize, src: Slot, len: usize) -> Result<()>;

    /// A rank of a tensor-parallel group ([`crate::parallel`]): `slot[offset..offset + len]`
    /// becomes the sum of every rank's, added in rank order. Only a backend that has joined a
    /// group is asked.
    fn all_reduce(&mut self, slot: Slot, offset: usize, len: usize) -> Result<()> {
        let _ = (slot, offset, len);
        Err(tensor_parallel_unsupported())
    }
    /// [`Backend::embed`] on a rank holding rows `first..first + table.rows()` of the
    /// vocabulary: a token outside them gets zeros (another rank gives its row, and the ranks'
    /// rows are summed).
    fn embed_part(&mut self, table: &Self::Matrix, n: usize, first: usize) -> Result<()> {
        let _ = (table, n, first);
        Err(tensor_parallel_unsupported())
    }
    /// On a rank whose last [`Backend::project_logits`] gave its part of the vocabulary, the
    /// first `rows` rows of every rank's parts gathered into whole rows of `vocab` logits.
    fn gather_logits(&mut self, rows: usize, vocab: usize) -> Result<()> {
        let _ = (rows, vocab);
        Err(tensor_parallel_unsupported())
    }
    /// Made once per MoE layer at load, kept in [`Moe::prepared`].
    fn prepare_experts(&self, experts: &[Mlp<Self>]) -> Result<Self::Experts>
    where
        Self: Sized;
    /// A mixture-of-experts block added into the residual stream: routes each token's
    /// `h = rms_norm(Residual[rows])` to its top-k experts and adds their weighted sum to
    /// `Residual[rows]` (`Normed` and the MLP slots are scratch). On a rank of a
    /// tensor-parallel group, whose experts hold their share of the columns, the weighted sum
    /// is a partial one: the backend adds the ranks' ([`Backend::all_reduce`]) before the
    /// residual takes it.
    fn norm_moe(
        &mut self,
        moe: &Moe<Self>,
        rows: Range<usize>,
        norm: &Self::Vector,
        eps: f32,
    ) -> Result<()>
    where
        Self: Sized;
    /// Moves rows `rows[j]` of `slot` (`width` values each; `rows` ascending) to rows `j`:
    /// the rows that give logits, gathered before the last layer's MLP when they are not
    /// one run (several sequences' last tokens).
    fn gather_rows(&mut self, slot: Slot, width: usize, rows: &[usize]) -> Result<()>;
    /// Logits of the first `rows` rows of `Normed`, `head.rows()` each.
    fn project_logits(&mut self, head: &Self::Matrix, rows: usize) -> Result<()>;
    /// The first `len` logits of the last pass, on the host.
    fn logits(&mut self, len: usize) -> Result<&[f32]>;
    /// The greedy choice after the last pass, from its first row of `vocab` logits: the index
    /// of the largest, by [`cpu::argmax`]'s rule. A device backend picks it where the logits
    /// are and brings back the index alone, not the row.
    fn greedy_token(&mut self, vocab: usize) -> Result<u32> {
        Ok(cpu::argmax(self.logits(vocab)?))
    }

    /// [`Backend::greedy_token`] of each of the first `rows` rows of the last pass's logits:
    /// a device backend picks them all where the logits are and brings back only the picks.
    fn greedy_tokens(&mut self, rows: usize, vocab: usize) -> Result<Vec<u32>> {
        Ok(self
            .logits(rows * vocab)?
            .chunks(vocab)
            .map(cpu::argmax)
            .collect())
    }

    /// Enqueues the greedy choice after the last pass ([`Backend::greedy_token`]'s), to be
    /// the token of the next [`Backend::begin_fed_pass`] and read later by
    /// [`Backend::read_pick`], in order; at most [`PICKS_AHEAD`] may wait unread. So greedy
    /// decode runs ahead of the host: a GPU leaves the pick on the device and the next pass is
    /// enqueued before the pick comes back, so the device never waits on the host's turn
    /// between steps. (The CPU, whose work is done when a call returns, just keeps it.)
    fn pick_ahead(&mut self, vocab: usize) -> Result<()>;

    /// The oldest pick of [`Backend::pick_ahead`] not yet read, once it is made.
    fn read_pick(&mut self) -> Result<u32>;

    /// [`Backend::begin_pass`] of one token at `table.len()`: the last pick of
    /// [`Backend::pick_ahead`], which the host may not have seen.
    fn begin_fed_pass(&mut self, table: &BlockTable) -> Result<()>;
}

fn tensor_parallel_unsupported() -> crate::Error {
    crate::Error::Unsupported {
        what: "tensor parallelism".into(),
        backend: "this backend",
    }
}

/// Picks of [`Backend::pick_ahead`] that may wait unread: the one the host is about to read,
/// and the one of the pass enqueued after it.
pub const PICKS_AHEAD: usize = 2;

/// [`Backend::norm_linears`] one step at a time: the norm into `Normed`, then each product.
/// The slot indices of `slots`, when no two are the same (a group of projections that may
/// write their slots in one launch).
/// One product of a model, for [`Backend::tune_products`]: its matrices in each layer (one
/// product's parts each: q, k and v; gate and up; or one matrix) and the most rows a pass
/// gives it.
pub struct TunedProduct<'a, B: Backend> {
    pub layers: Vec<Vec<&'a B::Matrix>>,
    pub most_rows: usize,
}

pub(crate) fn distinct_slots(slots: impl IntoIterator<Item = Slot>) -> Option<Vec<usize>> {
    let mut seen: Vec<usize> = Vec::with_capacity(Slot::COUNT);
    for slot in slots {
        if seen.contains(&slot.index()) {
            return None;
        }
        seen.push(slot.index());
    }
    Some(seen)
}

pub fn norm_linears_step_by_step<B: Backend>(
    b: &mut B,
    src: Slot,
    rows: Range<usize>,
    norm: &B::Vector,
    eps: f32,
    projections: &[Projection<'_, B>],
) -> Result<()> {
    b.rms_norm(src, rows.clone(), norm, eps, Slot::Normed)?;
    for p in projections {
        b.linear(p.weight, p.bias, Slot::Normed, rows.len(), p.dst)?;
    }
    Ok(())
}

/// [`Backend::norm_mlp`] one step at a time: gate and up, SwiGLU into `Gate`, and the down
/// projection added into the residual (through `BlockOut` when it has a bias).
pub fn norm_mlp_step_by_step<B: Backend>(
    b: &mut B,
    rows: Range<usize>,
    norm: &B::Vector,
    eps: f32,
    gate: Projection<'_, B>,
    up: Projection<'_, B>,
    down: Projection<'_, B>,
) -> Result<()> {
    let (n, width) = (rows.len(), gate.weight.rows());
    let offset = rows.start * down.weight.rows();
    b.norm_linears(Slot::Residual, rows, norm, eps, &[gate, up])?;
    b.silu_mul(n * width)?;
    add_to_residual(b, &down, Slot::Gate, n, offset)
}

/// `Residual[offset..] += src[..rows] · weightᵀ + bias`: straight into the residual
/// ([`Backend::linear_into_residual`]), or through `BlockOut` when there is a bias.
pub fn add_to_residual<B: Backend>(
    b: &mut B,
    projection: &Projection<'_, B>,
    src: Slot,
    rows: usize,
    offset: usize,
) -> Result<()> {
    let weight = projection.weight;
    match projection.bias {
        Some(bias) => {
            b.linear(weight, Some(bias), src, rows, Slot::BlockOut)?;
            b.add(Slot::Residual, offset, Slot::BlockOut, rows * weight.rows())
        }
        None => b.linear_into_residual(weight, src, rows, offset),
    }
}
