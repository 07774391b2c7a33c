//! A Redis ACL user: the `ACL SETUSER` line the documentation gives (read from
//! docs/topologies.md, so the two cannot drift apart) is applied to a fresh Redis, and brokers run as that user through the
//! whole life of a lock — acquire, a waiter woken by the release notice, renew, release,
//! readiness, and the put-back after a `FLUSHALL` — with no command refused (`ACL LOG` stays
//! empty), the lock scripts run as the function library. The password appears nowhere: not in
//! the brokers' logs at debug level, not in an error body, not in `/metrics`. A user without the
//! line's `+fcall +function|load` gets its locks all the same, by SHA, after one warning.

use std::time::{Duration, Instant};

use lockbroker_test_support::broker::{BrokerProcess, wait_until_ready};
use lockbroker_test_support::http::{Answer, granted_within, http_client, until_waiting};
use lockbroker_test_support::redis;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::{Method, StatusCode};

const PASSWORD: &str = "Pa55-w0rd-n3ver-l0gged";
const WRONG_PASSWORD: &str = "Wr0ng-pa55-n3ver-l0gged";
/// Stands for the password in the documented line.
const PLACEHOLDER: &str = ">CHANGE-ME";

/// The documented `ACL SETUSER lockbroker …` line (docs/topologies.md), the only one there.
fn documented_acl_line() -> String {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/topologies.md"))
        .expect("cannot read docs/topologies.md");
    let lines: Vec<&str> = page
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("ACL SETUSER lockbroker "))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "one ACL SETUSER line in docs/topologies.md: {lines:?}"
    );
    assert!(lines[0].contains(PLACEHOLDER), "the line has {PLACEHOLDER}");
    lines[0].to_owned()
}

/// Applies the `ACL SETUSER` `line` on `redis`, with [`PASSWORD`] for its placeholder.
async fn set_user(redis: &RedisServer, line: &str) {
    let line = line.replace(PLACEHOLDER, &format!(">{PASSWORD}"));
    let mut setuser = redis::cmd("ACL");
    for word in line.split_whitespace().skip(1) {
        setuser.arg(word);
    }
    let () = setuser
        .query_async(&mut redis.connection().await)
        .await
        .unwrap_or_else(|e| panic!("the ACL line is refused: {e}"));
}

/// A broker process running as `user:password`, logging everything at debug level.
async fn broker_as(redis: &RedisServer, password: &str) -> BrokerProcess {
    let url = format!("redis://lockbroker:{password}@127.0.0.1:{}/", redis.port());
    let flags = [
        "--store-timeout-ms",
        "1000",
        "--store-settle-ms",
        "500",
        "--log-level",
        "debug",
    ];
    crate::broker_on(&url, &flags).await
}

/// `DELETE path` on `broker` with `token` in the `Lock-Token` header, answered `204`.
async fn released_on(broker: &BrokerProcess, path: &str, token: &str) {
    send(Method::DELETE, broker.url(path), Some(token))
        .await
        .expect_status(StatusCode::NO_CONTENT);
}

