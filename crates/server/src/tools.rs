//! Tool calls: the `tools` a chat request offers go to the model's own chat template; its reply
//! is read back into OpenAI `tool_calls` in the format its template teaches it; and
//! `tool_choice: "required"` or a named function is enforced by constraining the reply to
//! calls (a Lark grammar around each tool's JSON schema).
//!
//! Formats, from the chat template's text:
//! - Hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`,
//!   one block per call, text around them is content;
//! - Llama 3.x JSON: the whole reply is `{"name": …, "parameters": {…}}` (after an optional
//!   `<|python_tag|>`).
//!
//! A template that shows neither gets a clear 400 rather than a guess.

use ember_engine::constraint::Grammar;
use serde_json::{Value, json};

/// How a request lets the model use its tools (`tool_choice`).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// Answer in text; the tools are not shown to the model.
    None,
    /// The model decides; its reply is read for calls.
    Auto,
    /// At least one call, enforced.
    Required,
    /// A call of this function, enforced.
    Named(String),
}

/// A request's tools: the definitions as given (`{"type": "function", "function": {…}}`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub definitions: Vec<Value>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls`: more than one call in a reply (default true).
    pub parallel: bool,
}

impl Tools {
    /// Whether the model sees the tools and its reply is read for calls.
    pub fn active(&self) -> bool {
        !self.definitions.is_empty() && self.choice != ToolChoice::None
    }

    fn functions(&self) -> impl Iterator<Item = &Value> {
        self.definitions.iter().map(|t| &t["function"])
    }
}

/// One call read from a reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// How the model writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The format a chat template teaches, when it is one ember reads.
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains(OPEN) {
            Some(ToolFormat::Hermes)
        } else if template.contains(PYTHON_TAG) || template.contains("Environment: ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The grammar a reply must follow when calls are required or one is named: calls only,
    /// each function's arguments held to its `parameters` schema.
    pub fn constraint(self, tools: &Tools) -> Option<Grammar> {
        let names: Vec<&str> = match &tools.choice {
            ToolChoice::Required => tools
                .functions()
                .filter_map(|f| f["name"].as_str())
                .collect(),
            ToolChoice::Named(name) => vec![name.as_str()],
            ToolChoice::None | ToolChoice::Auto => return None,
        };
        let key = match self {
            ToolFormat::Hermes => "arguments",
            ToolFormat::Llama3Json => "parameters",
        };
        let variants: Vec<Value> = names
            .iter()
            .map(|&name| {
                let parameters = tools
                    .functions()
                    .find(|f| f["name"] == name)
                    .and_then(|f| f.get("parameters"))
                    .filter(|p| p.is_object())
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"}));
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, key: parameters},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({
            "anyOf": variants,
            "x-guidance": {"whitespace_pattern": r"[\x20\x09]{0,2}"},
        });
        Some(match self {
            ToolFormat::Hermes => {
                let more = if tools.parallel && tools.choice == ToolChoice::Required {
                    "(\"\\n\" call)*"
                } else {
                    ""
                };
                Grammar::Lark(format!(
                    "%llguidance {{}}\nstart: call {more}\ncall: \"{OPEN}\\n\" %json {schema} \"\\n{CLOSE}\"\n"
                ))
            }
            ToolFormat::Llama3Json => Grammar::JsonSchema(schema),
        })
    }

    /// A whole reply's content (text outside the calls, trimmed; `None` when nothing is left)
    /// and its calls. A block that does not parse stays in the content, as written.
    pub fn split(self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        let mut stream = ToolStream::new(self);
        let mut pieces = stream.push(text);
        pieces.extend(stream.finish());
        let (mut content, mut calls) = (String::new(), Vec::new());
        for piece in pieces {
            match piece {
                StreamPiece::Content(c) => content.push_str(&c),
                StreamPiece::Call(call) => calls.push(call),
            }
        }
        let content = content.trim();
        ((!content.is_empty()).then(|| content.to_owned()), calls)
    }
}

/// A call's JSON (`{"name", "arguments"}` or Llama's `{"name", "parameters"}`), if it is one.
fn parse_call(text: &str) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => "{}".to_owned(),
        // Some models write the arguments as a JSON string already.
        Some(Value::String(s)) => s.clone(),
        Some(args) => args.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// What a reply streams as: content, and calls once each is whole.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamPiece {
    Content(String),
    Call(ToolCall),
}

