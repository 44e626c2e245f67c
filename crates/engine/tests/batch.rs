//! The batched loop (`Engine::submit` / `Engine::step_batch`) gives every request the tokens,
//! and the logits bit for bit, that the same request gets alone (`Engine::generate` on an
//! engine of one sequence and no prompt cache): many at once, prompts in chunks beside other
//! requests' decode tokens, greedy and seeded, with and without a prompt cache, and with a
//! request cancelled midway.
//!
//! `EMBER_TEST_DEVICE=cuda` runs them on the GPU with `--batch-invariant`'s kernels.

#[path = "common/replies.rs"]
mod replies;

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::Path;

use ember_engine::prompt_cache::CacheBudget;
use ember_engine::sampler::SamplingParams;
use ember_engine::{BatchEvent, Engine, EngineOptions, FinishReason, GenerateParams};
use replies::{Draws, Reply, Request, alone, bits, golden, on_test_device};

fn load(path: &Path, parallel: usize, chunk: usize, cache: CacheBudget) -> Engine {
    load_with(path, parallel, chunk, cache, None, 1)
}

/// [`load`] with a KV pool of `pool_tokens` positions for the running requests, the model
/// split across `ranks` (`--tensor-parallel`).
fn load_with(
    path: &Path,
    parallel: usize,
    chunk: usize,
    cache: CacheBudget,
    pool_tokens: Option<usize>,
    ranks: usize,
) -> Engine {
    let options = on_test_device(EngineOptions {
        tensor_parallel: ranks,
        threads: Some(2),
        context: Some(256),
        parallel: Some(parallel),
        kv_pool_tokens: pool_tokens,
        prefill_chunk: Some(chunk),
        prompt_cache: cache,
        ..EngineOptions::default()
    });
    Engine::load(path, &options).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Requests of several lengths, greedy and seeded, three of them sharing a 40-token history
/// (so a prompt cache has something to give).
fn requests(vocab: usize) -> Vec<Request> {
    let mut draws = Draws(0x9E37_79B9_7F4A_7C15u64);
    let mut next = |n: usize| draws.below(n);
    let history: Vec<u32> = (0..40).map(|_| next(vocab) as u32).collect();
    (0..8)
        .map(|i| {
            let mut prompt = if i % 3 == 0 {
                history.clone()
            } else {
                Vec::new()
            };
            let own = 1 + next(30);
            prompt.extend((0..own).map(|_| next(vocab) as u32));
            let sampling = if i % 2 == 0 {
                SamplingParams::default()
            } else {
                SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    seed: Some(100 + i as u64),
                    ..SamplingParams::default()
                }
            };
            Request {
                prompt,
                params: GenerateParams {
                    max_tokens: 3 + next(10),
                    sampling,
                    ignore_eos: true,
                    step_logits: true,
                    cache_prompt: true,
                    draft: true,
                },
            }
        })
        .collect()
}

/// Runs `requests` through the batched loop, all submitted at once, and `cancel` after its
/// second token; returns each finished request's reply and how many prompt tokens it found
/// cached, and the most requests one step advanced.
fn batched(
    engine: &mut Engine,
    requests: &[Request],
    cancel: Option<u64>,
) -> (HashMap<u64, (Reply, usize)>, usize) {
    for (id, r) in requests.iter().enumerate() {
        engine.submit(id as u64, &r.prompt, r.params, None).unwrap();
    }
    let mut replies: HashMap<u64, Reply> = HashMap::new();
    let mut cached = HashMap::new();
    let mut finished = HashMap::new();
    let mut widest = 0;
    loop {
        let mut stepped = std::collections::HashSet::new();
        let mut to_cancel = None;
        let more = engine
            .step_batch(&mut |id, event| match event {
                BatchEvent::Prompt { cached_tokens } => {
                    assert!(
                        cached.insert(id, cached_tokens).is_none(),
                        "two Prompt events"
                    );
                }
                BatchEvent::Token { token, logits, .. } => {
                    stepped.insert(id);
                    let reply = replies.entry(id).or_default();
                    reply.0.push(token);
                    reply
                        .1
                        .push(bits(logits.expect("the requests ask for step logits")));
                    if Some(id) == cancel && reply.0.len() == 2 {
                        to_cancel = Some(id);
                    }
                }
                BatchEvent::Finished(generation) => {
                    assert_eq!(generation.finish_reason, FinishReason::Length);
                    assert_eq!(generation.tokens, replies[&id].0);
                    finished.insert(id, ());
                }
                BatchEvent::Failed(e) => panic!("request {id} failed: {e}"),
            })
            .unwrap();
        widest = widest.max(stepped.len());
        if let Some(id) = to_cancel {
            assert!(engine.cancel(id));
        }
        if !more {
            break;
        }
    }
    assert_eq!(engine.pending_requests(), 0);
    let out = replies
        .into_iter()
        .filter(|(id, _)| finished.contains_key(id))
        .map(|(id, reply)| (id, (reply, cached[&id])))
        .collect();
    (out, widest)
}

