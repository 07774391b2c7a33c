//! `lockbroker run`: the command's environment and exit status, mutual exclusion between runs,
//! a lease lost under a running command, and signals.
//!
//! The commands are `sh -c` scripts that write what they see into a scratch directory (`$OUT`)
//! and loop for a bounded time (10 s at most) so that nothing outlives a failed test for long.

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use lockbroker_test_support::app::spawn_app;
use lockbroker_test_support::redis;
use lockbroker_test_support::redis_server::RedisServer;
use lockbroker_test_support::send_signal;
use lockbroker_test_support::temp::TempDir;
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, copy_bidirectional};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::support::{
    finish, is_running, is_there, lockbroker, lockbroker_command, until_none, wait_for_line,
};

/// The TTL of the lost-lease tests: `run` renews every third of it, 300 ms.
const SHORT_TTL: &str = "900ms";
const RENEW_EVERY: Duration = Duration::from_millis(300);

/// Allowance over the promised bound for starting processes and delivering signals on a busy
/// two-core machine.
const SLACK: Duration = Duration::from_millis(400);

/// Bound on waiting for a command's marker file.
const MARKER_LIMIT: Duration = Duration::from_secs(5);

/// Loops for at most 10 s; the trap makes SIGTERM leave a mark and exit 0.
const STOPPABLE: &str = r#"trap 'echo term >> "$OUT/term"; exit 0' TERM
echo "$LOCKBROKER_TOKEN" > "$OUT/token"
i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done"#;

fn run_args<'a>(key: &'a str, flags: &[&'a str], script: &'a str) -> Vec<&'a str> {
    let mut args = vec!["run", key];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    args
}

