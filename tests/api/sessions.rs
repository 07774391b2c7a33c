//! Sessions over HTTP: leases of every kind under one session, kept by its keep-alive alone and
//! ended together when it stops; close releases them at once; lock delay after an expiry only;
//! a waiter whose session ends leaves nothing behind; the secret is never shown. Written once,
//! run on the embedded store and on Redis; the cross-broker checks run on brokers sharing one
//! Redis.

use std::time::Duration;

use lockbroker_test_support::app::{Backend, TestApp, listening_apps, semaphore_path};
use lockbroker_test_support::http::{Answer, Grant, http_client, metric, until_waiting};
use lockbroker_test_support::on_both_stores;
use lockbroker_test_support::redis_server::RedisServer;
use lockbroker_test_support::redis_server::script_calls;
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio::time::Instant;

on_both_stores!(
    leases_of_every_kind_live_on_keep_alives_alone_and_end_together_when_they_stop,
    closing_releases_every_lease_at_once_and_waiters_get_the_keys,
    a_lock_delay_holds_the_keys_after_an_expiry_but_not_after_a_close,
    a_waiter_whose_session_ends_answers_no_session_and_leaves_nothing_queued,
    a_session_and_its_leases_are_shown_but_never_its_secret,
    a_lease_under_a_session_renews_to_the_session_end_and_releases_alone,
    sessions_refuse_what_the_contract_refuses,
    opening_again_with_a_request_id_answers_the_same_session,
    a_lease_granted_after_a_wait_ends_with_its_session_not_later,
);

/// Opens a session with `query`; its id and body.
pub(crate) async fn open(app: &TestApp, query: &str) -> (String, Value) {
    let body = app
        .send(app.request(Method::POST, &format!("/sessions?{query}")))
        .await
        .expect_status(StatusCode::CREATED)
        .json();
    let id = body["session"].as_str().expect("a session id").to_owned();
    (id, body)
}

/// `POST /sessions/{id}/renew`.
pub(crate) async fn keep_alive(app: &TestApp, id: &str) -> Answer {
    app.send(app.request(Method::POST, &format!("/sessions/{id}/renew")))
        .await
}

/// `DELETE /sessions/{id}`.
pub(crate) async fn close(app: &TestApp, id: &str) -> Answer {
    app.send(app.request(Method::DELETE, &format!("/sessions/{id}")))
        .await
}

/// The store's clock now, as a broker reports it (a lease's end minus its length, just granted).
fn started_ms(grant: &Grant) -> u64 {
    grant.expires_at_ms - grant.ttl_ms
}

async fn leases_of_every_kind_live_on_keep_alives_alone_and_end_together_when_they_stop(
    b: &Backend,
) {
    let app = &b.app;
    let (id, opened) = open(app, "ttl_ms=900&owner=node-1").await;
    assert_eq!(opened["ttl_ms"], 900);
    let lock = app.grant("s-lock", &format!("session={id}")).await;
    let shared = app
        .grant("s-shared", &format!("session={id}&mode=shared"))
        .await;
    let permit = app
        .send(app.request(
            Method::POST,
            &semaphore_path("s-pool", &format!("session={id}&limit=1")),
        ))
        .await;
    let permit = permit.expect_status(StatusCode::CREATED).json();
    assert_eq!(permit["session_expires_at_ms"], opened["expires_at_ms"]);
    for grant in [&lock, &shared] {
        assert_eq!(grant.session_expires_at_ms, Some(grant.expires_at_ms));
        assert_eq!(grant.expires_at_ms, opened["expires_at_ms"]);
    }
    // Past three TTLs on keep-alives alone: nobody renews the leases.
    let started = Instant::now();
    let mut last = Instant::now();
    while started.elapsed() < Duration::from_millis(3 * 900 + 300) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        last = Instant::now();
        keep_alive(app, &id).await.expect_status(StatusCode::OK);
        app.expect_locked("s-lock", "").await;
    }
    app.expect_locked("s-shared", "").await;
    // Stopped: all of them end with the session; waiters on each key get it.
    let permit_waiter = tokio::spawn(Answer::send(
        http_client().post(app.url(&semaphore_path("s-pool", "limit=1&wait_ms=5000"))),
    ));
    let waiters = [
        app.spawn_acquire("s-lock", "wait_ms=5000"),
        app.spawn_acquire("s-shared", "wait_ms=5000"),
        permit_waiter,
    ];
    let mut next = Vec::new();
    for waiter in waiters {
        let answer = waiter.await.unwrap();
        next.push(
            answer.expect_status(StatusCode::CREATED).json()["fence"]
                .as_u64()
                .unwrap(),
        );
    }
    let ended = last.elapsed();
    assert!(
        ended < Duration::from_millis(900 + 1000),
        "the leases ended {ended:?} after the last keep-alive"
    );
    let held = [lock.fence, shared.fence, permit["fence"].as_u64().unwrap()];
    for (next, held) in next.iter().zip(held) {
        assert!(*next > held);
    }
    keep_alive(app, &id)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.send(app.request(Method::GET, &format!("/sessions/{id}")))
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

