//! The decoder-only transformer shared by Llama, Qwen2, Qwen3 and Qwen3-MoE.
//!
//! The architectures differ only in options read from the config: q/k/v biases (Qwen2),
//! per-head q/k norms (Qwen3), Llama 3 rope scaling, and mixture-of-experts MLPs on some
//! layers (Qwen3-MoE). There is one forward pass, written once against [`Backend`]; a backend
//! brings only storage and kernels. Building one from a checkpoint's tensors: `load.rs`.

use std::ops::Range;

use crate::backend::{
    AttentionParams, Backend, KvStore, PassSegment, PassShape, Projection, RopeStyle, Slot,
    TunedProduct, WeightMatrix, add_to_residual,
};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::BlockTable;
use crate::parallel::Shard;

mod load;

/// A projection with an optional bias.
pub struct Linear<B: Backend> {
    pub weight: B::Matrix,
    pub bias: Option<B::Vector>,
}

impl<B: Backend> Linear<B> {
    /// This projection writing `dst`, as one of a group ([`Backend::norm_linears`]).
    fn writing(&self, dst: Slot) -> Projection<'_, B> {
        Projection {
            weight: &self.weight,
            bias: self.bias.as_ref(),
            dst,
        }
    }

    /// `Residual[offset..] += src[..rows] · weightᵀ + bias`.
    fn apply_to_residual(&self, b: &mut B, src: Slot, rows: usize, offset: usize) -> Result<()> {
        add_to_residual(b, &self.writing(Slot::Residual), src, rows, offset)
    }

    /// The same on a rank of a tensor-parallel group, whose weight holds its share of the
    /// input columns: its product is a partial sum, so the ranks' are added up (the bias
    /// with rank 0's) before the residual takes them.
    fn apply_partial_to_residual(
        &self,
        b: &mut B,
        src: Slot,
        rows: usize,
        offset: usize,
    ) -> Result<()> {
        let len = rows * self.weight.rows();
        b.linear(&self.weight, self.bias.as_ref(), src, rows, Slot::BlockOut)?;
        b.all_reduce(Slot::BlockOut, 0, len)?;
        b.add(Slot::Residual, offset, Slot::BlockOut, len)
    }
}

/// Gate, up and down projections with SwiGLU between.
pub struct Mlp<B: Backend> {
    pub gate: Linear<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    pub fn weight_bytes(&self) -> usize {
        self.gate.weight.size_in_bytes()
            + self.up.weight.size_in_bytes()
            + self.down.weight.size_in_bytes()
    }

    /// The MLP's width (its intermediate size).
    pub fn width(&self) -> usize {
        self.gate.weight.rows()
    }

    /// `Residual[rows] += down(silu(gate(h)) · up(h))` with `h = rms_norm(Residual[rows])`.
    fn apply_to_residual(
        &self,
        b: &mut B,
        rows: Range<usize>,
        norm: &B::Vector,
        eps: f32,
    ) -> Result<()> {
        let (gate, up) = (self.gate.writing(Slot::Gate), self.up.writing(Slot::Up));
        b.norm_mlp(rows, norm, eps, gate, up, self.down.writing(Slot::Residual))
    }

    /// [`Self::apply_to_residual`] on a rank holding its share of the MLP's columns: its
    /// down product a partial sum ([`Linear::apply_partial_to_residual`]).
    fn apply_partial_to_residual(
        &self,
        b: &mut B,
        rows: Range<usize>,
        norm: &B::Vector,
        eps: f32,
    ) -> Result<()> {
        let (gate, up) = (self.gate.writing(Slot::Gate), self.up.writing(Slot::Up));
        let (n, offset) = (rows.len(), rows.start * self.down.weight.rows());
        b.norm_linears(Slot::Residual, rows, norm, eps, &[gate, up])?;
        b.silu_mul(n * self.width())?;
        self.down
            .apply_partial_to_residual(b, Slot::Gate, n, offset)
    }
}

/// A mixture of experts: a router picks `top_k` experts per token.
pub struct Moe<B: Backend> {
    /// Every expert's row, held whole by every rank.
    pub router: B::Matrix,
    /// The experts this rank holds: all of them, unless the model is split by experts
    /// ([`crate::parallel::ExpertSplit::Experts`]).
    pub experts: Vec<Mlp<B>>,
    /// The router's index of `experts[0]`.
    pub first_expert: usize,
    /// The backend's own form of `experts` ([`Backend::prepare_experts`]).
    pub prepared: B::Experts,
    pub top_k: usize,
    /// Renormalise the chosen experts' probabilities to sum to 1 (Qwen3-MoE's option).
    pub norm_topk_prob: bool,
}

