//! Running calls on Redis, for the [`EpochKeeper`] that owns the connection: on the one verified
//! connection (making it if needed, see `check.rs`), within the store's time bound, and scripts
//! by SHA with the store's own handling of NOSCRIPT, or as functions of the library
//! (`scripts/library.rs`), loaded where a server lacks it. Every script call goes through
//! [`EpochKeeper::run_tracked`], [`EpochKeeper::run_unchecked`] or [`EpochKeeper::eval`], which
//! log it at TRACE (script, key, duration).

use std::sync::Arc;

use redis::{FromRedisValue, RedisError, Value};
use tokio::time::Instant;

use super::connection::{Conn, Link, breaks_connection};
use super::epoch::EpochKeeper;
use super::scripts::{Call, Library, ScriptCall};
use lockbroker_core::domain::millis;
use lockbroker_core::store::{StoreError, StoreResult};

/// When a script call began, if TRACE lines are on: otherwise nothing is measured, so a broker
/// not tracing pays one check of the log filter per call (see `Call::trace`).
fn trace_start() -> Option<Instant> {
    tracing::enabled!(tracing::Level::TRACE).then(Instant::now)
}

impl EpochKeeper {
    /// Runs a script on the verified connection (see [`EpochKeeper::with_link`]) and decodes
    /// its reply.
    pub(super) async fn run<S: ScriptCall>(self: &Arc<Self>, script: &S) -> StoreResult<S::Reply> {
        self.run_tracked(script).await.map(|(reply, _)| reply)
    }

    /// Runs a script as [`EpochKeeper::run`] does, and says which connection (its generation)
    /// carried it: replicas confirm a write only by a `WAIT` on that same connection, since
    /// `WAIT` counts the writes of its own connection alone (see `replicas.rs`).
    pub(super) async fn run_tracked<S: ScriptCall>(
        self: &Arc<Self>,
        script: &S,
    ) -> StoreResult<(S::Reply, u64)> {
        self.run_on(None, script).await
    }

    /// Runs a write whose replicas will be asked for (a grant or a renewal) as
    /// [`EpochKeeper::run_tracked`] does, but on ack link `link` if the store has them
    /// (`connection/ack_links.rs`, chosen by `Replicas::link_for`): the `WAIT` that confirms it
    /// then runs there too.
    pub(super) async fn run_acked<S: ScriptCall>(
        self: &Arc<Self>,
        script: &S,
        link: Option<usize>,
    ) -> StoreResult<(S::Reply, u64)> {
        self.run_on(link, script).await
    }

    /// Runs a script on the main connection (`None`) or on an ack link.
    async fn run_on<S: ScriptCall>(
        self: &Arc<Self>,
        ack: Option<usize>,
        script: &S,
    ) -> StoreResult<(S::Reply, u64)> {
        let call = self.scripts.call(script);
        let started = trace_start();
        let answer = self
            .with_link_at(ack, async |conn| self.invoke(conn, &call).await)
            .await;
        call.trace(started, answer.is_err());
        let (reply, generation): (Value, u64) = answer?;
        Ok((call.decode(reply)?, generation))
    }

    /// Runs a script on `conn`, within the store's time bound, sending its source on NOSCRIPT
    /// without a check: for calls made within the check itself.
    pub(super) async fn run_unchecked<S: ScriptCall>(
        self: &Arc<Self>,
        conn: &mut Conn,
        script: &S,
    ) -> StoreResult<S::Reply> {
        let call = self.scripts.call(script);
        let started = trace_start();
        let answer = self.bounded(self.invoke_unchecked(conn, &call)).await;
        call.trace(started, answer.is_err());
        call.decode(answer?)
    }

    /// Runs a script on `conn` with plain `EVAL` and its source, within the store's time bound:
    /// for the epoch's scripts, which then show apart from the lock operations in Redis's
    /// command statistics.
    pub(super) async fn eval<S: ScriptCall>(
        &self,
        conn: &mut Conn,
        script: &S,
    ) -> StoreResult<S::Reply> {
        let call = self.scripts.call(script);
        let started = trace_start();
        let answer = self.bounded(call.with_source().query_async(conn)).await;
        call.trace(started, answer.is_err());
        call.decode(answer?)
    }

    /// Runs a script call by SHA. A server without the script (NOSCRIPT) is, on a cluster, one
    /// the broker has not checked since it started — a restart or a promoted replica, whose
    /// connection the cluster client made unseen: the epoch is checked first (see `epoch.rs`),
    /// then the script sent with its source, to that server only.
    async fn invoke<T: FromRedisValue>(
        self: &Arc<Self>,
        conn: &mut Conn,
        call: &Call<'_>,
    ) -> Result<T, RedisError> {
        self.run_script(conn, call, self.layout.cluster).await
    }

