//! Running calls on Redis: on the one verified connection (making it if needed), within the
//! store's time bound, and scripts by SHA with the store's own handling of NOSCRIPT. Every
//! script call goes through [`RedisStore::run_tracked`], [`RedisStore::run_unchecked`] or
//! [`RedisStore::eval`], which log it at TRACE (script, key, duration).

use std::pin::Pin;

use redis::{FromRedisValue, RedisError, Value};
use tokio::time::Instant;

use super::RedisStore;
use super::connection::{Conn, Link, breaks_connection};
use super::scripts::{Call, ScriptCall};
use lockbroker_core::domain::millis;
use lockbroker_core::store::{Hold, StoreError, StoreResult};

/// When a script call began, if TRACE lines are on: otherwise nothing is measured, so a broker
/// not tracing pays one check of the log filter per call (see `Call::trace`).
fn trace_start() -> Option<Instant> {
    tracing::enabled!(tracing::Level::TRACE).then(Instant::now)
}

impl RedisStore {
    /// Runs a script on the verified connection (see [`RedisStore::with_link`]) and decodes
    /// its reply.
    pub(super) async fn run<S: ScriptCall>(&self, script: &S) -> StoreResult<S::Reply> {
        self.run_tracked(script).await.map(|(reply, _)| reply)
    }

    /// Runs a script as [`RedisStore::run`] does, and says which connection (its generation)
    /// carried it: replicas confirm a write only by a `WAIT` on that same connection, since
    /// `WAIT` counts the writes of its own connection alone (see `replicas.rs`).
    pub(super) async fn run_tracked<S: ScriptCall>(
        &self,
        script: &S,
    ) -> StoreResult<(S::Reply, u64)> {
        let call = self.scripts.call(script);
        let started = trace_start();
        let answer = self
            .with_link_tracked(async |conn| self.invoke(conn, &call).await)
            .await;
        call.trace(started, answer.is_err());
        let (reply, generation): (Value, u64) = answer?;
        Ok((call.decode(reply)?, generation))
    }

    /// Runs a script on `conn`, within the store's time bound, sending its source on NOSCRIPT
    /// without a check: for calls made within the check itself.
    pub(super) async fn run_unchecked<S: ScriptCall>(
        &self,
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
        &self,
        conn: &mut Conn,
        call: &Call<'_>,
    ) -> Result<T, RedisError> {
        self.run_script(conn, call, self.layout.cluster).await
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
    pub(super) fn catch_up_task(
        self,
    ) -> Pin<Box<dyn Future<Output = StoreResult<Option<Hold>>> + Send>> {
        let store = self.clone();
        self.spawned(async move { store.catch_up().await })
    }

    /// [`RedisStore::repair_slot`] in a task of its own, as [`RedisStore::catch_up_task`].
    pub(super) fn repair_task(
        self,
        slot: u16,
    ) -> Pin<Box<dyn Future<Output = StoreResult<()>> + Send>> {
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
            match tokio::time::timeout(self.connection.timeout(), tokio::spawn(work)).await {
                Ok(Ok(result)) => result,
                _ => Err(StoreError::Timeout(millis(self.connection.timeout()))),
            }
        })
    }

    /// The verified connection, making one if there is none (see `connection.rs`).
    pub(super) async fn link(&self) -> StoreResult<Link> {
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
                if self.layout.cluster {
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
        &self,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<T> {
        self.with_link_tracked(call).await.map(|(v, _)| v)
    }

    /// [`RedisStore::with_link`], which also says the generation of the connection it used.
    pub(super) async fn with_link_tracked<T>(
        &self,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<(T, u64)> {
        let deadline = Instant::now() + self.connection.timeout();
        let link = match self.connection.current() {
            Some(link) => link,
            None => tokio::time::timeout_at(deadline, self.link())
                .await
                .map_err(|_| StoreError::Timeout(millis(self.connection.timeout())))??,
        };
        let generation = link.generation;
        self.call_on(link, deadline, call)
            .await
            .map(|v| (v, generation))
    }

    /// Runs `call` on connection `generation` only, within the store's time bound: an error,
    /// without running it, if that connection is no longer the verified one (replaced, or
    /// down). For a `WAIT` that must count the writes an earlier call made on that connection.
    pub(super) async fn with_link_on<T>(
        &self,
        generation: u64,
        call: impl AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    ) -> StoreResult<T> {
        let deadline = Instant::now() + self.connection.timeout();
        match self.connection.current() {
            Some(link) if link.generation == generation => self.call_on(link, deadline, call).await,
            _ => Err(StoreError::Failed(
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
