//! Serving the API (`crate::http::Api`: the router behind its layers) on a listener, connection by connection: the accept loop, HTTPS
//! ([`tls`]), the connection limits, and graceful shutdown. Written by hand on hyper (rather
//! than `axum::serve`) for what the API promises about connections:
//!
//! - at most `max_connections` open at once: a permit is taken *before* `accept`, so later
//!   connections wait in the kernel's queue and an accept error (out of file descriptors) is
//!   logged and retried, never fatal;
//! - a request head must arrive within `header_timeout`: the TLS handshake and the protocol
//!   sniffing share that bound, then hyper's own header timer runs for each head, which on
//!   HTTP/1.1 is also the idle time of a kept-alive connection between requests (an HTTP/2
//!   connection with no stream for that long is closed too);
//! - a head over [`MAX_HEAD_BYTES`] is answered `431`, and hyper's own rejections get the JSON
//!   error body ([`io`]);
//! - on shutdown, idle connections and half-sent heads are closed at once, requests under way
//!   finish (waiting ones are answered `503` by the lock service), and whatever is still open
//!   after `DRAIN_LIMIT` is dropped.

pub(crate) mod io;
pub(crate) mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use futures_util::FutureExt;
use futures_util::future::Either;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tower::ServiceExt;

use crate::http::{Api, ApiBody};
use crate::reload::Reloadable;

/// Largest request head (request line and header fields): over it, `431`.
pub(crate) const MAX_HEAD_BYTES: usize = 16 * 1024;

/// How long shutdown waits for connections with requests under way. Waiting acquires are
/// answered at once and a store call ends within `store_timeout_ms`, so only a client that
/// stalls its own request or its reading of the answer is cut off by this.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// Pause after an accept error (such as running out of file descriptors) before the next try,
/// so a full table does not turn into a busy loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// HTTP/2 pings on an idle connection, and how long an answer may take before the connection
/// is closed: a peer that vanished does not keep its connection (and its permit).
const H2_KEEP_ALIVE: Duration = Duration::from_secs(20);

/// The client preface that opens an HTTP/2 connection without TLS (h2c, prior knowledge).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How connections are served.
#[derive(Clone)]
pub(crate) struct ServeSettings {
    pub header_timeout: Duration,
    pub max_connections: usize,
    /// HTTPS, with the configuration in force for new connections; plain HTTP when `None`.
    pub tls: Option<Arc<Reloadable<ServerConfig>>>,
}

/// Serves `api` on `listener` until `stop` completes, then shuts down gracefully;
/// `on_stop` runs first (the lock service answers its waiters).
pub(crate) async fn serve(
    listener: TcpListener,
    api: Api,
    settings: ServeSettings,
    stop: impl Future<Output = ()> + Send + 'static,
    on_stop: impl FnOnce() + Send,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(settings.max_connections));
    let (closing, closing_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(stop);
    loop {
        while connections.try_join_next().is_some() {}
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => {
                permit.expect("the semaphore is never closed")
            }
            () = &mut stop => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept a connection; trying again");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let tls = settings
            .tls
            .as_ref()
            .map(|config| TlsAcceptor::from(config.current()));
        let connection = Connection {
            api: api.clone(),
            header_timeout: settings.header_timeout,
            closing: closing_rx.clone(),
        };
        // The permit goes when the connection's task ends.
        connections.spawn(connection.serve(stream, tls).map(move |()| drop(permit)));
    }
    drop(listener);
    tracing::info!("shutting down: waiting requests get 503, in-flight ones finish");
    on_stop();
    let _ = closing.send(true);
    let drained = tokio::time::timeout(DRAIN_LIMIT, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = connections.len(),
            "closing connections still open {DRAIN_LIMIT:?} after shutdown began"
        );
        connections.shutdown().await;
    }
    Ok(())
}

/// One accepted connection's settings.
struct Connection {
    api: Api,
    header_timeout: Duration,
    closing: watch::Receiver<bool>,
}

/// Which protocol a connection speaks, and the bytes read to find out.
enum Protocol {
    Http1,
    Http2,
}

