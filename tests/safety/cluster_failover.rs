//! A Redis Cluster master fails over under load, losing writes on the way: the brokers follow
//! the promoted replica, put back the live lease it missed, and mutual exclusion holds.

use std::time::Duration;

use redis::Value;
use tokio::time::Instant;

use lockbroker_test_support::app::{TestApp, spawn_app_with};
use lockbroker_test_support::broker::wait_until_ready;
use lockbroker_test_support::cluster::RedisCluster;

use crate::faults::until_sections;
use crate::torture::{self, Brokers, Plan};

const STORE_TIMEOUT_MS: u64 = 1000;

/// The contract: grants resume within 10 s of the new master's election.
const RESUME_LIMIT: Duration = Duration::from_secs(10);

async fn brokers(cluster: &RedisCluster, n: usize) -> Vec<TestApp> {
    let mut apps = Vec::new();
    for _ in 0..n {
        apps.push(
            spawn_app_with(Some(cluster.url()), |c| {
                c.store_timeout_ms = STORE_TIMEOUT_MS;
                c.store_settle_ms = 1500;
            })
            .await,
        );
    }
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
        // Long leases: a lease the new master missed would block nobody unless it is put back,
        // so a broker that failed to put it back shows as an overlap.
        ttl_ms: 20_000,
        wait_ms: 1000,
        hold_ms: 0..=3,
        // Stopped once grants are back after the failover (`Run::stop`); this bounds a failover
        // that never ends.
        limit: Duration::from_secs(40),
        answer_bound: Duration::from_millis(1000 + STORE_TIMEOUT_MS) + Duration::from_secs(2),
        ..Plan::new("hot", 12, 10_000)
    };
    let run = torture::start(&brokers, &plan);
    until_sections(&run, 30).await;

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
    let cut_off = run.sections_so_far();
    until_sections(&run, cut_off + 20).await;
    cluster.kill(master);
    cluster.signal(replica, "-CONT");
    let promoted = cluster
        .wait_for_new_master("lockbroker:{hot}:lock", master)
        .await;
    let elected = Instant::now();
    assert_eq!(promoted, replica);
    // Grants come back, and go on for a while on the new master.
    let at_election = run.sections_so_far();
    let started = Instant::now();
    while run.sections_so_far() < at_election + 200 {
        assert!(
            started.elapsed() < RESUME_LIMIT + Duration::from_secs(5),
            "only {} critical sections in {:?} after the election",
            run.sections_so_far() - at_election,
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run.stop();

    let report = run.finish().await;
    let summary = report.check();
    let resumed = report
        .sections
        .iter()
        .map(|s| s.start)
        .filter(|start| *start > elected)
        .min()
        .expect("no critical section after the failover");
    assert!(
        resumed - elected < RESUME_LIMIT,
        "grants resumed {:?} after the new master was elected",
        resumed - elected
    );
    println!(
        "cluster failover: {summary}; first grant {:?} after the election",
        resumed - elected
    );
}
