//! Multi-turn chats against the prompt cache: how much of turn n's KV cache turn n+1 can reuse.
//!
//! The prompt cache keeps the tokens of the last request (its prompt, then the reply the model
//! generated) and reuses the longest common token prefix with the next request's prompt; only
//! the rest is prefilled. In a chat, turn n+1 re-renders the whole history, so the cache is
//! only as good as the chat template's fidelity to what the model saw and emitted. This test
//! simulates a 4-turn chat for real chat templates, rendered by ember's own [`ChatTemplate`]
//! and tokenized by ember's [`Tokenizer`], and measures, at each turn, the common prefix of
//!
//! - what the KV cache holds after turn n: `prompt_n` (history rendered with
//!   `add_generation_prompt`) followed by the reply as the model emits it (its text tokens, then
//!   the end-of-turn special token, `<|im_end|>` or `<|eot_id|>`), and
//! - `prompt_{n+1}`: the history with that reply stored as the assistant message (as a client
//!   sends it back: for a reasoning model with or without the reasoning) and a new user turn.
//!
//! Findings it pins down (each assertion fails if the template or tokenizer behaves otherwise):
//!
//! - Qwen2.5(-Coder), SmolLM2 (ChatML) and Llama 3.0 / 3.2 reproduce history exactly: all of
//!   turn n's cache is a prefix of turn n+1's prompt. The only new tokens before the next user
//!   message are what the template writes after the end-of-turn token and the model never
//!   emits: ChatML's `\n` after `<|im_end|>` (Llama 3 writes nothing there).
//! - Qwen3 with thinking on rewrites history: an earlier assistant turn is rendered without its
//!   `<think>` block (whether the client sends the reasoning back in `content`, in
//!   `reasoning_content`, or not at all), so reuse stops exactly at the end of `prompt_n` and
//!   the answer is prefilled again.
//! - Qwen3 with thinking off rewrites history too: the generation prompt ends with an empty
//!   `<think>\n\n</think>\n\n` that the history rendering leaves out, so reuse stops just before
//!   it, a few tokens short of `prompt_n`, and the answer is prefilled again.
//! - Llama 3.2's system block carries today's date (`strftime_now`): a conversation that crosses
//!   midnight keeps only the tokens before the date (the test pins the date elsewhere).
//!
//! The templates: Qwen3, Qwen2.5-Coder and Llama 3.2 are committed verbatim under
//! `tests/fixtures/templates/` (the golden fixtures carry trimmed or older ones); SmolLM2's and
//! Qwen2.5-Coder's are also read from their GGUF files in `models/` when those have been
//! fetched, tokenized then with the model's own vocabulary. The other cases tokenize with the
//! golden fixtures' small byte-level BPE vocabularies, which hold every special token those
//! templates emit (checked below): a prefix check needs the same pre-tokenization and special
//! tokens, not the real merges.

use std::path::{Path, PathBuf};

use ember_engine::chat_template::{ChatMessage, ChatTemplate};
use ember_engine::tokenizer::Tokenizer;
use ember_engine::{Engine, EngineOptions};
use serde_json::{Map, Value, json};

/// One turn of the simulated chat: the user's message, then the model's reasoning (emitted
/// only by a thinking model) and answer.
struct Turn {
    user: &'static str,
    reasoning: &'static str,
    answer: &'static str,
}

const SYSTEM: &str = "You are a concise assistant. Answer in a sentence or two.";

const TURNS: [Turn; 4] = [
    Turn {
        user: "What is the capital of France?",
        reasoning: "The user asks for the capital of France. That is Paris.",
        answer: "The capital of France is Paris.",
    },
    Turn {
        user: "And how many people live there?",
        reasoning: "Paris proper has about 2.1 million residents; the metropolitan area about \
                    12 million.\n\nI should give both numbers.",
        answer: "About 2.1 million people live in Paris itself, and roughly 12 million in its \
                 metropolitan area.",
    },
    Turn {
        user: "Write a Python function that returns the larger of two numbers.",
        reasoning: "A conditional expression is enough. Keep it short.",
        answer: "```python\ndef larger(a, b):\n    return a if a >= b else b\n```",
    },
    Turn {
        user: "Thanks! Can it take any number of arguments?",
        reasoning: "Use *args and max.",
        answer: "Yes:\n\n```python\ndef largest(*args):\n    return max(args)\n```",
    },
];

