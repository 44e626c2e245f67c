//! Cross-origin requests (CORS): which web pages may call the server from a browser.
//!
//! Off by default: a page on any site the user visits could otherwise drive a local model.
//! `--cors-origin ORIGIN` (repeatable, or `*`) allows pages of those origins: their requests'
//! responses carry `Access-Control-Allow-Origin`, and their preflights (`OPTIONS` with
//! `Access-Control-Request-Method`) are answered before authentication, since browsers send
//! them without credentials. A preflight from an origin not allowed gets a 403 naming the flag.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::server::AppState;

/// Origins allowed to call the server from a browser.
#[derive(Clone, Debug, Default)]
pub struct CorsOrigins {
    any: bool,
    origins: Vec<String>,
}

impl CorsOrigins {
    /// From `--cors-origin` values: origins (`https://host:port`) or `*` for any.
    pub fn new(values: &[String]) -> Self {
        let any = values.iter().any(|v| v == "*");
        let origins = values
            .iter()
            .filter(|v| *v != "*")
            .map(|v| v.trim_end_matches('/').to_owned())
            .collect();
        CorsOrigins { any, origins }
    }

    /// The `Access-Control-Allow-Origin` value for a request from `origin`, if it is allowed.
    fn allow(&self, origin: &str) -> Option<HeaderValue> {
        if self.any {
            return Some(HeaderValue::from_static("*"));
        }
        self.origins
            .iter()
            .any(|o| o == origin)
            .then(|| HeaderValue::from_str(origin).ok())
            .flatten()
    }
}

const ALLOWED_METHODS: &str = "GET, POST, OPTIONS";
const DEFAULT_ALLOWED_HEADERS: &str = "Authorization, Content-Type";

/// The outermost layer: answers preflights, and marks allowed origins' responses.
pub(crate) async fn cors(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let allowed = origin.as_deref().and_then(|o| state.cors.allow(o));
    if request.method() == Method::OPTIONS {
        return preflight(request.headers(), origin.as_deref(), allowed);
    }
    let mut response = next.run(request).await;
    if let Some(allowed) = allowed {
        let headers = response.headers_mut();
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
        headers.append(header::VARY, HeaderValue::from_static("Origin"));
    }
    response
}

/// An `OPTIONS` request: a browser's preflight, or a client asking what a route allows.
fn preflight(headers: &HeaderMap, origin: Option<&str>, allowed: Option<HeaderValue>) -> Response {
    let is_preflight = headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    match (is_preflight, origin, allowed) {
        (true, Some(origin), None) => ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            format!(
                "cross-origin requests from {origin} are not allowed; start the server with \
                 --cors-origin {origin} (or --cors-origin '*')"
            ),
        )
        .into_response(),
        (_, _, allowed) => {
            let mut response = StatusCode::NO_CONTENT.into_response();
            let out = response.headers_mut();
            out.insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
            if let Some(allowed) = allowed {
                let requested = headers
                    .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
                    .cloned()
                    .unwrap_or(HeaderValue::from_static(DEFAULT_ALLOWED_HEADERS));
                out.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
                out.insert(
                    header::ACCESS_CONTROL_ALLOW_METHODS,
                    HeaderValue::from_static(ALLOWED_METHODS),
                );
                out.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, requested);
                out.insert(
                    header::ACCESS_CONTROL_MAX_AGE,
                    HeaderValue::from_static("600"),
                );
                out.append(header::VARY, HeaderValue::from_static("Origin"));
            }
            response
        }
    }
}
