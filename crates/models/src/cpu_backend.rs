//! The CPU backend: weights read in place from the mapped checkpoint, activations in host
//! buffers, and `ember_tensor::cpu`'s kernels on a thread pool.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use ember_checkpoint::TensorSource;
use ember_tensor::cpu::{self, AttentionShape, RopeLayout, RopeTables};
use ember_tensor::{BufferOwner, DType, ThreadPool};

use crate::backend::{
    AttentionParams, Backend, PICKS_AHEAD, PassSegment, Projection, RopeStyle, Slot,
    distinct_slots, norm_linears_step_by_step,
};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::{BlockTable, KvPool};
use crate::parallel::{HostGroup, Shard};
use crate::rope::RopeTable;
use crate::transformer::{Mlp, Moe};
use crate::weights::{Matrix, Vector, WeightLoader};
use crate::workspace::{MoeWorkspace, Workspace};

/// Whose arithmetic the CPU kernels reproduce where the two references differ in rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arithmetic {
    /// Hugging Face transformers' (the golden fixtures; safetensors checkpoints).
    Transformers,
    /// llama.cpp's, op by op (GGUF checkpoints with an f16 cache, checked against llama.cpp).
    LlamaCpp,
}

pub struct CpuBackend {
    /// Shared with a draft model's backend: the two never run at once, and one set of
    /// workers leaves no idle spinners beside the running pass.
    pool: Arc<ThreadPool>,
    arithmetic: Arithmetic,
    owner: BufferOwner,
    ws: Workspace,
    /// The token ids of the pass under way.
    tokens: Vec<u32>,
    /// The blocks of the pass's sequences, one after another, and where each one's are in it.
    tables: Vec<u32>,
    segment_tables: Vec<Range<usize>>,
    /// Greedy picks not yet read ([`Backend::pick_ahead`]), oldest first, and the last one.
    picks: VecDeque<u32>,
    last_pick: Option<u32>,
    /// See [`CpuBackend::owning_weights`].
    owns_weights: bool,
    /// The quantized types of the matrices loaded, for reports.
    quantized_types: Mutex<Vec<DType>>,
    /// The tensor-parallel group this backend is a rank of, if any ([`CpuBackend::join_group`]).
    group: Option<(Arc<HostGroup>, Shard)>,
}

impl CpuBackend {
    /// Makes the activation buffers for batches of up to `max_batch` tokens over `context`
    /// positions, with room for `logit_rows` rows of logits.
    pub fn new(
        config: &ModelConfig,
        pool: impl Into<Arc<ThreadPool>>,
        owner: &BufferOwner,
        max_batch: usize,
        context: usize,
        logit_rows: usize,
        arithmetic: Arithmetic,
    ) -> Result<Self> {
        let pool = pool.into();
        let ws = Workspace::new(
            config,
            max_batch,
            context,
            logit_rows,
            pool.n_threads(),
            owner,
        )?;
        Ok(CpuBackend {
            pool,
            arithmetic,
            owner: owner.clone(),
            ws,
            tokens: Vec::with_capacity(max_batch),
            tables: Vec::new(),
            segment_tables: Vec::new(),
            picks: VecDeque::with_capacity(PICKS_AHEAD),
            last_pick: None,
            owns_weights: false,
            quantized_types: Mutex::new(Vec::new()),
            group: None,
        })
    }

