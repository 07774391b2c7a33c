//! Semaphores over HTTP: up to `limit` permits on `/semaphores/{key}`, each a lease with its
//! own token and fence; `limit_mismatch`; renew, release, inspect and `request_id` as for locks;
//! waiting for a permit. Written once, run on the embedded store and on Redis; the limit across
//! brokers runs on two brokers sharing one Redis.

use std::time::Instant;

use lockbroker::store::MAX_SEMAPHORE_LIMIT;
use lockbroker_test_support::app::{Backend, TestApp, listening_apps, semaphore_path};
use lockbroker_test_support::http::Answer;
use lockbroker_test_support::http::{assert_fields, until_waiting};
use lockbroker_test_support::on_both_stores;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::waiting::answered_promptly;

on_both_stores!(
    a_semaphore_grants_up_to_limit_permits_then_answers_locked,
    limit_is_required_and_from_1_to_the_most_permits,
    another_limit_is_409_limit_mismatch_naming_the_holders_limit,
    permits_renew_release_and_repeat_by_request_id_as_leases_do,
    a_waiting_request_gets_a_permit_when_one_is_released,
    a_semaphore_and_a_lock_of_one_name_are_unrelated,
    force_release_ends_every_permit_where_it_is_allowed,
);

/// Takes a permit and checks the `201` body: a grant plus `limit`, nothing else.
async fn permit(app: &TestApp, key: &str, query: &str) -> Value {
    let body = app
        .take(key, query)
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    assert_fields(
        &body,
        &["expires_at_ms", "fence", "key", "limit", "token", "ttl_ms"],
    );
    body
}

/// `DELETE /semaphores/{key}` with `token`: gives a permit back.
async fn give_back(app: &TestApp, key: &str, token: &str) -> Answer {
    let path = semaphore_path(key, "");
    app.with_token(Method::DELETE, &path, token).await
}

fn token(body: &Value) -> &str {
    body["token"].as_str().expect("a token")
}

async fn a_semaphore_grants_up_to_limit_permits_then_answers_locked(b: &Backend) {
    let app = &b.app;
    let one = permit(app, "pool", "limit=2&ttl_ms=20000").await;
    let two = permit(app, "pool", "limit=2&ttl_ms=30000&owner=second").await;
    assert_eq!(one["limit"], 2);
    assert_ne!(token(&one), token(&two));
    assert!(two["fence"].as_u64() > one["fence"].as_u64());
    let full = app.take("pool", "limit=2").await;
    let body = full.expect_error(StatusCode::CONFLICT, "locked");
    assert!(
        body["retry_after_ms"]
            .as_u64()
            .is_some_and(|ms| ms > 15_000 && ms <= 20_000),
        "the first permit ends first: {body}"
    );
    assert!(full.header("retry-after").is_some());
    let shown = app
        .get("/semaphores/pool")
        .await
        .expect_status(StatusCode::OK)
        .json();
    assert_eq!(shown["key"], "pool");
    assert_eq!(shown["limit"], 2);
    let holders = shown["holders"].as_array().expect("holders");
    assert_eq!(holders.len(), 2);
    assert_eq!(holders[1]["owner"], "second");
    assert_eq!(holders[1]["fence"], two["fence"]);
    assert!(!shown.to_string().contains(token(&one)));
}

