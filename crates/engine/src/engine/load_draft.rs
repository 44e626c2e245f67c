//! Loading `--draft-model`: a second model beside the target, on its device, its weights,
//! activations and KV pool made through the target's buffer owner (so the residency set holds
//! them with everything else, whole or not at all); on the CPU its passes run on the target's
//! threads.

use std::path::Path;
use std::sync::Arc;

use ember_checkpoint::{GgufFile, SafetensorsSet};
use ember_models::{
    CudaBackend, CudaKvPool, CudaOptions, KV_BLOCK_SIZE, KvLayout, KvPool, ModelConfig, Transformer,
};
use ember_tensor::cuda::CudaDevice;
use ember_tensor::{BufferOwner, ThreadPool};

use super::batch::DRAFT_STEP_ASIDE;
use super::load::{WeightFiles, cpu_backend, default_kv_dtype, gguf_path, warm_up};
use crate::draft::DraftModel;
use crate::error::{Error, Result};
use crate::gguf_tokenizer::tokenizer_from_gguf;
use crate::runner::{ModelRunner, Runner};
use crate::tokenizer::Tokenizer;

/// What the draft model is loaded for: the target's vocabulary, device and shape of work.
pub(super) struct DraftTarget<'a> {
    pub tokenizer: &'a Tokenizer,
    pub config: &'a ModelConfig,
    pub device: DraftDevice,
    /// Positions a sequence may reach, sequences drafting at once, tokens a pass.
    pub context: usize,
    pub parallel: usize,
    pub max_batch: usize,
}

/// Where the draft runs: the target's device.
pub(super) enum DraftDevice {
    /// On the target's threads.
    Cpu(Arc<ThreadPool>),
    /// On the target's GPU, with its graph setting and always the fastest products: a draft is
    /// only a guess, so it need not be batch-invariant where the target is (H100, qwen3-8b:
    /// a draft step 6.4 ms against the invariant kernel's 9.0).
    Cuda { device: CudaDevice, graphs: bool },
}

/// Loads the draft model at `path` (a Hugging Face directory or a GGUF file) for `target`.
pub(super) fn load_draft_model(
    path: &Path,
    target: DraftTarget<'_>,
    owner: &BufferOwner,
) -> Result<DraftModel> {
    let gguf = match gguf_path(path) {
        Some(file) => Some(GgufFile::open(&file, owner)?),
        None if path.is_dir() => None,
        None => return Err(Error::ModelDirMissing(path.to_path_buf())),
    };
    let (config, tokenizer) = match &gguf {
        Some(file) => (ModelConfig::from_gguf(file)?, tokenizer_from_gguf(file)?),
        None => (ModelConfig::from_dir(path)?, Tokenizer::from_dir(path)?),
    };
    check_vocabulary(path, target.tokenizer, &tokenizer)?;
    let weights = match gguf {
        Some(file) => WeightFiles::Gguf(file),
        None => WeightFiles::Safetensors(SafetensorsSet::open(path, owner)?),
    };
    let on_cuda = matches!(target.device, DraftDevice::Cuda { .. });
    let kv_dtype = default_kv_dtype(&weights, &config, on_cuda);
    let layout = KvLayout::new(&config, kv_dtype);
    // A whole context for each sequence the target runs at once.
    let blocks = layout.blocks_for(target.context) * target.parallel;
    let (hidden, layers) = (config.hidden_size, config.num_hidden_layers);
    let context = target.context;
    // A pass takes the draft steps of every sequence drafting at once (a token each; a
    // catch-up, a chunk each), a row of logits each: their greedy picks.
    let drafting = target.parallel.clamp(1, DRAFT_STEP_ASIDE);
    let (runner, files): (Box<dyn Runner>, Option<Box<dyn Send>>) = match target.device {
        DraftDevice::Cpu(pool) => {
            let (backend, owned) = cpu_backend(
                &config,
                pool,
                owner,
                [target.max_batch, context, drafting],
                kv_dtype,
                &weights,
            )?;
            let model = Transformer::load(&backend, config, weights.source(), context)?;
            let kv = KvPool::new(layout, blocks, 0, owner)?;
            let runner = ModelRunner {
                backend,
                model,
                kv,
                context,
            };
            // Owned weights need the mapping no more; else it stays as long as the draft.
            let files: Option<Box<dyn Send>> = match owned {
                true => None,
                false => Some(Box::new(weights)),
            };
            (Box::new(runner), files)
        }
        DraftDevice::Cuda { device, graphs } => {
            let backend = CudaBackend::new(
                device.clone(),
                &config,
                owner,
                target.max_batch,
                context.div_ceil(KV_BLOCK_SIZE),
                drafting,
                CudaOptions {
                    graphs,
                    batch_invariant: false,
                    draft_rows: 0,
                },
            )?;
            let model = Transformer::load(&backend, config, weights.source(), context)?;
            let kv = CudaKvPool::new(&device, owner, layout, blocks, 0)?;
            let mut runner = ModelRunner {
                backend,
                model,
                kv,
                context,
            };
            warm_up(&mut runner)?;
            // The weights live on the device now.
            drop(weights);
            (Box::new(runner), None)
        }
    };
    tracing::info!(
        "draft model {}: {layers} layers, {hidden} hidden, kv pool {blocks} blocks ({:.2} GiB)",
        path.display(),
        (blocks * layout.block_bytes()) as f64 / (1u64 << 30) as f64
    );
    Ok(DraftModel::new(
        runner,
        blocks,
        layout.block_size,
        target.config.vocab_size,
        files,
    ))
}

