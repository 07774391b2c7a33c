//! The HTTP API: the router, its state, and the layers every request goes through. Knows HTTP
//! and the lock service, nothing of Redis. The routes live in `locks` (the lock routes),
//! `semaphores` (the semaphore routes) and `ops` (health, readiness, metrics, the OpenAPI
//! document); this module puts them together.

pub mod auth;
pub mod error;
mod leases;
mod locks;
pub mod openapi;
mod ops;
pub mod params;
mod requests;
mod semaphores;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::response::Response;
use tower_http::trace::TraceLayer;

use crate::lock::{LockService, Outage};
use crate::store::Store;
pub use auth::Auth;
pub use error::ApiError;
use error::Expected;
use params::BODY_LIMIT;

/// Every route `router` serves, as (method, path in OpenAPI's syntax); a `GET` route also
/// answers `HEAD`. `GET /openapi.json` documents exactly these. `tests/api/openapi.rs` checks
/// the document against this list, and the router too: every method on every listed path, and
/// paths that are not routes (near misses of these, `/`, `/docs`, …), must answer as listed.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/locks/{key}"),
    ("DELETE", "/locks/{key}"),
    ("GET", "/locks/{key}"),
    ("POST", "/locks/{key}/renew"),
    ("GET", "/locks"),
    ("POST", "/semaphores/{key}"),
    ("DELETE", "/semaphores/{key}"),
    ("GET", "/semaphores/{key}"),
    ("POST", "/semaphores/{key}/renew"),
    ("GET", "/semaphores"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
];

/// Defaults and bounds for request parameters, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The lease length of a request that gives no `ttl_ms`.
    pub default_ttl_ms: u64,
    /// The longest lease a request may ask for.
    pub max_ttl_ms: u64,
    /// How long an acquire that gives no `wait_ms` waits.
    pub default_wait_ms: u64,
    /// The longest wait an acquire may ask for.
    pub max_wait_ms: u64,
}

/// What every handler shares.
pub struct AppState<S> {
    /// The lock service every lock route and readiness ask.
    pub locks: LockService<S>,
    /// The request parameters' defaults and bounds.
    pub limits: Limits,
    /// With an auth file: the policy the lock routes are guarded by. `None`: no auth.
    pub auth: Option<Auth>,
    /// Whether `/metrics` and `/openapi.json` need a token too (with `auth` only).
    pub auth_metrics: bool,
}

impl<S> Clone for AppState<S> {
    fn clone(&self) -> Self {
        Self {
            locks: self.locks.clone(),
            limits: self.limits,
            auth: self.auth.clone(),
            auth_metrics: self.auth_metrics,
        }
    }
}

/// The whole API as a router; tests drive it directly or over a socket.
pub fn router<S: Store>(state: AppState<S>) -> Router {
    let operations_guard = state.auth.clone().filter(|_| state.auth_metrics);
    Router::new()
        .merge(guard_lock_routes(
            locks::router().merge(semaphores::router()),
            state.auth.clone(),
        ))
        .merge(ops::ops_router(operations_guard))
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn(auth::refuse_oversized_body))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_response(answer_logger(state.locks.outage().clone()))
                // A 5xx is logged by `answer_logger`, which knows an expected 503 from a bug.
                .on_failure(()),
        )
        .with_state(state)
}

/// Logs each answer: at DEBUG as tower-http does by default; a 5xx that is not one of the API's
/// answers (a bug) at ERROR. The API's own 503s (the store out or holding, a full wait queue, a
/// shutdown) are expected: those of an outage are counted into it, which is logged once when it
/// begins and once when it ends (see [`crate::lock::Outage`]), so a Redis restart pages nobody.
fn answer_logger(
    outage: Arc<Outage>,
) -> impl Fn(&Response, Duration, &tracing::Span) + Clone + Send + Sync + 'static {
    move |response: &Response, latency: Duration, _span: &tracing::Span| {
        let status = response.status();
        let latency_ms = latency.as_millis();
        match response.extensions().get::<Expected>() {
            Some(expected) => {
                // Counted into the outage in progress; outside one there is nothing to count
                // into (the count starts again with the next).
                if expected.store_unavailable && outage.is_down() {
                    outage.refused();
                }
                tracing::debug!(%status, latency_ms, "answered");
            }
            None if status.is_server_error() => {
                tracing::error!(%status, latency_ms, "answered with a server error");
            }
            None => tracing::debug!(%status, latency_ms, "answered"),
        }
    }
}

/// The lock routes' own layer: auth, as `routes.route_layer(…)`, so that it guards the lock
/// routes alone. A route layer runs only for a request that matched one of these routes: an
/// unknown path still answers `404 not_found`, and the operations routes (health, readiness,
/// metrics, the document) stay outside it. Without an auth file the routes pass through as they
/// are, at no cost per request.
fn guard_lock_routes<S: Store>(
    routes: Router<AppState<S>>,
    auth: Option<Auth>,
) -> Router<AppState<S>> {
    match auth {
        Some(auth) => {
            routes.route_layer(middleware::from_fn_with_state(auth, auth::guard_lock_route))
        }
        None => routes,
    }
}

/// The span of one request: method and path, never the query string, which may carry a token;
/// with auth, the name of the token that sent it (recorded by the auth layer), never the token.
fn request_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        token = tracing::field::Empty,
    )
}
