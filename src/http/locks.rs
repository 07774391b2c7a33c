//! The lock routes — acquire (exclusive or shared), release (by token or by force), renew and
//! inspect a lease on `/locks/{key}`, list held locks on `/locks` — and the JSON bodies they
//! answer with, some of which the semaphore routes (`super::semaphores`) share. Each handler
//! turns the request into domain values, asks the [`LockService`](crate::lock::LockService) and
//! shapes its answer; every refusal is an [`ApiError`].

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use super::error::ApiError;
use super::openapi::{
    Forbidden, ForceRefused, KeyParam, Locked, NotGranted, NotHeld, NotOwner, RequestRefused,
    StoreUnavailable, TokenHeader, Unauthorized,
};
use super::params::{KeyPath, Params, token};
use super::requests::{
    AcquireBody, ListQueryParams, ModeName, NoParams, ReleaseQuery, RenewBody, acquire_request,
    list_query, ttl_param,
};
use crate::domain::{LockKey, Owner};
use crate::lock::HoldersView;
use crate::store::{Kind, Lease, Listed, Mode, Space, Store};

/// The lock routes, without their state.
pub(super) fn locks_router<S: Store>() -> Router<AppState<S>> {
    Router::new()
        .route("/locks", get(list::<S>))
        .route(
            "/locks/{key}",
            post(acquire::<S>).delete(release::<S>).get(inspect::<S>),
        )
        .route("/locks/{key}/renew", post(renew::<S>))
}

/// The body of a grant (acquire, renew). The token is shown here and nowhere else.
#[derive(Serialize, ToSchema)]
#[schema(as = Grant)]
pub(super) struct GrantBody<'a> {
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
    pub(super) fn new(key: &'a LockKey, lease: &'a Lease) -> Self {
        Self {
            key: key.as_str(),
            token: lease.token.as_str(),
            fence: lease.fence,
            ttl_ms: lease.ttl_ms,
            expires_at_ms: lease.expires_at_ms,
        }
    }
}

/// A grant's answer: `body` as JSON, written straight into a buffer of the size a grant takes
/// (axum's `Json` starts smaller, so a grant grows its buffer once, and writes through a
/// `BytesMut` writer piece by piece).
pub(super) fn grant_response(status: StatusCode, body: &GrantBody<'_>) -> Response {
    let mut json = Vec::with_capacity(GRANT_CAPACITY);
    serde_json::to_writer(&mut json, body).expect("a grant serializes to JSON");
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

/// Who holds a lock and until when. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = Lease)]
struct InspectBody<'a> {
    /// The lock's key, as decoded.
    key: &'a str,
    /// `exclusive` (one holder) or `shared` (one or more holders, listed in `holders`).
    #[schema(value_type = ModeName)]
    mode: &'static str,
    /// The fence of the live lease; for shared holders, the highest of theirs.
    #[schema(minimum = 1)]
    fence: u64,
    /// When the lease ends, Unix epoch ms on the store's clock; for shared holders, when the
    /// last of their leases ends.
    expires_at_ms: u64,
    /// Milliseconds until `expires_at_ms`.
    ttl_remaining_ms: u64,
    /// The `owner` label the acquire gave, or null; null for shared holders (each has its own,
    /// in `holders`).
    #[schema(required = true)]
    owner: Option<&'a str>,
    /// Only for `shared`: every shared holder, by fence.
    #[serde(skip_serializing_if = "Option::is_none")]
    holders: Option<Vec<HolderBody<'a>>>,
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "exclusive",
        Mode::Shared => "shared",
    }
}

/// One holder of a shared lock or of a semaphore's permits. Never its token.
#[derive(Serialize, ToSchema)]
#[schema(as = Holder)]
pub(super) struct HolderBody<'a> {
    /// The fence of this holder's lease.
    #[schema(minimum = 1)]
    fence: u64,
    /// When this lease ends, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
    /// Milliseconds until this lease ends.
    ttl_remaining_ms: u64,
    /// The `owner` label its acquire gave, or null.
    #[schema(required = true)]
    owner: Option<&'a str>,
}

/// The holders of a key, one body each, by fence.
pub(super) fn holder_bodies(now_ms: u64, holders: &[Lease]) -> Vec<HolderBody<'_>> {
    holders
        .iter()
        .map(|lease| HolderBody {
            fence: lease.fence,
            expires_at_ms: lease.expires_at_ms,
            ttl_remaining_ms: lease.expires_at_ms.saturating_sub(now_ms),
            owner: lease.owner.as_ref().map(Owner::as_str),
        })
        .collect()
}

/// What a key's top-level fence and expiry are when several leases hold it: the highest fence
/// and the latest end (when the key is free again, unless renewed). `None` for no holder.
pub(super) fn aggregate(holders: &[Lease]) -> Option<(u64, u64)> {
    let fence = holders.iter().map(|l| l.fence).max()?;
    let end = holders.iter().map(|l| l.expires_at_ms).max()?;
    Some((fence, end))
}