/// How the client stores the model's reply in the history it sends next.
#[derive(Clone, Copy, Debug, PartialEq)]
enum History {
    /// `content` is the answer; the reasoning (the server returns it apart, in
    /// `reasoning_content`) is dropped, as most OpenAI clients do.
    AnswerOnly,
    /// `content` is the answer, `reasoning_content` the reasoning, both echoed back.
    ReasoningField,
    /// `content` is everything the model wrote, `<think>` block included.
    ThinkInContent,
}

/// Renders messages with `add_generation_prompt`, as the server does.
type Render<'a> = Box<dyn Fn(&[ChatMessage]) -> String + 'a>;

/// A chat template with the tokenizer that encodes its prompts.
struct Case<'a> {
    name: String,
    render: Render<'a>,
    tokenizer: &'a Tokenizer,
    system: Option<&'static str>,
    /// The special token the model ends its turn with.
    end_of_turn: &'static str,
    /// What the history holds right after a past turn's end-of-turn token, up to the next
    /// user's text.
    next_user: &'static str,
    /// The model opens its reply with a `<think>` block.
    thinking: bool,
    history: History,
    /// Special tokens the template writes; each must be one token of `tokenizer`.
    markers: &'static [&'static str],
}

/// Turn n's cache against turn n+1's prompt.
struct Transition {
    /// n, counted from 1.
    turn: usize,
    /// `prompt_n` and the reply the model emitted after it (end-of-turn token included).
    prompt: Vec<u32>,
    reply: Vec<u32>,
    /// `prompt_{n+1}`.
    next: Vec<u32>,
    /// Length of the common prefix of `prompt ++ reply` and `next`.
    common: usize,
}

impl Transition {
    fn cached(&self) -> Vec<u32> {
        [self.prompt.as_slice(), self.reply.as_slice()].concat()
    }

