//! A request's sampling fields: temperature and the cuts, the penalties, and the output
//! constraint (a JSON schema or a grammar).

use ember_engine::constraint::Grammar;
use ember_engine::sampler::{Penalties, SamplingError, SamplingParams};
use serde_json::{Map, Value};

use super::fields::{field, int_field, number_field, str_field, wrong_type};
use crate::error::ApiError;

/// The output constraint a request asks for, from whichever of OpenAI's and llama.cpp's
/// fields names one (two at once are an error).
pub(super) fn parse_grammar(
    obj: &Map<String, Value>,
) -> Result<Option<(&'static str, Grammar)>, ApiError> {
    let mut found: Vec<(&'static str, Grammar)> = Vec::new();
    match field(obj, "response_format") {
        None | Some(Value::Null) => {}
        Some(Value::Object(format)) => {
            let p = "response_format";
            match str_field(field(format, "type"), "response_format.type")? {
                Some("text") => {}
                // llama-server also takes a `schema` here.
                Some("json_object") => found.push((
                    p,
                    match field(format, "schema") {
                        Some(schema @ Value::Object(_)) => Grammar::JsonSchema(schema.clone()),
                        _ => Grammar::JsonObject,
                    },
                )),
                Some("json_schema") => {
                    let q = "response_format.json_schema";
                    let schema = match field(format, "json_schema") {
                        Some(Value::Object(spec)) => match field(spec, "schema") {
                            Some(schema @ Value::Object(_)) => schema.clone(),
                            // OpenAI's `schema` is optional: without one, any JSON object.
                            None => serde_json::json!({"type": "object"}),
                            Some(other) => {
                                return Err(wrong_type(&format!("{q}.schema"), "an object", other));
                            }
                        },
                        Some(other) => return Err(wrong_type(q, "an object", other)),
                        None => {
                            return Err(ApiError::invalid(
                                q,
                                "`response_format.json_schema` is required when the type is json_schema",
                            ));
                        }
                    };
                    found.push((p, Grammar::JsonSchema(schema)));
                }
                Some(other) => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        format!(
                            "`response_format.type` must be text, json_object or json_schema, got {other:?}"
                        ),
                    ));
                }
                None => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        "`response_format.type` is required",
                    ));
                }
            }
        }
        Some(other) => return Err(wrong_type("response_format", "an object", other)),
    }
    match field(obj, "json_schema") {
        None | Some(Value::Null) => {}
        Some(schema @ Value::Object(_)) => {
            found.push(("json_schema", Grammar::JsonSchema(schema.clone())))
        }
        Some(other) => return Err(wrong_type("json_schema", "an object", other)),
    }
    match field(obj, "grammar") {
        None | Some(Value::Null) => {}
        Some(Value::String(g)) if g.trim().is_empty() => {}
        Some(Value::String(g)) => found.push(("grammar", Grammar::from_llama_grammar(g))),
        Some(other) => return Err(wrong_type("grammar", "a string", other)),
    }
    match &found[..] {
        [] => Ok(None),
        [(a, g)] => Ok(Some((a, g.clone()))),
        [(a, _), (b, _), ..] => Err(ApiError::invalid(
            *b,
            format!("`{a}` and `{b}` both constrain the output; send one of them"),
        )),
    }
}

