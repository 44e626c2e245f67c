//! The decoder-only transformer shared by Llama, Qwen2, Qwen3 and Qwen3-MoE.
//!
//! The architectures differ only in options read from the config: q/k/v biases (Qwen2),
//! per-head q/k norms (Qwen3), Llama 3 rope scaling, and mixture-of-experts MLPs on some
//! layers (Qwen3-MoE). There is one forward pass, written once against the CPU kernels.

use ember_checkpoint::TensorSource;
use ember_tensor::cpu::{self, AttentionShape, RopeLayout, RopeTables};
use ember_tensor::{BufferOwner, ThreadPool};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::rope::RopeTable;
use crate::weights::{Matrix, Vector, WeightLoader};
use crate::workspace::{MoeWorkspace, Workspace};

/// A projection with an optional bias.
pub struct Linear {
    pub weight: Matrix,
    pub bias: Option<Vector>,
}

impl Linear {
    fn load(
        w: &WeightLoader<'_>,
        prefix: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<Self> {
        Ok(Linear {
            weight: w.matrix(&format!("{prefix}.weight"), rows, cols)?,
            bias: if bias {
                Some(w.vector(&format!("{prefix}.bias"), rows)?)
            } else {
                None
            },
        })
    }

    /// `y[..m·out] = x[..m·in] · Wᵀ + b`.
    fn apply(&self, pool: &ThreadPool, x: &[f32], m: usize, y: &mut [f32], scratch: &mut [f32]) {
        let out = &mut y[..m * self.weight.rows];
        cpu::matmul(pool, x, m, &self.weight.as_mat(), out, scratch);
        if let Some(bias) = &self.bias {
            cpu::add_bias(out, bias.as_slice());
        }
    }
}

/// Gate, up and down projections with SwiGLU between.
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    fn weight_bytes(&self) -> usize {
        self.gate.weight.size_in_bytes()
            + self.up.weight.size_in_bytes()
            + self.down.weight.size_in_bytes()
    }

    /// `out = down(silu(gate(x)) · up(x))` for `m` rows.
    fn apply(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        s: &mut MlpScratch<'_>,
    ) {
        let width = self.gate.weight.rows;
        self.gate.apply(pool, x, m, s.gate, s.matmul);
        self.up.apply(pool, x, m, s.up, s.matmul);
        cpu::silu_mul(pool, &mut s.gate[..m * width], &s.up[..m * width]);
        self.down
            .apply(pool, &s.gate[..m * width], m, out, s.matmul);
    }
}

/// The workspace buffers an MLP writes besides its output.
struct MlpScratch<'a> {
    gate: &'a mut [f32],
    up: &'a mut [f32],
    matmul: &'a mut [f32],
}

pub struct Moe {
    pub router: Matrix,
    pub experts: Vec<Mlp>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

pub enum FeedForward {
    Dense(Mlp),
    Sparse(Moe),
}

pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<Vector>,
    pub k_norm: Option<Vector>,
}

pub struct Layer {
    pub input_norm: Vector,
    pub attention: Attention,
    pub post_attention_norm: Vector,
    pub feed_forward: FeedForward,
}

/// Which rows of logits a forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// The last token's only: what generation needs.
    Last,
    /// Every token's (prompt log-probabilities); the workspace must have the rows.
    All,
}

pub struct Transformer {
    pub config: ModelConfig,
    pub embed_tokens: Matrix,
    pub layers: Vec<Layer>,
    pub norm: Vector,
    /// The output projection; the embedding matrix itself when the embeddings are tied.
    lm_head: Option<Matrix>,
    rope: RopeTable,
}

