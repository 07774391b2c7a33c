//! A throwaway `redis-server` per test: on a free loopback port, with no persistence, retried on
//! another port if the one picked was taken, its log printed when it does not come up, and
//! killed (and reaped) when dropped. Tests stop, restart, freeze and thaw it to stage a Redis
//! that crashed, came back empty or hangs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::temp::temp_log;
use crate::{free_port, send_signal};

/// How long a fresh `redis-server` gets to answer PING before the test gives up.
const REDIS_START_LIMIT: Duration = Duration::from_secs(5);

/// A `redis-server` of this test's own, on a free loopback port, with no persistence: killed
/// (and reaped) when dropped.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    log: PathBuf,
    /// Where the append-only file lives once [`RedisServer::persist_to_aof`] turned it on; a
    /// restart then loads it.
    aof_dir: Option<PathBuf>,
    options: ServerOptions,
    /// Whether `options.dir` was made for this server (and goes with it).
    own_dir: bool,
}

/// What a server of a larger topology needs beyond the defaults (see `sentinel.rs`).
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// A configuration file, given first on the command line: a sentinel needs one it can
    /// rewrite, one per sentinel.
    pub config: Option<PathBuf>,
    /// Arguments after the defaults, such as `--replicaof 127.0.0.1 PORT` or `--sentinel`.
    pub args: Vec<String>,
    /// A working directory of its own. Without one the server works in the temp directory,
    /// which is fine for a server that never writes a file; a replica writes the RDB of its
    /// full sync there (as `dump.rdb`, which any server starting in that directory would load).
    pub dir: Option<PathBuf>,
}

/// Why one launch of `redis-server` did not come up.
enum LaunchError {
    /// The port was taken between picking it and redis binding it.
    PortBusy,
    Other(String),
}

impl RedisServer {
    /// Starts a server on a free port, trying another port if the one picked was taken.
    pub async fn start() -> Self {
        Self::start_with(ServerOptions::default()).await
    }

    /// As [`RedisServer::start`], with `options`.
    pub async fn start_with(options: ServerOptions) -> Self {
        let mut last = String::new();
        for _ in 0..10 {
            let port = free_port();
            let mut server = Self {
                port,
                child: None,
                log: temp_log(&format!("redis-{port}")),
                aof_dir: None,
                options: ServerOptions {
                    // Each server in a directory of its own by default: a file one writes (a
                    // replica's synced snapshot, `dump.rdb`) would be loaded by the next one
                    // started in a shared directory.
                    dir: Some(
                        options
                            .dir
                            .clone()
                            .unwrap_or_else(|| temp_log(&format!("redis-{port}-dir"))),
                    ),
                    ..options.clone()
                },
                own_dir: options.dir.is_none(),
            };
            match server.launch().await {
                Ok(()) => return server,
                Err(LaunchError::PortBusy) => last = format!("port {port} was busy"),
                Err(LaunchError::Other(why)) => panic!("redis-server did not start: {why}"),
            }
        }
        panic!("redis-server did not start on any free port ({last})");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the process is running (not stopped, nor exited by itself).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// A connection of the test's own, to look at what the brokers wrote.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("a valid URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis")
    }

    /// How many times this server has run `command` (lower case, as `INFO commandstats` names
    /// it: `evalsha`, `wait`): a count of round trips, not a timing.
    pub async fn command_calls(&self, command: &str) -> u64 {
        self.command_counts()
            .await
            .get(command)
            .copied()
            .unwrap_or(0)
    }

    /// How many lock script calls this server has run: `EVALSHA`s and `FCALL`s (the broker
    /// runs its scripts as functions where it can, by SHA where it cannot; its epoch check is a
    /// plain `EVAL`, not counted).
    pub async fn script_calls(&self) -> u64 {
        script_calls(&self.command_counts().await)
    }

    /// The calls this server has served, by command (lower case, as `INFO commandstats` names
    /// them), `info` itself left out.
    pub async fn command_counts(&self) -> BTreeMap<String, u64> {
        let mut conn = self.connection().await;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .expect("INFO commandstats");
        info.lines()
            .filter_map(|line| {
                let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = stats.split(',').find_map(|f| f.strip_prefix("calls="))?;
                let calls = calls.trim().parse().expect("calls= is a count");
                (name != "info").then(|| (name.to_owned(), calls))
            })
            .collect()
    }