/// The request's sampling; what it leaves out comes from `defaults` (the model's, see
/// `ember_engine::SamplingDefaults`, with the server's flags over them).
pub(super) fn parse_sampling(
    obj: &Map<String, Value>,
    defaults: &SamplingParams,
) -> Result<SamplingParams, ApiError> {
    let temperature = match number_field(field(obj, "temperature"), "temperature")? {
        None => f64::from(defaults.temperature),
        Some(t) if (0.0..=2.0).contains(&t) => t,
        Some(t) => {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be between 0 and 2, got {t}"),
            ));
        }
    };
    let top_p = match number_field(field(obj, "top_p"), "top_p")? {
        None => f64::from(defaults.top_p),
        Some(p) if p > 0.0 && p <= 1.0 => p,
        Some(p) => {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {p}"),
            ));
        }
    };
    let top_k = match int_field(field(obj, "top_k"), "top_k")? {
        None => defaults.top_k,
        Some(-1) | Some(0) => 0,
        // Larger than any vocabulary means off too; the sampler handles that.
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1, 0 (both mean off) or a positive integer, got {k}"),
            ));
        }
    };
    let min_p = match number_field(field(obj, "min_p"), "min_p")? {
        None => f64::from(defaults.min_p),
        Some(p) if (0.0..=1.0).contains(&p) => p,
        Some(p) => {
            return Err(ApiError::invalid(
                "min_p",
                format!("`min_p` must be between 0 and 1, got {p}"),
            ));
        }
    };
    let seed = match int_field(field(obj, "seed"), "seed")? {
        None => defaults.seed,
        Some(s) => Some(u64::try_from(s).map_err(|_| {
            ApiError::invalid(
                "seed",
                format!("`seed` must be an integer in 0..={}, got {s}", u64::MAX),
            )
        })?),
    };
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        seed,
        penalties: parse_penalties(obj, &defaults.penalties)?,
    };
    // The ranges above are at least as strict; this catches what rounding to f32 changes
    // (a top_p of 1e-60 becomes 0).
    sampling.validate().map_err(|e| {
        let param = match e {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::MinP(_) => "min_p",
            SamplingError::RepetitionPenalty(_) => "repetition_penalty",
            SamplingError::PresencePenalty(_) => "presence_penalty",
            SamplingError::FrequencyPenalty(_) => "frequency_penalty",
        };
        ApiError::invalid(param, e.to_string())
    })?;
    Ok(sampling)
}

/// OpenAI's `presence_penalty` and `frequency_penalty`, vLLM's `repetition_penalty` (llama.cpp's
/// `repeat_penalty`) and llama.cpp's `repeat_last_n` (-1: the whole sequence; absent: OpenAI's
/// and vLLM's counting, see [`Penalties::last_n`]).
pub(super) fn parse_penalties(
    obj: &Map<String, Value>,
    defaults: &Penalties,
) -> Result<Penalties, ApiError> {
    let within = |name: &str, default: f32| -> Result<f32, ApiError> {
        match number_field(field(obj, name), name)? {
            None => Ok(default),
            Some(x) if (-2.0..=2.0).contains(&x) => Ok(x as f32),
            Some(x) => Err(ApiError::invalid(
                name,
                format!("`{name}` must be between -2 and 2, got {x}"),
            )),
        }
    };
    let presence = within("presence_penalty", defaults.presence)?;
    let frequency = within("frequency_penalty", defaults.frequency)?;
    let mut repetition = None;
    for name in ["repetition_penalty", "repeat_penalty"] {
        match (number_field(field(obj, name), name)?, repetition) {
            (None, _) => {}
            (Some(x), _) if !(x > 0.0 && x.is_finite()) => {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be a number > 0 (1 is off), got {x}"),
                ));
            }
            (Some(x), Some((y, first))) if x != y => {
                return Err(ApiError::invalid(
                    name,
                    format!("`{first}` ({y}) and `{name}` ({x}) disagree; send one of them"),
                ));
            }
            (Some(x), _) => repetition = Some((x, name)),
        }
    }
    let last_n = match int_field(field(obj, "repeat_last_n"), "repeat_last_n")? {
        None => defaults.last_n,
        Some(-1) => Some(usize::MAX),
        Some(n) if n >= 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => {
            return Err(ApiError::invalid(
                "repeat_last_n",
                format!("`repeat_last_n` must be -1 (all), 0 (off) or a positive integer, got {n}"),
            ));
        }
    };
    Ok(Penalties {
        repetition: repetition.map_or(defaults.repetition, |(x, _)| x as f32),
        presence,
        frequency,
        last_n,
    })
}
