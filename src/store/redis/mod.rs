//! The Redis store: each primitive is one Lua script (`scripts.rs`), run by SHA over one
//! multiplexed connection that is verified before use (`connection.rs`), reading the time from
//! Redis's own `TIME`. The broker's live leases are kept in a ledger and put back when the store
//! loses them (`epoch.rs`); release notices reach every broker's waiters (`notices.rs`); behind
//! Sentinel, the broker follows the master's failovers (`sentinel.rs`).

mod connection;
mod epoch;
mod listing;
mod notices;
mod replicas;
mod replies;
mod scripts;
mod sentinel;
mod slots;
pub mod url;

use std::borrow::Cow;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use redis::io::tcp::{TcpSettings, socket2};
use redis::{ClientTlsConfig, FromRedisValue, RedisError, TlsCertificates, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use self::connection::{Conn, Connection, Connector, Link, breaks_connection};
use self::epoch::Epoch;
use self::replicas::Replicas;
use self::replies::{corrupt, field, held, lease_at, leases_from, parse_owner, refusal};
use self::scripts::{Call, Scripts};
pub use self::slots::slot_of;
use self::slots::tag_for;
pub use self::url::{ParsedUrl, RedisUrl, Topology};
use super::ledger::{Kind, Ledger};
use super::{
    Bid, EXPIRY_SLACK_MS, Grant, Hold, HoldReason, Holder, Join, Lease, ListQuery, Notice, Page,
    Permits, Pool, Released, Snapshot, Space, Store, StoreError, StoreResult,
};
use crate::domain::{Fence, LockKey, Token, Ttl, millis};
use crate::metrics::Metrics;

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

/// A semaphore's release notices carry its key after this (a lock key never has it).
const SEMAPHORE_NOTICE: &str = "#";

/// The Redis keys of one key in one space (see `scripts.rs`).
struct Names {
    /// The exclusive lease (for a semaphore: its pool, where no such lease is).
    lock: String,
    fence: String,
    pool: String,
    ends: String,
    /// The waiting exclusive acquires' intents.
    writers: String,
    /// What release notices carry for the key.
    notice: String,
}

/// Which granting script a bid runs.
#[derive(Debug, Clone, Copy)]
enum How {
    Claim,
    /// The fence of the expired lease seen.
    TakeOver(Fence),
    Join(Pool),
}

/// What a granting script answered.
enum Granting {
    Granted(Lease),
    Refused,
    Busy { retry_after_ms: u64 },
    LimitMismatch { limit: u32 },
    Held(Hold),
}

impl Granting {
    /// The answer of CLAIM or TAKE_OVER.
    fn exclusive(self) -> Grant {
        match self {
            Granting::Granted(lease) => Grant::Granted(lease),
            Granting::Held(hold) => Grant::Held(hold),
            Granting::Refused | Granting::Busy { .. } | Granting::LimitMismatch { .. } => {
                Grant::Refused
            }
        }
    }
}

/// An owner label as the pool scripts take it: '' for none, else '=' and the label.
fn labelled(owner: Option<&str>) -> String {
    owner.map_or(String::new(), |o| format!("={o}"))
}

/// The Redis store. Cloning is cheap: everything is shared.
#[derive(Clone)]
pub struct RedisStore {
    connection: Arc<Connection>,
    prefix: Arc<str>,
    /// `<prefix>released`: where releases publish the client key.
    channel: Arc<str>,
    /// `<prefix>epoch`: the store's epoch marker (see `epoch.rs`); on a cluster, one per slot.
    marker: Arc<str>,
    /// On a Redis Cluster: per-master epochs, per-slot markers (see `epoch.rs`).
    cluster: bool,
    epoch: Arc<Epoch>,
    ledger: Arc<Ledger>,
    metrics: Arc<Metrics>,
    store_settle: Duration,
    store_loss_delay: Duration,
    timeout: Duration,
    scripts: Arc<Scripts>,
    replicas: Arc<Replicas>,
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
        Ok(Self {
            connection: Arc::new(Connection::new(connector, settings.timeout)),
            prefix: prefix.into(),
            channel: format!("{prefix}released").into(),
            marker: format!("{prefix}epoch").into(),
            cluster,
            epoch: Arc::default(),
            ledger: Arc::default(),
            metrics,
            store_settle: settings.store_settle,
            store_loss_delay: settings.store_loss_delay,
            timeout: settings.timeout,
            scripts: Arc::new(Scripts::new()),
            replicas: Arc::new(Replicas::new(settings.replica_acks, settings.timeout)),
        })
    }

    fn keys(&self, key: &LockKey) -> [String; 2] {
        [
            format!("{}{{{}}}:lock", self.prefix, key),
            format!("{}{{{}}}:fence", self.prefix, key),
        ]
    }

    /// The Redis keys of `key` in `space` (see `scripts.rs`).
    fn names(&self, space: Space, key: &LockKey) -> Names {
        let base = format!("{}{{{}}}", self.prefix, key);
        match space {
            Space::Locks => Names {
                lock: format!("{base}:lock"),
                fence: format!("{base}:fence"),
                pool: format!("{base}:shared"),
                ends: format!("{base}:shared:ends"),
                writers: format!("{base}:writers"),
                notice: key.as_str().into(),
            },
            Space::Semaphores => Names {
                // A semaphore has no exclusive lease: the scripts find none in its pool.
                lock: format!("{base}:sem"),
                fence: format!("{base}:sem:fence"),
                pool: format!("{base}:sem"),
                ends: format!("{base}:sem:ends"),
                writers: format!("{base}:sem:writers"),
                notice: format!("{SEMAPHORE_NOTICE}{key}"),
            },
        }
    }

    /// On a cluster, the slot of `key`'s Redis keys.
    fn slot(&self, key: &LockKey) -> Option<u16> {
        self.cluster
            .then(|| slot_of(format!("{}{{{}}}", self.prefix, key).as_bytes()))
    }

    /// The epoch marker a script on `key` reads: the store's, or on a cluster its slot's.
    fn marker_for(&self, key: &LockKey) -> Cow<'_, str> {
        match self.slot(key) {
            Some(slot) => Cow::Owned(self.marker_of(slot)),
            None => Cow::Borrowed(&self.marker),
        }
    }

    /// The epoch marker of `slot` (on one server, the store's one marker).
    fn marker_of(&self, slot: u16) -> String {
        if self.cluster {
            format!("{}{{{}}}", self.marker, tag_for(slot))
        } else {
            self.marker.to_string()
        }
    }

    /// Runs a script call by SHA. A server without the script (NOSCRIPT) is, on a cluster, one
    /// the broker has not checked since it started — a restart or a promoted replica, whose
    /// connection the cluster client made unseen: the epoch is checked first (see `epoch.rs`),
    /// then the script sent with its source, to that server only.
    async fn invoke<T: FromRedisValue>(
        &self,
        conn: &mut Conn,
        call: &Call<'_>,
    ) -> Result<T, RedisError> {
        self.run_script(conn, call, self.cluster).await
    }

    /// Runs a script call, sending its source on NOSCRIPT without a check: for calls made
    /// within the check itself.
    async fn invoke_unchecked<T: FromRedisValue>(
        &self,
        conn: &mut Conn,
        call: &Call<'_>,
    ) -> Result<T, RedisError> {
        self.run_script(conn, call, false).await
    }

    async fn run_script<T: FromRedisValue>(
        &self,
        conn: &mut Conn,
        call: &Call<'_>,
        check_on_noscript: bool,
    ) -> Result<T, RedisError> {
        match call.by_sha().query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                if check_on_noscript && let Err(e) = self.clone().catch_up_task().await {
                    return Err(RedisError::from((
                        redis::ErrorKind::Io,
                        "epoch check failed",
                        e.to_string(),
                    )));
                }
                call.with_source().query_async(conn).await
            }
            result => result,
        }
    }

    /// [`RedisStore::catch_up`] in a task of its own (a put-back must not stop halfway because
    /// the request that started it gave up).
    fn catch_up_task(self) -> Pin<Box<dyn Future<Output = StoreResult<Option<Hold>>> + Send>> {
        let store = self.clone();
        self.spawned(async move { store.catch_up().await })
    }

    /// [`RedisStore::repair_slot`] in a task of its own, as [`RedisStore::catch_up_task`].
    fn repair_task(self, slot: u16) -> Pin<Box<dyn Future<Output = StoreResult<()>> + Send>> {
        let store = self.clone();
        self.spawned(async move { store.repair_slot(slot).await })
    }

    /// Runs `work` in a task of its own, waiting for it at most the store's time bound. Boxed,
    /// with its `Send` declared: catching up runs scripts, which can catch up — a cycle the
    /// compiler cannot see through when the future's type is inferred.
    fn spawned<T: Send + 'static>(
        self,
        work: impl Future<Output = StoreResult<T>> + Send + 'static,
    ) -> Pin<Box<dyn Future<Output = StoreResult<T>> + Send>> {
        Box::pin(async move {
            match tokio::time::timeout(self.timeout, tokio::spawn(work)).await {
                Ok(Ok(result)) => result,
                _ => Err(StoreError::Timeout(millis(self.timeout))),
            }
        })
    }

    /// The verified connection, making one if there is none (see `connection.rs`).
    async fn link(&self) -> StoreResult<Link> {
        self.connection
            .get(|| {
                tokio::spawn(self.clone().reconnect());
            })
            .await
    }

    /// Makes a new connection and runs the epoch check on it (putting leases back if the store
    /// lost them) before anything else may use it.
    ///
    /// A boxed future with its `Send` declared: reconnecting can put leases back, which can
    /// release through a connection, which can reconnect — a cycle the compiler cannot see
    /// through when the future's type is inferred.
    fn reconnect(self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let verified = async {
                let mut conn = self.connection.open().await?;
                if self.cluster {
                    self.check_cluster(&mut conn).await?;
                } else {
                    self.check_on(&mut conn).await?;
                }
                Ok::<_, StoreError>(conn)
            };
            match verified.await {
                Ok(conn) => {
                    tracing::debug!("connected to Redis");
                    self.connection.up(conn);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot connect to Redis");
                    self.connection.down(e);
                }
            }
        })
    }

    /// Runs one call with the store's time bound, on a connection already in hand.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, RedisError>>,
    ) -> StoreResult<T> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_timeout() => Err(StoreError::Timeout(millis(self.timeout))),
            Ok(Err(e)) => Err(StoreError::Failed(e.to_string())),
            Err(_) => Err(StoreError::Timeout(millis(self.timeout))),
        }
    }

    /// Runs `call` on the verified connection, all within the store's time bound (waiting for a
    /// connection included). A call that fails in a way that condemns the connection, or times
    /// out, replaces it.
    async fn with_link<T>(
        &self,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<T> {
        let deadline = Instant::now() + self.timeout;
        let timed_out = || StoreError::Timeout(millis(self.timeout));
        let link = match self.connection.current() {
            Some(link) => link,
            None => tokio::time::timeout_at(deadline, self.link())
                .await
                .map_err(|_| timed_out())??,
        };
        let mut conn = link.conn.clone();
        match tokio::time::timeout_at(deadline, call(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let error = if e.is_timeout() {
                    timed_out()
                } else {
                    StoreError::Failed(e.to_string())
                };
                if breaks_connection(&e) {
                    self.connection.drop_link(link.generation, &error);
                }
                Err(error)
            }
            Err(_) => {
                let error = timed_out();
                self.connection.drop_link(link.generation, &error);
                Err(error)
            }
        }
    }

    /// Runs CLAIM, TAKE_OVER or JOIN for `bid`. A refusal because the store is in another epoch
    /// than this broker knows waits for the broker to catch up (put its leases back), then tries
    /// once more.
    async fn grant(&self, how: How, key: &LockKey, bid: &Bid) -> StoreResult<Granting> {
        let space = match how {
            How::Join(pool) => pool.space(),
            How::Claim | How::TakeOver(_) => Space::Locks,
        };
        let names = self.names(space, key);
        let slot = self.slot(key);
        let marker = self.marker_for(key);
        let mut tries = 0;
        loop {
            tries += 1;
            let known = match self.epoch.for_grant(slot) {
                Ok(known) => known,
                Err(hold) => return Ok(Granting::Held(hold)),
            };
            let rid = bid.request_id.as_ref().map_or("", |r| r.as_str());
            let mut inv;
            match how {
                How::Claim | How::TakeOver(_) => {
                    let script = if matches!(how, How::Claim) {
                        &self.scripts.claim
                    } else {
                        &self.scripts.take_over
                    };
                    inv = script.call();
                    inv.key(&names.lock)
                        .key(&names.fence)
                        .key(&marker)
                        .key(&names.pool)
                        .key(&names.ends)
                        .key(&names.writers)
                        .arg(bid.token.as_str())
                        .arg(bid.ttl.as_ms())
                        .arg(if bid.owner.is_some() { "1" } else { "0" })
                        .arg(bid.owner.as_ref().map_or("", |o| o.as_str()))
                        .arg(EXPIRY_SLACK_MS)
                        .arg(&known)
                        .arg(rid)
                        .arg(if bid.waits { "1" } else { "0" });
                    if let How::TakeOver(seen) = how {
                        inv.arg(seen);
                    }
                }
                How::Join(pool) => {
                    inv = self.scripts.join.call();
                    inv.key(&names.pool)
                        .key(&names.ends)
                        .key(&names.fence)
                        .key(&marker);
                    if pool == Pool::Shared {
                        inv.key(&names.lock).key(&names.writers);
                    }
                    inv.arg(bid.token.as_str())
                        .arg(bid.ttl.as_ms())
                        .arg(labelled(bid.owner.as_ref().map(|o| o.as_str())))
                        .arg(EXPIRY_SLACK_MS)
                        .arg(match pool {
                            Pool::Shared => String::new(),
                            Pool::Semaphore { limit } => limit.to_string(),
                        })
                        .arg(&known)
                        .arg(rid);
                }
            }
            let reply: Vec<Value> = self
                .with_link(async |conn| self.invoke(conn, &inv).await)
                .await?;
            let answered = Instant::now();
            match field::<u8>(&reply, 0)? {
                0 => return Ok(Granting::Refused),
                1 => {
                    let token: String = field(&reply, 3)?;
                    let lease = Lease {
                        // The bid's own token, or the one of the earlier grant this repeats.
                        token: if token == bid.token.as_str() {
                            bid.token.clone()
                        } else {
                            Token::parse(&token).map_err(|_| corrupt("token"))?
                        },
                        fence: field(&reply, 1)?,
                        expires_at_ms: field(&reply, 2)?,
                        ttl_ms: field(&reply, 4)?,
                        owner: bid.owner.clone(),
                        request_id: bid.request_id.clone(),
                        limit: match how {
                            How::Join(Pool::Semaphore { limit }) => Some(limit),
                            _ => None,
                        },
                    };
                    // What remains on the store's clock: a lease handed back again by request id
                    // is older than its TTL.
                    let remaining = lease.expires_at_ms.saturating_sub(field(&reply, 5)?);
                    self.replicas
                        .confirm_grant(self, space, key, &bid.token, &lease)
                        .await?;
                    let kind = match how {
                        How::Join(Pool::Shared) => Kind::Shared,
                        How::Join(Pool::Semaphore { limit }) => Kind::Semaphore { limit },
                        How::Claim | How::TakeOver(_) => Kind::Exclusive,
                    };
                    self.remember(
                        key,
                        kind,
                        slot,
                        &lease,
                        answered + Duration::from_millis(remaining),
                        &known,
                    );
                    return Ok(Granting::Granted(lease));
                }
                2 => {
                    return Ok(Granting::Held(held(
                        field(&reply, 1)?,
                        field(&reply, 2)?,
                        &field::<String>(&reply, 3)?,
                    )));
                }
                3 if tries == 1
                    && let Some(slot) = slot
                    && let Some(epoch) = field::<Option<String>>(&reply, 1)?
                    && self.epoch.adopt(slot, &epoch) => {}
                // Caught up and the slot's marker is still missing: it alone lost it.
                3 if tries == 2
                    && let Some(slot) = slot
                    && field::<Option<String>>(&reply, 1)?.is_none() =>
                {
                    self.clone().repair_task(slot).await?;
                }
                3 if tries <= 2 => {
                    if let Some(hold) = self.clone().catch_up_task().await? {
                        return Ok(Granting::Held(hold));
                    }
                }
                3 => {
                    return Ok(Granting::Held(Hold {
                        reason: HoldReason::PuttingBack,
                        retry_after_ms: 1_000,
                    }));
                }
                4 => {
                    return Ok(Granting::Busy {
                        retry_after_ms: field(&reply, 1)?,
                    });
                }
                5 => {
                    return Ok(Granting::LimitMismatch {
                        limit: field(&reply, 1)?,
                    });
                }
                code => return Err(StoreError::Failed(format!("unexpected grant reply {code}"))),
            }
        }
    }

    /// Records a lease granted or renewed here in the ledger. If it was written in an epoch
    /// older than the newest one this broker has seen, its answer raced a loss and the put-back
    /// may have missed it: it is put back on its own.
    fn remember(
        &self,
        key: &LockKey,
        kind: Kind,
        slot: Option<u16>,
        lease: &Lease,
        ends: Instant,
        epoch: &str,
    ) {
        self.ledger.record(key, kind, lease, ends);
        if self.epoch.is_behind(slot, epoch) {
            self.put_back_late(key.clone(), kind, lease.token.clone());
        }
    }

    /// Runs RELEASE, RENEW or FORCE's call on `key` in `space`: the keys every holder script
    /// takes.
    fn holder_call<'s>(&self, script: &'s scripts::Lua, space: Space, key: &LockKey) -> Call<'s> {
        let names = self.names(space, key);
        let mut inv = script.call();
        inv.key(names.lock)
            .key(self.marker_for(key))
            .key(names.pool)
            .key(names.ends);
        inv
    }
}

