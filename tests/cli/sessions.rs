//! Sessions on the command line: `run --session-ttl` holding its lock on the session's
//! keep-alives and freeing it on exit, a SIGKILLed one's lock taken by the next run within the
//! session's TTL and a second, and `session open|show|renew|close` for scripts.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use lockbroker_test_support::app::spawn_app;
use lockbroker_test_support::send_signal;
use lockbroker_test_support::temp::TempDir;
use reqwest::StatusCode;

use crate::support::{finish, lockbroker, lockbroker_command, now_ns, wait_for_line};

/// Bound on waiting for a command's marker file.
const MARKER_LIMIT: Duration = Duration::from_secs(5);

/// `run` started (not awaited) with `$OUT` set to `scratch`: `run KEY FLAGS -- sh -c SCRIPT`.
fn start_run(
    url: &str,
    scratch: &TempDir,
    key: &str,
    flags: &[&str],
    script: &str,
) -> tokio::process::Child {
    let mut args = vec!["run", key];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    lockbroker_command(url, &args)
        .env("OUT", scratch.dir())
        .spawn()
        .expect("cannot start lockbroker run")
}

/// The command outlives three session TTLs (900 ms each) before it reads the lock's state: the
/// session's keep-alives alone keep it. The lock is free once run has exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_a_session_holds_the_lock_on_its_keep_alives_and_frees_it_on_exit() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("session-run");
    let script = r#"echo "$LOCKBROKER_FENCE" > "$OUT/fence"
sleep 2.8
"$LB" status "$LOCKBROKER_KEY" --json > "$OUT/status""#;
    let outcome = finish(start_run(
        &app.address,
        &scratch,
        "nightly",
        &["--session-ttl", "900ms"],
        script,
    ))
    .await;
    outcome.expect_code(0);
    let fence: u64 = std::fs::read_to_string(scratch.path("fence"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let status: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(scratch.path("status")).unwrap()).unwrap();
    assert_eq!(status["fence"], fence, "held past three TTLs: {status}");
    assert_eq!(status["session"], true, "under a session: {status}");
    app.inspect("nightly")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");

    // --ttl and --session-ttl are two ways to keep the lock: one at a time.
    lockbroker(
        &app.address,
        &[
            "run",
            "nightly",
            "--ttl",
            "1s",
            "--session-ttl",
            "1s",
            "--",
            "true",
        ],
    )
    .await
    .expect_code(2);
}

/// The broker goes away under `run --session-ttl 900ms`: no keep-alive gets through, the
/// session is lost before its end, and with it the lease: the command is stopped and run exits
/// 5, as for a lease of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_session_stops_the_command_as_a_lost_lease_does() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("session-gone");
    let script = r#"trap 'echo term >> "$OUT/term"; exit 0' TERM
echo started > "$OUT/started"
i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done"#;
    let run = start_run(
        &app.address,
        &scratch,
        "orphan",
        &["--session-ttl", "900ms", "--grace", "5s"],
        script,
    );
    wait_for_line(&scratch.path("started"), MARKER_LIMIT).await;
    let gone_at = Instant::now();
    app.shutdown().await;
    wait_for_line(&scratch.path("term"), MARKER_LIMIT).await;
    let stopped_after = gone_at.elapsed();
    let outcome = finish(run).await;
    outcome.expect_failure(
        5,
        &[
            "cannot renew the session",
            "lost the lease on orphan with its session",
        ],
    );
    // Allowance for starting processes and delivering signals on a busy machine.
    assert!(
        stopped_after < Duration::from_millis(900 + 400),
        "SIGTERM came {stopped_after:?} after the broker went away"
    );
}

