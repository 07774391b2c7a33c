//! The Redis store: each primitive is one Lua script (`scripts.rs`), run by SHA over one
//! multiplexed connection that is verified before use (`connection.rs`), reading the time from
//! Redis's own `TIME`. The broker's live leases are kept in a ledger and put back when the store
//! loses them (`epoch.rs`); release notices reach every broker's waiters (`notices.rs`); behind
//! Sentinel, the broker follows the master's failovers (`sentinel.rs`).

mod connection;
mod epoch;
mod notices;
mod replies;
mod scripts;
mod sentinel;
pub mod url;

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use redis::io::tcp::{TcpSettings, socket2};
use redis::{ClientTlsConfig, RedisError, Script, TlsCertificates, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use self::connection::{Conn, Connection, Connector, Link, breaks_connection};
use self::epoch::Epoch;
use self::replies::{ReadReply, corrupt, field, held, parse_owner, refusal};
use self::scripts::Scripts;
pub use self::url::{ParsedUrl, Topology};
use super::ledger::Ledger;
use super::{
    Bid, EXPIRY_SLACK_MS, Grant, Hold, HoldReason, Holder, Lease, Notice, Released, Snapshot,
    Store, StoreError, StoreResult,
};
use crate::domain::{Fence, LockKey, RequestId, Token, Ttl, millis};
use crate::metrics::Metrics;

/// Connection settings for [`RedisStore::connect`].
#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub url: String,
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
    /// Certificates for `rediss://` URLs.
    pub tls: RedisTls,
}

