//! The session routes' handlers: open (`POST /sessions`), keep alive
//! (`POST /sessions/{session}/renew`), close (`DELETE /sessions/{session}`) and read
//! (`GET /sessions/{session}`), and the JSON they answer with. The session's id is a secret like
//! a lease token: only the open answers it, and the request log shows `/sessions/…` without it.

use axum::Json;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::{IntoParams, ToSchema};

use super::SharedState;
use super::bodies::mode_name;
use super::error::ApiError;
use super::error::responses::{OpenRefused, SessionRefused};
use super::params::Params;
use super::requests::{Parameters, SessionBody, SessionRenewBody, session_id, ttl_param};
use crate::domain::{Owner, RequestId, Space, Token, Ttl};
use crate::lock::{LockError, SessionLease};
use crate::store::{MAX_LOCK_DELAY_MS, SessionRecord, SessionSpec};

/// The session's id, from the path.
#[derive(IntoParams)]
#[into_params(names("session"), parameter_in = Path)]
pub(crate) struct SessionPath(
    /// The `session` that `POST /sessions` answered.
    #[param(
        value_type = String,
        min_length = 1,
        max_length = 128,
        pattern = r"^[A-Za-z0-9._~-]{1,128}$"
    )]
    pub Token,
);

impl<S: Send + Sync> FromRequestParts<S> for SessionPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| ApiError::invalid("The session id is not valid UTF-8."))?;
        Ok(Self(session_id(&raw)?))
    }
}

/// What a close or a read takes: nothing (an unknown parameter is `400`, as everywhere).
#[derive(Debug, Default, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NoParams {}

impl Parameters for NoParams {}

/// A session as opened. The id is shown here and nowhere else.
#[derive(Serialize, ToSchema)]
#[schema(as = SessionGrant)]
pub(super) struct OpenedBody<'a> {
    /// The session's id: the secret that keeps it alive, closes it and takes leases under it.
    /// Opaque, URL-safe, at most 128 characters; only the open answers it.
    #[schema(max_length = 128)]
    session: &'a str,
    #[serde(flatten)]
    kept: KeptBody<'a>,
}

/// A session's length, end, label and lock delay (the answer of a keep-alive).
#[derive(Serialize, ToSchema)]
#[schema(as = SessionKept)]
pub(super) struct KeptBody<'a> {
    /// Its length in ms, counted from each keep-alive.
    ttl_ms: u64,
    /// When it ends unless kept alive, Unix epoch ms on the store's clock.
    expires_at_ms: u64,
    #[schema(required = true)]
    owner: Option<&'a str>,
    lock_delay_ms: u64,
}

impl<'a> KeptBody<'a> {
    fn new(record: &'a SessionRecord) -> Self {
        Self {
            ttl_ms: record.ttl_ms,
            expires_at_ms: record.expires_at_ms,
            owner: record.owner.as_ref().map(Owner::as_str),
            lock_delay_ms: record.lock_delay_ms,
        }
    }
}

/// A session and its live leases. Never its id, never a token.
#[derive(Serialize, ToSchema)]
#[schema(as = Session)]
pub(super) struct SessionViewBody<'a> {
    #[schema(required = true)]
    owner: Option<&'a str>,
    ttl_ms: u64,
    expires_at_ms: u64,
    ttl_remaining_ms: u64,
    lock_delay_ms: u64,
    /// The live leases taken under it, by space and key.
    leases: Vec<SessionLeaseBody<'a>>,
}

/// One lease under a session.
#[derive(Serialize, ToSchema)]
#[schema(as = SessionLease)]
pub(super) struct SessionLeaseBody<'a> {
    /// `locks` or `semaphores`.
    space: &'static str,
    key: &'a str,
    /// `exclusive` or `shared` for a lock; null for a semaphore's permit.
    #[schema(required = true)]
    mode: Option<&'static str>,
    #[schema(minimum = 1)]
    fence: u64,
}

fn lease_body(lease: &SessionLease) -> SessionLeaseBody<'_> {
    SessionLeaseBody {
        space: match lease.space {
            Space::Locks => "locks",
            Space::Semaphores => "semaphores",
        },
        key: lease.key.as_str(),
        mode: lease.mode.map(mode_name),
        fence: lease.fence,
    }
}

/// A session call's "not held" is the session's, not a lock's.
fn session_error(e: LockError) -> ApiError {
    match e {
        LockError::NotHeld => ApiError::session_ended(),
        e => e.into(),
    }
}

