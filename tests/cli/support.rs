//! Running the binary and watching what its commands leave behind: bounded waits throughout.
//! Starting a command and reading its outcome is test-support's (`command`), shared with the
//! bench's suite.

use std::path::Path;
use std::time::{Duration, Instant};

pub(crate) use lockbroker_test_support::command::{Outcome, finish};
use lockbroker_test_support::command::{command, run};
use tokio::process::Command;

/// The binary under test.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_lockbroker");

/// `lockbroker ARGS` aimed at `url` ([`command`]); `LB` names the binary, for commands that
/// `run` starts.
pub(crate) fn lockbroker_command(url: &str, args: &[&str]) -> Command {
    let mut command = command(BIN, url, args);
    command.env("LB", BIN);
    command
}

/// Runs `lockbroker ARGS` against `url` to the end.
pub(crate) async fn lockbroker(url: &str, args: &[&str]) -> Outcome {
    run(BIN, url, args).await
}

/// Waits until `path` holds at least one whole line (the writer ends it with a newline), and
/// returns its text. Polls, since a file gives no event to await; bounded by `limit`.
pub(crate) async fn wait_for_line(path: &Path, limit: Duration) -> String {
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
pub(crate) fn is_there(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether process `pid` runs: it is there and not a zombie.
pub(crate) fn is_running(pid: u32) -> bool {
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
pub(crate) async fn until_none(pids: &[u32], still: fn(u32) -> bool, limit: Duration) -> Duration {
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
pub(crate) fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}
