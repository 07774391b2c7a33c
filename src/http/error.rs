//! The API's error body, `{"error": code, "message": sentence}`, and how domain errors map to it.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::InvalidValue;
use crate::lock::LockError;
use crate::store::{Hold, HoldReason, StoreError};

pub(crate) mod responses;

/// An error response. Every error the broker sends, the router's own included, is one of these.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    code: ErrorCode,
    message: String,
    /// For `locked`: when the current lease ends; for a hold or a full wait queue, when to try
    /// again (the `Retry-After` header only).
    retry_after_ms: Option<u64>,
    /// For `limit_mismatch`: the limit the semaphore's holders use.
    limit: Option<u32>,
    /// For `locked` on a several-keys acquire: the keys that were busy.
    held: Option<Vec<String>>,
    /// A `store_unavailable` because the store did not answer (not a hold).
    store_down: bool,
}

/// The codes in the `error` field of an error body, with their statuses.
///
/// `invalid_request` 400, `not_found` 404 (no such path), `not_held` 404, `method_not_allowed`
/// 405, `locked` 409 (acquire), `not_owner` 409 (release, renew), `payload_too_large` 413,
/// `unsupported_media_type` 415, `limit_mismatch` 409 (a semaphore's holders use another
/// limit), `too_many_waiters` 503 (with `Retry-After: 1`: this broker
/// has `max_waiters` acquires waiting already; another broker may have room),
/// `store_unavailable` 503, `shutting_down` 503, `unauthorized` 401, `forbidden` 403,
/// `request_header_fields_too_large` 431, `internal` 500 (not expected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ErrorCode {
    InvalidRequest,
    NotFound,
    NotHeld,
    MethodNotAllowed,
    Locked,
    NotOwner,
    PayloadTooLarge,
    UnsupportedMediaType,
    TooManyWaiters,
    StoreUnavailable,
    ShuttingDown,
    Unauthorized,
    Forbidden,
    LimitMismatch,
    RequestHeaderFieldsTooLarge,
    NoSession,
    Internal,
}

/// The body of every error response but `409 locked` (`LockedError`) and `409 limit_mismatch`
/// (`PermitConflictError`).
#[derive(Serialize, ToSchema)]
#[schema(as = Error)]
pub(crate) struct Body<'a> {
    /// What went wrong, for programs.
    error: ErrorCode,
    /// One human sentence.
    message: &'a str,
}

/// The body of `409 locked`: the error body with the time until the current lease ends.
#[derive(Serialize, ToSchema)]
pub(crate) struct LockedError<'a> {
    /// Always `locked`.
    error: ErrorCode,
    /// One human sentence.
    message: &'a str,
    /// Milliseconds until the current lease ends (the `Retry-After` header gives it in whole
    /// seconds, rounded up, at least 1).
    retry_after_ms: u64,
    /// Only for a several-keys acquire (`POST /locks`): the keys that were busy when its wait ran
    /// out (it holds none of them, nor any other, afterwards).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(required = false)]
    held: Option<Vec<String>>,
}

/// The body of a `409` to a semaphore acquire: `locked` with `retry_after_ms`, or
/// `limit_mismatch` with `limit`.
// The broker sends a `locked` as a `LockedError` (the same JSON) and a `limit_mismatch` as this.
#[derive(Serialize, ToSchema)]
pub(crate) struct PermitConflictError<'a> {
    /// `locked` or `limit_mismatch`.
    error: ErrorCode,
    /// One human sentence.
    message: &'a str,
    /// With `locked`: milliseconds until the first permit ends.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    retry_after_ms: Option<u64>,
    /// With `limit_mismatch`: the limit the semaphore's current holders use.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u32, required = false, minimum = 1)]
    limit: Option<u32>,
}

/// The body of `404 not_held`; with `watch`, it adds `"fence": null` and `changed`.
#[derive(Serialize, ToSchema)]
#[schema(as = NotHeldError)]
pub(crate) struct NotHeldBody {
    /// Always `not_held`.
    #[schema(value_type = ErrorCode)]
    error: &'static str,
    /// One human sentence.
    message: &'static str,
    /// Only with `watch`: always null (nobody holds the key; a watch gives 0 for that).
    #[schema(value_type = Option<u64>, required = false)]
    fence: Option<u64>,
    /// Only with `watch`: whether this differs from what the watch saw (false: its wait ran out
    /// with the key still free).
    #[schema(required = false)]
    changed: bool,
}

