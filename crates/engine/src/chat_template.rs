//! Hugging Face chat templates rendered with minijinja, set up the way
//! transformers sets up jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, a `json.dumps`-style `tojson`, `strftime_now`) so the
//! output is byte-identical to Python's.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, Serde, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};
use serde::{Deserialize, Serialize};

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

// ---------------------------------------------------------------------------
// tojson: Python json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False), the signature transformers registers.

struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// Deeper nesting than this is surely a mistake; stops unbounded recursion.
const MAX_JSON_DEPTH: usize = 256;

fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    const PARAMS: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > PARAMS.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 positional arguments",
        ));
    }
    let mut params: [Option<Value>; 4] = Default::default();
    for (slot, value) in params.iter_mut().zip(args.iter()) {
        *slot = Some(value.clone());
    }
    for (slot, name) in params.iter_mut().zip(PARAMS) {
        if let Some(value) = kwargs.get::<Option<Value>>(name)? {
            if slot.is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            *slot = Some(value);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = params;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            // Python: ' ' * indent (negative gives '')
            ValueKind::Number if v.is_integer() => {
                let n = i64::try_from(v).unwrap_or(0).clamp(0, 64);
                Some(" ".repeat(n as usize))
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson indent must be an integer, a string or none",
                ));
            }
        },
    };
    let (item_separator, key_separator) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be a pair of strings",
                    ));
                }
            }
        }
        // json.dumps drops the space after ',' when indenting.
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let options = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    write_json(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    depth: usize,
) -> Result<(), Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value is nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or_default(), opts.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                write_separator(out, opts, depth + 1, i == 0);
                write_json(out, item, opts, depth + 1)?;
            }
            write_closing(out, opts, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                write_separator(out, opts, depth + 1, i == 0);
                write_json_string(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_separator);
                write_json(out, item, opts, depth + 1)?;
            }
            write_closing(out, opts, depth);
            out.push('}');
        }
        kind => {
            // json.dumps raises TypeError for undefined and other objects too.
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// Before an item: the item separator (except first), then newline + indent.
fn write_separator(out: &mut String, opts: &JsonOptions, level: usize, first: bool) {
    if !first {
        out.push_str(&opts.item_separator);
    }
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_closing(out: &mut String, opts: &JsonOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// Python coerces int/float/bool/None keys to strings.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key);
            s
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {kind}"),
            ));
        }
    })
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
    } else {
        let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        if x.is_nan() {
            out.push_str("NaN");
        } else if x.is_infinite() {
            out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
        } else {
            out.push_str(&py_float_repr(x));
        }
    }
}

/// Python's `repr(float)`: shortest round-trip digits, scientific notation
/// when the decimal exponent is < -4 or >= 16, always a `.0` or exponent.
fn py_float_repr(x: f64) -> String {
    // `{:e}` gives the shortest round-trip digits, e.g. "1.5e-5", "-1e16".
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    // Position of the decimal point relative to the digit string.
    let decpt = exp + 1;
    let n = digits.len() as i32;
    if !(-4 < decpt && decpt <= 16) {
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{dot}{rest}e{exp_sign}{:02}", exp.abs())
    } else if decpt <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt < n {
        let (int, frac) = digits.split_at(decpt as usize);
        format!("{sign}{int}.{frac}")
    } else {
        format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
    }
}

/// json.dumps string escaping: `"`, `\`, control characters; with
/// `ensure_ascii` also everything outside printable ASCII (as UTF-16 units).
fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------
// strftime_now: Python's datetime.now().strftime(fmt), local time, C locale.

fn strftime_now(format: String) -> Result<Value, Error> {
    let now = local_now().map_err(|msg| Error::new(ErrorKind::InvalidOperation, msg))?;
    Ok(Value::from(format_time(&format, &now)))
}

/// A broken-down local time.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LocalTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Sunday
    weekday: u32,
    /// 0-based day of the year
    yday: u32,
    microsecond: u32,
}

