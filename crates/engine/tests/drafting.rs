//! Speculative decoding never changes the output: every request drafted for (by prompt lookup,
//! or by a source that proposes the true continuation with a wrong token somewhere, so that
//! drafts are accepted, rejected at every place and cut by the request's end) gives the tokens,
//! and each token's logits bit for bit, that the same request gets undrafted and alone —
//! greedy and seeded sampling, draft depths 1 to 8, several requests at once, on every golden
//! fixture and on the real GGUF models (SmolLM2, and Qwen2.5-Coder-1.5B where fetched).
//!
//! `EMBER_TEST_DEVICE=cuda` runs them on the GPU with `--batch-invariant`, draft models beside
//! the target on the GPU (gpu-invariance skips the GGUF models' test).

#[path = "common/replies.rs"]
mod replies;

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_engine::constraint::{Constraint, ConstraintCompiler, Grammar};
use ember_engine::draft::{DraftKind, DraftOptions, DraftSource, NgramDrafter};
use ember_engine::sampler::SamplingParams;
use ember_engine::scheduler::SeqId;
use ember_engine::{BatchEvent, Device, Engine, EngineOptions, FinishReason, GenerateParams};
use replies::{Draws, Reply, Request, alone, bits, golden, on_test_device};

/// An engine of `parallel` sequences drafting by prompt lookup, up to 8 tokens a pass.
fn load(path: &Path, parallel: usize) -> Engine {
    load_split(path, parallel, 1)
}

/// [`load`] of the model split across `ranks` (`--tensor-parallel`).
fn load_split(path: &Path, parallel: usize, ranks: usize) -> Engine {
    let options = on_test_device(EngineOptions {
        tensor_parallel: ranks,
        threads: Some(2),
        context: Some(256),
        parallel: Some(parallel),
        prefill_chunk: Some(64),
        draft: DraftOptions {
            kind: DraftKind::Ngram,
            max: 8,
            min: 1,
        },
        ..EngineOptions::default()
    });
    Engine::load(path, &options).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Greedy and seeded requests; prompts that repeat a stretch (so prompt lookup finds matches),
/// one that opts out of drafting and one that may stop at an end-of-sequence token.
fn requests(vocab: usize) -> Vec<Request> {
    let mut draws = Draws(0x2545_F491_4F6C_DD1Du64);
    let mut next = |n: usize| draws.below(n);
    (0..6)
        .map(|i| {
            let stretch: Vec<u32> = (0..6 + next(10)).map(|_| next(vocab) as u32).collect();
            let mut prompt: Vec<u32> = (0..1 + next(12)).map(|_| next(vocab) as u32).collect();
            for _ in 0..2 {
                prompt.extend_from_slice(&stretch);
                prompt.push(next(vocab) as u32);
            }
            // It ends inside the stretch: prompt lookup guesses the rest.
            prompt.extend_from_slice(&stretch[..3]);
            let sampling = match i % 2 {
                0 => SamplingParams::default(),
                _ => SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    seed: Some(7 + i as u64),
                    ..SamplingParams::default()
                },
            };
            Request {
                prompt,
                params: GenerateParams {
                    max_tokens: 12 + next(20),
                    sampling,
                    ignore_eos: i != 5,
                    step_logits: true,
                    cache_prompt: false,
                    draft: i != 3,
                },
            }
        })
        .collect()
}

/// Every request submitted at once to the batched loop, run to the end.
fn batched(engine: &mut Engine, requests: &[Request]) -> HashMap<u64, Reply> {
    batched_held(engine, requests, &|| None)
}

/// [`batched`], each request held to the constraint `held` makes (if any).
fn batched_held(
    engine: &mut Engine,
    requests: &[Request],
    held: &dyn Fn() -> Option<Constraint>,
) -> HashMap<u64, Reply> {
    for (id, r) in requests.iter().enumerate() {
        engine
            .submit(id as u64, &r.prompt, r.params, held())
            .unwrap();
    }
    let mut replies: HashMap<u64, Reply> = HashMap::new();
    let mut finished = 0;
    while engine
        .step_batch(&mut |id, event| match event {
            BatchEvent::Prompt { .. } => {}
            BatchEvent::Token { token, logits, .. } => {
                let reply = replies.entry(id).or_default();
                reply.0.push(token);
                reply.1.push(bits(logits.expect("step logits asked for")));
            }
            BatchEvent::Finished(generation) => {
                assert_eq!(generation.tokens, replies[&id].0);
                if generation.finish_reason == FinishReason::Length {
                    assert_eq!(
                        generation.tokens.len(),
                        requests[id as usize].params.max_tokens
                    );
                }
                finished += 1;
            }
            BatchEvent::Failed(e) => panic!("request {id} failed: {e}"),
        })
        .unwrap()
    {}
    assert_eq!(finished, requests.len());
    replies
}

