//! Greedy output is the same bits however a sequence is computed: one prefill, prefill in
//! chunks, token by token, or on a different number of threads. This is what later lets
//! cached prefixes and batched requests reproduce a cold, lone run exactly.

use std::ops::ControlFlow;
use std::path::PathBuf;

use ember_engine::{Engine, EngineOptions};

fn load(name: &str, threads: usize, max_batch: usize) -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name);
    Engine::load(
        &dir,
        &EngineOptions {
            threads: Some(threads),
            context: Some(128),
            prefill_chunk: Some(max_batch),
            kv_dtype: None,
            ..EngineOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn prefill_chunks_tokens_and_threads_give_identical_logits() {
    for name in ["qwen3moe-f32", "llama-bf16", "qwen2-f32"] {
        let mut whole = load(name, 2, 64);
        let prompt = whole
            .encode_prompt("Reproducible means the same bits, every time.")
            .unwrap();
        let reference = whole.prefill(&prompt).unwrap().to_vec();

        let mut chunked = load(name, 2, 5);
        assert_eq!(
            chunked.prefill(&prompt).unwrap(),
            &reference[..],
            "{name}: chunked prefill"
        );

        let mut stepped = load(name, 2, 64);
        let mut last = Vec::new();
        for &token in &prompt {
            last = stepped.step(token).unwrap().to_vec();
        }
        assert_eq!(last, reference, "{name}: token by token");

        let mut single_thread = load(name, 1, 64);
        assert_eq!(
            single_thread.prefill(&prompt).unwrap(),
            &reference[..],
            "{name}: one thread"
        );

        let mut three_threads = load(name, 3, 64);
        assert_eq!(
            three_threads.prefill(&prompt).unwrap(),
            &reference[..],
            "{name}: three threads"
        );
    }
}

/// The prompt chunk defaults to the CPU's 512 and never exceeds the context (a chunk longer
/// than the cache would only hold idle activation rows); a chunk of the whole context gives
/// the same bits as any other.
#[test]
fn prefill_chunk_defaults_and_is_clamped_to_the_context() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/qwen2-f32");
    let load = |context, prefill_chunk| {
        Engine::load(
            &dir,
            &EngineOptions {
                threads: Some(1),
                context: Some(context),
                prefill_chunk,
                ..EngineOptions::default()
            },
        )
        .unwrap()
    };
    assert_eq!(
        load(4096, None).prefill_chunk(),
        ember_engine::DEFAULT_PREFILL_CHUNK_CPU
    );
    let mut clamped = load(128, Some(100_000));
    assert_eq!(clamped.prefill_chunk(), 128);
    assert_eq!(load(128, Some(0)).prefill_chunk(), 1);
    let prompt = clamped.encode_prompt("Clamped, not different.").unwrap();
    let whole = clamped.prefill(&prompt).unwrap().to_vec();
    assert_eq!(load(128, Some(3)).prefill(&prompt).unwrap(), &whole[..]);
}

/// A greedy pick made where the logits are (`prefill_greedy`, `step_greedy`: on a GPU the
/// logits never leave it) is the host's pick of the same logits, for whole and chunked
/// prompts alike (a prompt of exactly one chunk, and one a token longer).
#[test]
fn greedy_picks_in_place_equal_the_hosts_pick() {
    let argmax = ember_tensor::cpu::argmax;
    let name = "qwen3moe-f32";
    let mut engine = load(name, 2, 64);
    let prompt = engine
        .encode_prompt("Reproducible means the same bits, every time.")
        .unwrap();
    for chunk in [64, 5, prompt.len(), prompt.len() - 1] {
        let mut host = load(name, 2, chunk);
        let mut in_place = load(name, 2, chunk);
        let mut token = argmax(host.prefill(&prompt).unwrap());
        assert_eq!(
            in_place.prefill_greedy(&prompt).unwrap(),
            token,
            "{name}: prompt in chunks of {chunk}"
        );
        for step in 0..6 {
            let next = argmax(host.step(token).unwrap());
            assert_eq!(
                in_place.step_greedy(token).unwrap(),
                next,
                "{name}: step {step}, chunks of {chunk}"
            );
            token = next;
        }
        assert_eq!(in_place.position(), host.position());
    }
    assert!(engine.prefill_greedy(&[]).is_err(), "an empty prompt");
}

/// Greedy decode running a step ahead of the host (`decode_greedy`: each step enqueued, fed
/// by the pick before it, before that pick is read) gives the tokens of `step_greedy` one by
/// one; stopped early, by the caller or by its limit, the step run ahead is dropped with its
/// position, so the sequence goes on as if it had never run.
#[test]
fn decoding_ahead_gives_the_tokens_of_step_by_step_decode() {
    let name = "qwen3-f32";
    let mut engine = load(name, 2, 64);
    let prompt = engine
        .encode_prompt("One step ahead, same tokens.")
        .unwrap();
    let mut want = vec![engine.prefill_greedy(&prompt).unwrap()];
    for _ in 0..7 {
        want.push(engine.step_greedy(*want.last().unwrap()).unwrap());
    }
    for chunk in [64, 5] {
        let mut ahead = load(name, 2, chunk);
        let mut got = Vec::new();
        ahead
            .decode_greedy(&prompt, want.len(), |t| {
                got.push(t);
                ControlFlow::Continue(())
            })
            .unwrap();
        assert_eq!(got, want, "{name}: prompt in chunks of {chunk}");
        // The limit's last token is not fed: nothing ran ahead of it.
        assert_eq!(ahead.position(), prompt.len() + want.len() - 1);
    }
    for stop_after in [1, 3] {
        let mut ahead = load(name, 2, 64);
        let mut got = Vec::new();
        ahead
            .decode_greedy(&prompt, want.len(), |t| {
                got.push(t);
                if got.len() == stop_after {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .unwrap();
        assert_eq!(
            got,
            want[..stop_after],
            "{name}: stopped after {stop_after}"
        );
        assert_eq!(ahead.position(), prompt.len() + stop_after - 1);
        // The step run ahead for the last token left nothing behind.
        assert_eq!(
            ahead.step_greedy(got[stop_after - 1]).unwrap(),
            want[stop_after],
            "{name}: the step after stopping at {stop_after}"
        );
    }
    let mut none = Vec::new();
    engine.reset();
    engine
        .decode_greedy(&prompt, 0, |t| {
            none.push(t);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert!(
        none.is_empty() && engine.position() == 0,
        "a limit of 0 runs nothing"
    );
}
