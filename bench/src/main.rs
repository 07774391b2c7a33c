//! `lockbroker-bench`: a load generator for a running broker, and the same lock cycle run
//! directly against Redis in the same run, so the broker's cost is measured side by side with
//! the fastest thing a client could do instead.
//!
//! Phases: (a) uncontended acquire+release cycles, each client on its own key; (b) one hot key
//! with several contenders and zero hold time, measuring handoff (from a release being sent to
//! the next grant arriving); (c) with `--redis-url`, phase (a)'s cycle done by this process
//! straight on Redis with the broker's own scripts (one EVALSHA to claim, one to release);
//! (d) with `--redis-url` on one server, the textbook Redis lock cycle with nothing of
//! the broker's (`SET NX PX`, then a Lua compare-and-delete): the raw baseline.
//!
//! `--urls` runs instead one hot key through several brokers on one store (`fleet.rs`).
//!
//! `--mode` picks the lease the HTTP phases take: an exclusive lease (the default), a shared
//! lease on the lock, or one permit of a semaphore of `--limit` permits. Phase (c) exists for
//! exclusive leases only (phase (d) is the same in every mode), and handoff is measured only
//! where one holder follows another (an exclusive lease).
//!
//! `--ledger N` measures the lease ledger in this process instead, and `floor-proxy` (a hidden
//! subcommand) is the minimal lock server `--floor` measures the broker against; `delay-link`
//! (hidden too) is the slow link `scripts/measure-replica-acks.sh` puts between a replica and its
//! master; `redis-library` (hidden) prints the broker's function library for
//! `scripts/redis-instructions.py --functions`. The bench is a
//! program of its own, not a command of the shipped `lockbroker`: what only it needs (hyper's
//! HTTP client, the proxy, the `/proc` and `INFO` readers) stays out of the broker.
#![forbid(unsafe_code)]

mod args;
mod batches;
mod breakdown;
mod delay_link;
mod direct;
mod fleet;
mod floor;
mod floor_proxy;
mod http;
mod lean;
mod raw;
mod redis_stats;
mod sessions;
mod several;
mod table;
mod waiters;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use lockbroker_cli_support::{out, report};
use serde::Serialize;

use self::args::{BenchArgs, BenchMode, BenchTool};
use self::direct::uncontended_direct;
use self::floor::run_floor;
use self::http::{HttpRun, check_mode, hot_key_http, uncontended_http, wait_until_granting};
use self::raw::uncontended_raw;
use self::redis_stats::{RedisCost, data_nodes};
use self::table::print_table;
use self::waiters::park_waiters;
use lockbroker::domain::Token;
use lockbroker::store::RedisStore;
use lockbroker::store::redis::{ParsedUrl, RedisSettings, RedisUrl, Topology};

/// jemalloc, as in the broker: `--ledger` measures the memory the broker's allocator hands out,
/// and the floor proxy runs on the same allocator as the broker it is compared with.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let args = BenchArgs::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("cannot start the async runtime")
        .block_on(execute(args))
}

async fn execute(args: BenchArgs) -> ExitCode {
    match args.tool {
        Some(BenchTool::FloorProxy(proxy)) => return report(floor_proxy::serve(proxy).await),
        Some(BenchTool::DelayLink(link)) => return report(delay_link::serve(&link)),
        Some(BenchTool::RedisLibrary) => {
            out!("{}", lockbroker::store::redis::function_library());
            return ExitCode::SUCCESS;
        }
        None => {}
    }
    match args.ledger {
        Some(leases) => {
            let cost = lockbroker::store::ledger_cost(leases);
            if args.json {
                out!(
                    "{}",
                    serde_json::to_string(&cost).expect("plain structs always serialize")
                );
            } else {
                out!(
                    "ledger: {} live leases, {:.0} bytes per lease (resident memory growth); \
                     sweep {:.1} ms, put-back snapshot {:.1} ms",
                    cost.leases,
                    cost.bytes_per_lease,
                    cost.sweep_ms,
                    cost.snapshot_ms
                );
            }
            ExitCode::SUCCESS
        }
        None if !args.urls.is_empty() => report(fleet::run(args).await.map(drop)),
        None => report(run(args).await.map(drop)),
    }
}

