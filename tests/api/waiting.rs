//! Waiting acquires: woken at once by a release (not at their next poll), served in arrival order
//! on a broker, capped per broker, and forgotten when their client goes away.

use std::time::{Duration, Instant};

use lockbroker_test_support::app::{Backend, TestApp};
use lockbroker_test_support::http::{Answer, Grant, until_waiting};
use lockbroker_test_support::on_both_stores;
use reqwest::StatusCode;
use tokio::task::JoinHandle;

on_both_stores!(
    a_release_wakes_a_waiting_acquire_at_once,
    a_renewal_that_shortens_the_lease_wakes_a_waiting_acquire,
    waiters_on_one_broker_are_served_in_arrival_order,
    an_abandoned_waiter_stops_waiting_and_leaves_no_lease_behind,
    an_abandoned_waiter_hands_its_place_to_the_next_in_line,
    a_waiter_past_max_waiters_is_refused_at_once_with_503_too_many_waiters,
);

/// How soon a woken waiter must be granted. A waiter that missed the wake-up only looks again at
/// its fallback poll, at least 750 ms after it started waiting (1 s less its jitter), so these
/// tests release at least 550 ms before that; a wake-up by notice takes milliseconds.
pub(crate) const PROMPTLY: Duration = Duration::from_millis(300);

/// How long the tests give a waiter to reach the broker and find the lock held, when nothing
/// over HTTP can tell that it has. Only an upper bound: the tests check it is still waiting.
pub(crate) const SETTLE: Duration = Duration::from_millis(200);

/// Awaits a waiter's answer, for at most `limit`.
pub(crate) async fn answer_within(waiter: JoinHandle<Answer>, limit: Duration) -> Answer {
    tokio::time::timeout(limit, waiter)
        .await
        .unwrap_or_else(|_| panic!("the waiter was not answered within {limit:?}"))
        .expect("the waiter task")
}

/// Starts an acquire of `key` on `app` that waits up to 10 s, and gives it [`SETTLE`] to reach
/// the broker and find the lock held: it must still be waiting then.
pub(crate) async fn parked(app: &TestApp, key: &str) -> JoinHandle<Answer> {
    let waiter = app.spawn_acquire(key, "wait_ms=10000");
    tokio::time::sleep(SETTLE).await;
    assert!(!waiter.is_finished(), "the waiter must be waiting");
    waiter
}

/// Releases the lock lease `token` holds on `key` (`204`), and says when.
pub(crate) async fn released(app: &TestApp, key: &str, token: &str) -> Instant {
    app.release_ok(key, token).await;
    Instant::now()
}

/// Awaits `waiter`'s `201`, which must come within [`PROMPTLY`] of `since`: when what it
/// waited for ended (a release, a shortened lease).
pub(crate) async fn answered_promptly(waiter: JoinHandle<Answer>, since: Instant) -> Answer {
    let answer = answer_within(waiter, Duration::from_secs(3)).await;
    answer.expect_status(StatusCode::CREATED);
    assert!(
        since.elapsed() < PROMPTLY,
        "granted {:?} after what it waited for ended",
        since.elapsed()
    );
    answer
}

/// [`answered_promptly`], as the lock grant it must be.
pub(crate) async fn granted_promptly(waiter: JoinHandle<Answer>, since: Instant) -> Grant {
    answered_promptly(waiter, since)
        .await
        .expect_grant(StatusCode::CREATED)
}

async fn a_release_wakes_a_waiting_acquire_at_once(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("wake", "ttl_ms=30000").await;
    let waiter = parked(app, "wake").await;
    let since = released(app, "wake", &holder.token).await;
    let grant = granted_promptly(waiter, since).await;
    assert!(grant.fence > holder.fence);
}

async fn a_renewal_that_shortens_the_lease_wakes_a_waiting_acquire(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("shorten", "ttl_ms=30000").await;
    let waiter = parked(app, "shorten").await;
    // The waiter was told the lease ends in 30 s; now it ends in 1 ms.
    app.renew("shorten", &holder.token, "ttl_ms=1")
        .await
        .expect_grant(StatusCode::OK);
    let grant = granted_promptly(waiter, Instant::now()).await;
    assert!(grant.fence > holder.fence);
}

/// Starts an acquire that waits, takes the lock, releases it at once and returns its fence.
fn spawn_taker(app: &TestApp, key: &str) -> JoinHandle<u64> {
    let waiter = app.spawn_acquire(key, "wait_ms=10000");
    let (app_client, release_url) = (app.client.clone(), app.url(&format!("/locks/{key}")));
    tokio::spawn(async move {
        let grant = waiter
            .await
            .expect("the waiter task")
            .expect_grant(StatusCode::CREATED);
        let released = app_client
            .delete(release_url)
            .header("Lock-Token", &grant.token)
            .send()
            .await
            .expect("the release");
        assert_eq!(released.status(), StatusCode::NO_CONTENT);
        grant.fence
    })
}

