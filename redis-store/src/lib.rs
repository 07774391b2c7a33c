//! The Redis store: each primitive is one Lua script (`scripts/`), run by SHA over one
//! multiplexed connection that is verified before use (`connection.rs`, `calls.rs`; with replica
//! acknowledgements, a few more beside it: `connection/ack_links.rs`), reading the time from
//! Redis's own `TIME`. The broker's live leases are kept in a ledger and put back
//! when the store loses them; release notices reach every broker's waiters (`notices.rs`);
//! behind Sentinel, the broker follows the master's failovers (`sentinel.rs` finds the master, `failovers.rs` follows it).
//!
//! Two owners. [`RedisStore`] is the `Store` on Redis: its primitives (`primitives.rs`),
//! granting (`grant.rs`), the wait for replicas (`replicas.rs`), listing (`listing.rs`). Under
//! it, the `EpochKeeper` (`epoch.rs`) owns the connection, the epoch and the ledger,
//! and so every call on Redis (`calls.rs`), the epoch check (`epoch.rs`, `check.rs`) and the
//! put-back (`put_back.rs`). Where the keys are: `KeyLayout` (`keys.rs`). The path
//! of an acquire, from the route to the Lua script, and the key layout, once: `README.md` beside
//! this crate's manifest.
#![forbid(unsafe_code)]

mod batch;
mod calls;
mod check;
mod connection;
mod epoch;
mod grant;
mod handed;
mod keys;
mod ledger;
// Only for lockbroker-bench (the `bench` feature): the ledger itself stays private.
mod failovers;
#[cfg(feature = "bench")]
mod ledger_cost;
mod listing;
mod notices;
mod primitives;
mod put_back;
mod replicas;
mod scripts;
mod sentinel;
mod sessions;
mod several;
mod shard;
mod slots;
pub(crate) mod url;

#[cfg(feature = "bench")]
pub use ledger_cost::{LedgerCost, ledger_cost};

/// The function library the broker loads on one Redis or Sentinel (`FUNCTION LOAD`'s text), as
/// this build makes it: its lock scripts as Redis functions (see `scripts/library.rs`).
pub fn function_library() -> String {
    scripts::Scripts::new(true).library().source().to_owned()
}

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use redis::io::tcp::{TcpSettings, socket2};
use redis::{ClientTlsConfig, TlsCertificates};

use self::connection::{Connector, RedisConnection};
use self::epoch::{Epoch, EpochKeeper};
use self::keys::KeyLayout;
use self::replicas::Replicas;
use self::scripts::Scripts;
pub use self::slots::slot_of;
pub use self::url::{ParsedUrl, RedisUrl, Topology};
use crate::ledger::Ledger;
use lockbroker_core::metrics::Metrics;
use lockbroker_core::store::{StoreError, StoreResult};

/// Connection settings for [`RedisStore::connect`]. `Debug` shows no password.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// The Redis to keep locks in, parsed once.
    pub url: RedisUrl,
    /// Prepended to every Redis key the broker writes.
    pub key_prefix: String,
    /// Bound on one store call, connecting included.
    pub timeout: Duration,
    /// Paranoid option: after a detected loss, hold every grant until this long after the new
    /// epoch began (0: only the settle time).
    pub store_loss_delay: Duration,
    /// How long a new epoch holds every grant, so that every running broker that knew the store
    /// puts its live leases back first.
    pub store_settle: Duration,
    /// Certificates for TLS URLs (`rediss…://`); the configuration refuses them with a plain
    /// URL, so they are not checked against it again here.
    pub tls: RedisTls,
    /// How many replicas must have a grant or renewal before it is answered (see
    /// `replicas.rs`); 0: answered once the master has it.
    pub replica_acks: u32,
    /// The most claims and releases one script call carries when they arrive while another
    /// call is in flight (group commit, `batch.rs`); 1: each call alone.
    pub batch_max: usize,
}

/// PEM files for TLS to Redis. Without a CA file the system's roots are trusted.
#[derive(Debug, Clone, Default)]
pub struct RedisTls {
    /// The CA that Redis's certificate must chain to.
    pub ca: Option<PathBuf>,
    /// A certificate to present to Redis.
    pub client: Option<ClientCertificate>,
}

