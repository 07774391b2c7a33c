//! `lockbroker elect` and `lockbroker status --watch`: three candidates on three brokers sharing
//! Redis (and on one broker of the embedded store), each running a command that records its own
//! start and stop; exactly one runs at any instant, a SIGTERMed leader hands over within a
//! second, a SIGKILLed one within its TTL and a second, its command (and what that started)
//! gone within a second of the kill. `status --watch --json` prints each change.

use std::path::Path;
use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app, spawn_app_with};
use lockbroker_test_support::http::until_metric;
use lockbroker_test_support::redis_server::RedisServer;
use lockbroker_test_support::send_signal;
use lockbroker_test_support::temp::TempDir;
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};

use crate::support::{finish, is_there, lockbroker_command, now_ns, until_none};

/// The leaders' lease length.
const TTL: Duration = Duration::from_secs(2);

/// How soon a SIGTERMed leader's successor starts its command.
const HANDOFF: Duration = Duration::from_secs(1);

/// How soon a SIGKILLed leader's command, and what it started, are gone.
const GONE: Duration = Duration::from_secs(1);

/// A candidate's command: starts a child in the background, records `start NAME NS PID CHILD`
/// when it starts and `stop NAME NS` when a SIGTERM (to its process group) stops it, in the
/// shared log; runs until stopped (60 s at most, far beyond a test, so that nothing outlives a
/// failed one for long).
const COMMAND: &str = r#"sleep 60 &
echo "start $NAME $(date +%s%N) $$ $!" >> "$LOG"
trap 'echo "stop $NAME $(date +%s%N)" >> "$LOG"; exit 0' TERM
i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"#;

/// One line of the log: a command started (with its pid and its child's) or stopped.
#[derive(Debug, Clone)]
struct Record {
    started: bool,
    name: String,
    ns: u128,
    pids: Vec<u32>,
}

fn records(log: &Path) -> Vec<Record> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            Record {
                started: fields[0] == "start",
                name: fields[1].to_owned(),
                ns: fields[2].parse().expect("nanoseconds"),
                pids: fields[3..]
                    .iter()
                    .map(|p| p.parse().expect("a pid"))
                    .collect(),
            }
        })
        .collect()
}

