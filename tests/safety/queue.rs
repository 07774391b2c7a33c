//! The queue per key that every broker on one Redis shares: waiters are granted in the order they
//! joined it whatever their broker, consecutive shared requests together and an exclusive one
//! holding later shared ones back, permits in turn; a broker killed with waiters queued delays
//! the key by at most one offer window; and under the torture check's load, clients that give up
//! mid-wait never hold the key up.
//!
//! The order a waiter joined the queue is known from the harness's side: each waiter is sent
//! only once the one before it shows in the queue in Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockbroker_test_support::app::{TestApp, spawn_apps};
use lockbroker_test_support::http::{Answer, Grant, http_client, metric};
use lockbroker_test_support::redis::AsyncCommands;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::StatusCode;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::faults::{cut_off, three_broker_processes};
use crate::torture::{self, Brokers, Plan};

/// The brokers' store timeout here, and so their offer window: an offer not taken within it
/// passes on.
const STORE_TIMEOUT_MS: u64 = 500;

async fn brokers(redis: &RedisServer, n: usize) -> Vec<TestApp> {
    let apps = spawn_apps(&redis.url(), n, |c| {
        c.store_timeout_ms = Some(STORE_TIMEOUT_MS)
    })
    .await;
    redis.wait_until_listening(n as u64).await;
    apps
}

/// How many bids wait in the queue of `key` (a lock's, or with `semaphore` a semaphore's).
async fn queued(redis: &RedisServer, key: &str, semaphore: bool) -> u64 {
    let space = if semaphore { ":sem" } else { "" };
    let mut conn = redis.connection().await;
    conn.zcard(format!("lockbroker:{{{key}}}{space}:queue"))
        .await
        .expect("ZCARD")
}