fn check(name: &str) {
    check_split(name, 1);
}

/// [`check`] of the model split across `ranks`, against the same split alone.
fn check_split(name: &str, ranks: usize) {
    let path = golden(name);
    let load = |parallel, chunk, cache| load_with(&path, parallel, chunk, cache, None, ranks);
    let mut reference = load(1, 512, CacheBudget::Off);
    let vocab = reference.config().vocab_size;
    let requests = requests(vocab);
    let want: Vec<Reply> = requests.iter().map(|r| alone(&mut reference, r)).collect();

    // Four at a time in passes of 16 tokens: prompts run in chunks beside decode tokens.
    let mut engine = load(4, 16, CacheBudget::Off);
    let (got, widest) = batched(&mut engine, &requests, None);
    assert!(
        widest >= 3,
        "{name}: at most {widest} requests sampled in one step"
    );
    for (id, want) in want.iter().enumerate() {
        let ((tokens, logits), cached) = &got[&(id as u64)];
        assert_eq!(*cached, 0, "{name}: no cache, nothing cached");
        assert_eq!(tokens, &want.0, "{name}: request {id}'s tokens");
        assert!(logits == &want.1, "{name}: request {id}'s logits' bits");
    }

    // With a prompt cache, run twice: the second time each prompt's whole blocks come from
    // the cache, and the replies stay the same bits. One request
    // is cancelled midway; the others do not notice.
    let mut engine = load(3, 16, CacheBudget::Gib(0.01));
    batched(&mut engine, &requests, None);
    let (got, _) = batched(&mut engine, &requests, Some(4));
    assert!(
        !got.contains_key(&4),
        "{name}: the cancelled request finished"
    );
    for (id, want) in want.iter().enumerate().filter(|&(id, _)| id != 4) {
        let ((tokens, logits), cached) = &got[&(id as u64)];
        // Every whole block of the prompt but its last token's ran the first time.
        let whole = (requests[id].prompt.len() - 1) / 16 * 16;
        assert_eq!(*cached, whole, "{name}: request {id}'s cached tokens");
        assert_eq!(
            tokens, &want.0,
            "{name}: request {id}'s tokens, from the cache"
        );
        assert!(
            logits == &want.1,
            "{name}: request {id}'s logits' bits, from the cache"
        );
    }
}

#[test]
fn concurrent_equals_alone_on_every_golden_fixture() {
    for name in [
        "qwen3-f32",
        "qwen2-f32",
        "llama-f32",
        "qwen3moe-f32",
        "qwen3-bf16",
    ] {
        check(name);
    }
}

/// Split two ways (ranks as threads on the CPU, GPUs on CUDA): still the bits of the same
/// split alone.
#[test]
fn split_models_give_concurrent_requests_the_bits_they_get_alone() {
    for name in ["qwen3-f32", "qwen3moe-f32", "llama-bf16"] {
        check_split(name, 2);
    }
}

#[test]
fn bad_requests_are_refused_at_submit_and_the_loop_goes_on() {
    let mut engine = load(&golden("qwen3-f32"), 2, 16, CacheBudget::Off);
    let params = GenerateParams {
        max_tokens: 2,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        step_logits: false,
        cache_prompt: false,
        draft: true,
    };
    assert!(engine.submit(1, &[], params, None).is_err());
    let err = engine.submit(2, &vec![1; 256], params, None).unwrap_err();
    assert!(err.to_string().contains("context"), "{err}");
    let bad = GenerateParams {
        sampling: SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        },
        ..params
    };
    assert!(engine.submit(3, &[1, 2], bad, None).is_err());
    let nothing = GenerateParams {
        max_tokens: 0,
        ..params
    };
    assert!(engine.submit(5, &[1, 2], nothing, None).is_err());
    assert_eq!(engine.pending_requests(), 0);
    engine.submit(4, &[1, 2, 3], params, None).unwrap();
    let mut tokens = 0;
    while engine
        .step_batch(&mut |_, event| {
            if let BatchEvent::Token { .. } = event {
                tokens += 1;
            }
        })
        .unwrap()
    {}
    assert_eq!(tokens, 2);
}