    /// Fraction of the next prompt the cache serves.
    fn hit_rate(&self) -> f64 {
        self.common as f64 / self.next.len() as f64
    }
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn golden_tokenizer(name: &str) -> Tokenizer {
    let dir = fixtures().join("golden").join(name);
    Tokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A template committed under `tests/fixtures/templates/`.
fn template_file(name: &str) -> String {
    read(&fixtures().join("templates").join(name))
}

/// A renderer set up as `Engine::load` sets it up: the tokenizer's BOS and EOS strings.
fn renderer<'a>(source: &str, tokenizer: &Tokenizer, kwargs: Map<String, Value>) -> Render<'a> {
    let template = ChatTemplate::new(
        source,
        tokenizer.bos_token().map(str::to_owned),
        tokenizer.eos_token().map(str::to_owned),
    )
    .unwrap();
    Box::new(move |messages| template.render(messages, true, &kwargs).unwrap())
}

fn kwargs(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("kwargs must be an object, not {other}"),
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The model file in `models/` (or `$EMBER_MODELS_DIR`), if fetched.
fn model_path(file: &str) -> Option<PathBuf> {
    let mut dirs = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")];
    if let Some(dir) = std::env::var_os("EMBER_MODELS_DIR") {
        dirs.insert(0, PathBuf::from(dir));
    }
    dirs.into_iter().map(|d| d.join(file)).find(|p| p.is_file())
}

/// Loads a GGUF model for its tokenizer and template, as the server would (smallest cache).
fn gguf_engine(file: &str, fetch: &str) -> Option<Engine> {
    let Some(path) = model_path(file) else {
        eprintln!("SKIPPED: {file} is not in models/ (scripts/fetch-model {fetch})");
        return None;
    };
    let options = EngineOptions {
        threads: Some(1),
        context: Some(16),
        prefill_chunk: Some(16),
        ..EngineOptions::default()
    };
    Some(Engine::load(&path, &options).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// The assistant message a client sends back for a turn.
fn stored_reply(turn: &Turn, thinking: bool, history: History) -> ChatMessage {
    let mut message = ChatMessage::new("assistant", turn.answer);
    if thinking {
        match history {
            History::AnswerOnly => {}
            History::ReasoningField => message.reasoning_content = Some(turn.reasoning.into()),
            History::ThinkInContent => message.content = emitted_text(turn, true),
        }
    }
    message
}

/// The reply's text as the model writes it (Qwen3's framing of its reasoning).
fn emitted_text(turn: &Turn, thinking: bool) -> String {
    if thinking {
        format!("<think>\n{}\n</think>\n\n{}", turn.reasoning, turn.answer)
    } else {
        turn.answer.to_owned()
    }
}

/// Checks that `tokens` are `text` with every special marker recognized as its one token.
fn check_tokens(case: &Case, text: &str, tokens: &[u32]) {
    let tok = case.tokenizer;
    assert_eq!(
        tok.decode(tokens, false),
        text,
        "{}: the tokens do not spell the rendered text",
        case.name
    );
    for marker in case.markers {
        let id = tok.token_to_id(marker).unwrap();
        assert_eq!(
            tokens.iter().filter(|&&t| t == id).count(),
            text.matches(marker).count(),
            "{}: {marker} is not always tokenized as token {id} in {text:?}",
            case.name
        );
    }
}

/// Runs the 4-turn chat; returns turn n's cache against turn n+1's prompt for n = 1..=3.
fn simulate(case: &Case) -> Vec<Transition> {
    let tok = case.tokenizer;
    // The templates' special tokens must be single tokens of this vocabulary, or the tokens
    // of the fixtures would not stand for the real model's.
    for marker in case.markers.iter().chain([&case.end_of_turn]) {
        let id = tok
            .token_to_id(marker)
            .unwrap_or_else(|| panic!("{}: {marker} is not in the vocabulary", case.name));
        assert_eq!(
            tok.encode(marker, false).unwrap(),
            [id],
            "{}: {marker} is not one token",
            case.name
        );
    }
    let eot = tok.token_to_id(case.end_of_turn).unwrap();
    assert!(
        tok.is_special(eot),
        "{}: {} is not special",
        case.name,
        case.end_of_turn
    );

    let mut messages: Vec<ChatMessage> = case
        .system
        .map(|s| ChatMessage::new("system", s))
        .into_iter()
        .collect();
    let mut transitions = Vec::new();
    let mut last: Option<(Vec<u32>, Vec<u32>)> = None;
    for (i, turn) in TURNS.iter().enumerate() {
        messages.push(ChatMessage::new("user", turn.user));
        let text = (case.render)(&messages);
        let prompt = tok.encode(&text, false).unwrap();
        check_tokens(case, &text, &prompt);
        if let Some((prompt_before, reply)) = last.take() {
            let cached = [prompt_before.as_slice(), reply.as_slice()].concat();
            transitions.push(Transition {
                turn: i,
                common: common_prefix(&cached, &prompt),
                prompt: prompt_before,
                reply,
                next: prompt.clone(),
            });
        }
        // What generation leaves in the cache after the prompt: the reply's tokens, then the
        // end-of-turn token (special, so never part of the text).
        let mut reply = tok
            .encode(&emitted_text(turn, case.thinking), false)
            .unwrap();
        reply.push(eot);
        last = Some((prompt, reply));
        messages.push(stored_reply(turn, case.thinking, case.history));
    }
    for t in &transitions {
        eprintln!(
            "{}: turn {}->{}: cache {} (prompt {} + reply {}), next prompt {}, common prefix {} \
             -> hit rate {:.1}%, {} tokens to prefill, {} cached tokens dropped",
            case.name,
            t.turn,
            t.turn + 1,
            t.prompt.len() + t.reply.len(),
            t.prompt.len(),
            t.reply.len(),
            t.next.len(),
            t.common,
            100.0 * t.hit_rate(),
            t.next.len() - t.common,
            t.prompt.len() + t.reply.len() - t.common,
        );
    }
    transitions
}

/// A template that reproduces history exactly: all of turn n's cache is a prefix of turn
/// n+1's prompt, and what follows it is exactly `case.next_user` and the next user message.
fn assert_whole_cache_reused(case: &Case) {
    let transitions = simulate(case);
    assert_eq!(transitions.len(), TURNS.len() - 1);
    for t in &transitions {
        let cached = t.cached();
        assert_eq!(
            t.common,
            cached.len(),
            "{} turn {}: the cache diverges from the next prompt at token {} of {}: cached \
             {:?}, next {:?}",
            case.name,
            t.turn,
            t.common,
            cached.len(),
            case.tokenizer.decode(&cached[t.common..], false),
            case.tokenizer.decode(&t.next[t.common..], false),
        );
        let new = case.tokenizer.decode(&t.next[t.common..], false);
        let expected = format!("{}{}", case.next_user, TURNS[t.turn].user);
        assert!(
            new.starts_with(&expected),
            "{} turn {}: the new part of the next prompt is {new:?}, expected it to start with \
             {expected:?}",
            case.name,
            t.turn
        );
    }
}

const CHATML_MARKERS: &[&str] = &["<|im_start|>", "<|im_end|>"];
const QWEN3_MARKERS: &[&str] = &["<|im_start|>", "<|im_end|>", "<think>", "</think>"];
const LLAMA3_MARKERS: &[&str] = &[
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];
const CHATML_NEXT_USER: &str = "\n<|im_start|>user\n";
const LLAMA3_NEXT_USER: &str = "<|start_header_id|>user<|end_header_id|>\n\n";

fn chatml_case<'a>(
    name: &str,
    render: Render<'a>,
    tokenizer: &'a Tokenizer,
    system: Option<&'static str>,
) -> Case<'a> {
    Case {
        name: name.to_owned(),
        render,
        tokenizer,
        system,
        end_of_turn: "<|im_end|>",
        next_user: CHATML_NEXT_USER,
        thinking: false,
        history: History::AnswerOnly,
        markers: CHATML_MARKERS,
    }
}

fn llama3_case<'a>(
    name: &str,
    render: Render<'a>,
    tokenizer: &'a Tokenizer,
    system: Option<&'static str>,
) -> Case<'a> {
    Case {
        name: name.to_owned(),
        render,
        tokenizer,
        system,
        end_of_turn: "<|eot_id|>",
        next_user: LLAMA3_NEXT_USER,
        thinking: false,
        history: History::AnswerOnly,
        markers: LLAMA3_MARKERS,
    }
}

/// The golden fixtures' vocabularies Qwen3's template is tokenized with: both hold
/// `<|im_start|>`, `<|im_end|>`, `<think>` and `</think>`; qwen2-f32's splits text with the
/// pre-tokenizer regex of the real Qwen2/Qwen3 tokenizer, qwen3-f32's with GPT-2's byte-level
/// one. The findings must not depend on which.
const QWEN3_VOCABS: [&str; 2] = ["qwen2-f32", "qwen3-f32"];

fn qwen3_case<'a>(
    vocab: &str,
    tokenizer: &'a Tokenizer,
    thinking: bool,
    history: History,
) -> Case<'a> {
    let source = template_file("qwen3.jinja");
    let render = renderer(
        &source,
        tokenizer,
        kwargs(json!({"enable_thinking": thinking})),
    );
    Case {
        name: format!(
            "qwen3 (thinking {}, {history:?}, {vocab} vocab)",
            if thinking { "on" } else { "off" }
        ),
        render,
        tokenizer,
        system: Some(SYSTEM),
        end_of_turn: "<|im_end|>",
        next_user: CHATML_NEXT_USER,
        thinking,
        history,
        markers: QWEN3_MARKERS,
    }
}