    /// Runs a script call, sending its source on NOSCRIPT without a check: for calls made
    /// within the check itself.
    async fn invoke_unchecked<T: FromRedisValue>(
        self: &Arc<Self>,
        conn: &mut Conn,
        call: &Call<'_>,
    ) -> Result<T, RedisError> {
        self.run_script(conn, call, false).await
    }

    async fn run_script<T: FromRedisValue>(
        self: &Arc<Self>,
        conn: &mut Conn,
        call: &Call<'_>,
        check_on_noscript: bool,
    ) -> Result<T, RedisError> {
        match call.by_sha().query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                if check_on_noscript && let Err(e) = self.catch_up_task().await {
                    return Err(RedisError::from((
                        redis::ErrorKind::Io,
                        "epoch check failed",
                        e.to_string(),
                    )));
                }
                call.with_source().query_async(conn).await
            }
            Err(e) if call.is_function() && Library::missing(&e) => {
                // A server without this build's library (new, restarted empty, or flushed of
                // functions): loaded there, then the call runs again.
                match self.scripts.library().load(conn).await {
                    Ok(()) => {
                        tracing::debug!(
                            library = self.scripts.library().name(),
                            "loaded the function library on a server without it"
                        );
                        call.by_sha().query_async(conn).await
                    }
                    // The server refused the load: for good (no functions, or a user not
                    // allowed them), which turns them off; or for now (a full Redis refuses it,
                    // as a write), and the next call tries again. This call runs by its source.
                    Err(e) if e.code().is_some() => {
                        if Library::refused(&e) {
                            self.scripts.functions_off(&e);
                        } else {
                            tracing::debug!(error = %e, "the function library could not be loaded");
                        }
                        call.with_source().query_async(conn).await
                    }
                    Err(e) => Err(e),
                }
            }
            Err(e) if call.is_function() && Library::refused(&e) => {
                self.scripts.functions_off(&e);
                call.with_source().query_async(conn).await
            }
            result => result,
        }
    }

    /// Runs one call with the store's time bound, on a connection already in hand.
    pub(super) async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, RedisError>>,
    ) -> StoreResult<T> {
        match tokio::time::timeout(self.connection.timeout(), call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_timeout() => {
                Err(StoreError::Timeout(millis(self.connection.timeout())))
            }
            Ok(Err(e)) => Err(StoreError::Failed(e.to_string())),
            Err(_) => Err(StoreError::Timeout(millis(self.connection.timeout()))),
        }
    }

    /// Runs `call` on the verified connection, all within the store's time bound (waiting for a
    /// connection included). A call that fails in a way that condemns the connection, or times
    /// out, replaces it.
    pub(super) async fn with_link<T>(
        self: &Arc<Self>,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<T> {
        self.with_link_tracked(call).await.map(|(v, _)| v)
    }

    /// [`EpochKeeper::with_link`], which also says the generation of the connection it used.
    pub(super) async fn with_link_tracked<T>(
        self: &Arc<Self>,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<(T, u64)> {
        self.with_link_at(None, call).await
    }

    /// [`EpochKeeper::with_link_tracked`] on the main connection (`None`) or on an ack link.
    async fn with_link_at<T>(
        self: &Arc<Self>,
        ack: Option<usize>,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<(T, u64)> {
        let deadline = Instant::now() + self.connection.timeout();
        let now = match ack {
            None => self.connection.current(),
            Some(index) => self.connection.current_ack(index),
        };
        let link = match now {
            Some(link) => link,
            None => {
                let made = async {
                    match ack {
                        None => self.link().await,
                        Some(index) => self.ack_link(index).await,
                    }
                };
                tokio::time::timeout_at(deadline, made)
                    .await
                    .map_err(|_| StoreError::Timeout(millis(self.connection.timeout())))??
            }
        };
        let generation = link.generation;
        self.call_on(link, deadline, call)
            .await
            .map(|v| (v, generation))
    }

    /// Runs `call` on connection `generation` only (the main connection or an ack link),
    /// within the store's time bound: an error, without running it, if that connection is no
    /// longer a verified one (replaced, or down). For a `WAIT` that must count the writes an
    /// earlier call made on that connection.
    pub(super) async fn with_link_on<T>(
        &self,
        generation: u64,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<T> {
        let deadline = Instant::now() + self.connection.timeout();
        match self.connection.link_of(generation) {
            Some(link) => self.call_on(link, deadline, call).await,
            None => Err(StoreError::Failed(
                "the Redis connection that carried the write was replaced before its replicas \
                 confirmed it"
                    .into(),
            )),
        }
    }

    /// Runs `call` on `link` until `deadline`; a call that fails in a way that condemns the
    /// connection, or times out, replaces it.
    async fn call_on<T>(
        &self,
        link: Link,
        deadline: Instant,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<T> {
        let timed_out = || StoreError::Timeout(millis(self.connection.timeout()));
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
}
