//! The real `lockbroker serve` as a child process, for what a broker run in the test process
//! cannot show: the binary's start-up, configuration and exit status, signals, SIGKILL, and a
//! host clock shifted with `faketime`.
//!
//! [`BrokerCommand`] says how to start one (the binary, a clock offset, and the test's flags
//! for the port it is given); [`BrokerSpec`] is the usual case, a broker on a Redis with the
//! timeouts a fault test picks. [`BrokerProcess`] starts it on a free port, waits until it
//! serves, and kills it (its whole process group) when dropped. [`wait_until_ready`] and
//! [`clock_offset_s`] look at any broker by its URL.
//!
//! This crate cannot name the binary itself: Cargo tells only the package's own test targets
//! where it is (`env!("CARGO_BIN_EXE_lockbroker")`), so each suite passes that path in.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use reqwest::StatusCode;

use crate::http::http_client;
use crate::temp::temp_log;
use crate::{free_port, send_signal};

/// How long a broker gets to serve `/healthz` after it is started.
const START_LIMIT: Duration = Duration::from_secs(10);

/// `binary serve`, with no `LOCKBROKER_*` or `FAKETIME*` variable from the test's own
/// environment (either would change what the test asked for), and stdin closed.
pub fn serve_command(binary: impl Into<PathBuf>) -> Command {
    let mut command = Command::new(binary.into());
    command.arg("serve").stdin(Stdio::null());
    scrub_environment(&mut command);
    command
}

fn scrub_environment(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        let name_text = name.to_string_lossy();
        if name_text.starts_with("LOCKBROKER_") || name_text.starts_with("FAKETIME") {
            command.env_remove(name);
        }
    }
}

/// Completes `lockbroker serve`'s command line for the port the broker is given. Kept to
/// start the broker again, on the same port, after it was killed.
type Configure = Arc<dyn Fn(&mut Command, u16) + Send + Sync>;

/// How a broker process is started: its binary, optionally under `faketime`, completed by the
/// test for the port it is given.
#[derive(Clone)]
pub struct BrokerCommand {
    binary: PathBuf,
    /// A `faketime` offset for the host clock, such as `+5s` or `-5s`.
    skew: Option<String>,
    configure: Configure,
}

impl BrokerCommand {
    /// `binary serve --listen 127.0.0.1:PORT` and nothing else: the embedded store and every
    /// default.
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        Self::configured(binary, listen_on)
    }

    /// `binary serve` completed by `configure`, which must make the broker listen on the port
    /// it is given (by flag, environment or a configuration file it writes).
    pub fn configured(
        binary: impl Into<PathBuf>,
        configure: impl Fn(&mut Command, u16) + Send + Sync + 'static,
    ) -> Self {
        Self {
            binary: binary.into(),
            skew: None,
            configure: Arc::new(configure),
        }
    }

    /// The same broker under `faketime`, its wall clock moved by `offset` (`+5s`, `-5s`).
    pub fn skewed(mut self, offset: &str) -> Self {
        self.skew = Some(offset.to_owned());
        self
    }

    fn command(&self, port: u16) -> Command {
        let mut command = match &self.skew {
            None => serve_command(&self.binary),
            Some(offset) => {
                // The real clock moved by `offset`; the monotonic clock is left alone, as a host
                // whose wall clock is wrong still counts seconds at the right rate.
                let mut command = Command::new("faketime");
                command
                    .args(["-m", "--exclude-monotonic", "-f", offset])
                    .arg(&self.binary)
                    .arg("serve")
                    .stdin(Stdio::null());
                scrub_environment(&mut command);
                command
            }
        };
        // A process group of its own, so that SIGKILL reaches the broker itself, not only the
        // `faketime` wrapper around it.
        command.process_group(0);
        (self.configure)(&mut command, port);
        command
    }
}

/// `--listen 127.0.0.1:PORT`.
pub fn listen_on(command: &mut Command, port: u16) {
    command.args(["--listen", &format!("127.0.0.1:{port}")]);
}

