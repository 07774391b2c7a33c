//! Store restarts, flushes and data loss: brokers put the live leases they granted back into a
//! store that lost them, hold every grant for a short settle time meanwhile, and then serve as
//! before. Every test runs real `redis-server` processes and several brokers.

use std::time::{Duration, Instant};

use reqwest::StatusCode;

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::http::{Answer, Grant};
use lockbroker_test_support::redis_server::RedisServer;

use crate::cross_broker::wait_until_ready;
use crate::waiting::answer_within;

/// The settle time in these tests: long enough to be seen, short enough to keep them quick.
const SETTLE_MS: u64 = 1000;

/// The contract: within 10 s of the store answering again, a key without a live lease is granted.
const RECOVERY_LIMIT: Duration = Duration::from_secs(10);

async fn broker(redis: &RedisServer) -> TestApp {
    spawn_app_with(Some(redis.url()), |c| {
        c.store_timeout_ms = Some(1000);
        c.store_settle_ms = Some(SETTLE_MS);
    })
    .await
}

/// `n` brokers on `redis`, ready (past the first settle of a new store).
async fn brokers<const N: usize>(redis: &RedisServer) -> [TestApp; N] {
    let mut apps = Vec::new();
    for _ in 0..N {
        apps.push(broker(redis).await);
    }
    for app in &apps {
        wait_until_ready(app, Duration::from_secs(5)).await;
    }
    apps.try_into().unwrap_or_else(|_| unreachable!())
}