/// Waits until the log has `n` start records; the last of them.
async fn until_started(log: &Path, n: usize, limit: Duration) -> Record {
    let deadline = Instant::now() + limit;
    loop {
        let starts: Vec<Record> = records(log).into_iter().filter(|r| r.started).collect();
        if starts.len() >= n {
            assert_eq!(starts.len(), n, "two commands started at once: {starts:?}");
            return starts[n - 1].clone();
        }
        assert!(
            Instant::now() < deadline,
            "no command {n} started within {limit:?}: {:?}",
            records(log)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every command's run, as [start, stop] on the wall clock (a killed one stops when the test
/// killed it), never overlapping.
fn assert_one_at_a_time(log: &Path, killed: &[(String, u128)]) {
    let mut runs: Vec<(String, u128, u128)> = Vec::new();
    let all = records(log);
    for start in all.iter().filter(|r| r.started) {
        let stop = all
            .iter()
            .find(|r| !r.started && r.name == start.name && r.ns >= start.ns)
            .map(|r| r.ns)
            .or_else(|| killed.iter().find(|(n, _)| *n == start.name).map(|k| k.1))
            .unwrap_or(u128::MAX);
        runs.push((start.name.clone(), start.ns, stop));
    }
    runs.sort_by_key(|r| r.1);
    for pair in runs.windows(2) {
        assert!(
            pair[0].2 <= pair[1].1,
            "two leaders at once: {} ran until {} ns, {} started at {} ns",
            pair[0].0,
            pair[0].2,
            pair[1].0,
            pair[1].1
        );
    }
}

/// Three candidates, each on its broker: the first leader is SIGTERMed (its successor starts
/// within `HANDOFF`), the second's `elect` alone is SIGKILLed (its command and the command's
/// child are gone within `GONE`, its successor starts within the TTL and a second); never two
/// at once.
async fn three_candidates(apps: [&TestApp; 3]) {
    let dir = TempDir::new("elect");
    let log = dir.path("runs.log");
    let names = ["a", "b", "c"];
    let mut candidates: Vec<(String, Child)> = names
        .iter()
        .zip(apps)
        .map(|(name, app)| {
            let ttl = format!("{}ms", TTL.as_millis());
            let mut command = lockbroker_command(
                &app.address,
                &[
                    "elect", "leader", "--owner", name, "--ttl", &ttl, "--grace", "5s", "--",
                ],
            );
            command
                .args(["sh", "-c", COMMAND])
                .env("NAME", name)
                .env("LOG", &log);
            (
                name.to_string(),
                command.spawn().expect("cannot start elect"),
            )
        })
        .collect();
    let limit = Duration::from_secs(15);
    let first = until_started(&log, 1, limit).await;

    // SIGTERM: the leader stops its command, then hands over.
    let leader = candidates
        .iter()
        .position(|(n, _)| *n == first.name)
        .unwrap();
    let (_, child) = candidates.remove(leader);
    let sent = Instant::now();
    send_signal(child.id().unwrap(), "-TERM");
    let second = until_started(&log, 2, limit).await;
    let handoff = sent.elapsed();
    println!(
        "SIGTERMed leader {}: {} led after {handoff:?}",
        first.name, second.name
    );
    assert!(
        handoff < HANDOFF,
        "the successor started {handoff:?} after the SIGTERM"
    );
    let outcome = finish(child).await;
    assert_eq!(
        outcome.code,
        Some(0),
        "the stopped command's status: {outcome:?}"
    );

    // SIGKILL to elect alone (the OOM killer, `kill -9`): its command goes with it, and the
    // lease ends by itself.
    let leader = candidates
        .iter()
        .position(|(n, _)| *n == second.name)
        .unwrap();
    let (name, mut child) = candidates.remove(leader);
    assert_eq!(
        second.pids.len(),
        2,
        "the command and its child: {second:?}"
    );
    let sent = Instant::now();
    send_signal(child.id().unwrap(), "-KILL");
    let gone = until_none(&second.pids, is_there, GONE).await;
    let killed_at = now_ns();
    println!("SIGKILLed leader {name}: its command was gone after {gone:?}");
    let _ = child.wait().await;
    let third = until_started(&log, 3, limit).await;
    let failover = sent.elapsed();
    println!(
        "SIGKILLed leader {name}: {} led after {failover:?}",
        third.name
    );
    assert!(
        failover < TTL + Duration::from_secs(1),
        "the successor started {failover:?} after the kill"
    );

    // The last leader waited longer than its TTL before it led: its lease is judged from its
    // grant, not from when it started waiting, so it keeps leading.
    tokio::time::sleep(TTL * 2).await;
    let after = records(&log);
    assert!(
        !after.iter().any(|r| !r.started && r.name == third.name),
        "the leader that waited lost its lead: {after:?}"
    );
    let (_, last) = candidates.remove(0);
    send_signal(last.id().unwrap(), "-TERM");
    finish(last).await;
    assert_one_at_a_time(&log, &[(name, killed_at)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_candidates_on_three_brokers_one_leads_at_a_time_and_hand_over_on_sigterm_and_on_death()
 {
    let redis = RedisServer::start().await;
    let one = spawn_app(Some(redis.url())).await;
    let two = spawn_app(Some(redis.url())).await;
    let three = spawn_app(Some(redis.url())).await;
    three_candidates([&one, &two, &three]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_candidates_on_one_embedded_broker_one_leads_at_a_time() {
    let app = spawn_app(None).await;
    three_candidates([&app, &app, &app]).await;
}

/// `status KEY --watch --json` on the broker at `url`, and a reader of its lines.
fn watch_json(url: &str, key: &str) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut status = lockbroker_command(url, &["status", key, "--watch", "--json"])
        .spawn()
        .expect("cannot start status --watch");
    let lines = BufReader::new(status.stdout.take().unwrap()).lines();
    (status, lines)
}

/// The next line `status --watch --json` prints, within 10 s.
async fn next_json(lines: &mut Lines<BufReader<ChildStdout>>) -> Value {
    serde_json::from_str(&next_line(lines).await).expect("a JSON line")
}

/// The next line `status --watch` prints, within 10 s.
async fn next_line(lines: &mut Lines<BufReader<ChildStdout>>) -> String {
    tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("a line within 10 s")
        .expect("stdout")
        .expect("status --watch runs on")
}

/// `status --watch --json` on one broker sees the changes made through another broker sharing
/// Redis: one line each, in order, with who holds the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_prints_each_change_as_a_json_line() {
    let redis = RedisServer::start().await;
    let watching = spawn_app(Some(redis.url())).await;
    let changing = spawn_app(Some(redis.url())).await;
    let (mut status, mut lines) = watch_json(&watching.address, "followed");
    let mut next = async || next_json(&mut lines).await;
    let now = next().await;
    assert_eq!((&now["held"], &now["fence"]), (&false.into(), &Value::Null));
    let grant = changing.grant("followed", "owner=someone").await;
    let line = next().await;
    assert_eq!(line["held"], true);
    assert_eq!(line["fence"], grant.fence);
    assert_eq!(line["owner"], "someone");
    assert!(line["seen_at_ms"].as_u64().is_some());
    assert!(line.get("token").is_none());
    changing.release("followed", &grant.token).await;
    let line = next().await;
    assert_eq!(
        (&line["held"], &line["fence"]),
        (&false.into(), &Value::Null)
    );
    status.start_kill().unwrap();
}

/// `status --semaphore NAME --watch` in text on a broker whose `max_wait_ms` (2 s) is below the
/// 30 s a watch asks for: the refused waits are halved until one is accepted, and each change
/// is one line (the time, then who holds what).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_prints_a_semaphores_changes_as_lines_within_a_short_max_wait() {
    let app = spawn_app_with(None, |settings| settings.max_wait_ms = Some(2_000)).await;
    let mut status =
        lockbroker_command(&app.address, &["status", "--semaphore", "pool", "--watch"])
            .spawn()
            .expect("cannot start status --watch");
    let mut lines = BufReader::new(status.stdout.take().unwrap()).lines();
    let mut next = async || -> String {
        let line = next_line(&mut lines).await;
        // After the time it was seen.
        let (when, what) = line.split_once("  ").expect("a time, then the change");
        assert!(humantime::parse_rfc3339(when).is_ok(), "{line}");
        what.to_owned()
    };
    assert_eq!(next().await, "pool is free");
    let permit = app
        .send(app.request(Method::POST, "/semaphores/pool?limit=2"))
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    assert_eq!(
        next().await,
        format!("pool: 1 of 2 permits, highest fence {}", permit["fence"])
    );
    // The next change comes after more than one accepted wait has run out unchanged.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    app.send(
        app.request(Method::DELETE, "/semaphores/pool")
            .header("Lock-Token", permit["token"].as_str().unwrap()),
    )
    .await
    .expect_status(StatusCode::NO_CONTENT);
    assert_eq!(next().await, "pool is free");
    status.start_kill().unwrap();
}

/// `status KEY --watch --json` when the lock is handed on to a waiter queued for it (as an
/// `elect` candidate is): the line shows the lease the waiter took, with its own TTL (10 s),
/// not the offer the watch saw when the holder let go, which lasts the offer window (2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_shows_a_handed_on_leases_own_ttl_not_the_offer_window() {
    let app = spawn_app(None).await;
    let first = app.grant("handed", "ttl_ms=10000").await;
    let (mut status, mut lines) = watch_json(&app.address, "handed");
    let now = next_json(&mut lines).await;
    assert_eq!(now["fence"], first.fence);
    let waiter = app.spawn_acquire("handed", "ttl_ms=10000&wait_ms=10000");
    let parking = Duration::from_secs(10);
    until_metric(&app.address, "lockbroker_waiters", 1.0, parking).await;
    app.release_ok("handed", &first.token).await;
    let granted = waiter.await.unwrap().expect_grant(StatusCode::CREATED);
    let line = next_json(&mut lines).await;
    assert_eq!(line["fence"], granted.fence, "{line}");
    let remaining = line["ttl_remaining_ms"].as_u64().expect("a TTL");
    assert!(
        remaining > 5_000,
        "the line shows {remaining} ms left of a 10 s lease: {line}"
    );
    status.start_kill().unwrap();
}

/// `run` (and `elect`, which shares the code) with a wait longer than the TTL: the grant comes
/// after more than a TTL of waiting, and the lease is still held and renewed while the command
/// runs, not judged lost at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_that_waited_longer_than_its_ttl_keeps_its_lease() {
    let app = spawn_app(None).await;
    // Held for 1.5 s, longer than run's TTL; nobody releases it.
    app.grant("slow", "ttl_ms=1500").await;
    let outcome = finish(
        lockbroker_command(
            &app.address,
            &[
                "run",
                "slow",
                "--ttl",
                "1s",
                "--wait",
                "10s",
                "--",
                "sh",
                "-c",
                "sleep 1.5",
            ],
        )
        .spawn()
        .expect("cannot start run"),
    )
    .await;
    assert_eq!(outcome.code, Some(0), "{outcome:?}");
    assert!(
        outcome.elapsed >= Duration::from_millis(2_900),
        "it waited, then ran"
    );
}
