//! Several keys at once over HTTP: every key or none, one token and a fence per key, the busy
//! keys named on `409`, nothing held after a refusal, `request_id`, the release of several keys
//! and of one, and requests for the same keys in opposite orders that all complete. Written once,
//! run on the embedded store and on Redis.

use std::time::Duration;

use lockbroker_test_support::app::{Backend, TestApp};
use lockbroker_test_support::http::Answer;
use lockbroker_test_support::on_both_stores;
use lockbroker_test_support::redis_server::script_calls;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

on_both_stores!(
    every_key_is_granted_with_one_token_and_a_fence_each_in_the_order_asked,
    a_busy_key_refuses_them_all_names_it_and_leaves_none_held,
    a_request_id_gets_the_same_leases_again,
    keys_are_released_together_or_one_by_one_with_the_one_token,
    requests_for_the_same_keys_in_opposite_orders_all_complete,
    bad_key_lists_are_refused,
    several_keys_under_a_session_are_kept_and_closed_together,
    a_key_whose_lease_expired_is_taken_over_beside_free_ones,
);

async fn acquire(app: &TestApp, body: Value) -> Answer {
    app.send(app.request(Method::POST, "/locks").json(&body))
        .await
}

async fn release(app: &TestApp, keys: &str, token: &str) -> Answer {
    app.send(
        app.request(Method::DELETE, &format!("/locks?keys={keys}"))
            .header("Lock-Token", token),
    )
    .await
}