    /// The quantized types of the matrices loaded so far, each once.
    pub fn quantized_types(&self) -> Vec<DType> {
        self.quantized_types
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn note_type(&self, matrix: &Matrix) {
        let mut types = self
            .quantized_types
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if matrix.dtype.is_quantized() && !types.contains(&matrix.dtype) {
            types.push(matrix.dtype);
        }
    }

    /// Matrices loaded from now on are copied into buffers of this backend's own, each in
    /// the layout its kernels read best ([`ember_tensor::cpu::WeightLayout::best_for`]): a
    /// checkpoint's mapping is then no longer needed (nor held) once the model is loaded.
    pub fn owning_weights(mut self) -> Self {
        self.owns_weights = true;
        self
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// Makes this backend rank `shard.rank` of `group` ([`crate::parallel`]): its model is
    /// that shard's ([`crate::Transformer::load_shard`]), and its passes meet the other ranks'
    /// in the group's collectives.
    pub fn join_group(mut self, group: Arc<HostGroup>, shard: Shard) -> Self {
        assert_eq!(
            group.ranks(),
            shard.ranks,
            "a group of {} ranks",
            group.ranks()
        );
        self.group = Some((group, shard));
        self
    }

    /// The group and this rank's place in it (a handle of its own, so that the slots may be
    /// borrowed beside it).
    fn group(&self) -> Result<(Arc<HostGroup>, Shard)> {
        self.group.clone().ok_or_else(|| Error::Unsupported {
            what: "a collective outside a tensor-parallel group".into(),
            backend: "the CPU",
        })
    }

    /// The pool, for another backend to share.
    pub fn shared_pool(&self) -> Arc<ThreadPool> {
        Arc::clone(&self.pool)
    }

    fn slot_mut(&mut self, slot: Slot) -> &mut [f32] {
        self.ws.slots[slot.index()].as_mut_slice()
    }

    /// The pool, `src` to read, `dst` to write (they must differ) and the matmul scratch.
    fn src_dst(&mut self, src: Slot, dst: Slot) -> (&ThreadPool, &[f32], &mut [f32], &mut [f32]) {
        let CpuBackend { pool, ws, .. } = self;
        let Workspace {
            slots,
            matmul_scratch,
            ..
        } = ws;
        let [s, d] = slots
            .get_disjoint_mut([src.index(), dst.index()])
            .expect("distinct slots");
        (
            pool,
            s.as_slice(),
            d.as_mut_slice(),
            matmul_scratch.as_mut_slice(),
        )
    }
}

impl Backend for CpuBackend {
    type Matrix = Matrix;
    type Vector = Vector;
    type Rope = RopeTable;
    type Kv = KvPool;
    type Experts = ();

    fn max_batch(&self) -> usize {
        self.ws.max_batch
    }

    fn logit_rows(&self) -> usize {
        self.ws.logit_rows
    }

    fn load_matrix(
        &self,
        source: &dyn TensorSource,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix> {
        let matrix = self.loader(source).matrix(name, rows, cols)?;
        self.note_type(&matrix);
        Ok(matrix)
    }

    fn load_stacked(
        &self,
        source: &dyn TensorSource,
        name: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix> {
        let matrix = self.loader(source).stacked(name, count, rows, cols)?;
        self.note_type(&matrix);
        Ok(matrix)
    }

    fn load_vector(&self, source: &dyn TensorSource, name: &str, len: usize) -> Result<Vector> {
        self.loader(source).vector(name, len)
    }

    fn rope_tables(&self, config: &ModelConfig, positions: usize) -> Result<RopeTable> {
        RopeTable::new(config, positions, &self.owner)
    }

    fn begin_pass(&mut self, tokens: &[u32], table: &BlockTable) -> Result<()> {
        let rows = tokens.len();
        self.begin_batch(tokens, &[PassSegment { table, rows }])
    }

    fn begin_batch(&mut self, tokens: &[u32], segments: &[PassSegment<'_>]) -> Result<()> {
        // Picks not read by now never will be (as on a GPU, a pass of host tokens starts over).
        self.picks.clear();
        self.last_pick = None;
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.take_tables(segments.iter().map(|s| s.table));
        Ok(())
    }

    fn begin_fed_pass(&mut self, table: &BlockTable) -> Result<()> {
        let token = self.last_pick.ok_or(Error::NoTokens)?;
        self.tokens.clear();
        self.tokens.push(token);
        self.take_tables([table]);
        Ok(())
    }

    fn embed(&mut self, table: &Matrix, n: usize) -> Result<()> {
        // The whole vocabulary is the part starting at row 0 (tokens were checked against it).
        self.embed_part(table, n, 0)
    }

    fn rms_norm(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        weight: &Vector,
        eps: f32,
        dst: Slot,
    ) -> Result<()> {
        let width = weight.as_slice().len();
        let (pool, s, d, _) = self.src_dst(src, dst);
        let x = &s[rows.start * width..rows.end * width];
        cpu::rms_norm(pool, x, weight.as_slice(), eps, d);
        Ok(())
    }

    /// The norm, then every projection as one share of the threads where their weights
    /// allow it ([`cpu::matmul_shared_input`]): a decode step's q, k and v (gate and up) wait
    /// for the threads once, not once each.
    fn norm_linears(
        &mut self,
        src: Slot,
        rows: Range<usize>,
        norm: &Vector,
        eps: f32,
        projections: &[Projection<'_, Self>],
    ) -> Result<()> {
        let dsts = distinct_slots(projections.iter().map(|p| p.dst))
            .filter(|dsts| !dsts.contains(&Slot::Normed.index()));
        let Some(dsts) = dsts else {
            return norm_linears_step_by_step(self, src, rows, norm, eps, projections);
        };
        let m = rows.len();
        self.rms_norm(src, rows, norm, eps, Slot::Normed)?;
        let CpuBackend { pool, ws, .. } = self;
        let Workspace {
            slots,
            matmul_scratch,
            ..
        } = ws;
        let mut x = None;
        let mut outs: Vec<(usize, &mut [f32])> = Vec::with_capacity(dsts.len());
        for (i, slot) in slots.iter_mut().enumerate() {
            if i == Slot::Normed.index() {
                x = Some(slot.as_slice());
            } else if dsts.contains(&i) {
                outs.push((i, slot.as_mut_slice()));
            }
        }
        let x = x.expect("the normed slot");
        // In the projections' order.
        outs.sort_by_key(|(i, _)| dsts.iter().position(|d| d == i));
        let weights: Vec<_> = projections.iter().map(|p| p.weight.as_mat()).collect();
        let mut ys: Vec<&mut [f32]> = outs
            .into_iter()
            .zip(&weights)
            .map(|((_, y), w)| &mut y[..m * w.rows])
            .collect();
        let k = weights[0].cols;
        cpu::matmul_shared_input(
            pool,
            &x[..m * k],
            m,
            &weights,
            &mut ys,
            matmul_scratch.as_mut_slice(),
        );
        for (p, y) in projections.iter().zip(ys) {
            if let Some(bias) = p.bias {
                cpu::add_bias(y, bias.as_slice());
            }
        }
        Ok(())
    }

    fn linear(
        &mut self,
        weight: &Matrix,
        bias: Option<&Vector>,
        src: Slot,
        rows: usize,
        dst: Slot,
    ) -> Result<()> {
        let (pool, x, y, scratch) = self.src_dst(src, dst);
        linear(
            pool,
            weight,
            bias,
            &x[..rows * weight.cols],
            rows,
            y,
            scratch,
        );
        Ok(())
    }

    fn rope(
        &mut self,
        tables: &RopeTable,
        style: RopeStyle,
        slot: Slot,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        rows: Range<usize>,
        norm: Option<(&Vector, f32)>,
    ) -> Result<()> {
        let width = n_heads * head_dim;
        let values = rows.start * width..rows.end * width;
        if let Some((weight, eps)) = norm {
            let pool = &self.pool;
            let x = &mut self.ws.slots[slot.index()].as_mut_slice::<f32>()[values.clone()];
            cpu::rms_norm_in_place(pool, x, weight.as_slice(), eps);
        }
        let layout = RopeLayout::from(style);
        // llama.cpp's angles and fused rotation when imitating it (see `Arithmetic`).
        let ggml = self.arithmetic == Arithmetic::LlamaCpp;
        let (cos, sin) = tables.tables(ggml);
        let tables = RopeTables {
            cos,
            sin,
            layout,
            fused: ggml,
        };
        let pool = &self.pool;
        let x = &mut self.ws.slots[slot.index()].as_mut_slice::<f32>()[values];
        cpu::rope_in_place(pool, x, n_heads, head_dim, pos0, tables);
        Ok(())
    }

    fn attention(&mut self, kv: &mut KvPool, p: AttentionParams) -> Result<()> {
        let (q_width, kv_width) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
        let rows = p.row_range();
        let q_values = rows.start * q_width..rows.end * q_width;
        let kv_values = rows.start * kv_width..rows.end * kv_width;
        let pool = &self.pool;
        let Workspace {
            slots,
            attention_scratch,
            ..
        } = &mut self.ws;
        let [q, k, v, out] = slots
            .get_disjoint_mut([
                Slot::Queries.index(),
                Slot::Keys.index(),
                Slot::Values.index(),
                Slot::AttentionOut.index(),
            ])
            .expect("distinct slots");
        let table = &self.tables[self.segment_tables[p.segment].clone()];
        kv.write(
            p.layer,
            table,
            p.pos0,
            &k.as_slice()[kv_values.clone()],
            &v.as_slice()[kv_values],
        );
        let shape = AttentionShape {
            n_heads: p.n_heads,
            n_kv_heads: p.n_kv_heads,
            head_dim: p.head_dim,
        };
        cpu::causal_attention(
            pool,
            &q.as_slice()[q_values.clone()],
            kv.layer(p.layer, table),
            p.pos0,
            rows.len(),
            shape,
            p.scale,
            &mut out.as_mut_slice()[q_values],
            attention_scratch.as_mut_slice(),
        );
        Ok(())
    }

    fn silu_mul(&mut self, len: usize) -> Result<()> {
        let pool = &self.pool;
        let [gate, up] = self
            .ws
            .slots
            .get_disjoint_mut([Slot::Gate.index(), Slot::Up.index()])
            .expect("distinct slots");
        cpu::silu_mul(pool, &mut gate.as_mut_slice()[..len], &up.as_slice()[..len]);
        Ok(())
    }

    fn add(&mut self, dst: Slot, offset: usize, src: Slot, len: usize) -> Result<()> {
        let (_, s, d, _) = self.src_dst(src, dst);
        cpu::add_assign(&mut d[offset..offset + len], &s[..len]);
        Ok(())
    }

    fn all_reduce(&mut self, slot: Slot, offset: usize, len: usize) -> Result<()> {
        let (group, shard) = self.group()?;
        let data = &mut self.slot_mut(slot)[offset..offset + len];
        Ok(group.all_reduce(shard.rank, data)?)
    }

    fn embed_part(&mut self, table: &Matrix, n: usize, first: usize) -> Result<()> {
        let hidden = table.cols;
        let tokens = std::mem::take(&mut self.tokens);
        let x = self.slot_mut(Slot::Residual);
        for (i, &token) in tokens[..n].iter().enumerate() {
            let row = &mut x[i * hidden..(i + 1) * hidden];
            match (token as usize).checked_sub(first) {
                Some(r) if r < table.rows => table.row_to_f32(r, row),
                _ => row.fill(0.0),
            }
        }
        self.tokens = tokens;
        Ok(())
    }

    fn gather_logits(&mut self, rows: usize, vocab: usize) -> Result<()> {
        let (group, shard) = self.group()?;
        let logits = self.ws.logits.as_mut_slice::<f32>();
        let mine = logits[..rows * shard.part(vocab).len()].to_vec();
        group.all_gather_columns(shard, &mine, [rows, vocab], logits)?;
        Ok(())
    }

    /// Routes each token to its top-k experts and sums their outputs, weighted, in expert order
    /// (the order transformers uses, and the same whether a token runs alone or in a batch).
    fn prepare_experts(&self, _experts: &[Mlp<Self>]) -> Result<()> {
        Ok(())
    }

    fn norm_moe(
        &mut self,
        moe: &Moe<Self>,
        rows: Range<usize>,
        norm: &Vector,
        eps: f32,
    ) -> Result<()> {
        let hidden = moe.router.cols;
        self.rms_norm(Slot::Residual, rows.clone(), norm, eps, Slot::Normed)?;
        self.moe_into_block_out(moe, rows.len());
        if self.group.is_some() {
            // A rank's experts hold its share of their columns: its sum is a partial one.
            self.all_reduce(Slot::BlockOut, 0, rows.len() * hidden)?;
        }
        self.add(
            Slot::Residual,
            rows.start * hidden,
            Slot::BlockOut,
            rows.len() * hidden,
        )
    }

    fn gather_rows(&mut self, slot: Slot, width: usize, rows: &[usize]) -> Result<()> {
        let x = self.slot_mut(slot);
        for (j, &row) in rows.iter().enumerate() {
            // Ascending rows: row j is never one still to be read.
            debug_assert!(row >= j);
            x.copy_within(row * width..(row + 1) * width, j * width);
        }
        Ok(())
    }

    fn project_logits(&mut self, head: &Matrix, rows: usize) -> Result<()> {
        let pool = &self.pool;
        let Workspace {
            slots,
            logits,
            matmul_scratch,
            ..
        } = &mut self.ws;
        let h = &slots[Slot::Normed.index()].as_slice::<f32>()[..rows * head.cols];
        let out = &mut logits.as_mut_slice::<f32>()[..rows * head.rows];
        cpu::matmul(
            pool,
            h,
            rows,
            &head.as_mat(),
            out,
            matmul_scratch.as_mut_slice(),
        );
        Ok(())
    }

    fn logits(&mut self, len: usize) -> Result<&[f32]> {
        Ok(&self.ws.logits.as_slice::<f32>()[..len])
    }

    fn pick_ahead(&mut self, vocab: usize) -> Result<()> {
        if self.picks.len() >= PICKS_AHEAD {
            return Err(Error::Unsupported {
                what: format!("more than {PICKS_AHEAD} picks waiting unread"),
                backend: "cpu",
            });
        }
        let token = cpu::argmax(self.logits(vocab)?);
        self.picks.push_back(token);
        self.last_pick = Some(token);
        Ok(())
    }

    fn read_pick(&mut self) -> Result<u32> {
        self.picks.pop_front().ok_or(Error::NoTokens)
    }
}

impl CpuBackend {
    /// Keeps the pass's block tables (in buffers kept, not reallocated, from pass to pass).
    fn take_tables<'a>(&mut self, tables: impl IntoIterator<Item = &'a BlockTable>) {
        self.tables.clear();
        self.segment_tables.clear();
        for table in tables {
            let start = self.tables.len();
            self.tables.extend_from_slice(table.blocks());
            self.segment_tables.push(start..self.tables.len());
        }
    }

    fn loader<'a>(&'a self, source: &'a dyn TensorSource) -> WeightLoader<'a> {
        WeightLoader {
            set: source,
            owner: &self.owner,
            own: self.owns_weights,
        }
    }

    /// `BlockOut[..n]` = the weighted sum of the top-k experts of each of `n` tokens of
    /// `Normed`.
    fn moe_into_block_out(&mut self, moe: &Moe<Self>, n: usize) {
        let pool = &self.pool;
        // Routing is over every expert; this rank runs those it holds.
        let n_experts = moe.router.rows;
        let Workspace {
            slots,
            matmul_scratch,
            moe: moe_ws,
            ..
        } = &mut self.ws;
        let hidden = moe.router.cols;
        let MoeWorkspace { router, rows, out } = moe_ws
            .as_mut()
            .expect("a MoE model's workspace has MoE buffers");
        let [h, gate, up, proj] = slots
            .get_disjoint_mut([
                Slot::Normed.index(),
                Slot::Gate.index(),
                Slot::Up.index(),
                Slot::BlockOut.index(),
            ])
            .expect("distinct slots");
        let h = h.as_slice::<f32>();
        let router = &mut router.as_mut_slice::<f32>()[..n * n_experts];
        cpu::matmul(
            pool,
            &h[..n * hidden],
            n,
            &moe.router.as_mat(),
            router,
            matmul_scratch.as_mut_slice(),
        );

        let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n_experts];
        let mut order: Vec<usize> = (0..n_experts).collect();
        for (token, scores) in router.chunks_exact_mut(n_experts).enumerate() {
            cpu::softmax_in_place(scores);
            // Highest probability first; ties go to the lower expert index, as torch.topk does.
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            let chosen = &order[..moe.top_k];
            let total: f32 = chosen.iter().map(|&e| scores[e]).sum();
            for &e in chosen {
                let weight = if moe.norm_topk_prob {
                    scores[e] / total
                } else {
                    scores[e]
                };
                assigned[e].push((token, weight));
            }
        }

        let proj = &mut proj.as_mut_slice::<f32>()[..n * hidden];
        proj.fill(0.0);
        let mut scratch = MlpScratch {
            gate: gate.as_mut_slice(),
            up: up.as_mut_slice(),
            matmul: matmul_scratch.as_mut_slice(),
        };
        let (rows, out) = (rows.as_mut_slice::<f32>(), out.as_mut_slice::<f32>());
        for (expert, tokens) in moe.experts.iter().zip(&assigned[moe.first_expert..]) {
            if tokens.is_empty() {
                continue;
            }
            let m = tokens.len();
            for (r, &(token, _)) in tokens.iter().enumerate() {
                rows[r * hidden..(r + 1) * hidden]
                    .copy_from_slice(&h[token * hidden..(token + 1) * hidden]);
            }
            mlp(pool, expert, &rows[..m * hidden], m, out, &mut scratch);
            for (r, &(token, weight)) in tokens.iter().enumerate() {
                let dst = &mut proj[token * hidden..(token + 1) * hidden];
                for (d, &o) in dst.iter_mut().zip(&out[r * hidden..(r + 1) * hidden]) {
                    *d += o * weight;
                }
            }
        }
    }
}

/// `y[..m·out] = x · Wᵀ + b`.
fn linear(
    pool: &ThreadPool,
    weight: &Matrix,
    bias: Option<&Vector>,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    scratch: &mut [f32],
) {
    let out = &mut y[..m * weight.rows];
    cpu::matmul(pool, x, m, &weight.as_mat(), out, scratch);
    if let Some(bias) = bias {
        cpu::add_bias(out, bias.as_slice());
    }
}

/// The buffers an expert's MLP writes besides its output.
struct MlpScratch<'a> {
    gate: &'a mut [f32],
    up: &'a mut [f32],
    matmul: &'a mut [f32],
}

/// `out = down(silu(gate(x)) · up(x))` for `m` rows outside the slots (an expert's tokens).
fn mlp(
    pool: &ThreadPool,
    mlp: &Mlp<CpuBackend>,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    s: &mut MlpScratch<'_>,
) {
    let width = mlp.width();
    let (gate, up) = (&mut s.gate[..m * width], &mut s.up[..m * width]);
    linear(
        pool,
        &mlp.gate.weight,
        mlp.gate.bias.as_ref(),
        x,
        m,
        gate,
        s.matmul,
    );
    linear(
        pool,
        &mlp.up.weight,
        mlp.up.bias.as_ref(),
        x,
        m,
        up,
        s.matmul,
    );
    cpu::silu_mul(pool, gate, up);
    linear(
        pool,
        &mlp.down.weight,
        mlp.down.bias.as_ref(),
        gate,
        m,
        out,
        s.matmul,
    );
}
