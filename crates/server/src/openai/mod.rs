//! The OpenAI wire format: parsing and validating `/v1/chat/completions` and `/v1/completions`
//! request bodies, and building the response JSON (whole responses, SSE chunks, model list).
//!
//! Bodies are parsed into a [`serde_json::Value`] first and then read field by field, so that
//! every error is a 400 naming the field at fault in `param` (`messages[2].role`, `stop[1]`).
//! Conventions:
//! - `null` means the same as an absent field everywhere (OpenAI's SDKs send either).
//! - Integers may be written as integral floats (`16.0`), as pydantic-based servers accept.
//! - Fields OpenAI has that ember does not implement are rejected when set to anything but
//!   their neutral value (`logit_bias: {}`, `n: 1`): a request is never silently answered as
//!   if they had been honoured. Fields ember
//!   does not know at all (`user`, `metadata`, `store`, ...) are ignored.
//!
//! [`request`] parses and checks bodies (with [`sampling_fields`] for the sampling fields,
//! penalties and output constraints, [`tool_fields`] for tools, [`fields`] for reading one
//! field); [`response`] builds the JSON sent back.

mod fields;
mod request;
mod response;
mod sampling_fields;
mod tool_fields;

pub use request::*;
pub use response::*;

/// The largest `max_tokens` accepted; above it a value is a client bug, not a wish.
pub const MAX_TOKENS_LIMIT: usize = 1 << 24;
/// The most stop strings one request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// The most alternatives `top_logprobs` / completions `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// What a logprob of `-inf` (or a non-finite one) is sent as; JSON has no infinities.
pub const MIN_LOGPROB: f32 = -9999.0;
