//! What the lock routes (`super::locks`) and the semaphore routes (`super::semaphores`) do
//! alike, for the handlers of both: a release, a renewal, an inspect or watch, and a listing of
//! the leases of one [`Space`], and a grant's answer.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::bodies::GrantJson;
use super::error::{ApiError, watch_not_held};
use super::params::{Params, token};
use super::requests::{
    ListQueryParams, ReleaseQuery, RenewBody, WatchQuery, list_query, ttl_param, watch_request,
};
use crate::domain::{LockKey, Space};
use crate::lock::HoldersView;
use crate::store::{Lease, Page};

/// A release of the lease on `key` in `space` by its token, or of every lease on it by force.
pub(super) async fn release(
    state: &AppState,
    space: Space,
    key: &LockKey,
    params: Params<ReleaseQuery>,
) -> Result<StatusCode, ApiError> {
    let Params {
        values,
        token_header,
    } = params;
    if values.force.is_some() {
        // A force release takes no token, so one given with it is refused as a mistake.
        if token_header.is_some() || values.token.is_some() {
            return Err(ApiError::invalid(
                "A force release takes no token: it ends every lease on the key; leave out \
                 either the token or force=true.",
            ));
        }
        state.locks.force_release(space, key).await?;
    } else {
        let token = token(token_header, values.token)?;
        state.locks.release(space, key, &token).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// A renewal of the token's lease on `key` in `space`: the lease, with its new end.
pub(super) async fn renew(
    state: &AppState,
    space: Space,
    key: &LockKey,
    params: Params<RenewBody>,
) -> Result<Lease, ApiError> {
    let token = token(params.token_header, params.values.token)?;
    let ttl = ttl_param(params.values.ttl_ms, &state.limits)?;
    Ok(state.locks.renew(space, key, &token, ttl).await?)
}

/// An inspect of `key` in `space`: `200` with `body(view, None)`. With `watch`, it answers when
/// the holders differ from the fence the caller saw or change within `wait_ms`:
/// `body(view, Some(changed))`, or `404 not_held` with `"fence": null` for a free key (see
/// [`LockService::watch`](crate::lock::LockService)).
pub(super) async fn inspect(
    state: &AppState,
    space: Space,
    key: &LockKey,
    query: WatchQuery,
    body: impl Fn(&HoldersView, Option<bool>) -> Response,
) -> Result<Response, ApiError> {
    let Some(watch) = watch_request(query, &state.limits)? else {
        let view = match space {
            Space::Locks => state.locks.inspect(key).await?,
            Space::Semaphores => state.locks.permits(key).await?,
        };
        return Ok(body(&view, None));
    };
    let answer = state
        .locks
        .watch(space, key, watch.seen, watch.wait)
        .await?;
    Ok(match &answer.view {
        Some(view) => body(view, Some(answer.changed)),
        None => watch_not_held(answer.changed),
    })
}

/// A page of the keys in `space` with live leases.
pub(super) async fn list(
    state: &AppState,
    space: Space,
    query: ListQueryParams,
) -> Result<Page, ApiError> {
    let query = list_query(space, query)?;
    Ok(state.locks.list(&query).await?)
}

/// A grant's answer: `body` as JSON, written straight into a buffer of the size a grant takes
/// (axum's `Json` starts smaller, so a grant grows its buffer once, and writes through a
/// `BytesMut` writer piece by piece).
pub(super) fn grant_response(status: StatusCode, body: &impl GrantJson) -> Response {
    let mut json = Vec::with_capacity(GRANT_CAPACITY);
    body.write_json(&mut json);
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        json,
    )
        .into_response()
}

/// Room for a grant's JSON with a long key and token (both at most a few hundred bytes).
const GRANT_CAPACITY: usize = 256;