/// Proposes each request's true continuation (its undrafted reply), with one token made wrong
/// at a place that moves from call to call (none every third call), and past the reply's end
/// tokens of its own: drafts accepted whole, rejected at every depth, and longer than what the
/// request may still make.
struct Misleading {
    truth: HashMap<SeqId, Vec<u32>>,
    vocab: u32,
    calls: usize,
}

impl Misleading {
    /// Request `i`'s truth: its prompt, then `replies[i]`'s tokens.
    fn new(requests: &[Request], replies: &[Reply], vocab: usize) -> Self {
        let truth = requests
            .iter()
            .zip(replies)
            .enumerate()
            .map(|(id, (r, reply))| (id as SeqId, [&r.prompt[..], &reply.0[..]].concat()))
            .collect();
        Misleading {
            truth,
            vocab: vocab as u32,
            calls: 0,
        }
    }
}

impl DraftSource for Misleading {
    fn propose(&mut self, id: SeqId, tokens: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        let Some(truth) = self.truth.get(&id) else {
            return;
        };
        self.calls += 1;
        for at in tokens.len()..tokens.len() + max {
            out.push(truth.get(at).copied().unwrap_or(at as u32 % self.vocab));
        }
        if !self.calls.is_multiple_of(3) {
            let wrong = self.calls % out.len();
            out[wrong] = (out[wrong] + 1) % self.vocab;
        }
    }
}

fn check(path: &Path, name: &str) {
    check_split(path, name, 1);
}

/// [`check`] of the model split across `ranks`.
fn check_split(path: &Path, name: &str, ranks: usize) {
    // Two at a time: passes that draft for both, or for one beside the other's prompt or the
    // request that opts out.
    let mut engine = load_split(path, 2, ranks);
    let vocab = engine.config().vocab_size;
    let requests = requests(vocab);
    let want: Vec<Reply> = requests.iter().map(|r| alone(&mut engine, r)).collect();

    // Prompt lookup, the engine's own source, then matching single tokens too (random
    // weights rarely repeat a pair of the prompt's tokens, so this one surely drafts).
    for single in [false, true] {
        if single {
            let lookup = NgramDrafter { min_n: 1, max_n: 4 };
            engine.set_draft_source(Box::new(lookup), 8, 1);
        }
        let got = batched(&mut engine, &requests);
        for (id, want) in want.iter().enumerate() {
            let (tokens, logits) = &got[&(id as u64)];
            assert_eq!(
                tokens, &want.0,
                "{name}: request {id}'s tokens, n-gram drafts"
            );
            assert!(
                logits == &want.1,
                "{name}: request {id}'s logits, n-gram drafts"
            );
        }
    }
    let lookup = engine.step_timing().drafts;
    assert!(lookup.drafted > 0, "{name}: prompt lookup drafted nothing");

    for depth in [1, 3, 8] {
        let source = Misleading::new(&requests, &want, vocab);
        engine.set_draft_source(Box::new(source), depth, 1);
        let before = engine.step_timing().drafts;
        let got = batched(&mut engine, &requests);
        for (id, want) in want.iter().enumerate() {
            let (tokens, logits) = &got[&(id as u64)];
            assert_eq!(
                tokens, &want.0,
                "{name}: request {id}'s tokens, depth {depth}"
            );
            assert!(
                logits == &want.1,
                "{name}: request {id}'s logits, depth {depth}"
            );
        }
        // The drafts were verified, some kept and some not: the test saw both.
        let after = engine.step_timing().drafts;
        let (drafted, accepted) = (
            after.drafted - before.drafted,
            after.accepted - before.accepted,
        );
        assert!(
            accepted > 0 && accepted < drafted,
            "{name}, depth {depth}: {accepted} of {drafted} drafted tokens accepted"
        );
    }
}

#[test]
fn drafted_equals_undrafted_on_every_golden_fixture() {
    for name in [
        "qwen3-f32",
        "qwen2-f32",
        "llama-f32",
        "qwen3moe-f32",
        "qwen3-bf16",
    ] {
        check(&golden(name), name);
    }
}

