//! The layer in front of every route: a body announced larger than the limit is refused at
//! once, before it is read (waiting for a `Content-Length` of a terabyte would hold the request
//! open for ever), and every answer is logged in the request's span ([`log_answer`]).
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
use tower::{Layer, Service};

use super::error::{ApiError, Expected};
use super::params::BODY_LIMIT;
use crate::lock::Outage;

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
        let inner = if announced_too_large(&request) {
            Err(Some(
                ApiError::payload_too_large(BODY_LIMIT).into_response(),
            ))
        } else {
            Ok(self.inner.call(request))
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

/// The answer of a [`GateService`]: the inner service's, or the refusal of an oversized body.
pub(super) struct GateFuture<F> {
    /// `Err`: answered at once (taken when polled).
    inner: Result<F, Option<Response>>,
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
            Ok(inner) => match Pin::new(inner).poll(cx) {
                Poll::Ready(Ok(response)) => response,
                Poll::Ready(Err(never)) => match never {},
                Poll::Pending => return Poll::Pending,
            },
            Err(ready) => ready
                .take()
                .expect("a future is not polled after it completed"),
        };
        log_answer(&this.outage, &response, this.started.elapsed());
        Poll::Ready(Ok(response))
    }
}

/// Whether the request's `Content-Length` is over the body limit.
fn announced_too_large(request: &Request<Body>) -> bool {
    request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|len| len > BODY_LIMIT as u64)
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
/// (see [`crate::lock::Outage`]), so a Redis restart pages nobody.
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
