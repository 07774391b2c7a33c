//! Sessions under torture: clients on two brokers sharing one Redis each open a session, take a
//! hot key under it, keep it alive from either broker, and then either give it back (a release
//! or a close) or abandon it mid-hold (their keep-alives stop, as when a node dies); some abandon
//! the session while their acquire still waits. Every hold is recorded from its grant to the last
//! moment its client could believe it held the key — its release, or for an abandoned session
//! the end its last confirmed keep-alive promised (the keep-alive's send time plus the TTL, on
//! this process's clock, which is on the safe side of the store's). No two holds may overlap,
//! fences must rise in grant order, and a non-atomic counter updated under the lock must lose no
//! update.
//!
//! The same run then goes on across a Redis restart that empties it: sessions open before it are
//! gone (their keep-alives answer 404, which ends their holds at once) or put back with their
//! leases; either way no two holds overlap.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lockbroker_test_support::app::spawn_apps;
use lockbroker_test_support::http::http_client;
use lockbroker_test_support::redis_server::RedisServer;
use rand::RngExt;
use reqwest::{Client, StatusCode};
use serde_json::Value;
use tokio::sync::Mutex;
use tokio::time::Instant;

const TTL_MS: u64 = 600;
const CLIENTS: usize = 6;
const RUN: Duration = Duration::from_secs(8);

/// One hold, as its client saw it.
#[derive(Debug, Clone)]
struct Hold {
    client: usize,
    fence: u64,
    start: Instant,
    /// The last moment the client could believe it held the key.
    end: Instant,
    abandoned: bool,
}

struct Shared {
    brokers: Vec<String>,
    holds: Mutex<Vec<Hold>>,
    counter: AtomicU64,
    lost_updates: AtomicU64,
    updates: AtomicU64,
}

async fn post(client: &Client, url: String) -> Option<(StatusCode, Value)> {
    let response = client.post(url).send().await.ok()?;
    let status = response.status();
    let body = response.json().await.unwrap_or(Value::Null);
    Some((status, body))
}

/// One client's rounds until `until`.
async fn hammer(n: usize, shared: Arc<Shared>, until: Instant) {
    let http = http_client();
    let pick = |r: usize| shared.brokers[r % shared.brokers.len()].clone();
    while Instant::now() < until {
        let (abandon, abandon_waiting, r1, r2) = {
            let mut rng = rand::rng();
            (
                rng.random_bool(0.4),
                rng.random_bool(0.1),
                rng.random::<u32>() as usize,
                rng.random::<u32>() as usize,
            )
        };
        // The session's end, as this client can vouch for it: the send time of the open, then
        // of each confirmed keep-alive, plus the TTL (the store measures the TTL from when it
        // got the request, which is later). An acquire under the session does not renew it.
        let opening = Instant::now();
        let Some((StatusCode::CREATED, opened)) =
            post(&http, format!("{}/sessions?ttl_ms={TTL_MS}", pick(r1))).await
        else {
            continue;
        };
        let id = opened["session"].as_str().unwrap().to_owned();
        let renewed = std::sync::Mutex::new(opening);
        let acquire = post(
            &http,
            format!("{}/locks/hot?session={id}&wait_ms=3000", pick(r2)),
        );
        let answer = if abandon_waiting {
            // The session is left without keep-alives while its acquire waits: the acquire must
            // answer no_session (or a grant its client then treats as held until the session's
            // end), never hold the key for long.
            acquire.await
        } else {
            // Keep the session alive while the acquire waits.
            let keeping = keep_alive_until_done(&http, &shared, &id, r1, &renewed);
            tokio::pin!(keeping);
            tokio::select! {
                answer = acquire => answer,
                () = &mut keeping => None,
            }
        };
        let Some((StatusCode::CREATED, grant)) = answer else {
            continue;
        };
        let start = Instant::now();
        let fence = grant["fence"].as_u64().unwrap();
        // Believed held until the session's end, on this clock: a lease under a session ends
        // with it.
        let mut believed = *renewed.lock().unwrap() + Duration::from_millis(TTL_MS);
        let hold_ms = rand::rng().random_range(50..400u64);
        let hold_until = start + Duration::from_millis(hold_ms);
        let mut lost = false;
        while Instant::now() < hold_until && !abandon_waiting {
            // The work under the lock: a read-modify-write, only while the lease is believed.
            if Instant::now() + Duration::from_millis(30) >= believed {
                let sent = Instant::now();
                match post(
                    &http,
                    format!(
                        "{}/sessions/{id}/renew",
                        pick(rand::rng().random::<u32>() as usize)
                    ),
                )
                .await
                {
                    Some((StatusCode::OK, _)) => believed = sent + Duration::from_millis(TTL_MS),
                    Some((StatusCode::NOT_FOUND, _)) => {
                        lost = true;
                        break;
                    }
                    _ => {}
                }
                if Instant::now() >= believed {
                    lost = true;
                    break;
                }
            }
            let seen = shared.counter.load(Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(5)).await;
            if shared.counter.load(Ordering::SeqCst) != seen {
                shared.lost_updates.fetch_add(1, Ordering::SeqCst);
            }
            shared.counter.store(seen + 1, Ordering::SeqCst);
            shared.updates.fetch_add(1, Ordering::SeqCst);
        }
        let abandoned = abandon || abandon_waiting || lost;
        let end = if abandoned {
            // Dead: no release, no close, no keep-alive. The client could believe it held the key
            // until `believed`.
            believed
        } else {
            let end = Instant::now();
            let close = http
                .delete(format!("{}/sessions/{id}", pick(r2 + 1)))
                .send()
                .await;
            assert!(close.is_ok());
            end
        };
        shared.holds.lock().await.push(Hold {
            client: n,
            fence,
            start,
            end,
            abandoned,
        });
    }
}

