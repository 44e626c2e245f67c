//! A forward pass over several sequences gives each row the bits it gets alone.
//!
//! The sequences of a continuous-batching step share one pass: decode tokens, prompt chunks
//! with and without logits, all at once. Each row's logits must be the bits of the same
//! position computed alone, in one pass of its whole sequence (batch invariance: the CPU's
//! products give a row the same result in any batch, and attention runs per sequence). Checked
//! on every golden fixture (transformers' arithmetic, f32 cache) and on the GGUF model when it
//! is present (llama.cpp's, f16 cache).

mod common;

use std::path::{Path, PathBuf};

use common::{bits, fresh_table, golden, tokens};
use ember_checkpoint::{GgufFile, SafetensorsSet, TensorSource};
use ember_models::{
    Arithmetic, BlockTable, CpuBackend, KV_BLOCK_SIZE, KvDtype, KvLayout, KvPool, Logits,
    ModelConfig, SequencePass, Transformer,
};
use ember_tensor::{BufferOwner, ThreadPool};

const CONTEXT: usize = 128;
const MAX_BATCH: usize = 64;
const LOGIT_ROWS: usize = 64;

struct Model {
    backend: CpuBackend,
    model: Transformer<CpuBackend>,
    kv: KvPool,
    /// The next block no sequence holds.
    next_block: u32,
}

impl Model {
    fn load(config: ModelConfig, source: &dyn TensorSource, dtype: KvDtype) -> Model {
        let owner = BufferOwner::new();
        let arithmetic = match dtype {
            KvDtype::F16 => Arithmetic::LlamaCpp,
            _ => Arithmetic::Transformers,
        };
        let pool = ThreadPool::new(2);
        let backend = CpuBackend::new(
            &config, pool, &owner, MAX_BATCH, CONTEXT, LOGIT_ROWS, arithmetic,
        )
        .unwrap();
        let layout = KvLayout::new(&config, dtype);
        let model = Transformer::load(&backend, config, source, CONTEXT).unwrap();
        let blocks = 8 * CONTEXT / KV_BLOCK_SIZE;
        let kv = KvPool::new(layout, blocks, 0, &owner).unwrap();
        Model {
            backend,
            model,
            kv,
            next_block: 0,
        }
    }

    /// A new sequence's table, with blocks of its own for the whole context.
    fn sequence(&mut self) -> BlockTable {
        fresh_table(&mut self.next_block, CONTEXT)
    }

    fn vocab(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Every position's logits of `tokens` run alone in one pass, as bits.
    fn alone(&mut self, tokens: &[u32]) -> Vec<Vec<u32>> {
        let mut seq = self.sequence();
        let vocab = self.vocab();
        let logits = self
            .model
            .forward(
                &mut self.backend,
                &mut self.kv,
                &mut seq,
                tokens,
                Logits::All,
            )
            .unwrap();
        logits.chunks(vocab).map(bits).collect()
    }
}

/// One step of a batched run: for each sequence, how many of its next tokens the pass takes
/// and which logits it asks for.
type Step = [(usize, Logits); 4];

/// Continuous batching's shapes: a prompt chunk without logits beside a short prompt, then a
/// decode token beside a prompt's last chunk and a whole prompt with every row's logits (the
/// rows that give logits are not one run: they are gathered), then a step where every
/// sequence decodes, one of them starting with a one-token prompt.
const STEPS: [Step; 4] = [
    [
        (7, Logits::Last),
        (10, Logits::None),
        (0, Logits::None),
        (0, Logits::None),
    ],
    [
        (1, Logits::Last),
        (9, Logits::Last),
        (33, Logits::All),
        (0, Logits::None),
    ],
    [
        (1, Logits::Last),
        (1, Logits::Last),
        (1, Logits::Last),
        (1, Logits::Last),
    ],
    [
        (1, Logits::All),
        (1, Logits::None),
        (1, Logits::Last),
        (1, Logits::Last),
    ],
];

fn check_batch_equals_alone(model: &mut Model, what: &str) {
    let vocab = model.vocab();
    // Each sequence's tokens over all the steps.
    let lengths: Vec<usize> = (0..4)
        .map(|s| STEPS.iter().map(|step| step[s].0).sum())
        .collect();
    let all: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(s, &len)| tokens(len, 11 + s as u64, vocab))
        .collect();
    let want: Vec<Vec<Vec<u32>>> = all.iter().map(|t| model.alone(t)).collect();

    let mut tables: Vec<BlockTable> = (0..4).map(|_| model.sequence()).collect();
    let mut done = [0usize; 4];
    for (index, step) in STEPS.iter().enumerate() {
        let mut passes: Vec<SequencePass<'_, '_>> = tables
            .iter_mut()
            .zip(&all)
            .zip(step)
            .enumerate()
            .map(|(s, ((seq, tokens), &(n, logits)))| SequencePass {
                seq,
                tokens: &tokens[done[s]..done[s] + n],
                logits,
            })
            .collect();
        let Model {
            backend, model: m, ..
        } = model;
        let logits = m
            .forward_batch(backend, &mut model.kv, &mut passes)
            .unwrap();
        drop(passes);
        // The rows the step asked for, sequence by sequence, each against its position alone.
        let mut rows = logits.chunks(vocab);
        for (s, &(n, kind)) in step.iter().enumerate() {
            let positions = match kind {
                _ if n == 0 => 0..0,
                Logits::Last => done[s] + n - 1..done[s] + n,
                Logits::All => done[s]..done[s] + n,
                Logits::None => 0..0,
            };
            for position in positions {
                let got = bits(rows.next().expect("a row for every position asked"));
                assert!(
                    got == want[s][position],
                    "{what}: step {index}, sequence {s}, position {position}: the batched \
                     logits differ from the sequence's alone"
                );
            }
            done[s] += n;
        }
        assert!(rows.next().is_none(), "{what}: step {index}: extra rows");
    }
    for (s, table) in tables.iter().enumerate() {
        assert_eq!(table.len(), lengths[s], "{what}: sequence {s}'s positions");
    }
}

#[test]
fn a_batch_of_sequences_gives_each_row_its_bits_alone_on_every_golden_fixture() {
    let dir = golden("");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() >= 5, "golden fixtures: {names:?}");
    for name in names {
        let path = golden(&name);
        let owner = BufferOwner::new();
        let config = ModelConfig::from_dir(&path).unwrap();
        let source = SafetensorsSet::open(&path, &owner).unwrap();
        let mut model = Model::load(config, &source, KvDtype::F32);
        check_batch_equals_alone(&mut model, &name);
    }
}

fn gguf(file: &str) -> Option<PathBuf> {
    let mut dirs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")];
    if let Some(dir) = std::env::var_os("EMBER_MODELS_DIR") {
        dirs.insert(0, PathBuf::from(dir));
    }
    dirs.into_iter().map(|d| d.join(file)).find(|p| p.is_file())
}

#[test]
fn a_batch_of_sequences_gives_each_row_its_bits_alone_on_the_gguf_model() {
    let file = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let Some(path) = gguf(file) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must fetch the default model (scripts/fetch-model smollm2)"
        );
        println!("skipped: no {file}");
        return;
    };
    let owner = BufferOwner::new();
    let source = GgufFile::open(Path::new(&path), &owner).unwrap();
    let config = ModelConfig::from_gguf(&source).unwrap();
    let mut model = Model::load(config, &source, KvDtype::F16);
    check_batch_equals_alone(&mut model, file);
}
