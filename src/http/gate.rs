//! The layer in front of every route: a body announced larger than the limit is refused before
//! the routes see it (waiting for a `Content-Length` of a terabyte would hold the request open
//! for ever), and every answer is logged in the request's span ([`log_answer`]).
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
//! on every request.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use tower::{Layer, Service};

use super::error::{ApiError, Expected};
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
pub(super) struct GateService<S> {
    inner: S,
    outage: Arc<Outage>,
}

impl<S> Service<Request<Body>> for GateService<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response;
    type Error = Infallible;
    type Future = GateFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let started = Instant::now();
        let span = request_span(&request);
        let _entered = span.enter();
        tracing::debug!("started processing request");
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
pub(super) struct GateFuture<F> {
    inner: Inner<F>,
    span: tracing::Span,
    started: Instant,
    outage: Arc<Outage>,
}

impl<F> Future for GateFuture<F>
where
    F: Future<Output = Result<Response, Infallible>> + Unpin,
{
    type Output = Result<Response, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let _entered = this.span.enter();
        let response = match &mut this.inner {
            Inner::Called(inner) => match Pin::new(inner).poll(cx) {
                Poll::Ready(Ok(response)) => response,
                Poll::Ready(Err(never)) => match never {},
                Poll::Pending => return Poll::Pending,
            },
            Inner::Refused(ready) => ready
                .take()
                .expect("a future is not polled after it completed"),
            Inner::Refusing(refusal) => match refusal.as_mut().poll(cx) {
                Poll::Ready(response) => response,
                Poll::Pending => return Poll::Pending,
            },
        };
        log_answer(&this.outage, &response, this.started.elapsed());
        Poll::Ready(Ok(response))
    }
}

/// The request's `Content-Length`, if it has a readable one.
fn announced_length(request: &Request<Body>) -> Option<u64> {
    request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// The span of one request: method and path, never the query string, which may carry a token;
/// with auth, the name of the token that sent it (recorded by the auth layer), never the token.
fn request_span(request: &Request<Body>) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        token = tracing::field::Empty,
    )
}

/// Logs each answer: at DEBUG; a 5xx that is not one of the API's answers (a bug) at ERROR. The
/// API's own 503s (the store out or holding, a full wait queue, a shutdown) are expected: those
/// of an outage are counted into it, which is logged once when it begins and once when it ends
/// (see [`crate::metrics::Outage`]), so a Redis restart pages nobody.
fn log_answer(outage: &Outage, response: &Response, latency: Duration) {
    let status = response.status();
    let latency_ms = latency.as_millis();
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
            tracing::error!(%status, latency_ms, "answered with a server error");
        }
        None => tracing::debug!(%status, latency_ms, "answered"),
    }
}