pub enum FeedForward<B: Backend> {
    Dense(Mlp<B>),
    Sparse(Moe<B>),
}

impl<B: Backend> FeedForward<B> {
    /// The MLP of a dense layer (for tools that run a layer's kernels one by one).
    pub fn dense(&self) -> Option<&Mlp<B>> {
        match self {
            FeedForward::Dense(mlp) => Some(mlp),
            FeedForward::Sparse(_) => None,
        }
    }
}

pub struct Attention<B: Backend> {
    pub q: Linear<B>,
    pub k: Linear<B>,
    pub v: Linear<B>,
    pub o: Linear<B>,
    pub q_norm: Option<B::Vector>,
    pub k_norm: Option<B::Vector>,
}

pub struct Layer<B: Backend> {
    pub input_norm: B::Vector,
    pub attention: Attention<B>,
    pub post_attention_norm: B::Vector,
    pub feed_forward: FeedForward<B>,
}

/// The tokens of a forward pass.
#[derive(Clone, Copy, Debug)]
pub enum PassInput<'t> {
    /// Token ids from the host.
    Tokens(&'t [u32]),
    /// One token: the greedy pick of the pass before, left on the device by
    /// [`Backend::pick_ahead`].
    Fed,
}

impl<'t> From<&'t [u32]> for PassInput<'t> {
    fn from(tokens: &'t [u32]) -> Self {
        PassInput::Tokens(tokens)
    }
}

/// Which rows of logits a forward pass computes, for each of its sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// The last token's only: what generation needs.
    Last,
    /// Every token's (prompt log-probabilities); the backend must have the rows.
    All,
    /// None: a prompt chunk before the sequence's last, in a pass with others.
    None,
}

/// One sequence's part of a forward pass over several ([`Transformer::forward_batch`]): its
/// tokens go after the positions its table holds, and its keys and values into its blocks.
#[derive(Debug)]
pub struct SequencePass<'s, 't> {
    pub seq: &'s mut BlockTable,
    pub tokens: &'t [u32],
    pub logits: Logits,
}

/// Where a pass's rows come from: each sequence's run of rows and positions, and the rows
/// whose logits it gives, in order.
struct PassPlan {
    rows: usize,
    segments: Vec<SegmentRows>,
    logit_rows: Vec<usize>,
}

#[derive(Clone, Copy)]
struct SegmentRows {
    pos0: usize,
    first_row: usize,
    rows: usize,
}

impl PassPlan {
    /// The rows that give logits as one run `a..b` of the slots: where they are when they
    /// already form one (a single sequence's), else gathered to the front first.
    fn logit_rows_as_run<B: Backend>(&self, b: &mut B, width: usize) -> Result<Range<usize>> {
        let rows = &self.logit_rows;
        match (rows.first(), rows.last()) {
            (None, _) | (_, None) => Ok(0..0),
            (Some(&first), Some(&last)) if last + 1 - first == rows.len() => Ok(first..last + 1),
            _ => {
                b.gather_rows(Slot::Residual, width, rows)?;
                Ok(0..rows.len())
            }
        }
    }
}

pub struct Transformer<B: Backend> {
    /// The shapes this model computes: a rank's share of the heads and MLP columns when it is
    /// one of a tensor-parallel group ([`Self::load_shard`]), the vocabulary always whole.
    pub config: ModelConfig,
    /// Which rank of how many; [`Shard::WHOLE`] for a model on one backend.
    pub shard: Shard,
    /// The embedding's (and head's) rows: the vocabulary, or the rank's part of it.
    pub embed_tokens: B::Matrix,
    pub layers: Vec<Layer<B>>,
    pub norm: B::Vector,
    /// The output projection; the embedding matrix itself when the embeddings are tied.
    lm_head: Option<B::Matrix>,
    rope: B::Rope,
    /// Positions the rotary tables cover: the context.
    positions: usize,
}