/// Reads calls out of a reply as its text arrives: content streams on, except text that may
/// start a call (held back until it is known), and a call comes out when it closes.
pub struct ToolStream {
    format: ToolFormat,
    held: String,
    in_call: bool,
    /// Llama 3.x JSON: the reply began as a call, so it is held whole until the end.
    whole: Option<bool>,
    calls: usize,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> Self {
        ToolStream {
            format,
            held: String::new(),
            in_call: false,
            whole: None,
            calls: 0,
        }
    }

    /// Calls read so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<StreamPiece> {
        self.held.push_str(text);
        match self.format {
            ToolFormat::Hermes => self.hermes(false),
            ToolFormat::Llama3Json => self.llama(false),
        }
    }

    /// The rest, once the reply has ended.
    pub fn finish(&mut self) -> Vec<StreamPiece> {
        match self.format {
            ToolFormat::Hermes => self.hermes(true),
            ToolFormat::Llama3Json => self.llama(true),
        }
    }

    fn content(&self, text: &str, out: &mut Vec<StreamPiece>) {
        // Between and after calls, the line breaks that separate them are not content.
        if !(text.is_empty() || self.calls > 0 && text.trim().is_empty()) {
            out.push(StreamPiece::Content(text.to_owned()));
        }
    }

    fn hermes(&mut self, end: bool) -> Vec<StreamPiece> {
        let mut out = Vec::new();
        loop {
            if self.in_call {
                if let Some(at) = self.held.find(CLOSE) {
                    let inner = self.held[..at].to_owned();
                    self.held.drain(..at + CLOSE.len());
                    self.in_call = false;
                    match parse_call(&inner) {
                        Some(call) => {
                            self.calls += 1;
                            out.push(StreamPiece::Call(call));
                        }
                        None => self.content(&format!("{OPEN}{inner}{CLOSE}"), &mut out),
                    }
                    continue;
                }
                if end {
                    // An unclosed call (the reply hit its limit): a call if it parses.
                    let inner = std::mem::take(&mut self.held);
                    match parse_call(&inner) {
                        Some(call) => {
                            self.calls += 1;
                            out.push(StreamPiece::Call(call));
                        }
                        None => self.content(&format!("{OPEN}{inner}"), &mut out),
                    }
                }
                return out;
            }
            if let Some(at) = self.held.find(OPEN) {
                let before = self.held[..at].to_owned();
                self.content(&before, &mut out);
                self.held.drain(..at + OPEN.len());
                self.in_call = true;
                continue;
            }
            // Hold back a tail that may be the start of a call's tag.
            let keep = if end {
                0
            } else {
                partial_prefix(&self.held, OPEN)
            };
            let cut = self.held.len() - keep;
            let ready: String = self.held.drain(..cut).collect();
            self.content(&ready, &mut out);
            return out;
        }
    }

    fn llama(&mut self, end: bool) -> Vec<StreamPiece> {
        let mut out = Vec::new();
        if self.whole.is_none() {
            let start = self.held.trim_start();
            if start.is_empty() || (PYTHON_TAG.starts_with(start) && !end) {
                return out; // Not yet known.
            }
            self.whole = Some(start.starts_with('{') || start.starts_with(PYTHON_TAG));
        }
        if self.whole == Some(false) {
            let text = std::mem::take(&mut self.held);
            self.content(&text, &mut out);
            return out;
        }
        if end {
            let text = std::mem::take(&mut self.held);
            let body = text.trim_start().trim_start_matches(PYTHON_TAG);
            match parse_call(body) {
                Some(call) => {
                    self.calls += 1;
                    out.push(StreamPiece::Call(call));
                }
                None => self.content(&text, &mut out),
            }
        }
        out
    }
}