/// Split two ways (ranks as threads on the CPU, GPUs on CUDA): drafts verified across the
/// ranks change nothing either.
#[test]
fn drafted_equals_undrafted_on_split_models() {
    for name in ["qwen3-f32", "qwen3moe-f32"] {
        check_split(&golden(name), name, 2);
    }
}

/// Both real GGUF models: the default one (CI fetches it) and Qwen2.5-Coder-1.5B where
/// `scripts/fetch-model qwen2.5-coder-1.5b` put it.
#[test]
fn drafted_equals_undrafted_on_the_real_gguf_models() {
    let mut ran = 0;
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    ] {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models")
            .join(file);
        if path.is_file() {
            check(&path, file);
            ran += 1;
        } else {
            eprintln!("SKIPPED: {file} is not in models/ (scripts/fetch-model)");
        }
    }
    assert!(
        ran > 0 || std::env::var_os("CI").is_none(),
        "CI must run scripts/fetch-model smollm2"
    );
}

/// `Engine::generate` on an engine that drafts (`ember run`) takes the batched loop for a
/// request that may draft: the same tokens and logits as undrafted, drafts verified, and a
/// caller that stops early gets what it saw, the engine free for the next request.
#[test]
fn generate_on_a_drafting_engine_drafts_with_the_same_output() {
    let mut engine = load(&golden("qwen3-f32"), 1);
    engine.set_draft_source(Box::new(NgramDrafter { min_n: 1, max_n: 4 }), 8, 1);
    let requests = requests(engine.config().vocab_size);
    let mut drafted = 0;
    for (id, r) in requests.iter().enumerate() {
        let want = alone(&mut engine, r);
        let mut logits = Vec::new();
        let before = engine.step_timing();
        let generation = engine
            .generate(&r.prompt, &r.params, |step| {
                logits.push(bits(step.logits.expect("step logits asked for")));
                ControlFlow::Continue(())
            })
            .unwrap();
        assert_eq!(generation.tokens, want.0, "request {id}'s tokens");
        assert!(logits == want.1, "request {id}'s logits");
        let drafts = engine.step_timing().since(&before).drafts;
        assert_eq!(
            (generation.drafted_tokens, generation.accepted_tokens),
            (drafts.drafted, drafts.accepted)
        );
        if !r.params.draft {
            assert_eq!(drafts.drafted, 0, "request {id} opted out");
        }
        drafted += drafts.drafted;
    }
    assert!(drafted > 0, "nothing drafted");
    // Stopped after three tokens, whatever a pass made past them.
    let r = &requests[0];
    let want = alone(&mut engine, r);
    let mut seen = 0;
    let generation = engine
        .generate(&r.prompt, &r.params, |_| {
            seen += 1;
            match seen {
                3 => ControlFlow::Break(()),
                _ => ControlFlow::Continue(()),
            }
        })
        .unwrap();
    assert_eq!(generation.tokens, want.0[..3]);
    assert_eq!(generation.finish_reason, FinishReason::Stop);
    assert_eq!(engine.pending_requests(), 0);
    assert_eq!(alone(&mut engine, r), want);
}

#[test]
fn a_grammar_held_request_is_drafted_for_with_the_same_output() {
    // Held to a JSON schema, greedy and seeded: the drafts (the true continuation, a token
    // made wrong here and there) are cut where the grammar stops allowing them, each row's
    // pick is masked as the drafts before it leave the grammar, and every reply is the same
    // request's undrafted, tokens and logits.
    let mut engine = load(&golden("qwen3-f32"), 2);
    let vocab = engine.config().vocab_size;
    let compiler = ConstraintCompiler::new(
        Arc::clone(engine.tokenizer()),
        vocab,
        engine.eos_token_ids(),
    );
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"]
    });
    let held = || {
        Some(
            compiler
                .compile(&Grammar::JsonSchema(schema.clone()))
                .unwrap(),
        )
    };
    let mut requests = requests(vocab);
    requests.truncate(4);
    let mut want = Vec::new();
    for (id, r) in requests.iter().enumerate() {
        let alone = Request {
            prompt: r.prompt.clone(),
            params: GenerateParams {
                draft: false,
                ..r.params
            },
        };
        let mut replies = batched_held(&mut engine, std::slice::from_ref(&alone), &held);
        want.push(replies.remove(&0).unwrap_or_else(|| panic!("request {id}")));
    }
    for depth in [1, 3, 8] {
        let source = Misleading::new(&requests, &want, vocab);
        engine.set_draft_source(Box::new(source), depth, 1);
        let before = engine.step_timing().drafts;
        let got = batched_held(&mut engine, &requests, &held);
        for (id, want) in want.iter().enumerate() {
            let (tokens, logits) = &got[&(id as u64)];
            assert_eq!(tokens, &want.0, "request {id}'s tokens, depth {depth}");
            assert!(logits == &want.1, "request {id}'s logits, depth {depth}");
        }
        let after = engine.step_timing().drafts;
        let (drafted, accepted) = (
            after.drafted - before.drafted,
            after.accepted - before.accepted,
        );
        assert!(
            accepted > 0 && (depth == 1 || accepted < drafted),
            "depth {depth}: {accepted} of {drafted} drafted tokens accepted"
        );
    }
}