impl<B: Backend> Transformer<B> {
    pub fn lm_head(&self) -> &B::Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Lets `backend` time its products' kernels on this model's matrices
    /// ([`Backend::tune_products`]): q/k/v, o, and the dense layers' gate/up and down, each
    /// over every layer, and the output head over the logit rows.
    pub fn tune_products(&self, backend: &mut B) -> Result<()> {
        let (mut qkv, mut o, mut gate_up, mut down) = (vec![], vec![], vec![], vec![]);
        for layer in &self.layers {
            let a = &layer.attention;
            qkv.push(vec![&a.q.weight, &a.k.weight, &a.v.weight]);
            o.push(vec![&a.o.weight]);
            // Experts run on kernels of their own.
            if let Some(mlp) = layer.feed_forward.dense() {
                gate_up.push(vec![&mlp.gate.weight, &mlp.up.weight]);
                down.push(vec![&mlp.down.weight]);
            }
        }
        let rows = backend.max_batch();
        let mut products: Vec<TunedProduct<'_, B>> = [qkv, o, gate_up, down]
            .into_iter()
            .map(|layers| TunedProduct {
                layers,
                most_rows: rows,
            })
            .collect();
        products.push(TunedProduct {
            layers: vec![vec![self.lm_head()]],
            most_rows: backend.logit_rows(),
        });
        backend.tune_products(&products)
    }

    /// Weight bytes one decoded token reads: every layer's matrices (only the routed experts of
    /// sparse layers, `top_k` of them), the output projection, and one embedding row.
    pub fn weight_bytes_per_token(&self) -> usize {
        let mut bytes = self.lm_head().size_in_bytes()
            + self.embed_tokens.size_in_bytes() / self.embed_tokens.rows();
        for layer in &self.layers {
            let a = &layer.attention;
            bytes += [&a.q, &a.k, &a.v, &a.o]
                .iter()
                .map(|l| l.weight.size_in_bytes())
                .sum::<usize>();
            bytes += match &layer.feed_forward {
                FeedForward::Dense(mlp) => mlp.weight_bytes(),
                FeedForward::Sparse(moe) => {
                    // A token's top-k experts; where the ranks share the experts out, this
                    // rank's share of them (with routing spread evenly).
                    let expert = moe.experts.first().map_or(0, Mlp::weight_bytes);
                    let held = moe.experts.len();
                    moe.router.size_in_bytes() + moe.top_k * expert * held / moe.router.rows()
                }
            };
        }
        bytes
    }

