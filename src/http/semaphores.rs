//! The semaphore routes' handlers — take, give back, renew and inspect a permit on
//! `/semaphores/{key}`, list held semaphores on `/semaphores` — each documented for
//! `/openapi.json` by its `#[utoipa::path]`. A semaphore of `limit` permits is a key whose
//! leases are at most `limit` at once; each permit is a lease as a lock's is (token, fence,
//! expiry). Semaphore keys are a space of their own: `/semaphores/a` and `/locks/a` are
//! unrelated. What they answer is in `super::bodies`; what they do as the lock routes do, in
//! `super::leases`.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::SharedState;
use super::bodies::{PermitBody, SemaphoreBody, SemaphoreListBody};
use super::error::ApiError;
use super::error::responses::{
    AcquireRefused, InspectRefused, ListRefused, PermitRefused, ReleaseRefused, RenewRefused,
};
use super::leases::{self, grant_response};
use super::params::{KeyPath, Params, TokenHeader};
use super::requests::{
    ListQueryParams, ReleaseQuery, RenewBody, SemaphoreAcquireBody, WatchQuery, acquire_request,
};
use crate::domain::{Kind, Space};
use crate::store::MAX_SEMAPHORE_LIMIT;

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
        PermitRefused,
        AcquireRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn acquire_permit(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<SemaphoreAcquireBody>,
) -> Result<Response, ApiError> {
    let values = params.values;
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
        values.session,
        &state.limits,
    )?;
    let lease = state.locks.acquire(&key, request).await?;
    Ok(grant_response(
        StatusCode::CREATED,
        &PermitBody::new(&key, &lease, limit),
    ))
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
        ReleaseRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn release_permit(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<ReleaseQuery>,
) -> Result<StatusCode, ApiError> {
    leases::release(&state, Space::Semaphores, &key, params).await
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
        description = "`ttl_ms`, instead of or besides the query string; may be empty. \
            Never the token."
    ),
    responses(
        (status = 200, description = "Renewed: the grant again, with the new expiry.", body = PermitBody),
        RenewRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn renew_permit(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<RenewBody>,
) -> Result<Response, ApiError> {
    let lease = leases::renew(&state, Space::Semaphores, &key, params).await?;
    let limit = lease.limit.unwrap_or_default();
    Ok(grant_response(
        StatusCode::OK,
        &PermitBody::new(&key, &lease, limit),
    ))
}

/// Inspect or watch a semaphore
///
/// Its limit and its live permits; never a token. With `watch=F` (the highest permit fence
/// last seen, 0 for free) it answers at once if the permits differ from that, otherwise when
/// they change within `wait_ms` (a permit taken, given back, expired or force-released; not a
/// renewal), adding `fence` (the highest) and `changed`; as for locks.
#[utoipa::path(
    get,
    path = "/semaphores/{key}",
    operation_id = "inspect_semaphore",
    tag = "semaphores",
    params(KeyPath, WatchQuery),
    responses(
        (status = 200, description = "Held: the live permits.", body = SemaphoreBody),
        InspectRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn inspect_semaphore(
    State(state): State<SharedState>,
    KeyPath(key): KeyPath,
    params: Params<WatchQuery>,
) -> Result<Response, ApiError> {
    leases::inspect(
        &state,
        Space::Semaphores,
        &key,
        params.values,
        |view, changed| Json(SemaphoreBody::new(&key, view, changed)).into_response(),
    )
    .await
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
        (status = 200, description = "A page of held semaphores.", body = SemaphoreListBody),
        ListRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn list_semaphores(
    State(state): State<SharedState>,
    params: Params<ListQueryParams>,
) -> Result<Response, ApiError> {
    let page = leases::list(&state, Space::Semaphores, params.values).await?;
    Ok(Json(SemaphoreListBody::new(&page)).into_response())
}
