//! What the Sentinel fixture asks its servers: a connection, a command, `ROLE`, and whether
//! the deployment can fail over (the replicas in sync, the sentinels agreed), polled until it
//! can.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::{HEALTHY_LIMIT, MASTER_NAME, SentinelTopology};

/// A connection to the server (or sentinel) on `port`.
pub(super) async fn connect(port: u16) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(1)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// `cmd` on the server on `port`, through a connection of its own.
pub(super) async fn query<T: redis::FromRedisValue>(
    port: u16,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    let mut conn = connect(port).await?;
    cmd.query_async(&mut conn).await
}

/// The first element of `ROLE` on the server on `port`: `master`, `slave` or `sentinel`.
pub(super) async fn role(port: u16) -> Option<String> {
    let reply: Vec<redis::Value> = query(port, &redis::cmd("ROLE")).await.ok()?;
    redis::from_redis_value(reply.into_iter().next()?).ok()
}

impl SentinelTopology {
    /// Waits until the replicas are in sync and the sentinels ready (see [`Self::heal`]).
    pub(super) async fn wait_until_healthy(&self) {
        self.wait_until(HEALTHY_LIMIT, Self::replicas_in_sync).await;
        self.wait_until(HEALTHY_LIMIT, Self::sentinels_ready).await;
    }

    /// Polls `check` until it answers `Ok`, for at most `limit`; the last answer says what is
    /// missing when it gives up.
    pub(super) async fn wait_until<'a, F>(&'a self, limit: Duration, check: F)
    where
        F: AsyncFn(&'a Self) -> Result<(), String>,
    {
        let started = Instant::now();
        loop {
            let missing = match check(self).await {
                Ok(()) => return,
                Err(missing) => missing,
            };
            assert!(
                started.elapsed() < limit,
                "the Sentinel deployment was not ready within {limit:?}: {missing}\n{}",
                self.sentinel_logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether both replicas are linked to the master and in sync with it.
    pub(super) async fn replicas_in_sync(&self) -> Result<(), String> {
        let master = match self.sentinels.is_empty() {
            // Before the sentinels start, the first server is the master.
            true => self.data[0].server.port(),
            false => self
                .named_master()
                .await
                .ok_or("no master named by the sentinels")?,
        };
        let info = |port| async move {
            query::<String>(port, redis::cmd("INFO").arg("replication"))
                .await
                .map(|text| {
                    text.lines()
                        .filter_map(|l| l.trim().split_once(':'))
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect::<HashMap<String, String>>()
                })
                .map_err(|e| format!("INFO replication on {port}: {e}"))
        };
        let master_info = info(master).await?;
        for node in self.replicas(master) {
            let port = node.server.port();
            let replica = info(port).await?;
            let field = |k: &str| replica.get(k).map(String::as_str).unwrap_or_default();
            if field("role") != "slave"
                || field("master_port") != master.to_string()
                || field("master_link_status") != "up"
                || field("master_sync_in_progress") != "0"
                || replica.get("slave_repl_offset") != master_info.get("master_repl_offset")
            {
                return Err(format!(
                    "the replica on {port} is not in sync with the master on {master} \
                     (role {}, master port {}, link {})",
                    field("role"),
                    field("master_port"),
                    field("master_link_status")
                ));
            }
        }
        Ok(())
    }

    /// Whether every sentinel names the same master, sees both replicas up and both other
    /// sentinels, and can authorise a failover (`SENTINEL ckquorum`). (Not whether it sees the
    /// replicas' links up: it reads that from their `INFO`, which it asks for only every 10 s.)
    pub(super) async fn sentinels_ready(&self) -> Result<(), String> {
        let master = self.named_master().await.ok_or("no master")?;
        for sentinel in self.sentinel_ports() {
            let fail = |what: String| format!("sentinel on {sentinel}: {what}");
            let named: Option<(String, u16)> = query(
                sentinel,
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(MASTER_NAME),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
            if named.as_ref().map(|(_, port)| *port) != Some(master) {
                return Err(fail(format!("names {named:?}, not the master on {master}")));
            }
            let state: HashMap<String, String> = query(
                sentinel,
                redis::cmd("SENTINEL").arg("master").arg(MASTER_NAME),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
            let others = state.get("num-other-sentinels").map(String::as_str);
            if state.get("flags").map(String::as_str) != Some("master") || others != Some("2") {
                return Err(fail(format!(
                    "sees the master as {:?} with {others:?} other sentinels",
                    state.get("flags")
                )));
            }
            let replicas: Vec<HashMap<String, String>> = query(
                sentinel,
                redis::cmd("SENTINEL").arg("replicas").arg(MASTER_NAME),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
            let up = replicas
                .iter()
                .filter(|r| r.get("flags").map(String::as_str) == Some("slave"))
                .count();
            if up != 2 {
                return Err(fail(format!("sees {up} replicas up, not 2: {replicas:?}")));
            }
            let quorum: String = query(
                sentinel,
                redis::cmd("SENTINEL").arg("ckquorum").arg(MASTER_NAME),
            )
            .await
            .map_err(|e| fail(format!("ckquorum: {e}")))?;
            if !quorum.starts_with("OK") {
                return Err(fail(format!("ckquorum: {quorum}")));
            }
        }
        Ok(())
    }
}