/// The `404 not_held` a watch answers for a free key.
pub(super) fn watch_not_held(changed: bool) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(NotHeldBody {
            error: "not_held",
            message: "Nobody holds this key (it is free, it was released, or its lease expired).",
            fence: None,
            changed,
        }),
    )
        .into_response()
}

impl ApiError {
    fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_ms: None,
            limit: None,
            held: None,
            store_down: false,
        }
    }

    /// This answer with a `Retry-After` of `ms` unless it has one: `/readyz` says when to look
    /// again in every 503 it gives. (A lock call's 503 while the store does not answer has none:
    /// the client libraries then retry after their own short backoff, in time to renew a short
    /// lease, where a whole second could lose it.)
    pub(super) fn or_retry_after(mut self, ms: u64) -> Self {
        self.retry_after_ms.get_or_insert(ms);
        self
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorCode::InvalidRequest, message)
    }

    /// `404 not_held` for a session: it has ended (or never existed), and every lease under it
    /// is gone.
    pub(super) fn session_ended() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorCode::NotHeld,
            "The session has ended (or never existed); every lease under it is gone.",
        )
    }

    pub(crate) fn not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            "No such endpoint.",
        )
    }

    pub(crate) fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::MethodNotAllowed,
            "This endpoint does not accept that method.",
        )
    }

    pub(crate) fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::PayloadTooLarge,
            format!("The request body is larger than {limit} bytes."),
        )
    }

    pub(crate) fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::UnsupportedMediaType,
            "The request body must be JSON, sent with Content-Type: application/json.",
        )
    }

    /// `401 unauthorized`: no bearer token, a malformed one, or one the auth file does not have.
    /// The `WWW-Authenticate` header is the caller's to add.
    pub(crate) fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, message)
    }

    /// `403 forbidden`: a known token that may not do this here.
    pub(crate) fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, ErrorCode::Forbidden, message)
    }
}

impl ApiError {
    /// `500 internal`: a bug (a handler panicked). Not one of the API's expected answers, so the
    /// gate logs it at `ERROR`.
    pub(super) fn internal() -> Response {
        let mut response = Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "The broker failed to handle the request; its log has the details, under the \
             request's x-request-id.",
        )
        .into_response();
        response.extensions_mut().remove::<Expected>();
        response
    }
}

impl From<InvalidValue> for ApiError {
    fn from(e: InvalidValue) -> Self {
        Self::invalid(e.0)
    }
}

impl From<LockError> for ApiError {
    fn from(e: LockError) -> Self {
        match e {
            LockError::Locked { retry_after_ms } => Self {
                retry_after_ms: Some(retry_after_ms),
                ..Self::new(
                    StatusCode::CONFLICT,
                    ErrorCode::Locked,
                    "The lock is held by someone else.",
                )
            },
            LockError::LockedKeys {
                keys,
                retry_after_ms,
            } => Self {
                retry_after_ms: Some(retry_after_ms),
                held: Some(keys.iter().map(|k| k.as_str().to_owned()).collect()),
                ..Self::new(
                    StatusCode::CONFLICT,
                    ErrorCode::Locked,
                    "Some of the keys were still held by someone else when the wait ran out; \
                     none is held for you.",
                )
            },
            LockError::LimitMismatch { limit } => Self {
                limit: Some(limit),
                ..Self::new(
                    StatusCode::CONFLICT,
                    ErrorCode::LimitMismatch,
                    format!(
                        "The semaphore's current holders use the limit {limit}; ask with that \
                         limit, or wait until their permits end."
                    ),
                )
            },
            LockError::ForceReleaseOff => Self::forbidden(
                "Force release is off on this broker: start it with --allow-force-release \
                 (LOCKBROKER_ALLOW_FORCE_RELEASE, allow_force_release = true), or use an auth file \
                 and an admin token.",
            ),
            LockError::BadCursor => Self::invalid(
                "The cursor is not one this broker gave out; start the listing again without it.",
            ),
            LockError::NotHeld => Self::new(
                StatusCode::NOT_FOUND,
                ErrorCode::NotHeld,
                "Nobody holds this lock (it was released, or its lease expired).",
            ),
            LockError::NoSession => Self::new(
                StatusCode::NOT_FOUND,
                ErrorCode::NoSession,
                "The session does not exist or has ended: open a new one.",
            ),
            LockError::NotOwner => Self::new(
                StatusCode::CONFLICT,
                ErrorCode::NotOwner,
                "Someone else holds this lock now; your lease has ended.",
            ),
            LockError::TooManyWaiters { limit } => Self {
                // Answered like a full queue elsewhere: a load balancer may retry another broker.
                retry_after_ms: Some(1000),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorCode::TooManyWaiters,
                    format!("{limit} requests already wait on this broker; try again later."),
                )
            },
            LockError::StoreUnavailable(e) => {
                // Logged once per outage (see `crate::metrics::Outage`), not once per request.
                tracing::debug!(error = %e, "store unavailable");
                let message = match e {
                    StoreError::Timeout(ms) => {
                        format!("The lock store did not answer within {ms} ms.")
                    }
                    // `Failed`. (A bad cursor is the client's mistake: `LockError::BadCursor`,
                    // never wrapped here.)
                    _ => "The lock store could not be reached.".into(),
                };
                Self {
                    store_down: true,
                    ..Self::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        ErrorCode::StoreUnavailable,
                        message,
                    )
                }
            }
            LockError::OnHold(hold) => Self {
                retry_after_ms: Some(hold.retry_after_ms),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorCode::StoreUnavailable,
                    hold_message(hold),
                )
            },
            LockError::ShuttingDown => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::ShuttingDown,
                "The broker is shutting down; try another broker.",
            ),
        }
    }
}

