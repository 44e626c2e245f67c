//! A [`Transformer`] built from a checkpoint's tensors in a backend's memory.

use ember_checkpoint::TensorSource;
use ember_tensor::BufferOwner;

use super::{Attention, FeedForward, Layer, Linear, Mlp, Moe, Transformer};
use crate::backend::{Backend, WeightMatrix};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::parallel::{Shard, ShardSource};

impl<B: Backend> Linear<B> {
    fn load(
        b: &B,
        source: &dyn TensorSource,
        prefix: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<Self> {
        Ok(Linear {
            weight: b.load_matrix(source, &format!("{prefix}.weight"), rows, cols)?,
            bias: if bias {
                Some(b.load_vector(source, &format!("{prefix}.bias"), rows)?)
            } else {
                None
            },
        })
    }

    /// A projection whose weight is loaded already (one of [`Backend::load_adjacent`]'s).
    fn with_weight(
        b: &B,
        source: &dyn TensorSource,
        prefix: &str,
        weight: B::Matrix,
        bias: bool,
    ) -> Result<Self> {
        let bias = if bias {
            Some(b.load_vector(source, &format!("{prefix}.bias"), weight.rows())?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}

impl<B: Backend> Transformer<B> {
    /// Builds the model's weights in `backend`'s memory; `context` sizes the rotary tables.
    pub fn load(
        backend: &B,
        config: ModelConfig,
        source: &dyn TensorSource,
        context: usize,
    ) -> Result<Self> {
        Self::load_part(backend, config, source, context, Shard::WHOLE)
    }

    /// Builds rank `shard.rank`'s share of the model of `config` (the whole model's) in
    /// `backend`'s memory ([`crate::parallel`]): its heads, MLP columns and part of the
    /// vocabulary, the columns it copies listed by `owner` (the backend's). The backend must be
    /// a rank of a group of `shard.ranks` and sized for [`ModelConfig::for_shard`]'s shapes.
    pub fn load_shard(
        backend: &B,
        config: &ModelConfig,
        source: &dyn TensorSource,
        context: usize,
        shard: Shard,
        owner: &BufferOwner,
    ) -> Result<Self> {
        let part = ShardSource::new(source, config, shard, owner)?;
        Self::load_part(backend, config.for_shard(shard)?, &part, context, shard)
    }

    /// [`Self::load`] of `shard`'s share from a source that gives it, `config` its shapes.
    fn load_part(
        backend: &B,
        config: ModelConfig,
        source: &dyn TensorSource,
        context: usize,
        shard: Shard,
    ) -> Result<Self> {
        let b = backend;
        let c = &config;
        let (h, q_dim, kv_dim) = (c.hidden_size, c.q_dim(), c.kv_dim());
        // Outputs the ranks add up take their bias once, from rank 0.
        let summed_bias = shard.rank == 0;
        let vocab = shard.part(c.vocab_size).len();
        let embed_tokens = b.load_matrix(source, "model.embed_tokens.weight", vocab, h)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let linear = |name: &str, rows: usize, cols: usize, bias: bool| {
                Linear::load(
                    b,
                    source,
                    &format!("{p}.self_attn.{name}"),
                    rows,
                    cols,
                    bias,
                )
            };
            let head_norm = |name: &str| -> Result<Option<B::Vector>> {
                if c.qk_norm {
                    let name = format!("{p}.self_attn.{name}.weight");
                    Ok(Some(b.load_vector(source, &name, c.head_dim)?))
                } else {
                    Ok(None)
                }
            };
            // q, k and v share their input: adjacent, so that a backend may run them as one
            // product.
            let attn = |name: &str| format!("{p}.self_attn.{name}");
            let names = [attn("q_proj"), attn("k_proj"), attn("v_proj")];
            let weights = b.load_adjacent(
                source,
                &[
                    (&format!("{}.weight", names[0]), q_dim),
                    (&format!("{}.weight", names[1]), kv_dim),
                    (&format!("{}.weight", names[2]), kv_dim),
                ],
                h,
            )?;
            let [q, k, v] = <[B::Matrix; 3]>::try_from(weights)
                .unwrap_or_else(|w| panic!("load_adjacent gave {} matrices for 3", w.len()));
            let qkv = |name: &str, weight| Linear::with_weight(b, source, name, weight, c.qkv_bias);
            let attention = Attention {
                q: qkv(&names[0], q)?,
                k: qkv(&names[1], k)?,
                v: qkv(&names[2], v)?,
                o: linear("o_proj", h, q_dim, c.o_bias && summed_bias)?,
                q_norm: head_norm("q_norm")?,
                k_norm: head_norm("k_norm")?,
            };
            let feed_forward = if c.is_sparse_layer(i) {
                FeedForward::Sparse(load_moe(b, source, c, &p, shard)?)
            } else {
                FeedForward::Dense(load_mlp(
                    b,
                    source,
                    &format!("{p}.mlp"),
                    c.intermediate_size,
                    h,
                    c.mlp_bias,
                    c.mlp_bias && summed_bias,
                )?)
            };
            layers.push(Layer {
                input_norm: b.load_vector(source, &format!("{p}.input_layernorm.weight"), h)?,
                attention,
                post_attention_norm: b.load_vector(
                    source,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                )?,
                feed_forward,
            });
        }
        let norm = b.load_vector(source, "model.norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(b.load_matrix(source, "lm_head.weight", vocab, h)?)
        };
        let rope = b.rope_tables(c, context)?;
        Ok(Transformer {
            config,
            shard,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            positions: context,
        })
    }
}

fn load_mlp<B: Backend>(
    b: &B,
    source: &dyn TensorSource,
    prefix: &str,
    width: usize,
    hidden: usize,
    bias: bool,
    down_bias: bool,
) -> Result<Mlp<B>> {
    let name = |name: &str| format!("{prefix}.{name}");
    // Gate and up share their input: adjacent, so that a backend may run them as one product.
    let (gate, up) = (name("gate_proj"), name("up_proj"));
    let weights = b.load_adjacent(
        source,
        &[
            (&format!("{gate}.weight"), width),
            (&format!("{up}.weight"), width),
        ],
        hidden,
    )?;
    let [gate_weight, up_weight] = <[B::Matrix; 2]>::try_from(weights)
        .unwrap_or_else(|w| panic!("load_adjacent gave {} matrices for 2", w.len()));
    Ok(Mlp {
        gate: Linear::with_weight(b, source, &gate, gate_weight, bias)?,
        up: Linear::with_weight(b, source, &up, up_weight, bias)?,
        down: Linear::load(b, source, &name("down_proj"), hidden, width, down_bias)?,
    })
}

/// Experts are stored one tensor per expert (`experts.{e}.gate_proj.weight`, the layout on the
/// Hub), stacked with gate and up fused (`experts.gate_up_proj` `[E, 2·I, H]` and
/// `experts.down_proj` `[E, H, I]`, as transformers 5 keeps them in memory), or stacked apart
/// (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` in GGUF). All become per-expert views
/// without copying. A rank of expert parallelism loads the experts it holds (a stack then
/// comes as theirs only); the router stays whole.
fn load_moe<B: Backend>(
    b: &B,
    source: &dyn TensorSource,
    c: &ModelConfig,
    layer_prefix: &str,
    shard: Shard,
) -> Result<Moe<B>> {
    let moe = c
        .moe
        .as_ref()
        .expect("sparse layers exist only with a MoE config");
    let (width, hidden) = (moe.moe_intermediate_size, c.hidden_size);
    let held = shard.held_experts(moe.num_experts);
    let e_count = held.len();
    let prefix = format!("{layer_prefix}.mlp");
    let router = b.load_matrix(
        source,
        &format!("{prefix}.gate.weight"),
        moe.num_experts,
        hidden,
    )?;
    let stacked = format!("{prefix}.experts.gate_up_proj");
    let experts = if source.contains(&stacked) {
        let gate_up = b.load_stacked(source, &stacked, e_count, 2 * width, hidden)?;
        let down = b.load_stacked(
            source,
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
                        weight: gate_up.slice_rows(base, base + width),
                        bias: None,
                    },
                    up: Linear {
                        weight: gate_up.slice_rows(base + width, base + 2 * width),
                        bias: None,
                    },
                    down: Linear {
                        weight: down.slice_rows(e * hidden, (e + 1) * hidden),
                        bias: None,
                    },
                }
            })
            .collect()
    } else if source.contains(&format!("{prefix}.experts.gate_proj.weight")) {
        let stack = |name: &str, rows: usize, cols: usize| {
            b.load_stacked(
                source,
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
        let view = |m: &B::Matrix, e: usize, rows: usize| Linear {
            weight: m.slice_rows(e * rows, (e + 1) * rows),
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
        held.clone()
            .map(|e| {
                let prefix = format!("{prefix}.experts.{e}");
                load_mlp(b, source, &prefix, width, hidden, false, false)
            })
            .collect::<Result<Vec<_>>>()?
    };
    let prepared = b.prepare_experts(&experts)?;
    Ok(Moe {
        router,
        experts,
        first_expert: held.start,
        prepared,
        top_k: moe.num_experts_per_tok,
        norm_topk_prob: moe.norm_topk_prob,
    })
}
