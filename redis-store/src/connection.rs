//! The connection to Redis: one multiplexed connection at a time, replaced when it fails, and
//! never used before it is verified.
//!
//! A server that restarted, or a replica that took over, is always reached through a new
//! connection (the old one breaks with the old process; behind Sentinel, an old master that is
//! still up is left on the sentinels' word, see `failovers.rs`). So checking the store's epoch on every
//! new connection before any request may use it (`EpochKeeper::link`) means no broker
//! grants on a server whose losses it has not caught up with — whatever its timing. Requests
//! that find no connection wait for the one being made (within their own time bound), or fail
//! at once with the last error if the last attempt failed moments ago.
//!
//! With replica acknowledgements on one server or a Sentinel master, a few more connections
//! beside the main one carry the writes that wait for replicas (`ack_links.rs`, and
//! `replicas.rs` for why).

mod ack_links;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::io::tcp::TcpSettings;
use redis::{
    AsyncConnectionConfig, Cmd, FromRedisValue, Pipeline, RedisError, RedisFuture, RedisResult,
    TlsCertificates, TlsMode, Value,
};
use tokio::sync::watch;
use tokio::time::Instant;

use super::sentinel::Sentinels;
use super::url::{ParsedUrl, Topology};
use lockbroker_core::domain::millis;
use lockbroker_core::store::{StoreError, StoreResult};

/// How the broker reaches Redis: one server, the master the sentinels name, or a cluster.
pub(super) enum Connector {
    Single(redis::Client),
    /// Asks the sentinels for the master on every new connection, so a connection made after a
    /// failover reaches the new master (see `sentinel.rs`).
    Sentinel(Sentinels),
    Cluster {
        client: ClusterClient,
        /// The seed nodes, for the notice subscriber (see [`Connector::notice_client`]).
        seeds: Vec<redis::Client>,
    },
}

impl Connector {
    pub(super) fn build(
        url: &ParsedUrl,
        tcp: TcpSettings,
        tls: Option<TlsCertificates>,
        timeout: Duration,
    ) -> StoreResult<Self> {
        let invalid = |e: RedisError| StoreError::Failed(format!("invalid Redis settings: {e}"));
        match url.topology {
            Topology::Single => {
                let info = url.connection_info(0)?.set_tcp_settings(tcp);
                let client = match tls {
                    Some(certs) => redis::Client::build_with_tls(info, certs),
                    None => redis::Client::open(info),
                };
                Ok(Self::Single(client.map_err(invalid)?))
            }
            Topology::Sentinel => Ok(Self::Sentinel(
                Sentinels::new(url, tcp, tls, timeout).map_err(invalid)?,
            )),
            Topology::Cluster => {
                let infos = (0..url.hosts.len())
                    .map(|i| url.connection_info(i))
                    .collect::<Result<Vec<_>, _>>()?;
                let seeds = infos
                    .iter()
                    .map(|info| {
                        let info = info.clone().set_tcp_settings(tcp.clone());
                        match &tls {
                            Some(certs) => redis::Client::build_with_tls(info, certs.clone()),
                            None => redis::Client::open(info),
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(invalid)?;
                let mut builder = ClusterClientBuilder::new(infos)
                    .tcp_settings(tcp)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    // Failovers take seconds: the store's own time bound decides when to give up.
                    .retries(16)
                    .min_retry_wait(20)
                    .max_retry_wait(500);
                if let Some(user) = &url.username {
                    builder = builder.username(user);
                }
                if let Some(pass) = &url.password {
                    builder = builder.password(pass);
                }
                if url.tls {
                    builder = builder.tls(TlsMode::Secure);
                    if let Some(certs) = tls {
                        builder = builder.certs(certs);
                    }
                }
                Ok(Self::Cluster {
                    client: builder.build().map_err(invalid)?,
                    seeds,
                })
            }
        }
    }

    async fn open(&self, config: &AsyncConnectionConfig) -> RedisResult<Conn> {
        match self {
            Self::Single(client) => Ok(Conn::Single(
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await?,
            )),
            Self::Sentinel(sentinels) => Ok(Conn::Single(sentinels.open(config).await?)),
            Self::Cluster { client, .. } => Ok(Conn::Cluster(client.get_async_connection().await?)),
        }
    }

    /// A client for one server that receives every release notice: the server itself, the
    /// current master, or any node of a cluster (a plain `PUBLISH` reaches every node).
    pub(super) async fn notice_client(&self, attempt: usize) -> RedisResult<redis::Client> {
        match self {
            Self::Single(client) => Ok(client.clone()),
            Self::Sentinel(sentinels) => sentinels.master_client().await,
            Self::Cluster { seeds, .. } => Ok(seeds[attempt % seeds.len()].clone()),
        }
    }
}

/// A connection of any topology; commands on a cluster connection are routed by their keys.
#[derive(Clone)]
pub(super) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(conn) => conn.req_packed_command(cmd),
            Self::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            Self::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(conn) => conn.get_db(),
            Self::Cluster(conn) => conn.get_db(),
        }
    }
}