/// A pool smaller than the running requests need: the last admitted is preempted when the
/// others' blocks run out, and resumes later by recomputing its tokens (from the prompt cache
/// where it has one); every reply is still the bits of the same request alone.
#[test]
fn preempted_requests_resume_with_the_bits_they_get_alone() {
    let path = golden("qwen3-f32");
    let mut reference = load(&path, 1, 512, CacheBudget::Off);
    let vocab = reference.config().vocab_size;
    // Four requests of about 60 prompt and 70 new tokens: 520 positions at once, in a pool
    // of 256 (one context).
    let requests: Vec<Request> = (0..4u64)
        .map(|i| {
            let mut state = 0x2545_F491_4F6C_DD1D ^ (i + 1);
            let prompt = (0..55 + 3 * i)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % vocab as u64) as u32
                })
                .collect();
            let sampling = if i % 2 == 0 {
                SamplingParams::default()
            } else {
                SamplingParams {
                    temperature: 0.8,
                    top_k: 20,
                    seed: Some(7 + i),
                    ..SamplingParams::default()
                }
            };
            Request {
                prompt,
                params: GenerateParams {
                    max_tokens: 70,
                    sampling,
                    ignore_eos: true,
                    step_logits: true,
                    cache_prompt: true,
                    draft: true,
                },
            }
        })
        .collect();
    let want: Vec<Reply> = requests.iter().map(|r| alone(&mut reference, r)).collect();
    // A cache of a few blocks: the pool stays short of what the four need at once.
    for cache in [CacheBudget::Off, CacheBudget::Gib(0.0002)] {
        let mut engine = load_with(&path, 4, 32, cache, Some(256), 1);
        let (got, widest) = batched(&mut engine, &requests, None);
        let preemptions = engine.step_timing().preemptions;
        assert!(
            preemptions > 0,
            "{cache:?}: the pool never ran out ({widest} at once)"
        );
        for (id, want) in want.iter().enumerate() {
            let ((tokens, logits), _) = &got[&(id as u64)];
            assert_eq!(tokens, &want.0, "{cache:?}: request {id}'s tokens");
            assert!(
                logits == &want.1,
                "{cache:?}: request {id}'s logits' bits after {preemptions} preemptions"
            );
        }
        assert_eq!(engine.sequences(), (0, 0));
    }
}

/// 64 streams at once, arriving at random steps, of prompts from 1 to 200 tokens and replies
/// from 1 to 24, greedy and seeded: each reply the bits of the same request alone.
#[test]
fn sixty_four_streams_joining_and_leaving_each_get_their_bits_alone() {
    let path = golden("qwen3-bf16");
    let mut reference = load(&path, 1, 512, CacheBudget::Off);
    let vocab = reference.config().vocab_size as u64;
    let mut state = 0x5DEE_CE66_D1CE_4E5Bu64;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let requests: Vec<(u64, Request)> = (0..64u64)
        .map(|i| {
            let len = if i % 8 == 0 { 1 } else { 1 + next(200) };
            let prompt = (0..len).map(|_| next(vocab) as u32).collect();
            let sampling = if i % 3 == 0 {
                SamplingParams {
                    temperature: 1.1,
                    top_p: 0.9,
                    seed: Some(i),
                    ..SamplingParams::default()
                }
            } else {
                SamplingParams::default()
            };
            let arrival = next(40);
            let params = GenerateParams {
                max_tokens: 1 + next(24) as usize,
                sampling,
                ignore_eos: true,
                step_logits: i % 2 == 0,
                cache_prompt: false,
                draft: true,
            };
            (arrival, Request { prompt, params })
        })
        .collect();
    // Each reply's tokens, and the bits of its logits where it asks for them.
    let want: Vec<Reply> = requests
        .iter()
        .map(|(_, r)| {
            let mut logits = Vec::new();
            let generation = reference
                .generate(&r.prompt, &r.params, |step| {
                    logits.extend(step.logits.map(bits));
                    ControlFlow::Continue(())
                })
                .unwrap();
            (generation.tokens, logits)
        })
        .collect();

    let mut engine = load(&path, 64, 128, CacheBudget::Off);
    let mut got: HashMap<u64, Reply> = HashMap::new();
    let mut finished = 0;
    let mut widest = 0;
    let mut step = 0u64;
    while finished < requests.len() {
        for (id, (arrival, r)) in requests.iter().enumerate() {
            if *arrival == step {
                engine.submit(id as u64, &r.prompt, r.params, None).unwrap();
            }
        }
        let mut sampled = 0;
        engine
            .step_batch(&mut |id, event| match event {
                BatchEvent::Token { token, logits, .. } => {
                    sampled += 1;
                    let reply = got.entry(id).or_default();
                    reply.0.push(token);
                    reply.1.extend(logits.map(bits));
                }
                BatchEvent::Finished(_) => finished += 1,
                BatchEvent::Failed(e) => panic!("request {id} failed: {e}"),
                BatchEvent::Prompt { .. } => {}
            })
            .unwrap();
        widest = widest.max(sampled);
        step += 1;
        assert!(step < 10_000, "the loop does not finish");
    }
    assert!(
        widest >= 16,
        "at most {widest} requests sampled in one step"
    );
    for (id, want) in want.iter().enumerate() {
        let got = &got[&(id as u64)];
        assert_eq!(got.0, want.0, "request {id}'s tokens");
        assert!(got.1 == want.1, "request {id}'s logits' bits");
        // Logits come with a token where the request asks for them or samples from them.
        let p = &requests[id].1.params;
        assert_eq!(got.1.is_empty(), p.sampling.is_greedy() && !p.step_logits);
    }
}
