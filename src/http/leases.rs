//! What the lock routes (`super::locks`) and the semaphore routes (`super::semaphores`) share:
//! one handler body per operation (acquire, release, renew, inspect, list), generic over the
//! space's [`LeaseSpace`], and `lease_routes!`, which writes a space's router and its documented
//! handlers from that space's paths, operation ids, types and words.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::error::ApiError;
use super::params::{Params, token};
use super::requests::{
    ListQueryParams, Parameters, ReleaseQuery, RenewBody, WatchQuery, list_query, ttl_param,
    watch_request,
};
use super::{Limits, SharedState};
use crate::domain::{Kind, LockKey, Space};
use crate::lock::{AcquireRequest, HoldersView};
use crate::store::{Lease, Page, Store};

/// What the routes of one space do differently: their keys' space, what an acquire takes, and
/// the bodies they answer with.
pub(super) trait LeaseSpace {
    /// Where the routes' keys live.
    const SPACE: Space;
    /// An acquire's parameters.
    type Acquire: Parameters + Send;
    /// The body of a grant (acquire, renew).
    type Grant<'a>: GrantJson;
    /// The body of an inspect.
    type Inspect<'a>: Serialize;
    /// The body of a listing's page.
    type List<'a>: Serialize;

    /// The acquire the parameters ask for.
    fn acquire_request(values: Self::Acquire, limits: &Limits) -> Result<AcquireRequest, ApiError>;

    /// The body of the grant of `lease` on `key`; `limit`: the semaphore's, where known.
    fn grant<'a>(key: &'a LockKey, lease: &'a Lease, limit: Option<u32>) -> Self::Grant<'a>;

    /// The body of an inspect of `key`; `changed`: a watch's answer (see [`inspect`]).
    fn inspect<'a>(
        key: &'a LockKey,
        view: &'a HoldersView,
        changed: Option<bool>,
    ) -> Self::Inspect<'a>;

    /// The body of a listing's page.
    fn list(page: &Page) -> Self::List<'_>;
}

/// An acquire: `201` with the grant.
pub(super) async fn acquire<L: LeaseSpace, S: Store>(
    state: SharedState<S>,
    key: LockKey,
    values: L::Acquire,
) -> Result<Response, ApiError> {
    let key = &key;
    let request = L::acquire_request(values, &state.limits)?;
    let limit = match request.kind {
        Kind::Semaphore { limit } => Some(limit),
        Kind::Exclusive | Kind::Shared => None,
    };
    let lease = state.locks.acquire(key, request).await?;
    Ok(grant_response(
        StatusCode::CREATED,
        &L::grant(key, &lease, limit),
    ))
}