/// Open a session
///
/// One heartbeat for many leases: take locks, shared locks and permits under the session
/// (`session=` on their acquires), keep them all with one keep-alive, and when the session ends
/// — no keep-alive for its `ttl_ms` — every lease under it ends at once. With `lock_delay_ms`,
/// the keys of a session that ended by expiry stay held that long after its end.
#[utoipa::path(
    post,
    path = "/sessions",
    operation_id = "open_session",
    tag = "sessions",
    params(SessionBody),
    request_body(
        content = ref("#/components/schemas/SessionBody"),
        content_type = "application/json",
        description = "The parameters, instead of or besides the query string; may be empty."
    ),
    responses(
        (status = 201, description = "Opened.", body = OpenedBody),
        OpenRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn open_session(
    State(state): State<SharedState>,
    params: Params<SessionBody>,
) -> Result<Response, ApiError> {
    let values = params.values;
    let lock_delay_ms = values.lock_delay_ms.unwrap_or(0);
    if lock_delay_ms > MAX_LOCK_DELAY_MS {
        return Err(ApiError::invalid(format!(
            "lock_delay_ms is {lock_delay_ms}; at most {MAX_LOCK_DELAY_MS}."
        )));
    }
    let spec = SessionSpec {
        ttl: ttl_param(values.ttl_ms, &state.limits)?,
        owner: values.owner.map(|o| Owner::parse(&o)).transpose()?,
        lock_delay_ms,
        request_id: values
            .request_id
            .map(|r| RequestId::parse(&r))
            .transpose()?,
    };
    let record = state.locks.open_session(spec).await?;
    let body = OpenedBody {
        session: record.id.as_str(),
        kept: KeptBody::new(&record),
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// Keep a session alive
///
/// Moves the session's end to its `ttl_ms` (or the one given, which becomes its length) from
/// now, and every lease under it along: one request whatever the number of leases.
#[utoipa::path(
    post,
    path = "/sessions/{session}/renew",
    operation_id = "keep_alive",
    tag = "sessions",
    params(SessionPath, SessionRenewBody),
    request_body(
        content = ref("#/components/schemas/SessionRenewBody"),
        content_type = "application/json",
        description = "`ttl_ms`, instead of or besides the query string; may be empty."
    ),
    responses(
        (status = 200, description = "Kept: the session's new end.", body = KeptBody),
        SessionRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn keep_alive(
    State(state): State<SharedState>,
    SessionPath(id): SessionPath,
    params: Params<SessionRenewBody>,
) -> Result<Response, ApiError> {
    let ttl: Option<Ttl> = match params.values.ttl_ms {
        Some(ms) => Some(ttl_param(Some(ms), &state.limits)?),
        None => None,
    };
    let record = state
        .locks
        .keep_alive(&id, ttl)
        .await
        .map_err(session_error)?;
    Ok(Json(KeptBody::new(&record)).into_response())
}

/// Close a session
///
/// Ends the session and releases every lease under it at once (no lock delay).
#[utoipa::path(
    delete,
    path = "/sessions/{session}",
    operation_id = "close_session",
    tag = "sessions",
    params(SessionPath),
    responses(
        (status = 204, description = "Closed: every lease under it released."),
        SessionRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn close_session(
    State(state): State<SharedState>,
    SessionPath(id): SessionPath,
    _none: Params<NoParams>,
) -> Result<StatusCode, ApiError> {
    state
        .locks
        .close_session(&id)
        .await
        .map_err(session_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Read a session
///
/// The session's label, length, end and lock delay, and the live leases under it. Never its
/// id, never a token.
#[utoipa::path(
    get,
    path = "/sessions/{session}",
    operation_id = "read_session",
    tag = "sessions",
    params(SessionPath),
    responses(
        (status = 200, description = "The session.", body = SessionViewBody),
        SessionRefused,
    ),
    security((), ("bearer" = []))
)]
pub(super) async fn read_session(
    State(state): State<SharedState>,
    SessionPath(id): SessionPath,
    _none: Params<NoParams>,
) -> Result<Response, ApiError> {
    let (record, leases) = state.locks.session(&id).await.map_err(session_error)?;
    let body = SessionViewBody {
        owner: record.owner.as_ref().map(Owner::as_str),
        ttl_ms: record.ttl_ms,
        expires_at_ms: record.expires_at_ms,
        ttl_remaining_ms: record.expires_at_ms.saturating_sub(record.now_ms),
        lock_delay_ms: record.lock_delay_ms,
        leases: leases.iter().map(lease_body).collect(),
    };
    Ok(Json(body).into_response())
}