impl Store for RedisStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<Grant> {
        self.grant(How::Claim, key, bid)
            .await
            .map(Granting::exclusive)
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        let names = self.names(Space::Locks, key);
        let mut inv = self.scripts.read.call();
        inv.key(names.lock).key(names.pool).key(names.ends);
        let reply: Vec<Value> = self
            .with_link(async |conn| self.invoke(conn, &inv).await)
            .await?;
        let lease = match field::<Option<String>>(&reply, 1)? {
            Some(_) => Some(lease_at(&reply, 1)?),
            None => None,
        };
        Ok(Snapshot {
            now_ms: field(&reply, 0)?,
            lease,
            shared: leases_from(&reply, 7)?,
        })
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<Grant> {
        self.grant(How::TakeOver(seen), key, bid)
            .await
            .map(Granting::exclusive)
    }

    async fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<Holder<Released>> {
        let names = self.names(space, key);
        let mut inv = self.holder_call(&self.scripts.release, space, key);
        inv.arg(token.as_str())
            .arg(&*self.channel)
            .arg(&names.notice);
        let reply: Vec<Value> = self
            .with_link(async |conn| self.invoke(conn, &inv).await)
            .await?;
        let outcome = match field::<u8>(&reply, 0)? {
            1 => Holder::Done(Released {
                held_ms: field(&reply, 1)?,
            }),
            _ => refusal(&reply)?,
        };
        if !matches!(outcome, Holder::Held(_)) {
            self.ledger.forget_any(space, key, token);
        }
        Ok(outcome)
    }

