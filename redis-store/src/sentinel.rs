//! Redis Sentinel: finding the master (following its failovers is `failovers.rs`).
//!
//! **Finding the master.** Every new connection asks every sentinel of the URL for the master
//! (`SENTINEL get-master-addr-by-name`) and goes to the one that a majority of them name, then
//! confirms with `ROLE` on that very connection that it is a master, so nothing is ever written
//! to a replica. Not the first sentinel that answers: during a failover the sentinels switch
//! over a second or two, and the old master, if it is still up, stays a master until the
//! sentinels reconfigure it (8 s or more later when it never went down, as after
//! `SENTINEL FAILOVER`, and never while it is cut off from them). A sentinel that has not switched yet would send a
//! broker back to it while other brokers write to the new one.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::aio::MultiplexedConnection;
use redis::io::tcp::TcpSettings;
use redis::{
    AsyncConnectionConfig, ErrorKind, IntoConnectionInfo, RedisConnectionInfo, RedisError,
    RedisResult, Role, TlsCertificates,
};

use super::url::{ParsedUrl, node_addr};

/// A master's address, as the sentinels give it.
pub(super) type Addr = (String, u16);

/// The sentinels of the URL, and how to reach the master they name.
pub(super) struct Sentinels {
    pub(super) sentinels: Vec<Sentinel>,
    /// The master's name, as the sentinels know it.
    pub(super) master: String,
    /// The data nodes' user, password and database (the URL's credentials are theirs, not the
    /// sentinels').
    node: RedisConnectionInfo,
    tcp: TcpSettings,
    /// Whether the data nodes are reached over TLS, and with which certificates.
    tls: bool,
    certs: Option<TlsCertificates>,
    /// Bound on one question to a sentinel.
    timeout: Duration,
    /// The master that the last connection opened reached.
    connected: Mutex<Option<Addr>>,
    /// The master the broker last moved to on the sentinels' word (see `failovers.rs`).
    pub(super) moving_to: Mutex<Option<Addr>>,
}

/// One sentinel, with the connection to it once made (reused for every question).
pub(super) struct Sentinel {
    pub(super) client: redis::Client,
    /// A std mutex: nothing awaits while holding it (the connection is cloned out).
    conn: Mutex<Option<MultiplexedConnection>>,
}

impl Sentinels {
    pub(super) fn new(
        url: &ParsedUrl,
        tcp: TcpSettings,
        certs: Option<TlsCertificates>,
        timeout: Duration,
    ) -> RedisResult<Self> {
        let sentinels = (0..url.hosts.len())
            .map(|i| {
                let info = url
                    .addr(i)
                    .into_connection_info()?
                    .set_tcp_settings(tcp.clone());
                let client = match &certs {
                    Some(certs) => redis::Client::build_with_tls(info, certs.clone())?,
                    None => redis::Client::open(info)?,
                };
                Ok(Sentinel {
                    client,
                    conn: Mutex::new(None),
                })
            })
            .collect::<RedisResult<Vec<_>>>()?;
        Ok(Self {
            sentinels,
            master: url.master_name.clone().unwrap_or_default(),
            node: url.redis_info(),
            tcp,
            tls: url.tls,
            certs,
            timeout,
            connected: Mutex::new(None),
            moving_to: Mutex::new(None),
        })
    }

    /// The master that a majority of the URL's sentinels name now; an error while they
    /// disagree (during a failover) or too few of them answer. Answers as soon as a majority
    /// agrees: a sentinel that does not answer costs nothing then.
    pub(super) async fn master(&self) -> RedisResult<Addr> {
        let needed = self.sentinels.len() / 2 + 1;
        let mut answers: FuturesUnordered<_> = self.sentinels.iter().map(|s| self.ask(s)).collect();
        let mut votes: HashMap<Addr, usize> = HashMap::new();
        while let Some(answer) = answers.next().await {
            if let Some(addr) = answer {
                let n = votes.entry(addr.clone()).or_default();
                *n += 1;
                if *n >= needed {
                    return Ok(addr);
                }
            }
        }
        Err(RedisError::from((
            ErrorKind::MasterNameNotFoundBySentinel,
            "no master named by a majority of the sentinels",
            format!(
                "{} of the {needed} needed agree on {:?}",
                votes.values().max().copied().unwrap_or(0),
                self.master
            ),
        )))
    }

    /// What `sentinel` names as the master, through its kept connection (made again if it
    /// failed); `None` if it cannot say.
    async fn ask(&self, sentinel: &Sentinel) -> Option<Addr> {
        let kept = sentinel
            .conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut conn = match kept {
            Some(conn) => conn,
            None => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout));
                let opening = sentinel
                    .client
                    .get_multiplexed_async_connection_with_config(&config);
                let conn = tokio::time::timeout(self.timeout, opening)
                    .await
                    .ok()?
                    .ok()?;
                *sentinel.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.clone());
                conn
            }
        };
        let mut question = redis::cmd("SENTINEL");
        question.arg("get-master-addr-by-name").arg(&self.master);
        let asking = question.query_async::<Option<Addr>>(&mut conn);
        match tokio::time::timeout(self.timeout, asking).await {
            Ok(Ok(named)) => named,
            Ok(Err(e)) if !e.is_io_error() && !e.is_connection_dropped() => None,
            _ => {
                *sentinel.conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
                None
            }
        }
    }

    /// A client for the data node at `addr`.
    fn client(&self, (host, port): Addr) -> RedisResult<redis::Client> {
        let info = node_addr(host, port, self.tls)
            .into_connection_info()?
            .set_redis_settings(self.node.clone())
            .set_tcp_settings(self.tcp.clone());
        match &self.certs {
            Some(certs) => redis::Client::build_with_tls(info, certs.clone()),
            None => redis::Client::open(info),
        }
    }

    /// A client for the master a majority of the sentinels name (for the notice subscriber).
    pub(super) async fn master_client(&self) -> RedisResult<redis::Client> {
        self.client(self.master().await?)
    }

    /// A connection to the master a majority of the sentinels name, confirmed a master with
    /// `ROLE` on that connection: a replica promoted a moment ago may still be a replica, and an
    /// old master demoted a moment ago is one.
    pub(super) async fn open(
        &self,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<MultiplexedConnection> {
        let addr = self.master().await?;
        let conn = self.open_master(addr.clone(), config).await?;
        *self.connected.lock().unwrap_or_else(|e| e.into_inner()) = Some(addr);
        Ok(conn)
    }

    /// A connection to the master that the last connection opened reached, confirmed a master
    /// as [`Sentinels::open`] does: for the connections beside the main one (replica
    /// acknowledgements, `connection/ack_links.rs`), which must reach the same server.
    pub(super) async fn open_connected(
        &self,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<MultiplexedConnection> {
        let addr = self.connected().ok_or_else(|| {
            RedisError::from((
                ErrorKind::MasterNameNotFoundBySentinel,
                "no master reached through the sentinels yet",
            ))
        })?;
        self.open_master(addr, config).await
    }

    /// A connection to `addr`, confirmed a master with `ROLE` on that connection.
    async fn open_master(
        &self,
        addr: Addr,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<MultiplexedConnection> {
        let mut conn = self
            .client(addr)?
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        match redis::cmd("ROLE").query_async(&mut conn).await? {
            Role::Primary { .. } => Ok(conn),
            _ => Err(RedisError::from((
                ErrorKind::MasterNameNotFoundBySentinel,
                "the server the sentinels named is not a master (not yet, or no longer)",
            ))),
        }
    }

    /// The master the last connection opened reached.
    pub(super) fn connected(&self) -> Option<Addr> {
        self.connected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
