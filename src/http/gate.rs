//! The layer in front of every route: a body announced larger than the limit is refused before
//! the routes see it (waiting for a `Content-Length` of a terabyte would hold the request open
//! for ever), every request has its id (`x-request-id`, taken or made: see
//! [`super::layers::request_id`]) in its span and on its answer, and every answer is logged in
//! the request's span ([`log_answer`]).
//!
//! An oversized body of up to [`DRAIN_LIMIT`] is read and dropped before the refusal: answering
//! with the client's bytes still unread makes the connection close with data in its receive
//! buffer, which the kernel answers with a reset — and a client still sending may then lose the
//! `413` itself and see a broken connection instead. A larger one is refused at once (the
//! connection closes after the answer).
//!
//! Written by hand rather than with tower-http's `TraceLayer` and an axum `from_fn` middleware:
//! those do the same per request plus what the broker does not use (a response classifier, a
//! wrapped response body, a boxed future and a clone of the inner service), and this layer runs
//! on every request. The request id is kept here too rather than with tower-http's
//! `SetRequestId` and `PropagateRequestId`, which look the header up five times per request and
//! put the id in the request's and the answer's extensions, where nothing reads it (see
//! docs/benchmarks.md). The layers it sits among, tower-http's, are in `super::layers`: by the
//! time a request gets here its token headers are marked sensitive.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderValue, Request};
use axum::response::{IntoResponse, Response};
use http_body::Body as _;
use http_body_util::{BodyExt, Either};
use tower::{Layer, Service};

use super::error::{ApiError, Expected};
use super::layers::{REQUEST_ID, request_id};
use super::params::BODY_LIMIT;
use crate::metrics::Outage;

/// The layer: see the module's documentation.
#[derive(Clone)]
pub(super) struct Gate {
    outage: Arc<Outage>,
}

impl Gate {
    pub(super) fn new(outage: Arc<Outage>) -> Self {
        Self { outage }
    }
}

impl<S> Layer<S> for Gate {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GateService {
            inner,
            outage: self.outage.clone(),
        }
    }
}

/// [`Gate`] around one service.
#[derive(Clone)]
pub(crate) struct GateService<S> {
    inner: S,
    outage: Arc<Outage>,
}

impl<S, B> Service<Request<Body>> for GateService<S>
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<Either<B, Body>>;
    type Error = Infallible;
    type Future = GateFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The latency is logged at DEBUG only: below it, no clock is read.
        let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
        let id = request_id(request.headers());
        let span = request_span(&request, &id);
        let _entered = span.enter();
        tracing::debug!("started processing request");
        // `Authorization` and `Lock-Token` print as `Sensitive` (see `super::layers`).
        tracing::trace!(headers = ?request.headers(), "request headers");
        let inner = match announced_length(&request) {
            Some(len) if len > BODY_LIMIT as u64 && len <= DRAIN_LIMIT => {
                Inner::Refusing(Box::pin(refuse_after_draining(request.into_body())))
            }
            Some(len) if len > BODY_LIMIT as u64 => Inner::Refused(Some(
                ApiError::payload_too_large(BODY_LIMIT).into_response(),
            )),
            _ => Inner::Called(self.inner.call(request)),
        };
        drop(_entered);
        GateFuture {
            inner,
            span,
            id: Some(id),
            started,
            outage: self.outage.clone(),
        }
    }
}

/// The most of an oversized body that is read (and dropped) before the refusal, and the longest
/// that reading may take (see the module's documentation).
const DRAIN_LIMIT: u64 = 1024 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// The refusal of an oversized body, once the body was read to its end (or for [`DRAIN_TIME`]).
async fn refuse_after_draining(mut body: Body) -> Response {
    let drained = async { while let Some(Ok(_)) = body.frame().await {} };
    let _ = tokio::time::timeout(DRAIN_TIME, drained).await;
    ApiError::payload_too_large(BODY_LIMIT).into_response()
}

/// What a [`GateFuture`] waits for.
enum Inner<F> {
    /// The inner service's answer.
    Called(F),
    /// The refusal of an oversized body, answered at once (taken when polled).
    Refused(Option<Response>),
    /// The refusal of an oversized body, after reading it (rare: boxed).
    Refusing(Pin<Box<dyn Future<Output = Response> + Send>>),
}

