//! Running the binary and watching what its commands leave behind: bounded waits throughout.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::process::{Child, Command};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_lockbroker");

/// Bound on one command of the binary: the longest a test lets `lockbroker` run (the longest
/// wait a test asks for is 10 s).
pub const COMMAND_LIMIT: Duration = Duration::from_secs(20);

/// `lockbroker ARGS` aimed at `url`, with stdout and stderr captured, killed if dropped. The
/// environment is scrubbed of proxies (the brokers are on loopback) and of a stray token or TLS
/// file; `LB`
/// names the binary, for commands that `run` starts.
pub fn lockbroker_command(url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env("LOCKBROKER_URL", url)
        .env("LB", BIN)
        .env_remove("LOCKBROKER_TOKEN")
        .env_remove("LOCKBROKER_AUTH_TOKEN")
        .env_remove("LOCKBROKER_CACERT")
        .env_remove("LOCKBROKER_CLIENT_CERT")
        .env_remove("LOCKBROKER_CLIENT_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for proxy in [
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ] {
        command.env_remove(proxy);
    }
    command
}

/// How a command ended.
#[derive(Debug)]
pub struct Outcome {
    /// `None` when it died of a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Outcome {
    /// Asserts the exit code, showing the output when it is not.
    pub fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code,
            Some(code),
            "unexpected exit; stdout:\n{}\nstderr:\n{}",
            self.stdout,
            self.stderr
        );
        self
    }

    /// Asserts the exit code of a failure and that its message (stderr) says each of `says`.
    pub fn expect_failure(&self, code: i32, says: &[&str]) -> &Self {
        self.expect_code(code);
        for words in says {
            assert!(
                self.stderr.contains(words),
                "no {words:?} in: {}",
                self.stderr
            );
        }
        self
    }

    /// Stdout as the one JSON object `--json` prints.
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {:?}", self.stdout))
    }

    /// The value of a `label: value` line of the text output.
    pub fn field(&self, label: &str) -> String {
        let prefix = format!("{label}:");
        self.stdout
            .lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {label:?} line in:\n{}", self.stdout))
            .trim()
            .to_owned()
    }
}

/// Runs `lockbroker ARGS` against `url` to the end.
pub async fn lockbroker(url: &str, args: &[&str]) -> Outcome {
    finish(
        lockbroker_command(url, args)
            .spawn()
            .expect("cannot start lockbroker"),
    )
    .await
}

/// Waits (bounded) for a started command to end and collects its output.
pub async fn finish(child: Child) -> Outcome {
    let started = Instant::now();
    let output = tokio::time::timeout(COMMAND_LIMIT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("lockbroker did not finish within {COMMAND_LIMIT:?}"))
        .expect("cannot wait for lockbroker");
    Outcome {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}

/// Waits until `path` holds at least one whole line (the writer ends it with a newline), and
/// returns its text. Polls, since a file gives no event to await; bounded by `limit`.
pub async fn wait_for_line(path: &Path, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{} did not get a line within {limit:?}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether process `pid` is still there, as `kill -0` sees it: running, or dead but not yet
/// reaped by its parent (a zombie).
pub fn is_there(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether process `pid` runs: it is there and not a zombie.
pub fn is_running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // After the command's name in parentheses: the state.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| !matches!(state, "Z" | "X"))
    })
}

/// Waits until `still` holds for none of `pids` ([`is_there`]: each has died and been reaped;
/// [`is_running`]: each has died), polling `/proc` (a process of no relation to the test gives
/// no event to await); how long that took. Panics if one still is after `limit`.
pub async fn until_none(pids: &[u32], still: fn(u32) -> bool, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| still(p)).collect();
        if left.is_empty() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "{left:?} (of {pids:?}) still there {limit:?} later"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Nanoseconds since the Unix epoch, on the clock that `date +%s%N` in a command reads.
pub fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}
