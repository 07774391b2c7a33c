//! Shared (read) leases on locks, over HTTP: many shared holders or one exclusive, each shared
//! holder with its own token, fence and lease; waiting exclusive acquires not starved; force
//! release. Written once, run on the embedded store and on Redis; the cross-broker checks run on
//! two brokers sharing one Redis.

use std::time::Duration;

use lockbroker_test_support::app::{Backend, TestApp, listening_apps};
use lockbroker_test_support::http::{metric, until_waiting};
use lockbroker_test_support::on_both_stores;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::{Method, StatusCode};

use crate::waiting::{answer_within, granted_promptly, released};

on_both_stores!(
    shared_leases_are_held_together_each_with_its_own_token_fence_and_lease,
    inspecting_a_shared_lock_shows_every_holder_and_the_highest_fence_and_latest_end,
    an_exclusive_lock_refuses_shared_requests_and_mode_is_validated,
    a_waiting_exclusive_acquire_is_not_starved_by_new_shared_ones,
    waiting_shared_requests_are_all_granted_when_the_exclusive_holder_releases,
    force_release_ends_every_shared_lease_only_where_it_is_allowed,
);

async fn shared_leases_are_held_together_each_with_its_own_token_fence_and_lease(b: &Backend) {
    let app = &b.app;
    let one = app.grant("reads", "mode=shared&ttl_ms=30000").await;
    let two = app.grant("reads", "mode=shared&ttl_ms=1000").await;
    assert_ne!(one.token, two.token);
    assert!(two.fence > one.fence);
    assert_eq!(two.ttl_ms, 1000);
    app.expect_locked("reads", "").await;
    // Each holder renews and releases its own lease.
    let renewed = app
        .renew("reads", &two.token, "ttl_ms=60000")
        .await
        .expect_grant(StatusCode::OK);
    assert_eq!((renewed.fence, renewed.ttl_ms), (two.fence, 60_000));
    app.release_ok("reads", &one.token).await;
    app.release("reads", &one.token)
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    app.expect_locked("reads", "").await;
    app.release_ok("reads", &two.token).await;
    let writer = app.grant("reads", "").await;
    assert!(writer.fence > two.fence, "fences rise across both modes");
}

async fn inspecting_a_shared_lock_shows_every_holder_and_the_highest_fence_and_latest_end(
    b: &Backend,
) {
    let app = &b.app;
    let long = app
        .grant("shown", "mode=shared&ttl_ms=60000&owner=reader-a")
        .await;
    let short = app.grant("shown", "mode=shared&ttl_ms=20000").await;
    let body = app.inspect_held("shown").await;
    assert_eq!(body["mode"], "shared");
    assert_eq!(body["fence"], short.fence);
    assert_eq!(body["expires_at_ms"], long.expires_at_ms);
    assert!(body["owner"].is_null());
    let holders = body["holders"].as_array().expect("holders");
    assert_eq!(holders.len(), 2);
    assert_eq!(holders[0]["fence"], long.fence);
    assert_eq!(holders[0]["owner"], "reader-a");
    assert_eq!(holders[1]["expires_at_ms"], short.expires_at_ms);
    assert!(holders[1]["owner"].is_null());
    assert!(holders[0]["ttl_remaining_ms"].as_u64().unwrap() > 50_000);
    assert!(!body.to_string().contains(&long.token) && !body.to_string().contains("token"));
}

