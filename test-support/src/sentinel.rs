//! A Redis Sentinel deployment on loopback: one master, two replicas and three sentinels, each a
//! `redis-server` of its own (the sentinels run `redis-server <conf> --sentinel`, each with its
//! own configuration file, which it rewrites), each in a directory of its own, all killed when
//! dropped.
//!
//! [`SentinelTopology::start`] returns once the deployment can fail over: the replicas are in
//! sync, every sentinel knows both replicas and both other sentinels, and `SENTINEL ckquorum`
//! agrees. Tests then kill the master ([`SentinelTopology::kill_master`]), await the promotion
//! ([`SentinelTopology::wait_for_new_master`]), stage a failover that really loses writes
//! ([`SentinelTopology::cut_off_replicas`]), freeze the master so that it stops answering
//! without refusing ([`SentinelTopology::pause_master`]), and bring the dead server back as a
//! replica ([`SentinelTopology::heal`]) for the next failover.
//!
//! Timings (redis-server 7.0 on loopback, with the settings below): the sentinels find each other
//! within 2–5 s; a replica is promoted 1.5–4.5 s after its master is killed.

use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;

use crate::redis_server::{RedisServer, ServerOptions};
use crate::temp::TempDir;

mod probe;

use probe::{connect, query, role};

/// The master's name the sentinels monitor, the last part of the broker's URL.
pub const MASTER_NAME: &str = "lockbroker";

/// How long the sentinels wait before they call an unanswering server down: short, so that a
/// failover comes within seconds.
const DOWN_AFTER_MS: u64 = 1000;

/// The sentinels' `failover-timeout`: short, so that a failover that stalls is retried soon.
const FAILOVER_TIMEOUT_MS: u64 = 5000;

/// How long the deployment gets to become able to fail over, at start and after [`heal`].
///
/// [`heal`]: SentinelTopology::heal
const HEALTHY_LIMIT: Duration = Duration::from_secs(20);

/// A server of the deployment with the directory it works in. Declared before `dir`: the server
/// stops before its directory goes.
struct Node {
    server: RedisServer,
    dir: TempDir,
}

impl Node {
    async fn start(what: &str, config: Option<PathBuf>, args: Vec<String>) -> Self {
        let dir = TempDir::new(what);
        let server = RedisServer::start_with(ServerOptions {
            config,
            args,
            dir: Some(dir.dir().to_owned()),
        })
        .await;
        Self { server, dir }
    }
}

/// One master, two replicas and three sentinels, on free loopback ports; see the module's
/// documentation.
pub struct SentinelTopology {
    /// The data servers; the first one starts as the master. Failovers move the master among them.
    data: Vec<Node>,
    sentinels: Vec<Node>,
}

/// The arguments of every data server: a full sync starts at once (by default a master waits 5 s
/// for more replicas to share it).
fn data_args() -> Vec<String> {
    vec!["--repl-diskless-sync-delay".into(), "0".into()]
}

/// [`data_args`] and `--replicaof 127.0.0.1 PORT`.
fn replica_of(port: u16) -> Vec<String> {
    let mut args = data_args();
    args.extend(["--replicaof".into(), "127.0.0.1".into(), port.to_string()]);
    args
}