/// A broker on the Redis at `redis_url`, with the timeouts a fault test picks; the usual
/// [`BrokerCommand`] of the fault tests.
#[derive(Debug, Clone)]
pub struct BrokerSpec {
    /// The `lockbroker` binary (`env!("CARGO_BIN_EXE_lockbroker")`).
    pub binary: PathBuf,
    pub redis_url: String,
    pub store_timeout_ms: u64,
    pub max_ttl_ms: u64,
    /// `None`: the default (off).
    pub store_loss_delay_ms: Option<u64>,
    /// How long a new store epoch holds every grant while brokers put their leases back. The
    /// product's default, 3 s, unless a test needs another: with less, nothing is promised
    /// across a store loss, and a torture run across one would be testing a broken setting.
    pub store_settle_ms: u64,
    /// A `faketime` offset for the host clock, such as `+5s` or `-5s`.
    pub skew: Option<&'static str>,
    /// `--redis-replica-acks`; `None`: the default (0).
    pub replica_acks: Option<u32>,
}

impl BrokerSpec {
    pub fn on(binary: impl Into<PathBuf>, redis_url: String) -> Self {
        Self {
            binary: binary.into(),
            redis_url,
            store_timeout_ms: 500,
            max_ttl_ms: 30_000,
            store_loss_delay_ms: None,
            store_settle_ms: 3_000,
            skew: None,
            replica_acks: None,
        }
    }

    pub fn skewed(mut self, skew: &'static str) -> Self {
        self.skew = Some(skew);
        self
    }

    /// The flags after `--listen`.
    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "--redis-url".to_owned(),
            self.redis_url.clone(),
            "--store-timeout-ms".to_owned(),
            self.store_timeout_ms.to_string(),
            "--max-ttl-ms".to_owned(),
            self.max_ttl_ms.to_string(),
            "--default-ttl-ms".to_owned(),
            self.max_ttl_ms.min(30_000).to_string(),
            "--log-level".to_owned(),
            "warn".to_owned(),
            "--store-settle-ms".to_owned(),
            self.store_settle_ms.to_string(),
        ];
        if let Some(delay) = self.store_loss_delay_ms {
            args.extend(["--store-loss-delay-ms".to_owned(), delay.to_string()]);
        }
        if let Some(acks) = self.replica_acks {
            args.extend(["--redis-replica-acks".to_owned(), acks.to_string()]);
        }
        args
    }
}

impl From<BrokerSpec> for BrokerCommand {
    fn from(spec: BrokerSpec) -> Self {
        let args = spec.args();
        let command = Self::configured(spec.binary, move |command, port| {
            listen_on(command, port);
            command.args(&args);
        });
        match spec.skew {
            Some(offset) => command.skewed(offset),
            None => command,
        }
    }
}

/// A `lockbroker serve` process, in a process group of its own, killed with that group when
/// dropped. Its stdout and stderr go to a temp file, read with [`Self::output`].
pub struct BrokerProcess {
    command: BrokerCommand,
    child: Option<Child>,
    /// The last process started, also once `child` is gone (waited for, or being waited for
    /// by [`Self::exit_status`]). Under `faketime` it is the wrapper's.
    pid: u32,
    port: u16,
    log: PathBuf,
}

impl BrokerProcess {
    /// Starts a broker on a free port and waits until it serves `/healthz`. Tries another port
    /// if the one picked was taken meanwhile.
    pub async fn start(command: impl Into<BrokerCommand>) -> Self {
        let command = command.into();
        for _ in 0..5 {
            let mut broker = Self {
                command: command.clone(),
                child: None,
                pid: 0,
                port: free_port(),
                log: temp_log("broker"),
            };
            if broker.launch().await {
                return broker;
            }
        }
        panic!("the broker did not start on any free port");
    }