/// Latency percentiles of one phase, in milliseconds.
#[derive(Debug, Serialize)]
pub struct Latency {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl Latency {
    fn of(mut samples: Vec<Duration>) -> Self {
        samples.sort_unstable();
        let at = |q: f64| -> f64 {
            if samples.is_empty() {
                return 0.0;
            }
            let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
            samples[i].as_secs_f64() * 1000.0
        };
        Self {
            samples: samples.len(),
            p50_ms: at(0.50),
            p99_ms: at(0.99),
            p999_ms: at(0.999),
            max_ms: at(1.0),
        }
    }
}

/// One phase's figures.
#[derive(Debug, Serialize)]
pub struct Phase {
    pub name: &'static str,
    pub clients: usize,
    pub seconds: f64,
    pub cycles: u64,
    pub cycles_per_sec: f64,
    pub errors: u64,
    /// Latency of one whole cycle (acquire + release).
    pub cycle: Latency,
    /// Hot key only: from a release being sent to the next grant arriving.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handoff: Option<Latency>,
    /// Redis script calls (EVALSHA/EVAL) per cycle, when Redis was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_calls_per_cycle: Option<f64>,
    /// Redis CPU time (user + system, summed over the data nodes) per cycle, in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_cpu_us_per_cycle: Option<f64>,
}

impl Phase {
    fn set_redis_cost(&mut self, cost: Option<redis_stats::PerCycle>) {
        self.redis_calls_per_cycle = cost.as_ref().map(|c| c.calls);
        self.redis_cpu_us_per_cycle = cost.map(|c| c.cpu_us);
    }
}

/// The whole run.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    /// The lease the HTTP phases took; absent for exclusive leases, whose summary is as it
    /// always was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<BenchMode>,
    /// `--mode semaphore`: each semaphore's permits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    pub phases: Vec<Phase>,
    /// Uncontended broker cycles/s over direct-Redis cycles/s, measured in this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_over_direct: Option<f64>,
    /// Uncontended broker cycles/s over raw Redis lock cycles/s (`SET NX PX` + compare-and-delete),
    /// measured in this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_over_raw: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiters: Option<WaitersPhase>,
    /// `--floor`: the broker beside the minimal proxy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor: Option<floor::FloorSummary>,
    /// `--breakdown`: Redis's time per step and command, broker then proxy.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub breakdown: Vec<breakdown::Breakdown>,
    /// `--breakdown`: what unique-key cycles left in Redis, broker then proxy.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub leftover: Vec<breakdown::Leftover>,
}