/// Waits (at most 5 s) until `n` bids wait in the queue of `key`.
async fn until_queued(redis: &RedisServer, key: &str, semaphore: bool, n: u64) {
    let started = Instant::now();
    loop {
        let now = queued(redis, key, semaphore).await;
        if now == n {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{now} bids queued on {key}, not {n}, after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Sends `path?query` to `app` as a waiting request that joins the queue: returns once it is
/// the queue's `n`-th bid.
async fn join(
    redis: &RedisServer,
    app: &TestApp,
    key: &str,
    query: &str,
    semaphore: bool,
    n: u64,
) -> JoinHandle<Answer> {
    let handle = if semaphore {
        let request = http_client().post(app.url(&format!("/semaphores/{key}?{query}")));
        tokio::spawn(async move { Answer::send(request).await })
    } else {
        app.spawn_acquire(key, query)
    };
    until_queued(redis, key, semaphore, n).await;
    handle
}

async fn answered(handle: JoinHandle<Answer>, what: &str) -> Answer {
    tokio::time::timeout(Duration::from_secs(5), handle)
        .await
        .unwrap_or_else(|_| panic!("{what} was not granted within 5 s"))
        .expect("the request task")
}

async fn granted(handle: JoinHandle<Answer>, what: &str) -> Grant {
    answered(handle, what)
        .await
        .expect_grant(StatusCode::CREATED)
}

/// A semaphore's grant: its token and fence (the body adds `limit` to a lock's).
struct Permit {
    token: String,
    fence: u64,
}

fn permit_of(answer: &Answer) -> Permit {
    let body = answer.expect_status(StatusCode::CREATED).json();
    Permit {
        token: body["token"].as_str().expect("a token").to_owned(),
        fence: body["fence"].as_u64().expect("a fence"),
    }
}

async fn granted_permit(handle: JoinHandle<Answer>, what: &str) -> Permit {
    permit_of(&answered(handle, what).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_three_brokers_are_granted_in_the_order_they_joined_the_queue() {
    let redis = RedisServer::start().await;
    let apps = brokers(&redis, 3).await;
    let holder = apps[0].grant("fifo", "ttl_ms=30000").await;
    // Not round-robin, and not in the order the brokers subscribed: the store decides the
    // order, not which broker hears of a release first.
    let on = [2, 0, 1, 1, 2, 0, 0, 2, 1, 2, 2, 0];
    let mut waiting = Vec::new();
    for (n, &b) in on.iter().enumerate() {
        let handle = join(
            &redis,
            &apps[b],
            "fifo",
            "wait_ms=20000&ttl_ms=10000",
            false,
            n as u64 + 1,
        )
        .await;
        waiting.push((b, handle));
    }
    apps[0].release_ok("fifo", &holder.token).await;
    // Each waiter in turn: if a later one had been granted first, it would hold the key (the
    // harness releases only the one it expects), and the expected one would never come.
    let mut fence = holder.fence;
    for (n, (b, handle)) in waiting.into_iter().enumerate() {
        let grant = granted(handle, &format!("waiter {n} (on broker {b})")).await;
        assert!(grant.fence > fence, "fences rise in grant order");
        fence = grant.fence;
        apps[b]
            .release("fifo", &grant.token)
            .await
            .expect_status(StatusCode::NO_CONTENT);
    }
    assert_eq!(queued(&redis, "fifo", false).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_and_exclusive_waiters_across_brokers_keep_the_queue_order_and_shared_heads_go_together()
 {
    let redis = RedisServer::start().await;
    let apps = brokers(&redis, 3).await;
    let holder = apps[0].grant("rw", "ttl_ms=30000").await;
    let shared = "wait_ms=20000&ttl_ms=10000&mode=shared";
    let exclusive = "wait_ms=20000&ttl_ms=10000";
    let s1 = join(&redis, &apps[1], "rw", shared, false, 1).await;
    let s2 = join(&redis, &apps[2], "rw", shared, false, 2).await;
    let x1 = join(&redis, &apps[0], "rw", exclusive, false, 3).await;
    let s3 = join(&redis, &apps[1], "rw", shared, false, 4).await;
    let s4 = join(&redis, &apps[2], "rw", shared, false, 5).await;

    apps[0].release_ok("rw", &holder.token).await;
    // The two shared heads together: the second is granted while the first still holds.
    let g1 = granted(s1, "the first shared waiter").await;
    let g2 = granted(s2, "the second shared waiter").await;
    assert!(!x1.is_finished(), "the exclusive waiter waits for both");
    for (app, grant) in [(&apps[1], &g1), (&apps[2], &g2)] {
        app.release_ok("rw", &grant.token).await;
    }
    let gx = granted(x1, "the exclusive waiter").await;
    assert!(gx.fence > g1.fence.max(g2.fence));
    apps[0].release_ok("rw", &gx.token).await;
    // The shared waiters that came after the exclusive one were held back until it was granted:
    // their fences are above its fence.
    let g3 = granted(s3, "the third shared waiter").await;
    let g4 = granted(s4, "the fourth shared waiter").await;
    assert!(
        g3.fence > gx.fence && g4.fence > gx.fence,
        "a shared waiter went ahead of the exclusive one queued before it"
    );
    // And they hold together.
    let shown = apps[0].inspect("rw").await.json();
    assert_eq!(
        shown["holders"].as_array().map(Vec::len),
        Some(2),
        "{shown}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_waiters_across_brokers_get_permits_in_the_order_they_joined() {
    let redis = RedisServer::start().await;
    let apps = brokers(&redis, 3).await;
    let permit = |app: &TestApp| {
        let request = http_client().post(app.url("/semaphores/pool?limit=2&ttl_ms=30000"));
        async move { permit_of(&Answer::send(request).await) }
    };
    let p1 = permit(&apps[0]).await;
    let p2 = permit(&apps[1]).await;
    let query = "limit=2&wait_ms=20000&ttl_ms=10000";
    let w1 = join(&redis, &apps[2], "pool", query, true, 1).await;
    let w2 = join(&redis, &apps[0], "pool", query, true, 2).await;
    let w3 = join(&redis, &apps[1], "pool", query, true, 3).await;
    let release = |app: &TestApp, token: &str| {
        let request = http_client()
            .delete(app.url("/semaphores/pool"))
            .header("Lock-Token", token.to_owned());
        async move {
            Answer::send(request)
                .await
                .expect_status(StatusCode::NO_CONTENT);
        }
    };
    release(&apps[0], &p1.token).await;
    let g1 = granted_permit(w1, "the first permit waiter").await;
    assert!(!w2.is_finished() && !w3.is_finished(), "one permit freed");
    release(&apps[1], &p2.token).await;
    let g2 = granted_permit(w2, "the second permit waiter").await;
    release(&apps[2], &g1.token).await;
    let g3 = granted_permit(w3, "the third permit waiter").await;
    assert!(g1.fence < g2.fence && g2.fence < g3.fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_with_waiters_queued_delays_the_key_by_at_most_one_offer_window() {
    let redis = RedisServer::start().await;
    let [mut doomed, two, three] = three_broker_processes(&redis, STORE_TIMEOUT_MS).await;
    let post = |base: String, query: &'static str| {
        let request = http_client().post(format!("{base}/locks/dead?{query}"));
        tokio::spawn(async move { request.send().await.map(|r| r.status()) })
    };
    let holder =
        Answer::send(http_client().post(format!("{}/locks/dead?ttl_ms=30000", three.address())))
            .await
            .expect_grant(StatusCode::CREATED);
    // Three waiters on the doomed broker first in the queue, then one on a survivor.
    let mut on_doomed = Vec::new();
    for n in 1..=3 {
        on_doomed.push(post(doomed.address(), "wait_ms=30000&ttl_ms=10000"));
        until_queued(&redis, "dead", false, n).await;
    }
    let survivor = {
        let request = http_client().post(format!(
            "{}/locks/dead?wait_ms=30000&ttl_ms=10000",
            two.address()
        ));
        tokio::spawn(async move { Answer::send(request).await })
    };
    until_queued(&redis, "dead", false, 4).await;
    doomed.kill();
    cut_off(on_doomed).await;
    // The killed broker's bids are still in the queue, ahead of the survivor's.
    assert_eq!(queued(&redis, "dead", false).await, 4);

    let released = Instant::now();
    Answer::send(
        http_client()
            .delete(format!("{}/locks/dead", three.address()))
            .header("Lock-Token", holder.token),
    )
    .await
    .expect_status(StatusCode::NO_CONTENT);
    let grant = tokio::time::timeout(Duration::from_secs(10), survivor)
        .await
        .expect("the survivor's waiter must get the key")
        .expect("the waiter task")
        .expect_grant(StatusCode::CREATED);
    let delay = released.elapsed();
    eprintln!("the survivor got the key {delay:?} after the release");
    // The key is offered to the dead broker's first bid; the offer lapses after one window,
    // and the survivor's broker — told to look then — drops every bid of the dead broker and
    // takes the key. Slack: scheduling on a loaded machine.
    let bound = Duration::from_millis(STORE_TIMEOUT_MS) + Duration::from_millis(1500);
    assert!(
        delay < bound,
        "a dead broker's queued waiters held the key up for {delay:?} (bound {bound:?})"
    );
    assert!(grant.fence > holder.fence);
    assert_eq!(
        queued(&redis, "dead", false).await,
        0,
        "the dead broker's bids are gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_give_up_mid_wait_never_hold_the_key_up_across_three_brokers() {
    let redis = RedisServer::start().await;
    let apps = brokers(&redis, 3).await;
    let urls: Vec<String> = apps.iter().map(|a| a.url("")).collect();
    let brokers = Brokers::new(urls.clone());
    let plan = Plan {
        limit: Duration::from_secs(6),
        hold_ms: 0..=3,
        ..Plan::new("quitters", 9, 10_000)
    };
    let run = torture::start(&brokers, &plan);
    run.until_sections(10).await;
    // Meanwhile, waiters that give up after 20–200 ms (their connection closes mid-wait) join
    // the same queue on every broker, many of them ahead of the torture's clients.
    let stop = Arc::new(AtomicBool::new(false));
    let quitters: Vec<_> = (0..6)
        .map(|q| {
            let (stop, url) = (stop.clone(), urls[q % urls.len()].clone());
            tokio::spawn(async move {
                let client = http_client();
                let mut gave_up = 0u32;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let patience = Duration::from_millis(20 + (n * 37 + q as u64 * 11) % 180);
                    // A short TTL: a quitter that gives up at the very moment its grant is sent
                    // never reads it, and that lease is held, by nobody, until its TTL (the
                    // contract allows it: it was granted at that instant).
                    let request = client
                        .post(format!("{url}/locks/quitters?wait_ms=30000&ttl_ms=400"))
                        .timeout(patience)
                        .send();
                    match request.await {
                        Err(e) if e.is_timeout() => gave_up += 1,
                        Err(e) => panic!("a quitter's request failed: {e}"),
                        // Granted before it gave up: release at once. Its patience covers the
                        // body too: a grant whose head came just in time and whose body did not
                        // is a quitter that gave up without reading its token, as above.
                        Ok(response) if response.status() == StatusCode::CREATED => {
                            let body = match response.text().await {
                                Err(e) if e.is_timeout() => {
                                    gave_up += 1;
                                    continue;
                                }
                                body => body.expect("the grant's body is read"),
                            };
                            let grant: Grant = serde_json::from_str(&body).expect("a grant's body");
                            client
                                .delete(format!("{url}/locks/quitters"))
                                .header("Lock-Token", grant.token)
                                .send()
                                .await
                                .expect("the release is answered");
                        }
                        Ok(response) => panic!("a quitter got {}", response.status()),
                    }
                }
                gave_up
            })
        })
        .collect();
    let report = run.finish().await;
    stop.store(true, Ordering::Relaxed);
    let mut gave_up = 0;
    for quitter in quitters {
        gave_up += quitter.await.expect("the quitter task");
    }
    let summary = report.check();
    // Progress: no stretch without a grant longer than one offer window plus slack.
    let mut starts: Vec<Instant> = report.sections.iter().map(|s| s.start).collect();
    starts.sort();
    let longest = starts
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    // Releases that granted the key straight to a waiter of their own broker (some of them
    // waiters that gave up meanwhile, whose grants were released again).
    let mut direct = 0.0;
    for app in &apps {
        direct += metric(&app.address, "lockbroker_direct_grants_total").await;
    }
    eprintln!(
        "{summary}; {gave_up} waiters gave up mid-wait; {direct} direct grants; longest gap \
         {longest:?}"
    );
    assert!(gave_up >= 20, "only {gave_up} waiters gave up mid-wait");
    assert!(
        direct >= 10.0,
        "only {direct} direct grants: the run did not test them"
    );
    assert!(
        longest < Duration::from_millis(STORE_TIMEOUT_MS) + Duration::from_millis(1500),
        "the key stood still for {longest:?}"
    );
    // Waiters that gave up left the queue (each leaves as its connection closes).
    until_queued(&redis, "quitters", false, 0).await;
}