impl Connection {
    /// Serves the connection until it ends.
    ///
    /// The connection's task is most of a parked HTTP/1.1 waiter's memory, so its future is
    /// kept small: the TLS handshake and stream, larger than all the rest of it, are boxed; and
    /// the steps are not `async fn`s, which keep room for their arguments twice (as they came,
    /// and as the body's own), but functions that return an `async` block or a combinator.
    fn serve(
        self,
        stream: TcpStream,
        tls: Option<TlsAcceptor>,
    ) -> impl Future<Output = ()> + Send + 'static {
        let _ = stream.set_nodelay(true);
        let started = Instant::now();
        match tls {
            None => Either::Left(self.serve_plain(stream, started)),
            Some(acceptor) => Either::Right(Box::pin(self.serve_tls(stream, acceptor, started))),
        }
    }

    // An `async` block, not an `async fn`: see `serve`.
    #[allow(clippy::manual_async_fn)]
    fn serve_plain(
        self,
        mut stream: TcpStream,
        started: Instant,
    ) -> impl Future<Output = ()> + Send + 'static {
        async move {
            let mut closing = self.closing.clone();
            let sniffed = tokio::select! {
                sniffed = tokio::time::timeout(self.header_timeout, sniff(&mut stream)) => {
                    sniffed
                }
                // A client that has not finished its first bytes has no request under way.
                _ = closing.changed() => return,
            };
            let Ok(Ok(Some((protocol, read)))) = sniffed else {
                return;
            };
            self.run(stream, read, protocol, started).await;
        }
    }

    async fn serve_tls(self, stream: TcpStream, acceptor: TlsAcceptor, started: Instant) {
        let mut closing = self.closing.clone();
        let accepted = tokio::select! {
            accepted = tokio::time::timeout(self.header_timeout, acceptor.accept(stream)) => {
                accepted
            }
            _ = closing.changed() => return,
        };
        let stream = match accepted {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!("TLS handshake not done within the header timeout");
                return;
            }
        };
        let protocol = match stream.get_ref().1.alpn_protocol() {
            Some(b"h2") => Protocol::Http2,
            _ => Protocol::Http1,
        };
        self.run(stream, Vec::new(), protocol, started).await;
    }

    fn run<I>(
        self,
        stream: I,
        read: Vec<u8>,
        protocol: Protocol,
        started: Instant,
    ) -> impl Future<Output = ()> + Send + 'static
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Self {
            api,
            header_timeout,
            mut closing,
        } = self;
        async move {
            // Requests under way on this connection, each until its response body is sent.
            let activity = Arc::new(Activity::new());
            let counter = activity.clone();
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let guard = UnderWay::new(counter.clone());
                // A future of its own, not an `async` block: the block would keep the API's
                // future twice (as captured, and as awaited), for as long as the request waits.
                Answer {
                    future: api.clone().oneshot(request.map(Body::new)),
                    guard: Some(guard),
                }
            });
            // On shutdown, a connection with no request under way is idle or has sent part of a
            // head at most: it is closed at once. (Hyper alone would wait for the rest of a
            // half-sent first head until the header timeout.)
            let idle = || activity.idle_for().is_some();
            let result = match protocol {
                Protocol::Http1 => {
                    // The first head's time started with the connection.
                    let first_head = header_timeout
                        .saturating_sub(started.elapsed())
                        .max(Duration::from_millis(1));
                    let io = TokioIo::new(io::Stream::new(stream, read, true));
                    // Boxed, as the HTTP/2 one below: the connection's task then takes the size of
                    // the protocol it speaks, not of the larger of the two.
                    let mut connection = Box::pin(
                        http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(first_head.min(header_timeout))
                            .max_header_size(MAX_HEAD_BYTES)
                            .serve_connection(io, service),
                    );
                    tokio::select! {
                        result = connection.as_mut() => result,
                        _ = closing.changed() => {
                            if idle() {
                                return;
                            }
                            connection.as_mut().graceful_shutdown();
                            connection.await
                        }
                    }
                }
                Protocol::Http2 => {
                    let io = TokioIo::new(io::Stream::new(stream, read, false));
                    let mut connection = Box::pin(
                        http2::Builder::new(TokioExecutor::new())
                            .timer(TokioTimer::new())
                            .keep_alive_interval(H2_KEEP_ALIVE)
                            .keep_alive_timeout(H2_KEEP_ALIVE)
                            .max_header_list_size(MAX_HEAD_BYTES as u32)
                            .serve_connection(io, service),
                    );
                    // HTTP/2 has no header timer between requests: a connection with no stream
                    // for header_timeout is closed here (GOAWAY), as an idle HTTP/1.1 one is.
                    let mut check = tokio::time::interval((header_timeout / 4).max(IDLE_CHECK_MIN));
                    let mut ending = false;
                    // A GOAWAY completes when the client answers the ping that goes with it; an
                    // idle client that does not is dropped after one more header timeout.
                    let mut give_up: Option<Pin<Box<tokio::time::Sleep>>> = None;
                    loop {
                        tokio::select! {
                            result = connection.as_mut() => break result,
                            _ = closing.changed(), if !ending => {
                                connection.as_mut().graceful_shutdown();
                                ending = true;
                            }
                            _ = check.tick(), if !ending => {
                                if activity.idle_for().is_some_and(|idle| idle >= header_timeout) {
                                    connection.as_mut().graceful_shutdown();
                                    ending = true;
                                    give_up = Some(Box::pin(tokio::time::sleep(header_timeout)));
                                }
                            }
                            () = async { give_up.as_mut().expect("guarded").await }, if give_up.is_some() => {
                                break Ok(());
                            }
                        }
                    }
                }
            };
            if let Err(e) = result {
                // Header timeouts, resets, hyper's rejections: the client's doing, not the
                // broker's.
                tracing::debug!(error = %e, "connection ended with an error");
            }
        }
    }
}

