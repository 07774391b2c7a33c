//! Shared leases, semaphores, listing and force release from the command line: `run --shared`
//! and `run --semaphore` under real concurrency, `acquire`, `renew`, `status` and `release` of
//! each kind (on both stores), `list` across pages, and `release --force` refused and allowed.
//!
//! The `run` commands are `sh -c` scripts that leave marker files in a scratch directory (`$OUT`)
//! and wait (10 s at most) for a `go` file the test creates: the test synchronises on those
//! files and on the broker's waiter count, never on sleeps.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lockbroker_test_support::app::{Backend, spawn_app};
use lockbroker_test_support::broker::{BrokerCommand, BrokerProcess, listen_on};
use lockbroker_test_support::http::until_metric;
use lockbroker_test_support::on_both_stores;
use lockbroker_test_support::temp::TempDir;
use reqwest::StatusCode;
use serde_json::Value;

use crate::support::{BIN, Outcome, finish, lockbroker, lockbroker_command, wait_for_line};

/// Bound on waiting for a command's marker file or the broker's waiter count.
const MARKER_LIMIT: Duration = Duration::from_secs(5);

/// `wait_for FILE`: waits up to 10 s for FILE to exist.
const WAIT_FOR: &str = r#"wait_for() { i=0; while [ ! -e "$1" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; }"#;

