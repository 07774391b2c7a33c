//! The lock routes' handlers — acquire (exclusive or shared), release (by token or by force),
//! renew and inspect a lease on `/locks/{key}`, list held locks on `/locks` — each documented
//! for `/openapi.json` by its `#[utoipa::path]`. What they answer is in `super::bodies`; what
//! they do as the semaphore routes do, in `super::leases`; every refusal is an [`ApiError`].

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::SharedState;
use super::bodies::{GrantBody, LockBody, LockListBody};
use super::error::ApiError;
use super::error::responses::{
    AcquireRefused, InspectRefused, ListRefused, Locked, ReleaseRefused, RenewRefused,
};
use super::leases::{self, grant_response};
use super::params::{KeyPath, Params, TokenHeader};
use super::requests::{
    AcquireBody, ListQueryParams, ModeName, ReleaseQuery, RenewBody, WatchQuery, acquire_request,
};
use crate::domain::Space;

/// Acquire a lock
///
/// Grants a lease on `key` if nobody holds it (or the holder's lease has expired), waiting up
/// to `wait_ms` while someone else holds it. Answers `201` only when the lease is really held.
/// With `mode=shared`, a shared lease: granted beside other shared ones, never with an exclusive
/// one; an exclusive acquire that waits holds new shared ones back, so it is not starved.
#[utoipa::path(
    post,
    path = "/locks/{key}",
    operation_id = "acquire",
    tag = "locks",
    params(KeyPath, AcquireBody),
    request_body(
        content = ref("#/components/schemas/AcquireBody"),
        content_type = "application/json",
        description = "The parameters, instead of or besides the query string; may be empty."
    ),
    responses(
        (status = 201, description = "Granted: the lease is held.", body = GrantBody),
        Locked,
        AcquireRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn acquire_lock(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<AcquireBody>,
) -> Result<Response, ApiError> {
    let values = params.values;
    let request = acquire_request(
        ModeName::lock_kind(values.mode),
        values.ttl_ms,
        values.wait_ms,
        values.owner,
        values.request_id,
        values.session,
        &state.limits,
    )?;
    let lease = state.locks.acquire(&key, request).await?;
    Ok(grant_response(
        StatusCode::CREATED,
        &GrantBody::new(&key, &lease),
    ))
}

/// Release a lock
///
/// Ends the lease that the token holds (the exclusive one, or one shared lease). The token
/// comes in the `Lock-Token` header or the `token` query parameter, never in a body. After a
/// `503`, the lease may still be held. With `force=true` and no token, ends every lease on the
/// key instead.
#[utoipa::path(
    delete,
    path = "/locks/{key}",
    operation_id = "release",
    tag = "locks",
    params(KeyPath, TokenHeader, ReleaseQuery),
    responses(
        (
            status = 204,
            description = "Released (with `force=true`: every lease on the key ended)."
        ),
        ReleaseRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn release_lock(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<ReleaseQuery>,
) -> Result<StatusCode, ApiError> {
    leases::release(&state, Space::Locks, &key, params).await
}

/// Renew a lease
///
/// Moves the end of the token's live lease to `ttl_ms` after the renewal. Same token, same
/// fence. The token comes as for release.
#[utoipa::path(
    post,
    path = "/locks/{key}/renew",
    operation_id = "renew",
    tag = "locks",
    params(KeyPath, TokenHeader, RenewBody),
    request_body(
        content = ref("#/components/schemas/RenewBody"),
        content_type = "application/json",
        description = "`ttl_ms`, instead of or besides the query string; may be empty. \
            Never the token."
    ),
    responses(
        (status = 200, description = "Renewed: the grant again, with the new expiry.", body = GrantBody),
        RenewRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn renew_lock(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<RenewBody>,
) -> Result<Response, ApiError> {
    let lease = leases::renew(&state, Space::Locks, &key, params).await?;
    Ok(grant_response(
        StatusCode::OK,
        &GrantBody::new(&key, &lease),
    ))
}

/// Inspect or watch a lock
///
/// Who holds the lock, in which mode and until when; never a token. For shared holders,
/// `fence` is the highest of theirs, `expires_at_ms` the latest end, `owner` null, and
/// `holders` lists each. With `watch=F` (the fence last seen, 0 for free) it answers at once if
/// the holders differ from that, otherwise when they change within `wait_ms` (a grant, a
/// release, an expiry, a takeover, a force release; not a renewal), with `changed`; when the
/// wait runs out, the unchanged view with `changed: false`. A free key is `404 not_held` with
/// `fence: null`. A watch waits like an acquire (it counts against `max_waiters`).
#[utoipa::path(
    get,
    path = "/locks/{key}",
    operation_id = "inspect",
    tag = "locks",
    params(KeyPath, WatchQuery),
    responses(
        (status = 200, description = "Held: the live lease.", body = LockBody),
        InspectRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn inspect_lock(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<WatchQuery>,
) -> Result<Response, ApiError> {
    leases::inspect(
        &state,
        Space::Locks,
        &key,
        params.values,
        |view, changed| Json(LockBody::new(&key, view, changed)).into_response(),
    )
    .await
}

/// List held locks
///
/// The locks with live leases whose keys start with `prefix`, a page at a time, in key order;
/// never a token. Follow `next_cursor` until it is null. A page may hold fewer than `limit`
/// entries and still have a next one. With auth, needs `read` or `lock` on a prefix of `prefix`
/// (so a token limited to `orders:` lists with `prefix=orders:` or longer).
#[utoipa::path(
    get,
    path = "/locks",
    operation_id = "list_locks",
    tag = "locks",
    params(ListQueryParams),
    responses(
        (status = 200, description = "A page of held locks.", body = LockListBody),
        ListRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn list_locks(
    State(state): State<SharedState>,
    params: Params<ListQueryParams>,
) -> Result<Response, ApiError> {
    let page = leases::list(&state, Space::Locks, params.values).await?;
    Ok(Json(LockListBody::new(&page)).into_response())
}
