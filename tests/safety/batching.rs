//! Group commit under a store loss: clients on many keys through two brokers, so that claims and
//! releases go out in batches (and one hot key, whose operations go alone), while Redis restarts
//! empty mid-run. Per key, the torture's check: no two critical sections overlap, no update is
//! lost, fences rise in grant order, every answer within its bound — and the brokers did batch.

use std::time::Duration;

use lockbroker_test_support::app::spawn_apps;
use lockbroker_test_support::http::metric;
use lockbroker_test_support::redis_server::RedisServer;
use tokio::time::Instant;

use crate::torture::{self, Brokers, Plan};

/// The store timeout of the brokers: small, so the restart is felt fast.
const STORE_TIMEOUT_MS: u64 = 300;

/// Keys with a client of their own: free whenever asked, so claimed and released in batches.
const OWN_KEYS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_claims_and_releases_keep_every_key_exclusive_across_a_redis_restart() {
    let mut redis = RedisServer::start().await;
    const TTL_MS: u64 = 1500;
    let apps = spawn_apps(&redis.url(), 2, |c| {
        c.store_timeout_ms = Some(STORE_TIMEOUT_MS);
        c.max_ttl_ms = Some(TTL_MS);
        c.default_ttl_ms = Some(TTL_MS);
    })
    .await;
    let brokers = Brokers::new(apps.iter().map(|a| a.address.clone()).collect());
    let plan = |key: String, clients| Plan {
        ttl_ms: TTL_MS,
        hold_ms: 0..=2,
        limit: Duration::from_secs(7),
        ..Plan::new(&key, clients, 100_000).waiting(800, STORE_TIMEOUT_MS)
    };
    let mut plans: Vec<Plan> = (0..OWN_KEYS).map(|k| plan(format!("own-{k}"), 1)).collect();
    plans.push(plan("hot".into(), 6));
    let runs: Vec<_> = plans.iter().map(|p| torture::start(&brokers, p)).collect();
    for run in &runs {
        run.until_sections(10).await;
    }
    redis.restart().await;
    let restarted = Instant::now();
    let mut after = 0;
    for (run, plan) in runs.into_iter().zip(&plans) {
        let report = run.finish().await;
        let summary = report.check();
        let since = report.sections_between(restarted, Instant::now()).len();
        assert!(
            since >= 3,
            "{}: {since} critical sections after the restart ({summary})",
            plan.key
        );
        after += since;
        eprintln!("{}: {summary}", plan.key);
    }
    let mut batches = 0.0;
    let mut batched = 0.0;
    let mut direct = 0.0;
    for app in &apps {
        batches += metric(&app.address, "lockbroker_store_batch_size_count").await;
        batched += metric(&app.address, "lockbroker_store_batch_size_sum").await;
        direct += metric(&app.address, "lockbroker_direct_grants_total").await;
    }
    eprintln!(
        "{after} critical sections after the restart; {batched} operations in {batches} \
         batches; {direct} direct grants"
    );
    // The hot key's waiters on the releasing broker are granted the key in the release's answer.
    assert!(direct >= 1.0, "no direct grant: the run did not test them");
    assert!(
        batched > batches && batches >= 10.0,
        "too little batched to test it: {batched} operations in {batches} batches"
    );
}
