//! Tensor parallelism on the CPU (`ember_models::parallel`): a model split across ranks run as
//! threads, each a backend holding its share of the weights and KV cache, meeting in a host
//! group's all-reduces, against the same model whole. On every golden fixture (a mixture of
//! experts with every expert cut like a dense MLP):
//! - split 2 ways, greedy decoding gives transformers' recorded ids (the fixtures' margins
//!   leave room for f32 sums in another order), and every row of logits stays within
//!   `LOGIT_TOLERANCE` of the whole model's;
//! - at a fixed split, a sequence's logits are the same bits run to run and whether it runs
//!   alone or beside another sequence in one pass (sums in rank order, kernels that never mix
//!   rows).
//!
//! Split four ways over two key-value heads, each head is held by the ranks that read it (and
//! decoding still gives the reference's ids). Splits the shapes do not allow (heads that do
//! not divide, ranks not a multiple of the key-value heads) are refused at load with an error
//! naming why.

mod common;

use std::sync::Arc;

use common::{bits, fresh_table, golden, tokens};
use ember_checkpoint::SafetensorsSet;
use ember_models::parallel::{ExpertSplit, HostGroup, Shard};
use ember_models::{
    Arithmetic, BlockTable, CpuBackend, FeedForward, KV_BLOCK_SIZE, KvDtype, KvLayout, KvPool,
    Logits, ModelConfig, SequencePass, Transformer,
};
use ember_tensor::{BufferOwner, ThreadPool};
use serde_json::Value;

const CONTEXT: usize = 256;
const MAX_BATCH: usize = 128;
/// Largest difference from the whole model's logits, relative to the row's largest logit:
/// the o and down products' sums are cut in two and added (f32 sums in another order; up to
/// 1.5e-6 measured on these fixtures).
const LOGIT_TOLERANCE: f32 = 1e-5;

const FIXTURES: [&str; 9] = [
    "llama-bf16",
    "llama-f32",
    "qwen2-bf16",
    "qwen2-f32",
    "qwen3-bf16",
    "qwen3-f32",
    "qwen3-hd128-bf16",
    "qwen3moe-bf16",
    "qwen3moe-f32",
];

/// One rank's (or the whole model's) backend, model and cache.
struct Rank {
    backend: CpuBackend,
    model: Transformer<CpuBackend>,
    kv: KvPool,
    next_block: u32,
}

impl Rank {
    fn load(
        config: &ModelConfig,
        source: &SafetensorsSet,
        shard: Shard,
        group: Option<Arc<HostGroup>>,
    ) -> Rank {
        let owner = BufferOwner::new();
        let shapes = config.for_shard(shard).unwrap();
        let backend = CpuBackend::new(
            &shapes,
            ThreadPool::new(1),
            &owner,
            MAX_BATCH,
            CONTEXT,
            MAX_BATCH,
            Arithmetic::Transformers,
        )
        .unwrap();
        let backend = match group {
            Some(group) => backend.join_group(group, shard),
            None => backend,
        };
        let model =
            Transformer::load_shard(&backend, config, source, CONTEXT, shard, &owner).unwrap();
        let layout = KvLayout::new(&model.config, KvDtype::F32);
        let kv = KvPool::new(layout, 4 * CONTEXT / KV_BLOCK_SIZE, 0, &owner).unwrap();
        Rank {
            backend,
            model,
            kv,
            next_block: 0,
        }
    }

    /// Experts the first sparse layer holds.
    fn held_experts(&self) -> usize {
        self.model
            .layers
            .iter()
            .find_map(|l| match &l.feed_forward {
                FeedForward::Sparse(moe) => Some(moe.experts.len()),
                FeedForward::Dense(_) => None,
            })
            .expect("a sparse layer")
    }

    fn sequence(&mut self) -> BlockTable {
        fresh_table(&mut self.next_block, CONTEXT)
    }

    /// Every row's logits of `prompt`, then `steps` greedy tokens one pass each (their
    /// logits after the prompt's).
    fn greedy(&mut self, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<f32>) {
        // Each case from an empty cache: the earlier cases' blocks are taken again.
        self.next_block = 0;
        let mut seq = self.sequence();
        let vocab = self.model.config.vocab_size;
        let mut logits = self
            .model
            .forward(
                &mut self.backend,
                &mut self.kv,
                &mut seq,
                prompt,
                Logits::All,
            )
            .unwrap()
            .to_vec();
        let mut ids = Vec::new();
        for _ in 0..steps {
            let last = &logits[logits.len() - vocab..];
            let id = ember_tensor::cpu::argmax(last);
            ids.push(id);
            let row = self
                .model
                .forward(
                    &mut self.backend,
                    &mut self.kv,
                    &mut seq,
                    &[id],
                    Logits::Last,
                )
                .unwrap()
                .to_vec();
            logits.extend(row);
        }
        (ids, logits)
    }