/// PEM files for TLS to Redis. Without a CA file the system's roots are trusted.
#[derive(Debug, Clone, Default)]
pub struct RedisTls {
    pub ca: Option<PathBuf>,
    /// A client certificate, with its key (`key`).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
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
        let client_tls = match (&self.cert, &self.key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(ClientTlsConfig {
                client_cert: read("certificate", cert)?,
                client_key: read("key", key)?,
            }),
            _ => {
                return Err(StoreError::Failed(
                    "a Redis TLS client certificate needs both its certificate and its key".into(),
                ));
            }
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

/// The Redis store. Cloning is cheap: everything is shared.
#[derive(Clone)]
pub struct RedisStore {
    connection: Arc<Connection>,
    prefix: Arc<str>,
    /// `<prefix>released`: where releases publish the client key.
    channel: Arc<str>,
    /// `<prefix>epoch`: the store's epoch marker (see `epoch.rs`).
    marker: Arc<str>,
    epoch: Arc<Epoch>,
    ledger: Arc<Ledger>,
    metrics: Arc<Metrics>,
    store_settle: Duration,
    store_loss_delay: Duration,
    timeout: Duration,
    scripts: Arc<Scripts>,
}

impl RedisStore {
    /// Sets up the store without waiting for Redis: the broker starts (and says it is not
    /// ready) while Redis is down, and connects when it returns.
    pub fn connect(settings: &RedisSettings, metrics: Arc<Metrics>) -> StoreResult<Self> {
        let url = ParsedUrl::parse(&settings.url)?;
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
        let tls = settings.tls.load()?;
        if tls.is_some() && !url.tls {
            return Err(StoreError::Failed(
                "Redis TLS files are set but the Redis URL does not ask for TLS (rediss://…)"
                    .into(),
            ));
        }
        let connector = Connector::build(&url, tcp, tls, settings.timeout)?;
        let prefix = settings.key_prefix.as_str();
        Ok(Self {
            connection: Arc::new(Connection::new(connector, settings.timeout)),
            prefix: prefix.into(),
            channel: format!("{prefix}released").into(),
            marker: format!("{prefix}epoch").into(),
            epoch: Arc::default(),
            ledger: Arc::default(),
            metrics,
            store_settle: settings.store_settle,
            store_loss_delay: settings.store_loss_delay,
            timeout: settings.timeout,
            scripts: Arc::new(Scripts::new()),
        })
    }

    fn keys(&self, key: &LockKey) -> [String; 2] {
        [
            format!("{}{{{}}}:lock", self.prefix, key),
            format!("{}{{{}}}:fence", self.prefix, key),
        ]
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
                let run_id = connection::run_id(&mut conn).await?;
                self.check_on(&mut conn, &run_id).await?;
                Ok::<_, StoreError>((conn, run_id))
            };
            match verified.await {
                Ok((conn, run_id)) => {
                    tracing::debug!(%run_id, "connected to Redis");
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

    /// Runs CLAIM or TAKE_OVER for `bid`. A refusal because the store is in another epoch than
    /// this broker knows waits for the broker to catch up (put its leases back), then tries
    /// once more.
    async fn grant(
        &self,
        script: &Script,
        key: &LockKey,
        bid: &Bid,
        seen: Option<Fence>,
    ) -> StoreResult<Grant> {
        let [lock, fence] = self.keys(key);
        for first in [true, false] {
            let known = match self.epoch.for_grant() {
                Ok(known) => known,
                Err(hold) => return Ok(Grant::Held(hold)),
            };
            let mut inv = script.key(&lock);
            inv.key(&fence)
                .key(&*self.marker)
                .arg(bid.token.as_str())
                .arg(bid.ttl.as_ms())
                .arg(if bid.owner.is_some() { "1" } else { "0" })
                .arg(bid.owner.as_ref().map_or("", |o| o.as_str()))
                .arg(EXPIRY_SLACK_MS)
                .arg(&known)
                .arg(bid.request_id.as_ref().map_or("", |r| r.as_str()));
            if let Some(seen) = seen {
                inv.arg(seen);
            }
            let reply: Vec<Value> = self
                .with_link(async |conn| inv.invoke_async(conn).await)
                .await?;
            let answered = Instant::now();
            match field::<u8>(&reply, 0)? {
                0 => return Ok(Grant::Refused),
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
                    };
                    // What remains on the store's clock: a lease handed back again by request id
                    // is older than its TTL.
                    let remaining = lease.expires_at_ms.saturating_sub(field(&reply, 5)?);
                    self.remember(
                        key,
                        &lease,
                        answered + Duration::from_millis(remaining),
                        &known,
                    );
                    return Ok(Grant::Granted(lease));
                }
                2 => {
                    return Ok(Grant::Held(held(
                        field(&reply, 1)?,
                        field(&reply, 2)?,
                        &field::<String>(&reply, 3)?,
                    )));
                }
                3 if first => {
                    // Catch up in a task of its own: a put-back must not stop halfway because
                    // this request gave up.
                    let store = self.clone();
                    let catching_up = tokio::spawn(async move { store.catch_up().await });
                    match tokio::time::timeout(self.timeout, catching_up).await {
                        Ok(Ok(Ok(Some(hold)))) => return Ok(Grant::Held(hold)),
                        Ok(Ok(Ok(None))) => {}
                        Ok(Ok(Err(e))) => return Err(e),
                        _ => return Err(StoreError::Timeout(millis(self.timeout))),
                    }
                }
                3 => {
                    return Ok(Grant::Held(Hold {
                        reason: HoldReason::PuttingBack,
                        retry_after_ms: 1_000,
                    }));
                }
                code => return Err(StoreError::Failed(format!("unexpected grant reply {code}"))),
            }
        }
        unreachable!("the second pass always returns")
    }

    /// Records a lease granted or renewed here in the ledger. If it was written in an epoch
    /// older than the newest one this broker has seen, its answer raced a loss and the put-back
    /// may have missed it: it is put back on its own.
    fn remember(&self, key: &LockKey, lease: &Lease, ends: Instant, epoch: &str) {
        self.ledger.record(key, lease, ends);
        if self.epoch.is_behind(epoch) {
            self.put_back_late(key.clone());
        }
    }
}

impl Store for RedisStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<Grant> {
        self.grant(&self.scripts.claim, key, bid, None).await
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        let [lock, _] = self.keys(key);
        let inv = self.scripts.read.key(lock);
        let (now_ms, token, fence, expires, ttl, owner, request_id): ReadReply = self
            .with_link(async |conn| inv.invoke_async(conn).await)
            .await?;
        let lease = match (token, fence, expires, ttl) {
            (Some(token), Some(fence), Some(expires_at_ms), Some(ttl_ms)) => Some(Lease {
                token: Token::parse(&token).map_err(|_| corrupt("token"))?,
                fence,
                expires_at_ms,
                ttl_ms,
                owner: parse_owner(owner)?,
                request_id: request_id.and_then(|r| RequestId::parse(&r).ok()),
            }),
            (None, None, None, None) => None,
            _ => return Err(corrupt("record")),
        };
        Ok(Snapshot { now_ms, lease })
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<Grant> {
        self.grant(&self.scripts.take_over, key, bid, Some(seen))
            .await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> StoreResult<Holder<Released>> {
        let [lock, _] = self.keys(key);
        let mut inv = self.scripts.release.key(lock);
        inv.key(&*self.marker)
            .arg(token.as_str())
            .arg(&*self.channel)
            .arg(key.as_str());
        let reply: Vec<Value> = self
            .with_link(async |conn| inv.invoke_async(conn).await)
            .await?;
        let outcome = match field::<u8>(&reply, 0)? {
            1 => Holder::Done(Released {
                held_ms: field(&reply, 1)?,
            }),
            _ => refusal(&reply)?,
        };
        if !matches!(outcome, Holder::Held(_)) {
            self.ledger.forget(key, token);
        }
        Ok(outcome)
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Ttl) -> StoreResult<Holder<Lease>> {
        let [lock, _] = self.keys(key);
        let mut inv = self.scripts.renew.key(lock);
        inv.key(&*self.marker)
            .arg(token.as_str())
            .arg(ttl.as_ms())
            .arg(EXPIRY_SLACK_MS)
            .arg(&*self.channel)
            .arg(key.as_str());
        let reply: Vec<Value> = self
            .with_link(async |conn| inv.invoke_async(conn).await)
            .await?;
        let answered = Instant::now();
        if field::<u8>(&reply, 0)? != 1 {
            let outcome = refusal(&reply)?;
            if !matches!(outcome, Holder::Held(_)) {
                self.ledger.forget(key, token);
            }
            return Ok(outcome);
        }
        let lease = Lease {
            token: token.clone(),
            fence: field(&reply, 1)?,
            expires_at_ms: field(&reply, 2)?,
            ttl_ms: ttl.as_ms(),
            owner: parse_owner(field(&reply, 3)?)?,
            request_id: None,
        };
        let ends = answered + Duration::from_millis(ttl.as_ms());
        self.remember(key, &lease, ends, &field::<String>(&reply, 4)?);
        Ok(Holder::Done(lease))
    }

    async fn ready(&self) -> StoreResult<Option<Hold>> {
        if self.epoch.putting_back() {
            return Ok(Some(Hold {
                reason: HoldReason::PuttingBack,
                retry_after_ms: 1_000,
            }));
        }
        // In a task of its own, like any catch-up: a put-back must not stop halfway.
        let store = self.clone();
        match tokio::time::timeout(
            self.timeout,
            tokio::spawn(async move { store.catch_up().await }),
        )
        .await
        {
            Ok(Ok(result)) => result,
            _ => Err(StoreError::Timeout(millis(self.timeout))),
        }
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
