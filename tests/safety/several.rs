//! Several keys at once under torture: clients on two brokers sharing one Redis each take random
//! subsets of 2 to 4 keys out of 6, named in random order, hold them a moment and release them
//! all. Every request must be served within its (long) wait — a deadlock would leave requests
//! waiting until their wait runs out — and per key no two holds overlap and fences rise in grant
//! order.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lockbroker_test_support::app::spawn_apps;
use lockbroker_test_support::http::http_client;
use lockbroker_test_support::redis_server::RedisServer;
use rand::RngExt;
use rand::seq::SliceRandom;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tokio::time::Instant;

const KEYS: [&str; 6] = ["s-a", "s-b", "s-c", "s-d", "s-e", "s-f"];
const CLIENTS: usize = 8;
const ROUNDS: usize = 12;

/// One key's hold, as its client saw it.
#[derive(Debug, Clone)]
struct Hold {
    client: usize,
    fence: u64,
    start: Instant,
    end: Instant,
}

async fn client(
    n: usize,
    brokers: Arc<Vec<String>>,
    holds: Arc<Mutex<BTreeMap<String, Vec<Hold>>>>,
    faults: bool,
) -> Vec<Duration> {
    let http = http_client();
    let mut waits = Vec::new();
    for round in 0..ROUNDS {
        let (keys, broker, hold_ms) = {
            let mut rng = rand::rng();
            let mut keys = KEYS.to_vec();
            keys.shuffle(&mut rng);
            keys.truncate(rng.random_range(2..=4));
            (
                keys,
                brokers[(n + round) % brokers.len()].clone(),
                rng.random_range(1..20u64),
            )
        };
        let asked = Instant::now();
        let answer = http
            .post(format!("{broker}/locks"))
            .json(&json!({"keys": keys, "wait_ms": 20000, "ttl_ms": 10000}))
            .send()
            .await;
        let answer = match answer {
            Ok(answer) => answer,
            Err(_) if faults => continue,
            Err(e) => panic!("the broker did not answer: {e}"),
        };
        let status = answer.status();
        let body: Value = answer.json().await.expect("a JSON body");
        if faults && status == StatusCode::SERVICE_UNAVAILABLE {
            // The store lost its data or settles: asked again in the next round.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        assert_eq!(
            status,
            StatusCode::CREATED,
            "client {n} round {round}: {body}"
        );
        let start = Instant::now();
        waits.push(start - asked);
        tokio::time::sleep(Duration::from_millis(hold_ms)).await;
        let end = Instant::now();
        let released = http
            .delete(format!("{broker}/locks?keys={}", keys.join(",")))
            .header("Lock-Token", body["token"].as_str().unwrap())
            .send()
            .await;
        if !faults {
            assert_eq!(
                released.expect("the broker answers").status(),
                StatusCode::OK
            );
        }
        let mut holds = holds.lock().await;
        for lease in body["leases"].as_array().unwrap() {
            holds
                .entry(lease["key"].as_str().unwrap().to_owned())
                .or_default()
                .push(Hold {
                    client: n,
                    fence: lease["fence"].as_u64().unwrap(),
                    start,
                    end,
                });
        }
    }
    waits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_key_sets_in_random_orders_on_two_brokers_never_deadlock_nor_overlap() {
    let redis = RedisServer::start().await;
    let apps = spawn_apps(&redis.url(), 2, |_| {}).await;
    let brokers = Arc::new(apps.iter().map(|a| a.address.clone()).collect::<Vec<_>>());
    let holds = Arc::new(Mutex::new(BTreeMap::new()));
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(client(n, brokers.clone(), holds.clone(), false)))
        .collect();
    let mut waits = Vec::new();
    for c in clients {
        let client_waits = tokio::time::timeout(Duration::from_secs(60), c)
            .await
            .expect("the clients did not finish within 60 s: a deadlock")
            .expect("a client task");
        waits.extend(client_waits);
    }
    let took = started.elapsed();
    check(&holds, &mut waits, took).await;
    assert_eq!(waits.len(), CLIENTS * ROUNDS);
}

