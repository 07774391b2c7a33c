//! [`Error`]: why a call did not give what was asked, with the broker's own error code kept,
//! and whether asking again may help ([`Error::is_transient`]).
//!
//! The one policy on error answers, shared with the Java and Python clients: `429`, `502`,
//! `503`, `504` and no answer at all are asked again (the same request, the same request id,
//! after `Retry-After` or a short pause) until the caller's wait runs out; any other answer is
//! returned at once. The broker itself never answers `500`, `501`, `505`…: one of those comes
//! from something else on the way (a proxy, a server that is not a broker), and asking again
//! would only hide it. Failures name the URL asked (and so the key).

use std::time::Duration;

use reqwest::StatusCode;
use serde::Deserialize;

use crate::types::{Space, format_ms};

/// Why a call did not give what was asked. The first four are answers a caller branches on;
/// the others are failures. `space` says whether a lock or a semaphore answered, for the
/// message.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// `409 locked`: someone else holds the lock, or every permit of the semaphore is taken,
    /// and the wait ran out. `held`: for several keys at once ([`Client::acquire_all`]), the
    /// keys that were busy (none of the keys is held then); empty for one key.
    ///
    /// [`Client::acquire_all`]: crate::Client::acquire_all
    #[error("{}{}", locked_words(*.space, held), retry_hint(*.space, *.retry_after_ms))]
    Locked {
        space: Space,
        retry_after_ms: Option<u64>,
        held: Vec<String>,
    },
    /// `404 not_held`: nobody holds the lock (or this permit).
    #[error("{}", not_held_words(*.space))]
    NotHeld { space: Space },
    /// `409 not_owner`: someone else holds the lock; this token's lease has ended.
    #[error("{}", not_owner_words(*.space))]
    NotOwner { space: Space },
    /// The session has ended (no keep-alive within its ttl, or closed) or never was, and every
    /// lease under it with it: `404 no_session` from an acquire under it, `404 not_held` from
    /// its own calls (keep-alive, close, read). `code` is the broker's.
    #[error("the session has ended (or never existed); every lease under it is gone")]
    SessionEnded { code: &'static str },
    /// `409 limit_mismatch`: the semaphore's holders took their permits with another limit.
    #[error(
        "its holders use {}; every holder of a semaphore must give the same --limit",
        limit.map_or_else(|| format!("another limit ({message})"), |n| format!("--limit {n}"))
    )]
    LimitMismatch { limit: Option<u32>, message: String },
    /// Any other error answer: `400 invalid_request`, `401 unauthorized`, `403 forbidden`,
    /// `503 store_unavailable`, a proxy's `502`... `retry_after` is the answer's `Retry-After`
    /// header, when it had one; `url` the URL asked (the key's, for a call on a key).
    #[error("{url} answered {status} {code}: {message}")]
    Api {
        status: StatusCode,
        code: String,
        message: String,
        retry_after: Option<Duration>,
        url: String,
    },
    /// No answer: the connection was refused or reset, or the request timed out. `url` is the
    /// URL asked (the key's, for a call on a key).
    #[error("cannot reach the broker at {url}: {reason}")]
    Transport { url: String, reason: String },
    /// A success status with a body that is not what the API promises.
    #[error("the answer from {url} could not be read: {reason}")]
    BadResponse { url: String, reason: String },
    /// Refused before anything was sent: the call cannot be right (an empty key names no lock
    /// and no semaphore).
    #[error("{0}")]
    Invalid(String),
}

fn locked_words(space: Space, held: &[String]) -> String {
    match (space, held) {
        (Space::Locks, []) => "the lock is held by someone else".to_owned(),
        (Space::Locks, held) => format!(
            "held by someone else: {} (none of the keys was taken)",
            held.join(", ")
        ),
        (Space::Semaphores, _) => "every permit is taken".to_owned(),
    }
}

fn not_held_words(space: Space) -> &'static str {
    match space {
        Space::Locks => "nobody holds the lock (it was released, or its lease expired)",
        Space::Semaphores => "this permit is not held (it was released, or its lease expired)",
    }
}

fn not_owner_words(space: Space) -> &'static str {
    match space {
        Space::Locks => "someone else holds the lock now; this token's lease has ended",
        Space::Semaphores => "this token holds no permit now; its lease has ended",
    }
}

fn retry_hint(space: Space, retry_after_ms: Option<u64>) -> String {
    retry_after_ms.map_or_else(String::new, |ms| match space {
        Space::Locks => format!("; its lease ends in {}", format_ms(ms)),
        Space::Semaphores => format!("; the next one frees in {}", format_ms(ms)),
    })
}

