//! `acquire`, `release`, `renew` and `status`: their output, text and `--json`, and their exit
//! codes.

use std::time::Duration;

use lockbroker_test_support::app::spawn_app;
use lockbroker_test_support::free_port;

use crate::support::{finish, lockbroker, lockbroker_command};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_prints_the_token_and_fence_and_status_shows_the_holder() {
    let app = spawn_app(None).await;
    let url = &app.address;

    let acquired = lockbroker(url, &["acquire", "orders:42", "--owner", "worker-7"]).await;
    acquired.expect_code(0);
    let token = acquired.field("token");
    let fence: u64 = acquired.field("fence").parse().expect("a numeric fence");
    assert_eq!(acquired.field("key"), "orders:42");
    assert_eq!(acquired.field("ttl"), "30s", "the broker's default TTL");
    assert!(token.len() >= 32, "a real token: {token:?}");

    let status = lockbroker(url, &["status", "orders:42"]).await;
    status.expect_code(0);
    assert_eq!(status.field("fence"), fence.to_string());
    assert_eq!(status.field("owner"), "worker-7");
    assert!(
        !status.stdout.contains(&token),
        "status never shows the token"
    );

    let json = lockbroker(url, &["status", "orders:42", "--json"]).await;
    json.expect_code(0);
    let body = json.json();
    assert_eq!(body["fence"], fence);
    assert_eq!(body["owner"], "worker-7");
    assert!(body["ttl_remaining_ms"].as_u64().unwrap() <= 30_000);

    let released = lockbroker(url, &["release", "orders:42", "--token", &token]).await;
    released.expect_code(0);
    assert_eq!(released.stdout.trim(), "released orders:42");

    let free = lockbroker(url, &["status", "orders:42"]).await;
    free.expect_code(4);
    assert_eq!(free.stdout.trim(), "orders:42 is not held");
    assert!(
        free.stderr.is_empty(),
        "a free lock is an answer, not an error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_output_carries_the_grant_and_renew_keeps_its_fence() {
    let app = spawn_app(None).await;
    let url = &app.address;

    let acquired = lockbroker(url, &["acquire", "jobs:1", "--ttl", "1500ms", "--json"]).await;
    acquired.expect_code(0);
    let grant = acquired.json();
    assert_eq!(grant["key"], "jobs:1");
    assert_eq!(grant["ttl_ms"], 1500);
    let token = grant["token"].as_str().unwrap().to_owned();

    let renewed = lockbroker(
        url,
        &[
            "renew", "jobs:1", "--token", &token, "--ttl", "2m", "--json",
        ],
    )
    .await;
    renewed.expect_code(0);
    let renewal = renewed.json();
    assert_eq!(renewal["ttl_ms"], 120_000);
    assert_eq!(
        renewal["fence"], grant["fence"],
        "a renewal keeps the fence"
    );
    assert_eq!(renewal["token"], grant["token"]);
    assert!(renewal["expires_at_ms"].as_u64() > grant["expires_at_ms"].as_u64());

    let text = lockbroker(url, &["renew", "jobs:1", "--token", &token]).await;
    text.expect_code(0);
    assert_eq!(
        text.field("ttl"),
        "30s",
        "without --ttl, the broker's default"
    );

    let released = lockbroker(url, &["release", "jobs:1", "--token", &token, "--json"]).await;
    released.expect_code(0);
    assert_eq!(
        released.json(),
        serde_json::json!({"key": "jobs:1", "released": true})
    );

    for command in ["release", "renew"] {
        let again = lockbroker(url, &[command, "jobs:1", "--token", &token, "--json"]).await;
        again.expect_code(4);
        assert_eq!(again.json()["error"], "not_held", "{command}");
        assert!(
            again.stderr.contains("nobody holds the lock"),
            "{command}: {}",
            again.stderr
        );
    }
    let status = lockbroker(url, &["status", "jobs:1", "--json"]).await;
    status.expect_code(4);
    assert_eq!(status.json()["error"], "not_held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquiring_a_held_lock_exits_3_and_says_when_it_frees() {
    let app = spawn_app(None).await;
    let url = &app.address;
    app.grant("busy", "ttl_ms=30000").await;

    let text = lockbroker(url, &["acquire", "busy"]).await;
    text.expect_code(3);
    assert!(text.stdout.is_empty(), "nothing on stdout: {}", text.stdout);
    assert!(
        text.stderr.contains("held by someone else") && text.stderr.contains("busy"),
        "{}",
        text.stderr
    );

    let json = lockbroker(url, &["acquire", "busy", "--wait", "0s", "--json"]).await;
    json.expect_code(3);
    let body = json.json();
    assert_eq!(body["error"], "locked");
    assert!(body["retry_after_ms"].as_u64().unwrap() > 20_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_with_a_wait_gets_the_lock_when_the_holders_lease_ends() {
    let app = spawn_app(None).await;
    let held = app.grant("handoff", "ttl_ms=700").await;
    let acquired = lockbroker(
        &app.address,
        &["acquire", "handoff", "--wait", "10s", "--json"],
    )
    .await;
    acquired.expect_code(0);
    assert!(acquired.json()["fence"].as_u64().unwrap() > held.fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_exits_3_after_the_wait() {
    let app = spawn_app(None).await;
    app.grant("slow", "ttl_ms=30000").await;
    let waited = lockbroker(&app.address, &["acquire", "slow", "--wait", "400ms"]).await;
    waited.expect_code(3);
    assert!(
        waited.elapsed >= Duration::from_millis(400),
        "it waited {:?}",
        waited.elapsed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_are_written_the_human_way_and_bad_ones_are_usage_errors() {
    let app = spawn_app(None).await;
    let url = &app.address;
    for (written, ms) in [
        ("1500ms", 1500),
        ("2m", 120_000),
        ("1m 30s", 90_000),
        ("3s", 3000),
    ] {
        let key = format!("dur-{ms}");
        let acquired = lockbroker(url, &["acquire", &key, "--ttl", written, "--json"]).await;
        acquired.expect_code(0);
        assert_eq!(acquired.json()["ttl_ms"], ms, "--ttl {written}");
    }
    for bad in ["30", "0s", "soon", "1500us", "-1s"] {
        let refused = lockbroker(url, &["acquire", "dur-bad", &format!("--ttl={bad}")]).await;
        refused.expect_code(2);
        assert!(
            refused.stderr.contains("--ttl"),
            "{bad}: {}",
            refused.stderr
        );
    }
    let refused = lockbroker(url, &["acquire", "dur-bad", "--wait", "10"]).await;
    refused.expect_code(2);
    assert!(
        refused.stderr.contains("30s, 1500ms or 2m"),
        "the message shows how: {}",
        refused.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_and_flags_are_usage_errors_and_broker_refusals_are_errors() {
    let app = spawn_app(None).await;
    let url = &app.address;
    for args in [
        &["acquire", "a b"][..],
        &["acquire", "a/b"],
        &["status", ""],
        &["acquire", "k", "--request-id", "has space"],
        &["release", "k"],
        &["acquire", "k", "--bogus"],
    ] {
        lockbroker(url, args).await.expect_code(2);
    }
    // Over the broker's max_ttl_ms (an hour): valid here, refused there.
    let refused = lockbroker(url, &["acquire", "k", "--ttl", "2h", "--json"]).await;
    refused.expect_code(1);
    assert_eq!(refused.json()["error"], "invalid_request");
    assert!(refused.stderr.contains("400"), "{}", refused.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_exits_1_for_every_command() {
    // A port nobody listens on: connection refused.
    let url = format!("http://127.0.0.1:{}", free_port());
    let token = "0".repeat(48);
    for args in [
        &["acquire", "k"][..],
        &["release", "k", "--token", &token],
        &["renew", "k", "--token", &token],
        &["status", "k"],
        &["run", "k", "--", "true"],
    ] {
        let outcome = lockbroker(&url, args).await;
        outcome.expect_code(1);
        assert!(
            outcome.stderr.contains("cannot reach the broker"),
            "{args:?}: {}",
            outcome.stderr
        );
    }
    let json = lockbroker(&url, &["status", "k", "--json"]).await;
    json.expect_code(1);
    assert_eq!(json.json()["error"], "unreachable");
    lockbroker("https://127.0.0.1:1", &["status", "k"])
        .await
        .expect_code(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn someone_elses_token_is_not_the_owner_and_exits_4() {
    let app = spawn_app(None).await;
    let url = &app.address;
    app.grant("mine", "ttl_ms=30000").await;
    let stranger = "f".repeat(48);
    for command in ["release", "renew"] {
        let refused = lockbroker(url, &[command, "mine", "--token", &stranger, "--json"]).await;
        refused.expect_code(4);
        assert_eq!(refused.json()["error"], "not_owner", "{command}");
    }
    lockbroker(url, &["status", "mine"]).await.expect_code(0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_and_the_token_can_come_from_the_environment() {
    let app = spawn_app(None).await;
    // lockbroker_command sets LOCKBROKER_URL and gives no --url.
    let acquired = lockbroker(&app.address, &["acquire", "env", "--json"]).await;
    acquired.expect_code(0);
    let token = acquired.json()["token"].as_str().unwrap().to_owned();
    let mut release = lockbroker_command(&app.address, &["release", "env"]);
    release.env("LOCKBROKER_TOKEN", &token);
    let released = finish(release.spawn().unwrap()).await;
    released.expect_code(0);
    // --url beats the environment.
    let unreachable = format!("http://127.0.0.1:{}", free_port());
    lockbroker(&unreachable, &["status", "env", "--url", &app.address])
        .await
        .expect_code(4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_repeated_with_its_request_id_returns_the_same_grant() {
    let app = spawn_app(None).await;
    let url = &app.address;
    let args = ["acquire", "idem", "--request-id", "job-42_a", "--json"];
    let first = lockbroker(url, &args).await;
    first.expect_code(0);
    let again = lockbroker(url, &args).await;
    again.expect_code(0);
    assert_eq!(first.json(), again.json(), "the same lease, token and all");

    let other = lockbroker(url, &["acquire", "idem", "--request-id", "job-43"]).await;
    other.expect_code(3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_documents_the_exit_codes() {
    for command in ["acquire", "release", "renew", "status"] {
        let help = lockbroker("http://127.0.0.1:1", &[command, "--help"]).await;
        help.expect_code(0);
        for line in ["Exit codes:", "3    locked", "4    not held"] {
            assert!(
                help.stdout.contains(line),
                "{command} --help lacks {line:?}"
            );
        }
    }
    let help = lockbroker("http://127.0.0.1:1", &["run", "--help"]).await;
    help.expect_code(0);
    for line in [
        "128+S",
        "5      the lease was lost",
        "127    the command was not found",
    ] {
        assert!(help.stdout.contains(line), "run --help lacks {line:?}");
    }
}

/// `lockbroker list --json | head -1`: a reader that closed its end of the pipe ends the command
/// quietly, with no panic and nothing on stderr. A listing or a status is an answer its reader
/// may cut short: it ends with its own status (0, or 4 for a free key), table or JSON, as the
/// table form does when the pipe took all of it. An acquire whose grant nobody read ends with
/// 141, as SIGPIPE would. The pipe's read end is closed before the command starts, so its first
/// write finds it closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_pipe_ends_list_and_status_quietly() {
    let app = spawn_app(None).await;
    let url = &app.address;
    for key in ["piped:1", "piped:2", "piped:3"] {
        lockbroker(url, &["acquire", key]).await.expect_code(0);
    }
    for (args, code) in [
        (&["list"][..], 0),
        (&["list", "--json"], 0),
        (&["list", "--json", "--page-size", "1"], 0),
        (&["status", "piped:1"], 0),
        (&["status", "piped:1", "--json"], 0),
        (&["status", "piped:1", "--watch", "--json"], 0),
        (&["status", "free", "--json"], 4),
        (&["acquire", "piped:4", "--json"], 141),
    ] {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let mut command = lockbroker_command(url, args);
        command.stdout(writer);
        let outcome = finish(command.spawn().expect("the binary starts")).await;
        assert_eq!(outcome.stderr, "", "{args:?} says nothing");
        assert_eq!(outcome.code, Some(code), "{args:?}");
    }
}
