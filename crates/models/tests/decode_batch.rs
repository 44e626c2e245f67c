//! Decode steps of many sequences in one pass, on any backend: each sequence's prompt is
//! prefilled on its own, then its decode tokens run in passes beside other sequences' (which
//! join and leave between steps), and every row's logits must be the bits the same step gives
//! the sequence decoding alone. On the CPU always; on CUDA with `EMBER_TEST_DEVICE=cuda`
//! (graphs on and off, batch-invariant products on and off). There the decode attention takes
//! every row in one launch with the splits it takes alone, and the products are
//! - batch-invariant (`CudaOptions::batch_invariant`): the same tensor-core kernel, one order
//!   of sums per element, for every batch: decode passes of any size give every row its bits
//!   alone;
//! - otherwise: matrix-vector kernels, whose rows never see each other, for passes of up to
//!   `cuda::MAX_BATCH` rows (bits alone), cuBLASLt past them (close to alone only).
//!
//! Passes that mix prompt chunks with decode rows are checked to stay close to alone on CUDA,
//! not equal: a prompt row's attention is the prompt kernel's arithmetic, a decode row's the
//! decode kernel's. A mixture of experts keeps its own expert kernels: bits for passes of up to
//! `cuda::MAX_BATCH` rows only.

mod common;

use common::{bits, fresh_table, golden, tokens};
use ember_checkpoint::{SafetensorsSet, TensorSource};
use ember_models::{
    Arithmetic, Backend, BlockTable, CpuBackend, CudaBackend, CudaKvPool, CudaOptions,
    KV_BLOCK_SIZE, KvDtype, KvLayout, KvPool, Logits, ModelConfig, SequencePass, Transformer,
};
use ember_tensor::cuda::CudaDevice;
use ember_tensor::{BufferOwner, ThreadPool};

const CONTEXT: usize = 128;
const MAX_BATCH: usize = 64;
const SEQUENCES: usize = 16;
const DECODE_STEPS: usize = 6;

struct Harness<B: Backend> {
    backend: B,
    model: Transformer<B>,
    kv: B::Kv,
    next_block: u32,
}

impl<B: Backend> Harness<B> {
    fn vocab(&self) -> usize {
        self.model.config.vocab_size
    }

    /// A new sequence's table, with blocks of its own for the whole context.
    fn sequence(&mut self) -> BlockTable {
        fresh_table(&mut self.next_block, CONTEXT)
    }

    /// `tokens` in one pass of their own; the last row's logits as bits.
    fn alone(&mut self, seq: &mut BlockTable, tokens: &[u32]) -> Vec<u32> {
        let vocab = self.vocab();
        let logits = self
            .model
            .forward(&mut self.backend, &mut self.kv, seq, tokens, Logits::Last)
            .unwrap();
        bits(&logits[..vocab])
    }

    /// Passes over several sequences, `tokens` each, all with their last row's logits.
    fn together(&mut self, passes: &mut [SequencePass<'_, '_>]) -> Vec<Vec<u32>> {
        let vocab = self.vocab();
        let logits = self
            .model
            .forward_batch(&mut self.backend, &mut self.kv, passes)
            .unwrap();
        logits.chunks(vocab).map(bits).collect()
    }
}

/// Sequence `s`'s prompt (a few to a few dozen tokens) and its decode tokens.
fn script(s: usize, vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let prompt = tokens(3 + (s * 7) % 40, 101 + s as u64, vocab);
    (prompt, tokens(DECODE_STEPS, 202 + s as u64, vocab))
}

/// Whether sequence `s` takes part in step `t` of a run of `n`: sequences join and leave.
fn takes_part(s: usize, t: usize, n: usize) -> bool {
    n < 3 || !(s + t).is_multiple_of(3)
}

/// How two rows of logits must compare.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    Bits,
    /// Within this share of the row's largest magnitude, at every logit.
    Close(f32),
}

fn compare(got: &[u32], want: &[u32], expect: Expect, what: &str) {
    match expect {
        Expect::Bits => assert!(got == want, "{what}: the logits differ from alone"),
        Expect::Close(share) => {
            let f = |b: &u32| f32::from_bits(*b);
            let scale = want.iter().map(|b| f(b).abs()).fold(0.0f32, f32::max);
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (f(a) - f(b)).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst.is_finite() && worst <= share * scale.max(1.0),
                "{what}: a logit is {worst} away from alone (largest {scale})"
            );
        }
    }
}