/// Shortest period of the HTTP/2 idle check.
const IDLE_CHECK_MIN: Duration = Duration::from_millis(10);

/// What a connection is doing: requests under way, and when the last one ended.
struct Activity {
    under_way: AtomicUsize,
    started: Instant,
    /// When the last request ended, in ms since `started`.
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            under_way: AtomicUsize::new(0),
            started: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    /// How long the connection has had no request under way; `None` while one is.
    fn idle_for(&self) -> Option<Duration> {
        if self.under_way.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::SeqCst));
        Some(self.started.elapsed().saturating_sub(last))
    }
}

/// Counts a request as under way while it lives.
struct UnderWay(Arc<Activity>);

impl UnderWay {
    fn new(activity: Arc<Activity>) -> Self {
        activity.under_way.fetch_add(1, Ordering::SeqCst);
        Self(activity)
    }
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        let now = u64::try_from(self.0.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.last_ms.store(now, Ordering::SeqCst);
        self.0.under_way.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request's answer from the API, its body then counted as under way ([`CountedBody`]).
struct Answer<F> {
    future: F,
    guard: Option<UnderWay>,
}

impl<F> Future for Answer<F>
where
    F: Future<Output = Result<hyper::Response<ApiBody>, Infallible>> + Unpin,
{
    type Output = Result<hyper::Response<CountedBody>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let response = std::task::ready!(Pin::new(&mut self.future).poll(cx))?;
        let guard = self
            .guard
            .take()
            .expect("a future is not polled after it completed");
        Poll::Ready(Ok(response.map(|body| CountedBody {
            body,
            _guard: guard,
        })))
    }
}

/// A response body that keeps its request counted as under way until it is sent (dropped).
struct CountedBody {
    body: ApiBody,
    _guard: UnderWay,
}

impl http_body::Body for CountedBody {
    type Data = axum::body::Bytes;
    type Error = <ApiBody as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Reads until the bytes tell HTTP/2's preface from anything else (HTTP/1.1). `None` when the
/// client closed first.
async fn sniff(stream: &mut TcpStream) -> std::io::Result<Option<(Protocol, Vec<u8>)>> {
    let mut read = vec![0u8; H2_PREFACE.len()];
    let mut filled = 0;
    loop {
        let n = stream.read(&mut read[filled..]).await?;
        if n == 0 {
            return Ok(None);
        }
        filled += n;
        if read[..filled] != H2_PREFACE[..filled] {
            read.truncate(filled);
            return Ok(Some((Protocol::Http1, read)));
        }
        if filled == H2_PREFACE.len() {
            return Ok(Some((Protocol::Http2, read)));
        }
    }
}
