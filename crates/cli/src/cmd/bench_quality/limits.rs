//! Limits a reply must keep exactly: a stop string cuts it right before its first occurrence
//! (`stop`), and `max_tokens` is the reply's length to the token (`max-tokens`).

use serde_json::json;

use super::client::{Reply, Request, difference};
use super::prompts::{LONG_ANSWER_PROMPT, LONG_STREAM_PROMPT, STORY_PROMPT};
use super::{Suite, Tally};

/// The lengths `max-tokens` asks for.
const MAX_TOKENS: [usize; 3] = [1, 7, 32];

/// Chars in a stop string (fewer where the reply ends sooner or a non-printable char comes).
const STOP_CHARS: usize = 6;

/// Per endpoint: an unconstrained greedy reply, then the same request with a stop string taken
/// from that reply, streamed and not: the reply must be the unconstrained one cut right before
/// the stop string's first occurrence, finished by "stop".
pub fn stop(suite: &Suite) -> Tally {
    let requests = [
        // Thinking off, so a reasoning model's stop string is looked for in its answer only.
        Request::ask(STORY_PROMPT, suite.max_tokens)
            .with("chat_template_kwargs", json!({"enable_thinking": false})),
        Request::complete(LONG_STREAM_PROMPT, suite.max_tokens),
    ];
    let mut tally = Tally::default();
    for request in requests {
        let endpoint = request.endpoint.name();
        let free = match suite.client.send(&request) {
            Ok(reply) => reply,
            Err(e) => {
                tally.record(&format!("{endpoint}, unconstrained"), Err(e));
                continue;
            }
        };
        let stops = stop_strings(&free.content, &free.reasoning);
        if stops.is_empty() {
            let why = format!(
                "no stop string to take from the unconstrained reply {:?}",
                free.content
            );
            tally.record(endpoint, Ok(Some(why)));
        }
        for (kind, stop) in stops {
            let cut = free.content.find(&stop).expect("taken from the reply");
            let expected = Reply {
                content: free.content[..cut].to_owned(),
                finish_reason: Some("stop".into()),
                ..free.clone()
            };
            let request = request.clone().with("stop", json!([stop]));
            for streamed in [false, true] {
                let how = if streamed { "streamed" } else { "unary" };
                tally.check(&format!("{endpoint}, {how}, {kind} {stop:?}"), || {
                    let reply = suite.client.send_as(&request, streamed)?;
                    Ok(difference(("expected", &expected), ("with stop", &reply)))
                });
            }
        }
    }
    tally
}

