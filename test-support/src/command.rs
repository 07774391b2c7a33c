//! Running a command-line binary of the workspace (`lockbroker`, `lockbroker-bench`) against a
//! broker, and reading how it ended: bounded waits throughout.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::process::{Child, Command};

/// Bound on one command of the binary: the longest a test lets `lockbroker` (or the bench) run (the longest
/// wait a test asks for is 10 s).
pub const COMMAND_LIMIT: Duration = Duration::from_secs(20);

/// `BIN ARGS` (`lockbroker`, `lockbroker-bench`) aimed at `url`, with stdout and stderr
/// captured, killed if dropped. The environment is scrubbed of proxies (the brokers are on
/// loopback) and of a stray token or TLS file.
pub fn command(bin: &str, url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(bin);
    command
        .args(args)
        .env("LOCKBROKER_URL", url)
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

/// Runs `BIN ARGS` against `url` to the end.
pub async fn run(bin: &str, url: &str, args: &[&str]) -> Outcome {
    finish(
        command(bin, url, args)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}")),
    )
    .await
}

/// Waits (bounded) for a started command to end and collects its output.
pub async fn finish(child: Child) -> Outcome {
    let started = Instant::now();
    let output = tokio::time::timeout(COMMAND_LIMIT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("the command did not finish within {COMMAND_LIMIT:?}"))
        .expect("cannot wait for the command");
    Outcome {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}
