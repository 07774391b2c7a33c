//! A Redis Cluster master fails over under load, losing writes on the way: the brokers follow
//! the promoted replica, put back the live lease it missed, and mutual exclusion holds.

use std::time::Duration;

use lockbroker_test_support::redis::{self, Value};
use tokio::time::Instant;

use lockbroker_test_support::app::{TestApp, spawn_apps};
use lockbroker_test_support::broker::wait_until_ready;
use lockbroker_test_support::cluster::RedisCluster;

use crate::torture::{self, Brokers, Plan};

const STORE_TIMEOUT_MS: u64 = 1000;

/// The contract: grants resume within 10 s of the new master's election.
const RESUME_LIMIT: Duration = Duration::from_secs(10);

async fn brokers(cluster: &RedisCluster, n: usize) -> Vec<TestApp> {
    let apps = spawn_apps(&cluster.url(), n, |c| {
        c.store_timeout_ms = Some(STORE_TIMEOUT_MS);
        // The default: every broker must catch up within it, under the suite's load.
        c.store_settle_ms = Some(3000);
    })
    .await;
    for app in &apps {
        wait_until_ready(&app.address, Duration::from_secs(15)).await;
    }
    apps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_holds_while_a_cluster_master_fails_over_to_a_replica_that_missed_writes()
{
    let mut cluster = RedisCluster::start(3).await;
    let apps = brokers(&cluster, 3).await;
    let master = cluster.master_of("lockbroker:{hot}:lock").await;
    let replica = cluster.replica_of(master).await;

    let brokers = Brokers::new(apps.iter().map(|a| a.address.clone()).collect());
    let plan = Plan {
        // Leases far longer than a critical section: a lease the new master missed would block
        // nobody unless it is put back, so a broker that failed to put it back shows as an
        // overlap. Not much longer: a release the new master missed (its notice lost with the
        // old master) is put back too, and blocks the key until its end — documented, and
        // bounded here so that grants are back within the contract's 10 s.
        ttl_ms: 4_000,
        wait_ms: 1000,
        hold_ms: 0..=3,
        // Stopped once grants are back after the failover (`Run::stop`); this bounds a failover
        // that never ends.
        limit: Duration::from_secs(40),
        answer_bound: Duration::from_millis(1000 + STORE_TIMEOUT_MS) + Duration::from_secs(2),
        ..Plan::new("hot", 12, 10_000)
    };
    let run = torture::start(&brokers, &plan);
    // Beside it, clients on a key of another master, through the same brokers: that master
    // loses nothing, so it grants throughout (each broker holds only the failed master's keys
    // while it puts leases back), and its key's sections never overlap either.
    let cold = key_where(&cluster, "cold", |m| m != master).await;
    let elsewhere = torture::start(
        &brokers,
        &Plan {
            key: cold,
            clients: 4,
            ..plan.clone()
        },
    );
    run.until_sections(30).await;
    elsewhere.until_sections(30).await;

    // Writes the replica will miss: freeze it, cut it off, let the clients go on.
    cluster.signal(replica, "-STOP");
    let mut conn = cluster.nodes[master].connection().await;
    let _: Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut conn)
        .await
        .expect("CLIENT KILL TYPE replica");
    // An extra client takes the hot key now (the new master will not have its lease) and works
    // through the failover until after grants resume: had its lease not been put back, a client
    // of the run would get the key meanwhile, and their sections would overlap.
    let probe = key_where(&cluster, "probe", |m| m == master).await;
    let mut timeline = None;
    let long = run
        .hold_once(&apps[0].address, 20_000, 3000, Duration::ZERO, async {
            cluster.kill(master);
            cluster.signal(replica, "-CONT");
            let promoted = cluster
                .wait_for_new_master("lockbroker:{hot}:lock", master)
                .await;
            let elected = Instant::now();
            let resumed = first_grant(&apps[1], &probe).await;
            timeline = Some((promoted, elected, resumed));
            // Work on a while after grants are back.
            tokio::time::sleep(Duration::from_secs(1)).await;
        })
        .await
        .expect("the extra client gets the hot key");
    let (promoted, elected, resumed) = timeline.expect("the failover happened");
    assert_eq!(promoted, replica);
    assert_eq!(
        long.released,
        Some(reqwest::StatusCode::NO_CONTENT),
        "the extra client's lease was not back for it to release"
    );
    assert!(
        resumed - elected < RESUME_LIMIT,
        "grants resumed {:?} after the new master was elected",
        resumed - elected
    );
    // And the run's clients go on on the new master.
    let after = run.sections_so_far();
    let started = Instant::now();
    while run.sections_so_far() < after + 100 {
        assert!(
            started.elapsed() < RESUME_LIMIT,
            "only {} critical sections in {:?} after the failover",
            run.sections_so_far() - after,
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run.stop();
    elsewhere.stop();

    let report = run.finish().await;
    let summary = report.check();
    let other = elsewhere.finish().await;
    let other_summary = other.check();
    // From the election until grants were back on the new master: the brokers caught up with
    // it and put their leases back meanwhile.
    let granted_elsewhere = other.sections_between(elected, resumed).len();
    assert!(
        granted_elsewhere > 0,
        "no section on another master while the failed one was caught up with ({:?})",
        resumed - elected
    );
    println!(
        "cluster failover: {summary}; a free key on the new master granted {:?} after the election; \
         on another master: {other_summary}, {granted_elsewhere} sections meanwhile",
        resumed - elected
    );
}

/// The first key `<prefix>-<i>` whose lock lives on a master that `wanted` accepts.
async fn key_where(cluster: &RedisCluster, prefix: &str, wanted: impl Fn(usize) -> bool) -> String {
    for i in 0.. {
        let key = format!("{prefix}-{i}");
        if wanted(
            cluster
                .master_of(&format!("lockbroker:{{{key}}}:lock"))
                .await,
        ) {
            return key;
        }
    }
    unreachable!()
}

/// Asks `app` for the free `key` until it is granted; every answer before is a 503 (which
/// leaves nothing behind). Returns when.
async fn first_grant(app: &TestApp, key: &str) -> Instant {
    let started = Instant::now();
    loop {
        let answer = app.acquire(key, "ttl_ms=1000").await;
        if answer.status == reqwest::StatusCode::CREATED {
            return Instant::now();
        }
        answer.expect_error(
            reqwest::StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
        );
        assert!(
            started.elapsed() < RESUME_LIMIT + Duration::from_secs(10),
            "no free key granted: {}",
            answer.text
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