/// Stop strings from the later part of `reply`, none of them in `reasoning`: one starting
/// inside a word ("mid-token": BPE vocabularies seldom split a common word there) and one
/// starting at the space before a word (where such vocabularies start a token). Only printable
/// chars, so the server's text and this one agree on them.
fn stop_strings(reply: &str, reasoning: &str) -> Vec<(&'static str, String)> {
    let chars: Vec<char> = reply.chars().collect();
    let plain = |c: char| !c.is_control() && c != char::REPLACEMENT_CHARACTER;
    // The printable chars from `at`, up to STOP_CHARS of them; at least 2.
    let candidate = |at: usize| {
        let stop: String = chars[at..]
            .iter()
            .take(STOP_CHARS)
            .take_while(|&&c| plain(c))
            .collect();
        (stop.chars().count() >= 2 && !reasoning.contains(&stop)).then_some(stop)
    };
    let later = chars.len() / 3..chars.len();
    let mid_word = later.clone().find_map(|i| {
        (i > 0 && chars[i - 1].is_alphanumeric() && chars[i].is_alphanumeric())
            .then(|| candidate(i))
            .flatten()
    });
    // A reply without words (a small random model's) still gets a stop string.
    let anywhere = || {
        later
            .clone()
            .find_map(|i| (i > 0).then(|| candidate(i)).flatten())
    };
    let mut stops: Vec<(&'static str, String)> = Vec::new();
    stops.extend(
        mid_word
            .map(|stop| ("mid-word", stop))
            .or_else(|| anywhere().map(|stop| ("printable run", stop))),
    );
    let word_start = later.clone().find_map(|i| {
        (chars[i].is_whitespace() && chars.get(i + 1).is_some_and(|c| c.is_alphanumeric()))
            .then(|| candidate(i))
            .flatten()
            .filter(|stop| stops.iter().all(|(_, s)| s != stop))
    });
    stops.extend(word_start.map(|stop| ("word start", stop)));
    stops
}

/// For each of a few lengths, on both endpoints: `max_tokens: N` with `ignore_eos` must give
/// exactly N tokens by the server's own count, finished by "length". A server that refuses
/// `ignore_eos` is asked without it, and then a reply ended early by end-of-sequence passes.
pub fn max_tokens(suite: &Suite) -> Tally {
    let mut tally = Tally::default();
    for n in MAX_TOKENS {
        for request in [
            Request::complete(LONG_ANSWER_PROMPT, n),
            Request::ask(LONG_ANSWER_PROMPT, n),
        ] {
            let label = format!("{}, max_tokens {n}", request.endpoint.name());
            tally.check(&label, || {
                let with_eos_ignored = request.clone().with("ignore_eos", json!(true));
                let (reply, eos_ignored) = match suite.client.send(&with_eos_ignored) {
                    Ok(reply) => (reply, true),
                    Err(e) if format!("{e:#}").contains("ignore_eos") => {
                        (suite.client.send(&request)?, false)
                    }
                    Err(e) => return Err(e),
                };
                Ok(length_problem(&reply, n, eos_ignored))
            });
        }
    }
    tally
}

/// What is wrong with a reply asked for at most `n` tokens, if anything.
fn length_problem(reply: &Reply, n: usize, eos_ignored: bool) -> Option<String> {
    let Some(tokens) = reply.completion_tokens else {
        return Some("the reply has no usage.completion_tokens".into());
    };
    let finish = reply.finish_reason.as_deref();
    let stopped_early = !eos_ignored && finish == Some("stop") && tokens <= n as u64;
    if stopped_early || (tokens == n as u64 && finish == Some("length")) {
        return None;
    }
    Some(format!(
        "completion_tokens {tokens}, finish_reason {}; expected {n} and \"length\"",
        json!(finish)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_start_inside_a_word_and_before_one() {
        let reply = "The keeper walked along the shore every evening";
        let stops = stop_strings(reply, "");
        assert_eq!(stops[0], ("mid-word", "ed alo".to_owned()));
        assert_eq!(stops[1], ("word start", " along".to_owned()));
        for (_, stop) in &stops {
            assert!(reply.find(stop.as_str()).unwrap() >= reply.len() / 3);
        }
        // Not strings the reasoning holds, where a server would stop first.
        let stops = stop_strings(reply, "we walked along");
        assert_eq!(stops[0].1, "long t");
        assert_eq!(stops[1].1, " the s");
        // Junk without words still gets one; too short a reply gets none.
        assert_eq!(stop_strings("\u{1c}#$%&'()*+", "")[0].1, "%&'()*");
        assert!(stop_strings("a", "").is_empty());
        assert!(stop_strings("\u{fffd}\u{fffd}\u{fffd}", "").is_empty());
        // Stop strings end before a char no server would match (a random model's reply).
        let junk = "ked\u{1c}\u{fffd}\u{fffd}He\u{fffd}\u{fffd} f\u{fffd}5\u{fffd}\u{1c}\u{fffd}\u{fffd}\
                    em\u{fffd}em\u{fffd}\u{fffd}\u{fffd} re\u{fffd}";
        let stops = stop_strings(junk, "");
        assert_eq!(stops[0], ("printable run", " f".to_owned()));
        assert_eq!(stops[1], ("word start", " re".to_owned()));
    }

    #[test]
    fn lengths_are_exact_unless_eos_was_allowed() {
        let reply = |tokens, finish: &str| Reply {
            completion_tokens: Some(tokens),
            finish_reason: Some(finish.into()),
            ..Reply::default()
        };
        assert_eq!(length_problem(&reply(7, "length"), 7, true), None);
        assert!(length_problem(&reply(8, "length"), 7, true).is_some());
        assert!(length_problem(&reply(3, "stop"), 7, true).is_some());
        assert_eq!(length_problem(&reply(3, "stop"), 7, false), None);
        assert!(length_problem(&Reply::default(), 7, true).is_some());
    }
}