/// A release by token, or by force: `204`.
pub(super) async fn release<L: LeaseSpace, S: Store>(
    state: SharedState<S>,
    key: LockKey,
    params: Params<ReleaseQuery>,
) -> Result<StatusCode, ApiError> {
    let key = &key;
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
        state.locks.force_release(L::SPACE, key).await?;
    } else {
        let token = token(token_header, values.token)?;
        state.locks.release(L::SPACE, key, &token).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// A renewal: `200` with the grant again.
pub(super) async fn renew<L: LeaseSpace, S: Store>(
    state: SharedState<S>,
    key: LockKey,
    params: Params<RenewBody>,
) -> Result<Response, ApiError> {
    let key = &key;
    let token = token(params.token_header, params.values.token)?;
    let ttl = ttl_param(params.values.ttl_ms, &state.limits)?;
    let lease = state.locks.renew(L::SPACE, key, &token, ttl).await?;
    Ok(grant_response(
        StatusCode::OK,
        &L::grant(key, &lease, lease.limit),
    ))
}

/// A grant's answer: `body` as JSON, written straight into a buffer of the size a grant takes
/// (axum's `Json` starts smaller, so a grant grows its buffer once, and writes through a
/// `BytesMut` writer piece by piece).
fn grant_response(status: StatusCode, body: &impl GrantJson) -> Response {
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

/// A grant's body written as JSON: by `serde_json` unless the body writes itself faster (the
/// lock grant, every acquire's answer: see `GrantBody`).
pub(super) trait GrantJson: Serialize {
    /// Appends the body's JSON to `out`.
    fn write_json(&self, out: &mut Vec<u8>) {
        serde_json::to_writer(out, self).expect("a grant serializes to JSON");
    }
}

/// Room for a grant's JSON with a long key and token (both at most a few hundred bytes).
const GRANT_CAPACITY: usize = 256;

/// An inspect: `200` with the live leases. With `watch`, it answers when they differ from the
/// fence the caller saw or change within `wait_ms`, with `changed`; a free key is then
/// `404 not_held` with `"fence": null` (see [`LockService::watch`](crate::lock::LockService)).
pub(super) async fn inspect<L: LeaseSpace, S: Store>(
    state: SharedState<S>,
    key: LockKey,
    values: WatchQuery,
) -> Result<Response, ApiError> {
    let key = &key;
    let Some(watch) = watch_request(values, &state.limits)? else {
        let view = match L::SPACE {
            Space::Locks => state.locks.inspect(key).await?,
            Space::Semaphores => state.locks.permits(key).await?,
        };
        return Ok(Json(L::inspect(key, &view, None)).into_response());
    };
    let answer = state
        .locks
        .watch(L::SPACE, key, watch.seen, watch.wait)
        .await?;
    Ok(match &answer.view {
        Some(view) => Json(L::inspect(key, view, Some(answer.changed))).into_response(),
        None => super::error::watch_not_held(answer.changed),
    })
}

/// A listing: `200` with a page.
pub(super) async fn list<L: LeaseSpace, S: Store>(
    state: SharedState<S>,
    params: ListQueryParams,
) -> Result<Response, ApiError> {
    let query = list_query(L::SPACE, params)?;
    let page = state.locks.list(&query).await?;
    Ok(Json(L::list(&page)).into_response())
}

/// Writes a space's routes: `router()`, and one documented handler per operation that hands
/// the request to the shared body above. Given, in this order: the space's `LeaseSpace` type,
/// its tag and its three paths (the listing, a key, a key's renewal); the five operation ids;
/// the acquire's parameters and their schema, the acquire's conflict response, and the grant,
/// inspect and listing bodies; the words of the acquire's request body and of the five success
/// answers; then the five operations' doc comments (summary and description), each ended by `;`.
macro_rules! lease_routes {
    (
        $space:ident $tag:tt [$list_path:tt $key_path:tt $renew_path:tt]
        operations [$acquire_id:tt $release_id:tt $renew_id:tt $inspect_id:tt $list_id:tt]
        types [$params:ident $schema:tt $conflict:ident $grant:ident $inspect:ident $list:ident]
        answers [$request:tt $granted:tt $released:tt $renewed:tt $held:tt $listed:tt]
        $(#[doc = $acquire_doc:tt])* ;
        $(#[doc = $release_doc:tt])* ;
        $(#[doc = $renew_doc:tt])* ;
        $(#[doc = $inspect_doc:tt])* ;
        $(#[doc = $list_doc:tt])* ;
    ) => {
        /// The routes, without their state.
        pub(super) fn router<S: Store>() -> axum::Router<super::SharedState<S>> {
            use axum::routing::{get, post};
            axum::Router::new()
                .route($list_path, get(list::<S>))
                .route(
                    $key_path,
                    post(acquire::<S>).delete(release::<S>).get(inspect::<S>),
                )
                .route($renew_path, post(renew::<S>))
        }

        $(#[doc = $acquire_doc])*
        #[utoipa::path(
            post,
            path = $key_path,
            operation_id = $acquire_id,
            tag = $tag,
            params(super::params::KeyPath, $params),
            request_body(
                content = ref($schema),
                content_type = "application/json",
                description = $request
            ),
            responses(
                (status = 201, description = $granted, body = $grant),
                super::error::responses::RequestRefused,
                super::error::responses::Unauthorized,
                super::error::responses::Forbidden,
                $conflict,
                super::error::responses::NotGranted,
            ),
            security((), ("bearer" = []))
        )]
        pub(super) fn acquire<S: Store>(
            axum::extract::State(state): axum::extract::State<super::SharedState<S>>,
            super::params::KeyPath(key): super::params::KeyPath,
            params: super::params::Params<$params>,
        ) -> impl Future<Output = Result<axum::response::Response, super::error::ApiError>> + Send {
            super::leases::acquire::<$space, S>(state, key, params.values)
        }

        $(#[doc = $release_doc])*
        #[utoipa::path(
            delete,
            path = $key_path,
            operation_id = $release_id,
            tag = $tag,
            params(
                super::params::KeyPath,
                super::params::TokenHeader,
                super::requests::ReleaseQuery
            ),
            responses(
                (status = 204, description = $released),
                super::error::responses::RequestRefused,
                super::error::responses::Unauthorized,
                super::error::responses::ForceRefused,
                super::error::responses::NotHeld,
                super::error::responses::NotOwner,
                super::error::responses::StoreUnavailable,
            ),
            security((), ("bearer" = []))
        )]
        pub(super) fn release<S: Store>(
            axum::extract::State(state): axum::extract::State<super::SharedState<S>>,
            super::params::KeyPath(key): super::params::KeyPath,
            params: super::params::Params<super::requests::ReleaseQuery>,
        ) -> impl Future<Output = Result<axum::http::StatusCode, super::error::ApiError>> + Send {
            super::leases::release::<$space, S>(state, key, params)
        }

        $(#[doc = $renew_doc])*
        #[utoipa::path(
            post,
            path = $renew_path,
            operation_id = $renew_id,
            tag = $tag,
            params(
                super::params::KeyPath,
                super::params::TokenHeader,
                super::requests::RenewBody
            ),
            request_body(
                content = ref("#/components/schemas/RenewBody"),
                content_type = "application/json",
                description = "`ttl_ms`, instead of or besides the query string; may be empty. \
                    Never the token."
            ),
            responses(
                (status = 200, description = $renewed, body = $grant),
                super::error::responses::RequestRefused,
                super::error::responses::Unauthorized,
                super::error::responses::Forbidden,
                super::error::responses::NotHeld,
                super::error::responses::NotOwner,
                super::error::responses::StoreUnavailable,
            ),
            security((), ("bearer" = []))
        )]
        pub(super) fn renew<S: Store>(
            axum::extract::State(state): axum::extract::State<super::SharedState<S>>,
            super::params::KeyPath(key): super::params::KeyPath,
            params: super::params::Params<super::requests::RenewBody>,
        ) -> impl Future<Output = Result<axum::response::Response, super::error::ApiError>> + Send {
            super::leases::renew::<$space, S>(state, key, params)
        }

        $(#[doc = $inspect_doc])*
        #[utoipa::path(
            get,
            path = $key_path,
            operation_id = $inspect_id,
            tag = $tag,
            params(super::params::KeyPath, super::requests::WatchQuery),
            responses(
                (status = 200, description = $held, body = $inspect),
                super::error::responses::RequestRefused,
                super::error::responses::Unauthorized,
                super::error::responses::Forbidden,
                super::error::responses::InspectNotHeld,
                super::error::responses::InspectUnavailable,
            ),
            security((), ("bearer" = []))
        )]
        pub(super) fn inspect<S: Store>(
            axum::extract::State(state): axum::extract::State<super::SharedState<S>>,
            super::params::KeyPath(key): super::params::KeyPath,
            params: super::params::Params<super::requests::WatchQuery>,
        ) -> impl Future<Output = Result<axum::response::Response, super::error::ApiError>> + Send {
            super::leases::inspect::<$space, S>(state, key, params.values)
        }

        $(#[doc = $list_doc])*
        #[utoipa::path(
            get,
            path = $list_path,
            operation_id = $list_id,
            tag = $tag,
            params(super::requests::ListQueryParams),
            responses(
                (status = 200, description = $listed, body = $list),
                super::error::responses::RequestRefused,
                super::error::responses::Unauthorized,
                super::error::responses::Forbidden,
                super::error::responses::StoreUnavailable,
            ),
            security((), ("bearer" = []))
        )]
        pub(super) fn list<S: Store>(
            axum::extract::State(state): axum::extract::State<super::SharedState<S>>,
            params: super::params::Params<super::requests::ListQueryParams>,
        ) -> impl Future<Output = Result<axum::response::Response, super::error::ApiError>> + Send {
            super::leases::list::<$space, S>(state, params.values)
        }
    };
}

pub(super) use lease_routes;