impl Conn {
    /// `WAIT replicas timeout_ms` on the master that holds `key`: how many replicas have every
    /// write this connection made there so far. `WAIT` counts the writes of the connection it
    /// runs on, so it must follow the write on the same connection: on a cluster, the node
    /// connection that the key's slot routes to.
    pub(super) async fn wait_for_replicas(
        &mut self,
        key: &str,
        replicas: u32,
        timeout_ms: u64,
    ) -> RedisResult<u64> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(timeout_ms);
        self.on_master(wait, || Route::with_key(key, SlotAddr::Master))
            .await
    }

    /// One `SCAN` step on the master whose slots start at `first_slot` (on one server: the
    /// server): the next cursor and the keys matching `pattern`.
    pub(super) async fn scan_step(
        &mut self,
        first_slot: u16,
        cursor: u64,
        pattern: &str,
        count: usize,
    ) -> RedisResult<(u64, Vec<String>)> {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(count);
        self.on_master(scan, || Route::new(first_slot, SlotAddr::Master))
            .await
    }

    /// Runs `cmd` on one master: the server, or on a cluster the master of `route`'s slot.
    async fn on_master<T: FromRedisValue>(
        &mut self,
        cmd: Cmd,
        route: impl FnOnce() -> Route,
    ) -> RedisResult<T> {
        match self {
            Self::Single(conn) => cmd.query_async(conn).await,
            Self::Cluster(conn) => {
                let node = SingleNodeRoutingInfo::SpecificNode(route());
                let reply = conn
                    .route_command(cmd, RoutingInfo::SingleNode(node))
                    .await?;
                Ok(redis::from_redis_value(reply)?)
            }
        }
    }
}

/// After a failed attempt, how long requests fail at once before one of them tries again, so a
/// Redis that is down costs one connection attempt per interval, not one per request.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

/// Why a connection was dropped, or not used, after the sentinels named a new master.
const SWITCHED: &str = "the sentinels name a new master";

/// A verified connection. Cheap to clone: the connection is multiplexed.
#[derive(Clone)]
pub(super) struct Link {
    pub conn: Conn,
    /// Tells this connection from the ones before and after it, so that a failure on an old
    /// one does not drop its replacement.
    pub generation: u64,
}

#[derive(Clone)]
enum State {
    Up(Link),
    /// A connection is being made and verified; requests wait for it.
    Connecting,
    Down {
        error: StoreError,
        at: Instant,
    },
}

/// The store's connection to Redis: the verified [`Link`] in use (or why there is none), how
/// one is made, and the master switches that replace it; and the ack links beside it, if any.
pub(super) struct RedisConnection {
    pub connector: Connector,
    config: AsyncConnectionConfig,
    timeout: Duration,
    state: watch::Sender<State>,
    /// The ack links (`ack_links.rs`): none unless replica acknowledgements are asked for on one
    /// server or a Sentinel master. Each belongs to the main connection that was up when it was
    /// made, and goes down with it.
    acks: Box<[watch::Sender<State>]>,
    generations: AtomicU64,
    /// Counts the master switches the sentinels made known (see `failovers.rs`). The notice
    /// subscriber watches it to move to the new master.
    switches: watch::Sender<u64>,
    /// `switches` when the connection being made was started: if a switch came meanwhile, that
    /// connection may reach the old master, and it is not used.
    opened_at_switch: AtomicU64,
}