#[test]
fn a_request_that_opts_out_is_never_drafted_for() {
    let mut engine = load(&golden("qwen3-f32"), 2);
    let vocab = engine.config().vocab_size;
    let mut requests = requests(vocab);
    requests.truncate(2);
    for r in &mut requests {
        r.params.draft = false;
    }
    let never = vec![(vec![0; 256], Vec::new()); requests.len()];
    let source = Misleading::new(&requests, &never, vocab);
    engine.set_draft_source(Box::new(source), 4, 1);
    batched(&mut engine, &requests);
    assert_eq!(engine.step_timing().drafts.drafted, 0);
}

#[test]
fn a_request_cancelled_while_drafting_leaves_the_others_and_the_pool_whole() {
    let mut engine = load(&golden("qwen3-f32"), 2);
    let vocab = engine.config().vocab_size;
    let mut requests = requests(vocab);
    requests.truncate(3);
    let want: Vec<Reply> = requests.iter().map(|r| alone(&mut engine, r)).collect();
    let source = Misleading::new(&requests, &want, vocab);
    engine.set_draft_source(Box::new(source), 4, 1);
    for (id, r) in requests.iter().enumerate() {
        engine.submit(id as u64, &r.prompt, r.params, None).unwrap();
    }
    let mut replies: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut finished = Vec::new();
    loop {
        let mut cancel = false;
        let more = engine
            .step_batch(&mut |id, event| match event {
                BatchEvent::Token { token, .. } => {
                    let reply = replies.entry(id).or_default();
                    reply.push(token);
                    cancel |= id == 0 && reply.len() >= 3;
                }
                BatchEvent::Finished(_) => finished.push(id),
                BatchEvent::Failed(e) => panic!("request {id} failed: {e}"),
                BatchEvent::Prompt { .. } => {}
            })
            .unwrap();
        if cancel && engine.cancel(0) {
            // Drafts were in flight for it: they are gone with it.
            assert!(engine.step_timing().drafts.drafted > 0);
        }
        if !more {
            break;
        }
    }
    assert!(!finished.contains(&0), "the cancelled request finished");
    assert_eq!(engine.pending_requests(), 0);
    for id in 1..3u64 {
        assert_eq!(replies[&id], want[id as usize].0, "request {id}");
    }
    // The pool took every block back: the same requests run again, whole and equal.
    let got = batched(&mut engine, &requests);
    for (id, want) in want.iter().enumerate() {
        assert_eq!(got[&(id as u64)].0, want.0, "request {id} after the cancel");
    }
}

#[test]
fn a_request_ending_on_its_first_token_leaves_its_whole_prompt_to_the_cache() {
    let options = on_test_device(EngineOptions {
        threads: Some(2),
        context: Some(256),
        parallel: Some(2),
        prefill_chunk: Some(64),
        prompt_cache: ember_engine::prompt_cache::CacheBudget::Gib(0.01),
        draft: DraftOptions {
            kind: DraftKind::Ngram,
            max: 8,
            min: 1,
        },
        ..EngineOptions::default()
    });
    let mut engine = Engine::load(&golden("qwen3-f32"), &options).unwrap();
    let params = GenerateParams {
        max_tokens: 1,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        step_logits: false,
        cache_prompt: true,
        draft: true,
    };
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
    let mut cached = Vec::new();
    for id in 0..2 {
        engine.submit(id, &prompt, params, None).unwrap();
        while engine
            .step_batch(&mut |_, event| {
                if let BatchEvent::Prompt { cached_tokens } = event {
                    cached.push(cached_tokens);
                }
            })
            .unwrap()
        {}
    }
    // The second time, every whole block but the last token's came from the cache.
    assert_eq!(cached, vec![0, 32]);
}