async fn closing_releases_every_lease_at_once_and_waiters_get_the_keys(b: &Backend) {
    let app = &b.app;
    let (id, _) = open(app, "ttl_ms=30000&lock_delay_ms=20000").await;
    let one = app.grant("c-one", &format!("session={id}")).await;
    app.grant("c-two", &format!("session={id}")).await;
    let waiter = app.spawn_acquire("c-one", "wait_ms=10000");
    until_waiting(&app.address, 1).await;
    let closed = Instant::now();
    close(app, &id).await.expect_status(StatusCode::NO_CONTENT);
    let next = waiter.await.unwrap().expect_grant(StatusCode::CREATED);
    assert!(
        closed.elapsed() < Duration::from_secs(2),
        "no lock delay after a close"
    );
    assert!(next.fence > one.fence);
    app.grant("c-two", "").await;
    close(app, &id)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    app.acquire("c-three", &format!("session={id}"))
        .await
        .expect_error(StatusCode::NOT_FOUND, "no_session");
}

async fn a_lock_delay_holds_the_keys_after_an_expiry_but_not_after_a_close(b: &Backend) {
    let app = &b.app;
    let (id, opened) = open(app, "ttl_ms=500&lock_delay_ms=1500").await;
    assert_eq!(opened["lock_delay_ms"], 1500);
    let held = app.grant("d-key", &format!("session={id}")).await;
    // The session expires; for the delay after its end the key is granted to nobody.
    let waiter = app.spawn_acquire("d-key", "wait_ms=5000");
    let next = waiter.await.unwrap().expect_grant(StatusCode::CREATED);
    let gap = started_ms(&next) - held.expires_at_ms;
    assert!(
        (1500..1500 + 700).contains(&gap),
        "granted {gap} ms after the session's end, the lock delay is 1500 ms"
    );
    assert!(next.fence > held.fence);
    // While the delay runs, a plain acquire is refused with the time until its end.
    app.release_ok("d-key", &next.token).await;
    let (id, _) = open(app, "ttl_ms=400&lock_delay_ms=3000").await;
    app.grant("d-key", &format!("session={id}")).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let locked = app.expect_locked("d-key", "").await;
    let retry = locked["retry_after_ms"].as_u64().unwrap();
    assert!((1500..=3000).contains(&retry), "retry_after_ms {retry}");
    // A close has no delay.
    let (id, _) = open(app, "ttl_ms=30000&lock_delay_ms=30000").await;
    app.grant("d-closed", &format!("session={id}")).await;
    close(app, &id).await.expect_status(StatusCode::NO_CONTENT);
    app.grant("d-closed", "").await;
}

async fn a_waiter_whose_session_ends_answers_no_session_and_leaves_nothing_queued(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("w-key", "ttl_ms=30000").await;
    let (id, _) = open(app, "ttl_ms=800").await;
    let waiter = app.spawn_acquire("w-key", &format!("session={id}&wait_ms=20000"));
    until_waiting(&app.address, 1).await;
    // No keep-alive: the session ends while it waits.
    let asked = Instant::now();
    waiter
        .await
        .unwrap()
        .expect_error(StatusCode::NOT_FOUND, "no_session");
    assert!(
        asked.elapsed() < Duration::from_secs(4),
        "{:?}",
        asked.elapsed()
    );
    until_waiting(&app.address, 0).await;
    // Nothing of it is left: the holder's release frees the key for a request that does not
    // wait (a queued entry would hold it back).
    app.release_ok("w-key", &holder.token).await;
    app.grant("w-key", "").await;
    // A waiter under a session that is closed stops too.
    let blocker = app.grant("w-two", "ttl_ms=30000").await;
    let (id, _) = open(app, "ttl_ms=30000").await;
    let waiter = app.spawn_acquire("w-two", &format!("session={id}&wait_ms=20000"));
    until_waiting(&app.address, 1).await;
    close(app, &id).await.expect_status(StatusCode::NO_CONTENT);
    waiter
        .await
        .unwrap()
        .expect_error(StatusCode::NOT_FOUND, "no_session");
    app.release_ok("w-two", &blocker.token).await;
    app.grant("w-two", "").await;
}