/// What a store-wide hold means, in the words clients and `/readyz` show.
fn hold_message(hold: Hold) -> String {
    let secs = hold.retry_after_ms.div_ceil(1000).max(1);
    match hold.reason {
        HoldReason::Settling => format!(
            "The lock store is new or was emptied: settling for {secs} s before the first grant, \
             so that brokers that knew it can put their live leases back."
        ),
        HoldReason::Loss => format!(
            "Holding back after a detected store loss (restart, flush or failover): brokers are \
             putting their live leases back; grants resume in {secs} s."
        ),
        HoldReason::PuttingBack => "This broker is putting its live leases back into the lock \
             store after a loss; grants resume in a moment."
            .to_owned(),
    }
}

/// The JSON body of an answer hyper gives by itself, before any route runs, to a request it
/// cannot parse (see `crate::server::io`): the same format as every other error.
pub(crate) fn framework_rejection(status: u16) -> Vec<u8> {
    let (code, message) = match status {
        431 => (
            ErrorCode::RequestHeaderFieldsTooLarge,
            "The request head is over 16 KiB, or has more than 100 header fields.",
        ),
        413 => (
            ErrorCode::PayloadTooLarge,
            "The request body is larger than the limit.",
        ),
        400..=499 => (
            ErrorCode::InvalidRequest,
            "The request is not valid HTTP: a malformed request line or header field, a control \
             character in the target, or an invalid Content-Length.",
        ),
        _ => (
            ErrorCode::Internal,
            "The server could not handle the request.",
        ),
    };
    serde_json::to_vec(&Body {
        error: code,
        message,
    })
    .expect("a plain struct serializes")
}

/// Marks a response as an answer the API defines (every [`ApiError`] is one): a `503` among
/// them is the store's or the broker's state (an outage, a hold, a full wait queue, a
/// shutdown), not a bug, and is not logged as an error. A 5xx without it is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expected {
    /// `503 store_unavailable` because the store did not answer (not a hold): counted into the
    /// current outage.
    pub store_unavailable: bool,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let message = self.message.as_str();
        let mut response = match (self.code, self.retry_after_ms, self.limit) {
            (ErrorCode::Locked, Some(retry_after_ms), _) => Json(LockedError {
                error: self.code,
                message,
                retry_after_ms,
                held: self.held,
            })
            .into_response(),
            (ErrorCode::LimitMismatch, _, Some(limit)) => Json(PermitConflictError {
                error: self.code,
                message,
                retry_after_ms: None,
                limit: Some(limit),
            })
            .into_response(),
            _ => Json(Body {
                error: self.code,
                message,
            })
            .into_response(),
        };
        *response.status_mut() = self.status;
        response.extensions_mut().insert(Expected {
            store_unavailable: self.store_down,
        });
        if let Some(ms) = self.retry_after_ms {
            // Whole seconds, rounded up, at least 1.
            let secs = ms.div_ceil(1000).max(1);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