/// A client certificate for TLS to Redis: both files or neither, by construction.
#[derive(Debug, Clone)]
pub struct ClientCertificate {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl RedisTls {
    /// The certificates to use, read from their files; `None` when no file is set.
    fn load(&self) -> StoreResult<Option<TlsCertificates>> {
        let read = |what: &str, path: &PathBuf| {
            std::fs::read(path).map_err(|e| {
                StoreError::Failed(format!(
                    "cannot read the Redis TLS {what} {}: {e}",
                    path.display()
                ))
            })
        };
        let client_tls = match &self.client {
            None => None,
            Some(client) => Some(ClientTlsConfig {
                client_cert: read("certificate", &client.cert)?,
                client_key: read("key", &client.key)?,
            }),
        };
        let root_cert = self.ca.as_ref().map(|ca| read("CA", ca)).transpose()?;
        Ok(
            (client_tls.is_some() || root_cert.is_some()).then_some(TlsCertificates {
                client_tls,
                root_cert,
            }),
        )
    }
}

/// Chooses `ring` as the process's TLS crypto provider. The redis crate builds its rustls
/// configurations with the process default, and rustls cannot pick one by itself when no
/// provider, or more than one, is compiled in (it panics at the first TLS connection). Done once,
/// before the first `rediss://` client is built; a provider already installed is kept.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// This broker as the scripts know it.
pub(crate) struct Broker {
    /// A random id (12 hex digits), new at every start: what its queued bids and the leases it
    /// answers for record.
    pub id: String,
    /// `<prefix>b:`: every broker's own channel is this and its id.
    pub channels: String,
    /// `<prefix>b:<id>`.
    pub channel: String,
    /// `<prefix>b:changes`, where the scripts announce changes to watched keys (ids are hex,
    /// so no broker's own channel is this one).
    pub changes: String,
    /// How long an offer to a queued bid stays open: the store timeout (the broker must see
    /// the notice and take the offer in one call).
    pub window_ms: u64,
}

impl Broker {
    fn new(prefix: &str, timeout: Duration) -> Self {
        let id: String = (0..12)
            .map(|_| char::from(b"0123456789abcdef"[rand::random_range(0..16usize)]))
            .collect();
        let channels = format!("{prefix}b:");
        Self {
            channel: format!("{channels}{id}"),
            changes: format!("{channels}changes"),
            id,
            channels,
            window_ms: u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
        }
    }

    /// The caller, as the queue's scripts take it.
    pub(crate) fn caller(&self) -> scripts::Caller<'_> {
        scripts::Caller {
            id: &self.id,
            channels: &self.channels,
            window_ms: self.window_ms,
        }
    }
}

/// The Redis store. Cloning is cheap: everything is shared. One field a concern.
#[derive(Clone)]
pub struct RedisStore {
    /// Where the broker's keys are in Redis (`keys.rs`).
    layout: Arc<KeyLayout>,
    /// `<prefix>released`: the shared channel, which every broker reads: epoch announcements,
    /// and the ends of leases written by older brokers (`notices.rs`).
    channel: Arc<str>,
    /// This broker on the store: its id and its own channel, where the scripts tell it of
    /// offers to its queued bids and of ends of leases it remembers (`notices.rs`).
    broker: Arc<Broker>,
    /// Every call on Redis, over the connection it owns, in the epoch it keeps; the ledger of
    /// this broker's live leases, which it puts back after a loss (`epoch.rs`).
    keeper: Arc<EpochKeeper>,
    /// The wait for replicas after each granting or renewing write (`replicas.rs`).
    replicas: Arc<Replicas>,
    metrics: Arc<Metrics>,
}

impl RedisStore {
    /// Sets up the store without waiting for Redis: the broker starts (and says it is not
    /// ready) while Redis is down, and connects when it returns.
    pub fn connect(settings: &RedisSettings, metrics: Arc<Metrics>) -> StoreResult<Self> {
        let url = settings.url.parsed();
        // A response timeout alone does not tell a dead connection from a slow one: on a
        // connection whose far end vanished without a reset (a host gone, a black-holing
        // middlebox), every call would time out until the kernel gave up, minutes later.
        // TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged, and keepalive
        // probes an idle one, so such a connection fails and is replaced within a few seconds.
        let tcp = TcpSettings::default().set_nodelay(true).set_keepalive(
            socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(5))
                .with_interval(Duration::from_secs(1)),
        );
        #[cfg(target_os = "linux")]
        let tcp = tcp.set_user_timeout(settings.timeout.max(Duration::from_secs(1)));
        if url.tls {
            install_tls_provider();
        }
        let tls = settings.tls.load()?;
        let connector = Connector::build(url, tcp, tls, settings.timeout)?;
        let cluster = url.topology == Topology::Cluster;
        let prefix = settings.key_prefix.as_str();
        let layout = Arc::new(KeyLayout {
            prefix: prefix.into(),
            marker: format!("{prefix}epoch"),
            cluster,
        });
        let channel: Arc<str> = format!("{prefix}released").into();
        let broker = Arc::new(Broker::new(prefix, settings.timeout));
        // Ack links only where `WAIT` would otherwise share the one connection of a server.
        let ack_links = if settings.replica_acks > 0 && !cluster {
            replicas::ACK_LINKS
        } else {
            0
        };
        let keeper = EpochKeeper {
            layout: layout.clone(),
            channel: channel.clone(),
            broker: broker.clone(),
            connection: RedisConnection::new(connector, settings.timeout, ack_links),
            // Functions on one Redis and Sentinel; a cluster's NOSCRIPT is news (`library.rs`).
            scripts: Scripts::new(!cluster),
            epoch: Epoch::new(settings.store_settle, settings.store_loss_delay),
            // An end's mark outlasts the answer of a renewal Redis ran before it: that call's
            // time bound, and as much again for its replicas.
            ledger: Ledger::with_linger(settings.timeout * 2 + Duration::from_secs(1)),
            notices: std::sync::OnceLock::new(),
            metrics: metrics.clone(),
            batcher: batch::Batcher::new(settings.batch_max),
            handed: handed::HandedGrants::new(settings.replica_acks == 0),
        };
        Ok(Self {
            layout,
            channel,
            broker,
            keeper: Arc::new(keeper),
            replicas: Arc::new(Replicas::new(
                settings.replica_acks,
                settings.timeout,
                ack_links,
            )),
            metrics,
        })
    }
}
