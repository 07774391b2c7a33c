//! Brokers as real processes, for the faults that need one: SIGKILL, and a host clock shifted
//! with `faketime`. Each runs in a process group of its own (so that SIGKILL reaches the broker
//! itself, not only the `faketime` wrapper around it) and is killed when dropped.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use reqwest::StatusCode;

use crate::helpers::{free_port, http_client, temp_log};

const BINARY: &str = env!("CARGO_BIN_EXE_lockbroker");

/// How long a broker gets to serve `/healthz` after it is started.
const START_LIMIT: Duration = Duration::from_secs(10);

/// How a broker process is run.
#[derive(Debug, Clone)]
pub struct BrokerSpec {
    pub redis_url: String,
    pub store_timeout_ms: u64,
    pub max_ttl_ms: u64,
    /// `None`: the default, `max_ttl_ms`.
    pub store_loss_delay_ms: Option<u64>,
    /// A `faketime` offset for the host clock, such as `+5s` or `-5s`.
    pub skew: Option<&'static str>,
}

impl BrokerSpec {
    pub fn on(redis_url: String) -> Self {
        Self {
            redis_url,
            store_timeout_ms: 500,
            max_ttl_ms: 30_000,
            store_loss_delay_ms: None,
            skew: None,
        }
    }

    pub fn skewed(mut self, skew: &'static str) -> Self {
        self.skew = Some(skew);
        self
    }

    fn command(&self, port: u16) -> Command {
        let mut command = match self.skew {
            None => Command::new(BINARY),
            Some(offset) => {
                // The real clock moved by `offset`; the monotonic clock is left alone, as a host
                // whose wall clock is wrong still counts seconds at the right rate.
                let mut command = Command::new("faketime");
                command.args(["-m", "--exclude-monotonic", "-f", offset, BINARY]);
                command
            }
        };
        command
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--redis-url", &self.redis_url])
            .args(["--store-timeout-ms", &self.store_timeout_ms.to_string()])
            .args(["--max-ttl-ms", &self.max_ttl_ms.to_string()])
            .args(["--default-ttl-ms", &self.max_ttl_ms.min(30_000).to_string()])
            .args(["--log-level", "warn"])
            // A new Redis per test: no settling time before the first grant (the api tests
            // cover the settling).
            .args(["--store-settle-ms", "0"])
            .stdin(Stdio::null())
            .process_group(0);
        if let Some(delay) = self.store_loss_delay_ms {
            command.args(["--store-loss-delay-ms", &delay.to_string()]);
        }
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("LOCKBROKER_")
                || name.to_string_lossy().starts_with("FAKETIME")
            {
                command.env_remove(name);
            }
        }
        command
    }
}

/// A `lockbroker serve` process.
pub struct BrokerProcess {
    spec: BrokerSpec,
    child: Option<Child>,
    port: u16,
    log: PathBuf,
}

impl BrokerProcess {
    /// Starts a broker on a free port and waits until it serves `/healthz`.
    pub async fn start(spec: BrokerSpec) -> Self {
        for _ in 0..5 {
            let mut broker = Self {
                spec: spec.clone(),
                child: None,
                port: free_port(),
                log: temp_log("safety-broker"),
            };
            if broker.launch().await {
                return broker;
            }
        }
        panic!("the broker did not start on any free port");
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// SIGKILL, to the whole process group, and reap: no shutdown, no cleanup.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let group = Pid::from_raw(i32::try_from(child.id()).expect("a pid fits in i32"));
            let _ = killpg(group, Signal::SIGKILL);
            let _ = child.wait();
        }
    }

    /// Starts the broker again, on the same port, after [`Self::kill`].
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

    /// What the broker wrote so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Spawns the process and waits for `/healthz`; `false` if the port was taken.
    async fn launch(&mut self) -> bool {
        let out = std::fs::File::create(&self.log).expect("cannot create the broker log");
        let err = out.try_clone().expect("cannot clone the log handle");
        let spawned = self.spec.command(self.port).stdout(out).stderr(err).spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.spec.skew.is_some() => {
                panic!(
                    "`faketime` is not installed, and the clock-skew tests run brokers under it. \
                     Run the README's test command, scripts/test.sh, which installs it (on \
                     Debian/Ubuntu: apt-get install faketime)."
                )
            }
            Err(e) => panic!("cannot start the lockbroker binary: {e}"),
        };
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
            let healthz = client.get(format!("{}/healthz", self.url())).send().await;
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
fn parse_http_date(date: &str) -> Option<u64> {
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

#[test]
fn http_dates_are_read_as_unix_seconds() {
    assert_eq!(parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
    assert_eq!(
        parse_http_date("Sat, 21 Nov 2026 23:31:42 GMT"),
        Some(1_795_303_902)
    );
}