async fn limit_is_required_and_from_1_to_the_most_permits(b: &Backend) {
    let app = &b.app;
    let over = format!("limit={}", MAX_SEMAPHORE_LIMIT + 1);
    for bad in ["", "limit=0", &over, "limit=-1", "limit=two"] {
        app.take("bounds", bad)
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    permit(app, "bounds", &format!("limit={MAX_SEMAPHORE_LIMIT}")).await;
    permit(app, "bounds-1", "limit=1").await;
    app.send(
        app.request(Method::POST, "/semaphores/bounds-json")
            .json(&serde_json::json!({"limit": 3, "ttl_ms": 5000})),
    )
    .await
    .expect_status(StatusCode::CREATED);
}

async fn another_limit_is_409_limit_mismatch_naming_the_holders_limit(b: &Backend) {
    let app = &b.app;
    let held = permit(app, "mismatch", "limit=3").await;
    let body = app
        .take("mismatch", "limit=5&wait_ms=200")
        .await
        .expect_error(StatusCode::CONFLICT, "limit_mismatch");
    assert_eq!(body["limit"], 3);
    give_back(app, "mismatch", token(&held))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    // Nobody holds a permit now: another limit is fine.
    permit(app, "mismatch", "limit=5").await;
}

async fn permits_renew_release_and_repeat_by_request_id_as_leases_do(b: &Backend) {
    let app = &b.app;
    let first = permit(app, "renewed", "limit=2&ttl_ms=5000&request_id=job-1").await;
    let again = permit(app, "renewed", "limit=2&ttl_ms=5000&request_id=job-1").await;
    assert_eq!(
        (token(&again), &again["fence"]),
        (token(&first), &first["fence"])
    );
    let other = permit(app, "renewed", "limit=2").await;
    let path = semaphore_path("renewed/renew", "ttl_ms=60000");
    let renewed = app.with_token(Method::POST, &path, token(&first)).await;
    renewed.expect_status(StatusCode::OK);
    // The acquire's body again: same token and fence, the new lease, the semaphore's limit.
    let renewed = renewed.json();
    assert_eq!(renewed["token"], first["token"]);
    assert_eq!(renewed["fence"], first["fence"]);
    assert_eq!(renewed["ttl_ms"], 60_000);
    assert_eq!(renewed["limit"], 2);
    // Each permit given back twice: the second time, another permit holds (`not_owner`), then
    // none does (`not_held`).
    for (permit, status, again) in [
        (&first, StatusCode::CONFLICT, "not_owner"),
        (&other, StatusCode::NOT_FOUND, "not_held"),
    ] {
        give_back(app, "renewed", token(permit))
            .await
            .expect_status(StatusCode::NO_CONTENT);
        give_back(app, "renewed", token(permit))
            .await
            .expect_error(status, again);
    }
    app.get("/semaphores/renewed")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

async fn a_waiting_request_gets_a_permit_when_one_is_released(b: &Backend) {
    let app = &b.app;
    let held = permit(app, "queue", "limit=1&ttl_ms=30000").await;
    let waiter = app.spawn_take("queue", "limit=1&wait_ms=10000");
    until_waiting(&app.address, 1).await;
    give_back(app, "queue", token(&held))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    let granted = answered_promptly(waiter, Instant::now()).await;
    assert!(granted.json()["fence"].as_u64() > held["fence"].as_u64());
}

async fn a_semaphore_and_a_lock_of_one_name_are_unrelated(b: &Backend) {
    let app = &b.app;
    let sem = permit(app, "twin", "limit=1").await;
    let lock = app.grant("twin", "").await;
    app.inspect("twin").await.expect_status(StatusCode::OK);
    // A lock's token does not release a permit, nor the other way round.
    give_back(app, "twin", &lock.token)
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    app.release("twin", token(&sem))
        .await
        .expect_error(StatusCode::CONFLICT, "not_owner");
    app.release_ok("twin", &lock.token).await;
    app.get("/semaphores/twin")
        .await
        .expect_status(StatusCode::OK);
}

async fn force_release_ends_every_permit_where_it_is_allowed(b: &Backend) {
    let allowed = b.another_app(|c| c.allow_force_release = Some(true)).await;
    permit(&allowed, "forced-sem", "limit=3").await;
    permit(&allowed, "forced-sem", "limit=3").await;
    let force = |app: &TestApp| app.request(Method::DELETE, "/semaphores/forced-sem?force=true");
    b.app
        .send(force(&b.app))
        .await
        .expect_error(StatusCode::FORBIDDEN, "forbidden");
    allowed
        .send(force(&allowed))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    allowed
        .get("/semaphores/forced-sem")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    allowed
        .send(force(&allowed))
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphores_limit_holds_across_brokers_and_a_release_on_one_wakes_a_waiter_on_another() {
    let redis = RedisServer::start().await;
    let [a, b] = listening_apps(&redis).await;
    let one = permit(&a, "shared-pool", "limit=2&ttl_ms=30000").await;
    permit(&b, "shared-pool", "limit=2&ttl_ms=30000").await;
    for app in [&a, &b] {
        app.take("shared-pool", "limit=2")
            .await
            .expect_error(StatusCode::CONFLICT, "locked");
        let body = app
            .take("shared-pool", "limit=4")
            .await
            .expect_error(StatusCode::CONFLICT, "limit_mismatch");
        assert_eq!(body["limit"], 2);
    }
    let waiter = b.spawn_take("shared-pool", "limit=2&wait_ms=10000");
    until_waiting(&b.address, 1).await;
    give_back(&a, "shared-pool", token(&one))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    answered_promptly(waiter, Instant::now()).await;
    let shown = a.get("/semaphores/shared-pool").await.json();
    assert_eq!(shown["holders"].as_array().map(Vec::len), Some(2));
}
