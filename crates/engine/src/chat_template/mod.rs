//! Hugging Face chat templates rendered with minijinja, set up the way
//! transformers sets up jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, a `json.dumps`-style `tojson`, `strftime_now`) so the
//! output is byte-identical to Python's.

use std::fmt::Write as _;

use minijinja::value::{Serde, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};
use serde::{Deserialize, Serialize};

mod json;
#[cfg(test)]
mod tests;
mod time;

use json::{py_float_repr, tojson};
use time::strftime_now;

/// The name errors refer to the template by.
const TEMPLATE_NAME: &str = "chat_template";

/// Errors from compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat_template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`; carries the message.
    #[error("chat_template raised an exception: {0}")]
    Raised(String),
    #[error("chat_template failed to render: {0}")]
    Render(String),
    #[error("chat_template_kwargs may not set `{0}`: it is set by the renderer")]
    ReservedKwarg(String),
}

/// One chat message as the template sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant's tool calls as templates read them (transformers' shape):
    /// `[{"id", "type": "function", "function": {"name", "arguments": {…}}}]`, the arguments
    /// an object, not the API's JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// A chat template compiled once, rendered per request.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|err| TemplateError::Syntax(err.to_string()))?;
        env.set_syntax(syntax);
        // Templates call Python str/dict methods (.startswith, .split, .items() …).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        // The built-in tojson HTML-escapes `<>&'`; transformers' is plain json.dumps.
        env.add_filter("tojson", tojson);
        env.set_formatter(format_value);
        // jinja2's lexer turns every \r\n and \r of the source into \n; minijinja keeps them.
        let source = source.replace("\r\n", "\n").replace('\r', "\n");
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|err| TemplateError::Syntax(describe(&err)))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders the conversation. `kwargs` become top-level variables, as
    /// transformers does with `chat_template_kwargs` (e.g. `enable_thinking`);
    /// they may override `bos_token`/`eos_token` but not `messages` or
    /// `add_generation_prompt`. `tools` is left undefined.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TemplateError> {
        let mut ctx: Vec<(&str, Value)> = Vec::with_capacity(kwargs.len() + 4);
        // Unset special tokens stay undefined, as in transformers' special_tokens_map.
        if let Some(bos) = &self.bos_token {
            ctx.push(("bos_token", Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            ctx.push(("eos_token", Value::from(eos.as_str())));
        }
        for (key, value) in kwargs {
            if key == "messages" || key == "add_generation_prompt" {
                return Err(TemplateError::ReservedKwarg(key.clone()));
            }
            ctx.push((key.as_str(), Value::from(Serde(value))));
        }
        ctx.push(("messages", Value::from(Serde(messages))));
        ctx.push(("add_generation_prompt", Value::from(add_generation_prompt)));
        // Later pairs win, so kwargs override the special tokens.
        let ctx = Value::from_pairs(ctx);

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|err| TemplateError::Render(describe(&err)))?;
        template
            .render(ctx)
            .map_err(|err| match raised_message(&err) {
                Some(message) => TemplateError::Raised(message),
                None => TemplateError::Render(describe(&err)),
            })
    }
}

/// minijinja already prints None/True/False and strings the Python way, but
/// writes floats without exponents (`1e-07` comes out as `0.0000001`).
fn format_value(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    if value.kind() == ValueKind::Number
        && !value.is_integer()
        && let Ok(x) = f64::try_from(value.clone())
    {
        let text = if x.is_nan() {
            "nan".to_owned()
        } else if x.is_infinite() {
            (if x > 0.0 { "inf" } else { "-inf" }).to_owned()
        } else {
            py_float_repr(x)
        };
        return out
            .write_str(&text)
            .map_err(|_| Error::from(ErrorKind::WriteFailure));
    }
    minijinja::escape_formatter(out, state, value)
}

/// minijinja's message plus the template line when known.
fn describe(err: &Error) -> String {
    let mut text = err.to_string();
    if let Some(line) = err.line()
        && !text.contains(&format!(":{line})"))
    {
        let _ = write!(text, " (line {line})");
    }
    text
}

/// Marker carried as the source of the error `raise_exception` returns, so
/// `render` can tell a deliberate template error from an engine failure.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn raised_message(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        source = current.source();
    }
    None
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}