/// Qwen3 with thinking on drops the `<think>` block of every assistant turn before the last
/// user message, however the client sends the reasoning back: the cache is reused through the
/// end of `prompt_n` and no further (the reply's `<think>` is where the two part), so the whole
/// reply is dropped from the cache and its answer prefilled again.
#[test]
fn qwen3_thinking_rewrites_history_at_the_reply() {
    for vocab in QWEN3_VOCABS {
        let tok = golden_tokenizer(vocab);
        let think = tok.token_to_id("<think>").unwrap();
        let mut prompts: Vec<Vec<Vec<u32>>> = Vec::new();
        for history in [
            History::AnswerOnly,
            History::ReasoningField,
            History::ThinkInContent,
        ] {
            let case = qwen3_case(vocab, &tok, true, history);
            let transitions = simulate(&case);
            for t in &transitions {
                assert!(
                    t.common >= t.prompt.len(),
                    "{} turn {}: only {} of prompt_n's {} tokens are reused",
                    case.name,
                    t.turn,
                    t.common,
                    t.prompt.len()
                );
                // A rewrite, not a full hit: the history leaves the reasoning out.
                assert_eq!(
                    t.common,
                    t.prompt.len(),
                    "{} turn {}: more than prompt_n was reused",
                    case.name,
                    t.turn
                );
                assert_eq!(t.reply[0], think, "{}: the reply opens <think>", case.name);
                let new = tok.decode(&t.next[t.common..], false);
                let expected = format!(
                    "{}<|im_end|>{CHATML_NEXT_USER}{}",
                    TURNS[t.turn - 1].answer,
                    TURNS[t.turn].user
                );
                assert!(
                    new.starts_with(&expected),
                    "{} turn {}: the next prompt goes on with {new:?}",
                    case.name,
                    t.turn
                );
                assert_hit_rate(&case, t, QWEN3_MIN_HIT_RATE);
            }
            prompts.push(transitions.into_iter().map(|t| t.next).collect());
        }
        // The three ways of sending the reasoning back render the same prompts.
        assert_eq!(
            prompts[0], prompts[1],
            "{vocab}: reasoning_content changes the prompt"
        );
        assert_eq!(
            prompts[0], prompts[2],
            "{vocab}: <think> in content changes the prompt"
        );
    }
}