/// Keeps session `id` alive every third of its TTL (never ends by itself: the caller races it),
/// booking in `renewed` the send time of each keep-alive the broker confirmed.
async fn keep_alive_until_done(
    http: &Client,
    shared: &Shared,
    id: &str,
    r: usize,
    renewed: &std::sync::Mutex<Instant>,
) {
    let mut i = r;
    loop {
        tokio::time::sleep(Duration::from_millis(TTL_MS / 3)).await;
        i += 1;
        let url = format!(
            "{}/sessions/{id}/renew",
            shared.brokers[i % shared.brokers.len()]
        );
        let sent = Instant::now();
        if let Some((StatusCode::OK, _)) = post(http, url).await {
            *renewed.lock().unwrap() = sent;
        }
    }
}

fn check(holds: &mut [Hold]) -> String {
    holds.sort_by_key(|h| h.start);
    for pair in holds.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            a.end <= b.start,
            "client {} held the key (fence {}, abandoned {}) until {:?} after client {} was \
             granted it (fence {})",
            a.client,
            a.fence,
            a.abandoned,
            a.end - b.start,
            b.client,
            b.fence
        );
        assert!(
            b.fence > a.fence,
            "fences must rise in grant order: {a:?} then {b:?}"
        );
    }
    let abandoned = holds.iter().filter(|h| h.abandoned).count();
    format!("{} holds, {abandoned} of them abandoned", holds.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_sessions_on_two_brokers_never_let_two_clients_hold_one_key() {
    let mut redis = RedisServer::start().await;
    let apps = spawn_apps(&redis.url(), 2, |_| {}).await;
    let shared = Arc::new(Shared {
        brokers: apps.iter().map(|a| a.address.clone()).collect(),
        holds: Mutex::default(),
        counter: AtomicU64::new(0),
        lost_updates: AtomicU64::new(0),
        updates: AtomicU64::new(0),
    });
    let until = Instant::now() + RUN;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(hammer(n, shared.clone(), until)))
        .collect();
    // Halfway, Redis restarts empty: every session and lease is lost or put back.
    tokio::time::sleep(RUN / 2).await;
    redis.restart().await;
    for client in clients {
        client.await.expect("a client task");
    }
    let mut holds = shared.holds.lock().await.clone();
    let summary = check(&mut holds);
    let abandoned = holds.iter().filter(|h| h.abandoned).count();
    eprintln!(
        "{summary}; {} updates under the lock",
        shared.updates.load(Ordering::SeqCst)
    );
    assert_eq!(
        shared.lost_updates.load(Ordering::SeqCst),
        0,
        "an update was lost"
    );
    assert!(
        holds.len() >= 12,
        "too few holds to mean anything: {summary}"
    );
    assert!(abandoned >= 3, "too few abandoned sessions: {summary}");
}