    /// `CONFIG SET name value`, at run time.
    pub async fn config_set(&self, name: &str, value: impl redis::ToRedisArgs) {
        let mut conn = self.connection().await;
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("CONFIG SET {name}: {e}"));
    }

    /// `FLUSHALL`: every key gone, the server process the same (as an operator's mistake, or a
    /// script that cleans the wrong database, would leave it).
    pub async fn flushall(&self) {
        let mut conn = self.connection().await;
        let () = redis::cmd("FLUSHALL")
            .query_async(&mut conn)
            .await
            .expect("FLUSHALL");
    }

    /// Polls until `brokers` brokers listen for release notices on Redis (see
    /// [`wait_until_listening_on`]).
    pub async fn wait_until_listening(&self, brokers: u64) {
        wait_until_listening_on(&mut self.connection().await, brokers).await;
    }

    /// Kills the server and waits for it: its data is gone, like a Redis that crashed.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts an empty server again on the same port (the brokers keep their URL). The port can
    /// stay busy for a moment after the old server died, so this retries for a few seconds.
    pub async fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + REDIS_START_LIMIT;
        loop {
            match self.launch().await {
                Ok(()) => return,
                Err(LaunchError::PortBusy) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(LaunchError::PortBusy) => {
                    panic!("port {} stayed busy; cannot restart redis", self.port)
                }
                Err(LaunchError::Other(why)) => panic!("redis-server did not restart: {why}"),
            }
        }
    }

    /// As [`RedisServer::restart`], with other `options` from now on (a master killed in a
    /// failover comes back as a replica of the new one).
    pub async fn restart_with(&mut self, options: ServerOptions) {
        self.options = options;
        self.restart().await;
    }

    /// Freezes the server (SIGSTOP): connections stay open but nothing is answered, as with a
    /// Redis stuck in a long command or a network that drops packets.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT); it then runs what was sent to it meanwhile.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Restarts the server with an append-only file (every write fsynced) in a directory of its
    /// own: from then on a restart loads it, as a Redis with persistence does. Call it before
    /// the brokers start.
    pub async fn persist_to_aof(&mut self) {
        let dir = temp_log(&format!("redis-{}-aof", self.port));
        std::fs::create_dir_all(&dir).expect("cannot create the AOF directory");
        self.aof_dir = Some(dir);
        self.restart().await;
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("redis-server is running");
        send_signal(child.id(), signal);
    }

    async fn launch(&mut self) -> Result<(), LaunchError> {
        if let Some(dir) = &self.options.dir {
            std::fs::create_dir_all(dir).expect("cannot create the redis directory");
        }
        let log = std::fs::File::create(&self.log).expect("cannot create the redis log file");
        let log_err = log.try_clone().expect("cannot clone the log file handle");
        let mut command = Command::new("redis-server");
        if let Some(config) = &self.options.config {
            command.arg(config);
        }
        let spawned = command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(match self.aof_dir {
                Some(_) => ["--appendonly", "yes", "--appendfsync", "always"],
                None => ["--appendonly", "no", "--appendfsync", "everysec"],
            })
            .arg("--dir")
            .arg(
                self.aof_dir
                    .clone()
                    .or_else(|| self.options.dir.clone())
                    .expect("every server has a directory"),
            )
            .args(&self.options.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not on PATH: the tests start their own Redis. Run the \
                 README's test command, scripts/test.sh, which installs it."
            ),
            Err(e) => {
                return Err(LaunchError::Other(format!(
                    "cannot spawn redis-server: {e}"
                )));
            }
        };
        let child = self.child.insert(child);
        let deadline = Instant::now() + REDIS_START_LIMIT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                let log = self.log_text();
                return Err(if log.contains("Address already in use") {
                    LaunchError::PortBusy
                } else {
                    LaunchError::Other(format!("it exited with {status}; its log:\n{log}"))
                });
            }
            if ping(self.port).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(LaunchError::Other(format!(
                    "it did not answer PING within {REDIS_START_LIMIT:?}; its log:\n{}",
                    self.log_text()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// What the server wrote to its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(no log: {e})"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.log);
        if let Some(dir) = &self.aof_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        if self.own_dir
            && let Some(dir) = &self.options.dir
        {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Whether a Redis on `port` answers `PING` with `PONG`.
async fn ping(port: u16) -> bool {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
        return false;
    };
    let exchange = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), exchange).await,
        Ok(Ok(pong)) if pong == "PONG"
    )
}

/// How many brokers listen for release notices on the server `conn` reaches: each listens on one
/// subscriber connection, on the channel `<prefix>released` (default prefix).
pub async fn listening(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (_, listening): (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg("lockbroker:released")
        .query_async(conn)
        .await
        .expect("PUBSUB NUMSUB");
    listening
}

/// Polls until `brokers` brokers listen for release notices on the server `conn` reaches.
pub async fn wait_until_listening_on(conn: &mut redis::aio::MultiplexedConnection, brokers: u64) {
    until_listening(async || conn.clone(), brokers, "the server").await;
}

/// Polls, for at most 5 s, until `brokers` brokers listen for release notices on the server
/// `connect` reaches, asked again before each look (`place` names it in the failure).
pub async fn until_listening(
    mut connect: impl AsyncFnMut() -> redis::aio::MultiplexedConnection,
    brokers: u64,
    place: &str,
) {
    let started = Instant::now();
    loop {
        let listening = listening(&mut connect().await).await;
        if listening >= brokers {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "only {listening} of {brokers} brokers listen for release notices on {place} after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The lock script calls among `counts` (as [`RedisServer::command_counts`] gives them):
/// `EVALSHA`s and `FCALL`s.
pub fn script_calls(counts: &BTreeMap<String, u64>) -> u64 {
    ["evalsha", "fcall"]
        .iter()
        .filter_map(|name| counts.get(*name))
        .sum()
}