/// Qwen3 with thinking off: the generation prompt ends with an empty `<think>\n\n</think>\n\n`
/// that the history's rendering of the turn leaves out, so the cache is reused up to just
/// before it: a few tokens of `prompt_n` and the whole reply are prefilled again.
#[test]
fn qwen3_no_thinking_drops_the_empty_think_block() {
    for vocab in QWEN3_VOCABS {
        let tok = golden_tokenizer(vocab);
        let case = qwen3_case(vocab, &tok, false, History::AnswerOnly);
        let empty_think = tok.encode("<think>\n\n</think>\n\n", false).unwrap();
        for t in &simulate(&case) {
            assert!(
                t.prompt.ends_with(&empty_think),
                "{} turn {}: the prompt does not end with the empty think block",
                case.name,
                t.turn
            );
            assert_eq!(
                t.common,
                t.prompt.len() - empty_think.len(),
                "{} turn {}: expected the cache to be reused up to the empty think block",
                case.name,
                t.turn
            );
            let new = tok.decode(&t.next[t.common..], false);
            let expected = format!(
                "{}<|im_end|>{CHATML_NEXT_USER}{}",
                TURNS[t.turn - 1].answer,
                TURNS[t.turn].user
            );
            assert!(
                new.starts_with(&expected),
                "{} turn {}: the next prompt goes on with {new:?}",
                case.name,
                t.turn
            );
            assert_hit_rate(&case, t, QWEN3_MIN_HIT_RATE);
        }
    }
}

/// The least share of turn n+1's prompt that Qwen3's cache must serve, with or without
/// thinking. Reuse ends at (or a few tokens before) the end of `prompt_n`, so the hit rate is
/// about `prompt_n / prompt_{n+1}`: the new part is the last answer (prefilled again), the new
/// question and the framing, while `prompt_n` grows every turn. Measured with these messages
/// over both vocabularies: 49.6-58.0% on turns 1->2 and 2->3 (turn 2's answer is long) and
/// 70.5-71.8% on turn 3->4 (the exact ChatML templates reach 65-87% on the same vocabulary).
/// 45% leaves room for token counts to move by a few percent, and fails if reuse ended one
/// turn earlier (at `prompt_{n-1}`, turn 2->3 would be about 30%).
const QWEN3_MIN_HIT_RATE: f64 = 0.45;

fn assert_hit_rate(case: &Case, t: &Transition, min: f64) {
    assert!(
        t.hit_rate() > min,
        "{} turn {}: hit rate {:.3} is below {min}",
        case.name,
        t.turn,
        t.hit_rate()
    );
}

/// Qwen2.5-Coder's template (ChatML with a default system message) keeps history as is.
#[test]
fn qwen25_reuses_the_whole_cache() {
    let tok = golden_tokenizer("qwen2-f32");
    let source = template_file("qwen2.5-coder-instruct.jinja");
    // Without a system message the template writes its default one; with one, that one.
    for system in [None, Some(SYSTEM)] {
        let render = renderer(&source, &tok, Map::new());
        let name = format!("qwen2.5-coder (system: {})", system.is_some());
        assert_whole_cache_reused(&chatml_case(&name, render, &tok, system));
    }
    // The golden fixture's own (simplified) ChatML template behaves the same.
    let golden = read(&fixtures().join("golden/qwen2-f32/chat_template.jinja"));
    let render = renderer(&golden, &tok, Map::new());
    assert_whole_cache_reused(&chatml_case("qwen2 golden fixture", render, &tok, None));
}

