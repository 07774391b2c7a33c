//! A real Redis Cluster per test file: `redis-server` processes in cluster mode on free loopback
//! ports (each with its own directory and node file), joined by `redis-cli --cluster create`,
//! waited on until every node reports `cluster_state:ok` and every replica's link is up, and
//! killed when dropped. Tests kill a master to stage a failover and flush one to stage a loss.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::temp::TempDir;
use crate::{free_port, send_signal};

/// How long the cluster gets to form, or to recover after a failover.
const CLUSTER_LIMIT: Duration = Duration::from_secs(30);

/// One node of the cluster.
pub struct Node {
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
}

impl Node {
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// A connection to this node alone (commands on keys of other nodes answer MOVED).
    pub async fn connection(&self) -> MultiplexedConnection {
        redis::Client::open(format!("redis://127.0.0.1:{}/", self.port))
            .expect("a valid URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to a cluster node")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }
}

/// A Redis Cluster of `masters` masters with one replica each.
pub struct RedisCluster {
    pub nodes: Vec<Node>,
    _dir: TempDir,
}

impl RedisCluster {
    /// Starts `masters` masters and as many replicas, creates the cluster and waits until it
    /// serves every slot.
    pub async fn start(masters: usize) -> Self {
        let dir = TempDir::new("redis-cluster");
        let mut nodes = Vec::new();
        for i in 0..masters * 2 {
            let node_dir = dir.path(&format!("node-{i}"));
            std::fs::create_dir_all(&node_dir).expect("cannot create a node directory");
            nodes.push(start_node(node_dir).await);
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(node.address());
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("cannot run redis-cli --cluster create");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && text.contains("All 16384 slots covered"),
            "redis-cli --cluster create failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Self { nodes, _dir: dir };
        cluster.wait_until_healthy().await;
        cluster
    }

    /// The broker's URL for this cluster, naming every node as a seed.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self.nodes.iter().map(Node::address).collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// The nodes that are masters now, by asking each running node's `ROLE`.
    pub async fn masters(&self) -> Vec<usize> {
        let mut masters = Vec::new();
        for (i, node) in self.nodes.iter().enumerate() {
            if node.is_running() && role(node).await.as_deref() == Some("master") {
                masters.push(i);
            }
        }
        masters
    }

    /// The node that serves `redis_key`'s slot now.
    pub async fn master_of(&self, redis_key: &str) -> usize {
        self.owner_of(redis_key)
            .await
            .unwrap_or_else(|| panic!("no master serves the slot of {redis_key}"))
    }

    /// The running node that the masters' `CLUSTER SLOTS` name for `redis_key`'s slot.
    async fn owner_of(&self, redis_key: &str) -> Option<usize> {
        let slot = lockbroker::store::redis::slot_of(redis_key.as_bytes());
        for i in self.masters().await {
            let mut conn = self.nodes[i].connection().await;
            let owner: Vec<redis::Value> = redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            for range in owner {
                let redis::Value::Array(parts) = range else {
                    continue;
                };
                let (Some(start), Some(end), Some(redis::Value::Array(master))) =
                    (parts.first(), parts.get(1), parts.get(2))
                else {
                    continue;
                };
                let start: u16 = redis::from_redis_value_ref(start).expect("slot");
                let end: u16 = redis::from_redis_value_ref(end).expect("slot");
                if (start..=end).contains(&slot) {
                    let port: u16 = redis::from_redis_value_ref(&master[1]).expect("port");
                    return self
                        .nodes
                        .iter()
                        .position(|n| n.port == port && n.is_running());
                }
            }
        }
        None
    }

    /// The replica of master `i`.
    pub async fn replica_of(&self, i: usize) -> usize {
        let mut conn = self.nodes[i].connection().await;
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await
            .expect("INFO replication");
        let port: u16 = info
            .lines()
            .find_map(|l| l.strip_prefix("slave0:"))
            .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("port=")))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("node {i} has no replica:\n{info}"));
        self.nodes
            .iter()
            .position(|n| n.port == port)
            .expect("the replica is one of ours")
    }

    /// Kills node `i` (SIGKILL): with no persistence its data is gone; its replica is promoted
    /// after the node timeout.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) node `i`.
    pub fn signal(&self, i: usize, signal: &str) {
        let child = self.nodes[i].child.as_ref().expect("the node is running");
        send_signal(child.id(), signal);
    }

    /// Waits until every running node reports `cluster_state:ok` and every running replica's
    /// link to its master is up.
    pub async fn wait_until_healthy(&self) {
        let started = Instant::now();
        loop {
            let mut healthy = true;
            for node in self.nodes.iter().filter(|n| n.is_running()) {
                let mut conn = node.connection().await;
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_default();
                let replication: String = redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_default();
                healthy &= info.contains("cluster_state:ok")
                    && (replication.contains("role:master")
                        || replication.contains("master_link_status:up"));
            }
            if healthy {
                return;
            }
            if started.elapsed() > CLUSTER_LIMIT {
                let logs: Vec<String> = self.nodes.iter().map(Node::log).collect();
                panic!(
                    "the cluster did not become healthy within {CLUSTER_LIMIT:?}; logs:\n{}",
                    logs.join("\n----\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the slot that `redis_key` hashes to is served by a master other than node
    /// `old`, and returns the new master's index.
    pub async fn wait_for_new_master(&self, redis_key: &str, old: usize) -> usize {
        let started = Instant::now();
        loop {
            let master = tokio::time::timeout(Duration::from_secs(1), self.owner_of(redis_key))
                .await
                .ok()
                .flatten();
            if let Some(master) = master
                && master != old
                && role(&self.nodes[master]).await.as_deref() == Some("master")
            {
                return master;
            }
            assert!(
                started.elapsed() < CLUSTER_LIMIT,
                "no replica took over from node {old} within {CLUSTER_LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

async fn role(node: &Node) -> Option<String> {
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{}/", node.port))
        .ok()?
        .get_multiplexed_async_connection()
        .await
        .ok()?;
    let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await.ok()?;
    redis::from_redis_value_ref(role.first()?).ok()
}

/// A port for a cluster node: its bus port (+10000) must exist and be free too.
fn cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port < 55536 && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

async fn start_node(dir: PathBuf) -> Node {
    for _ in 0..10 {
        let port = cluster_port();
        let log = dir.join("redis.log");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", "2000"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot spawn redis-server: is it installed? (scripts/test.sh installs it)");
        let mut node = Node {
            port,
            child: Some(child),
            dir: dir.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(child) = node.child.as_mut()
                && let Ok(Some(_)) = child.try_wait()
            {
                node.child = None;
                break;
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return node;
            }
            if Instant::now() > deadline {
                panic!("a cluster node did not start; its log:\n{}", node.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !node.log().contains("Address already in use") {
            panic!("a cluster node did not start; its log:\n{}", node.log());
        }
        let _ = std::fs::remove_file(dir.join("nodes.conf"));
    }
    panic!("no free port pair for a cluster node");
}
