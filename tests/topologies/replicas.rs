//! Replica acknowledgements (`--redis-replica-acks`): on a master with one replica, a grant or
//! renewal is answered only once the replica has it; with the replica frozen, an acquire
//! answers 503 within about the store timeout and leaves nothing behind, and a renewal leaves
//! the lease ending when its holder was last told.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockbroker_test_support::app::spawn_app_with;
use lockbroker_test_support::broker::wait_until_ready;
use lockbroker_test_support::redis;
use lockbroker_test_support::redis_server::RedisServer;
use reqwest::{Method, StatusCode};

use crate::torture;

use torture::{Brokers, Plan};

/// The acknowledging broker's store timeout: WAIT waits half of it. Long enough that a replica
/// on a loaded 2-core machine acknowledges an unstalled write within it: 600 ms failed one run
/// in three with the safety suite running beside it, and 1500 ms (WAIT 750 ms) failed one CI
/// run while the Cluster and Sentinel topologies of this file's neighbours were starting.
const STORE_TIMEOUT_MS: u64 = 3000;

/// Makes `replica` a replica of `master` and waits until it is in sync.
async fn replicate(master: &RedisServer, replica: &RedisServer) {
    // The first sync streams the data set without touching the disk, after a delay (5 s by
    // default) that waits for more replicas to join: there are no more.
    master.config_set("repl-diskless-sync-delay", 0).await;
    // A replica writes a full sync to dump.rdb in its directory, the temp directory that every
    // test's redis-server loads at start (`dir` cannot be changed at run time): it loads syncs
    // from the socket instead, always.
    replica.config_set("repl-diskless-load", "swapdb").await;
    let mut conn = replica.connection().await;
    let () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(master.port())
        .query_async(&mut conn)
        .await
        .expect("REPLICAOF");
    until_in_sync(master).await;
}

/// Waits until a write on `master` is acknowledged by its replica ("online" in the master's
/// INFO comes a moment before the replica has loaded the first sync; a thawed replica catches
/// up after a moment too).
async fn until_in_sync(master: &RedisServer) {
    let mut master_conn = master.connection().await;
    let started = Instant::now();
    loop {
        let () = redis::cmd("SET")
            .arg("replication-check")
            .arg(1)
            .query_async(&mut master_conn)
            .await
            .expect("SET");
        let acked: u64 = redis::cmd("WAIT")
            .arg(1)
            .arg(100)
            .query_async(&mut master_conn)
            .await
            .expect("WAIT");
        if acked == 1 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the replica did not come online"
        );
    }
}