impl Error {
    /// Whether the same request may succeed later: no answer, `503` (the store unavailable,
    /// the broker settling or shutting down), `429`, or a proxy's `502`/`504` (no broker behind
    /// it just now). Any other status — `500`, `501`, `505`…, which the broker never answers —
    /// is not: asking again would not change it.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Transport { .. } => true,
            Self::Api { status, .. } => is_transient_status(*status),
            _ => false,
        }
    }

    /// Whether the broker refused the caller's bearer token: `401` (no token, or one it does
    /// not know, or no longer knows) or `403` (a token not allowed this).
    pub fn is_unauthorized(&self) -> bool {
        matches!(
            self,
            Self::Api { status, .. }
                if *status == StatusCode::UNAUTHORIZED || *status == StatusCode::FORBIDDEN
        )
    }

    /// Whether the answer is a `5xx`, transient or not.
    pub fn is_server_error(&self) -> bool {
        matches!(self, Self::Api { status, .. } if status.is_server_error())
    }

    /// Whether the answer says the lease is gone: `not_held` or `not_owner`, or its session
    /// ended ([`Error::SessionEnded`]).
    pub fn is_gone(&self) -> bool {
        matches!(
            self,
            Self::NotHeld { .. } | Self::NotOwner { .. } | Self::SessionEnded { .. }
        )
    }

    /// The API's error code for this error; `unreachable` and `bad_response` for the two that
    /// have no answer to take one from.
    pub fn code(&self) -> &str {
        match self {
            Self::Locked { .. } => "locked",
            Self::NotHeld { .. } => "not_held",
            Self::NotOwner { .. } => "not_owner",
            Self::SessionEnded { code } => code,
            Self::LimitMismatch { .. } => "limit_mismatch",
            Self::Api { code, .. } => code,
            Self::Transport { .. } => "unreachable",
            Self::BadResponse { .. } => "bad_response",
            Self::Invalid(_) => "invalid_request",
        }
    }

    /// How long the broker asked to wait before trying again (`Retry-After`), if it said.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Api { retry_after, .. } => *retry_after,
            Self::Locked { retry_after_ms, .. } => retry_after_ms.map(Duration::from_millis),
            _ => None,
        }
    }
}

/// The statuses that asking again may change: see [`Error::is_transient`].
pub(crate) fn is_transient_status(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT
    )
}

/// The API's error body; every field optional, since a proxy in front may answer otherwise.
#[derive(Deserialize)]
struct ErrorBody {
    error: Option<String>,
    message: Option<String>,
    retry_after_ms: Option<u64>,
    /// `limit_mismatch`: the limit the semaphore's holders use.
    limit: Option<u32>,
    /// `locked` for several keys at once: the busy ones.
    held: Option<Vec<String>>,
}

/// Turns an error answer from `space` into an [`Error`], keeping the API's code and message.
pub(crate) async fn error_from(response: reqwest::Response, space: Space) -> Error {
    let status = response.status();
    let retry_after = retry_after_header(&response);
    let url = asked(response.url());
    let text = response.text().await.unwrap_or_default();
    error_from_text(status, retry_after, &text, space, url)
}

/// A request's URL as errors name it: without its query (which says nothing a reader needs).
pub(crate) fn asked(url: &reqwest::Url) -> String {
    let mut url = url.clone();
    url.set_query(None);
    url.into()
}