    /// `http://127.0.0.1:PORT`, as [`crate::app::TestApp::address`].
    pub fn address(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `path` on this broker, as [`crate::app::TestApp::url`].
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address())
    }

    /// The process id, to signal it (see [`crate::send_signal`]).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// What the broker wrote to stdout and stderr so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, to the whole process group, and reap: no shutdown, no cleanup.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(child.id());
            let _ = child.wait();
        }
    }

    /// Starts the broker again, on the same port, after [`Self::kill`]. The port can stay busy
    /// for a moment after the old process died, so this retries for a few seconds.
    pub async fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + START_LIMIT;
        while !self.launch().await {
            assert!(
                Instant::now() < deadline,
                "port {} stayed busy; cannot restart the broker",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, the graceful stop, then [`Self::exit_status`].
    pub async fn terminate(&mut self, limit: Duration) -> ExitStatus {
        send_signal(self.pid, "-TERM");
        self.exit_status(limit).await
    }

    /// Waits for the process to exit, for at most `limit`; past that it is killed and the test
    /// fails with its output.
    pub async fn exit_status(&mut self, limit: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("the broker process");
        let waiting = tokio::task::spawn_blocking(move || child.wait());
        match tokio::time::timeout(limit, waiting).await {
            Ok(status) => status.expect("the wait task").expect("wait for the broker"),
            Err(_) => {
                kill_group(self.pid);
                panic!(
                    "the broker did not exit within {limit:?}:\n{}",
                    self.output()
                );
            }
        }
    }

    /// Spawns the process and waits for `/healthz`; `false` if the port was taken. Panics on
    /// any other failure to start.
    async fn launch(&mut self) -> bool {
        let out = std::fs::File::create(&self.log).expect("cannot create the broker log");
        let err = out.try_clone().expect("cannot clone the log handle");
        let spawned = self
            .command
            .command(self.port)
            .stdout(out)
            .stderr(err)
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.command.skew.is_some() => {
                panic!(
                    "`faketime` is not installed, and the clock-skew tests run brokers under it. \
                     Run the README's test command, scripts/test.sh, which installs it (on \
                     Debian/Ubuntu: apt-get install faketime)."
                )
            }
            Err(e) => panic!("cannot start the lockbroker binary: {e}"),
        };
        self.pid = child.id();
        self.child = Some(child);
        let client = http_client();
        let started = Instant::now();
        loop {
            let child = self.child.as_mut().expect("the broker process");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                let output = self.output();
                if output.contains("cannot listen") {
                    return false;
                }
                panic!("the broker exited at start with {status}:\n{output}");
            }
            let healthz = client.get(self.url("/healthz")).send().await;
            if healthz.is_ok_and(|r| r.status() == StatusCode::OK) {
                return true;
            }
            if started.elapsed() > START_LIMIT {
                self.kill();
                panic!(
                    "the broker did not serve within {START_LIMIT:?}:\n{}",
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// SIGKILL to the process group led by `pid` (a broker started by [`BrokerProcess`]).
fn kill_group(pid: u32) {
    let group = Pid::from_raw(i32::try_from(pid).expect("a pid fits in i32"));
    let _ = killpg(group, Signal::SIGKILL);
}

/// Polls `url`'s `/readyz` until it answers 200, for at most `limit`.
pub async fn wait_until_ready(url: &str, limit: Duration) {
    let client = http_client();
    let started = Instant::now();
    loop {
        let ready = client.get(format!("{url}/readyz")).send().await;
        if ready.is_ok_and(|r| r.status() == StatusCode::OK) {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "the broker at {url} was not ready within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// How far the broker at `url` thinks the time is from this host's clock, in seconds, read from
/// the `Date` header it puts on every answer (its own wall clock, to the second).
pub async fn clock_offset_s(url: &str) -> i64 {
    let answer = http_client()
        .get(format!("{url}/healthz"))
        .send()
        .await
        .expect("the broker answers");
    let date = answer
        .headers()
        .get("date")
        .expect("a Date header")
        .to_str()
        .expect("an ASCII date")
        .to_owned();
    let theirs = parse_http_date(&date).unwrap_or_else(|| panic!("cannot read Date {date:?}"));
    let ours = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    i64::try_from(theirs).unwrap() - i64::try_from(ours).unwrap()
}

/// Unix seconds of an IMF-fixdate such as `Sat, 21 Nov 2026 23:31:42 GMT`.
pub fn parse_http_date(date: &str) -> Option<u64> {
    let parts: Vec<&str> = date.split_whitespace().collect();
    let [_, day, month, year, time, "GMT"] = parts.as_slice() else {
        return None;
    };
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| m == month)? as i64
        + 1;
    let (day, year): (i64, i64) = (day.parse().ok()?, year.parse().ok()?);
    let hms: Vec<u64> = time
        .split(':')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    let [h, m, s] = hms.as_slice() else {
        return None;
    };
    // Days from 1970-01-01 to the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    Some(days * 86_400 + h * 3600 + m * 60 + s)
}
