//! The semaphore routes — take, give back, renew and inspect a permit on `/semaphores/{key}`,
//! list held semaphores on `/semaphores` — and their JSON bodies. A semaphore of `limit` permits
//! is a key whose leases are at most `limit` at once; each permit is a lease as a lock's is
//! (token, fence, expiry). Semaphore keys are a space of their own: `/semaphores/a` and
//! `/locks/a` are unrelated.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use super::error::ApiError;
use super::locks::{HolderBody, aggregate, holder_bodies, release_in};
use super::openapi::{
    Forbidden, ForceRefused, NotGranted, NotHeld, NotOwner, PermitRefused, RequestRefused,
    StoreUnavailable, Unauthorized,
};
use super::params::{KeyPath, Params, TokenHeader, token};
use super::requests::{
    ListQueryParams, NoParams, ReleaseQuery, RenewBody, SemaphoreAcquireBody, acquire_request,
    list_query, ttl_param,
};
use crate::domain::LockKey;
use crate::store::Kind;
use crate::store::{Lease, Listed, MAX_SEMAPHORE_LIMIT, Space, Store};

/// The semaphore routes, without their state.
pub(super) fn semaphores_router<S: Store>() -> Router<AppState<S>> {
    Router::new()
        .route("/semaphores", get(list::<S>))
        .route(
            "/semaphores/{key}",
            post(acquire::<S>).delete(release::<S>).get(inspect::<S>),
        )
        .route("/semaphores/{key}/renew", post(renew::<S>))
}

/// The body of a permit taken: a grant, with the semaphore's limit.
#[derive(Serialize, ToSchema)]
#[schema(as = PermitGrant)]
struct PermitBody<'a> {
    /// The semaphore's key, as decoded.
    key: &'a str,
    /// The secret that proves the permit is yours (release, renew). Shown once, here.
    #[schema(max_length = 128)]
    token: &'a str,
    /// The permit's fencing number: for this semaphore, greater than every fence granted
    /// before.
    #[schema(minimum = 1)]
    fence: u64,
    /// The lease length in ms.
    #[schema(minimum = 1)]
    ttl_ms: u64,
    /// When the permit ends, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
    /// How many permits the semaphore has.
    #[schema(minimum = 1)]
    limit: u32,
}

/// Who holds a semaphore's permits. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = Semaphore)]
struct InspectBody<'a> {
    /// The semaphore's key, as decoded.
    key: &'a str,
    /// The limit the holders took their permits with.
    #[schema(minimum = 1)]
    limit: u32,
    /// Each live permit, by fence.
    holders: Vec<HolderBody<'a>>,
}

/// One held semaphore in a listing. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = ListedSemaphore)]
struct ListedBody<'a> {
    /// The semaphore's key.
    key: &'a str,
    /// The limit its holders use.
    #[schema(minimum = 1)]
    limit: u32,
    /// How many permits are taken.
    #[schema(minimum = 1)]
    holders: usize,
    /// The highest fence among the permits.
    #[schema(minimum = 1)]
    fence: u64,
    /// When the last permit ends.
    expires_at_ms: u64,
    /// Milliseconds until `expires_at_ms`.
    ttl_remaining_ms: u64,
}

/// A page of held semaphores.
#[derive(Serialize, ToSchema)]
#[schema(as = SemaphoreList)]
struct ListBody<'a> {
    /// The held semaphores whose keys start with the prefix, in key order.
    semaphores: Vec<ListedBody<'a>>,
    /// Give it as `cursor` for the next page; null on the last page.
    #[schema(required = true)]
    next_cursor: Option<&'a str>,
}

/// Take a permit
///
/// Grants one of the semaphore's `limit` permits if one is free, waiting up to `wait_ms` while
/// all are taken. Every holder must use the same `limit`: another one is `409 limit_mismatch`
/// while permits taken with the first are live.
#[utoipa::path(
    post,
    path = "/semaphores/{key}",
    operation_id = "acquire_permit",
    tag = "semaphores",
    params(KeyPath, SemaphoreAcquireBody),
    request_body(
        content = ref("#/components/schemas/SemaphoreAcquireBody"),
        content_type = "application/json",
        description = "The parameters, instead of or besides the query string."
    ),
    responses(
        (status = 201, description = "Granted: the permit is held.", body = PermitBody),
        RequestRefused,
        Unauthorized,
        Forbidden,
        PermitRefused,
        NotGranted,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn acquire<S: Store>(
    State(state): State<AppState<S>>,
    KeyPath(key): KeyPath,
    Params { values, .. }: Params<SemaphoreAcquireBody>,
) -> Result<Response, ApiError> {
    let limit = match values.limit {
        Some(n) if (1..=u64::from(MAX_SEMAPHORE_LIMIT)).contains(&n) => n as u32,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "limit must be between 1 and {MAX_SEMAPHORE_LIMIT}."
            )));
        }
        None => {
            return Err(ApiError::invalid(format!(
                "limit is required: how many permits the semaphore has (1 to \
                     {MAX_SEMAPHORE_LIMIT})."
            )));
        }
    };
    let request = acquire_request(
        Kind::Semaphore { limit },
        values.ttl_ms,
        values.wait_ms,
        values.owner,
        values.request_id,
        &state.limits,
    )?;
    let lease = state.locks.acquire(&key, request).await?;
    Ok((StatusCode::CREATED, Json(permit_body(&key, &lease, limit))).into_response())
}