async fn an_exclusive_lock_refuses_shared_requests_and_mode_is_validated(b: &Backend) {
    let app = &b.app;
    let writer = app.grant("solo", "mode=exclusive&owner=w").await;
    let body = app.expect_locked("solo", "mode=shared").await;
    assert!(body["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0));
    let shown = app.inspect_held("solo").await;
    assert_eq!(shown["mode"], "exclusive");
    assert_eq!(shown["fence"], writer.fence);
    assert_eq!(shown["owner"], "w");
    assert!(shown.get("holders").is_none(), "{shown}");
    for bad in ["mode=read", "mode=", "mode=Shared"] {
        app.acquire("solo-free", bad)
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    let grant = app
        .acquire_json("solo-free", "", serde_json::json!({"mode": "shared"}))
        .await
        .expect_grant(StatusCode::CREATED);
    assert!(grant.fence > 0);
}

async fn a_waiting_exclusive_acquire_is_not_starved_by_new_shared_ones(b: &Backend) {
    let app = &b.app;
    let reader = app.grant("busy", "mode=shared&ttl_ms=30000").await;
    let writer = app.spawn_acquire("busy", "wait_ms=10000");
    until_waiting(&app.address, 1).await;
    // New shared requests wait behind the writer; one that may not wait is refused.
    for _ in 0..3 {
        app.expect_locked("busy", "mode=shared").await;
    }
    let late_reader = app.spawn_acquire("busy", "mode=shared&wait_ms=10000");
    until_waiting(&app.address, 2).await;
    let since = released(app, "busy", &reader.token).await;
    let granted = granted_promptly(writer, since).await;
    assert!(
        !late_reader.is_finished(),
        "the later reader waits for the writer"
    );
    app.release_ok("busy", &granted.token).await;
    let read = answer_within(late_reader, Duration::from_secs(3))
        .await
        .expect_grant(StatusCode::CREATED);
    assert!(read.fence > granted.fence);
}

async fn waiting_shared_requests_are_all_granted_when_the_exclusive_holder_releases(b: &Backend) {
    let app = &b.app;
    let writer = app.grant("fan-out", "ttl_ms=30000").await;
    let readers: Vec<_> = (0..3)
        .map(|_| app.spawn_acquire("fan-out", "mode=shared&wait_ms=10000"))
        .collect();
    until_waiting(&app.address, 3).await;
    let since = released(app, "fan-out", &writer.token).await;
    for reader in readers {
        granted_promptly(reader, since).await;
    }
    let shown = app.inspect("fan-out").await.json();
    assert_eq!(shown["holders"].as_array().map(Vec::len), Some(3));
}

async fn force_release_ends_every_shared_lease_only_where_it_is_allowed(b: &Backend) {
    let allowed = b.another_app(|c| c.allow_force_release = Some(true)).await;
    let one = allowed.grant("forced", "mode=shared").await;
    allowed.grant("forced", "mode=shared").await;
    let force =
        |app: &TestApp, query: &str| app.request(Method::DELETE, &format!("/locks/forced?{query}"));
    let refused = b.app.send(force(&b.app, "force=true")).await;
    let body = refused.expect_error(StatusCode::FORBIDDEN, "forbidden");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("--allow-force-release")),
        "{body}"
    );
    for bad in ["force=false", "force=1", "force="] {
        allowed
            .send(force(&allowed, bad))
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    allowed
        .send(force(&allowed, "force=true").header("Lock-Token", &one.token))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    allowed
        .send(force(&allowed, "force=true"))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    allowed
        .inspect("forced")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    allowed
        .release("forced", &one.token)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    allowed
        .send(force(&allowed, "force=true"))
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let next = allowed.grant("forced", "").await;
    assert!(next.fence > one.fence);
    assert_eq!(
        metric(
            &allowed.address,
            "lockbroker_force_releases_total{space=\"locks\",result=\"released\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_lease_on_one_broker_blocks_an_exclusive_acquire_on_another_until_released() {
    let redis = RedisServer::start().await;
    let [a, b] = listening_apps(&redis).await;
    let reader = a.grant("across", "mode=shared&ttl_ms=30000").await;
    b.expect_locked("across", "").await;
    let writer = b.spawn_acquire("across", "wait_ms=10000");
    until_waiting(&b.address, 1).await;
    // The writer's intent holds new shared leases back on the other broker too.
    a.expect_locked("across", "mode=shared").await;
    let since = released(&a, "across", &reader.token).await;
    let granted = granted_promptly(writer, since).await;
    assert!(granted.fence > reader.fence);
    a.expect_locked("across", "mode=shared").await;
}