    /// The last rows' logits of two sequences in one pass.
    fn pair(&mut self, a: &[u32], b: &[u32]) -> Vec<f32> {
        let (mut sa, mut sb) = (self.sequence(), self.sequence());
        let passes = &mut [
            SequencePass {
                seq: &mut sa,
                tokens: a,
                logits: Logits::Last,
            },
            SequencePass {
                seq: &mut sb,
                tokens: b,
                logits: Logits::Last,
            },
        ];
        self.model
            .forward_batch(&mut self.backend, &mut self.kv, passes)
            .unwrap()
            .to_vec()
    }

    /// The last row's logits of `tokens` alone.
    fn alone(&mut self, tokens: &[u32]) -> Vec<f32> {
        let mut seq = self.sequence();
        self.model
            .forward(
                &mut self.backend,
                &mut self.kv,
                &mut seq,
                tokens,
                Logits::Last,
            )
            .unwrap()
            .to_vec()
    }
}

/// `f` on every rank of a model split `ranks` ways, each on a thread of its own; rank 0's
/// result (every rank ends a pass with the same whole rows of logits).
fn on_ranks<T: Send>(
    config: &ModelConfig,
    source: &SafetensorsSet,
    ranks: usize,
    f: impl Fn(&mut Rank) -> T + Sync,
) -> T {
    on_ranks_split(config, source, ranks, ExpertSplit::Columns, f)
}

/// [`on_ranks`] with the experts shared out as `experts` says.
fn on_ranks_split<T: Send>(
    config: &ModelConfig,
    source: &SafetensorsSet,
    ranks: usize,
    experts: ExpertSplit,
    f: impl Fn(&mut Rank) -> T + Sync,
) -> T {
    let group = Arc::new(HostGroup::new(ranks));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let (group, f) = (Arc::clone(&group), &f);
                s.spawn(move || {
                    let shard = Shard::new(rank, ranks).unwrap().with_experts(experts);
                    f(&mut Rank::load(config, source, shard, Some(group)))
                })
            })
            .collect();
        let mut results: Vec<T> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        results.swap_remove(0)
    })
}

fn completions(name: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let path = golden(name).join("expected.json");
    let expected: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    expected["completions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (ids(&c["input_ids"]), ids(&c["generated_ids"])))
        .collect()
}

fn max_relative_difference(got: &[f32], want: &[f32], vocab: usize) -> f32 {
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| {
            let scale = w.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            g.iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs() / scale)
                .fold(0.0, f32::max)
        })
        .fold(0.0, f32::max)
}

/// Greedy decoding of `name`'s golden cases whole and split `ranks` ways (the experts shared
/// as `experts` says): the reference's ids both ways, the split's logits within
/// `LOGIT_TOLERANCE` of the whole model's.
fn check_split_decoding(name: &str, ranks: usize, experts: ExpertSplit) {
    let path = golden(name);
    let owner = BufferOwner::new();
    let config = ModelConfig::from_dir(&path).unwrap();
    let source = SafetensorsSet::open(&path, &owner).unwrap();
    let vocab = config.vocab_size;
    let mut whole = Rank::load(&config, &source, Shard::WHOLE, None);
    let how = format!("split {ranks} ways ({experts:?})");
    for (case, (prompt, want)) in completions(name).into_iter().enumerate() {
        let (whole_ids, whole_logits) = whole.greedy(&prompt, want.len());
        let (ids, logits) = on_ranks_split(&config, &source, ranks, experts, |r| {
            r.greedy(&prompt, want.len())
        });
        assert_eq!(ids, want, "{name} case {case}: tokens {how}");
        assert_eq!(whole_ids, want, "{name} case {case}: tokens whole");
        let diff = max_relative_difference(&logits, &whole_logits, vocab);
        assert!(
            diff <= LOGIT_TOLERANCE,
            "{name} case {case}: logits {how} {diff:e} from the whole model's"
        );
    }
}

#[test]
fn split_two_ways_greedy_decoding_gives_the_references_tokens() {
    for name in FIXTURES {
        check_split_decoding(name, 2, ExpertSplit::Columns);
    }
}