/// The draft's tokens must be the target's, id for id: the same number, each the same text
/// (a model's embedding may have more rows than its tokenizer has tokens: those are never
/// proposed, see [`DraftModel`]).
fn check_vocabulary(path: &Path, target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    let mismatch = |what: String| Error::DraftVocabulary {
        path: path.to_path_buf(),
        what,
    };
    let (n_target, n_draft) = (target.vocab_size(), draft.vocab_size());
    if n_target != n_draft {
        return Err(mismatch(format!(
            "its tokenizer has {n_draft} tokens, the model's {n_target}"
        )));
    }
    for id in 0..n_target as u32 {
        let (t, d) = (target.id_to_token(id), draft.id_to_token(id));
        if t != d {
            return Err(mismatch(format!(
                "token {id} is {} there and {} in the model",
                show(&d),
                show(&t)
            )));
        }
    }
    Ok(())
}

fn show(token: &Option<String>) -> String {
    token
        .as_ref()
        .map_or("missing".into(), |t| format!("{t:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::{DraftSource, Proposal};

    /// The golden qwen3 fixture as a draft for itself, over a context of 128 positions, for
    /// a target of two sequences at once.
    fn draft() -> DraftModel {
        draft_for(2)
    }

    /// The same for a target of `parallel` sequences at once (as many share a draft step).
    fn draft_for(parallel: usize) -> DraftModel {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/qwen3-f32");
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let config = ModelConfig::from_dir(&dir).unwrap();
        let target = DraftTarget {
            tokenizer: &tokenizer,
            config: &config,
            device: DraftDevice::Cpu(Arc::new(ThreadPool::new(1))),
            context: 128,
            parallel,
            max_batch: 16,
        };
        load_draft_model(&dir, target, &BufferOwner::new()).unwrap()
    }

    fn propose(d: &mut DraftModel, id: u64, tokens: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        d.propose(id, tokens, max, &mut out);
        out
    }

    #[test]
    fn proposals_after_a_rejection_are_those_of_a_fresh_draft() {
        let prompt: Vec<u32> = (0..37).map(|i| (i * 11 + 5) % 400).collect();
        let mut kept = draft();
        let first = propose(&mut kept, 1, &prompt, 6);
        assert_eq!(first.len(), 6);
        // The target kept two drafts and picked another token: the draft's blocks hold four
        // positions the sequence does not have.
        let mut seq = [&prompt[..], &first[..2]].concat();
        seq.push((first[2] + 1) % 400);
        let after = propose(&mut kept, 1, &seq, 5);
        // Another sequence beside it, and the first one's next step, all drafts standing.
        let other = propose(&mut kept, 2, &prompt[..20], 3);
        seq.extend_from_slice(&after);
        seq.push(7);
        let later = propose(&mut kept, 1, &seq, 4);
        // Tokens that part from what the blocks hold well before the last one.
        let mut edited = seq.clone();
        edited[10] = (edited[10] + 1) % 400;
        let after_edit = propose(&mut kept, 1, &edited, 4);

        let mut fresh = draft();
        assert_eq!(after, propose(&mut fresh, 9, &seq[..prompt.len() + 3], 5));
        assert_eq!(other, propose(&mut fresh, 10, &prompt[..20], 3));
        assert_eq!(later, propose(&mut fresh, 11, &seq, 4));
        assert_eq!(after_edit, propose(&mut fresh, 12, &edited, 4));
        // Ended sequences give their blocks back.
        kept.finish(1);
        kept.finish(2);
        assert_eq!(kept.sequences(), 0);
    }

    /// Sequences proposing together (their draft steps in shared passes) get what each
    /// would alone: a sequence cut back after a rejection, one whose prompt takes several
    /// chunks to catch up, a short one, one with nothing to propose; four asks over passes of
    /// three rows.
    #[test]
    fn proposals_together_are_each_alone() {
        let prompt: Vec<u32> = (0..23).map(|i| (i * 7 + 3) % 400).collect();
        let long: Vec<u32> = (0..40).map(|i| (i * 13 + 1) % 400).collect();
        let short = [5, 9, 100, 3, 77];
        let mut together = draft_for(3);
        let first = propose(&mut together, 1, &prompt, 4);
        let cut = [&prompt[..], &[first[0], (first[1] + 1) % 400]].concat();
        let asks = [
            Proposal {
                id: 1,
                tokens: &cut,
                max: 5,
            },
            Proposal {
                id: 2,
                tokens: &long,
                max: 3,
            },
            Proposal {
                id: 3,
                tokens: &short,
                max: 6,
            },
            Proposal {
                id: 4,
                tokens: &[],
                max: 4,
            },
        ];
        let mut outs = vec![vec![1]; asks.len()];
        together.propose_all(&asks, &mut outs);

        let mut alone = draft_for(1);
        let each: Vec<Vec<u32>> = asks
            .iter()
            .map(|a| propose(&mut alone, a.id + 10, a.tokens, a.max))
            .collect();
        assert_eq!(outs, each);
        assert_eq!(outs.iter().map(Vec::len).collect::<Vec<_>>(), [5, 3, 6, 0]);
        // Their next proposals go on from the blocks the shared passes filled.
        let next = [&long[..], &outs[1][..], &[4]].concat();
        assert_eq!(
            propose(&mut together, 2, &next, 4),
            propose(&mut draft_for(1), 7, &next, 4)
        );
        for id in 1..=4 {
            together.finish(id);
        }
        assert_eq!(together.sequences(), 0);
    }

    #[test]
    fn a_proposal_stops_at_the_context() {
        let mut d = draft();
        let prompt: Vec<u32> = (0..126).map(|i| (i * 3 + 1) % 400).collect();
        assert_eq!(propose(&mut d, 1, &prompt, 8).len(), 2);
        assert!(propose(&mut d, 1, &[prompt.clone(), vec![1, 2]].concat(), 8).is_empty());
    }
}