async fn waiters_on_one_broker_are_served_in_arrival_order(b: &Backend) {
    let app = &b.app;
    let holder = app.grant("fifo", "ttl_ms=30000").await;
    let mut takers = Vec::new();
    for arrived in 1..=4 {
        takers.push(spawn_taker(app, "fifo"));
        // Each waits before the next arrives, so their order is certain.
        until_waiting(&app.address, arrived).await;
    }
    assert!(takers.iter().all(|t| !t.is_finished()), "all must wait");
    app.release_ok("fifo", &holder.token).await;
    let mut fences = Vec::new();
    for taker in takers {
        let fence = tokio::time::timeout(Duration::from_secs(5), taker)
            .await
            .expect("every waiter must be served within 5 s")
            .expect("the taker task");
        fences.push(fence);
    }
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "grants out of arrival order: fences {fences:?} (in arrival order)"
    );
    assert!(fences[0] > holder.fence);
}

/// Polls until the broker has a free waiting place (`max_waiters` is set so that the waiters
/// the test keeps fill them all), proving it let go of a waiter whose client left.
async fn wait_until_a_waiting_place_frees(app: &TestApp, key: &str) {
    let abandoned = Instant::now();
    loop {
        let answer = app.acquire(key, "wait_ms=20").await;
        if answer.status == StatusCode::CONFLICT {
            answer.expect_error(StatusCode::CONFLICT, "locked");
            return;
        }
        answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters");
        assert!(
            abandoned.elapsed() < Duration::from_secs(3),
            "the broker still waits for a client that left 3 s ago"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn an_abandoned_waiter_stops_waiting_and_leaves_no_lease_behind(b: &Backend) {
    // One waiting place: whether the abandoned waiter still holds it shows over HTTP.
    let app = b.another_app(|c| c.max_waiters = Some(1)).await;
    let holder = app.grant("left", "ttl_ms=30000").await;
    let waiter = parked(&app, "left").await;
    app.acquire("left", "wait_ms=100")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters");

    // The client goes away: its request future is dropped and its connection closed.
    waiter.abort();
    assert!(waiter.await.is_err_and(|e| e.is_cancelled()));
    wait_until_a_waiting_place_frees(&app, "left").await;

    // When the holder releases, nobody takes the lock on the abandoned waiter's behalf. (A
    // waiter still running would take it within milliseconds of the release.)
    app.release_ok("left", &holder.token).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    app.inspect("left")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");
    let next = app.grant("left", "wait_ms=0").await;
    assert!(next.fence > holder.fence);
}

async fn an_abandoned_waiter_hands_its_place_to_the_next_in_line(b: &Backend) {
    let app = b.another_app(|c| c.max_waiters = Some(2)).await;
    let holder = app.grant("line", "ttl_ms=30000").await;
    let first = app.spawn_acquire("line", "wait_ms=10000");
    tokio::time::sleep(SETTLE).await;
    let second = app.spawn_acquire("line", "wait_ms=10000");
    tokio::time::sleep(SETTLE).await;
    assert!(
        !first.is_finished() && !second.is_finished(),
        "both must wait"
    );

    // The first in line goes away; the broker lets go of it...
    first.abort();
    assert!(first.await.is_err_and(|e| e.is_cancelled()));
    wait_until_a_waiting_place_frees(&app, "line").await;
    // ...and the second is next: a release reaches it at once.
    let since = released(&app, "line", &holder.token).await;
    let grant = granted_promptly(second, since).await;
    let shown = app.inspect_held("line").await;
    assert_eq!(shown["fence"], grant.fence);
}

async fn a_waiter_past_max_waiters_is_refused_at_once_with_503_too_many_waiters(b: &Backend) {
    let app = b.another_app(|c| c.max_waiters = Some(1)).await;
    let holder = app.grant("crowded", "ttl_ms=30000").await;
    let first = parked(&app, "crowded").await;

    let started = Instant::now();
    app.acquire("crowded", "wait_ms=5000")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused only after {:?}",
        started.elapsed()
    );
    // A request that would not wait is not a waiter: it gets the ordinary 409.
    app.expect_locked("crowded", "wait_ms=0").await;
    // The cap is per broker, across keys.
    app.grant("elsewhere", "ttl_ms=30000").await;
    app.acquire("elsewhere", "wait_ms=5000")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "too_many_waiters");
    // A free key is granted even with every waiting place taken: it needs no wait.
    app.grant("free", "wait_ms=5000").await;

    app.release_ok("crowded", &holder.token).await;
    let granted = answer_within(first, Duration::from_secs(3))
        .await
        .expect_grant(StatusCode::CREATED);
    assert!(granted.fence > holder.fence);
}
