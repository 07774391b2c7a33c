//! The HTTP API (`../shared/design/api.md`): routes, handlers and the JSON they speak. Knows
//! HTTP and the lock service, nothing of Redis.

pub mod error;
pub mod openapi;
pub mod params;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use tower_http::trace::TraceLayer;
use utoipa::ToSchema;

use crate::domain::{LockKey, Owner, RequestId, Ttl, WaitFor};
use crate::lock::{AcquireRequest, LockService};
use crate::store::{Lease, Store};
pub use error::ApiError;
use error::Body as ErrorBody;
use openapi::{AcquireBody, KeyParam, LockedError, RenewBody, TokenHeader, TokenQuery};
use params::{BODY_LIMIT, KeyPath, Params};

/// Every route [`router`] serves, as (method, path in OpenAPI's syntax); a `GET` route also
/// answers `HEAD`. `GET /openapi.json` documents exactly these. `tests/api/openapi.rs` checks
/// the document against this list, and the router too: every method on every listed path, and
/// paths that are not routes (near misses of these, `/`, `/docs`, …), must answer as listed.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/locks/{key}"),
    ("DELETE", "/locks/{key}"),
    ("GET", "/locks/{key}"),
    ("POST", "/locks/{key}/renew"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
];

/// Defaults and bounds for request parameters, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub default_wait_ms: u64,
    pub max_wait_ms: u64,
}

/// What every handler shares.
pub struct AppState<S> {
    pub locks: LockService<S>,
    pub limits: Limits,
}

impl<S> Clone for AppState<S> {
    fn clone(&self) -> Self {
        Self {
            locks: self.locks.clone(),
            limits: self.limits,
        }
    }
}

/// The whole API as a router; tests drive it directly or over a socket.
pub fn router<S: Store>(state: AppState<S>) -> Router {
    Router::new()
        .route(
            "/locks/{key}",
            post(acquire::<S>).delete(release::<S>).get(inspect::<S>),
        )
        .route("/locks/{key}/renew", post(renew::<S>))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
        .route("/openapi.json", get(openapi_json))
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(TraceLayer::new_for_http().make_span_with(request_span))
        .with_state(state)
}

/// The span of one request: method and path, never the query string, which may carry a token.
fn request_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
    )
}

/// The body of a grant (acquire, renew). The token is shown here and nowhere else.
#[derive(Serialize, ToSchema)]
#[schema(as = Grant)]
struct GrantBody<'a> {
    /// The lock's key, as decoded.
    key: &'a str,
    /// The secret that proves the lease is yours (release, renew): opaque, URL-safe, at most
    /// 128 characters. Only acquire returns it, once; renew echoes the one it was given.
    #[schema(max_length = 128)]
    token: &'a str,
    /// The fencing number: for this key, greater than every fence granted before, across
    /// broker and Redis restarts. Renewals keep it.
    #[schema(minimum = 1)]
    fence: u64,
    /// The lease length in ms.
    #[schema(minimum = 1)]
    ttl_ms: u64,
    /// When the lease ends, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
}

impl<'a> GrantBody<'a> {
    fn new(key: &'a LockKey, lease: &'a Lease) -> Self {
        Self {
            key: key.as_str(),
            token: lease.token.as_str(),
            fence: lease.fence,
            ttl_ms: lease.ttl_ms,
            expires_at_ms: lease.expires_at_ms,
        }
    }
}

/// Who holds a lock and until when. Never the token.
#[derive(Serialize, ToSchema)]
#[schema(as = Lease)]
struct InspectBody<'a> {
    /// The lock's key, as decoded.
    key: &'a str,
    /// The fence of the live lease.
    #[schema(minimum = 1)]
    fence: u64,
    /// When the lease ends, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
    /// Milliseconds until the lease ends.
    ttl_remaining_ms: u64,
    /// The `owner` label the acquire gave, or null.
    #[schema(required = true)]
    owner: Option<&'a str>,
}

fn ttl_param(params: &mut Params, limits: &Limits) -> Result<Ttl, ApiError> {
    Ok(Ttl::parse(
        params.int("ttl_ms")?.unwrap_or(limits.default_ttl_ms),
        limits.max_ttl_ms,
    )?)
}