impl Transformer {
    /// Builds the model over the mapped checkpoint; `context` sizes the rotary tables.
    pub fn load(
        config: ModelConfig,
        set: &dyn TensorSource,
        owner: &BufferOwner,
        context: usize,
    ) -> Result<Self> {
        let w = WeightLoader { set, owner };
        let c = &config;
        let (h, q_dim, kv_dim) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let embed_tokens = w.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attention = Attention {
                q: Linear::load(&w, &format!("{p}.self_attn.q_proj"), q_dim, h, c.qkv_bias)?,
                k: Linear::load(&w, &format!("{p}.self_attn.k_proj"), kv_dim, h, c.qkv_bias)?,
                v: Linear::load(&w, &format!("{p}.self_attn.v_proj"), kv_dim, h, c.qkv_bias)?,
                o: Linear::load(&w, &format!("{p}.self_attn.o_proj"), h, q_dim, c.o_bias)?,
                q_norm: if c.qk_norm {
                    Some(w.vector(&format!("{p}.self_attn.q_norm.weight"), c.head_dim)?)
                } else {
                    None
                },
                k_norm: if c.qk_norm {
                    Some(w.vector(&format!("{p}.self_attn.k_norm.weight"), c.head_dim)?)
                } else {
                    None
                },
            };
            let feed_forward = if c.is_sparse_layer(i) {
                FeedForward::Sparse(load_moe(&w, c, &p)?)
            } else {
                FeedForward::Dense(load_mlp(
                    &w,
                    &format!("{p}.mlp"),
                    c.intermediate_size,
                    h,
                    c.mlp_bias,
                )?)
            };
            layers.push(Layer {
                input_norm: w.vector(&format!("{p}.input_layernorm.weight"), h)?,
                attention,
                post_attention_norm: w
                    .vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                feed_forward,
            });
        }
        let norm = w.vector("model.norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(w.matrix("lm_head.weight", c.vocab_size, h)?)
        };
        let rope = RopeTable::new(c, context, owner)?;
        Ok(Transformer {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
        })
    }

    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Weight bytes one decoded token reads: every layer's matrices (only the routed experts of
    /// sparse layers, `top_k` of them), the output projection, and one embedding row.
    pub fn weight_bytes_per_token(&self) -> usize {
        let mut bytes = self.lm_head().size_in_bytes()
            + self.embed_tokens.size_in_bytes() / self.embed_tokens.rows;
        for layer in &self.layers {
            let a = &layer.attention;
            bytes += [&a.q, &a.k, &a.v, &a.o]
                .iter()
                .map(|l| l.weight.size_in_bytes())
                .sum::<usize>();
            bytes += match &layer.feed_forward {
                FeedForward::Dense(mlp) => mlp.weight_bytes(),
                FeedForward::Sparse(moe) => {
                    moe.router.size_in_bytes() + moe.top_k * moe.experts[0].weight_bytes()
                }
            };
        }
        bytes
    }

    /// Runs `tokens` (at most the workspace's batch) at the positions after what `kv` holds,
    /// appends their keys and values, and returns the requested logits, `vocab_size` per row.
    pub fn forward<'w>(
        &self,
        pool: &ThreadPool,
        ws: &'w mut Workspace,
        kv: &mut KvCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<&'w [f32]> {
        let c = &self.config;
        let n = tokens.len();
        if n > ws.max_batch {
            return Err(Error::BatchTooLarge {
                requested: n,
                capacity: ws.max_batch,
            });
        }
        if logits == Logits::All && n > ws.logit_rows {
            return Err(Error::BatchTooLarge {
                requested: n,
                capacity: ws.logit_rows,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::TokenOutOfRange {
                id,
                vocab_size: c.vocab_size,
            });
        }
        kv.reserve(n)?;
        if n == 0 {
            return Ok(&ws.logits.as_slice()[..0]);
        }
        let pos0 = kv.len();
        if pos0 + n > self.rope.positions {
            return Err(Error::ContextFull {
                used: pos0,
                requested: n,
                capacity: self.rope.positions,
            });
        }
        let hidden = c.hidden_size;
        {
            let x = ws.x.as_mut_slice::<f32>();
            for (i, &token) in tokens.iter().enumerate() {
                self.embed_tokens
                    .row_to_f32(token as usize, &mut x[i * hidden..(i + 1) * hidden]);
            }
        }
        for (index, layer) in self.layers.iter().enumerate() {
            let eps = c.rms_norm_eps;
            cpu::rms_norm(
                pool,
                &ws.x.as_slice()[..n * hidden],
                layer.input_norm.as_slice(),
                eps,
                ws.h.as_mut_slice(),
            );
            self.attention(pool, ws, kv, index, &layer.attention, n, pos0);
            cpu::add_assign(
                &mut ws.x.as_mut_slice()[..n * hidden],
                &ws.proj.as_slice()[..n * hidden],
            );

            cpu::rms_norm(
                pool,
                &ws.x.as_slice()[..n * hidden],
                layer.post_attention_norm.as_slice(),
                eps,
                ws.h.as_mut_slice(),
            );
            match &layer.feed_forward {
                FeedForward::Dense(mlp) => {
                    let Workspace {
                        h,
                        gate,
                        up,
                        proj,
                        matmul_scratch,
                        ..
                    } = ws;
                    let mut scratch = MlpScratch {
                        gate: gate.as_mut_slice(),
                        up: up.as_mut_slice(),
                        matmul: matmul_scratch.as_mut_slice(),
                    };
                    mlp.apply(pool, h.as_slice(), n, proj.as_mut_slice(), &mut scratch);
                }
                FeedForward::Sparse(moe) => self.moe(pool, ws, moe, n),
            }
            cpu::add_assign(
                &mut ws.x.as_mut_slice()[..n * hidden],
                &ws.proj.as_slice()[..n * hidden],
            );
        }
        kv.advance(n);

        let rows = match logits {
            Logits::Last => n - 1..n,
            Logits::All => 0..n,
        };
        let m = rows.len();
        let Workspace {
            x,
            h,
            logits: out,
            matmul_scratch,
            ..
        } = ws;
        cpu::rms_norm(
            pool,
            &x.as_slice()[rows.start * hidden..rows.end * hidden],
            self.norm.as_slice(),
            c.rms_norm_eps,
            h.as_mut_slice(),
        );
        let out = &mut out.as_mut_slice::<f32>()[..m * c.vocab_size];
        cpu::matmul(
            pool,
            h.as_slice(),
            m,
            &self.lm_head().as_mat(),
            out,
            matmul_scratch.as_mut_slice(),
        );
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &ThreadPool,
        ws: &mut Workspace,
        kv: &mut KvCache,
        index: usize,
        a: &Attention,
        n: usize,
        pos0: usize,
    ) {
        let c = &self.config;
        let Workspace {
            h,
            q,
            k,
            v,
            attn,
            proj,
            matmul_scratch,
            attention_scratch,
            ..
        } = ws;
        let (h, scratch) = (h.as_slice::<f32>(), matmul_scratch.as_mut_slice::<f32>());
        let q = &mut q.as_mut_slice::<f32>()[..n * c.q_dim()];
        let keys = &mut k.as_mut_slice::<f32>()[..n * c.kv_dim()];
        let values = &mut v.as_mut_slice::<f32>()[..n * c.kv_dim()];
        a.q.apply(pool, h, n, q, scratch);
        a.k.apply(pool, h, n, keys, scratch);
        a.v.apply(pool, h, n, values, scratch);
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            cpu::rms_norm_in_place(pool, q, qn.as_slice(), c.rms_norm_eps);
            cpu::rms_norm_in_place(pool, keys, kn.as_slice(), c.rms_norm_eps);
        }
        let layout = if c.rope_interleaved {
            RopeLayout::Pairs
        } else {
            RopeLayout::Halves
        };
        let tables = RopeTables {
            cos: self.rope.cos(),
            sin: self.rope.sin(),
            layout,
        };
        cpu::rope_in_place(pool, q, c.num_attention_heads, c.head_dim, pos0, tables);
        cpu::rope_in_place(pool, keys, c.num_key_value_heads, c.head_dim, pos0, tables);
        kv.write(index, pos0, keys, values);
        let (keys, values) = kv.layer(index);
        let shape = AttentionShape {
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        };
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let attn = &mut attn.as_mut_slice::<f32>()[..n * c.q_dim()];
        cpu::causal_attention(
            pool,
            q,
            keys,
            values,
            pos0,
            n,
            shape,
            scale,
            attn,
            attention_scratch.as_mut_slice(),
        );
        a.o.apply(pool, attn, n, proj.as_mut_slice(), scratch);
    }

    /// Routes each token to its top-k experts and sums their outputs, weighted, in expert order
    /// (the order transformers uses, and the same whether a token runs alone or in a batch).
    fn moe(&self, pool: &ThreadPool, ws: &mut Workspace, moe: &Moe, n: usize) {
        let hidden = self.config.hidden_size;
        let n_experts = moe.experts.len();
        let Workspace {
            h,
            gate,
            up,
            proj,
            matmul_scratch,
            moe: moe_ws,
            ..
        } = ws;
        let MoeWorkspace { router, rows, out } = moe_ws
            .as_mut()
            .expect("a MoE model's workspace has MoE buffers");
        let h = h.as_slice::<f32>();
        let router = &mut router.as_mut_slice::<f32>()[..n * n_experts];
        cpu::matmul(
            pool,
            h,
            n,
            &moe.router.as_mat(),
            router,
            matmul_scratch.as_mut_slice(),
        );
        let mut scratch = MlpScratch {
            gate: gate.as_mut_slice(),
            up: up.as_mut_slice(),
            matmul: matmul_scratch.as_mut_slice(),
        };

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
        let (rows, out) = (rows.as_mut_slice::<f32>(), out.as_mut_slice::<f32>());
        for (expert, tokens) in moe.experts.iter().zip(&assigned) {
            if tokens.is_empty() {
                continue;
            }
            let m = tokens.len();
            for (r, &(token, _)) in tokens.iter().enumerate() {
                rows[r * hidden..(r + 1) * hidden]
                    .copy_from_slice(&h[token * hidden..(token + 1) * hidden]);
            }
            expert.apply(pool, rows, m, out, &mut scratch);
            for (r, &(token, weight)) in tokens.iter().enumerate() {
                let dst = &mut proj[token * hidden..(token + 1) * hidden];
                for (d, &o) in dst.iter_mut().zip(&out[r * hidden..(r + 1) * hidden]) {
                    *d += o * weight;
                }
            }
        }
    }
}