/// The answer of a [`GateService`]: the inner service's, or the refusal of an oversized body.
pub(crate) struct GateFuture<F> {
    inner: Inner<F>,
    span: tracing::Span,
    /// The request's id, for its answer (taken when the answer is ready).
    id: Option<HeaderValue>,
    started: Option<Instant>,
    outage: Arc<Outage>,
}

impl<F, B> Future for GateFuture<F>
where
    F: Future<Output = Result<Response<B>, Infallible>> + Unpin,
{
    type Output = Result<Response<Either<B, Body>>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let _entered = this.span.enter();
        let mut response = match &mut this.inner {
            Inner::Called(inner) => match Pin::new(inner).poll(cx) {
                Poll::Ready(Ok(response)) => response.map(Either::Left),
                Poll::Ready(Err(never)) => match never {},
                Poll::Pending => return Poll::Pending,
            },
            Inner::Refused(ready) => ready
                .take()
                .expect("a future is not polled after it completed")
                .map(Either::Right),
            Inner::Refusing(refusal) => match refusal.as_mut().poll(cx) {
                Poll::Ready(response) => response.map(Either::Right),
                Poll::Pending => return Poll::Pending,
            },
        };
        let id = this
            .id
            .take()
            .expect("a future is not polled after it completed");
        let latency = this.started.map(|started| started.elapsed());
        log_answer(&this.outage, &response, latency, &id);
        response.headers_mut().insert(REQUEST_ID, id);
        Poll::Ready(Ok(response))
    }
}

/// The body's length as the request announced it (`Content-Length`), as the HTTP library read
/// it (no header lookup, no second parse).
fn announced_length(request: &Request<Body>) -> Option<u64> {
    request.body().size_hint().exact()
}

/// The span of one request: method and path, never the query string, which may carry a token;
/// its request id; with auth, the name of the token that sent it (recorded by the auth layer),
/// never the token. (Its fields are read only when the span is enabled, at `DEBUG`.)
fn request_span(request: &Request<Body>, id: &HeaderValue) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %request.method(),
        path = %loggable_path(request.uri().path()),
        request_id = %text(id),
        token = tracing::field::Empty,
    )
}

/// A request's path as the log shows it: a session's id is a secret, so `/sessions/<id>…`
/// shows as `/sessions/…` and the rest of the path.
fn loggable_path(path: &str) -> std::borrow::Cow<'_, str> {
    match path.strip_prefix("/sessions/") {
        Some(rest) => {
            let after = rest.find('/').map_or("", |i| &rest[i..]);
            format!("/sessions/…{after}").into()
        }
        None => path.into(),
    }
}

/// A request id as text (every one the gate keeps or makes is ASCII).
fn text(id: &HeaderValue) -> &str {
    id.to_str().unwrap_or_default()
}

/// Logs each answer: at DEBUG; a 5xx that is not one of the API's answers (a bug) at ERROR, with
/// the request id (the request's span, at DEBUG, is not there at the default level); the
/// latency only at DEBUG, where the clock is read (`latency`). The
/// API's own 503s (the store out or holding, a full wait queue, a shutdown) are expected: those
/// of an outage are counted into it, which is logged once when it begins and once when it ends
/// (see [`crate::metrics::Outage`]), so a Redis restart pages nobody.
fn log_answer<B>(
    outage: &Outage,
    response: &Response<B>,
    latency: Option<Duration>,
    id: &HeaderValue,
) {
    let status = response.status();
    let latency_ms = latency.map(|latency| latency.as_millis());
    match response.extensions().get::<Expected>() {
        Some(expected) => {
            // Counted into the outage in progress; outside one there is nothing to count
            // into (the count starts again with the next).
            if expected.store_unavailable && outage.is_down() {
                outage.refused();
            }
            tracing::debug!(%status, latency_ms, "answered");
        }
        None if status.is_server_error() => {
            let request_id = text(id);
            tracing::error!(%status, latency_ms, %request_id, "answered with a server error");
        }
        None => tracing::debug!(%status, latency_ms, "answered"),
    }
}