/// Acquire a lock
///
/// Grants a lease on `key` if nobody holds it (or the holder's lease has expired), waiting up
/// to `wait_ms` while someone else holds it. Answers `201` only when the lease is really held.
#[utoipa::path(
    post,
    path = "/locks/{key}",
    tag = "locks",
    params(KeyParam, AcquireBody),
    request_body(
        content = ref("#/components/schemas/AcquireBody"),
        content_type = "application/json",
        description = "The parameters, instead of or besides the query string; may be empty."
    ),
    responses(
        (status = 201, description = "Granted: the lease is held.", body = GrantBody),
        (status = 400, description = "`invalid_request`: a bad key or parameter (not an integer, \
            `ttl_ms` 0 or over `max_ttl_ms`, `wait_ms` over `max_wait_ms`, a bad `owner` or \
            `request_id`), an unknown parameter, or malformed JSON.", body = ErrorBody),
        (status = 409, description = "`locked`: still held by someone else when `wait_ms` ran out.",
            body = LockedError,
            headers(("Retry-After" = u64, description = "Seconds until the current lease \
                ends, rounded up, at least 1."))),
        (status = 413, description = "`payload_too_large`: the body is over 16 KiB.", body = ErrorBody),
        (status = 415, description = "`unsupported_media_type`: a non-empty body that is not \
            `application/json`.", body = ErrorBody),
        (status = 503, description = "Not granted. `store_unavailable`: the store could not be \
            reached or did not answer in time (`store_timeout_ms`), or, with `Retry-After`, the \
            broker holds grants back after Redis lost its data; `too_many_waiters`, with \
            `Retry-After: 1`: `max_waiters` acquires already wait on this broker; \
            `shutting_down`: the broker stopped while the request waited. Try again, or another \
            broker.", body = ErrorBody,
            headers(("Retry-After" = u64, description = "With `too_many_waiters` and while \
                grants are held back: seconds to wait before trying again."))),
    )
)]
async fn acquire<S: Store>(
    State(state): State<AppState<S>>,
    KeyPath(key): KeyPath,
    mut params: Params,
) -> Result<Response, ApiError> {
    let ttl = ttl_param(&mut params, &state.limits)?;
    let wait = WaitFor::parse(
        params
            .int("wait_ms")?
            .unwrap_or(state.limits.default_wait_ms),
        state.limits.max_wait_ms,
    )?;
    let owner = params
        .text("owner")?
        .map(|o| Owner::parse(&o))
        .transpose()?;
    let request_id = params
        .text("request_id")?
        .map(|r| RequestId::parse(&r))
        .transpose()?;
    params.finish()?;
    let request = AcquireRequest {
        ttl,
        wait,
        owner,
        request_id,
    };
    let lease = state.locks.acquire(&key, request).await?;
    Ok((StatusCode::CREATED, Json(GrantBody::new(&key, &lease))).into_response())
}

/// Release a lock
///
/// Ends the lease that the token holds. The token comes in the `Lock-Token` header or the
/// `token` query parameter, never in a body.
#[utoipa::path(
    delete,
    path = "/locks/{key}",
    tag = "locks",
    params(KeyParam, TokenHeader, TokenQuery),
    responses(
        (status = 204, description = "Released."),
        (status = 400, description = "`invalid_request`: no token, a malformed token, a token \
            in the body, a bad key, or an unknown parameter.", body = ErrorBody),
        (status = 404, description = "`not_held`: nobody holds the lock (it was released, or \
            the lease expired).", body = ErrorBody),
        (status = 409, description = "`not_owner`: someone else's live lease holds the key \
            (yours expired and was taken over, or the token is wrong).", body = ErrorBody),
        (status = 413, description = "`payload_too_large`: a body over 16 KiB.", body = ErrorBody),
        (status = 415, description = "`unsupported_media_type`: a non-empty body that is not \
            `application/json`.", body = ErrorBody),
        (status = 503, description = "`store_unavailable`: the store could not be reached or \
            did not answer in time; the lease may still be held.", body = ErrorBody),
    )
)]
async fn release<S: Store>(
    State(state): State<AppState<S>>,
    KeyPath(key): KeyPath,
    mut params: Params,
) -> Result<StatusCode, ApiError> {
    let token = params.token()?;
    params.finish()?;
    state.locks.release(&key, &token).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Renew a lease
///
/// Moves the end of the token's live lease to `ttl_ms` after the renewal. Same token, same
/// fence. The token comes as for release.
#[utoipa::path(
    post,
    path = "/locks/{key}/renew",
    tag = "locks",
    params(KeyParam, TokenHeader, TokenQuery, RenewBody),
    request_body(
        content = ref("#/components/schemas/RenewBody"),
        content_type = "application/json",
        description = "`ttl_ms`, instead of or besides the query string; may be empty. Never \
            the token."
    ),
    responses(
        (status = 200, description = "Renewed: the grant again, with the new expiry.", body = GrantBody),
        (status = 400, description = "`invalid_request`: no token, a malformed token, a token \
            in the body, a bad key or `ttl_ms`, an unknown parameter, or malformed JSON.",
            body = ErrorBody),
        (status = 404, description = "`not_held`: nobody holds the lock (it was released, or \
            the lease expired).", body = ErrorBody),
        (status = 409, description = "`not_owner`: someone else's live lease holds the key \
            (yours expired and was taken over, or the token is wrong).", body = ErrorBody),
        (status = 413, description = "`payload_too_large`: the body is over 16 KiB.", body = ErrorBody),
        (status = 415, description = "`unsupported_media_type`: a non-empty body that is not \
            `application/json`.", body = ErrorBody),
        (status = 503, description = "`store_unavailable`: the store could not be reached or \
            did not answer in time.", body = ErrorBody),
    )
)]
async fn renew<S: Store>(
    State(state): State<AppState<S>>,
    KeyPath(key): KeyPath,
    mut params: Params,
) -> Result<Response, ApiError> {
    let token = params.token()?;
    let ttl = ttl_param(&mut params, &state.limits)?;
    params.finish()?;
    let lease = state.locks.renew(&key, &token, ttl).await?;
    Ok(Json(GrantBody::new(&key, &lease)).into_response())
}