/// Waits until a bid is in `key`'s queue in Redis (the brokers' default key prefix), for at most
/// 5 s.
async fn until_queued(redis: &RedisServer, key: &str) {
    let started = Instant::now();
    let mut conn = redis.connection().await;
    loop {
        let queued: u64 = lockbroker_test_support::redis::cmd("ZCARD")
            .arg(format!("lockbroker:{{{key}}}:queue"))
            .query_async(&mut conn)
            .await
            .unwrap();
        if queued > 0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no bid in {key}'s queue after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Asks `app` for `key` until it is granted, and says how long that took from `since`. Every
/// answer before is a 503 `store_unavailable` with a Retry-After (a hold, or Redis not back yet)
/// or a 409 `locked`.
async fn first_grant(app: &TestApp, key: &str, since: Instant) -> Duration {
    loop {
        let answer = app.acquire(key, "ttl_ms=1000").await;
        if answer.status == StatusCode::CREATED {
            return since.elapsed();
        }
        answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
        assert!(
            since.elapsed() < RECOVERY_LIMIT,
            "{key} was not granted {RECOVERY_LIMIT:?} after Redis answered again: {}",
            answer.text
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `/metrics` until `series` has a value `wanted` accepts (for at most 5 s).
async fn metric_until(app: &TestApp, series: &str, what: &str, wanted: impl Fn(f64) -> bool) {
    let started = Instant::now();
    loop {
        let text = app.get("/metrics").await.text;
        let value = text
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok());
        if value.is_some_and(&wanted) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{series} stayed at {value:?}, expected {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// After a loss: the lease `held` (key `key`, granted by a broker that kept running) answers
/// `409 locked` on every broker, with `retry_after_ms` to its end; its token renews (same
/// fence) and releases on any broker; afterwards the key is granted with a larger fence.
async fn expect_put_back(apps: &[&TestApp], key: &str, held: &Grant) {
    for app in apps {
        let answer = app.acquire(key, "ttl_ms=1000").await;
        let body = answer.expect_error(StatusCode::CONFLICT, "locked");
        let retry = body["retry_after_ms"].as_u64().expect("retry_after_ms");
        assert!(
            retry > 0 && retry <= held.ttl_ms,
            "retry_after_ms {retry} for a lease of {} ms",
            held.ttl_ms
        );
        let shown = app.inspect_held(key).await;
        assert_eq!(
            shown["fence"], held.fence,
            "the lease was put back with its fence"
        );
    }
    let renewed = apps[apps.len() - 1]
        .renew(key, &held.token, "ttl_ms=20000")
        .await
        .expect_grant(StatusCode::OK);
    assert_eq!(renewed.fence, held.fence);
    apps[0].release_ok(key, &held.token).await;
    let next = apps[apps.len() - 1].grant(key, "ttl_ms=1000").await;
    next.assert_fence_above(held, "the loss");
}

/// How Redis loses every key in [`live_leases_come_back_after`].
enum Loss {
    /// A restart without persistence: the connection breaks, a new server answers.
    RestartEmpty,
    /// FLUSHALL: no connection breaks; the brokers notice it by themselves (the grant scripts
    /// refuse to grant without the store's epoch, and an idle broker checks every second).
    Flushall,
}

/// Broker one holds `kept` (only it knows the lease); Redis loses every key; broker two grants
/// another key within ten seconds, and both brokers refuse `kept`, put back. The Redis and the
/// brokers, still running.
async fn live_leases_come_back_after(loss: Loss) -> (RedisServer, [TestApp; 2]) {
    let mut redis = RedisServer::start().await;
    let [one, two] = brokers::<2>(&redis).await;
    let held = one.grant("kept", "ttl_ms=30000&owner=batch").await;
    let what = match loss {
        Loss::RestartEmpty => {
            redis.restart().await;
            "restart without persistence"
        }
        Loss::Flushall => {
            redis.flushall().await;
            "FLUSHALL"
        }
    };
    let lost = Instant::now();
    let recovery = first_grant(&two, "free", lost).await;
    eprintln!("{what}: first grant {recovery:?} after Redis answered");
    expect_put_back(&[&two, &one], "kept", &held).await;
    (redis, [one, two])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_restarts_empty_live_leases_are_put_back_and_other_keys_are_granted_within_ten_seconds()
 {
    let (_redis, [one, _two]) = live_leases_come_back_after(Loss::RestartEmpty).await;
    metric_until(
        &one,
        "lockbroker_leases_put_back_total",
        "at least 1.0",
        |v| v >= 1.0,
    )
    .await;
    metric_until(&one, "lockbroker_store_losses_total", "at least 1.0", |v| {
        v >= 1.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_flushall_live_leases_are_put_back_and_other_keys_are_granted_within_ten_seconds() {
    live_leases_come_back_after(Loss::Flushall).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_from_the_append_only_file_the_new_server_counts_as_a_loss_and_leases_are_kept()
 {
    let mut redis = RedisServer::start().await;
    redis.persist_to_aof().await;
    let [one, two] = brokers::<2>(&redis).await;
    let held = one.grant("kept", "ttl_ms=30000").await;
    // A lease the file never got: written while the AOF was off, as writes of a server's last
    // second are lost with `appendfsync everysec`.
    redis.config_set("appendonly", "no").await;
    let lost = one.grant("lost", "ttl_ms=30000").await;
    redis.restart().await;
    let back = Instant::now();
    // The data survived, but the server process is another one: a loss all the same.
    let recovery = first_grant(&two, "free", back).await;
    eprintln!("restart from the append-only file: first grant {recovery:?} after Redis answered");
    metric_until(&one, "lockbroker_store_losses_total", "at least 1.0", |v| {
        v >= 1.0
    })
    .await;
    expect_put_back(&[&two, &one], "kept", &held).await;
    expect_put_back(&[&two, &one], "lost", &lost).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renew_during_the_hold_answers_503_until_the_lease_is_back_never_not_held() {
    let mut redis = RedisServer::start().await;
    let [one, two] = brokers::<2>(&redis).await;
    let held = one.grant("kept", "ttl_ms=30000").await;
    redis.restart().await;
    let back = Instant::now();
    // On the broker that did not grant it, from the moment Redis is back.
    let renewed = loop {
        let answer = two.renew("kept", &held.token, "ttl_ms=30000").await;
        if answer.status == StatusCode::OK {
            break answer.expect_grant(StatusCode::OK);
        }
        answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
        assert!(
            back.elapsed() < RECOVERY_LIMIT,
            "the renewal never went through"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(renewed.fence, held.fence);
    assert_eq!(renewed.token, held.token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_parked_across_a_loss_is_granted_when_the_put_back_lease_is_released() {
    let mut redis = RedisServer::start().await;
    let [one, two] = brokers::<2>(&redis).await;
    let held = one.grant("queue", "ttl_ms=30000").await;
    let waiter = two.spawn_acquire("queue", "wait_ms=20000&ttl_ms=1000");
    // Its bid in the key's queue in Redis before Redis restarts empty.
    until_queued(&redis, "queue").await;
    redis.restart().await;
    let back = Instant::now();
    first_grant(&one, "free", back).await;
    // The put-back lease still blocks the waiter; its holder releases it.
    if waiter.is_finished() {
        let answer = answer_within(waiter, Duration::from_secs(1)).await;
        panic!(
            "the waiter was answered while the lease was held: {} {}",
            answer.status, answer.text
        );
    }
    loop {
        let answer = one.release("queue", &held.token).await;
        if answer.status == StatusCode::NO_CONTENT {
            break;
        }
        answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let granted = answer_within(waiter, Duration::from_secs(3))
        .await
        .expect_grant(StatusCode::CREATED);
    assert!(granted.fence > held.fence);
}

/// The reason of a 503 `store_unavailable`, as `/readyz` says it.
fn reason(answer: &Answer) -> String {
    answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_settling_on_a_new_store_and_holding_back_after_a_detected_loss() {
    let redis = RedisServer::start().await;
    let started = Instant::now();
    let app = spawn_app_with(Some(redis.url()), |c| c.store_settle_ms = Some(1500)).await;
    // A store never seen before is new or emptied, never "lost".
    let (readyz, acquire) = loop {
        let readyz = app.get("/readyz").await;
        if readyz.status == StatusCode::SERVICE_UNAVAILABLE && reason(&readyz).contains("settling")
        {
            break (readyz, app.acquire("k", "").await);
        }
        assert!(started.elapsed() < Duration::from_secs(1), "no settle seen");
    };
    assert!(readyz.header("retry-after").is_some());
    let said = reason(&acquire);
    assert!(
        said.contains("new or was emptied") && !said.contains("lost"),
        "{said}"
    );
    let ready_after = wait_until_ready(&app, Duration::from_secs(5)).await;
    assert!(
        started.elapsed() >= Duration::from_millis(1400),
        "{ready_after:?}"
    );
    app.grant("k", "").await;

    // A flush seen by a broker that knew the store is a loss.
    redis.flushall().await;
    let flushed = Instant::now();
    loop {
        let readyz = app.get("/readyz").await;
        if readyz.status == StatusCode::SERVICE_UNAVAILABLE {
            let said = reason(&readyz);
            assert!(said.contains("store loss"), "{said}");
            break;
        }
        assert!(
            flushed.elapsed() < Duration::from_secs(3),
            "/readyz did not report the hold after a flush"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_until_ready(&app, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_loss_a_broker_that_never_saw_the_store_grants_nothing_while_a_put_back_lease_lives()
 {
    let mut redis = RedisServer::start().await;
    let [knowing] = brokers::<1>(&redis).await;
    let held = knowing.grant("kept", "ttl_ms=4000").await;
    let granted_at = Instant::now();
    redis.restart().await;
    // A broker started after the loss reaches the empty Redis; it never saw the old one and
    // cannot tell it from a new store, so it settles, and the knowing broker puts the lease back.
    let newcomer = broker(&redis).await;
    while granted_at.elapsed() < Duration::from_millis(3900) {
        for app in [&newcomer, &knowing] {
            let answer = app.acquire("kept", "ttl_ms=1000").await;
            assert_ne!(
                answer.status,
                StatusCode::CREATED,
                "granted {} {:?} into the live lease with fence {}",
                answer.text,
                granted_at.elapsed(),
                held.fence
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_released_through_another_broker_is_not_put_back_after_a_loss() {
    let redis = RedisServer::start().await;
    let [one, two] = brokers::<2>(&redis).await;
    let released = one.grant("moved-on", "ttl_ms=60000").await;
    metric_until(&one, "lockbroker_ledger_leases", "1.0", |v| v == 1.0).await;
    // Behind a load balancer, the release may reach another broker; its notice tells the one
    // that granted the lease.
    two.release_ok("moved-on", &released.token).await;
    metric_until(&one, "lockbroker_ledger_leases", "0.0", |v| v == 0.0).await;
    // And a newer lease, granted by the other broker, is the one that comes back after a loss.
    let newer = two.grant("moved-on", "ttl_ms=60000").await;
    redis.flushall().await;
    let flushed = Instant::now();
    first_grant(&one, "free", flushed).await;
    expect_put_back(&[&one, &two], "moved-on", &newer).await;
    // The released token never comes back.
    one.renew("moved-on", &released.token, "")
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
}
