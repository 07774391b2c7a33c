//! The broker on a real Redis Cluster (3 masters, 3 replicas): locks spread over every master,
//! shared leases and semaphore permits work there and the listings walk every master, release
//! notices wake waiters on other brokers, and a master that loses its data (flushed)
//! gets its live leases put back while the other masters keep granting. One cluster for the
//! file's scenarios, run in order: starting one takes seconds.
//!
//! A master failover under load is in the safety suite (`tests/safety/cluster_failover.rs`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::broker::wait_until_ready;
use lockbroker_test_support::cluster::RedisCluster;
use lockbroker_test_support::http::{Grant, metric, until_metric};
use lockbroker_test_support::redis;

/// The settle time of a master's new epoch in these tests.
const SETTLE_MS: u64 = 1000;

async fn broker(cluster: &RedisCluster) -> TestApp {
    spawn_app_with(Some(cluster.url()), |c| {
        c.store_timeout_ms = Some(2000);
        c.store_settle_ms = Some(SETTLE_MS);
    })
    .await
}

/// The Redis key of a lock (default prefix), whose slot decides its master.
fn lock_key(key: &str) -> String {
    format!("lockbroker:{{{key}}}:lock")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_locks_spread_over_the_masters_wake_across_brokers_and_survive_a_flushed_master()
 {
    let cluster = RedisCluster::start(3).await;
    let one = broker(&cluster).await;
    let two = broker(&cluster).await;
    for app in [&one, &two] {
        wait_until_ready(&app.address, Duration::from_secs(15)).await;
    }
    // Ready means some master grants: the others may still be settling for a moment.
    every_master_grants(&cluster, &one).await;

    locks_spread_over_every_master(&cluster, &one, &two).await;
    shared_leases_permits_and_listings_work_on_every_master(&cluster, &one, &two).await;
    a_release_wakes_a_waiter_on_another_broker_within_100_ms(&one, &two).await;
    a_flushed_master_gets_its_leases_back_while_the_others_grant(&cluster, &one, &two).await;
    a_slot_that_lost_its_marker_and_keys_gets_its_leases_back(&cluster, &one, &two).await;
    a_sessions_leases_on_every_master_live_and_end_with_it_across_a_flushed_master(
        &cluster, &one, &two,
    )
    .await;
    several_keys_on_every_master_are_taken_together_and_in_opposite_orders(&cluster, &one, &two)
        .await;
    crate::replica_acks_0_warns_once_at_start(cluster.url()).await;
}

/// Waits until a key on each master is granted (each master settles on its own).
async fn every_master_grants(cluster: &RedisCluster, app: &TestApp) {
    let started = Instant::now();
    let mut granted = BTreeSet::new();
    for i in 0.. {
        let key = format!("settled-{i}");
        let master = cluster.master_of(&lock_key(&key)).await;
        if granted.contains(&master) {
            continue;
        }
        loop {
            let answer = app.acquire(&key, "ttl_ms=1").await;
            if answer.status == StatusCode::CREATED {
                break;
            }
            answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{}",
                answer.text
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        granted.insert(master);
        if granted.len() == 3 {
            return;
        }
    }
}

async fn locks_spread_over_every_master(cluster: &RedisCluster, one: &TestApp, two: &TestApp) {
    let mut masters = BTreeSet::new();
    let mut grants = Vec::new();
    for i in 0..24 {
        let key = format!("spread-{i}");
        let grant = one.grant(&key, "ttl_ms=30000").await;
        // Held: another broker sees it.
        two.expect_locked(&key, "").await;
        masters.insert(cluster.master_of(&lock_key(&key)).await);
        grants.push((key, grant));
    }
    assert_eq!(
        masters.len(),
        3,
        "24 locks landed on masters {masters:?} only"
    );
    for (key, grant) in &grants {
        two.release_ok(key, &grant.token).await;
        let again = one.grant(key, "ttl_ms=1000").await;
        assert!(again.fence > grant.fence, "fences rise on {key}");
        one.release_ok(key, &again.token).await;
    }
}

/// Shared leases and permits on keys of every master (each script's keys on one slot), and the
/// listings, which walk every master in turn, in small pages.
async fn shared_leases_permits_and_listings_work_on_every_master(
    cluster: &RedisCluster,
    one: &TestApp,
    two: &TestApp,
) {
    const KEYS: usize = 18;
    let mut masters = BTreeSet::new();
    let mut held = Vec::new();
    for i in 0..KEYS {
        let key = format!("rw-{i:02}");
        masters.insert(cluster.master_of(&lock_key(&key)).await);
        let first = one.grant(&key, "mode=shared&ttl_ms=30000").await;
        let second = two.grant(&key, "mode=shared&ttl_ms=30000").await;
        two.expect_locked(&key, "").await;
        let permit = one
            .send(one.request(Method::POST, &format!("/semaphores/sem-{i:02}?limit=1")))
            .await;
        permit.expect_status(StatusCode::CREATED);
        two.send(two.request(Method::POST, &format!("/semaphores/sem-{i:02}?limit=1")))
            .await
            .expect_error(StatusCode::CONFLICT, "locked");
        held.push((
            key,
            first,
            second,
            permit.json()["token"].as_str().unwrap().to_owned(),
        ));
    }
    assert_eq!(
        masters.len(),
        3,
        "{KEYS} locks landed on masters {masters:?} only"
    );

    for (path, field, prefix) in [
        ("/locks", "locks", "rw-"),
        ("/semaphores", "semaphores", "sem-"),
    ] {
        let mut listed = Vec::new();
        let mut cursor: Option<String> = None;
        for page in 0.. {
            assert!(page < 200, "the listing of {path} does not end");
            let query = match &cursor {
                None => format!("{path}?prefix={prefix}&limit=4"),
                Some(c) => format!("{path}?prefix={prefix}&limit=4&cursor={c}"),
            };
            let answer = two.get(&query).await;
            answer.expect_status(StatusCode::OK);
            let body = answer.json();
            let entries = body[field].as_array().unwrap();
            assert!(entries.len() <= 4, "{}", answer.text);
            for entry in entries {
                assert!(entry.get("token").is_none(), "a listing shows no token");
                listed.push(entry["key"].as_str().unwrap().to_owned());
            }
            match body["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
        listed.sort();
        listed.dedup();
        let expected: Vec<String> = (0..KEYS).map(|i| format!("{}{i:02}", prefix)).collect();
        assert_eq!(listed, expected, "{path} on every master");
    }

    for (key, first, second, permit) in held {
        one.release_ok(&key, &second.token).await;
        two.release_ok(&key, &first.token).await;
        let semaphore = key.replace("rw-", "sem-");
        two.send(
            two.request(Method::DELETE, &format!("/semaphores/{semaphore}"))
                .header("Lock-Token", permit),
        )
        .await
        .expect_status(StatusCode::NO_CONTENT);
    }
}

async fn a_release_wakes_a_waiter_on_another_broker_within_100_ms(one: &TestApp, two: &TestApp) {
    let mut delays = Vec::new();
    for i in 0..5 {
        let key = format!("relay-{i}");
        let holder = one.grant(&key, "ttl_ms=30000").await;
        let waiters_before = metric(&two.address, "lockbroker_waiters").await;
        let waiter = two.spawn_acquire(&key, "wait_ms=10000");
        until_metric(
            &two.address,
            "lockbroker_waiters",
            waiters_before + 1.0,
            Duration::from_secs(5),
        )
        .await;
        one.release_ok(&key, &holder.token).await;
        let released = Instant::now();
        let grant = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter was not woken within 5 s")
            .expect("the waiter task")
            .expect_grant(StatusCode::CREATED);
        delays.push(released.elapsed());
        assert!(grant.fence > holder.fence);
        two.release_ok(&key, &grant.token).await;
    }
    delays.sort();
    // The median: one slow wake on a loaded 2-core machine is not the broker's doing; the
    // waiter's fallback poll would take a second or more.
    let median = delays[delays.len() / 2];
    assert!(
        median < Duration::from_millis(100),
        "waiters on another broker were woken after {delays:?}"
    );
}

async fn a_flushed_master_gets_its_leases_back_while_the_others_grant(
    cluster: &RedisCluster,
    one: &TestApp,
    two: &TestApp,
) {
    let kept: Grant = one.grant("kept", "ttl_ms=30000").await;
    let flushed = cluster.master_of(&lock_key("kept")).await;
    // A key on another master, to show that master goes on granting during the hold.
    let mut elsewhere = String::new();
    for i in 0.. {
        elsewhere = format!("elsewhere-{i}");
        if cluster.master_of(&lock_key(&elsewhere)).await != flushed {
            break;
        }
    }
    let losses_before = metric(&one.address, "lockbroker_store_losses_total").await;
    let mut node = cluster.nodes[flushed].connection().await;
    let () = redis::cmd("FLUSHALL")
        .query_async(&mut node)
        .await
        .expect("FLUSHALL on one master");
    let flushed_at = Instant::now();
    // Until the broker that granted it puts it back, the key is never granted to anyone else:
    // it answers 503 (no marker, or the hold) or 409 (back).
    let mut elsewhere_granted_during_hold = false;
    let mut ready_during_hold = false;
    loop {
        let answer = two.acquire("kept", "").await;
        match answer.status {
            StatusCode::CONFLICT => break,
            StatusCode::SERVICE_UNAVAILABLE => {
                answer.expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
                // One master's hold is not the store's: the broker stays ready for the others.
                if !ready_during_hold {
                    ready_during_hold = two.get("/readyz").await.status == StatusCode::OK;
                }
            }
            _ => panic!(
                "a flushed lease was granted to another client: {} {}",
                answer.status, answer.text
            ),
        }
        if !elsewhere_granted_during_hold {
            let other = two.acquire(&elsewhere, "ttl_ms=500").await;
            elsewhere_granted_during_hold = other.status == StatusCode::CREATED;
        }
        assert!(
            flushed_at.elapsed() < Duration::from_secs(10),
            "the lease was not put back within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        metric(&one.address, "lockbroker_store_losses_total").await > losses_before,
        "the loss was not counted"
    );
    assert!(
        elsewhere_granted_during_hold,
        "a key on a master that lost nothing was held too"
    );
    assert!(
        ready_during_hold,
        "/readyz was not ready while only one master held"
    );
    // The holder's token still works: renew keeps the fence, release frees the key.
    renew_and_release(one, "kept", &kept).await;
    let next = two.grant("kept", "ttl_ms=1000").await;
    assert!(next.fence > kept.fence, "the fence counter was raised back");
}

/// One slot's keys vanish on their own (deleted, or evicted by a Redis that should not evict):
/// its epoch marker and the lock with it. The next grant on the slot notices, the slot holds,
/// and the broker that granted the lease puts it back.
async fn a_slot_that_lost_its_marker_and_keys_gets_its_leases_back(
    cluster: &RedisCluster,
    one: &TestApp,
    two: &TestApp,
) {
    let lonely: Grant = one.grant("lonely", "ttl_ms=30000").await;
    let slot = lockbroker::store::redis::slot_of(lock_key("lonely").as_bytes());
    let master = cluster.master_of(&lock_key("lonely")).await;
    let mut node = cluster.nodes[master].connection().await;
    let markers: Vec<String> = redis::cmd("KEYS")
        .arg("lockbroker:epoch*")
        .query_async(&mut node)
        .await
        .expect("KEYS");
    let marker = markers
        .into_iter()
        .find(|m| lockbroker::store::redis::slot_of(m.as_bytes()) == slot)
        .expect("the slot has an epoch marker");
    let deleted: i64 = redis::cmd("DEL")
        .arg(&marker)
        .arg(lock_key("lonely"))
        .query_async(&mut node)
        .await
        .expect("DEL");
    assert_eq!(deleted, 2);
    let started = Instant::now();
    loop {
        let answer = two.acquire("lonely", "").await;
        match answer.status {
            StatusCode::CONFLICT => break,
            StatusCode::SERVICE_UNAVAILABLE => {}
            _ => panic!(
                "a lease whose keys vanished was granted again: {} {}",
                answer.status, answer.text
            ),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the lease was not put back within 10 s: {}",
            answer.text
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    renew_and_release(one, "lonely", &lonely).await;
}

/// The holder of a lease put back renews it (once the hold is over: 503 until then) with its
/// fence unchanged, and releases it.
async fn renew_and_release(app: &TestApp, key: &str, lease: &Grant) {
    let started = Instant::now();
    let renewed = loop {
        let answer = app.renew(key, &lease.token, "").await;
        if answer.status != StatusCode::SERVICE_UNAVAILABLE {
            break answer.expect_grant(StatusCode::OK);
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{}",
            answer.text
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(renewed.fence, lease.fence);
    app.release_ok(key, &lease.token).await;
}

/// A session opened on one broker with leases on keys of every master, kept alive from the other
/// broker past three TTLs (each keep-alive: the session's record, then one KEEP per slot); while
/// one master is flushed no key of it is granted to anyone else as long as a keep-alive promised
/// it; when the keep-alives stop, every key goes to waiters within the TTL and a second.
async fn a_sessions_leases_on_every_master_live_and_end_with_it_across_a_flushed_master(
    cluster: &RedisCluster,
    one: &TestApp,
    two: &TestApp,
) {
    const TTL_MS: u64 = 1500;
    let opened = one
        .send(one.request(Method::POST, &format!("/sessions?ttl_ms={TTL_MS}")))
        .await;
    let id = opened.expect_status(StatusCode::CREATED).json()["session"]
        .as_str()
        .unwrap()
        .to_owned();
    let keep_alive = || async {
        let sent = Instant::now();
        let answer = two
            .send(two.request(Method::POST, &format!("/sessions/{id}/renew")))
            .await;
        (sent, answer.status)
    };
    let mut masters = BTreeSet::new();
    let mut keys = Vec::new();
    for i in 0..12 {
        let key = format!("sess-{i}");
        two.grant(&key, &format!("session={id}")).await;
        masters.insert(cluster.master_of(&lock_key(&key)).await);
        keys.push(key);
    }
    assert_eq!(
        masters.len(),
        3,
        "the session's leases are on masters {masters:?}"
    );
    let mut promised = Instant::now() + Duration::from_millis(TTL_MS);
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3 * TTL_MS + 500) {
        tokio::time::sleep(Duration::from_millis(TTL_MS / 4)).await;
        let (sent, status) = keep_alive().await;
        assert_eq!(status, StatusCode::OK);
        promised = sent + Duration::from_millis(TTL_MS);
    }
    for key in &keys {
        one.expect_locked(key, "").await;
    }
    // One master loses its data: its leases are put back by the broker that kept them; the
    // session's record may be gone (its keep-alive then says so). No key is granted to anyone
    // while a keep-alive's promise stands.
    let flushed = cluster.master_of(&lock_key(&keys[0])).await;
    let mut node = cluster.nodes[flushed].connection().await;
    let () = redis::cmd("FLUSHALL")
        .query_async(&mut node)
        .await
        .expect("FLUSHALL on one master");
    let flushed_at = Instant::now();
    let mut session_lost = false;
    while flushed_at.elapsed() < Duration::from_millis(2 * TTL_MS) && !session_lost {
        for key in &keys {
            let answer = one.acquire(key, "ttl_ms=100").await;
            assert!(
                answer.status != StatusCode::CREATED || Instant::now() > promised,
                "{key} was granted to another client while the session's keep-alive promised it"
            );
        }
        let (sent, status) = keep_alive().await;
        match status {
            StatusCode::OK => promised = sent + Duration::from_millis(TTL_MS),
            StatusCode::NOT_FOUND => session_lost = true,
            status => assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE),
        }
        tokio::time::sleep(Duration::from_millis(TTL_MS / 4)).await;
    }
    // The keep-alives stop: every key ends with the session (or, lost with its record, at the
    // end its leases were put back with) and goes to the waiters.
    let stopped = Instant::now();
    let waiters: Vec<_> = keys
        .iter()
        .map(|key| one.spawn_acquire(key, "wait_ms=10000&ttl_ms=1000"))
        .collect();
    for waiter in waiters {
        waiter
            .await
            .expect("the waiter task")
            .expect_grant(StatusCode::CREATED);
    }
    assert!(
        stopped.elapsed() < Duration::from_millis(TTL_MS + 1000 + SETTLE_MS),
        "the session's keys ended {:?} after its last keep-alive",
        stopped.elapsed()
    );
}

/// Several keys at once whose keys live on all three masters: granted together with one token,
/// seen held from the other broker, released together; refused with one busy key, leaving the
/// others free; two brokers asking for the same keys in opposite orders both complete.
async fn several_keys_on_every_master_are_taken_together_and_in_opposite_orders(
    cluster: &RedisCluster,
    one: &TestApp,
    two: &TestApp,
) {
    let keys: Vec<String> = (0..9).map(|i| format!("multi-{i}")).collect();
    let mut masters = BTreeSet::new();
    for key in &keys {
        masters.insert(cluster.master_of(&lock_key(key)).await);
    }
    assert_eq!(masters.len(), 3, "the keys are on masters {masters:?}");
    let granted = one
        .send(
            one.request(Method::POST, "/locks")
                .json(&serde_json::json!({"keys": keys, "ttl_ms": 20000})),
        )
        .await;
    let body = granted.expect_status(StatusCode::CREATED).json();
    let token = body["token"].as_str().unwrap().to_owned();
    for key in &keys {
        two.expect_locked(key, "").await;
    }
    let released = two
        .send(
            two.request(Method::DELETE, &format!("/locks?keys={}", keys.join(",")))
                .header("Lock-Token", &token),
        )
        .await;
    let results = released.expect_status(StatusCode::OK).json();
    assert!(
        results["results"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["status"] == 204),
        "{results}"
    );
    // One key busy on one master: the slots whose keys were all free and were granted in the
    // one round go back at once, and the answer names the busy key alone.
    let busy = one.grant(&keys[4], "ttl_ms=20000").await;
    let refused = two
        .send(
            two.request(Method::POST, "/locks")
                .json(&serde_json::json!({"keys": keys, "ttl_ms": 20000})),
        )
        .await;
    let body = refused.expect_error(StatusCode::CONFLICT, "locked");
    assert_eq!(body["held"], serde_json::json!([keys[4]]));
    for key in keys.iter().filter(|k| **k != keys[4]) {
        let free = one.grant(key, "").await;
        one.release_ok(key, &free.token).await;
    }
    one.release_ok(&keys[4], &busy.token).await;
    // {first, last} and {last, first} from the two brokers at once, several times.
    let pair = [keys[0].clone(), keys[8].clone()];
    let mut asks = Vec::new();
    for round in 0..4 {
        for (i, app) in [one, two].into_iter().enumerate() {
            let mut order = pair.clone();
            if (round + i) % 2 == 1 {
                order.reverse();
            }
            let request = app
                .request(Method::POST, "/locks")
                .json(&serde_json::json!({"keys": order, "wait_ms": 15000, "ttl_ms": 1000}));
            asks.push(tokio::spawn(lockbroker_test_support::http::Answer::send(
                request,
            )));
        }
    }
    for ask in asks {
        let answer = tokio::time::timeout(Duration::from_secs(30), ask)
            .await
            .expect("an opposite-order request did not complete: a deadlock")
            .expect("the request task");
        answer.expect_status(StatusCode::CREATED);
    }
}
