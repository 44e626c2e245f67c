//! Reading one field of a request body: its type checked, its error naming it.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// The field `key` of `obj`, with `null` read as absent.
pub(super) fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(super) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!("`{param}` must be {expected}, got {}", type_name(got)),
    )
}

pub(super) fn unsupported(param: &str) -> ApiError {
    ApiError::invalid(param, format!("`{param}` is not supported"))
}

pub(super) fn bool_field(value: Option<&Value>, param: &str) -> Result<Option<bool>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong_type(param, "a boolean", other)),
    }
}

pub(super) fn str_field<'a>(
    value: Option<&'a Value>,
    param: &str,
) -> Result<Option<&'a str>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong_type(param, "a string", other)),
    }
}

pub(super) fn number_field(value: Option<&Value>, param: &str) -> Result<Option<f64>, ApiError> {
    match value {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(other) => Err(wrong_type(param, "a number", other)),
    }
}

pub(super) fn int_field(value: Option<&Value>, param: &str) -> Result<Option<i128>, ApiError> {
    match value {
        None => Ok(None),
        Some(v @ Value::Number(_)) => match as_integer(v) {
            Some(n) => Ok(Some(n)),
            None => Err(ApiError::invalid(
                param,
                format!("`{param}` must be an integer, got {v}"),
            )),
        },
        Some(other) => Err(wrong_type(param, "an integer", other)),
    }
}

/// A JSON number that is an integer (`16` or `16.0`), widened so no range check overflows.
pub(super) fn as_integer(value: &Value) -> Option<i128> {
    if let Some(i) = value.as_i64() {
        return Some(i.into());
    }
    if let Some(u) = value.as_u64() {
        return Some(u.into());
    }
    let f = value.as_f64()?;
    (f.fract() == 0.0 && f.abs() < 1e30).then_some(f as i128)
}
