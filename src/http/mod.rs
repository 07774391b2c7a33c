//! The HTTP API: the router, its state, and the layers every request goes through. Knows HTTP
//! and the lock service, nothing of Redis. [`router`] lists every route and its handler: the
//! lock routes' in `locks`, the semaphore routes' in `semaphores` (what both do alike in
//! `leases`, the JSON they answer with in `bodies`), and the operations routes' (health,
//! readiness, metrics, the OpenAPI document) in `ops`. [`api`] is the router behind the layers
//! every request goes through (`layers`, the `gate` among them): what the server serves.

pub(crate) mod auth;
mod bodies;
pub(crate) mod error;
mod gate;
mod layers;
mod leases;
mod locks;
pub(crate) mod openapi;
mod ops;
pub(crate) mod params;
mod requests;
mod semaphores;
mod sessions;
mod several;

use std::sync::Arc;

use axum::Router;
use axum::middleware;
use axum::routing::{get, post};

use crate::lock::LockService;
use crate::store::AnyStore;
pub(crate) use auth::Auth;
pub(crate) use error::ApiError;
pub(crate) use layers::{Api, ApiBody};

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
    ("POST", "/locks"),
    ("DELETE", "/locks"),
    ("POST", "/semaphores/{key}"),
    ("DELETE", "/semaphores/{key}"),
    ("GET", "/semaphores/{key}"),
    ("POST", "/semaphores/{key}/renew"),
    ("GET", "/semaphores"),
    ("POST", "/sessions"),
    ("DELETE", "/sessions/{session}"),
    ("GET", "/sessions/{session}"),
    ("POST", "/sessions/{session}/renew"),
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
pub(crate) struct AppState {
    /// The lock service every lock route and readiness ask.
    pub locks: LockService<AnyStore>,
    /// The request parameters' defaults and bounds.
    pub limits: Limits,
    /// With an auth file: the policy the lock routes are guarded by. `None`: no auth.
    pub auth: Option<Auth>,
    /// Whether `/metrics` and `/openapi.json` need a token too (with `auth` only).
    pub auth_metrics: bool,
    /// Tests only: serve [`PANIC_ROUTE`].
    pub panic_route: bool,
}

/// A route whose handler panics, served only when [`AppState::panic_route`] is set: how the
/// tests check that a panic answers `500 internal` and leaves its connection serving.
const PANIC_ROUTE: &str = "/_test/panic";

/// The state the router hands each request: the [`AppState`] behind one `Arc`, so that a
/// request (which axum hands a clone of it, and whose handler holds one while it waits) costs
/// one reference count and eight bytes, not a copy of every field and a count per `Arc` in it.
pub(crate) type SharedState = Arc<AppState>;

/// The whole API as the server serves it: [`router`] behind the layers every request goes
/// through (`layers`: token headers marked sensitive, the gate, panics caught).
pub(crate) fn api(state: AppState) -> Api {
    let outage = state.locks.outage().clone();
    layers::around(router(state), outage)
}

/// Every route and its handler.
fn router(state: AppState) -> Router {
    let state = Arc::new(state);
    let operations_guard = state.auth.clone().filter(|_| state.auth_metrics);
    let document = openapi::document_json(&state.limits, state.locks.cursor_pattern());
    let lease_routes = Router::new()
        .route(
            "/locks",
            get(locks::list_locks)
                .post(several::acquire_locks)
                .delete(several::release_locks),
        )
        .route(
            "/locks/{key}",
            post(locks::acquire_lock)
                .delete(locks::release_lock)
                .get(locks::inspect_lock),
        )
        .route("/locks/{key}/renew", post(locks::renew_lock))
        .route("/semaphores", get(semaphores::list_semaphores))
        .route(
            "/semaphores/{key}",
            post(semaphores::acquire_permit)
                .delete(semaphores::release_permit)
                .get(semaphores::inspect_semaphore),
        )
        .route("/semaphores/{key}/renew", post(semaphores::renew_permit))
        .route("/sessions", post(sessions::open_session))
        .route(
            "/sessions/{session}",
            get(sessions::read_session).delete(sessions::close_session),
        )
        .route("/sessions/{session}/renew", post(sessions::keep_alive));
    let routes = Router::new()
        .merge(guard_lock_routes(lease_routes, state.auth.clone()))
        .merge(ops::ops_router(operations_guard, document));
    let routes = match state.panic_route {
        true => routes.route(PANIC_ROUTE, get(panics)),
        false => routes,
    };
    routes
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(state)
}

/// The handler of [`PANIC_ROUTE`].
async fn panics() -> ApiError {
    panic!("the test route panics")
}

/// The lock routes' own layer: auth, as `routes.route_layer(…)`, so that it guards the lock
/// routes alone. A route layer runs only for a request that matched one of these routes: an
/// unknown path still answers `404 not_found`, and the operations routes (health, readiness,
/// metrics, the document) stay outside it. Without an auth file the routes pass through as they
/// are, at no cost per request.
fn guard_lock_routes(routes: Router<SharedState>, auth: Option<Auth>) -> Router<SharedState> {
    match auth {
        Some(auth) => {
            routes.route_layer(middleware::from_fn_with_state(auth, auth::guard_lock_route))
        }
        None => routes,
    }
}