impl RedisConnection {
    /// `ack_links`: how many ack links to keep beside the main connection (0: none).
    pub(super) fn new(connector: Connector, timeout: Duration, ack_links: usize) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let never_tried = || State::Down {
            error: StoreError::Failed("not connected to Redis yet".into()),
            at: Instant::now() - RECONNECT_PAUSE,
        };
        Self {
            connector,
            config,
            timeout,
            state: watch::Sender::new(never_tried()),
            acks: (0..ack_links)
                .map(|_| watch::Sender::new(never_tried()))
                .collect(),
            generations: AtomicU64::new(0),
            switches: watch::Sender::new(0),
            opened_at_switch: AtomicU64::new(0),
        }
    }

    /// The verified connection; if there is none, waits for the one being made, calling
    /// `connect` first if nobody is making one. Not bounded here: callers bound it.
    pub(super) async fn get(&self, connect: impl Fn()) -> StoreResult<Link> {
        wait_for(&self.state, connect).await
    }

    /// The bound on one store call, connecting included.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The verified connection if there is one now; never waits.
    pub(super) fn current(&self) -> Option<Link> {
        match &*self.state.borrow() {
            State::Up(link) => Some(link.clone()),
            _ => None,
        }
    }

    /// Opens a new connection. Not yet usable: [`Connection::up`] makes it so once verified.
    pub(super) async fn open(&self) -> Result<Conn, StoreError> {
        self.opened_at_switch
            .store(*self.switches.borrow(), Ordering::Relaxed);
        self.bounded_open(self.connector.open(&self.config)).await
    }

    /// A connection being opened, within the store's time bound.
    async fn bounded_open(
        &self,
        opening: impl Future<Output = RedisResult<Conn>>,
    ) -> StoreResult<Conn> {
        match tokio::time::timeout(self.timeout, opening).await {
            Ok(opened) => opened.map_err(|e| StoreError::Failed(e.to_string())),
            Err(_) => Err(StoreError::Timeout(millis(self.timeout))),
        }
    }

    /// Makes a verified connection the one requests use, unless the sentinels named a new master
    /// since it was opened: then requests make another one at once.
    pub(super) fn up(&self, conn: Conn) {
        if self.opened_at_switch.load(Ordering::Relaxed) != *self.switches.borrow() {
            self.state.send_replace(State::Down {
                error: StoreError::Failed(SWITCHED.into()),
                at: Instant::now() - RECONNECT_PAUSE,
            });
            return;
        }
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        self.state
            .send_replace(State::Up(Link { conn, generation }));
    }

    /// A connection attempt failed.
    pub(super) fn down(&self, error: StoreError) {
        self.state.send_replace(State::Down {
            error,
            at: Instant::now(),
        });
    }

    /// Stops using connection `generation` (it broke, or a call on it timed out: a connection
    /// whose far end went silent would otherwise time out every call for minutes). The next
    /// request makes a new one at once. The main connection takes its ack links with it.
    pub(super) fn drop_link(&self, generation: u64, error: &StoreError) {
        let dropped = self.state.send_if_modified(|s| match s {
            State::Up(link) if link.generation == generation => {
                *s = State::Down {
                    error: error.clone(),
                    at: Instant::now() - RECONNECT_PAUSE,
                };
                true
            }
            _ => false,
        });
        if dropped {
            // INFO: the failed call is counted into the store outage, logged at WARN.
            tracing::info!(error = %error, "the Redis connection failed: replacing it");
            self.drop_ack_links();
        } else {
            self.drop_ack_link(generation, error);
        }
    }

    /// The sentinels name a new master: stops using the connection that is up (and any being
    /// made) and its ack links, so the next request reaches the new master through them and
    /// checks its epoch first; tells the notice subscriber to move too.
    pub(super) fn master_switched(&self) {
        self.switches.send_modify(|n| *n += 1);
        self.state.send_if_modified(|s| match s {
            State::Up(_) => {
                *s = State::Down {
                    error: StoreError::Failed(SWITCHED.into()),
                    at: Instant::now() - RECONNECT_PAUSE,
                };
                true
            }
            _ => false,
        });
        self.drop_ack_links();
    }

    /// Changes with every master switch (see [`Connection::master_switched`]).
    pub(super) fn switches(&self) -> watch::Receiver<u64> {
        self.switches.subscribe()
    }
}

/// The verified connection `state` holds; if there is none, waits for the one being made,
/// calling `connect` first if nobody is making one.
async fn wait_for(state: &watch::Sender<State>, connect: impl Fn()) -> StoreResult<Link> {
    let mut rx = state.subscribe();
    loop {
        let start = match &*rx.borrow_and_update() {
            State::Up(link) => return Ok(link.clone()),
            State::Down { error, at } if at.elapsed() < RECONNECT_PAUSE => {
                return Err(error.clone());
            }
            State::Down { .. } => true,
            State::Connecting => false,
        };
        if start
            && state.send_if_modified(|s| match s {
                State::Down { .. } => {
                    *s = State::Connecting;
                    true
                }
                _ => false,
            })
        {
            connect();
        }
        if rx.changed().await.is_err() {
            return Err(StoreError::Failed("the Redis store was shut down".into()));
        }
    }
}

/// Whether a failed call means the connection itself is unusable.
pub(super) fn breaks_connection(e: &RedisError) -> bool {
    e.is_connection_dropped()
        || e.is_io_error()
        || e.is_timeout()
        || e.is_unrecoverable_error()
        // A server that became a replica (a failover demoted it) refuses writes: find the master.
        || e.code() == Some("READONLY")
}