fn permit_body<'a>(key: &'a LockKey, lease: &'a Lease, limit: u32) -> PermitBody<'a> {
    PermitBody {
        key: key.as_str(),
        token: lease.token.as_str(),
        fence: lease.fence,
        ttl_ms: lease.ttl_ms,
        expires_at_ms: lease.expires_at_ms,
        limit,
    }
}

/// Give back a permit
///
/// Ends the permit that the token holds; the token comes as for locks. With `force=true` and no
/// token, ends every permit of the semaphore instead.
#[utoipa::path(
    delete,
    path = "/semaphores/{key}",
    operation_id = "release_permit",
    tag = "semaphores",
    params(KeyPath, TokenHeader, ReleaseQuery),
    responses(
        (status = 204, description = "Released (with `force=true`: every permit ended)."),
        RequestRefused,
        Unauthorized,
        ForceRefused,
        NotHeld,
        NotOwner,
        StoreUnavailable,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn release<S: Store>(
    State(state): State<AppState<S>>,
    KeyPath(key): KeyPath,
    params: Params<ReleaseQuery>,
) -> Result<StatusCode, ApiError> {
    release_in(&state, Space::Semaphores, &key, params).await
}

/// Renew a permit
///
/// Moves the end of the token's live permit to `ttl_ms` after the renewal. Same token, same
/// fence. The token comes as for release.
#[utoipa::path(
    post,
    path = "/semaphores/{key}/renew",
    operation_id = "renew_permit",
    tag = "semaphores",
    params(KeyPath, TokenHeader, RenewBody),
    request_body(
        content = ref("#/components/schemas/RenewBody"),
        content_type = "application/json",
        description = "`ttl_ms`, instead of or besides the query string; may be empty. Never \
            the token."
    ),
    responses(
        (status = 200, description = "Renewed: the grant again, with the new expiry.", body = PermitBody),
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
    params: Params<RenewBody>,
) -> Result<Response, ApiError> {
    let token = token(params.token_header, params.values.token)?;
    let ttl = ttl_param(params.values.ttl_ms, &state.limits)?;
    let lease = state
        .locks
        .renew(Space::Semaphores, &key, &token, ttl)
        .await?;
    let limit = lease.limit.unwrap_or_default();
    Ok(Json(permit_body(&key, &lease, limit)).into_response())
}

/// Inspect a semaphore
///
/// Its limit and its live permits; never a token. Takes no parameters.
#[utoipa::path(
    get,
    path = "/semaphores/{key}",
    operation_id = "inspect_semaphore",
    tag = "semaphores",
    params(KeyPath),
    responses(
        (status = 200, description = "Held: the live permits.", body = InspectBody),
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
    _: Params<NoParams>,
) -> Result<Response, ApiError> {
    let view = state.locks.permits(&key).await?;
    Ok(Json(InspectBody {
        key: key.as_str(),
        limit: view.limit.unwrap_or_default(),
        holders: holder_bodies(view.now_ms, &view.holders),
    })
    .into_response())
}

/// List held semaphores
///
/// The semaphores with live permits whose keys start with `prefix`, a page at a time, in key
/// order; never a token. Paged and authorised as `GET /locks`.
#[utoipa::path(
    get,
    path = "/semaphores",
    operation_id = "list_semaphores",
    tag = "semaphores",
    params(ListQueryParams),
    responses(
        (status = 200, description = "A page of held semaphores.", body = ListBody),
        RequestRefused,
        Unauthorized,
        Forbidden,
        StoreUnavailable,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn list<S: Store>(
    State(state): State<AppState<S>>,
    params: Params<ListQueryParams>,
) -> Result<Response, ApiError> {
    let query = list_query(Space::Semaphores, params.values)?;
    let page = state.locks.list(&query).await?;
    let semaphores = page
        .entries
        .iter()
        .filter_map(|entry| listed(page.now_ms, entry))
        .collect();
    Ok(Json(ListBody {
        semaphores,
        next_cursor: page.next_cursor.as_deref(),
    })
    .into_response())
}

fn listed(now_ms: u64, entry: &Listed) -> Option<ListedBody<'_>> {
    let (fence, expires_at_ms) = aggregate(&entry.holders)?;
    Some(ListedBody {
        key: entry.key.as_str(),
        limit: entry.limit?,
        holders: entry.holders.len(),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(now_ms),
    })
}