/// The length of the longest tail of `text` that is a proper start of `tag`.
fn partial_prefix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn formats_come_from_the_template() {
        assert_eq!(
            ToolFormat::detect("... <tool_call>\\n{...}</tool_call> ..."),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::detect("{{- \"Environment: ipython\\n\" }}"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::detect("{{ messages }}"), None);
    }

    #[test]
    fn hermes_replies_split_into_content_and_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \
                    \"arguments\": {}}\n</tool_call>";
        let (content, calls) = ToolFormat::Hermes.split(text);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls,
            vec![
                call("get_weather", "{\"city\":\"Paris\"}"),
                call("now", "{}")
            ]
        );
        // No calls: all content. A block that is not a call stays as written.
        assert_eq!(
            ToolFormat::Hermes.split("Hi."),
            (Some("Hi.".into()), vec![])
        );
        let (content, calls) = ToolFormat::Hermes.split("<tool_call>oops</tool_call>");
        assert_eq!(
            (content.as_deref(), calls.len()),
            (Some("<tool_call>oops</tool_call>"), 0)
        );
        // Cut by the token limit after the JSON: still a call.
        let (_, calls) =
            ToolFormat::Hermes.split("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n");
        assert_eq!(calls, vec![call("f", "{}")]);
    }

    #[test]
    fn streamed_pieces_are_the_same_whatever_the_cuts() {
        let text = "Sure <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n";
        let whole = ToolFormat::Hermes.split(text);
        for cut in 1..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let mut s = ToolStream::new(ToolFormat::Hermes);
            let mut pieces = s.push(&text[..cut]);
            pieces.extend(s.push(&text[cut..]));
            pieces.extend(s.finish());
            let content: String = pieces
                .iter()
                .filter_map(|p| match p {
                    StreamPiece::Content(c) => Some(c.as_str()),
                    StreamPiece::Call(_) => None,
                })
                .collect();
            let calls: Vec<ToolCall> = pieces
                .into_iter()
                .filter_map(|p| match p {
                    StreamPiece::Call(c) => Some(c),
                    StreamPiece::Content(_) => None,
                })
                .collect();
            assert_eq!(content.trim(), whole.0.as_deref().unwrap(), "cut at {cut}");
            assert!(
                !content.contains('<'),
                "a tag leaked into content at cut {cut}"
            );
            assert_eq!(calls, whole.1, "cut at {cut}");
        }
    }

    #[test]
    fn llama_replies_are_one_json_call_or_text() {
        let (content, calls) = ToolFormat::Llama3Json
            .split("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": \"b\"}}");
        assert_eq!((content, calls), (None, vec![call("f", "{\"a\":\"b\"}")]));
        let (content, calls) = ToolFormat::Llama3Json.split("Hello {there}");
        assert_eq!(
            (content.as_deref(), calls.len()),
            (Some("Hello {there}"), 0)
        );
    }

    #[test]
    fn required_and_named_choices_become_grammars() {
        let tools = |choice| Tools {
            definitions: vec![
                json!({"type": "function", "function": {"name": "a",
                       "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}),
                json!({"type": "function", "function": {"name": "b"}}),
            ],
            choice,
            parallel: true,
        };
        assert_eq!(
            ToolFormat::Hermes.constraint(&tools(ToolChoice::Auto)),
            None
        );
        let Some(Grammar::Lark(g)) = ToolFormat::Hermes.constraint(&tools(ToolChoice::Required))
        else {
            panic!("a Lark grammar")
        };
        assert!(g.contains("start: call (\"\\n\" call)*"), "{g}");
        assert!(
            g.contains("\"const\":\"a\"") && g.contains("\"const\":\"b\""),
            "{g}"
        );
        let Some(Grammar::Lark(g)) =
            ToolFormat::Hermes.constraint(&tools(ToolChoice::Named("b".into())))
        else {
            panic!("a Lark grammar")
        };
        assert!(
            g.contains("start: call \n") && !g.contains("\"const\":\"a\""),
            "{g}"
        );
    }
}
