//! A TCP proxy on loopback whose behaviour the test switches while traffic flows: pass it
//! through, delay it, drop the connections, or blackhole them. Brokers point their Redis URL at it
//! to meet a slow or cut-off Redis; the demo uses it as the load balancer in front of its app
//! nodes (each new connection goes to the next upstream in turn, as a round-robin balancer does).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// What the proxy does with traffic, switchable at run time with [`Proxy::set`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Forward everything as it comes.
    Pass,
    /// Forward every chunk this much later than it arrived, in order (a slow link: bytes
    /// already sent are delivered late, even after the sender gave up on them).
    Delay(Duration),
    /// Close every connection, and close new ones as soon as they are accepted (a cut link, or
    /// a Redis that went away): whatever was still in the proxy is lost.
    Drop,
    /// Accept and read, but never forward nor answer (a partition: the peer sees silence). The
    /// bytes read are discarded, so a connection that was blackholed is out of step with Redis:
    /// it is closed when the blackhole ends, as a real partition ends with a reset.
    Blackhole,
    /// [`Mode::Blackhole`] for the connections accepted before the proxy's n-th, [`Mode::Pass`]
    /// for the others: a half-open connection whose far end still acknowledges everything,
    /// while a new connection works. Set with [`Proxy::blackhole_existing`].
    BlackholeOlderThan(usize),
}

impl Mode {
    /// The mode as it applies to the connection accepted `born`-th.
    fn for_connection(self, born: usize) -> Self {
        match self {
            Mode::BlackholeOlderThan(n) if born < n => Mode::Blackhole,
            Mode::BlackholeOlderThan(_) => Mode::Pass,
            mode => mode,
        }
    }
}

/// How long the proxy tries to reach an upstream for a new connection.
const CONNECT_LIMIT: Duration = Duration::from_secs(1);

struct Shared {
    upstreams: Vec<SocketAddr>,
    next: AtomicUsize,
    /// Connections accepted so far.
    accepted: AtomicUsize,
    mode: watch::Sender<Mode>,
}

/// A running proxy; stops (closing every connection) when dropped.
pub(crate) struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// A proxy to one upstream, in [`Mode::Pass`].
    pub(crate) async fn start(upstream: SocketAddr) -> Self {
        Self::balance(vec![upstream]).await
    }

    /// A proxy spreading connections over `upstreams` in turn, in [`Mode::Pass`].
    pub(crate) async fn balance(upstreams: Vec<SocketAddr>) -> Self {
        assert!(!upstreams.is_empty());
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("the proxy binds a loopback port");
        let addr = listener.local_addr().expect("a bound address");
        let shared = Arc::new(Shared {
            upstreams,
            next: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
            mode: watch::Sender::new(Mode::Pass),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Self {
            addr,
            shared,
            accept,
        }
    }

    /// `redis://127.0.0.1:PORT/`, for a broker to use as its Redis.
    pub(crate) fn redis_url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// `http://127.0.0.1:PORT`, for clients of the servers behind it.
    pub(crate) fn http_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Switches the mode; connections under way follow at once.
    pub(crate) fn set(&self, mode: Mode) {
        self.shared.mode.send_replace(mode);
    }

    /// Blackholes every connection open now; new ones pass.
    pub(crate) fn blackhole_existing(&self) {
        let accepted = self.shared.accepted.load(Ordering::SeqCst);
        self.set(Mode::BlackholeOlderThan(accepted));
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every connection's task.
        self.accept.abort();
    }
}

/// The address in a `redis://HOST:PORT/` URL.
pub(crate) fn redis_addr(url: &str) -> SocketAddr {
    url.trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|e| panic!("{url} is not redis://IP:PORT/: {e}"))
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        // Reap finished connections as we go, so the set does not grow with every one.
        while connections.try_join_next().is_some() {}
        connections.spawn(serve(client, shared.clone()));
    }
}

/// One proxied connection: ends when either side closes, when the mode turns to `Drop`, or when
/// a blackhole this connection was caught in ends.
async fn serve(client: TcpStream, shared: Arc<Shared>) {
    let born = shared.accepted.fetch_add(1, Ordering::SeqCst);
    let mut mode = shared.mode.subscribe();
    if mode.borrow_and_update().for_connection(born) == Mode::Drop {
        return;
    }
    let i = shared.next.fetch_add(1, Ordering::Relaxed) % shared.upstreams.len();
    let server =
        match tokio::time::timeout(CONNECT_LIMIT, TcpStream::connect(shared.upstreams[i])).await {
            Ok(Ok(server)) => server,
            _ => return,
        };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let blackholed = Arc::new(AtomicBool::new(false));
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let pipe = |from, to| pump(from, to, shared.mode.subscribe(), born, blackholed.clone());
    let (up, down) = (
        pipe(client_read, server_write),
        pipe(server_read, client_write),
    );
    let cut = async {
        loop {
            if mode.changed().await.is_err() {
                return;
            }
            let now = mode.borrow_and_update().for_connection(born);
            if now == Mode::Drop || (blackholed.load(Ordering::SeqCst) && now != Mode::Blackhole) {
                return;
            }
        }
    };
    // Returning drops both sockets: the connection closes on both sides.
    tokio::select! {
        () = up => {}
        () = down => {}
        () = cut => {}
    }
}

/// Copies one direction, chunk by chunk, as the mode says. Chunks go through a queue to a writer
/// that sends each at its due time, so a delay postpones traffic without slowing its rate, and
/// order is kept.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mode: watch::Receiver<Mode>,
    born: usize,
    blackholed: Arc<AtomicBool>,
) {
    let (queue, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let now = mode.borrow().for_connection(born);
            if now == Mode::Blackhole {
                blackholed.store(true, Ordering::SeqCst);
            }
            if blackholed.load(Ordering::SeqCst) {
                continue;
            }
            let at = match now {
                Mode::Pass => Instant::now(),
                Mode::Delay(by) => Instant::now() + by,
                Mode::Drop => break,
                Mode::Blackhole | Mode::BlackholeOlderThan(_) => {
                    unreachable!("handled above, or resolved by for_connection")
                }
            };
            if queue.send((at, buf[..n].to_vec())).is_err() {
                break;
            }
        }
        // Dropping the queue's sender lets the writer finish what was already queued.
    };
    let writer = async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(reader, writer);
}
