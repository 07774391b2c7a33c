//! The HTTP API (`../shared/design/api.md`): routes, handlers and the JSON they speak. Knows
//! HTTP and the lock service, nothing of Redis.

pub mod error;
pub mod params;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use tower_http::trace::TraceLayer;

use crate::domain::{LockKey, Owner, RequestId, Ttl, WaitFor};
use crate::lock::{AcquireRequest, LockService};
use crate::store::{Lease, Store};
pub use error::ApiError;
use params::{BODY_LIMIT, KeyPath, Params};

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
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// The body of a grant (acquire, renew). The token is shown here and nowhere else.
#[derive(Serialize)]
struct GrantBody<'a> {
    key: &'a str,
    token: &'a str,
    fence: u64,
    ttl_ms: u64,
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

#[derive(Serialize)]
struct InspectBody<'a> {
    key: &'a str,
    fence: u64,
    expires_at_ms: u64,
    ttl_remaining_ms: u64,
    owner: Option<&'a str>,
}

fn ttl_param(params: &mut Params, limits: &Limits) -> Result<Ttl, ApiError> {
    Ok(Ttl::parse(
        params.int("ttl_ms")?.unwrap_or(limits.default_ttl_ms),
        limits.max_ttl_ms,
    )?)
}

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

#[derive(Serialize)]
struct StatusBody {
    status: &'static str,
}

async fn healthz() -> Json<StatusBody> {
    Json(StatusBody { status: "ok" })
}

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

async fn readyz<S: Store>(State(state): State<AppState<S>>) -> Result<Json<StatusBody>, ApiError> {
    state.locks.ready().await?;
    Ok(Json(StatusBody { status: "ready" }))
}