/// An answer's `Retry-After` header, in whole seconds as the broker sends it.
pub(crate) fn retry_after_header(response: &reqwest::Response) -> Option<Duration> {
    response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// [`error_from`] for an answer whose body was read already.
pub(crate) fn error_from_text(
    status: StatusCode,
    retry_after: Option<Duration>,
    text: &str,
    space: Space,
    url: String,
) -> Error {
    let body: Option<ErrorBody> = serde_json::from_str(text).ok();
    let code = body.as_ref().and_then(|b| b.error.clone());
    match (status, code.as_deref()) {
        (StatusCode::CONFLICT, Some("locked")) => {
            let (retry_after_ms, held) = body.map_or((None, None), |b| (b.retry_after_ms, b.held));
            Error::Locked {
                space,
                retry_after_ms,
                held: held.unwrap_or_default(),
            }
        }
        (StatusCode::NOT_FOUND, Some("not_held")) => Error::NotHeld { space },
        (StatusCode::CONFLICT, Some("not_owner")) => Error::NotOwner { space },
        (StatusCode::NOT_FOUND, Some("no_session")) => Error::SessionEnded { code: "no_session" },
        (StatusCode::CONFLICT, Some("limit_mismatch")) => {
            let (limit, message) = body.map_or((None, None), |b| (b.limit, b.message));
            Error::LimitMismatch {
                limit,
                message: message.unwrap_or_else(|| excerpt(text)),
            }
        }
        _ => Error::Api {
            status,
            code: code.unwrap_or_else(|| "unexpected_response".into()),
            message: body
                .and_then(|b| b.message)
                .unwrap_or_else(|| excerpt(text)),
            retry_after,
            url,
        },
    }
}

/// An error and its causes on one line: reqwest's own `Display` stops at "error sending
/// request", and the reason (connection refused, timed out) is further down.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The start of a body that was not what was expected, for a message.
pub(crate) fn excerpt(text: &str) -> String {
    let text = text.trim();
    if text.is_empty() {
        return "(empty body)".into();
    }
    let cut: String = text.chars().take(200).collect();
    if cut.len() < text.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: StatusCode) -> Error {
        Error::Api {
            status,
            code: "x".into(),
            message: "m".into(),
            retry_after: Some(Duration::from_secs(1)),
            url: "http://h:1/locks/orders:42".into(),
        }
    }

    #[test]
    fn only_no_answer_and_the_statuses_of_a_broker_or_proxy_in_trouble_are_asked_again() {
        for status in [429, 502, 503, 504] {
            let status = StatusCode::from_u16(status).unwrap();
            assert!(answer(status).is_transient(), "{status}");
        }
        for status in [400, 401, 403, 404, 500, 501, 505, 507] {
            let status = StatusCode::from_u16(status).unwrap();
            assert!(!answer(status).is_transient(), "{status}");
        }
        let unreachable = Error::Transport {
            url: "http://h:1/locks/k".into(),
            reason: "connection refused".into(),
        };
        assert!(unreachable.is_transient());
        assert_eq!(
            answer(StatusCode::SERVICE_UNAVAILABLE).retry_after(),
            Some(Duration::from_secs(1))
        );
        let gone = Error::NotOwner {
            space: Space::Locks,
        };
        assert!(!gone.is_transient() && gone.is_gone());
        let mismatch = Error::LimitMismatch {
            limit: Some(3),
            message: "limit 3 in use".into(),
        };
        assert!(!mismatch.is_transient() && !mismatch.is_gone());
        assert!(answer(StatusCode::UNAUTHORIZED).is_unauthorized());
        assert!(answer(StatusCode::FORBIDDEN).is_unauthorized());
        assert!(!answer(StatusCode::BAD_REQUEST).is_unauthorized());
    }

    #[test]
    fn an_error_answer_names_its_status_and_the_url_asked() {
        let proxy = error_from_text(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            "<html>oops</html>",
            Space::Locks,
            "http://h:1/locks/orders:42".into(),
        );
        assert_eq!(
            proxy.to_string(),
            "http://h:1/locks/orders:42 answered 500 Internal Server Error unexpected_response: \
             <html>oops</html>"
        );
        assert!(!proxy.is_transient());
        let url = reqwest::Url::parse("http://h:1/locks/k?watch=3&wait_ms=100").unwrap();
        assert_eq!(asked(&url), "http://h:1/locks/k");
    }

    #[test]
    fn messages_name_what_is_taken_locks_and_permits_for_semaphores() {
        let locked = |space| Error::Locked {
            space,
            retry_after_ms: Some(1500),
            held: Vec::new(),
        };
        assert_eq!(
            locked(Space::Locks).to_string(),
            "the lock is held by someone else; its lease ends in 1s 500ms"
        );
        assert_eq!(
            locked(Space::Semaphores).to_string(),
            "every permit is taken; the next one frees in 1s 500ms"
        );
        assert_eq!(
            Error::NotHeld {
                space: Space::Locks
            }
            .to_string(),
            "nobody holds the lock (it was released, or its lease expired)"
        );
    }

    #[test]
    fn a_limit_mismatch_says_which_limit_the_holders_use_when_the_broker_tells() {
        let told = Error::LimitMismatch {
            limit: Some(3),
            message: "The semaphore is held with limit 3.".into(),
        };
        assert_eq!(
            told.to_string(),
            "its holders use --limit 3; every holder of a semaphore must give the same --limit"
        );
        let untold = Error::LimitMismatch {
            limit: None,
            message: "Another limit is in use.".into(),
        };
        assert!(
            untold
                .to_string()
                .starts_with("its holders use another limit (Another limit is in use.)"),
            "{untold}"
        );
    }

    #[test]
    fn long_bodies_are_cut_and_empty_ones_said() {
        assert_eq!(excerpt("  "), "(empty body)");
        let long = "x".repeat(300);
        assert_eq!(excerpt(&long).chars().count(), 201);
    }
}