/// `lockbroker run FLAGS -- sh -c SCRIPT` started (not awaited), with `$OUT` set to `scratch`
/// and `$ID` to `id`.
fn start_run(
    url: &str,
    scratch: &TempDir,
    id: usize,
    flags: &[&str],
    script: &str,
) -> tokio::process::Child {
    let script = format!("{WAIT_FOR}\n{script}");
    let mut args = vec!["run"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", &script]);
    lockbroker_command(url, &args)
        .env("OUT", scratch.dir())
        .env("ID", id.to_string())
        .spawn()
        .expect("cannot start lockbroker run")
}

/// Stdout as JSON lines, one object each.
fn json_lines(outcome: &Outcome) -> Vec<Value> {
    outcome
        .stdout
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shared_runs_hold_the_lock_at_once_and_an_exclusive_run_waits_for_both() {
    let app = spawn_app(None).await;
    let url = &app.address;
    let scratch = TempDir::new("shared-runs");
    // Each shared run marks itself inside, then waits to see the other inside too: both hold
    // the lock at the same time, or neither ever sees the other.
    let shared = r#"echo "$LOCKBROKER_MODE" > "$OUT/mode-$ID"
touch "$OUT/inside-$ID"
other=$((1 - ID))
wait_for "$OUT/inside-$other"
[ -e "$OUT/inside-$other" ] && echo yes > "$OUT/saw-$ID"
wait_for "$OUT/go"
rm "$OUT/inside-$ID""#;
    let flags = ["--shared", "reports", "--wait", "10s", "--ttl", "5s"];
    let runs: Vec<_> = (0..2)
        .map(|id| start_run(url, &scratch, id, &flags, shared))
        .collect();
    for id in 0..2 {
        wait_for_line(&scratch.path(&format!("saw-{id}")), MARKER_LIMIT).await;
        let mode = std::fs::read_to_string(scratch.path(&format!("mode-{id}"))).unwrap();
        assert_eq!(mode.trim(), "shared");
    }

    // status shows the lock shared, with both holders.
    let status = lockbroker(url, &["status", "reports", "--json"]).await;
    status.expect_code(0);
    let body = status.json();
    assert_eq!(body["mode"], "shared", "{body}");
    assert_eq!(body["holders"].as_array().map(Vec::len), Some(2), "{body}");
    let text = lockbroker(url, &["status", "reports"]).await;
    text.expect_code(0);
    assert_eq!(text.field("mode"), "shared");
    assert_eq!(text.field("holders"), "2");

    // An exclusive run must wait: with --wait 0s it gives up at once without running...
    let skipped = finish(start_run(
        url,
        &scratch,
        9,
        &["reports", "--wait", "0s"],
        r#"touch "$OUT/ran-anyway""#,
    ))
    .await;
    skipped.expect_code(3);
    assert!(!scratch.path("ran-anyway").exists());
    // ...and with a wait it runs once both shared runs are done, never while one is inside.
    let exclusive = start_run(
        url,
        &scratch,
        2,
        &["reports", "--wait", "10s", "--ttl", "5s"],
        r#"ls "$OUT"/inside-* > /dev/null 2>&1 && echo overlap > "$OUT/overlap"
echo ran > "$OUT/exclusive""#,
    );
    until_metric(url, "lockbroker_waiters", 1.0, MARKER_LIMIT).await;
    assert!(
        !scratch.path("exclusive").exists(),
        "the exclusive run did not wait"
    );
    std::fs::write(scratch.path("go"), "go\n").unwrap();
    for run in runs {
        finish(run).await.expect_code(0);
    }
    finish(exclusive).await.expect_code(0);
    wait_for_line(&scratch.path("exclusive"), MARKER_LIMIT).await;
    assert!(
        !scratch.path("overlap").exists(),
        "the exclusive run overlapped a shared one"
    );
    lockbroker(url, &["status", "reports"]).await.expect_code(4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_of_2_runs_at_most_2_of_3_commands_at_once() {
    let app = spawn_app(None).await;
    let url = &app.address;
    let scratch = TempDir::new("semaphore-runs");
    // Each run counts the runs inside (itself included) as it enters, and stays until `go`.
    let script = r#"touch "$OUT/inside-$ID"
ls "$OUT" | grep -c '^inside-' >> "$OUT/counts"
echo "$LOCKBROKER_KEY $LOCKBROKER_MODE" > "$OUT/env-$ID"
echo in > "$OUT/entered-$ID"
wait_for "$OUT/go"
rm "$OUT/inside-$ID""#;
    let flags = [
        "--semaphore",
        "nightly",
        "--limit",
        "2",
        "--wait",
        "10s",
        "--ttl",
        "5s",
    ];
    let runs: Vec<_> = (0..3)
        .map(|id| start_run(url, &scratch, id, &flags, script))
        .collect();

    // Two get a permit and wait for `go`; the third waits for a permit.
    until_metric(url, "lockbroker_waiters", 1.0, MARKER_LIMIT).await;
    let entered = || {
        (0..3)
            .filter(|id| scratch.path(&format!("entered-{id}")).exists())
            .count()
    };
    let deadline = Instant::now() + MARKER_LIMIT;
    while entered() < 2 {
        assert!(Instant::now() < deadline, "two runs did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(entered(), 2, "a third run started while two held permits");

    let status = lockbroker(url, &["status", "--semaphore", "nightly"]).await;
    status.expect_code(0);
    assert_eq!(status.field("semaphore"), "nightly");
    assert_eq!(status.field("limit"), "2");
    assert_eq!(status.field("holders"), "2");
    // Another limit while these hold theirs: refused, exit 1, with the limit in use.
    let mismatch = lockbroker(
        url,
        &[
            "acquire",
            "--semaphore",
            "nightly",
            "--limit",
            "3",
            "--json",
        ],
    )
    .await;
    mismatch.expect_code(1);
    assert_eq!(mismatch.json()["error"], "limit_mismatch");
    assert!(
        mismatch.stderr.contains("same --limit"),
        "{}",
        mismatch.stderr
    );
    // A semaphore and a lock of the same name are unrelated.
    lockbroker(url, &["status", "nightly"]).await.expect_code(4);

    std::fs::write(scratch.path("go"), "go\n").unwrap();
    for run in runs {
        finish(run).await.expect_code(0);
    }
    let counts = std::fs::read_to_string(scratch.path("counts")).unwrap();
    let counts: Vec<u32> = counts.lines().map(|c| c.trim().parse().unwrap()).collect();
    assert_eq!(counts.len(), 3, "every run ran once: {counts:?}");
    assert_eq!(
        counts.iter().max(),
        Some(&2),
        "two at once, never three: {counts:?}"
    );
    let env = std::fs::read_to_string(scratch.path("env-0")).unwrap();
    assert_eq!(env.trim(), "nightly semaphore");
    lockbroker(url, &["status", "--semaphore", "nightly"])
        .await
        .expect_code(4);
}

/// acquire, status, renew and release of shared leases and of permits, on one store.
async fn every_command_handles_shared_leases_and_permits(backend: &Backend) {
    let url = &backend.app.address;

    let first = lockbroker(
        url,
        &["acquire", "--shared", "cfg", "--owner", "a", "--json"],
    )
    .await;
    first.expect_code(0);
    let first = first.json();
    let second = lockbroker(url, &["acquire", "cfg", "--shared", "--owner", "b"]).await;
    second.expect_code(0);
    assert_eq!(second.field("mode"), "shared");
    let second_token = second.field("token");
    assert!(second.field("fence").parse::<u64>().unwrap() > first["fence"].as_u64().unwrap());
    // No exclusive lease while shared ones are held.
    lockbroker(url, &["acquire", "cfg"]).await.expect_code(3);

    let status = lockbroker(url, &["status", "cfg", "--json"]).await;
    status.expect_code(0);
    let body = status.json();
    assert_eq!(body["mode"], "shared");
    let owners: BTreeSet<&str> = body["holders"]
        .as_array()
        .expect("holders")
        .iter()
        .map(|h| h["owner"].as_str().unwrap())
        .collect();
    assert_eq!(owners, BTreeSet::from(["a", "b"]));
    assert!(!status.stdout.contains(&second_token), "never a token");

    let first_token = first["token"].as_str().unwrap();
    let renewed = lockbroker(
        url,
        &[
            "renew",
            "cfg",
            "--token",
            first_token,
            "--ttl",
            "1m",
            "--json",
        ],
    )
    .await;
    renewed.expect_code(0);
    assert_eq!(renewed.json()["ttl_ms"], 60_000);
    assert_eq!(renewed.json()["fence"], first["fence"]);
    for token in [first_token, second_token.as_str()] {
        lockbroker(url, &["release", "cfg", "--token", token])
            .await
            .expect_code(0);
    }
    lockbroker(url, &["status", "cfg"]).await.expect_code(4);

    // Permits: two of two, then the third is refused with the semaphore's words.
    let mut tokens = Vec::new();
    for owner in ["p", "q"] {
        let permit = lockbroker(
            url,
            &[
                "acquire",
                "--semaphore",
                "pool",
                "--limit",
                "2",
                "--owner",
                owner,
                "--json",
            ],
        )
        .await;
        permit.expect_code(0);
        assert_eq!(permit.json()["limit"], 2);
        tokens.push(permit.json()["token"].as_str().unwrap().to_owned());
    }
    let full = lockbroker(url, &["acquire", "--semaphore", "pool", "--limit", "2"]).await;
    full.expect_failure(3, &["semaphore pool", "every permit is taken"]);
    let status = lockbroker(url, &["status", "--semaphore", "pool", "--json"]).await;
    status.expect_code(0);
    assert_eq!(status.json()["limit"], 2);
    assert_eq!(status.json()["holders"].as_array().map(Vec::len), Some(2));

    lockbroker(
        url,
        &[
            "renew",
            "--semaphore",
            "pool",
            "--token",
            &tokens[0],
            "--ttl",
            "10s",
        ],
    )
    .await
    .expect_code(0);
    for token in &tokens {
        let released = lockbroker(url, &["release", "--semaphore", "pool", "--token", token]).await;
        released.expect_code(0);
        assert_eq!(released.stdout.trim(), "released semaphore pool");
    }
    let again = lockbroker(
        url,
        &[
            "release",
            "--semaphore",
            "pool",
            "--token",
            &tokens[0],
            "--json",
        ],
    )
    .await;
    again.expect_code(4);
    assert_eq!(again.json()["error"], "not_held");
    let free = lockbroker(url, &["status", "--semaphore", "pool"]).await;
    free.expect_code(4);
    assert_eq!(free.stdout.trim(), "semaphore pool is not held");
}

on_both_stores!(every_command_handles_shared_leases_and_permits);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_follows_the_cursor_through_every_page_under_the_prefix() {
    let app = spawn_app(None).await;
    let url = &app.address;
    let mut tokens = Vec::new();
    for key in ["list:a", "list:b", "list:c", "list:d", "other:x"] {
        tokens.push(app.grant(key, "ttl_ms=30000").await.token);
    }
    tokens.push(app.grant("list:e", "ttl_ms=30000&mode=shared").await.token);
    let listed = |args: &'static [&'static str]| lockbroker(url, args);

    // Six locks under the prefix, two a page: three pages or more, all followed.
    let all = listed(&["list", "list:", "--page-size", "2", "--json"]).await;
    all.expect_code(0);
    let lines = json_lines(&all);
    let keys: BTreeSet<&str> = lines.iter().map(|l| l["key"].as_str().unwrap()).collect();
    assert_eq!(
        keys,
        BTreeSet::from(["list:a", "list:b", "list:c", "list:d", "list:e"])
    );
    assert_eq!(lines.len(), 5, "each lock once: {}", all.stdout);
    let shared = lines.iter().find(|l| l["key"] == "list:e").unwrap();
    assert_eq!(shared["mode"], "shared");
    for line in &lines {
        assert!(line.get("token").is_none(), "{line}");
    }

    // --limit caps the total, across pages, and says there may be more.
    let capped = listed(&["list", "list:", "--page-size", "2", "--limit", "3"]).await;
    capped.expect_code(0);
    let rows: Vec<&str> = capped.stdout.lines().collect();
    assert_eq!(rows.len(), 4, "a header and three rows:\n{}", capped.stdout);
    assert!(
        rows[0].starts_with("key") && rows[0].contains("mode"),
        "{}",
        rows[0]
    );
    assert!(
        rows[1..].iter().all(|r| r.starts_with("list:")),
        "{}",
        capped.stdout
    );
    assert!(capped.stderr.contains("--limit 3"), "{}", capped.stderr);

    // Everything, as a table; never a token.
    let everything = listed(&["list"]).await;
    everything.expect_code(0);
    assert_eq!(
        everything.stdout.lines().count(),
        7,
        "{}",
        everything.stdout
    );
    for token in &tokens {
        assert!(
            !everything.stdout.contains(token.as_str()),
            "a token was listed"
        );
    }
    let none = listed(&["list", "nothing-here:"]).await;
    none.expect_code(0);
    assert_eq!(none.stdout.trim(), r#"no locks held under "nothing-here:""#);

    // Semaphores are listed apart, with their holder count.
    for _ in 0..2 {
        lockbroker(
            url,
            &["acquire", "--semaphore", "list:pool", "--limit", "3"],
        )
        .await
        .expect_code(0);
    }
    let semaphores = listed(&["list", "list:", "--semaphores", "--json"]).await;
    semaphores.expect_code(0);
    let lines = json_lines(&semaphores);
    assert_eq!(lines.len(), 1, "{}", semaphores.stdout);
    assert_eq!(lines[0]["key"], "list:pool");
    assert_eq!(lines[0]["limit"], 3);
    assert_eq!(lines[0]["holders"], 2);
    let table = listed(&["list", "--semaphores"]).await;
    table.expect_code(0);
    assert!(table.stdout.starts_with("semaphore"), "{}", table.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_force_is_refused_without_allow_force_release_and_ends_every_lease_with_it() {
    // Auth off and no --allow-force-release: 403, and it says what would allow it.
    let app = spawn_app(None).await;
    app.grant("stuck", "ttl_ms=30000").await;
    let refused = lockbroker(&app.address, &["release", "--force", "stuck"]).await;
    refused.expect_code(1);
    for words in ["403", "forbidden", "admin", "--allow-force-release"] {
        assert!(
            refused.stderr.contains(words),
            "{words}: {}",
            refused.stderr
        );
    }
    let json = lockbroker(&app.address, &["release", "--force", "stuck", "--json"]).await;
    json.expect_code(1);
    assert_eq!(json.json()["error"], "forbidden");
    app.inspect("stuck").await.expect_status(StatusCode::OK);

    // The real binary with the flag: every lease on the key ends, no token needed.
    let broker = BrokerProcess::start(BrokerCommand::configured(BIN, |command, port| {
        listen_on(command, port);
        command.arg("--allow-force-release");
    }))
    .await;
    let url = &broker.address();
    lockbroker(url, &["acquire", "stuck"]).await.expect_code(0);
    let forced = lockbroker(url, &["release", "--force", "stuck"]).await;
    forced.expect_code(0);
    assert!(
        forced.stdout.starts_with("released stuck"),
        "{}",
        forced.stdout
    );
    lockbroker(url, &["status", "stuck"]).await.expect_code(4);
    let again = lockbroker(url, &["release", "--force", "stuck"]).await;
    again.expect_code(4);
    assert_eq!(again.stdout.trim(), "stuck is not held");

    for _ in 0..2 {
        lockbroker(url, &["acquire", "--shared", "readers"])
            .await
            .expect_code(0);
        lockbroker(url, &["acquire", "--semaphore", "pool", "--limit", "2"])
            .await
            .expect_code(0);
    }
    lockbroker(url, &["release", "--force", "readers"])
        .await
        .expect_code(0);
    lockbroker(url, &["status", "readers"]).await.expect_code(4);
    let semaphore = lockbroker(
        url,
        &["release", "--semaphore", "pool", "--force", "--json"],
    )
    .await;
    semaphore.expect_code(0);
    assert_eq!(
        semaphore.json(),
        serde_json::json!({"key": "pool", "released": true, "forced": true})
    );
    lockbroker(url, &["status", "--semaphore", "pool"])
        .await
        .expect_code(4);
}