async fn a_session_and_its_leases_are_shown_but_never_its_secret(b: &Backend) {
    let app = &b.app;
    let (id, _) = open(app, "ttl_ms=20000&owner=node-7&lock_delay_ms=250").await;
    let lock = app.grant("v-lock", &format!("session={id}")).await;
    let labelled = app
        .grant("v-own", &format!("session={id}&owner=job-9&mode=shared"))
        .await;
    let shown = app
        .send(app.request(Method::GET, &format!("/sessions/{id}")))
        .await
        .expect_status(StatusCode::OK)
        .json();
    assert_eq!(shown["owner"], "node-7");
    assert_eq!(shown["lock_delay_ms"], 250);
    assert!(shown["ttl_remaining_ms"].as_u64().unwrap() > 10_000);
    let leases = shown["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 2, "{shown}");
    assert_eq!(leases[0]["key"], "v-lock");
    assert_eq!(leases[0]["fence"], lock.fence);
    assert_eq!(leases[0]["mode"], "exclusive");
    assert_eq!(leases[1]["mode"], "shared");
    assert_eq!(leases[1]["fence"], labelled.fence);
    let inspected = app.inspect_held("v-lock").await;
    assert_eq!(inspected["session"], true);
    assert_eq!(
        inspected["owner"], "node-7",
        "the session's label when the lease has none"
    );
    let shared = app.inspect_held("v-own").await;
    assert_eq!(shared["holders"][0]["owner"], "job-9");
    assert_eq!(shared["holders"][0]["session"], true);
    let plain = app.grant("v-plain", "").await;
    assert!(app.inspect_held("v-plain").await.get("session").is_none());
    app.release_ok("v-plain", &plain.token).await;
    let listed = app.get("/locks?prefix=v-").await.json();
    assert_eq!(listed["locks"][0]["session"], true);
    for body in [shown, inspected, shared, listed] {
        let text = body.to_string();
        assert!(!text.contains(&id) && !text.contains(&lock.token), "{text}");
    }
}

async fn a_lease_under_a_session_renews_to_the_session_end_and_releases_alone(b: &Backend) {
    let app = &b.app;
    let (id, opened) = open(app, "ttl_ms=20000&lock_delay_ms=500").await;
    let one = app.grant("r-one", &format!("session={id}")).await;
    let two = app.grant("r-two", &format!("session={id}")).await;
    // A renewal by token answers the session's end and changes nothing.
    let renewed = app
        .renew("r-one", &one.token, "ttl_ms=1000")
        .await
        .expect_grant(StatusCode::OK);
    // The session's end — give or take the grant's own round trip: a lease asks for what is left
    // of its session as its broker measures it, so it may end a millisecond or so later.
    let session_ends = opened["expires_at_ms"].as_u64().unwrap();
    assert!(
        (session_ends..session_ends + 50).contains(&renewed.expires_at_ms),
        "renewed to {}, the session ends at {session_ends}",
        renewed.expires_at_ms
    );
    assert_eq!(renewed.fence, one.fence);
    app.release_ok("r-one", &one.token).await;
    app.grant("r-one", "").await;
    // The session and its other lease go on.
    let kept = keep_alive(app, &id)
        .await
        .expect_status(StatusCode::OK)
        .json();
    assert!(kept["expires_at_ms"].as_u64() >= opened["expires_at_ms"].as_u64());
    app.expect_locked("r-two", "").await;
    let shown = app
        .send(app.request(Method::GET, &format!("/sessions/{id}")))
        .await
        .json();
    assert_eq!(shown["leases"].as_array().unwrap().len(), 1, "{shown}");
    assert_eq!(shown["leases"][0]["fence"], two.fence);
}

async fn sessions_refuse_what_the_contract_refuses(b: &Backend) {
    let app = &b.app;
    let (id, _) = open(app, "").await;
    app.acquire("x-key", &format!("session={id}&ttl_ms=1000"))
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    app.acquire("x-key", "session=no-such-session")
        .await
        .expect_error(StatusCode::NOT_FOUND, "no_session");
    app.acquire("x-key", "session=not%20one")
        .await
        .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    for query in [
        "lock_delay_ms=60001",
        "ttl_ms=0",
        "ttl_ms=99999999999",
        "tll_ms=5",
    ] {
        app.send(app.request(Method::POST, &format!("/sessions?{query}")))
            .await
            .expect_error(StatusCode::BAD_REQUEST, "invalid_request");
    }
    keep_alive(app, "no-such-session")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    close(app, "no-such-session")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    // The defaults: a lease's TTL, no delay.
    let shown = app
        .send(app.request(Method::GET, &format!("/sessions/{id}")))
        .await
        .json();
    assert_eq!(
        (shown["ttl_ms"].as_u64(), shown["lock_delay_ms"].as_u64()),
        (Some(30_000), Some(0))
    );
    assert!(shown["owner"].is_null());
    assert_eq!(
        metric(&app.address, "lockbroker_sessions_total{event=\"opened\"}").await,
        1.0
    );
}

async fn opening_again_with_a_request_id_answers_the_same_session(b: &Backend) {
    let app = &b.app;
    let (first, _) = open(app, "ttl_ms=5000&request_id=open-1").await;
    let (again, _) = open(app, "ttl_ms=5000&request_id=open-1").await;
    assert_eq!(first, again);
    let (other, _) = open(app, "ttl_ms=5000&request_id=open-2").await;
    assert_ne!(first, other);
    close(app, &first)
        .await
        .expect_status(StatusCode::NO_CONTENT);
    let (after, _) = open(app, "ttl_ms=5000&request_id=open-1").await;
    assert_ne!(after, first, "a closed session is not answered again");
}

/// A waiter under a session granted when the holder's lease expires (on its own ask, nobody
/// offering it the key) gets a lease that ends with its session, not the time it waited later.
async fn a_lease_granted_after_a_wait_ends_with_its_session_not_later(b: &Backend) {
    let app = &b.app;
    app.grant("g-key", "ttl_ms=1500").await;
    let (id, opened) = open(app, "ttl_ms=6000").await;
    let granted = app
        .acquire("g-key", &format!("session={id}&wait_ms=5000"))
        .await
        .expect_grant(StatusCode::CREATED);
    assert_eq!(
        granted.session_expires_at_ms,
        opened["expires_at_ms"].as_u64()
    );
    let shown = app.inspect_held("g-key").await;
    let ends = shown["expires_at_ms"].as_u64().unwrap();
    let session_ends = opened["expires_at_ms"].as_u64().unwrap();
    assert!(
        ends <= session_ends + 50,
        "the lease ends {} ms after its session",
        ends - session_ends
    );
}

/// Open on one broker, keep alive on another, acquire on a third: one session for the fleet; its
/// expiry frees keys for waiters on every broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_session_serves_every_broker_on_the_store() {
    let redis = RedisServer::start().await;
    let [one, two, three] = listening_apps::<3>(&redis).await;
    let (id, _) = open(&one, "ttl_ms=1000").await;
    let held = three.grant("fleet", &format!("session={id}")).await;
    let waiter = two.spawn_acquire("fleet", "wait_ms=10000");
    let mut last = Instant::now();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        last = Instant::now();
        keep_alive(&two, &id).await.expect_status(StatusCode::OK);
    }
    assert!(
        !waiter.is_finished(),
        "the keep-alives on another broker kept the lease"
    );
    let next = waiter.await.unwrap().expect_grant(StatusCode::CREATED);
    assert!(last.elapsed() < Duration::from_millis(1000 + 1000));
    assert!(next.fence > held.fence);
    close(&three, &id)
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
}

