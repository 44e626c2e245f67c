//! The same request sent two ways must get the same reply: with speculative decoding and
//! without (`drafts`), alone and among others (`concurrent`), streamed and not (`streaming`),
//! resumed from the prompt cache and computed cold (`multiturn`).

use serde_json::json;

use super::client::{Request, difference, send_all_at_once};
use super::prompts::{self, MULTITURN, SAMPLED_PROMPT, SAMPLED_TEMPERATURE, SEED, TOPICS};
use super::{Suite, Tally};

/// Each greedy prompt, and one seeded sampled one, sent normally and with `"draft": false`
/// (ember's per-request switch for speculative decoding; other servers ignore the field).
pub fn drafts(suite: &Suite) -> Tally {
    let mut requests: Vec<(String, Request)> = prompts::draft_prompts()
        .into_iter()
        .map(|(label, prompt)| (label.to_owned(), Request::ask(&prompt, suite.max_tokens)))
        .collect();
    requests.push((
        format!("sampled (temperature {SAMPLED_TEMPERATURE}, seed {SEED})"),
        Request::ask(SAMPLED_PROMPT, suite.max_tokens)
            .with("temperature", json!(SAMPLED_TEMPERATURE))
            .with("seed", json!(SEED)),
    ));
    let mut tally = Tally::default();
    for (label, request) in requests {
        tally.check(&label, || {
            let drafted = suite.client.send(&request)?;
            let plain = suite
                .client
                .send(&request.clone().with("draft", json!(false)))?;
            Ok(difference(("default", &drafted), ("draft false", &plain)))
        });
    }
    tally
}

/// Distinct requests (chat and text completions, streamed and not) sent alone one after
/// another, then all at once: each reply must be what it was alone.
pub fn concurrent(suite: &Suite) -> Tally {
    let requests: Vec<Request> = TOPICS
        .iter()
        .enumerate()
        .map(|(i, topic)| {
            if i.is_multiple_of(2) {
                Request::ask(
                    &format!("Write two sentences about {topic}."),
                    suite.max_tokens,
                )
            } else {
                Request::complete(&format!("Two facts about {topic}:"), suite.max_tokens)
            }
        })
        .collect();
    // Every third streams, in both rounds, so streamed and unary requests share batches.
    let streamed = |i: usize| i.is_multiple_of(3);
    let alone: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| suite.client.send_as(r, streamed(i)))
        .collect();
    let together = send_all_at_once(&suite.client, &requests, streamed);
    let mut tally = Tally::default();
    for (i, (alone, together)) in alone.into_iter().zip(together).enumerate() {
        let outcome = alone.and_then(|a| Ok(difference(("alone", &a), ("concurrent", &together?))));
        tally.record(&format!("request {i} ({})", TOPICS[i]), outcome);
    }
    tally
}

/// Streamed text (joined deltas) against the unary reply, on both endpoints.
pub fn streaming(suite: &Suite) -> Tally {
    let n = suite.max_tokens;
    let requests = [
        ("chat, story", Request::ask(prompts::STORY_PROMPT, n)),
        ("chat, code", Request::ask(prompts::CODE_PROMPT, n)),
        (
            "completions, story",
            Request::complete(prompts::LONG_STREAM_PROMPT, n),
        ),
        (
            "completions, code",
            Request::complete("def quicksort(items):", n),
        ),
    ];
    let mut tally = Tally::default();
    for (label, request) in requests {
        tally.check(label, || {
            let unary = suite.client.send(&request)?;
            let streamed = suite.client.send_streamed(&request)?;
            Ok(difference(("unary", &unary), ("streamed", &streamed)))
        });
    }
    tally
}

/// A chat of three turns, each the history and a new message: the reply sent normally (which
/// may resume from the prompt cache the previous turn left) must be the reply computed with
/// `"cache_prompt": false`.
pub fn multiturn(suite: &Suite) -> Tally {
    let mut tally = Tally::default();
    let mut messages = Vec::new();
    for (turn, message) in MULTITURN.iter().enumerate() {
        messages.push(json!({"role": "user", "content": message}));
        let request = Request::chat(json!(messages), suite.max_tokens);
        let outcome = (|| -> anyhow::Result<_> {
            let resumed = suite.client.send(&request)?;
            let cold = suite
                .client
                .send(&request.clone().with("cache_prompt", json!(false)))?;
            let why = difference(("cached", &resumed), ("cache_prompt false", &cold));
            messages.push(json!({"role": "assistant", "content": resumed.content}));
            Ok(why)
        })();
        let stop = outcome.is_err();
        tally.record(&format!("turn {}", turn + 1), outcome);
        if stop {
            // Without the reply there is no next turn to ask.
            break;
        }
    }
    tally
}
