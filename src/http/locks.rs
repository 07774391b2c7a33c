//! The lock routes — acquire, release, renew and inspect a lease on `/locks/{key}` — and the
//! JSON bodies they answer with. Each handler turns the request into domain values, asks the
//! [`LockService`](crate::lock::LockService) and shapes its answer; every refusal is an
//! [`ApiError`].

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use super::openapi::{
    AcquireBody, Forbidden, KeyParam, Locked, NotGranted, NotHeld, NotOwner, RenewBody,
    RequestRefused, StoreUnavailable, TokenHeader, TokenQuery, Unauthorized,
};
use super::params::{KeyPath, Params};
use super::{AppState, Limits};
use crate::domain::{LockKey, Owner, RequestId, Ttl, WaitFor};
use crate::lock::AcquireRequest;
use crate::store::{Lease, Store};

/// The lock routes, without their state.
pub(super) fn locks_router<S: Store>() -> Router<AppState<S>> {
    Router::new()
        .route(
            "/locks/{key}",
            post(acquire::<S>).delete(release::<S>).get(inspect::<S>),
        )
        .route("/locks/{key}/renew", post(renew::<S>))
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
        RequestRefused,
        Unauthorized,
        Forbidden,
        Locked,
        NotGranted,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn acquire<S: Store>(
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
/// `token` query parameter, never in a body. After a `503`, the lease may still be held.
#[utoipa::path(
    delete,
    path = "/locks/{key}",
    tag = "locks",
    params(KeyParam, TokenHeader, TokenQuery),
    responses(
        (status = 204, description = "Released."),
        RequestRefused,
        Unauthorized,
        Forbidden,
        NotHeld,
        NotOwner,
        StoreUnavailable,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn release<S: Store>(
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
        RequestRefused,
        Unauthorized,
        Forbidden,
        NotHeld,
        NotOwner,
        StoreUnavailable,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn renew<S: Store>(
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
/// Who holds the lock and until when; never the token. Takes no parameters.
#[utoipa::path(
    get,
    path = "/locks/{key}",
    tag = "locks",
    params(KeyParam),
    responses(
        (status = 200, description = "Held: the live lease.", body = InspectBody),
        RequestRefused,
        Unauthorized,
        Forbidden,
        NotHeld,
        StoreUnavailable,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn inspect<S: Store>(
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