/// Per key: no two holds overlap, fences rise in grant order. Prints the run's figures.
async fn check(holds: &Mutex<BTreeMap<String, Vec<Hold>>>, waits: &mut [Duration], took: Duration) {
    let holds = holds.lock().await;
    let mut total = 0;
    for (key, key_holds) in holds.iter() {
        let mut key_holds = key_holds.clone();
        key_holds.sort_by_key(|h| h.start);
        for pair in key_holds.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(
                a.end <= b.start,
                "{key}: client {} held it (fence {}) while client {} was granted it (fence {})",
                a.client,
                a.fence,
                b.client,
                b.fence
            );
            assert!(b.fence > a.fence, "{key}: fences must rise in grant order");
        }
        total += key_holds.len();
    }
    waits.sort();
    let p99 = waits[(waits.len() * 99 / 100).min(waits.len() - 1)];
    eprintln!(
        "{} acquisitions of 2-4 keys ({total} key holds) in {took:?}: {:.0} acquisitions/s, wait p50 {:?} p99 {:?}",
        waits.len(),
        waits.len() as f64 / took.as_secs_f64(),
        waits[waits.len() / 2],
        p99
    );
}

/// The same torture across a Redis restart that empties it halfway: acquires answered 503 while
/// the store settles are asked again; per key still no overlap and rising fences (the brokers
/// put the leases they granted back before anything is granted again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_key_sets_keep_their_promises_across_a_redis_restart() {
    let mut redis = RedisServer::start().await;
    let apps = spawn_apps(&redis.url(), 2, |c| c.store_settle_ms = Some(1000)).await;
    let brokers = Arc::new(apps.iter().map(|a| a.address.clone()).collect::<Vec<_>>());
    let holds = Arc::new(Mutex::new(BTreeMap::new()));
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(client(n, brokers.clone(), holds.clone(), true)))
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    redis.restart().await;
    let mut waits = Vec::new();
    for c in clients {
        let client_waits = tokio::time::timeout(Duration::from_secs(90), c)
            .await
            .expect("the clients did not finish within 90 s")
            .expect("a client task");
        waits.extend(client_waits);
    }
    assert!(!waits.is_empty(), "nothing was granted across the restart");
    check(&holds, &mut waits, started.elapsed()).await;
}

/// A broker killed while a several-keys request it serves holds its first key and waits for the
/// second: the first key is held up no longer than its lease's TTL (the documented bound: nobody
/// renews it any more), and a waiter on another broker gets it then; a client that gives up
/// instead releases what its request took at once.
/// Waits until `key` is held, seen from `broker`: a watch from "free" (answered when the key's
/// holders change, within 5 s), not a poll.
async fn until_held(http: &reqwest::Client, broker: &str, key: &str) {
    let shown = http
        .get(format!("{broker}/locks/{key}?watch=0&wait_ms=5000"))
        .send()
        .await
        .unwrap();
    assert_eq!(shown.status(), StatusCode::OK, "{key} was never taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_mid_acquisition_holds_its_first_key_only_until_that_lease_ends() {
    let redis = RedisServer::start().await;
    let [mut doomed, other, _third] = crate::faults::three_broker_processes(&redis, 1000).await;
    let http = http_client();
    // `k-2` is held elsewhere, so a request for {k-1, k-2} takes k-1 and waits for k-2.
    let blocker: Value = http
        .post(format!("{}/locks/k-2?ttl_ms=30000", other.address()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let request = http
        .post(format!("{}/locks", doomed.address()))
        .json(&json!({"keys": ["k-1", "k-2"], "wait_ms": 20000, "ttl_ms": 2000}));
    let pending = tokio::spawn(async move { request.send().await.map(|r| r.status()) });
    // k-1 is taken by the several-keys request (its queue shows nobody; the lock is held).
    until_held(&http, &other.address(), "k-1").await;
    let killed = Instant::now();
    doomed.kill();
    let _ = pending.await;
    // Nobody renews k-1 now: a waiter on a surviving broker gets it within its TTL (+ slack).
    let granted = http
        .post(format!("{}/locks/k-1?wait_ms=10000", other.address()))
        .send()
        .await
        .unwrap();
    assert_eq!(granted.status(), StatusCode::CREATED);
    assert!(
        killed.elapsed() < Duration::from_millis(2000 + 1500),
        "k-1 was held {:?} after its broker died; its lease was 2 s",
        killed.elapsed()
    );
    // A client that gives up mid-way: what its request took is released at once.
    let request = http
        .post(format!("{}/locks", other.address()))
        .json(&json!({"keys": ["k-0", "k-2"], "wait_ms": 20000, "ttl_ms": 30000}));
    let gave_up = tokio::spawn(async move { request.send().await });
    until_held(&http, &other.address(), "k-0").await;
    gave_up.abort();
    let left = Instant::now();
    let next = http
        .post(format!("{}/locks/k-0?wait_ms=5000", other.address()))
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), StatusCode::CREATED);
    assert!(
        left.elapsed() < Duration::from_secs(2),
        "k-0 was held {:?} after its client left",
        left.elapsed()
    );
    drop(blocker);
}