/// Acquire a lock
///
/// Grants a lease on `key` if nobody holds it (or the holder's lease has expired), waiting up
/// to `wait_ms` while someone else holds it. Answers `201` only when the lease is really held.
/// With `mode=shared`, a shared lease: granted beside other shared ones, never with an exclusive
/// one; an exclusive acquire that waits holds new shared ones back, so it is not starved.
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
    Params { values, .. }: Params<AcquireBody>,
) -> Result<Response, ApiError> {
    let kind = match values.mode {
        None | Some(ModeName::Exclusive) => Kind::Exclusive,
        Some(ModeName::Shared) => Kind::Shared,
    };
    let request = acquire_request(
        kind,
        values.ttl_ms,
        values.wait_ms,
        values.owner,
        values.request_id,
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
    tag = "locks",
    params(KeyParam, TokenHeader, ReleaseQuery),
    responses(
        (status = 204, description = "Released (with `force=true`: every lease on the key ended)."),
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
    release_in(&state, Space::Locks, &key, params).await
}

/// A release by token, or by force, in `space`.
pub(super) async fn release_in<S: Store>(
    state: &AppState<S>,
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

/// Renew a lease
///
/// Moves the end of the token's live lease to `ttl_ms` after the renewal. Same token, same
/// fence. The token comes as for release.
#[utoipa::path(
    post,
    path = "/locks/{key}/renew",
    tag = "locks",
    params(KeyParam, TokenHeader, RenewBody),
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
    params: Params<RenewBody>,
) -> Result<Response, ApiError> {
    let token = token(params.token_header, params.values.token)?;
    let ttl = ttl_param(params.values.ttl_ms, &state.limits)?;
    let lease = state.locks.renew(Space::Locks, &key, &token, ttl).await?;
    Ok(grant_response(
        StatusCode::OK,
        &GrantBody::new(&key, &lease),
    ))
}

/// Inspect a lock
///
/// Who holds the lock, in which mode and until when; never a token. Takes no parameters. For
/// shared holders, `fence` is the highest of theirs, `expires_at_ms` the latest end, `owner`
/// null, and `holders` lists each.
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
    _: Params<NoParams>,
) -> Result<Response, ApiError> {
    let view = state.locks.inspect(&key).await?;
    Ok(Json(inspect_body(&key, &view)).into_response())
}

fn inspect_body<'a>(key: &'a LockKey, view: &'a HoldersView) -> InspectBody<'a> {
    let (fence, expires_at_ms) = aggregate(&view.holders).unwrap_or_default();
    let shared = view.mode == Some(Mode::Shared);
    InspectBody {
        key: key.as_str(),
        mode: mode_name(view.mode.unwrap_or(Mode::Exclusive)),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(view.now_ms),
        owner: match view.holders.as_slice() {
            [only] if !shared => only.owner.as_ref().map(Owner::as_str),
            _ => None,
        },
        holders: shared.then(|| holder_bodies(view.now_ms, &view.holders)),
    }
}

/// One held lock in a listing. Never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = ListedLock)]
struct ListedLockBody<'a> {
    /// The lock's key.
    key: &'a str,
    /// `exclusive` or `shared`.
    #[schema(value_type = ModeName)]
    mode: &'static str,
    /// The lease's fence; for shared holders, the highest.
    #[schema(minimum = 1)]
    fence: u64,
    /// When the lease ends; for shared holders, when the last one does.
    expires_at_ms: u64,
    /// Milliseconds until `expires_at_ms`.
    ttl_remaining_ms: u64,
    /// The exclusive holder's `owner` label, or null (always null for shared holders).
    #[schema(required = true)]
    owner: Option<&'a str>,
}

/// A page of held locks.
#[derive(Serialize, ToSchema)]
#[schema(as = LockList)]
struct LockListBody<'a> {
    /// The held locks whose keys start with the prefix, in key order.
    locks: Vec<ListedLockBody<'a>>,
    /// Give it as `cursor` for the next page; null on the last page.
    #[schema(required = true)]
    next_cursor: Option<&'a str>,
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
    let query = list_query(Space::Locks, params.values)?;
    let page = state.locks.list(&query).await?;
    let locks = page
        .entries
        .iter()
        .filter_map(|entry| listed_lock(page.now_ms, entry))
        .collect();
    Ok(Json(LockListBody {
        locks,
        next_cursor: page.next_cursor.as_deref(),
    })
    .into_response())
}

fn listed_lock(now_ms: u64, entry: &Listed) -> Option<ListedLockBody<'_>> {
    let (fence, expires_at_ms) = aggregate(&entry.holders)?;
    let mode = entry.mode.unwrap_or(Mode::Exclusive);
    Some(ListedLockBody {
        key: entry.key.as_str(),
        mode: mode_name(mode),
        fence,
        expires_at_ms,
        ttl_remaining_ms: expires_at_ms.saturating_sub(now_ms),
        owner: match (mode, entry.holders.as_slice()) {
            (Mode::Exclusive, [only]) => only.owner.as_ref().map(Owner::as_str),
            _ => None,
        },
    })
}
