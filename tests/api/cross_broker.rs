//! Several brokers on one Redis: they share the locks, the tokens, the fences and the clock.

use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app, spawn_app_with};
use lockbroker_test_support::redis;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::StatusCode;

use crate::waiting::{granted_promptly, parked, released};

async fn three_brokers(redis: &RedisServer) -> [TestApp; 3] {
    [
        spawn_app(Some(redis.url())).await,
        spawn_app(Some(redis.url())).await,
        spawn_app(Some(redis.url())).await,
    ]
}

/// Polls `/readyz` until it is 200, for at most `limit`. Returns how long it took.
pub(crate) async fn wait_until_ready(app: &TestApp, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let answer = app.get("/readyz").await;
        if answer.status == StatusCode::OK {
            return started.elapsed();
        }
        answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
        assert!(
            started.elapsed() < limit,
            "the broker was not ready {limit:?} after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_taken_on_one_broker_is_refused_on_another_released_on_a_third_and_then_granted_on_the_second()
 {
    let redis = RedisServer::start().await;
    let [one, two, three] = three_brokers(&redis).await;
    let grant = one.grant("shared", "").await;
    two.expect_locked("shared", "").await;
    three.release_ok("shared", &grant.token).await;
    let next = two.grant("shared", "").await;
    assert!(next.fence > grant.fence);
    one.expect_locked("shared", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_works_on_any_broker_sharing_the_store() {
    let redis = RedisServer::start().await;
    let [one, two, three] = three_brokers(&redis).await;
    let grant = one.grant("roaming", "ttl_ms=5000").await;
    let renewed = two
        .renew("roaming", &grant.token, "ttl_ms=60000")
        .await
        .expect_grant(StatusCode::OK);
    assert_eq!(renewed.token, grant.token);
    assert_eq!(renewed.fence, grant.fence);
    let shown = three.inspect_held("roaming").await;
    assert_eq!(shown["expires_at_ms"], renewed.expires_at_ms);
    // A wrong token is refused on every broker alike.
    let other = one.grant("elsewhere", "").await;
    for app in [&one, &two, &three] {
        app.release("roaming", &other.token)
            .await
            .expect_error(StatusCode::CONFLICT, "not_owner");
    }
    three.release_ok("roaming", &grant.token).await;
    for app in [&one, &two, &three] {
        app.inspect("roaming")
            .await
            .expect_error(StatusCode::NOT_FOUND, "not_held");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_on_one_redis_report_the_same_expiry_for_a_lease() {
    let redis = RedisServer::start().await;
    let [one, two, three] = three_brokers(&redis).await;
    let grant = two.grant("clock", "ttl_ms=20000").await;
    for app in [&one, &two, &three] {
        let shown = app.inspect_held("clock").await;
        assert_eq!(shown["expires_at_ms"], grant.expires_at_ms);
        assert_eq!(shown["fence"], grant.fence);
    }
    // A lock refused on another broker names the same end of lease.
    let body = one.expect_locked("clock", "").await;
    assert!(
        body["retry_after_ms"]
            .as_u64()
            .is_some_and(|ms| ms <= 20_000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_keep_rising_after_redis_restarts_without_its_data() {
    let mut redis = RedisServer::start().await;
    // No settle time: grants resume as soon as the lease is back (the hold has tests of its
    // own in `store_loss`).
    let app = spawn_app_with(Some(redis.url()), |c| c.store_settle_ms = Some(0)).await;
    let mut last = 0;
    for _ in 0..3 {
        let grant = app.grant("durable", "").await;
        assert!(grant.fence > last);
        last = grant.fence;
        app.release_ok("durable", &grant.token).await;
    }
    let held = app.grant("durable", "ttl_ms=60000").await;
    redis.restart().await;
    wait_until_ready(&app, Duration::from_secs(5)).await;
    // Redis lost everything; the broker put the live lease back, and its holder releases it...
    app.release_ok("durable", &held.token).await;
    // ...and the next fence is above every fence granted before, though the counter was lost.
    let next = app.grant("durable", "").await;
    next.assert_fence_above(&held, "Redis lost its data");
    // And it keeps rising from there.
    app.release_ok("durable", &next.token).await;
    assert!(app.grant("durable", "").await.fence > next.fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_writes_redis_keys_only_under_its_prefix() {
    let redis = RedisServer::start().await;
    let app = spawn_app_with(Some(redis.url()), |c| {
        c.key_prefix = Some("apitest:".into())
    })
    .await;
    app.grant("orders:42", "").await;
    app.grant("x", "").await;
    let mut conn = redis.connection().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    assert!(!keys.is_empty(), "the locks must be in Redis");
    assert!(
        keys.iter().all(|k| k.starts_with("apitest:")),
        "keys outside the prefix: {keys:?}"
    );
    assert!(keys.iter().any(|k| k.contains("orders:42")), "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_with_different_prefixes_do_not_share_locks() {
    let redis = RedisServer::start().await;
    let blue = spawn_app_with(Some(redis.url()), |c| c.key_prefix = Some("blue:".into())).await;
    let green = spawn_app_with(Some(redis.url()), |c| c.key_prefix = Some("green:".into())).await;
    blue.grant("deploy", "").await;
    green.grant("deploy", "").await;
    blue.expect_locked("deploy", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_on_the_embedded_store_do_not_share_locks() {
    let one = spawn_app(None).await;
    let two = spawn_app(None).await;
    let grant = one.grant("local", "").await;
    two.inspect("local")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    two.grant("local", "").await;
    two.release("local", &grant.token)
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_one_broker_wakes_a_waiter_on_another_at_once() {
    let redis = RedisServer::start().await;
    let [one, two, three] = three_brokers(&redis).await;
    redis.wait_until_listening(3).await;
    let holder = one.grant("relay", "ttl_ms=30000").await;
    let waiter = parked(&two, "relay").await;
    let since = released(&three, "relay", &holder.token).await;
    let grant = granted_promptly(waiter, since).await;
    assert!(grant.fence > holder.fence);
}
