//! A deliberately wrong OpenAI-compatible server, for proving that `bench quality` fails what
//! it should. Its reply is a fixed function of the prompt (so sending a request twice, with or
//! without `draft` or `cache_prompt`, gets the same reply) except that it:
//! - streams a different last word than it answers unary,
//! - ignores `max_tokens` and `stop` (every reply is [`REPLY_WORDS`] tokens, "length"),
//! - answers differently while another request is in flight.

use std::hash::{Hash, Hasher};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

/// Words in every reply, one token each by the stub's count.
const REPLY_WORDS: usize = 12;

/// Each request lasts this long, so requests sent together overlap.
const REQUEST_TIME: Duration = Duration::from_millis(20);

const WORDS: &[&str] = &[
    "river", "stone", "light", "cloud", "maple", "north", "quiet", "amber", "field", "glass",
    "orbit", "delta", "frost", "cedar", "coral", "ember",
];

/// Serves on a free loopback port until the test process ends; returns `http://127.0.0.1:PORT`.
pub fn start() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding the stub's port");
    let addr = listener.local_addr().expect("the stub's address");
    let in_flight = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let in_flight = Arc::clone(&in_flight);
            std::thread::spawn(move || {
                // A client that leaves mid-answer is no concern of the stub's.
                let _ = serve(stream, &in_flight);
            });
        }
    });
    format!("http://{addr}")
}

/// Answers one request on `stream` (the client sends `Connection: close`).
fn serve(stream: TcpStream, in_flight: &AtomicUsize) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    let mut out = stream;
    match path {
        "/health" => respond(&mut out, 200, &json!({"status": "ok"})),
        "/v1/models" => respond(&mut out, 200, &json!({"data": [{"id": "stub"}]})),
        "/v1/chat/completions" | "/v1/completions" => {
            let request: Value = serde_json::from_slice(&body).unwrap_or_default();
            let chat = path == "/v1/chat/completions";
            in_flight.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(REQUEST_TIME);
            let crowded = in_flight.load(Ordering::SeqCst) > 1;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            let mut words = reply_words(&request, chat);
            if crowded {
                words[0] = "crowded";
            }
            if request["stream"] == true {
                *words.last_mut().unwrap() = "streamed";
                stream_reply(&mut out, &words, chat)
            } else {
                let text = words.join(" ");
                let choice = if chat {
                    json!({"message": {"role": "assistant", "content": text}})
                } else {
                    json!({"text": text})
                };
                respond(
                    &mut out,
                    200,
                    &json!({
                        "choices": [with_finish(choice)],
                        "usage": {"completion_tokens": REPLY_WORDS},
                    }),
                )
            }
        }
        _ => respond(&mut out, 404, &json!({"error": {"message": "not found"}})),
    }
}

/// The reply's words: a function of the prompt (or the messages) only.
fn reply_words(request: &Value, chat: bool) -> Vec<&'static str> {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let prompt = if chat {
        request["messages"].to_string()
    } else {
        request["prompt"].to_string()
    };
    prompt.hash(&mut hasher);
    let mut state = hasher.finish() | 1;
    (0..REPLY_WORDS)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            WORDS[(state % WORDS.len() as u64) as usize]
        })
        .collect()
}

fn with_finish(mut choice: Value) -> Value {
    choice["index"] = json!(0);
    choice["finish_reason"] = json!("length");
    choice
}

fn respond(out: &mut TcpStream, status: u16, body: &Value) -> std::io::Result<()> {
    let body = body.to_string();
    write!(
        out,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Server-sent events, a word each, read until the connection closes.
fn stream_reply(out: &mut TcpStream, words: &[&str], chat: bool) -> std::io::Result<()> {
    write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    )?;
    for (i, word) in words.iter().enumerate() {
        let piece = if i == 0 {
            word.to_string()
        } else {
            format!(" {word}")
        };
        let mut choice = if chat {
            json!({"index": 0, "delta": {"content": piece}, "finish_reason": null})
        } else {
            json!({"index": 0, "text": piece, "finish_reason": null})
        };
        if i + 1 == words.len() {
            choice = with_finish(choice);
        }
        write!(out, "data: {}\n\n", json!({"choices": [choice]}))?;
    }
    let usage = json!({"choices": [], "usage": {"completion_tokens": REPLY_WORDS}});
    write!(out, "data: {usage}\n\ndata: [DONE]\n\n")
}