#[test]
fn at_a_fixed_split_a_row_is_the_same_bits_run_to_run_and_in_any_batch() {
    for name in ["qwen3-bf16", "qwen2-f32", "qwen3moe-f32"] {
        let path = golden(name);
        let owner = BufferOwner::new();
        let config = ModelConfig::from_dir(&path).unwrap();
        let source = SafetensorsSet::open(&path, &owner).unwrap();
        let vocab = config.vocab_size;
        let (a, b) = (tokens(11, 1, vocab), tokens(5, 2, vocab));
        let run = || {
            on_ranks(&config, &source, 2, |r| {
                let pair = r.pair(&a, &b);
                let (alone_a, alone_b) = (r.alone(&a), r.alone(&b));
                (pair, [alone_a, alone_b].concat())
            })
        };
        let (pair, alone) = run();
        assert_eq!(
            bits(&pair),
            bits(&alone),
            "{name}: two sequences in one pass ≠ alone"
        );
        let (again, _) = run();
        assert_eq!(
            bits(&again),
            bits(&pair),
            "{name}: a second run ≠ the first"
        );
    }
}

/// The mixture-of-experts fixtures split by experts (each rank holds four of the eight whole,
/// attention still split by heads): the reference's tokens, logits within the tolerance of the
/// whole model's, and a row the same bits alone or beside another.
#[test]
fn split_by_experts_gives_the_references_tokens_and_batch_invariant_rows() {
    for name in ["qwen3moe-bf16", "qwen3moe-f32"] {
        let path = golden(name);
        let owner = BufferOwner::new();
        let config = ModelConfig::from_dir(&path).unwrap();
        let source = SafetensorsSet::open(&path, &owner).unwrap();
        let vocab = config.vocab_size;
        let held = on_ranks_split(&config, &source, 2, ExpertSplit::Experts, |r| {
            r.held_experts()
        });
        assert_eq!(held, 4, "{name}: experts a rank holds");
        check_split_decoding(name, 2, ExpertSplit::Experts);
        // The bytes a token reads, every rank's added: the same however the experts are
        // shared (a token's experts are on one rank or cut across both).
        let total = |experts| -> usize {
            (0..2)
                .map(|rank| {
                    let shard = Shard::new(rank, 2).unwrap().with_experts(experts);
                    let rank = Rank::load(&config, &source, shard, None);
                    rank.model.weight_bytes_per_token()
                })
                .sum()
        };
        assert_eq!(
            total(ExpertSplit::Experts),
            total(ExpertSplit::Columns),
            "{name}"
        );
        let (a, b) = (tokens(11, 1, vocab), tokens(5, 2, vocab));
        let (pair, alone) = on_ranks_split(&config, &source, 2, ExpertSplit::Experts, |r| {
            let pair = r.pair(&a, &b);
            (pair, [r.alone(&a), r.alone(&b)].concat())
        });
        assert_eq!(bits(&pair), bits(&alone), "{name}: a pair ≠ alone");
    }
}

/// Four ranks over two key-value heads: each head's cache held by the two ranks whose query
/// heads read it.
#[test]
fn split_four_ways_over_two_key_value_heads_replicates_them() {
    for name in ["qwen3-f32", "llama-bf16", "qwen3-hd128-bf16"] {
        let config = ModelConfig::from_dir(&golden(name)).unwrap();
        assert_eq!(config.num_key_value_heads, 2, "{name}");
        let shapes = config.for_shard(Shard::new(3, 4).unwrap()).unwrap();
        assert_eq!(
            (shapes.num_attention_heads, shapes.num_key_value_heads),
            (1, 1)
        );
        check_split_decoding(name, 4, ExpertSplit::Columns);
    }
}

#[test]
fn splits_the_shapes_do_not_allow_are_refused_at_load() {
    let owner = BufferOwner::new();
    // Two key-value heads go neither three ways (the ranks are not a multiple of them) nor
    // do six query heads go four.
    let path = golden("qwen2-f32");
    let config = ModelConfig::from_dir(&path).unwrap();
    let err = config.for_shard(Shard::new(0, 3).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("2 key-value heads across 3 ranks"),
        "{err}"
    );
    let err = config.for_shard(Shard::new(0, 4).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("6 attention heads across 4 ranks"),
        "{err}"
    );
    let source = SafetensorsSet::open(&path, &owner).unwrap();
    let backend = CpuBackend::new(
        &config,
        ThreadPool::new(1),
        &owner,
        4,
        CONTEXT,
        4,
        Arithmetic::Transformers,
    )
    .unwrap();
    let shard = Shard::new(1, 3).unwrap();
    let err = Transformer::load_shard(&backend, &config, &source, CONTEXT, shard, &owner)
        .err()
        .expect("three ranks of two key-value heads");
    assert!(err.to_string().contains("tensor parallelism"), "{err}");
}