/// On one Redis a keep-alive costs the store two script calls — the session's record, then
/// every lease under it in one KEEP — whatever the number of leases; each lease still ends with
/// the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_costs_one_redis_two_script_calls_whatever_the_number_of_leases() {
    let b = Backend::start(lockbroker_test_support::app::StoreKind::Redis).await;
    let (app, redis) = (&b.app, b.redis.as_ref().unwrap());
    let (id, _) = open(app, "ttl_ms=20000").await;
    for leases in [1, 10, 60] {
        for i in 0..leases {
            app.grant(&format!("k-{leases}-{i}"), &format!("session={id}"))
                .await;
        }
        // Once first, so that every script is cached: a script's first call may be an `FCALL`
        // or `EVALSHA` answered that the server lacks it, and the call again.
        keep_alive(app, &id).await.expect_status(StatusCode::OK);
        let before = redis.command_counts().await;
        let kept = keep_alive(app, &id)
            .await
            .expect_status(StatusCode::OK)
            .json();
        let after = redis.command_counts().await;
        // Script calls (the broker's background epoch check runs with plain `EVAL`).
        let calls = script_calls(&after) - script_calls(&before);
        assert_eq!(
            calls, 2,
            "a keep-alive with {leases} more leases: {after:?}"
        );
        let shown = app.inspect_held(&format!("k-{leases}-0")).await;
        assert_eq!(shown["expires_at_ms"], kept["expires_at_ms"]);
    }
}
