//! ember-server: an OpenAI-compatible HTTP API over one [`Engine`](ember_engine::Engine).
//!
//! A request's path: [`routes`] authenticates, parses and validates it ([`openai`]), tokenizes
//! the prompt, and queues a [`worker::Job`]; the engine thread ([`worker`]) generates and sends
//! back token events; the route turns them into a response or an SSE stream, cutting at stop
//! strings and splitting reasoning from content ([`text`]). Errors are OpenAI-shaped
//! ([`error`]) and counted in [`metrics`]. Connections are accepted by [`listen`] (header
//! timeout, connection limit) and cross-origin calls allowed by [`cors`].
//!
//! Architecture invariant: only this crate knows HTTP and JSON wire formats; the engine runs on
//! its own thread and never blocks the async runtime.

pub mod cors;
pub mod error;
mod listen;
pub mod metrics;
pub mod openai;
mod routes;
mod server;
pub mod text;
pub mod tools;
pub mod worker;

pub use cors::CorsOrigins;
pub use listen::ConnectionLimits;
pub use server::{SamplingOverrides, ServerOptions, run, serve};
