//! A chat request's tools: `tools`, `tool_choice`, `parallel_tool_calls`, and the tool calls
//! of its assistant messages.

use serde_json::{Map, Value};

use super::fields::{bool_field, field, str_field, wrong_type};
use crate::error::ApiError;
use crate::tools::{ToolChoice, Tools};

/// OpenAI's `tools` (functions only), `tool_choice` and `parallel_tool_calls`.
pub(super) fn parse_tools(obj: &Map<String, Value>) -> Result<Tools, ApiError> {
    let definitions = match field(obj, "tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(other) => return Err(wrong_type("tools", "an array", other)),
    };
    let mut names = Vec::with_capacity(definitions.len());
    for (i, tool) in definitions.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(t) = tool else {
            return Err(wrong_type(&p, "an object", tool));
        };
        match str_field(field(t, "type"), &format!("{p}.type"))? {
            Some("function") => {}
            other => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    format!("`{p}.type` must be \"function\", got {other:?}"),
                ));
            }
        }
        let q = format!("{p}.function");
        let Some(Value::Object(function)) = field(t, "function") else {
            return Err(ApiError::invalid(&q, format!("`{q}` must be an object")));
        };
        let name = str_field(field(function, "name"), &format!("{q}.name"))?.unwrap_or("");
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(ApiError::invalid(
                format!("{q}.name"),
                format!("`{q}.name` must be 1 to 64 letters, digits, `_` or `-`, got {name:?}"),
            ));
        }
        match field(function, "parameters") {
            None | Some(Value::Object(_)) => {}
            Some(other) => return Err(wrong_type(&format!("{q}.parameters"), "an object", other)),
        }
        names.push(name.to_owned());
    }
    let choice = match field(obj, "tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be none, auto, required or a function, got {other:?}"
                    ),
                ));
            }
        },
        Some(Value::Object(choice)) => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` names a function as {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not among the `tools`"),
                ));
            }
            ToolChoice::Named(name.to_owned())
        }
        Some(other) => return Err(wrong_type("tool_choice", "a string or an object", other)),
    };
    if definitions.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a call but the request has no `tools`",
        ));
    }
    let parallel =
        bool_field(field(obj, "parallel_tool_calls"), "parallel_tool_calls")?.unwrap_or(true);
    Ok(Tools {
        definitions,
        choice,
        parallel,
    })
}

/// An assistant message's `tool_calls` as templates read them: each call's `arguments`, JSON
/// text in the API, parsed into the object transformers hands its templates.
pub(super) fn parse_tool_calls(p: &str, calls: &[Value]) -> Result<Value, ApiError> {
    let mut out = Vec::with_capacity(calls.len());
    for (i, call) in calls.iter().enumerate() {
        let q = format!("{p}.tool_calls[{i}]");
        let function = call
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::invalid(&q, format!("`{q}.function` must be an object")))?;
        let name = str_field(field(function, "name"), &format!("{q}.function.name"))?
            .ok_or_else(|| ApiError::invalid(&q, format!("`{q}.function.name` is required")))?;
        let arguments = match field(function, "arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(text)) => serde_json::from_str(text).map_err(|e| {
                ApiError::invalid(
                    format!("{q}.function.arguments"),
                    format!("`{q}.function.arguments` is not valid JSON: {e}"),
                )
            })?,
            Some(args @ Value::Object(_)) => args.clone(),
            Some(other) => {
                return Err(wrong_type(
                    &format!("{q}.function.arguments"),
                    "a JSON string",
                    other,
                ));
            }
        };
        let mut entry = serde_json::json!({
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            entry["id"] = id.into();
        }
        out.push(entry);
    }
    Ok(Value::Array(out))
}