/// Llama 3.2's template (a system block with the date) and Llama 3.0's, the golden fixture's
/// (Meta-Llama-3-8B-Instruct's template), keep history as is: the model's `<|eot_id|>` is the
/// last token of a turn in both.
#[test]
fn llama3_reuses_the_whole_cache() {
    let tok = golden_tokenizer("llama-f32");
    let source = template_file("llama3.2-instruct.jinja");
    // The date is pinned; the server renders today's (see
    // `llama32_date_change_keeps_only_what_precedes_it`).
    let date = kwargs(json!({"date_string": "26 Jul 2024"}));
    for system in [None, Some(SYSTEM)] {
        let render = renderer(&source, &tok, date.clone());
        let name = format!("llama3.2 (system: {})", system.is_some());
        assert_whole_cache_reused(&llama3_case(&name, render, &tok, system));
    }
    let golden = read(&fixtures().join("golden/llama-f32/chat_template.jinja"));
    for system in [None, Some(SYSTEM)] {
        let render = renderer(&golden, &tok, Map::new());
        let name = format!("llama3 golden fixture (system: {})", system.is_some());
        assert_whole_cache_reused(&llama3_case(&name, render, &tok, system));
    }
}

/// Llama 3.2 writes "Today Date: <strftime_now>" into its system block, the first tokens of
/// every prompt: when the date changes between two turns, the cache is reused only up to it.
#[test]
fn llama32_date_change_keeps_only_what_precedes_it() {
    let tok = golden_tokenizer("llama-f32");
    let source = template_file("llama3.2-instruct.jinja");
    let messages = [ChatMessage::new("user", TURNS[0].user)];
    let on = |date: &str| {
        let render = renderer(&source, &tok, kwargs(json!({"date_string": date})));
        tok.encode(&render(&messages), false).unwrap()
    };
    let (before, after) = (on("31 Dec 2024"), on("01 Jan 2025"));
    let common = common_prefix(&before, &after);
    let header = tok
        .encode(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge \
             Date: December 2023\nToday Date: ",
            false,
        )
        .unwrap();
    eprintln!(
        "llama3.2 across midnight: common prefix {common} of {} tokens",
        after.len()
    );
    assert_eq!(common, header.len(), "the prompts part at the date");
    // Without a pinned date the template takes today's from strftime_now.
    let today = renderer(&source, &tok, Map::new())(&messages);
    assert!(
        !today.contains("26 Jul 2024"),
        "strftime_now was not used: {today:?}"
    );
}

/// The real models' templates and vocabularies, from their GGUF files when fetched: SmolLM2
/// (ChatML with its own default system message) and Qwen2.5-Coder, whose embedded template
/// must be the one committed under `tests/fixtures/templates/`.
#[test]
fn gguf_models_reuse_the_whole_cache() {
    if let Some(engine) = gguf_engine("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2") {
        let encoder = engine.encoder();
        for system in [None, Some(SYSTEM)] {
            let render = Box::new(|m: &[ChatMessage]| encoder.render_chat(m, &Map::new()).unwrap());
            let name = format!("smollm2 gguf (system: {})", system.is_some());
            assert_whole_cache_reused(&chatml_case(&name, render, engine.tokenizer(), system));
        }
    }
    if let Some(engine) = gguf_engine(
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        "qwen2.5-coder-1.5b",
    ) {
        let encoder = engine.encoder();
        assert_eq!(
            encoder.chat_template_source(),
            Some(template_file("qwen2.5-coder-instruct.jinja").as_str()),
            "the GGUF's template is not the committed one"
        );
        for system in [None, Some(SYSTEM)] {
            let render = Box::new(|m: &[ChatMessage]| encoder.render_chat(m, &Map::new()).unwrap());
            let name = format!("qwen2.5-coder gguf (system: {})", system.is_some());
            assert_whole_cache_reused(&chatml_case(&name, render, engine.tokenizer(), system));
        }
    }
}