/// Inspect a lock
///
/// Who holds the lock and until when; never the token.
#[utoipa::path(
    get,
    path = "/locks/{key}",
    tag = "locks",
    params(KeyParam),
    responses(
        (status = 200, description = "Held: the live lease.", body = InspectBody),
        (status = 400, description = "`invalid_request`: a bad key, or any parameter (this \
            endpoint takes none).", body = ErrorBody),
        (status = 404, description = "`not_held`: nobody holds the lock (free, released or \
            expired).", body = ErrorBody),
        (status = 413, description = "`payload_too_large`: a body over 16 KiB.", body = ErrorBody),
        (status = 415, description = "`unsupported_media_type`: a non-empty body that is not \
            `application/json`.", body = ErrorBody),
        (status = 503, description = "`store_unavailable`: the store could not be reached or \
            did not answer in time.", body = ErrorBody),
    )
)]
async fn inspect<S: Store>(
    State(state): State<AppState<S>>,
    KeyPath(key): KeyPath,
    params: Params,
) -> Result<Response, ApiError> {
    params.finish()?;
    let view = state.locks.inspect(&key).await?;
    Ok(Json(InspectBody {
        key: key.as_str(),
        fence: view.lease.fence,
        expires_at_ms: view.lease.expires_at_ms,
        ttl_remaining_ms: view.ttl_remaining_ms(),
        owner: view.lease.owner.as_ref().map(Owner::as_str),
    })
    .into_response())
}

/// The body of `/healthz` and `/readyz`.
#[derive(Serialize, ToSchema)]
#[schema(as = Status)]
struct StatusBody {
    /// `ok` (healthz) or `ready` (readyz).
    #[schema(value_type = String, examples("ok", "ready"))]
    status: &'static str,
}

/// Liveness
///
/// `200` while the process serves; it does not ask the store.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "The process serves.", body = StatusBody))
)]
async fn healthz() -> Json<StatusBody> {
    Json(StatusBody { status: "ok" })
}

/// Metrics
///
/// Counters and latencies of acquires, releases, renewals and store calls, and the number of
/// waiting acquires, in the OpenMetrics text format (Prometheus).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((
        status = 200,
        description = "The metrics.",
        body = String,
        content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8"
    ))
)]
async fn metrics<S: Store>(State(state): State<AppState<S>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        state.locks.render_metrics(),
    )
        .into_response()
}

/// Readiness
///
/// `200` when the store answers, `503` otherwise: a load balancer takes the broker out of
/// rotation.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "The store answers.", body = StatusBody),
        (status = 503, description = "`store_unavailable`: the store could not be reached or \
            did not answer in time.", body = ErrorBody),
    )
)]
async fn readyz<S: Store>(State(state): State<AppState<S>>) -> Result<Json<StatusBody>, ApiError> {
    state.locks.ready().await?;
    Ok(Json(StatusBody { status: "ready" }))
}

/// This document
///
/// The OpenAPI document of this API.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI document.", body = Object))
)]
async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(openapi::document())
}