async fn send(method: Method, url: String, token: Option<&str>) -> Answer {
    let mut request = http_client().request(method, url);
    if let Some(token) = token {
        request = request.header("Lock-Token", token);
    }
    Answer::send(request).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_run_as_the_documented_acl_user_and_never_show_its_password() {
    let redis = RedisServer::start().await;
    let mut admin = redis.connection().await;
    set_user(&redis, &documented_acl_line()).await;

    let one = broker_as(&redis, PASSWORD).await;
    let two = broker_as(&redis, PASSWORD).await;
    wait_until_ready(&one.address(), Duration::from_secs(5)).await;
    wait_until_ready(&two.address(), Duration::from_secs(5)).await;
    redis.wait_until_listening(2).await;

    // Acquire, a waiter on the other broker woken by the release notice, renew, release.
    let holder = send(Method::POST, one.url("/locks/acl?ttl_ms=20000"), None)
        .await
        .expect_grant(StatusCode::CREATED);
    let waiter = tokio::spawn(send(
        Method::POST,
        two.url("/locks/acl?ttl_ms=20000&wait_ms=10000"),
        None,
    ));
    until_waiting(&two.address(), 1).await;
    send(
        Method::POST,
        one.url("/locks/acl/renew"),
        Some(&holder.token),
    )
    .await
    .expect_status(StatusCode::OK);
    released_on(&one, "/locks/acl", &holder.token).await;
    let next = granted_within(waiter, Instant::now(), Duration::from_millis(500)).await;

    // The store is flushed: the brokers start a new epoch and put the live lease back.
    let () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .expect("FLUSHALL");
    let started = Instant::now();
    loop {
        let view = send(Method::GET, one.url("/locks/acl"), None).await;
        if view.status == StatusCode::OK {
            assert_eq!(view.json()["fence"], next.fence);
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the lease was not put back: {}",
            view.text
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    wait_until_ready(&one.address(), Duration::from_secs(5)).await;
    released_on(&two, "/locks/acl", &next.token).await;

    // Shared leases, a semaphore permit and the listings use their own commands too.
    let reader = send(Method::POST, one.url("/locks/acl-rw?mode=shared"), None)
        .await
        .expect_grant(StatusCode::CREATED);
    send(Method::POST, two.url("/locks/acl-rw"), None)
        .await
        .expect_error(StatusCode::CONFLICT, "locked");
    let permit = send(Method::POST, two.url("/semaphores/acl-pool?limit=2"), None).await;
    permit.expect_status(StatusCode::CREATED);
    let listed = send(Method::GET, one.url("/locks?prefix=acl"), None).await;
    listed.expect_status(StatusCode::OK);
    assert_eq!(
        listed.json()["locks"][0]["key"],
        "acl-rw",
        "{}",
        listed.text
    );
    send(Method::GET, one.url("/semaphores"), None)
        .await
        .expect_status(StatusCode::OK);
    released_on(&two, "/locks/acl-rw", &reader.token).await;
    let permit_token = permit.json()["token"].as_str().expect("a token").to_owned();
    released_on(&one, "/semaphores/acl-pool", &permit_token).await;

    // The lock scripts ran as the function library, none by SHA.
    assert!(redis.command_calls("fcall").await > 0);
    assert_eq!(redis.command_calls("evalsha").await, 0);

    // Every command the brokers sent was allowed.
    let denied: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(&mut admin)
        .await
        .expect("ACL LOG");
    assert!(
        denied.is_empty(),
        "the documented ACL line refused commands: {denied:?}"
    );

    // WAIT, sent only with replica acknowledgements (tested in replicas.rs), is allowed too.
    let wait: String = redis::cmd("ACL")
        .arg("DRYRUN")
        .arg("lockbroker")
        .arg("WAIT")
        .arg(1)
        .arg(100)
        .query_async(&mut admin)
        .await
        .expect("ACL DRYRUN");
    assert_eq!(wait, "OK", "the documented ACL line refuses WAIT");

    // The broker with the wrong password (started after the ACL LOG was read: a failed AUTH
    // is logged there too) is not ready, and says why.
    let wrong = broker_as(&redis, WRONG_PASSWORD).await;
    let refused = send(Method::GET, wrong.url("/readyz"), None).await;
    refused.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    let refused_acquire = send(Method::POST, wrong.url("/locks/acl"), None).await;
    refused_acquire.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    assert!(
        wrong.output().contains("Password authentication failed"),
        "the log does not say the password is wrong:\n{}",
        wrong.output()
    );

    for broker in [&one, &two, &wrong] {
        let metrics = send(Method::GET, broker.url("/metrics"), None).await.text;
        let shown = [
            broker.output(),
            metrics,
            refused.text.clone(),
            refused_acquire.text.clone(),
        ];
        for text in shown {
            for secret in [PASSWORD, WRONG_PASSWORD] {
                assert!(!text.contains(secret), "the password shows in:\n{text}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_not_allowed_functions_gets_its_locks_by_sha_after_one_warning() {
    let redis = RedisServer::start().await;
    let line = documented_acl_line().replace(" +fcall +function|load", "");
    assert!(
        !line.contains("fcall") && !line.contains("function"),
        "{line}"
    );
    set_user(&redis, &line).await;
    let broker = broker_as(&redis, PASSWORD).await;
    wait_until_ready(&broker.address(), Duration::from_secs(5)).await;

    // A lock cycle, and a waiter handed the lock on release: the queue's scripts too.
    let holder = send(Method::POST, broker.url("/locks/sha?ttl_ms=20000"), None)
        .await
        .expect_grant(StatusCode::CREATED);
    let waiter = tokio::spawn(send(
        Method::POST,
        broker.url("/locks/sha?ttl_ms=20000&wait_ms=10000"),
        None,
    ));
    until_waiting(&broker.address(), 1).await;
    released_on(&broker, "/locks/sha", &holder.token).await;
    let next = granted_within(waiter, Instant::now(), Duration::from_millis(500)).await;
    assert!(next.fence > holder.fence);
    released_on(&broker, "/locks/sha", &next.token).await;

    // Each script's first run was an EVAL with its source; from then on, by SHA.
    let by_sha = redis.command_calls("evalsha").await;
    let again = send(Method::POST, broker.url("/locks/sha"), None)
        .await
        .expect_grant(StatusCode::CREATED);
    released_on(&broker, "/locks/sha", &again.token).await;
    assert_eq!(redis.command_calls("evalsha").await - by_sha, 2);
    assert_eq!(redis.command_calls("fcall").await, 0);
    let log = broker.output();
    assert_eq!(
        log.matches("cannot run the broker's function library")
            .count(),
        1,
        "one warning:\n{log}"
    );
}