fn local_now() -> Result<LocalTime, String> {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "system clock is before 1970".to_owned())?;
    let t = libc::time_t::try_from(since_epoch.as_secs())
        .map_err(|_| "system clock out of range".to_owned())?;
    // SAFETY: `tm` is plain old data, so all-zero is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call; localtime_r is the
    // thread-safe variant and writes only into `tm`.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return Err("localtime_r failed".to_owned());
    }
    let field = |v: libc::c_int| u32::try_from(v).unwrap_or(0);
    Ok(LocalTime {
        year: i64::from(tm.tm_year) + 1900,
        month: field(tm.tm_mon) + 1,
        day: field(tm.tm_mday),
        hour: field(tm.tm_hour),
        minute: field(tm.tm_min),
        second: field(tm.tm_sec),
        weekday: field(tm.tm_wday),
        yday: field(tm.tm_yday),
        microsecond: since_epoch.subsec_micros(),
    })
}

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// C-locale strftime for the common directives, glibc's `%-d` style
/// no-padding flag, and Python's own `%f`. Unknown directives are copied
/// through, as glibc does.
fn format_time(format: &str, t: &LocalTime) -> String {
    let weekday = WEEKDAYS[(t.weekday % 7) as usize];
    let month = MONTHS[(t.month.clamp(1, 12) - 1) as usize];
    let hour12 = match t.hour % 12 {
        0 => 12,
        h => h,
    };
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.next_if_eq(&'-').is_some();
        let Some(spec) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        // Zero-padded (or space-padded) number, unless the `-` flag was given.
        let num = |out: &mut String, v: i64, width: usize, pad: char| {
            let _ = match (no_pad, pad) {
                (true, _) => write!(out, "{v}"),
                (false, ' ') => write!(out, "{v:>width$}"),
                (false, _) => write!(out, "{v:0width$}"),
            };
        };
        match spec {
            'a' => out.push_str(&weekday[..3]),
            'A' => out.push_str(weekday),
            'b' | 'h' => out.push_str(&month[..3]),
            'B' => out.push_str(month),
            'd' => num(&mut out, t.day.into(), 2, '0'),
            'e' => num(&mut out, t.day.into(), 2, ' '),
            'm' => num(&mut out, t.month.into(), 2, '0'),
            'Y' => {
                let _ = write!(out, "{}", t.year);
            }
            'y' => num(&mut out, t.year.rem_euclid(100), 2, '0'),
            'C' => num(&mut out, t.year.div_euclid(100), 2, '0'),
            'H' => num(&mut out, t.hour.into(), 2, '0'),
            'k' => num(&mut out, t.hour.into(), 2, ' '),
            'I' => num(&mut out, hour12.into(), 2, '0'),
            'l' => num(&mut out, hour12.into(), 2, ' '),
            'M' => num(&mut out, t.minute.into(), 2, '0'),
            'S' => num(&mut out, t.second.into(), 2, '0'),
            'f' => num(&mut out, t.microsecond.into(), 6, '0'),
            'j' => num(&mut out, i64::from(t.yday) + 1, 3, '0'),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'P' => out.push_str(if t.hour < 12 { "am" } else { "pm" }),
            'u' => num(&mut out, (t.weekday + 6) as i64 % 7 + 1, 1, '0'),
            'w' => num(&mut out, t.weekday.into(), 1, '0'),
            // Week of the year, weeks starting on Sunday (%U) or Monday (%W).
            'U' => num(&mut out, (t.yday as i64 + 7 - t.weekday as i64) / 7, 2, '0'),
            'W' => num(
                &mut out,
                (t.yday as i64 + 7 - (t.weekday as i64 + 6) % 7) / 7,
                2,
                '0',
            ),
            'F' => out.push_str(&format_time("%Y-%m-%d", t)),
            'D' | 'x' => out.push_str(&format_time("%m/%d/%y", t)),
            'T' | 'X' => out.push_str(&format_time("%H:%M:%S", t)),
            'R' => out.push_str(&format_time("%H:%M", t)),
            'r' => out.push_str(&format_time("%I:%M:%S %p", t)),
            'c' => out.push_str(&format_time("%a %b %e %H:%M:%S %Y", t)),
            // datetime.now() is naive, so Python prints nothing for the zone.
            'z' | 'Z' => {}
            'n' => out.push('\n'),
            't' => out.push('\t'),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A condensed Qwen3 template: namespace, messages[::-1], loop.index0/last,
    /// startswith/split/strip, reasoning_content and enable_thinking.
    const QWEN3_STYLE: &str = r#"{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"#;

    fn qwen() -> ChatTemplate {
        ChatTemplate::new(QWEN3_STYLE, None, Some("<|im_end|>".into())).unwrap()
    }

    fn no_kwargs() -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }

    fn kwargs(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn qwen3_single_turn() {
        let msgs = [
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Hi!"),
        ];
        let out = qwen().render(&msgs, true, &no_kwargs()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n\
             <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = qwen()
            .render(&msgs, true, &kwargs(json!({"enable_thinking": false})))
            .unwrap();
        assert!(
            out.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            "{out:?}"
        );
        let out = qwen()
            .render(&msgs, false, &kwargs(json!({"enable_thinking": true})))
            .unwrap();
        assert!(
            out.ends_with("<|im_start|>user\nHi!<|im_end|>\n"),
            "{out:?}"
        );
    }

    #[test]
    fn qwen3_multi_turn_reasoning() {
        let mut with_reasoning = ChatMessage::new("assistant", "The answer is 4.");
        with_reasoning.reasoning_content = Some("\n2+2=4\n".into());
        let msgs = [
            ChatMessage::new("user", "What is 1+1?"),
            ChatMessage::new("assistant", "<think>\nadd them\n</think>\n\n2"),
            ChatMessage::new("user", "And 2+2?"),
            with_reasoning,
        ];
        let out = qwen().render(&msgs, false, &no_kwargs()).unwrap();
        // Reasoning before the last user query is dropped; after it, kept.
        assert_eq!(
            out,
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n\
             <|im_start|>assistant\n2<|im_end|>\n\
             <|im_start|>user\nAnd 2+2?<|im_end|>\n\
             <|im_start|>assistant\n<think>\n2+2=4\n</think>\n\nThe answer is 4.<|im_end|>\n"
        );
    }

    #[test]
    fn raise_exception_carries_the_message() {
        let msgs = [ChatMessage::new("robot", "beep")];
        match qwen().render(&msgs, true, &no_kwargs()) {
            Err(TemplateError::Raised(message)) => assert_eq!(message, "Unknown role: robot"),
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn syntax_and_render_errors_are_errors() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m }", None, None).unwrap_err();
        assert!(matches!(err, TemplateError::Syntax(_)), "{err}");
        let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(matches!(err, TemplateError::Syntax(_)), "{err}");

        let tpl = ChatTemplate::new("{{ messages[0].content.nope() }}", None, None).unwrap();
        let err = tpl.render(&[ChatMessage::new("user", "x")], false, &no_kwargs());
        assert!(matches!(err, Err(TemplateError::Render(_))), "{err:?}");

        let err = qwen().render(&[], false, &kwargs(json!({"messages": []})));
        assert!(matches!(err, Err(TemplateError::ReservedKwarg(k)) if k == "messages"));
    }

    #[test]
    fn special_tokens_kwargs_and_whitespace_control() {
        let src = "{{ bos_token }}\n{% for m in messages %}\n  {% if loop.last %}\n[{{ m.role }}]{{ m.content }}\n  {% endif %}\n{% endfor %}\n{{ eos_token is defined }}|{{ tools is defined }}|{{ custom }}\n";
        let tpl = ChatTemplate::new(src, Some("<s>".into()), None).unwrap();
        let msgs = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
        let out = tpl
            .render(
                &msgs,
                false,
                &kwargs(json!({"custom": [1, "x", null, true]})),
            )
            .unwrap();
        // trim_blocks + lstrip_blocks; Python-style rendering of lists/None/bools;
        // no trailing newline kept.
        assert_eq!(out, "<s>\n[user]b\nFalse|False|[1, 'x', None, True]");
        let out = tpl
            .render(&msgs, false, &kwargs(json!({"bos_token": "<B>"})))
            .unwrap();
        assert!(out.starts_with("<B>\n"), "{out:?}");
    }

    #[test]
    fn loop_controls_and_py_methods() {
        let src = "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
                   {% if m.role == 'stop' %}{% break %}{% endif %}{{ m.content.strip().upper() }},\
                   {% endfor %}{% for k, v in opts.items() %}{{ k }}={{ v }};{% endfor %}\
                   {{ 'a,b'.split(',') | length }}";
        let tpl = ChatTemplate::new(src, None, None).unwrap();
        let msgs = [
            ChatMessage::new("user", " a "),
            ChatMessage::new("skip", "b"),
            ChatMessage::new("user", "c"),
            ChatMessage::new("stop", "d"),
            ChatMessage::new("user", "e"),
        ];
        let out = tpl
            .render(&msgs, false, &kwargs(json!({"opts": {"z": 1, "a": 2}})))
            .unwrap();
        assert_eq!(out, "A,C,z=1;a=2;2");
    }

    #[test]
    fn reasoning_content_is_omitted_when_none() {
        let tpl = ChatTemplate::new(
            "{% for m in messages %}{{ m.reasoning_content is defined }}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let mut m = ChatMessage::new("assistant", "x");
        let out = tpl
            .render(std::slice::from_ref(&m), false, &no_kwargs())
            .unwrap();
        assert_eq!(out, "False");
        m.reasoning_content = Some("r".into());
        assert_eq!(tpl.render(&[m], false, &no_kwargs()).unwrap(), "True");
    }

    fn render_with(src: &str, kw: serde_json::Value) -> Result<String, TemplateError> {
        ChatTemplate::new(src, None, None)?.render(&[], false, &kwargs(kw))
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let tool = json!({"tool": {"name": "f<&>'", "z": 1, "a": [1.5, 1e-7, 1e16, 100.0, -0.0],
                                   "u": "é\n\"\\\u{1}", "e": {}, "l": [], "n": null, "b": false}});
        let out = render_with("{{ tool | tojson }}", tool.clone()).unwrap();
        assert_eq!(
            out,
            r#"{"name": "f<&>'", "z": 1, "a": [1.5, 1e-07, 1e+16, 100.0, -0.0], "u": "é\n\"\\\u0001", "e": {}, "l": [], "n": null, "b": false}"#
        );
        let out = render_with("{{ tool | tojson(indent=2) }}", tool.clone()).unwrap();
        assert_eq!(
            out,
            "{\n  \"name\": \"f<&>'\",\n  \"z\": 1,\n  \"a\": [\n    1.5,\n    1e-07,\n    1e+16,\n    100.0,\n    -0.0\n  ],\n  \"u\": \"é\\n\\\"\\\\\\u0001\",\n  \"e\": {},\n  \"l\": [],\n  \"n\": null,\n  \"b\": false\n}"
        );
        let out = render_with(
            "{{ tool.u | tojson(ensure_ascii=true) }} {{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=[',', ':']) }}",
            tool,
        )
        .unwrap();
        assert_eq!(out, r#""\u00e9\n\"\\\u0001" {"a":2,"b":1}"#);
        assert!(render_with("{{ nope | tojson }}", json!({})).is_err());
        assert!(render_with("{{ 1 | tojson(bogus=1) }}", json!({})).is_err());
        assert_eq!(
            render_with("{{ '🙂' | tojson(true) }}", json!({})).unwrap(),
            r#""\ud83d\ude42""#
        );
    }

    #[test]
    fn newlines_and_numbers_print_as_in_python() {
        // jinja2 normalises the source's \r\n and \r to \n.
        let out = render_with(
            "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\rd\r\n",
            json!({}),
        );
        assert_eq!(out.unwrap(), "a\nb\nc\nd");
        let out = render_with(
            "{{ x }} {{ y }} {{ z }} {{ n }}",
            json!({"x": 1e-7, "y": 1e20, "z": 2.5, "n": 7}),
        );
        assert_eq!(out.unwrap(), "1e-07 1e+20 2.5 7");
    }

    #[test]
    fn python_float_repr() {
        let cases = [
            (0.0, "0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456789.125, "123456789.125"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (-2.5e-300, "-2.5e-300"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (0.30000000000000004, "0.30000000000000004"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn strftime_directives() {
        let t = LocalTime {
            year: 2026,
            month: 3,
            day: 5,
            hour: 7,
            minute: 4,
            second: 9,
            weekday: 4,
            yday: 63,
            microsecond: 42,
        };
        assert_eq!(format_time("%d %b %Y", &t), "05 Mar 2026");
        assert_eq!(format_time("%B %-d, %Y %H:%M", &t), "March 5, 2026 07:04");
        assert_eq!(
            format_time("%A %a %m/%e %I%p %j %y %k|%l %P", &t),
            "Thursday Thu 03/ 5 07AM 064 26  7| 7 am"
        );
        assert_eq!(
            format_time("%F %T.%f [%z%Z] %% %Q %U %W %u %", &t),
            "2026-03-05 07:04:09.000042 [] % %Q 09 09 4 %"
        );
        assert_eq!(format_time("%c", &t), "Thu Mar  5 07:04:09 2026");
        // Through the template, against the real clock: only the shape is stable.
        let out = render_with("{{ strftime_now('%Y-%m-%d') }}", json!({})).unwrap();
        assert_eq!(out.len(), 10, "{out}");
        assert!(out.starts_with("20"), "{out}");
    }
}
