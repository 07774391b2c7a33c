//! The layers around the whole router, outermost first. They wrap the router once, as one
//! service ([`Api`], which the server clones per request), rather than through
//! `Router::layer`, which wraps every route apart and then boxes and clones the layered
//! service on every request:
//!
//! 1. `Authorization` and `Lock-Token` marked sensitive (tower-http's
//!    `SetSensitiveRequestHeaders`): their values print as `Sensitive` wherever a request's
//!    headers are formatted, so no log line shows a bearer token or a lease token, whatever the
//!    level (the gate logs the headers at `TRACE`);
//! 2. the [gate](super::gate): the body limit; the request id ([`request_id`]), in the
//!    request's span and on its answer; the answer's log line;
//! 3. a handler that panics answers `500 internal` (tower-http's `CatchPanic`), logged at
//!    `ERROR`; the panic ends that request only, and its connection goes on serving.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, header};
use http_body_util::Either;
use tower::ServiceBuilder;
use tower_http::BoxError;
use tower_http::body::UnsyncBoxBody;
use tower_http::catch_panic::{CatchPanic, CatchPanicLayer, ResponseForPanic};
use tower_http::sensitive_headers::{SetSensitiveRequestHeaders, SetSensitiveRequestHeadersLayer};

use super::error::ApiError;
use super::gate::{Gate, GateService};
use crate::metrics::Outage;

/// The whole API as one service: the router behind the layers of this module.
pub(crate) type Api = SetSensitiveRequestHeaders<GateService<CatchPanic<Router, PanicAnswer>>>;

/// The body of every answer of [`Api`]: `CatchPanic`'s (which boxes the router's), or the
/// gate's own refusal.
pub(crate) type ApiBody = Either<UnsyncBoxBody<Bytes, BoxError>, Body>;

/// `router` behind the layers of the module's documentation.
pub(super) fn around(router: Router, outage: Arc<Outage>) -> Api {
    ServiceBuilder::new()
        .layer(SetSensitiveRequestHeadersLayer::from_shared(Arc::new([
            header::AUTHORIZATION,
            LOCK_TOKEN,
        ])))
        .layer(Gate::new(outage))
        .layer(CatchPanicLayer::custom(PanicAnswer))
        .service(router)
}

/// [`LOCK_TOKEN_HEADER`](super::requests::LOCK_TOKEN_HEADER) as a static name: marking a
/// request's headers looks each name up, and a name made at run time would be copied per
/// request that lacks it.
const LOCK_TOKEN: HeaderName = HeaderName::from_static("lock-token");

/// The request id's header, on requests and answers.
pub(super) const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest request id a client may send; a longer one is replaced.
const MAX_REQUEST_ID: usize = 64;

/// The id of a request: the `x-request-id` it sent if that is 1 to [`MAX_REQUEST_ID`]
/// characters from `A-Z a-z 0-9 - _ . : + / =`, otherwise a new one ([`make_request_id`]).
pub(super) fn request_id(headers: &HeaderMap) -> HeaderValue {
    // Found by a scan rather than a lookup, which hashes the name first: a request has a
    // handful of header fields (at most 100), and this runs for every request.
    let sent = headers
        .iter()
        .find_map(|(name, id)| (*name == REQUEST_ID).then_some(id));
    match sent {
        Some(id) if is_valid_request_id(id.as_bytes()) => id.clone(),
        _ => make_request_id(),
    }
}

/// Whether a client's request id is kept: short, and nothing in it that would need escaping in
/// a log line.
fn is_valid_request_id(id: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID).contains(&id.len())
        && id
            .iter()
            .all(|&c| c.is_ascii_alphanumeric() || b"-_.:+/=".contains(&c))
}

/// The id of a request that came without a valid one: a 64-bit number in decimal (1 to 20
/// digits), this broker's count of made ids from a random start, mixed by a bijection
/// (splitmix64's): distinct within a broker, unrelated across brokers and restarts, and not a
/// sequence that tells a client how many requests a broker served. Decimal, because
/// `HeaderValue` takes an integer without checking its characters one by one; a count rather
/// than the thread's random generator, because it is cheaper (most requests get a made id).
fn make_request_id() -> HeaderValue {
    static START: OnceLock<u64> = OnceLock::new();
    static MADE: AtomicU64 = AtomicU64::new(0);
    let start = *START.get_or_init(rand::random);
    let count = start.wrapping_add(MADE.fetch_add(1, Ordering::Relaxed));
    HeaderValue::from(mix(count))
}

/// splitmix64's finalizer: a bijection on 64-bit numbers that scatters consecutive ones.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The answer of a request whose handler panicked: `500 internal`, logged at `ERROR` with the
/// panic's message (in the request's span), and again as a server error by the gate.
#[derive(Clone, Copy)]
pub(crate) struct PanicAnswer;

impl ResponseForPanic for PanicAnswer {
    type ResponseBody = Body;

    fn response_for_panic(
        &mut self,
        panic: Box<dyn Any + Send + 'static>,
    ) -> Response<Self::ResponseBody> {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("(no message)");
        tracing::error!(panic = message, "a request's handler panicked");
        ApiError::internal()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::requests::LOCK_TOKEN_HEADER;

    #[test]
    fn the_sensitive_lock_token_header_is_the_one_the_parser_reads() {
        assert_eq!(LOCK_TOKEN, HeaderName::try_from(LOCK_TOKEN_HEADER).unwrap());
    }

    #[test]
    fn request_ids_of_sane_length_and_characters_are_kept() {
        for id in [
            "a",
            "0f8fad5b-d9cb-469f-a165-70867728950e",
            "01ARZ3NDEKTSV4RRFFQ69G5FAV",
            "Root=1-5759e988-bd862e3fe1be46a994272793",
            "svc.example:42/abc+def=",
            &"x".repeat(MAX_REQUEST_ID),
        ] {
            assert!(is_valid_request_id(id.as_bytes()), "{id:?}");
        }
        for id in [
            "",
            &"x".repeat(MAX_REQUEST_ID + 1),
            "two words",
            "line\nbreak",
            "tab\t",
            "quote\"",
            "{braces}",
            "caf\u{e9}",
            "\u{1b}[31mred",
        ] {
            assert!(!is_valid_request_id(id.as_bytes()), "{id:?}");
        }
    }

    #[test]
    fn made_request_ids_are_decimal_numbers_and_differ() {
        let mut made = std::collections::HashSet::new();
        for _ in 0..100 {
            let id = request_id(&HeaderMap::new());
            let text = id.to_str().expect("ASCII").to_owned();
            assert!((1..=20).contains(&text.len()), "{text}");
            assert!(text.bytes().all(|c| c.is_ascii_digit()), "{text}");
            assert!(is_valid_request_id(text.as_bytes()), "{text}");
            made.insert(text);
        }
        assert_eq!(made.len(), 100);
    }
}