/// `n` sequences, each prefilled alone, then decoding: alone, and in passes over whichever
/// of them take part in a step; every row against its step alone.
fn check_decode_batches<B: Backend>(h: &mut Harness<B>, n: usize, expect: Expect, what: &str) {
    // The sequences of earlier checks are done with: their blocks are free.
    h.next_block = 0;
    let vocab = h.vocab();
    let scripts: Vec<(Vec<u32>, Vec<u32>)> = (0..n).map(|s| script(s, vocab)).collect();
    let want: Vec<Vec<Vec<u32>>> = scripts
        .iter()
        .map(|(prompt, decode)| {
            let mut seq = h.sequence();
            h.alone(&mut seq, prompt);
            decode.iter().map(|&t| h.alone(&mut seq, &[t])).collect()
        })
        .collect();

    let mut tables: Vec<BlockTable> = Vec::with_capacity(n);
    for (prompt, _) in &scripts {
        let mut seq = h.sequence();
        h.alone(&mut seq, prompt);
        tables.push(seq);
    }
    let mut done = vec![0usize; n];
    let mut step = 0;
    while done.iter().any(|&d| d < DECODE_STEPS) {
        let part: Vec<usize> = (0..n)
            .filter(|&s| done[s] < DECODE_STEPS && takes_part(s, step, n))
            .collect();
        step += 1;
        if part.is_empty() {
            continue;
        }
        let rows = {
            let mut passes: Vec<SequencePass<'_, '_>> = tables
                .iter_mut()
                .enumerate()
                .filter(|(s, _)| part.contains(s))
                .map(|(s, seq)| SequencePass {
                    seq,
                    tokens: &scripts[s].1[done[s]..done[s] + 1],
                    logits: Logits::Last,
                })
                .collect();
            h.together(&mut passes)
        };
        assert_eq!(rows.len(), part.len(), "{what}: a row per sequence");
        for (row, &s) in rows.iter().zip(&part) {
            let label = format!(
                "{what}: {n} sequences, sequence {s}, decode step {}",
                done[s]
            );
            compare(row, &want[s][done[s]], expect, &label);
            done[s] += 1;
        }
    }
}

/// Passes that mix prompt chunks (with and without logits) and decode rows, against the
/// same positions run alone one token at a time after the same prompts.
fn check_mixed_passes<B: Backend>(h: &mut Harness<B>, expect: Expect, what: &str) {
    h.next_block = 0;
    let vocab = h.vocab();
    // Per sequence: a prompt prefilled alone, then per step the tokens it takes and whether
    // its last row gives logits.
    let steps: [[(usize, bool); 4]; 3] = [
        [(1, true), (12, false), (5, true), (0, false)],
        [(1, true), (3, true), (1, true), (20, true)],
        [(1, true), (1, true), (1, true), (1, true)],
    ];
    let lengths: Vec<usize> = (0..4).map(|s| steps.iter().map(|t| t[s].0).sum()).collect();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|s| tokens(9 + 5 * s, 303 + s as u64, vocab))
        .collect();
    let rest: Vec<Vec<u32>> = (0..4)
        .map(|s| tokens(lengths[s], 404 + s as u64, vocab))
        .collect();
    // Alone: every position's logits, one token a pass after the prompt.
    let want: Vec<Vec<Vec<u32>>> = (0..4)
        .map(|s| {
            let mut seq = h.sequence();
            h.alone(&mut seq, &prompts[s]);
            rest[s].iter().map(|&t| h.alone(&mut seq, &[t])).collect()
        })
        .collect();
    let mut tables: Vec<BlockTable> = Vec::with_capacity(4);
    for prompt in &prompts {
        let mut seq = h.sequence();
        h.alone(&mut seq, prompt);
        tables.push(seq);
    }
    let mut done = [0usize; 4];
    for (index, step) in steps.iter().enumerate() {
        let rows = {
            let mut passes: Vec<SequencePass<'_, '_>> = tables
                .iter_mut()
                .enumerate()
                .map(|(s, seq)| SequencePass {
                    seq,
                    tokens: &rest[s][done[s]..done[s] + step[s].0],
                    logits: if step[s].1 {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                })
                .collect();
            h.together(&mut passes)
        };
        let mut rows = rows.iter();
        for (s, &(n, logits)) in step.iter().enumerate() {
            if n > 0 && logits {
                let got = rows.next().expect("a row for every sequence asking");
                let position = done[s] + n - 1;
                let label =
                    format!("{what}: mixed step {index}, sequence {s}, position {position}");
                compare(got, &want[s][position], expect, &label);
            }
            done[s] += n;
        }
        assert!(rows.next().is_none(), "{what}: step {index}: extra rows");
    }
}