async fn lock_exists(redis: &RedisServer, key: &str) -> bool {
    let mut conn = redis.connection().await;
    redis::cmd("EXISTS")
        .arg(format!("lockbroker:{{{key}}}:lock"))
        .query_async::<u8>(&mut conn)
        .await
        .expect("EXISTS")
        == 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_and_renewals_wait_for_the_replica_and_leave_nothing_when_it_stalls() {
    let master = RedisServer::start().await;
    let replica = RedisServer::start().await;
    replicate(&master, &replica).await;
    let acked = spawn_app_with(Some(master.url()), |c| {
        c.redis_replica_acks = Some(1);
        c.store_timeout_ms = Some(STORE_TIMEOUT_MS);
    })
    .await;
    // A broker that does not wait, to look at the store.
    let plain = spawn_app_with(Some(master.url()), |_| {}).await;
    wait_until_ready(&acked.address, Duration::from_secs(5)).await;
    wait_until_ready(&plain.address, Duration::from_secs(5)).await;

    // Answered only once the replica has it: the replica has it at the moment of the answer.
    let held = acked.grant("acked", "ttl_ms=20000").await;
    assert!(lock_exists(&replica, "acked").await);
    let renewed = acked
        .renew("acked", &held.token, "ttl_ms=20000")
        .await
        .expect_grant(StatusCode::OK);
    // A shared lease and a semaphore permit, the same way.
    let reader = acked.grant("readers", "mode=shared&ttl_ms=20000").await;
    let permit = acked
        .send(acked.request(Method::POST, "/semaphores/pool?limit=2&ttl_ms=20000"))
        .await;
    permit.expect_status(StatusCode::CREATED);
    let permit = permit.json();

    replica.pause();
    let asked = Instant::now();
    acked
        .acquire("stalled", "ttl_ms=20000")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_millis(STORE_TIMEOUT_MS / 2)
            && took < Duration::from_millis(STORE_TIMEOUT_MS * 2),
        "a grant the replica did not acknowledge was answered after {took:?}"
    );
    // Nothing left behind: the key is free on the master.
    assert!(!lock_exists(&master, "stalled").await);
    plain
        .inspect("stalled")
        .await
        .expect_error(StatusCode::NOT_FOUND, "not_held");

    // A renewal the replica does not acknowledge: 503, and the lease ends exactly when its
    // holder was last told, not when the unacknowledged renewal said.
    acked
        .renew("acked", &held.token, "ttl_ms=30000")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    let view = plain.inspect("acked").await.json();
    assert_eq!(view["expires_at_ms"], renewed.expires_at_ms, "{view}");
    // So do a shared lease's and a permit's: each ends when its holder was last told.
    acked
        .renew("readers", &reader.token, "ttl_ms=30000")
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    let view = plain.inspect("readers").await.json();
    assert_eq!(
        view["holders"][0]["expires_at_ms"], reader.expires_at_ms,
        "{view}"
    );
    acked
        .send(
            acked
                .request(Method::POST, "/semaphores/pool/renew?ttl_ms=30000")
                .header("Lock-Token", permit["token"].as_str().unwrap()),
        )
        .await
        .expect_error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable");
    let view = plain.get("/semaphores/pool").await.json();
    assert_eq!(
        view["holders"][0]["expires_at_ms"], permit["expires_at_ms"],
        "{view}"
    );

    replica.resume();
    until_in_sync(&master).await;
    let granted = acked.grant("stalled", "ttl_ms=20000").await;
    assert!(lock_exists(&replica, "stalled").await);
    acked.release_ok("stalled", &granted.token).await;
    acked
        .renew("acked", &held.token, "ttl_ms=5000")
        .await
        .expect_status(StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_grants_share_waits_yet_each_is_on_the_replica_when_answered_and_the_torture_check_holds_across_a_stalled_replica()
 {
    let master = RedisServer::start().await;
    let replica = RedisServer::start().await;
    replicate(&master, &replica).await;
    // A longer store timeout than the other test's: 48 grants at once on a loaded machine must
    // not time out before the replica stalls on purpose.
    const STORE_TIMEOUT_MS: u64 = 2000;
    let spawn = || {
        spawn_app_with(Some(master.url()), |c| {
            c.redis_replica_acks = Some(1);
            c.store_timeout_ms = Some(STORE_TIMEOUT_MS);
        })
    };
    let brokers = [Arc::new(spawn().await), Arc::new(spawn().await)];
    for broker in &brokers {
        wait_until_ready(&broker.address, Duration::from_secs(5)).await;
    }

    // Many grants at once on one broker: the ones whose writes land while a WAIT is in flight
    // share the next one, and still each is on the replica when its answer arrives.
    const CONCURRENT: usize = 48;
    let waits_before = master.command_calls("wait").await;
    let mut grants = tokio::task::JoinSet::new();
    for i in 0..CONCURRENT {
        let (app, replica_conn) = (brokers[i % 2].clone(), replica.connection().await);
        grants.spawn(async move {
            let key = format!("together-{i}");
            let grant = app.grant(&key, "ttl_ms=20000").await;
            let mut replica_conn = replica_conn;
            let on_replica: u8 = redis::cmd("EXISTS")
                .arg(format!("lockbroker:{{{key}}}:lock"))
                .query_async(&mut replica_conn)
                .await
                .expect("EXISTS on the replica");
            (key, grant.token, on_replica)
        });
    }
    while let Some(outcome) = grants.join_next().await {
        let (key, _, on_replica) = outcome.expect("a grant task");
        assert_eq!(
            on_replica, 1,
            "{key} was answered before the replica had it"
        );
    }
    let waits = master.command_calls("wait").await - waits_before;
    eprintln!("{CONCURRENT} concurrent grants were acknowledged by {waits} WAITs");

    // The torture check (no overlap, no lost update, rising fences, only allowed answers) across
    // a replica that stops acknowledging for longer than a WAIT waits (half the store timeout):
    // grants meanwhile answer 503 and are released, grants before and after are acknowledged.
    let addresses: Vec<String> = brokers.iter().map(|b| b.address.clone()).collect();
    let plan = Plan {
        ttl_ms: 2000,
        limit: Duration::from_secs(30),
        ..Plan::new("hot", 8, 100).waiting(1000, STORE_TIMEOUT_MS)
    };
    let run = torture::start(&Brokers::new(addresses), &plan);
    run.until_sections(20).await;
    let before = run.sections_so_far();
    replica.pause();
    tokio::time::sleep(Duration::from_millis(STORE_TIMEOUT_MS * 2)).await;
    replica.resume();
    until_in_sync(&master).await;
    let resumed = run.sections_so_far();
    let report = run.finish().await;
    let summary = report.check();
    assert!(
        summary.unavailable > 0,
        "no grant was refused while the replica stalled: {summary}"
    );
    assert!(
        summary.sections >= resumed + 20,
        "only {} sections after the replica came back ({before} before it stalled): {summary}",
        summary.sections - resumed
    );
    eprintln!("{summary}");
}

/// How many ack links a broker keeps with replica acks on one Redis (`ACK_LINKS`).
const ACK_LINKS: usize = 16;

/// How many clients of `master` are blocked in a `WAIT` now, as `CLIENT LIST` shows them.
async fn blocked_waits(master: &RedisServer) -> usize {
    let mut conn = master.connection().await;
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .expect("CLIENT LIST");
    clients
        .lines()
        .filter(|client| {
            let field = |name: &str| {
                client
                    .split(' ')
                    .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
            };
            field("cmd") == Some("wait") && field("flags").is_some_and(|f| f.contains('b'))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_on_different_keys_wait_for_the_replica_on_several_connections_at_once() {
    let master = RedisServer::start().await;
    let replica = RedisServer::start().await;
    replicate(&master, &replica).await;
    // WAIT waits 5 s: the stalled replica keeps the WAITs blocked long enough to be seen.
    const STORE_TIMEOUT_MS: u64 = 10_000;
    let acked = spawn_app_with(Some(master.url()), |c| {
        c.redis_replica_acks = Some(1);
        c.store_timeout_ms = Some(STORE_TIMEOUT_MS);
    })
    .await;
    wait_until_ready(&acked.address, Duration::from_secs(5)).await;

    // With the replica stalled, grants spread over the broker's ack links each end in a WAIT
    // that blocks: one on each link that carried a grant, at once (over one connection the
    // broker would keep one WAIT in flight, the others' grants waiting behind it), and never
    // more than one per link (group commit on each).
    replica.pause();
    // Twice as many grants as links: more than one WAIT per link would show.
    let keys: Vec<String> = (0..2 * ACK_LINKS).map(|i| format!("apart-{i}")).collect();
    let grants: Vec<_> = keys
        .iter()
        .map(|key| acked.spawn_acquire(key, "ttl_ms=20000"))
        .collect();
    let started = Instant::now();
    loop {
        let blocked = blocked_waits(&master).await;
        assert!(
            blocked <= ACK_LINKS,
            "{blocked} WAITs in flight at once: more than one per ack link"
        );
        if blocked >= 2 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_millis(STORE_TIMEOUT_MS / 2),
            "never more than {blocked} WAIT in flight at once"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    replica.resume();
    for (key, grant) in keys.iter().zip(grants) {
        grant
            .await
            .expect("an acquire task")
            .expect_grant(StatusCode::CREATED);
        assert!(
            lock_exists(&replica, key).await,
            "{key} was answered before the replica had it"
        );
    }
}