/// `run --session-ttl 1s` SIGKILLed: its session gets no keep-alive, and a second run waiting
/// for the key starts its command within the session's TTL and a second of the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runs_lock_goes_to_the_next_run_within_the_session_ttl_and_a_second() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("session-killed");
    let mut killed = start_run(
        &app.address,
        &scratch,
        "killed",
        &["--session-ttl", "1s"],
        r#"echo started > "$OUT/first"; sleep 10"#,
    );
    wait_for_line(&scratch.path("first"), MARKER_LIMIT).await;
    let next = start_run(
        &app.address,
        &scratch,
        "killed",
        &["--wait", "10s", "--session-ttl", "1s"],
        r#"date +%s%N > "$OUT/second""#,
    );
    let killed_at = now_ns();
    send_signal(killed.id().expect("run is running"), "-KILL");
    assert_eq!(killed.wait().await.unwrap().signal(), Some(9));
    finish(next).await.expect_code(0);
    let started: u128 = std::fs::read_to_string(scratch.path("second"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let after = Duration::from_nanos(u64::try_from(started - killed_at).unwrap());
    println!("the next run's command started {after:?} after the kill");
    assert!(
        after <= Duration::from_secs(2),
        "the lock went to the next run {after:?} after the kill"
    );
}

/// A script's session: opened (its id alone on stdout), a lease taken under it, shown, kept
/// alive, closed (the lease with it); then every call on it exits 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_open_show_renew_and_close_round_trip() {
    let app = spawn_app(None).await;
    let url = app.address.as_str();
    let opened = lockbroker(
        url,
        &["session", "open", "--ttl", "10s", "--owner", "nightly"],
    )
    .await;
    opened.expect_code(0);
    let id = opened.stdout.trim().to_owned();
    assert!(
        id.len() >= 32 && !id.contains(char::is_whitespace),
        "{id:?}"
    );

    let granted = lockbroker(url, &["acquire", "batch", "--session", &id, "--json"]).await;
    granted.expect_code(0);
    let fence = granted.json()["fence"].as_u64().unwrap();
    lockbroker(url, &["acquire", "other", "--session", &id, "--ttl", "1s"])
        .await
        .expect_code(2);

    let shown = lockbroker(url, &["session", "show", &id, "--json"]).await;
    shown.expect_code(0);
    let view = shown.json();
    assert_eq!(view["owner"], "nightly");
    assert_eq!(view["ttl_ms"], 10_000);
    assert_eq!(view["leases"][0]["key"], "batch");
    assert_eq!(view["leases"][0]["fence"], fence);
    assert!(!shown.stdout.contains(&id), "show never prints the id");
    // The id may come from the environment, out of `ps`.
    let text = finish(
        lockbroker_command(url, &["session", "show"])
            .env("LOCKBROKER_SESSION", &id)
            .spawn()
            .unwrap(),
    )
    .await;
    text.expect_code(0);
    assert_eq!(text.field("owner"), "nightly");
    assert_eq!(text.field("leases"), "1");
    assert!(text.stdout.contains("batch"), "{}", text.stdout);

    let renewed = lockbroker(url, &["session", "renew", &id, "--ttl", "20s", "--json"]).await;
    renewed.expect_code(0);
    assert_eq!(renewed.json()["ttl_ms"], 20_000);
    lockbroker(url, &["session", "renew", &id])
        .await
        .expect_code(0)
        .field("expires");

    lockbroker(url, &["session", "close", &id])
        .await
        .expect_code(0);
    app.inspect("batch")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let ended = lockbroker(url, &["session", "show", &id, "--json"]).await;
    ended.expect_code(4);
    assert_eq!(ended.json()["error"], "not_held");
    lockbroker(url, &["session", "renew", &id])
        .await
        .expect_failure(4, &["the session has ended"]);
    lockbroker(url, &["session", "close", &id])
        .await
        .expect_code(4);
    let refused = lockbroker(url, &["acquire", "batch", "--session", &id, "--json"]).await;
    refused.expect_code(4);
    assert_eq!(refused.json()["error"], "no_session");
    assert!(!refused.stderr.contains(&id), "{}", refused.stderr);

    let as_json = lockbroker(url, &["session", "open", "--json", "--lock-delay", "2s"]).await;
    as_json.expect_code(0);
    let body = as_json.json();
    assert_eq!(body["lock_delay_ms"], 2000);
    let other = body["session"].as_str().unwrap();
    lockbroker(url, &["session", "close", other, "--json"])
        .await
        .expect_code(0);
}

/// `elect --session-ttl`: the leader's lease is under its session for the whole term (here
/// three of the session's TTLs), and free once the command has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elect_with_a_session_leads_on_its_keep_alives_and_hands_over_on_exit() {
    let app = spawn_app(None).await;
    let scratch = TempDir::new("session-elect");
    let script = r#"sleep 2.8; "$LB" status "$LOCKBROKER_KEY" --json > "$OUT/status""#;
    let args = [
        "elect",
        "leader",
        "--owner",
        "node-a",
        "--session-ttl",
        "900ms",
        "--",
        "sh",
        "-c",
        script,
    ];
    let outcome = finish(
        lockbroker_command(&app.address, &args)
            .env("OUT", scratch.dir())
            .spawn()
            .unwrap(),
    )
    .await;
    outcome.expect_code(0);
    let status: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(scratch.path("status")).unwrap()).unwrap();
    assert_eq!(status["owner"], "node-a", "{status}");
    assert_eq!(status["session"], true, "{status}");
    app.inspect("leader")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}