    /// Runs `tokens` (at most the backend's batch) at the positions after what `seq` holds,
    /// appends their keys and values to its blocks in `kv`, and returns the requested logits,
    /// `vocab_size` per row.
    pub fn forward<'b>(
        &self,
        b: &'b mut B,
        kv: &mut B::Kv,
        seq: &mut BlockTable,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<&'b [f32]> {
        self.forward_batch(
            b,
            kv,
            &mut [SequencePass {
                seq,
                tokens,
                logits,
            }],
        )
    }

    /// [`Self::forward`] of several sequences in one pass (at most the backend's batch of
    /// tokens in all): the products run over every row at once, the attention sequence by
    /// sequence over its own blocks. Returns the sequences' logits one after another, each
    /// sequence's rows as its [`Logits`] asks (none, its last, or all). A row's results are
    /// those it gets alone where the backend's kernels are batch-invariant (the CPU's are).
    pub fn forward_batch<'b>(
        &self,
        b: &'b mut B,
        kv: &mut B::Kv,
        seqs: &mut [SequencePass<'_, '_>],
    ) -> Result<&'b [f32]> {
        let rows = self.run_batch(b, kv, seqs)?;
        if rows == 0 {
            return Ok(&[]);
        }
        b.logits(rows * self.config.vocab_size)
    }

    /// [`Self::forward_batch`] with the logits left on the backend: returns their rows, for
    /// [`Backend::logits`] or [`Backend::greedy_tokens`] to take.
    pub fn run_batch(
        &self,
        b: &mut B,
        kv: &mut B::Kv,
        seqs: &mut [SequencePass<'_, '_>],
    ) -> Result<usize> {
        self.run(b, kv, seqs, false)
    }

    /// [`Self::forward`] of a non-empty `tokens` with the last token's logits, returning the
    /// greedy choice among them ([`Backend::greedy_token`]) instead of the logits.
    pub fn forward_greedy(
        &self,
        b: &mut B,
        kv: &mut B::Kv,
        seq: &mut BlockTable,
        tokens: &[u32],
    ) -> Result<u32> {
        self.run_for_last_token(b, kv, seq, tokens, false)?;
        b.greedy_token(self.config.vocab_size)
    }

    /// [`Self::forward_greedy`] running ahead of the host: a pass of `input` whose pick is
    /// enqueued, not waited for ([`Backend::pick_ahead`]); [`Backend::read_pick`] reads it. A pass
    /// of [`PassInput::Fed`] takes the token of the pick enqueued before it, which the host
    /// has not seen, so the device goes from one step to the next without waiting for it.
    pub fn forward_ahead(
        &self,
        b: &mut B,
        kv: &mut B::Kv,
        seq: &mut BlockTable,
        input: PassInput<'_>,
    ) -> Result<()> {
        let (tokens, fed) = match input {
            PassInput::Tokens(tokens) => (tokens, false),
            PassInput::Fed => (&[][..], true),
        };
        self.run_for_last_token(b, kv, seq, tokens, fed)?;
        b.pick_ahead(self.config.vocab_size)
    }

    /// A pass of one sequence that leaves its last token's logits on the backend; an empty
    /// pass (nothing to pick from) is an error.
    fn run_for_last_token(
        &self,
        b: &mut B,
        kv: &mut B::Kv,
        seq: &mut BlockTable,
        tokens: &[u32],
        fed: bool,
    ) -> Result<()> {
        let logits = Logits::Last;
        let pass = SequencePass {
            seq,
            tokens,
            logits,
        };
        if self.run(b, kv, &mut [pass], fed)? == 0 {
            return Err(Error::NoTokens);
        }
        Ok(())
    }

    /// The work of [`Self::forward_batch`], the logits left on the backend; returns their
    /// rows. `fed`: one sequence, whose one token is the pick the pass before left on the
    /// device (its `tokens` are empty).
    fn run(
        &self,
        b: &mut B,
        kv: &mut B::Kv,
        seqs: &mut [SequencePass<'_, '_>],
        fed: bool,
    ) -> Result<usize> {
        let c = &self.config;
        debug_assert!(!fed || seqs.len() == 1);
        let rows_of = |s: &SequencePass<'_, '_>| if fed { 1 } else { s.tokens.len() };
        let n: usize = seqs.iter().map(rows_of).sum();
        if n > b.max_batch() {
            return Err(Error::BatchTooLarge {
                requested: n,
                capacity: b.max_batch(),
            });
        }
        let block_size = kv.layout().block_size;
        let mut plan = PassPlan {
            rows: n,
            segments: Vec::with_capacity(seqs.len()),
            logit_rows: Vec::new(),
        };
        for s in seqs.iter() {
            // A fed pass's one token is on the device: nothing of it to check here.
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(Error::TokenOutOfRange {
                    id,
                    vocab_size: c.vocab_size,
                });
            }
            let (pos0, rows) = (s.seq.len(), rows_of(s));
            self.check_room(s.seq, kv.blocks(), block_size, rows)?;
            if rows == 0 {
                continue;
            }
            let first_row = plan.segments.last().map_or(0, |p| p.first_row + p.rows);
            match s.logits {
                Logits::Last => plan.logit_rows.push(first_row + rows - 1),
                Logits::All => plan.logit_rows.extend(first_row..first_row + rows),
                Logits::None => {}
            }
            plan.segments.push(SegmentRows {
                pos0,
                first_row,
                rows,
            });
        }
        let m = plan.logit_rows.len();
        if m > b.logit_rows() {
            return Err(Error::BatchTooLarge {
                requested: m,
                capacity: b.logit_rows(),
            });
        }
        if n == 0 {
            return Ok(0);
        }
        match seqs {
            _ if fed => b.begin_fed_pass(seqs[0].seq)?,
            [one] => b.begin_pass(one.tokens, one.seq)?,
            _ => {
                let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens).copied().collect();
                let segments: Vec<PassSegment<'_>> = seqs
                    .iter()
                    .filter(|s| !s.tokens.is_empty())
                    .map(|s| PassSegment {
                        table: s.seq,
                        rows: s.tokens.len(),
                    })
                    .collect();
                b.begin_batch(&tokens, &segments)?;
            }
        }
        let shape = PassShape {
            tokens: n,
            sequences: plan.segments.len(),
            logit_rows: m,
        };
        b.run_pass(kv, shape, &mut |b, kv| self.pass(b, kv, &plan))?;
        for s in seqs.iter_mut() {
            let rows = rows_of(s);
            s.seq.advance(rows);
        }
        Ok(m)
    }

    /// Whether `rows` more positions fit `seq`: inside the context and its blocks, and its
    /// blocks inside the pool (one outside would be another's memory).
    fn check_room(
        &self,
        seq: &BlockTable,
        pool_blocks: usize,
        block_size: usize,
        rows: usize,
    ) -> Result<()> {
        let pos0 = seq.len();
        let capacity = seq.capacity(block_size).min(self.positions);
        let written = pos0 / block_size..(pos0 + rows).div_ceil(block_size);
        let written =
            &seq.blocks()[written.start.min(written.end)..written.end.min(seq.blocks().len())];
        if let Some(&block) = written.iter().find(|&&b| b as usize >= pool_blocks) {
            return Err(Error::Unsupported {
                what: format!("kv block {block} of a pool of {pool_blocks}"),
                backend: "any",
            });
        }
        if pos0 + rows > capacity {
            return Err(Error::ContextFull {
                used: pos0,
                requested: rows,
                capacity,
            });
        }
        Ok(())
    }

    /// The device work of a forward pass.
    fn pass(&self, b: &mut B, kv: &mut B::Kv, plan: &PassPlan) -> Result<()> {
        let c = &self.config;
        let (eps, n) = (c.rms_norm_eps, plan.rows);
        if self.shard.is_whole() {
            b.embed(&self.embed_tokens, n)?;
        } else {
            b.embed_part(&self.embed_tokens, n, self.shard.part(c.vocab_size).start)?;
            b.all_reduce(Slot::Residual, 0, n * c.hidden_size)?;
        }
        let mut segments = self.attention_segments(plan);
        let mut logit_rows = 0..0;
        for (index, layer) in self.layers.iter().enumerate() {
            self.attention(b, kv, index, layer, n, &mut segments)?;

            // The last layer's MLP runs only on the rows that give logits (llama.cpp's
            // `inp_out_ids`): less work, and its products see the batch llama.cpp's do.
            let rows = if index + 1 == self.layers.len() {
                logit_rows = plan.logit_rows_as_run(b, c.hidden_size)?;
                logit_rows.clone()
            } else {
                0..n
            };
            if rows.is_empty() {
                continue;
            }
            let norm = &layer.post_attention_norm;
            match &layer.feed_forward {
                FeedForward::Dense(mlp) if !self.shard.is_whole() => {
                    mlp.apply_partial_to_residual(b, rows, norm, eps)?
                }
                FeedForward::Dense(mlp) => mlp.apply_to_residual(b, rows, norm, eps)?,
                FeedForward::Sparse(moe) => b.norm_moe(moe, rows, norm, eps)?,
            }
        }
        let m = logit_rows.len();
        if m == 0 {
            return Ok(());
        }
        b.rms_norm(Slot::Residual, logit_rows, &self.norm, eps, Slot::Normed)?;
        b.project_logits(self.lm_head(), m)?;
        if !self.shard.is_whole() {
            b.gather_logits(m, c.vocab_size)?;
        }
        Ok(())
    }

    /// Each sequence's attention in a pass, for layer 0.
    fn attention_segments(&self, plan: &PassPlan) -> Vec<AttentionParams> {
        let c = &self.config;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let segment = |(segment, rows): (usize, &SegmentRows)| AttentionParams {
            layer: 0,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale,
            pos0: rows.pos0,
            segment,
            first_row: rows.first_row,
            rows: rows.rows,
        };
        plan.segments.iter().enumerate().map(segment).collect()
    }

    /// A layer's attention: q, k and v over every row, then each sequence's rotation, cache
    /// store and attention over its own blocks, then the output projection over every row.
    fn attention(
        &self,
        b: &mut B,
        kv: &mut B::Kv,
        index: usize,
        layer: &Layer<B>,
        n: usize,
        segments: &mut [AttentionParams],
    ) -> Result<()> {
        let c = &self.config;
        let (a, eps) = (&layer.attention, c.rms_norm_eps);
        let qkv = [
            a.q.writing(Slot::Queries),
            a.k.writing(Slot::Keys),
            a.v.writing(Slot::Values),
        ];
        b.norm_linears(Slot::Residual, 0..n, &layer.input_norm, eps, &qkv)?;
        let (q_norm, k_norm) = (
            a.q_norm.as_ref().map(|w| (w, eps)),
            a.k_norm.as_ref().map(|w| (w, eps)),
        );
        let style = if c.rope_interleaved {
            RopeStyle::Pairs
        } else {
            RopeStyle::Halves
        };
        for p in segments.iter_mut() {
            p.layer = index;
        }
        b.rope_attention_segments(kv, &self.rope, style, segments, q_norm, k_norm)?;
        if self.shard.is_whole() {
            a.o.apply_to_residual(b, Slot::AttentionOut, n, 0)
        } else {
            a.o.apply_partial_to_residual(b, Slot::AttentionOut, n, 0)
        }
    }
}
