//! The connection to Redis: one multiplexed connection at a time, replaced when it fails, and
//! never used before it is verified.
//!
//! A server that restarted, or a replica that took over, is always reached through a new
//! connection (the old one breaks with the old process). So checking the store's epoch on every
//! new connection before any request may use it (`RedisStore::check_on`) means no broker
//! grants on a server whose losses it has not caught up with — whatever its timing. Requests
//! that find no connection wait for the one being made (within their own time bound), or fail
//! at once with the last error if the last attempt failed moments ago.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisError};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::domain::millis;
use crate::store::{StoreError, StoreResult};

/// After a failed attempt, how long requests fail at once before one of them tries again, so a
/// Redis that is down costs one connection attempt per interval, not one per request.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

/// A verified connection. Cheap to clone: the connection is multiplexed.
#[derive(Clone)]
pub(super) struct Link {
    pub conn: MultiplexedConnection,
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

pub(super) struct Connection {
    client: redis::Client,
    config: AsyncConnectionConfig,
    timeout: Duration,
    state: watch::Sender<State>,
    generations: AtomicU64,
}

impl Connection {
    pub fn new(client: redis::Client, timeout: Duration) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let never_tried = State::Down {
            error: StoreError::Failed("not connected to Redis yet".into()),
            at: Instant::now() - RECONNECT_PAUSE,
        };
        Self {
            client,
            config,
            timeout,
            state: watch::Sender::new(never_tried),
            generations: AtomicU64::new(0),
        }
    }

    /// The verified connection; if there is none, waits for the one being made, calling
    /// `connect` first if nobody is making one. Not bounded here: callers bound it.
    pub async fn get(&self, connect: impl Fn()) -> StoreResult<Link> {
        let mut rx = self.state.subscribe();
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
                && self.state.send_if_modified(|s| match s {
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

    /// The verified connection if there is one now; never waits.
    pub fn current(&self) -> Option<Link> {
        match &*self.state.borrow() {
            State::Up(link) => Some(link.clone()),
            _ => None,
        }
    }

    /// Opens a new connection and reads which server process it reached. Not yet usable:
    /// [`Connection::up`] makes it so once verified.
    pub async fn open(&self) -> Result<(MultiplexedConnection, Arc<str>), StoreError> {
        let opening = async {
            let mut conn = self
                .client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await
                .map_err(|e| StoreError::Failed(e.to_string()))?;
            let run_id = run_id(&mut conn).await?;
            Ok((conn, run_id))
        };
        match tokio::time::timeout(self.timeout, opening).await {
            Ok(opened) => opened,
            Err(_) => Err(StoreError::Timeout(millis(self.timeout))),
        }
    }

    /// Makes a verified connection the one requests use.
    pub fn up(&self, conn: MultiplexedConnection) {
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        self.state
            .send_replace(State::Up(Link { conn, generation }));
    }

    /// A connection attempt failed.
    pub fn down(&self, error: StoreError) {
        self.state.send_replace(State::Down {
            error,
            at: Instant::now(),
        });
    }

    /// Stops using connection `generation` (it broke, or a call on it timed out: a connection
    /// whose far end went silent would otherwise time out every call for minutes). The next
    /// request makes a new one at once.
    pub fn drop_link(&self, generation: u64, error: &StoreError) {
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
            tracing::warn!(error = %error, "the Redis connection failed: replacing it");
        }
    }
}

/// The server process `conn` reaches now (`INFO server`'s `run_id`). Unbounded: callers bound it.
pub(super) async fn run_id(conn: &mut MultiplexedConnection) -> Result<Arc<str>, StoreError> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .map_err(|e| StoreError::Failed(e.to_string()))?;
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(|id| Arc::from(id.trim()))
        .ok_or_else(|| StoreError::Failed("Redis's INFO server has no run_id".into()))
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