/// The parked-waiters phase.
#[derive(Debug, Serialize)]
pub struct WaitersPhase {
    /// Waiters the broker reported at the peak.
    pub waiters: u64,
    /// Acquires that failed instead of waiting (connection refused, 503).
    pub errors: u64,
    pub rss_before_mib: f64,
    pub rss_with_waiters_mib: f64,
    pub bytes_per_waiter: f64,
    /// From the clients leaving to the broker reporting no waiters.
    pub drained_ms: f64,
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: BenchArgs) -> anyhow::Result<Summary> {
    if args.clients == 0 || args.contenders == 0 {
        bail!("--clients and --contenders must be at least 1");
    }
    if args.limit.is_some() && args.mode != BenchMode::Semaphore {
        bail!("--limit is the semaphore's permits: give it with --mode semaphore");
    }
    let base = args.url.trim_end_matches('/').to_owned();
    let http = args
        .connect
        .apply(
            reqwest::Client::builder()
                .pool_max_idle_per_host(args.clients.max(args.contenders) * 2)
                .timeout(Duration::from_secs(30)),
        )
        .map_err(anyhow::Error::msg)?
        .build()?;
    http.get(format!("{base}/readyz"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("the broker at {base} is not ready"))?;
    wait_until_granting(&http, &base).await?;
    let redis = match &args.redis_url {
        None => Vec::new(),
        Some(url) => data_nodes(url).await?,
    };
    let run_id = Token::generate().as_str()[..8].to_owned();
    if args.mode != BenchMode::Exclusive {
        check_mode(&http, &base, &args, &run_id).await?;
    }
    if !args.sessions.is_empty() {
        sessions::keep_alive_costs(&http, &base, &redis, &args, &run_id).await?;
        return Ok(Summary::default());
    }
    if !args.several.is_empty() {
        several::acquisition_costs(&http, &base, &redis, &args, &run_id).await?;
        return Ok(Summary::default());
    }
    let progress = std::io::stderr().is_terminal() && !args.json;
    if args.floor || args.breakdown {
        return run_floor(&http, &base, &redis, &args, &run_id, progress).await;
    }

    let mut phases = Vec::new();
    let run = HttpRun {
        http: &http,
        base: &base,
        args: &args,
        run_id: &run_id,
        progress,
    };
    let cost = RedisCost::start(&redis).await?;
    let mut uncontended = uncontended_http(run).await;
    uncontended.set_redis_cost(cost.per(uncontended.cycles).await?);
    phases.push(uncontended);

    let cost = RedisCost::start(&redis).await?;
    let mut hot = hot_key_http(run).await;
    hot.set_redis_cost(cost.per(hot.cycles).await?);
    phases.push(hot);

    let mut broker_over_direct = None;
    if let Some(url) = args
        .redis_url
        .as_ref()
        .filter(|_| args.mode == BenchMode::Exclusive)
    {
        let store = RedisStore::connect(
            &RedisSettings {
                url: RedisUrl::parse(url)?,
                key_prefix: args.key_prefix.clone(),
                timeout: Duration::from_secs(2),
                store_loss_delay: Duration::ZERO,
                store_settle: Duration::from_secs(3),
                tls: Default::default(),
                replica_acks: 0,
                batch_max: 64,
            },
            Arc::default(),
        )?;
        let cost = RedisCost::start(&redis).await?;
        let mut direct = uncontended_direct(Arc::new(store), &args, &run_id, progress).await;
        direct.set_redis_cost(cost.per(direct.cycles).await?);
        if direct.cycles_per_sec > 0.0 {
            broker_over_direct = Some(phases[0].cycles_per_sec / direct.cycles_per_sec);
        }
        phases.push(direct);
    }
    let mut broker_over_raw = None;
    // One server only: the raw cycle neither routes keys nor follows sentinels.
    let single = match &args.redis_url {
        Some(url) => Some(ParsedUrl::parse(url)?).filter(|p| p.topology == Topology::Single),
        None => None,
    };
    if let Some(parsed) = single {
        let client = redis::Client::open(parsed.connection_info(0)?)?;
        let cost = RedisCost::start(&redis).await?;
        let mut raw = uncontended_raw(&client, &args, &run_id, progress).await?;
        raw.set_redis_cost(cost.per(raw.cycles).await?);
        // Each cycle's SET is a round trip too, though not a script call.
        raw.redis_calls_per_cycle = raw.redis_calls_per_cycle.map(|calls| calls + 1.0);
        if raw.cycles_per_sec > 0.0 {
            broker_over_raw = Some(phases[0].cycles_per_sec / raw.cycles_per_sec);
        }
        phases.push(raw);
    }
    let waiters = if args.waiters > 0 {
        Some(park_waiters(&base, &args.connect, args.waiters, args.http2, &run_id).await?)
    } else {
        None
    };
    let summary = Summary {
        mode: (args.mode != BenchMode::Exclusive).then_some(args.mode),
        limit: (args.mode == BenchMode::Semaphore).then(|| args.limit()),
        phases,
        broker_over_direct,
        broker_over_raw,
        waiters,
        floor: None,
        breakdown: Vec::new(),
        leftover: Vec::new(),
    };
    if args.json {
        out!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_table(&summary);
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let samples = (1..=1000).map(Duration::from_millis).collect();
        let l = Latency::of(samples);
        assert_eq!(l.p50_ms, 500.0);
        assert_eq!(l.p99_ms, 990.0);
        assert_eq!(l.p999_ms, 999.0);
        assert_eq!(l.max_ms, 1000.0);
    }
}