/// `lockbroker run` started (not awaited), with `$OUT` set to `scratch`.
fn start_run(url: &str, scratch: &TempDir, args: &[&str]) -> tokio::process::Child {
    lockbroker_command(url, args)
        .env("OUT", scratch.dir())
        .spawn()
        .expect("cannot start lockbroker run")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_sees_its_key_fence_and_token_and_the_lock_is_released_after() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("env");
    let script = r#"printf '%s %s %s %s\n' "$LOCKBROKER_KEY" "$LOCKBROKER_FENCE" "$LOCKBROKER_TOKEN" "$LOCKBROKER_URL" > "$OUT/env"
"$LB" status "$LOCKBROKER_KEY" --json > "$OUT/status""#;
    let outcome = finish(start_run(
        &app.address,
        &scratch,
        &run_args("reports:daily", &[], script),
    ))
    .await;
    outcome.expect_code(0);

    let env = std::fs::read_to_string(scratch.path("env")).unwrap();
    let fields: Vec<&str> = env.split_whitespace().collect();
    let [key, fence, token, url] = fields[..] else {
        panic!("the command's environment lacks a value: {env:?}");
    };
    assert_eq!(key, "reports:daily");
    let fence: u64 = fence.parse().expect("a numeric fence");
    assert_eq!(token.len(), 48, "a real token: {token}");
    assert_eq!(url, app.address);

    // While the command ran, the lock was held with that fence, under run's default owner.
    let status: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(scratch.path("status")).unwrap()).unwrap();
    assert_eq!(status["fence"], fence);
    assert!(
        status["owner"].as_str().unwrap().contains(" pid "),
        "{status}"
    );

    // Released when it exited; the next grant is fenced above it.
    app.inspect("reports:daily")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    assert!(app.grant("reports:daily", "").await.fence > fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_exits_with_the_commands_status() {
    let app = spawn_app(None).await;
    for (command, code) in [
        (&["sh", "-c", "exit 7"][..], 7),
        (&["true"], 0),
        (&["sh", "-c", "kill -TERM $$"], 128 + 15),
        (&["lockbroker-test-no-such-command"], 127),
        (&["/"], 126),
    ] {
        let mut args = vec!["run", "status-codes", "--"];
        args.extend_from_slice(command);
        let outcome = lockbroker(&app.address, &args).await;
        assert_eq!(
            outcome.code,
            Some(code),
            "{command:?}: stderr {}",
            outcome.stderr
        );
        // Whatever the command did, the lock is free again.
        app.inspect("status-codes")
            .await
            .expect_error(StatusCode::NOT_FOUND, "not_held");
    }
    // No command at all is a usage error.
    lockbroker(&app.address, &["run", "status-codes"])
        .await
        .expect_code(2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_of_the_same_key_never_overlap() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("overlap");
    let script = r#"echo "start $ID $(date +%s%N)" >> "$OUT/log"
sleep 0.2
echo "end $ID $(date +%s%N)" >> "$OUT/log""#;
    let runs: Vec<_> = (0..3)
        .map(|id| {
            lockbroker_command(
                &app.address,
                &run_args("nightly", &["--wait", "10s", "--ttl", "5s"], script),
            )
            .env("OUT", scratch.dir())
            .env("ID", id.to_string())
            .spawn()
            .expect("cannot start lockbroker run")
        })
        .collect();
    for run in runs {
        finish(run).await.expect_code(0);
    }

    let log = std::fs::read_to_string(scratch.path("log")).unwrap();
    let lines: Vec<(String, String, u128)> = log
        .lines()
        .map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            (f[0].to_owned(), f[1].to_owned(), f[2].parse().unwrap())
        })
        .collect();
    assert_eq!(lines.len(), 6, "three starts and three ends:\n{log}");
    for pair in lines.chunks(2) {
        assert_eq!(pair[0].0, "start", "interleaved:\n{log}");
        assert_eq!(pair[1].0, "end", "interleaved:\n{log}");
        assert_eq!(pair[0].1, pair[1].1, "interleaved:\n{log}");
    }
    assert!(
        lines.windows(2).all(|w| w[0].2 <= w[1].2),
        "times go back:\n{log}"
    );
    let mut ids: Vec<&str> = lines.iter().map(|l| l.1.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids, ["0", "1", "2"], "every run ran once:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_0_a_lock_held_elsewhere_exits_3_at_once_without_running_the_command() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("skip");
    app.grant("cron:hourly", "ttl_ms=30000").await;
    let script = r#"touch "$OUT/ran""#;

    let skipped = finish(start_run(
        &app.address,
        &scratch,
        &run_args("cron:hourly", &["--wait", "0"], script),
    ))
    .await;
    skipped.expect_code(3);
    assert!(
        skipped.elapsed < Duration::from_secs(2),
        "took {:?}",
        skipped.elapsed
    );
    assert!(
        skipped.stderr.contains("held by someone else"),
        "{}",
        skipped.stderr
    );

    let quiet = finish(start_run(
        &app.address,
        &scratch,
        &run_args("cron:hourly", &["--wait", "0s", "--quiet"], script),
    ))
    .await;
    quiet.expect_code(3);
    assert_eq!(quiet.stderr, "", "--quiet says nothing when skipping");
    assert!(!scratch.path("ran").exists(), "the command must not run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_released_under_the_command_stops_it_within_one_renewal_interval() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("released");
    let run = start_run(
        &app.address,
        &scratch,
        &run_args("lost", &["--ttl", SHORT_TTL, "--grace", "5s"], STOPPABLE),
    );
    let token = wait_for_line(&scratch.path("token"), MARKER_LIMIT).await;

    let lost_at = Instant::now();
    app.release_ok("lost", token.trim()).await;
    wait_for_line(&scratch.path("term"), MARKER_LIMIT).await;
    let stopped_after = lost_at.elapsed();

    let outcome = finish(run).await;
    outcome.expect_failure(5, &["lost the lease on lost"]);
    assert!(
        stopped_after < RENEW_EVERY + SLACK,
        "SIGTERM came {stopped_after:?} after the lease was lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_deleted_from_redis_stops_the_command_within_one_renewal_interval() {
    let redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let scratch = TempDir::new("deleted");
    let run = start_run(
        &app.address,
        &scratch,
        &run_args("deleted", &["--ttl", SHORT_TTL, "--grace", "5s"], STOPPABLE),
    );
    wait_for_line(&scratch.path("token"), MARKER_LIMIT).await;

    // Someone deletes the lock's key by hand: the lease is really gone (the store did not lose
    // its data, so nothing puts it back).
    let mut conn = redis.connection().await;
    let lost_at = Instant::now();
    redis::cmd("DEL")
        .arg("lockbroker:{deleted}:lock")
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
    wait_for_line(&scratch.path("term"), MARKER_LIMIT).await;
    let stopped_after = lost_at.elapsed();

    finish(run).await.expect_code(5);
    assert!(
        stopped_after < RENEW_EVERY + SLACK,
        "SIGTERM came {stopped_after:?} after the lease was deleted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_keeps_the_command_running_because_its_lease_is_put_back() {
    let mut redis = RedisServer::start().await;
    let app = spawn_app(Some(redis.url())).await;
    let scratch = TempDir::new("restart");
    // Works for 3 s, then exits 0 by itself; SIGTERM would leave a mark.
    let script = r#"trap 'echo term >> "$OUT/term"; exit 0' TERM
echo "$LOCKBROKER_FENCE" > "$OUT/token"
i=0; while [ $i -lt 60 ]; do sleep 0.05; i=$((i+1)); done
echo done > "$OUT/done""#;
    let run = start_run(
        &app.address,
        &scratch,
        &run_args("nightly", &["--ttl", "2s", "--grace", "5s"], script),
    );
    let fence = wait_for_line(&scratch.path("token"), MARKER_LIMIT).await;
    // Redis restarts empty under the running command.
    redis.restart().await;
    let outcome = finish(run).await;
    outcome.expect_code(0);
    assert!(scratch.path("done").exists(), "the command did not finish");
    assert!(
        !scratch.path("term").exists(),
        "the command was stopped: {}",
        outcome.stderr
    );
    // It held the lock all along, and released it when done.
    app.inspect("nightly")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    assert!(!fence.trim().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_gone_until_the_lease_ends_stops_the_command() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("gone");
    let run = start_run(
        &app.address,
        &scratch,
        &run_args("orphan", &["--ttl", SHORT_TTL, "--grace", "5s"], STOPPABLE),
    );
    wait_for_line(&scratch.path("token"), MARKER_LIMIT).await;

    let gone_at = Instant::now();
    app.shutdown().await;
    wait_for_line(&scratch.path("term"), MARKER_LIMIT).await;
    let stopped_after = gone_at.elapsed();

    let outcome = finish(run).await;
    outcome.expect_code(5);
    assert!(
        outcome.stderr.contains("cannot renew")
            && outcome.stderr.contains("no renewal got through"),
        "{}",
        outcome.stderr
    );
    // The last renewal that got through was sent before the broker went away, so the lease
    // (900 ms) ended within 900 ms of that; not before the last renewal interval had passed.
    assert!(
        stopped_after < Duration::from_millis(900) + SLACK,
        "SIGTERM came {stopped_after:?} after the broker went away"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("stubborn");
    let script = r#"trap '' TERM
echo "$LOCKBROKER_TOKEN" > "$OUT/token"
i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done"#;
    let run = start_run(
        &app.address,
        &scratch,
        &run_args(
            "stubborn",
            &["--ttl", SHORT_TTL, "--grace", "300ms"],
            script,
        ),
    );
    let token = wait_for_line(&scratch.path("token"), MARKER_LIMIT).await;
    let lost_at = Instant::now();
    app.release("stubborn", token.trim()).await;

    let outcome = finish(run).await;
    let ended_after = lost_at.elapsed();
    outcome.expect_code(5);
    assert!(outcome.stderr.contains("SIGKILL"), "{}", outcome.stderr);
    assert!(
        ended_after >= Duration::from_millis(300),
        "killed before the grace period was over: {ended_after:?}"
    );
    assert!(
        ended_after < RENEW_EVERY + Duration::from_millis(300) + SLACK,
        "killed {ended_after:?} after the lease was lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_sent_to_run_reach_the_command_and_the_lock_is_released() {
    let app = spawn_app(None).await;
    for signal in ["TERM", "INT", "HUP"] {
        let scratch = TempDir::new("signal");
        let script = format!(
            r#"trap 'echo {signal} > "$OUT/got"; exit 42' {signal}
echo ready > "$OUT/ready"
i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done"#
        );
        let run = start_run(&app.address, &scratch, &run_args("signals", &[], &script));
        let pid = run.id().expect("run is running");
        wait_for_line(&scratch.path("ready"), MARKER_LIMIT).await;

        send_signal(pid, &format!("-{signal}"));
        let outcome = finish(run).await;
        outcome.expect_code(42);
        let got = std::fs::read_to_string(scratch.path("got")).unwrap();
        assert_eq!(got.trim(), signal);
        app.inspect("signals")
            .await
            .expect_error(StatusCode::NOT_FOUND, "not_held");
    }
}

/// `run` SIGKILLed alone, not its group (as the OOM killer or `kill -9` does): its command, a
/// shell, and the child it started in the background are gone (dead and reaped) within a
/// second. A second `run` waiting for the key gets it when the dead run's lease ends, and its
/// command starts after the first one's processes are all gone (it asks `kill -0` as it
/// starts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_killed_with_sigkill_takes_its_command_and_its_children_down_at_once() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("killed");
    let first = r#"sleep 10 & echo "$$ $!" > "$OUT/first"; wait"#;
    let mut killed = start_run(
        &app.address,
        &scratch,
        &run_args("killed", &["--ttl", "1s"], first),
    );
    let pids: Vec<u32> = wait_for_line(&scratch.path("first"), MARKER_LIMIT)
        .await
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert_eq!(pids.len(), 2, "the shell and its child: {pids:?}");
    assert!(pids.iter().all(|&p| is_there(p)), "{pids:?} run");

    // The next run waits for the lock, and as its command starts lists those still running.
    let second = r#"there=""
for p in $FIRST; do kill -0 "$p" 2>/dev/null && there="$there $p"; done
echo "started;$there" > "$OUT/second""#;
    let next = lockbroker_command(
        &app.address,
        &run_args("killed", &["--wait", "10s", "--ttl", "1s"], second),
    )
    .env("OUT", scratch.dir())
    .env("FIRST", format!("{} {}", pids[0], pids[1]))
    .spawn()
    .expect("cannot start lockbroker run");

    send_signal(killed.id().expect("run is running"), "-KILL");
    let gone = until_none(&pids, is_there, Duration::from_secs(1)).await;
    println!("the command and its child were gone {gone:?} after run was SIGKILLed");
    let status = killed.wait().await.unwrap();
    assert_eq!(status.signal(), Some(9), "{status}");

    finish(next).await.expect_code(0);
    let seen = std::fs::read_to_string(scratch.path("second")).unwrap();
    assert_eq!(
        seen.trim(),
        "started;",
        "the second run's command started while the first's ran"
    );
}

/// The process between `run` and its command (`lockbroker __supervise`) SIGKILLed: the
/// command's first process dies with it, `run` sends SIGKILL to the rest of the group, exits
/// 137 as for a command killed so, and releases the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_helper_takes_the_command_down_and_run_reports_sigkill() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("helper");
    let script = r#"sleep 10 & echo "$$ $!" > "$OUT/pids"; wait"#;
    let run = start_run(&app.address, &scratch, &run_args("helper", &[], script));
    let pids: Vec<u32> = wait_for_line(&scratch.path("pids"), MARKER_LIMIT)
        .await
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pids[0])).unwrap();
    let helper: u32 = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
        .and_then(|ppid| ppid.parse().ok())
        .expect("the command's parent");
    assert_ne!(helper, run.id().unwrap(), "a process stands between them");

    send_signal(helper, "-KILL");
    // Dead: with their parents gone, init reaps them when it gets round to it.
    until_none(&pids, is_running, Duration::from_secs(1)).await;
    finish(run)
        .await
        .expect_failure(137, &["sending SIGKILL to the command"]);
    app.inspect("helper")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_answer_was_lost_is_asked_again_and_gets_the_same_grant() {
    let app = spawn_app(None).await;
    let mut proxy = LossyProxy::start(&app.address).await;
    let scratch = TempDir::new("lost-answer");
    let script = r#"echo "$LOCKBROKER_FENCE $LOCKBROKER_TOKEN" > "$OUT/env""#;
    let outcome = finish(start_run(
        &proxy.url,
        &scratch,
        &run_args("retried", &["--ttl", "5s"], script),
    ))
    .await;
    outcome.expect_failure(0, &["trying once more"]);

    let swallowed = tokio::time::timeout(MARKER_LIMIT, &mut proxy.swallowed)
        .await
        .expect("the proxy saw the first acquire")
        .expect("the proxy reports what it swallowed");
    let body = swallowed
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .expect("an HTTP answer");
    assert!(swallowed.starts_with("HTTP/1.1 201"), "{swallowed}");
    let first: serde_json::Value = serde_json::from_str(body).unwrap();
    let env = std::fs::read_to_string(scratch.path("env")).unwrap();
    assert_eq!(
        env.trim(),
        format!("{} {}", first["fence"], first["token"].as_str().unwrap()),
        "the retry returned the grant whose answer was lost, not a second lease"
    );
    app.inspect("retried")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

/// A proxy in front of a broker that forwards the first request but swallows its answer,
/// closing the client's connection as a network failure would, then forwards the rest.
struct LossyProxy {
    url: String,
    /// The first answer, as the broker sent it.
    swallowed: oneshot::Receiver<String>,
    task: tokio::task::JoinHandle<()>,
}

impl LossyProxy {
    async fn start(broker: &str) -> Self {
        let upstream: SocketAddr = broker
            .trim_start_matches("http://")
            .parse()
            .expect("the broker's address");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (report, swallowed) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut report = Some(report);
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(upstream)
                    .await
                    .expect("the broker is up");
                match report.take() {
                    Some(report) => {
                        let _ = report.send(swallow(client, server).await);
                    }
                    None => {
                        tokio::spawn(async move {
                            let (mut client, mut server) = (client, server);
                            let _ = copy_bidirectional(&mut client, &mut server).await;
                        });
                    }
                }
            }
        });
        Self {
            url,
            swallowed,
            task,
        }
    }
}

impl Drop for LossyProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Forwards the request, reads the whole answer, and closes the client's connection without it.
async fn swallow(client: TcpStream, server: TcpStream) -> String {
    let (mut client_read, client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let forward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    });
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !is_complete(&answer) {
        let n = server_read
            .read(&mut buf)
            .await
            .expect("the broker answers");
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    forward.abort();
    drop(client_write);
    String::from_utf8_lossy(&answer).into_owned()
}

/// Whether `answer` holds an HTTP response's head and its whole `content-length` body.
fn is_complete(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())
                .flatten()
        })
        .unwrap_or(0);
    body.len() >= length
}