impl SentinelTopology {
    /// Starts the deployment and waits until it can fail over (see [`Self::heal`]'s conditions).
    pub async fn start() -> Self {
        crate::init_test_log();
        let master = Node::start("sentinel-master", None, data_args()).await;
        let master_port = master.server.port();
        let mut data = vec![master];
        for _ in 0..2 {
            data.push(Node::start("sentinel-replica", None, replica_of(master_port)).await);
        }
        let mut topology = Self {
            data,
            sentinels: Vec::new(),
        };
        // Replicas first, in sync: a sentinel learns the replicas from the master's first INFO
        // reply, which it asks for at once; later it asks only every 10 s.
        topology
            .wait_until(HEALTHY_LIMIT, Self::replicas_in_sync)
            .await;
        for _ in 0..3 {
            let dir = TempDir::new("sentinel");
            let config = dir.path("sentinel.conf");
            std::fs::write(
                &config,
                format!(
                    "sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
                     sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n\
                     sentinel parallel-syncs {MASTER_NAME} 2\n"
                ),
            )
            .expect("cannot write a sentinel's configuration");
            let server = RedisServer::start_with(ServerOptions {
                config: Some(config),
                args: vec!["--sentinel".into()],
                dir: Some(dir.dir().to_owned()),
            })
            .await;
            topology.sentinels.push(Node { server, dir });
        }
        topology.wait_until_healthy().await;
        topology
    }

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/lockbroker`: the URL brokers
    /// use.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.server.port()))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }

    /// The sentinels' ports.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.server.port()).collect()
    }

    /// The port of the master: the one a sentinel names and that `ROLE` confirms is a master.
    /// Panics if there is none (during a failover).
    pub async fn master_port(&self) -> u16 {
        self.named_master()
            .await
            .expect("no master named by the sentinels and confirmed by ROLE")
    }

    /// A connection of the test's own to the server on `port`, to look at or write to it
    /// directly.
    pub async fn connection(&self, port: u16) -> redis::aio::MultiplexedConnection {
        connect(port)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the server on port {port}: {e}"))
    }

    /// The master a sentinel names, if `ROLE` on it confirms it is one. Sentinels switch at
    /// slightly different moments, and may name the new master a moment before it has switched
    /// role; any sentinel naming a confirmed master will do.
    async fn named_master(&self) -> Option<u16> {
        for sentinel in self.sentinel_ports() {
            let named: Result<Option<(String, u16)>, _> = query(
                sentinel,
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(MASTER_NAME),
            )
            .await;
            if let Ok(Some((_, port))) = named
                && role(port).await.as_deref() == Some("master")
            {
                return Some(port);
            }
        }
        None
    }

    fn node_mut(&mut self, port: u16) -> &mut Node {
        self.data
            .iter_mut()
            .find(|n| n.server.port() == port)
            .unwrap_or_else(|| panic!("no data server on port {port}"))
    }

    /// SIGKILLs the master: no shutdown, its data gone. Returns its port and when it died.
    pub async fn kill_master(&mut self) -> (u16, Instant) {
        let port = self.master_port().await;
        self.node_mut(port).server.stop();
        (port, Instant::now())
    }

    /// Freezes the master (SIGSTOP): it stops answering without refusing, as a host that
    /// vanished or a partition looks from the outside. Its kernel still accepts connections and
    /// acknowledges what is sent, so nothing fails fast: every wait on it ends only by a
    /// timeout. Returns its port and when it froze; [`Self::resume`] thaws it.
    pub async fn pause_master(&self) -> (u16, Instant) {
        let port = self.master_port().await;
        self.node(port).server.pause();
        (port, Instant::now())
    }

    /// Thaws the data server on `port` that [`Self::pause_master`] froze. After a failover it
    /// still believes it is the master until the sentinels (or [`Self::heal`]) demote it.
    pub fn resume(&self, port: u16) {
        self.node(port).server.resume();
    }

    fn node(&self, port: u16) -> &Node {
        self.data
            .iter()
            .find(|n| n.server.port() == port)
            .unwrap_or_else(|| panic!("no data server on port {port}"))
    }

    /// Polls until the sentinels name a master other than `old` and `ROLE` confirms it (for at
    /// most `limit`). Returns its port and when it was seen.
    pub async fn wait_for_new_master(&self, old: u16, limit: Duration) -> (u16, Instant) {
        let started = Instant::now();
        loop {
            if let Some(port) = self.named_master().await
                && port != old
            {
                return (port, Instant::now());
            }
            assert!(
                started.elapsed() < limit,
                "no replica was promoted within {limit:?} of the master on port {old}:\n{}",
                self.sentinel_logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Asks a sentinel for a failover (`SENTINEL FAILOVER`) with every server up: a replica is
    /// promoted, and the old master is demoted to a replica of it. Returns the old master's port
    /// and when the failover was asked for.
    pub async fn fail_over(&self) -> (u16, Instant) {
        let master = self.master_port().await;
        let sentinel = self.sentinel_ports()[0];
        let () = query(
            sentinel,
            redis::cmd("SENTINEL").arg("failover").arg(MASTER_NAME),
        )
        .await
        .expect("SENTINEL FAILOVER");
        (master, Instant::now())
    }

    /// The first element of `ROLE` on the server on `port`: `master` or `slave` (`None` if it
    /// does not answer).
    pub async fn role(&self, port: u16) -> Option<String> {
        role(port).await
    }

    /// Stages a failover that loses writes (on loopback, replicas are so quick that a plain kill
    /// loses almost nothing): freezes every replica (SIGSTOP) and has the master drop their
    /// links (`CLIENT KILL TYPE replica`). Writes from now on reach the master only; kill it,
    /// then [`Self::resume_replicas`] at once (a replica frozen for longer than the sentinels'
    /// down-after time cannot be promoted), and the promoted replica has none of them. The
    /// other replica then syncs from the new master and loses them too.
    pub async fn cut_off_replicas(&self) {
        let master = self.master_port().await;
        for node in self.replicas(master) {
            node.server.pause();
        }
        let killed: u64 = query(
            master,
            redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("replica"),
        )
        .await
        .expect("CLIENT KILL TYPE replica on the master");
        assert_eq!(killed, 2, "the master had {killed} replica links, not 2");
    }

    /// Thaws the replicas [`Self::cut_off_replicas`] froze (every data server but `master`).
    pub fn resume_replicas(&self, master: u16) {
        for node in self.replicas(master) {
            node.server.resume();
        }
    }

    fn replicas(&self, master: u16) -> impl Iterator<Item = &Node> {
        self.data.iter().filter(move |n| n.server.port() != master)
    }

    /// Brings every dead data server back, empty, as a replica of the current master, demotes an
    /// old master that is still up (the sentinels would, but only 8 s after the failover), and
    /// waits until the deployment can fail over again: every replica in sync with the master,
    /// and every sentinel agreeing on the master, seeing both replicas up and both other
    /// sentinels, with `SENTINEL ckquorum` answering OK.
    pub async fn heal(&mut self) {
        let master = self.master_port().await;
        for node in &mut self.data {
            let port = node.server.port();
            if port != master
                && node.server.is_running()
                && role(port).await.as_deref() == Some("master")
            {
                let () = query(port, redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master))
                    .await
                    .expect("REPLICAOF on the old master");
            }
            if !node.server.is_running() {
                node.server
                    .restart_with(ServerOptions {
                        config: None,
                        args: replica_of(master),
                        dir: Some(node.dir.dir().to_owned()),
                    })
                    .await;
            }
        }
        self.wait_until_healthy().await;
    }

    /// Every sentinel's log, for a failure message.
    pub fn sentinel_logs(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| {
                format!(
                    "--- sentinel on {} ---\n{}",
                    s.server.port(),
                    s.server.log_text()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}
