//! The soak: the torture check for longer, with more clients, while faults are injected at random
//! one after another — Redis frozen and thawed, Redis restarted empty, the link to Redis slowed,
//! cut or blackholed, a broker killed with SIGKILL and started again. Sized by the environment:
//!
//! - `LOCKBROKER_SOAK_SECONDS` (default 8): how long the clients hammer;
//! - `LOCKBROKER_SOAK_CLIENTS` (default 12): how many;
//! - `LOCKBROKER_SOAK_SEED` (default: from the clock): the faults' random sequence, printed so a
//!   failing run can be replayed.
//!
//! CI runs the short default; `LOCKBROKER_SOAK_SECONDS=600 LOCKBROKER_SOAK_CLIENTS=48 cargo test
//! --release --test safety soak -- --nocapture` is the long run (see docs/testing.md).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockbroker_test_support::broker::{BrokerProcess, BrokerSpec, wait_until_ready};
use lockbroker_test_support::redis_server::RedisServer;
use tokio::time::Instant;

use crate::proxy::{Mode, Proxy, redis_addr};
use crate::torture::{self, Brokers, Plan};

const STORE_TIMEOUT_MS: u64 = 300;
/// Short leases, so a lost lease costs a second, not more.
const MAX_TTL_MS: u64 = 1000;

fn setting(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        Err(_) => default,
    }
}

/// SplitMix64: a small, seedable sequence, so a run can be replayed from its printed seed.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soak_of_random_faults_never_breaks_mutual_exclusion() {
    let seconds = setting("LOCKBROKER_SOAK_SECONDS", 8);
    let clients = usize::try_from(setting("LOCKBROKER_SOAK_CLIENTS", 12)).unwrap();
    let seed = setting(
        "LOCKBROKER_SOAK_SEED",
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    );
    eprintln!(
        "soak: {seconds} s, {clients} clients, LOCKBROKER_SOAK_SEED={seed} (set \
         LOCKBROKER_SOAK_SECONDS for a longer run)"
    );
    let mut dice = Dice(seed);

    let mut redis = RedisServer::start().await;
    let proxy = Proxy::start(redis_addr(&redis.url())).await;
    let spec = BrokerSpec {
        store_timeout_ms: STORE_TIMEOUT_MS,
        max_ttl_ms: MAX_TTL_MS,
        ..BrokerSpec::on(crate::LOCKBROKER, proxy.redis_url())
    };
    let mut brokers = Vec::new();
    for _ in 0..3 {
        brokers.push(BrokerProcess::start(spec.clone()).await);
    }
    redis.wait_until_listening(3).await;
    for broker in &brokers {
        wait_until_ready(&broker.address(), Duration::from_secs(8)).await;
    }
    let urls: Vec<String> = brokers.iter().map(BrokerProcess::address).collect();
    let plan = Plan {
        ttl_ms: MAX_TTL_MS,
        hold_ms: 0..=5,
        limit: Duration::from_secs(seconds),
        brokers_may_die: true,
        ..Plan::new("hot", clients, usize::MAX).waiting(500, STORE_TIMEOUT_MS)
    };
    let run = torture::start(&Brokers::new(urls.clone()), &plan);
    let end = run.started() + plan.limit;
    let mut faults = Vec::new();
    // Each fault lasts a moment, then everything is healed and ready again before the next, so
    // that the faults come one at a time (see docs/failover.md for what holds when they pile up).
    while Instant::now() + Duration::from_millis(1500) < end {
        tokio::time::sleep(Duration::from_millis(dice.between(200, 600))).await;
        let lasts = Duration::from_millis(dice.between(100, 700));
        let fault = match dice.between(0, 6) {
            0 => {
                redis.pause();
                tokio::time::sleep(lasts).await;
                redis.resume();
                format!("Redis frozen for {lasts:?}")
            }
            1 => {
                redis.restart().await;
                "Redis restarted empty".to_owned()
            }
            2 => {
                let by = dice.between(10, 600);
                proxy.set(Mode::Delay(Duration::from_millis(by)));
                tokio::time::sleep(lasts).await;
                proxy.set(Mode::Pass);
                format!("link delayed {by} ms for {lasts:?}")
            }
            3 => {
                proxy.set(Mode::Drop);
                tokio::time::sleep(lasts).await;
                proxy.set(Mode::Pass);
                format!("link cut for {lasts:?}")
            }
            4 => {
                proxy.set(Mode::Blackhole);
                tokio::time::sleep(lasts).await;
                proxy.set(Mode::Pass);
                format!("link blackholed for {lasts:?}")
            }
            _ => {
                let i = usize::try_from(dice.between(0, 2)).unwrap();
                brokers[i].kill();
                tokio::time::sleep(lasts).await;
                brokers[i].restart().await;
                format!("broker {i} killed, restarted {lasts:?} later")
            }
        };
        faults.push(fault);
        for url in &urls {
            wait_until_ready(url, Duration::from_secs(10)).await;
        }
    }
    let report = run.finish().await;
    let summary = report.check();
    eprintln!(
        "soak (seed {seed}): {summary} in {:?} through {} faults:\n  {}",
        report.took,
        faults.len(),
        faults.join("\n  ")
    );
    assert!(!faults.is_empty(), "the soak injected no fault");
    assert!(
        summary.sections >= clients,
        "the soak made almost no progress: {summary}"
    );
}
