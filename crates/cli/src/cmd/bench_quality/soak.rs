//! `soak`: a server under a long mixed load still gives every request the reply it gives alone.
//! Chats of many turns run at once (their histories growing, so prompt-cache blocks are taken,
//! extended and evicted while others decode) beside a long decoding stream sent again and again
//! until the chats end; afterwards each turn's request, and the stream, are sent alone.

use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;

use super::client::{Reply, Request, difference};
use super::prompts::{LONG_STREAM_PROMPT, SOAK_QUESTIONS};
use super::{Suite, Tally};

const CHATS: usize = 3;

/// Tokens of the stream decoding beside the chats.
const STREAM_TOKENS: usize = 256;

pub fn soak(suite: &Suite) -> Tally {
    let stream = Request::complete(LONG_STREAM_PROMPT, STREAM_TOKENS);
    let chats_done = AtomicUsize::new(0);
    let (chats, streams) = std::thread::scope(|s| {
        let chats: Vec<_> = (0..CHATS)
            .map(|chat| {
                let chats_done = &chats_done;
                s.spawn(move || {
                    let turns = run_chat(suite, chat);
                    chats_done.fetch_add(1, Ordering::Relaxed);
                    turns
                })
            })
            .collect();
        let streams = s.spawn(|| {
            let mut replies = Vec::new();
            loop {
                replies.push(suite.client.send_streamed(&stream));
                if chats_done.load(Ordering::Relaxed) == CHATS {
                    break replies;
                }
            }
        });
        let chats: Vec<Vec<Turn>> = chats
            .into_iter()
            .map(|h| h.join().expect("a soak chat panicked"))
            .collect();
        (chats, streams.join().expect("the soak stream panicked"))
    });

    let mut tally = Tally::default();
    for (chat, turns) in chats.into_iter().enumerate() {
        for (turn, Turn { request, reply }) in turns.into_iter().enumerate() {
            tally.check(&format!("chat {} turn {}", chat + 1, turn + 1), || {
                let under_load = reply?;
                let alone = suite.client.send_as(&request, streamed(chat))?;
                Ok(difference(("alone", &alone), ("under load", &under_load)))
            });
        }
    }
    let alone = suite.client.send_streamed(&stream);
    for (i, under_load) in streams.into_iter().enumerate() {
        tally.check(&format!("long stream {}", i + 1), || {
            let alone = alone.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            Ok(difference(("alone", alone), ("under load", &under_load?)))
        });
    }
    tally
}

/// One turn of a chat under load: what was asked and what came back.
struct Turn {
    request: Request,
    reply: anyhow::Result<Reply>,
}

/// The middle chat streams, so streamed and unary replies share the batches.
fn streamed(chat: usize) -> bool {
    chat % 2 == 1
}

/// Chat `chat`'s turns, each the history so far and a new question; it ends early at a
/// request that fails (there is no reply to build the next turn on).
fn run_chat(suite: &Suite, chat: usize) -> Vec<Turn> {
    let mut messages = Vec::new();
    let mut turns = Vec::new();
    for turn in 0..suite.soak_turns {
        let question = SOAK_QUESTIONS[(turn + chat) % SOAK_QUESTIONS.len()];
        let content = format!("(chat {}, turn {}) {question}", chat + 1, turn + 1);
        messages.push(json!({"role": "user", "content": content}));
        let request = Request::chat(json!(messages), suite.max_tokens);
        let reply = suite.client.send_as(&request, streamed(chat));
        let failed = match &reply {
            Ok(reply) => {
                messages.push(json!({"role": "assistant", "content": reply.content}));
                false
            }
            Err(_) => true,
        };
        turns.push(Turn { request, reply });
        if failed {
            break;
        }
    }
    turns
}
