//! Fixtures shared by lockbroker's test suites (`tests/api`, `tests/cli`, `tests/client`,
//! `tests/safety`, `tests/topologies`). Each fixture starts what a test needs on free loopback
//! ports and tears it down when dropped, so every test owns its servers and nothing has to be
//! running beforehand.
//!
//! - [`redis_server`]: a throwaway `redis-server` per test.
//! - [`app`]: a broker run in the test process on port 0 ([`app::spawn_app`]), and the
//!   `on_both_stores!` macro that runs one contract on the embedded store and on Redis.
//! - [`broker`]: the real `lockbroker serve` as a child process, for start-up, signals,
//!   SIGKILL and a host clock shifted with `faketime`.
//! - [`command`]: a command-line binary (`lockbroker`'s client commands, `lockbroker-bench`)
//!   run against a broker with a scrubbed environment, bounded, and how it ended.
//! - [`certs`]: a CA, server and client certificates made in the test, for the broker's HTTPS.
//! - [`cluster`]: a real Redis Cluster of masters and replicas (`redis-cli --cluster create`)
//!   that tests flush and fail over.
//! - [`http`]: the test HTTP client and readers of the API's answers.
//! - [`sentinel`]: a Redis Sentinel deployment (a master, two replicas, three sentinels) that
//!   tests fail over.
//! - [`temp`]: unique files and directories in the temp directory.
//! - [`tls`]: certificates made for the test, and a TLS-only `redis-server`.
//!
//! Unix only, as the suites are: the fixtures signal processes and put brokers in process
//! groups. Each new kind of server (a Redis Cluster, Sentinels, TLS) gets a sibling module.
#![forbid(unsafe_code)]

pub mod app;
pub mod broker;
pub mod certs;
pub mod cluster;
pub mod command;
pub mod http;
pub mod redis_server;
pub mod sentinel;
pub mod temp;
pub mod tls;

/// The Redis client the fixtures use, for tests that talk to a `redis-server` directly: the
/// broker's package does not depend on `redis`, so its tests reach it through here.
pub use redis;

use std::net::TcpListener;
use std::process::Command;
use std::sync::Once;
use std::time::{SystemTime, UNIX_EPOCH};

use lockbroker::config::LogFormat;

/// Test logs are for debugging a failure: printed only when asked for with `TEST_LOG=1`.
pub fn init_test_log() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            lockbroker::init_logging(LogFormat::Text, "info,lockbroker=debug");
        }
    });
}

/// A loopback port that was free a moment ago. Whoever binds it next may lose a race with
/// another process; callers that start servers on it retry with another port.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("cannot bind a loopback port")
        .port()
}

/// Unix epoch milliseconds on this host (the clock Redis reads too: it runs here).
pub fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is past 1970");
    u64::try_from(since.as_millis()).expect("milliseconds fit in u64")
}

/// One `[[tokens]]` entry of an auth file: `secret` is its `token = "…"` or `token_sha256 =
/// "…"` line (arrays and names as TOML writes them, which is how `Debug` writes plain ones).
pub fn auth_entry(name: &str, secret: &str, prefixes: &[&str], permissions: &[&str]) -> String {
    format!(
        "[[tokens]]\nname = {name:?}\n{secret}\nprefixes = {prefixes:?}\npermissions = {permissions:?}\n\n"
    )
}

/// Sends `signal` (such as `-TERM`) to a process with the system's `kill`.
pub fn send_signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(signal)
        .arg(pid.to_string())
        .status()
        .expect("cannot run kill");
    assert!(status.success(), "kill {signal} {pid} failed: {status}");
}