    async fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        ttl: Ttl,
    ) -> StoreResult<Holder<Lease>> {
        let told = self.replicas.before_renew(self, space, key, token).await?;
        let names = self.names(space, key);
        let mut inv = self.holder_call(&self.scripts.renew, space, key);
        inv.arg(token.as_str())
            .arg(ttl.as_ms())
            .arg(EXPIRY_SLACK_MS)
            .arg(&*self.channel)
            .arg(&names.notice);
        let reply: Vec<Value> = self
            .with_link(async |conn| self.invoke(conn, &inv).await)
            .await?;
        let answered = Instant::now();
        if field::<u8>(&reply, 0)? != 1 {
            let outcome = refusal(&reply)?;
            if !matches!(outcome, Holder::Held(_)) {
                self.ledger.forget_any(space, key, token);
            }
            return Ok(outcome);
        }
        // A pool lease's reply has a sixth field: its semaphore's limit ('' for a shared lease).
        let kind = match (space, reply.len()) {
            (Space::Locks, 5) => Kind::Exclusive,
            (Space::Locks, _) => Kind::Shared,
            (Space::Semaphores, _) => Kind::Semaphore {
                limit: field::<String>(&reply, 5)?
                    .parse()
                    .map_err(|_| corrupt("limit"))?,
            },
        };
        let lease = Lease {
            token: token.clone(),
            fence: field(&reply, 1)?,
            expires_at_ms: field(&reply, 2)?,
            ttl_ms: ttl.as_ms(),
            owner: parse_owner(field(&reply, 3)?)?,
            request_id: None,
            limit: match kind {
                Kind::Semaphore { limit } => Some(limit),
                _ => None,
            },
        };
        self.replicas
            .confirm_renew(self, space, key, token, told, &lease)
            .await?;
        let ends = answered + Duration::from_millis(ttl.as_ms());
        self.remember(
            key,
            kind,
            self.slot(key),
            &lease,
            ends,
            &field::<String>(&reply, 4)?,
        );
        Ok(Holder::Done(lease))
    }

    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> StoreResult<Join> {
        Ok(match self.grant(How::Join(pool), key, bid).await? {
            Granting::Granted(lease) => Join::Granted(lease),
            Granting::Held(hold) => Join::Held(hold),
            Granting::Busy { retry_after_ms } => Join::Busy { retry_after_ms },
            Granting::LimitMismatch { limit } => Join::LimitMismatch { limit },
            Granting::Refused => {
                return Err(StoreError::Failed("unexpected join reply".into()));
            }
        })
    }

    async fn permits(&self, key: &LockKey) -> StoreResult<Permits> {
        let names = self.names(Space::Semaphores, key);
        let mut inv = self.scripts.permits.call();
        inv.key(names.pool).key(names.ends);
        let reply: Vec<Value> = self
            .with_link(async |conn| self.invoke(conn, &inv).await)
            .await?;
        let holders = leases_from(&reply, 2)?;
        let limit = match field::<Option<String>>(&reply, 1)? {
            Some(limit) if !holders.is_empty() => {
                Some(limit.parse().map_err(|_| corrupt("limit"))?)
            }
            _ => None,
        };
        Ok(Permits {
            now_ms: field(&reply, 0)?,
            limit,
            holders,
        })
    }

    async fn force_release(&self, space: Space, key: &LockKey) -> StoreResult<Holder<Vec<Fence>>> {
        let names = self.names(space, key);
        let mut inv = self.holder_call(&self.scripts.force, space, key);
        inv.arg(&*self.channel).arg(&names.notice);
        let reply: Vec<Value> = self
            .with_link(async |conn| self.invoke(conn, &inv).await)
            .await?;
        if field::<u8>(&reply, 0)? != 1 {
            return refusal(&reply);
        }
        let fences: Vec<Fence> = (1..reply.len())
            .map(|i| field(&reply, i))
            .collect::<StoreResult<_>>()?;
        if fences.is_empty() {
            return Ok(Holder::NotHeld);
        }
        if let Some(&top) = fences.iter().max() {
            self.ledger.forget_ended(space, key.as_str(), top, true);
        }
        Ok(Holder::Done(fences))
    }

    async fn list(&self, query: &ListQuery) -> StoreResult<Page> {
        listing::page(self, query).await
    }

    async fn ready(&self) -> StoreResult<Option<Hold>> {
        if self.epoch.putting_back() {
            return Ok(Some(Hold {
                reason: HoldReason::PuttingBack,
                retry_after_ms: 1_000,
            }));
        }
        self.clone().catch_up_task().await
    }

    fn ledger_len(&self) -> usize {
        self.ledger.len()
    }

    fn start(&self, notices: mpsc::Sender<Notice>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no runtime for the store's background work; waiters will poll");
            return;
        };
        runtime.spawn(notices::watch_epoch(self.clone(), notices.clone()));
        runtime.spawn(sentinel::follow_failovers(self.clone(), notices.clone()));
        runtime.spawn(notices::listen(self.clone(), notices));
    }
}