/// An engine of two sequences drafting with the model at `draft`, up to 6 tokens a pass, on
/// the device under test (the draft beside the target).
fn load_with_draft_model(path: &Path, draft: &Path) -> Result<Engine, ember_engine::Error> {
    let options = on_test_device(EngineOptions {
        threads: Some(2),
        context: Some(256),
        parallel: Some(2),
        prefill_chunk: Some(64),
        draft: DraftOptions {
            kind: DraftKind::Model,
            max: 6,
            min: 1,
        },
        draft_model: Some(draft.to_path_buf()),
        ..EngineOptions::default()
    });
    Engine::load(path, &options)
}

#[test]
fn a_draft_model_never_changes_the_output() {
    let target = golden("qwen3-f32");
    let mut reference = load(&target, 2);
    let vocab = reference.config().vocab_size;
    let requests = requests(vocab);
    let want: Vec<Reply> = requests.iter().map(|r| alone(&mut reference, r)).collect();
    // The target itself (its greedy picks are the target's own: every greedy draft stands),
    // its bf16 twin, and a model of the same vocabulary and other weights (few stand).
    for draft in ["qwen3-f32", "qwen3-bf16", "qwen3moe-f32"] {
        let mut engine = load_with_draft_model(&target, &golden(draft)).unwrap();
        // Three runs: a draft pool that kept ended sequences' blocks would run dry.
        for run in 0..3 {
            let before = engine.step_timing().drafts;
            let got = batched(&mut engine, &requests);
            for (id, want) in want.iter().enumerate() {
                let (tokens, logits) = &got[&(id as u64)];
                assert_eq!(tokens, &want.0, "draft {draft}, run {run}: request {id}");
                assert!(
                    logits == &want.1,
                    "draft {draft}, run {run}: request {id}'s logits"
                );
            }
            let after = engine.step_timing().drafts;
            assert!(
                after.drafted > before.drafted,
                "draft {draft}, run {run}: nothing drafted"
            );
        }
    }
}

#[test]
fn a_target_drafting_for_itself_has_every_greedy_draft_accepted() {
    let target = golden("qwen3-f32");
    let mut engine = load_with_draft_model(&target, &target).unwrap();
    let vocab = engine.config().vocab_size;
    // The greedy requests that run to their length (0, 2, 4): nothing cuts a draft short.
    let requests: Vec<Request> = requests(vocab).into_iter().step_by(2).collect();
    batched(&mut engine, &requests);
    let drafts = engine.step_timing().drafts;
    assert!(drafts.drafted > 0);
    if replies::device() == Device::Cpu {
        assert_eq!(drafts.accepted, drafts.drafted);
    } else {
        // On CUDA the draft takes the fastest products, the target the batch-invariant ones:
        // the same model to within rounding, so a near tie may go the other way.
        assert!(
            drafts.accepted * 10 >= drafts.drafted * 9,
            "{} of {} accepted",
            drafts.accepted,
            drafts.drafted
        );
    }
}

#[test]
fn a_draft_model_must_share_the_vocabulary_and_be_named() {
    let target = golden("qwen3-f32");
    // llama's fixture tokenizer has as many tokens as qwen3's, other ones.
    let message = load_error(load_with_draft_model(&target, &golden("llama-f32")));
    assert!(
        message.contains("--draft-model") && message.contains("token 303 is"),
        "{message}"
    );
    let e = load_error(load_with_draft_model(&target, Path::new("/no/such/draft")));
    assert!(e.contains("/no/such/draft"), "{e}");
    // `--draft model` with no model; a model with another kind.
    let mut options = EngineOptions {
        threads: Some(1),
        context: Some(64),
        draft: DraftOptions {
            kind: DraftKind::Model,
            max: 4,
            min: 1,
        },
        ..EngineOptions::default()
    };
    let e = load_error(Engine::load(&target, &options));
    assert!(e.contains("--draft-model"), "{e}");
    options.draft.kind = DraftKind::Ngram;
    options.draft_model = Some(target.clone());
    let e = load_error(Engine::load(&target, &options));
    assert!(e.contains("--draft ngram"), "{e}");
}

fn load_error(loaded: Result<Engine, ember_engine::Error>) -> String {
    match loaded {
        Ok(_) => panic!("the engine loaded"),
        Err(e) => e.to_string(),
    }
}