async fn every_key_is_granted_with_one_token_and_a_fence_each_in_the_order_asked(b: &Backend) {
    let app = &b.app;
    let before = app.grant("m-b", "").await;
    app.release_ok("m-b", &before.token).await;
    let body = acquire(app, json!({"keys": ["m-c", "m-a", "m-b"], "ttl_ms": 20000}))
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    let token = body["token"].as_str().unwrap();
    let leases = body["leases"].as_array().unwrap();
    let keys: Vec<_> = leases.iter().map(|l| l["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["m-c", "m-a", "m-b"]);
    assert!(leases[2]["fence"].as_u64().unwrap() > before.fence);
    assert_eq!(body["ttl_ms"], 20000);
    for key in keys {
        app.expect_locked(key, "").await;
        // Each key's lease renews with the one token.
        app.renew(key, token, "ttl_ms=30000")
            .await
            .expect_status(StatusCode::OK);
    }
}

async fn a_busy_key_refuses_them_all_names_it_and_leaves_none_held(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("n-b", "ttl_ms=20000").await;
    let answer = acquire(app, json!({"keys": ["n-a", "n-b", "n-c"], "wait_ms": 300})).await;
    let body = answer.expect_error(StatusCode::CONFLICT, "locked");
    assert_eq!(body["held"], json!(["n-b"]));
    assert!(body["retry_after_ms"].as_u64().unwrap() > 0);
    assert!(answer.header("retry-after").is_some());
    // Nothing of it is left held: the other keys are free at once.
    for key in ["n-a", "n-c"] {
        let free = app.grant(key, "").await;
        app.release_ok(key, &free.token).await;
    }
    app.release_ok("n-b", &holder.token).await;
}

async fn a_request_id_gets_the_same_leases_again(b: &Backend) {
    let app = &b.app;
    let ask = json!({"keys": ["r-1", "r-2"], "request_id": "several-1"});
    let first = acquire(app, ask.clone())
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    let again = acquire(app, ask)
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    assert_eq!(first["token"], again["token"]);
    assert_eq!(first["leases"], again["leases"]);
}

async fn keys_are_released_together_or_one_by_one_with_the_one_token(b: &Backend) {
    let app = &b.app;
    let body = acquire(app, json!({"keys": ["d-1", "d-2", "d-3"]}))
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    let token = body["token"].as_str().unwrap();
    app.release_ok("d-3", token).await;
    let answer = release(app, "d-1,d-2,d-3", token).await;
    let results = answer.expect_status(StatusCode::OK).json()["results"].clone();
    assert_eq!(
        results,
        json!([
            {"key": "d-1", "status": 204},
            {"key": "d-2", "status": 204},
            {"key": "d-3", "status": 404}
        ])
    );
    app.grant("d-1", "").await;
}

async fn requests_for_the_same_keys_in_opposite_orders_all_complete(b: &Backend) {
    let app = &b.app;
    let app_url = app.url("/locks");
    let mut waiting = Vec::new();
    for i in 0..6 {
        let keys = if i % 2 == 0 {
            ["o-a", "o-b"]
        } else {
            ["o-b", "o-a"]
        };
        let request = app
            .request(Method::POST, "/locks")
            .json(&json!({"keys": keys, "wait_ms": 20000, "ttl_ms": 20000}));
        let url = app_url.clone();
        // Each holder releases both keys as soon as it has them.
        waiting.push(tokio::spawn(async move {
            let body = Answer::send(request)
                .await
                .expect_status(StatusCode::CREATED)
                .json();
            let released = lockbroker_test_support::http::http_client()
                .delete(format!("{url}?keys=o-a,o-b"))
                .header("Lock-Token", body["token"].as_str().unwrap())
                .send()
                .await
                .unwrap();
            assert_eq!(released.status(), StatusCode::OK);
        }));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    for handle in waiting {
        tokio::time::timeout_at(deadline, handle)
            .await
            .expect("a request for both keys did not complete: deadlock")
            .expect("the request task");
    }
}

async fn bad_key_lists_are_refused(b: &Backend) {
    let app = &b.app;
    let many: Vec<String> = (0..65).map(|i| format!("k{i}")).collect();
    for body in [
        json!({"keys": []}),
        json!({"keys": ["a", "a"]}),
        json!({"keys": many}),
        json!({"keys": ["a/b"]}),
        json!({}),
        json!({"keys": ["a"], "bogus": 1}),
    ] {
        acquire(app, body)
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    release(app, "", "some-token")
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
}

/// Several keys under a session: the keep-alive keeps every one of them (one token for all),
/// and a close releases every one.
async fn several_keys_under_a_session_are_kept_and_closed_together(b: &Backend) {
    let app = &b.app;
    let opened = app
        .send(app.request(Method::POST, "/sessions?ttl_ms=800"))
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    let id = opened["session"].as_str().unwrap().to_owned();
    acquire(app, json!({"keys": ["u-1", "u-2", "u-3"], "session": id}))
        .await
        .expect_status(StatusCode::CREATED);
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        app.send(app.request(Method::POST, &format!("/sessions/{id}/renew")))
            .await
            .expect_status(StatusCode::OK);
    }
    for key in ["u-1", "u-2", "u-3"] {
        app.expect_locked(key, "").await;
    }
    app.send(app.request(Method::DELETE, &format!("/sessions/{id}")))
        .await
        .expect_status(StatusCode::NO_CONTENT);
    for key in ["u-1", "u-2", "u-3"] {
        app.grant(key, "").await;
    }
}

async fn a_key_whose_lease_expired_is_taken_over_beside_free_ones(b: &Backend) {
    let app = &b.app;
    let gone = app.grant("x-b", "ttl_ms=100").await;
    // Its holder never releases it: the lease ends at its TTL, and stays in the key.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let body = acquire(app, json!({"keys": ["x-a", "x-b", "x-c"], "ttl_ms": 20000}))
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    let leases = body["leases"].as_array().unwrap();
    assert!(leases[1]["fence"].as_u64().unwrap() > gone.fence);
    for key in ["x-a", "x-b", "x-c"] {
        app.expect_locked(key, "").await;
    }
}

/// On one Redis, keys that are all free cost one script call whatever their number; a busy one
/// costs that try and then the keys' own calls, in order, up to the busy one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_keys_are_granted_in_one_redis_script_call() {
    let b = Backend::start(lockbroker_test_support::app::StoreKind::Redis).await;
    let (app, redis) = (&b.app, b.redis.as_ref().unwrap());
    // Once first, so that every script is cached: a script's first call may be an `EVALSHA`
    // answered NOSCRIPT and an `EVAL`.
    acquire(app, json!({"keys": ["warm-1", "warm-2"]}))
        .await
        .expect_status(StatusCode::CREATED);
    for n in [2, 8, 64] {
        let keys: Vec<String> = (0..n).map(|i| format!("one-{n}-{i:02}")).collect();
        let before = redis.command_counts().await;
        let body = acquire(app, json!({"keys": keys}))
            .await
            .expect_status(StatusCode::CREATED)
            .json();
        let after = redis.command_counts().await;
        // Script calls (the broker's background epoch check runs with plain `EVAL`).
        assert_eq!(
            script_calls(&after) - script_calls(&before),
            1,
            "{n} free keys: {before:?} {after:?}"
        );
        let leases = body["leases"].as_array().unwrap();
        assert_eq!(leases.len(), n);
        for key in [&keys[0], &keys[n - 1]] {
            app.expect_locked(key, "").await;
        }
    }
    // The third of four keys is busy: the one try, then the first two keys' claims and the
    // third's refusal and look (then the two taken are released).
    let holder = app.grant("busy-3", "ttl_ms=20000").await;
    let before = redis.command_counts().await;
    acquire(
        app,
        json!({"keys": ["busy-1", "busy-2", "busy-3", "busy-4"]}),
    )
    .await
    .expect_error(StatusCode::CONFLICT, "locked");
    let after = redis.command_counts().await;
    assert!(
        script_calls(&after) - script_calls(&before) >= 5,
        "{after:?}"
    );
    app.release_ok("busy-3", &holder.token).await;
}
