//! Many clients on one key: mutual exclusion, no lost update, and fences in the order the
//! critical sections ran.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockbroker_test_support::app::{TestApp, spawn_app};
use lockbroker_test_support::redis_server::RedisServer;

/// One critical section as a client saw it: from the grant's arrival to just before its release.
#[derive(Debug, Clone, Copy)]
struct Section {
    start: Instant,
    end: Instant,
    fence: u64,
}

/// `clients` tasks, spread over `brokers` in turn, each taking the one key `rounds` times and
/// doing a deliberately non-atomic read-modify-write of a shared counter while holding it.
/// Asserts no lost update, no overlap, fences rising in the order the sections ran, and a 204
/// for every release. Returns how long it took.
async fn contend(brokers: Vec<Arc<TestApp>>, clients: usize, rounds: usize) -> Duration {
    let counter = Arc::new(AtomicU64::new(0));
    let sections = Arc::new(Mutex::new(Vec::with_capacity(clients * rounds)));
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let app = brokers[i % brokers.len()].clone();
            let (counter, sections) = (counter.clone(), sections.clone());
            tokio::spawn(async move {
                for _ in 0..rounds {
                    let grant = app.grant("hot", "wait_ms=30000&ttl_ms=10000").await;
                    let start = Instant::now();
                    // Read, give way to the other tasks, write back: two holders at once would
                    // lose an update here.
                    let seen = counter.load(Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    counter.store(seen + 1, Ordering::SeqCst);
                    let end = Instant::now();
                    sections.lock().unwrap().push(Section {
                        start,
                        end,
                        fence: grant.fence,
                    });
                    app.release_ok("hot", &grant.token).await;
                }
            })
        })
        .collect();
    let all = futures::future::join_all(tasks);
    for joined in tokio::time::timeout(Duration::from_secs(90), all)
        .await
        .expect("the clients must be done within 90 s")
    {
        joined.expect("a client failed");
    }
    let took = started.elapsed();

    let total = u64::try_from(clients * rounds).unwrap();
    assert_eq!(counter.load(Ordering::SeqCst), total, "lost updates");
    let mut sections = sections.lock().unwrap().clone();
    assert_eq!(sections.len(), clients * rounds);
    sections.sort_by_key(|s| s.start);
    for pair in sections.windows(2) {
        let (before, after) = (pair[0], pair[1]);
        assert!(
            before.end <= after.start,
            "two clients held the lock at once: {before:?} and {after:?}"
        );
        assert!(
            before.fence < after.fence,
            "fence {} came after fence {}",
            after.fence,
            before.fence
        );
    }
    took
}

/// The acceptance test: 24 clients on three brokers sharing one Redis, 960 critical
/// sections on one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_four_clients_on_three_brokers_never_hold_the_lock_at_once() {
    let redis = RedisServer::start().await;
    let brokers = vec![
        Arc::new(spawn_app(Some(redis.url())).await),
        Arc::new(spawn_app(Some(redis.url())).await),
        Arc::new(spawn_app(Some(redis.url())).await),
    ];
    let took = contend(brokers, 24, 40).await;
    eprintln!("960 critical sections over three brokers and Redis took {took:?}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_one_embedded_broker_never_hold_the_lock_at_once() {
    let broker = Arc::new(spawn_app(None).await);
    let took = contend(vec![broker], 12, 20).await;
    eprintln!("240 critical sections on the embedded store took {took:?}");
}
