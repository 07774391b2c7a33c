//! Group commit on one Redis: claims and releases that come while a script call is in flight go
//! out together in one call, each answered as its own call would be. Counted by Redis itself
//! (`INFO commandstats`) and by the broker's `lockbroker_store_batch_size`.

use std::sync::Arc;
use std::time::Duration;

use lockbroker_test_support::app::spawn_app;
use lockbroker_test_support::http::metric;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::StatusCode;

const CLIENTS: usize = 32;
const CYCLES: usize = 25;

/// 32 clients at once, each acquiring and releasing its own key 25 times, then releasing it
/// again and taking a key that another holds (both refused): every answer is the one a call
/// alone gives, fences rise per key — and the script calls are fewer than the operations, in
/// batches the metrics show. Half the clients name an owner and a request id (a batched claim's
/// longer form): their leases show the owner, and a retry with the request id gets the same
/// grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_and_releases_share_script_calls_and_keep_their_answers() {
    let redis = RedisServer::start().await;
    let app = Arc::new(spawn_app(Some(redis.url())).await);
    // Every script loaded first (a script's first call may be a NOSCRIPT and a load).
    let warm = app.grant("warm-up", "").await;
    app.release_ok("warm-up", &warm.token).await;
    let held = app.grant("taken", "ttl_ms=60000").await;
    let before = redis.script_calls().await;
    let clients = (0..CLIENTS).map(|c| {
        let app = Arc::clone(&app);
        tokio::spawn(async move {
            let key = format!("batch-{c}");
            let named = c % 2 == 1;
            let (mut fence, mut token) = (0, String::new());
            for i in 0..CYCLES {
                let query = if named {
                    format!("ttl_ms=10000&owner=worker-{c}&request_id=r{c}-{i}")
                } else {
                    "ttl_ms=10000".to_owned()
                };
                let grant = app.grant(&key, &query).await;
                assert!(grant.fence > fence, "fences rise on {key}");
                if named && (i == 0 || i == CYCLES - 1) {
                    let shown = app.inspect_held(&key).await;
                    assert_eq!(shown["owner"], format!("worker-{c}"), "{key}: {shown}");
                }
                // The retry last: a claim the batch cannot take (the key is held) makes the key
                // go alone for a while.
                if named && i == CYCLES - 1 {
                    let again = app.grant(&key, &query).await;
                    assert_eq!(
                        again.token, grant.token,
                        "{key}: a retry of request r{c}-{i}"
                    );
                    assert_eq!(
                        again.fence, grant.fence,
                        "{key}: a retry of request r{c}-{i}"
                    );
                }
                (fence, token) = (grant.fence, grant.token);
                app.release_ok(&key, &token).await;
            }
            // Released means released: the last token holds nothing any more.
            app.release(&key, &token)
                .await
                .expect_error(StatusCode::NOT_FOUND, "not_held");
            app.expect_locked("taken", "").await;
        })
    });
    for client in futures_util::future::join_all(clients).await {
        client.expect("a client's cycles");
    }
    let calls = redis.script_calls().await - before;
    // Per client: 25 grants, 25 releases, a release of nothing, a refused claim and its look —
    // each one script call when alone; per named client also two reads and a retry.
    let alone = (CLIENTS * (CYCLES * 2 + 3) + CLIENTS / 2 * 3) as u64;
    let batches = metric(&app.address, "lockbroker_store_batch_size_count").await;
    let batched = metric(&app.address, "lockbroker_store_batch_size_sum").await;
    println!("{calls} script calls for {alone} operations; {batched} in {batches} batches");
    assert!(
        batches > 0.0,
        "no batch in {alone} operations from {CLIENTS} clients at once"
    );
    assert!(
        batched > batches,
        "{batches} batches carried {batched} operations: none carried two"
    );
    assert!(
        calls * 2 < alone,
        "{calls} script calls for {alone} operations, {batched} of them in {batches} batches"
    );
    app.release_ok("taken", &held.token).await;
}

/// A broker joining a store whose epoch another began: its first claims, many at once, gather
/// in a batch while its first epoch check runs. Each is granted, and none is taken for a grant
/// that raced a loss: nothing is put back, so no store-wide hold follows (a batch runs only the
/// claims asked in its own epoch; the others go alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_brokers_first_claims_at_once_set_no_hold() {
    use lockbroker::store::{GrantAnswer, Store};

    let redis = RedisServer::start().await;
    let (first, _notices) = crate::store_pools::store_on(&redis, "lb:", Duration::from_secs(2));
    let warm = crate::store_pools::key("warm-up");
    // The first broker begins the epoch and waits out its settle time.
    loop {
        match first
            .claim(&warm, &crate::store_queue::bid(1000, 0))
            .await
            .unwrap()
        {
            GrantAnswer::Granted(_) => break,
            GrantAnswer::OnHold(hold) => {
                tokio::time::sleep(Duration::from_millis(hold.retry_after_ms.min(50))).await;
            }
            other => panic!("{other:?}"),
        }
    }
    let hold_before = hold_until(&redis).await;

    let metrics = Arc::new(lockbroker::store::Metrics::default());
    let (second, _notices) = crate::store_pools::store_on_with(
        &redis,
        "lb:",
        Duration::from_secs(2),
        Arc::clone(&metrics),
    );
    let second = Arc::new(second);
    let claims = (0..CLIENTS).map(|c| {
        let second = Arc::clone(&second);
        tokio::spawn(async move {
            let k = crate::store_pools::key(&format!("first-{c}"));
            second.claim(&k, &crate::store_queue::bid(10_000, 0)).await
        })
    });
    for claim in futures_util::future::join_all(claims).await {
        match claim.expect("a claim").expect("an answer") {
            GrantAnswer::Granted(_) => {}
            other => panic!("a first claim answered {other:?}"),
        }
    }
    // A put-back of a grant taken for one that raced a loss is decided as the grant is recorded,
    // before its claim answers, and counted then; it would also move the hold out a second.
    assert!(
        metrics
            .render(0, [0, 0], 0)
            .contains("lockbroker_late_put_backs_total 0\n"),
        "a first claim was put back as one that raced a loss"
    );
    assert_eq!(
        hold_until(&redis).await,
        hold_before,
        "a put-back hold followed the first claims"
    );
    let next = crate::store_pools::key("after");
    match second
        .claim(&next, &crate::store_queue::bid(1000, 0))
        .await
        .unwrap()
    {
        GrantAnswer::Granted(_) => {}
        other => panic!("the claim after them answered {other:?}"),
    }
}

/// The store-wide hold's end the epoch marker `lb:epoch` records (ms), if any.
async fn hold_until(redis: &RedisServer) -> Option<u64> {
    lockbroker_test_support::redis::cmd("HGET")
        .arg("lb:epoch")
        .arg("hold_until")
        .query_async(&mut redis.connection().await)
        .await
        .unwrap()
}