fn load_mlp(
    w: &WeightLoader<'_>,
    prefix: &str,
    width: usize,
    hidden: usize,
    bias: bool,
) -> Result<Mlp> {
    Ok(Mlp {
        gate: Linear::load(w, &format!("{prefix}.gate_proj"), width, hidden, bias)?,
        up: Linear::load(w, &format!("{prefix}.up_proj"), width, hidden, bias)?,
        down: Linear::load(w, &format!("{prefix}.down_proj"), hidden, width, bias)?,
    })
}

/// Experts are stored one tensor per expert (`experts.{e}.gate_proj.weight`, the layout on the
/// Hub), stacked with gate and up fused (`experts.gate_up_proj` `[E, 2·I, H]` and
/// `experts.down_proj` `[E, H, I]`, as transformers 5 keeps them in memory), or stacked apart
/// (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` in GGUF). All become per-expert views
/// without copying.
fn load_moe(w: &WeightLoader<'_>, c: &ModelConfig, layer_prefix: &str) -> Result<Moe> {
    let moe = c
        .moe
        .as_ref()
        .expect("sparse layers exist only with a MoE config");
    let (e_count, width, hidden) = (moe.num_experts, moe.moe_intermediate_size, c.hidden_size);
    let prefix = format!("{layer_prefix}.mlp");
    let router = w.matrix(&format!("{prefix}.gate.weight"), e_count, hidden)?;
    let stacked = format!("{prefix}.experts.gate_up_proj");
    let experts = if w.set.contains(&stacked) {
        let gate_up = w.stacked(&stacked, e_count, 2 * width, hidden)?;
        let down = w.stacked(
            &format!("{prefix}.experts.down_proj"),
            e_count,
            hidden,
            width,
        )?;
        (0..e_count)
            .map(|e| {
                let base = e * 2 * width;
                Mlp {
                    gate: Linear {
                        weight: gate_up.rows(base, base + width),
                        bias: None,
                    },
                    up: Linear {
                        weight: gate_up.rows(base + width, base + 2 * width),
                        bias: None,
                    },
                    down: Linear {
                        weight: down.rows(e * hidden, (e + 1) * hidden),
                        bias: None,
                    },
                }
            })
            .collect()
    } else if w
        .set
        .contains(&format!("{prefix}.experts.gate_proj.weight"))
    {
        let stack = |name: &str, rows: usize, cols: usize| {
            w.stacked(
                &format!("{prefix}.experts.{name}.weight"),
                e_count,
                rows,
                cols,
            )
        };
        let (gate, up, down) = (
            stack("gate_proj", width, hidden)?,
            stack("up_proj", width, hidden)?,
            stack("down_proj", hidden, width)?,
        );
        let view = |m: &Matrix, e: usize, rows: usize| Linear {
            weight: m.rows(e * rows, (e + 1) * rows),
            bias: None,
        };
        (0..e_count)
            .map(|e| Mlp {
                gate: view(&gate, e, width),
                up: view(&up, e, width),
                down: view(&down, e, hidden),
            })
            .collect()
    } else {
        (0..e_count)
            .map(|e| load_mlp(w, &format!("{prefix}.experts.{e}"), width, hidden, false))
            .collect::<Result<Vec<_>>>()?
    };
    Ok(Moe {
        router,
        experts,
        top_k: moe.num_experts_per_tok,
        norm_topk_prob: moe.norm_topk_prob,
    })
}