const FIXTURES: [&str; 4] = [
    "qwen3-bf16",
    "qwen3-hd128-bf16",
    "llama-f32",
    "qwen3moe-bf16",
];

fn cpu_harness(config: ModelConfig, source: &dyn TensorSource) -> Harness<CpuBackend> {
    let owner = BufferOwner::new();
    let backend = CpuBackend::new(
        &config,
        ThreadPool::new(2),
        &owner,
        MAX_BATCH,
        CONTEXT,
        SEQUENCES,
        Arithmetic::Transformers,
    )
    .unwrap();
    let layout = KvLayout::new(&config, KvDtype::F32);
    let model = Transformer::load(&backend, config, source, CONTEXT).unwrap();
    let blocks = 2 * (SEQUENCES + 4) * CONTEXT / KV_BLOCK_SIZE;
    let kv = KvPool::new(layout, blocks, 0, &owner).unwrap();
    Harness {
        backend,
        model,
        kv,
        next_block: 0,
    }
}

#[test]
fn decode_passes_over_many_sequences_give_each_row_its_bits_alone_on_the_cpu() {
    for name in FIXTURES {
        let path = golden(name);
        let owner = BufferOwner::new();
        let config = ModelConfig::from_dir(&path).unwrap();
        let source = SafetensorsSet::open(&path, &owner).unwrap();
        let mut h = cpu_harness(config, &source);
        for n in [2, 5, SEQUENCES] {
            check_decode_batches(&mut h, n, Expect::Bits, name);
        }
        check_mixed_passes(&mut h, Expect::Bits, name);
    }
}

/// The device under test, from `EMBER_TEST_DEVICE` (`cuda` or `cuda:N`); `None` for the CPU.
fn cuda_ordinal() -> Option<usize> {
    let device = std::env::var("EMBER_TEST_DEVICE").ok()?;
    match device.as_str() {
        "cpu" => None,
        "cuda" => Some(0),
        other => Some(
            other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("EMBER_TEST_DEVICE: cpu, cuda or cuda:N, not {other}")),
        ),
    }
}

#[test]
fn decode_passes_over_many_sequences_give_each_row_its_bits_alone_on_cuda() {
    let Some(ordinal) = cuda_ordinal() else {
        println!("skipped: EMBER_TEST_DEVICE is not cuda");
        return;
    };
    let device = CudaDevice::open(ordinal).unwrap();
    let on_off = |b: bool| if b { "on" } else { "off" };
    for name in FIXTURES {
        for (graphs, batch_invariant) in [(true, true), (false, true), (true, false)] {
            let what = format!(
                "{name} (cuda, graphs {}, batch-invariant products {})",
                on_off(graphs),
                on_off(batch_invariant)
            );
            let path = golden(name);
            let owner = BufferOwner::new();
            let config = ModelConfig::from_dir(&path).unwrap();
            let source = SafetensorsSet::open(&path, &owner).unwrap();
            let backend = CudaBackend::new(
                device.clone(),
                &config,
                &owner,
                MAX_BATCH,
                CONTEXT / KV_BLOCK_SIZE,
                SEQUENCES,
                CudaOptions {
                    graphs,
                    batch_invariant,
                    draft_rows: 0,
                },
            )
            .unwrap();
            let dtype = if config.dtype.as_deref() == Some("bfloat16") {
                KvDtype::Bf16
            } else {
                KvDtype::F32
            };
            let layout = KvLayout::new(&config, dtype);
            let model = Transformer::load(&backend, config, &source, CONTEXT).unwrap();
            let blocks = 2 * (SEQUENCES + 4) * CONTEXT / KV_BLOCK_SIZE;
            let kv = CudaKvPool::new(&device, &owner, layout, blocks, 0).unwrap();
            let mut h = Harness {
                backend,
                model,
                kv,
                next_block: 0,
            };
            let exact_rows = ember_tensor::cuda::MAX_BATCH;
            let dense = h.model.config.moe.is_none();
            // Twice, so that the graphs recorded the first time are replayed the second.
            for _ in 0..2 {
                for n in [2, 5, exact_rows] {
                    check_decode_batches(&mut h, n, Expect::Bits, &what);
                }
                // A mixture of experts routes each token to its top experts: rounding that
                // moves a router logit across a tie sends the token elsewhere, so its rows
                // need not stay close to alone where its expert kernels see the batch.
                if dense {
                    let long = if batch_invariant {
                        Expect::Bits
                    } else {
                        Expect::Close(0.05)
                    };
                    check_decode_batches(&mut h, SEQUENCES, long, &what);
                    check_mixed_passes(&mut h, Expect::Close(0.05), &what);
                }
            }
        }
    }
}
