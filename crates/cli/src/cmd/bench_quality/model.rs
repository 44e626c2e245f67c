//! Checks whose outcome depends on the model as well as the server: reasoning kept out of the
//! answer (`thinking`), and a passage repeated verbatim (`copy`, which small or random models
//! fail: it is reported as it comes).

use serde_json::json;

use super::client::{Reply, Request, first_difference, snippet};
use super::prompts::{ARITHMETIC_PROMPT, PASSAGE, copy_prompt};
use super::{Suite, Tally};

/// The same chat with `enable_thinking` on and off: off, no reasoning and no think tag in the
/// answer; on, no think tag in the answer (whatever reasoning came is in `reasoning_content`).
///
/// Whether it applies: the template shows thinking support when the one the server reports at
/// `/props` names `enable_thinking` or `<think>`, or when the switch shows in the replies (they
/// differ, or either has reasoning or a think tag). Otherwise the check is reported with
/// `"applicable": false` and fails nothing.
pub fn thinking(suite: &Suite) -> Tally {
    let ask = |on: bool| {
        suite.client.send(
            &Request::ask(ARITHMETIC_PROMPT, suite.max_tokens)
                .with("chat_template_kwargs", json!({"enable_thinking": on})),
        )
    };
    let mut tally = Tally::default();
    let (on, off) = match (ask(true), ask(false)) {
        (Ok(on), Ok(off)) => (on, off),
        (Err(e), _) | (_, Err(e)) => {
            tally.record("request", Err(e));
            return tally;
        }
    };
    let template_thinks = suite
        .client
        .chat_template()
        .is_some_and(|t| t.contains("enable_thinking") || t.contains("<think>"));
    let shows = |r: &Reply| !r.reasoning.is_empty() || has_think_tag(&r.content);
    tally.applicable = template_thinks
        || (&on.content, &on.reasoning) != (&off.content, &off.reasoning)
        || shows(&on)
        || shows(&off);
    tally.check("thinking off", || {
        Ok(if !off.reasoning.is_empty() {
            Some(format!(
                "reasoning_content is not empty: {:?}",
                snippet(&off.reasoning, 0)
            ))
        } else {
            think_tag_problem(&off.content)
        })
    });
    tally.check("thinking on", || Ok(think_tag_problem(&on.content)));
    tally
}

fn has_think_tag(text: &str) -> bool {
    text.contains("<think>") || text.contains("</think>")
}

fn think_tag_problem(content: &str) -> Option<String> {
    let at = content
        .find("<think>")
        .or_else(|| content.find("</think>"))?;
    let chars = content[..at].chars().count();
    Some(format!(
        "content has a think tag at char {chars}: {:?}",
        snippet(content, chars)
    ))
}

/// A passage asked to be repeated verbatim: the reply must contain it exactly.
pub fn copy(suite: &Suite) -> Tally {
    // No tokenizer takes more than a token per byte, and the margin leaves room for a preamble.
    let max_tokens = PASSAGE.len() + 64;
    let request = Request::ask(&copy_prompt(), max_tokens)
        .with("chat_template_kwargs", json!({"enable_thinking": false}));
    let mut tally = Tally::default();
    tally.check("passage", || {
        let reply = suite.client.send(&request)?;
        Ok(copy_problem(&reply.content))
    });
    tally
}

/// Where `reply` departs from the passage, if it does not contain it.
fn copy_problem(reply: &str) -> Option<String> {
    if reply.contains(PASSAGE) {
        return None;
    }
    // Compare from where the copy seems to start: the passage's first words, else the start.
    let opening: String = PASSAGE.chars().take(16).collect();
    let copy = reply.find(&opening).map_or(reply, |at| &reply[at..]);
    let at = first_difference(PASSAGE, copy).unwrap_or(0);
    Some(format!(
        "the copy departs from the passage at char {at}: passage {:?}, reply {:?}",
        snippet(PASSAGE, at),
        snippet(copy, at)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_found_and_departures_located() {
        assert_eq!(copy_problem(&format!("Sure:\n\n{PASSAGE}\n")), None);
        let typo = format!("Here it is: {}", PASSAGE.replacen("granite", "granit", 1));
        let why = copy_problem(&typo).unwrap();
        let at = PASSAGE.find("granite").unwrap() + "granit".len();
        assert!(why.contains(&format!("at char {at}:")), "{why}");
        assert!(
            copy_problem("I cannot do that.")
                .unwrap()
                .contains("at char 0")
        );
    }

    #[test]
    fn think_tags_are_located() {
        assert_eq!(think_tag_problem("4 + 4 = 8"), None);
        let why = think_tag_problem("ok </think> 8").unwrap();
        assert!(why.contains("at char 3"), "{why}");
    }
}
