//! `lockbroker bench`: a load generator for a running broker, and the same lock cycle run
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

mod breakdown;
mod direct;
mod fleet;
mod floor;
pub mod floor_proxy;
mod http;
mod lean;
mod raw;
mod redis_stats;
mod table;
mod waiters;

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;

pub use self::fleet::run as run_fleet;

use self::direct::uncontended_direct;
use self::floor::run_floor;
use self::http::{check_mode, hot_key_http, uncontended_http, wait_until_granting};
use self::raw::uncontended_raw;
use self::redis_stats::{RedisCost, data_nodes};
use self::table::print_table;
use self::waiters::park_waiters;
use crate::cli::parse_limit;
use lockbroker::domain::Token;
use lockbroker::store::RedisStore;
use lockbroker::store::redis::{ParsedUrl, RedisSettings, RedisUrl, Topology};

/// `lockbroker bench` flags.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// A tool the bench runs as a process of its own.
    #[command(subcommand)]
    pub tool: Option<BenchTool>,
    /// The broker to load.
    #[arg(long, env = lockbroker_client::URL_ENV, default_value = lockbroker_client::DEFAULT_URL)]
    pub url: String,
    #[command(flatten)]
    pub connect: crate::cli::ConnectArgs,
    /// The Redis the broker uses: adds the direct-Redis phase and counts Redis calls per
    /// operation (from INFO commandstats).
    #[arg(long)]
    pub redis_url: Option<String>,
    /// The broker's key prefix in Redis (for the direct phase).
    #[arg(long, default_value = "lockbroker:")]
    pub key_prefix: String,
    /// Concurrent clients in the uncontended and direct phases.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Contenders on the hot key.
    #[arg(long, default_value_t = 16)]
    pub contenders: usize,
    /// Instead of the usual phases, run one hot key through a fleet of brokers on one store:
    /// `--contenders` clients loop acquire (waiting up to --wait-ms), hold --hold, release, client
    /// i through the i % N-th of these URLs (comma-separated, or the flag repeated); --url is not
    /// used.
    #[arg(long, value_delimiter = ',', value_name = "URL,...")]
    pub urls: Vec<String>,
    /// With --urls: how long each client holds the lease before releasing it.
    #[arg(long, default_value = "1ms", value_parser = humantime::parse_duration)]
    pub hold: Duration,
    /// With --urls: the wait_ms of each acquire.
    #[arg(long, default_value_t = 20_000)]
    pub wait_ms: u64,
    /// How long each phase runs (`10s`, `1500ms`, `1m`).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Also hold a key and park this many waiting acquires on it, then report the broker's
    /// resident memory per waiter (from its /metrics) and how fast they drain when their
    /// clients leave. Needs a file-descriptor limit above twice this number.
    #[arg(long, default_value_t = 0)]
    pub waiters: usize,
    /// Park the waiters over HTTP/2 (h2c, prior knowledge): at most 150 streams on each
    /// connection instead of one connection each.
    #[arg(long)]
    pub http2: bool,
    /// The lease each cycle takes: an exclusive lease on a lock, a shared lease on it, or one
    /// permit of a semaphore (see --limit). The direct-Redis phase runs for exclusive only.
    #[arg(long, value_enum, default_value_t = BenchMode::Exclusive)]
    pub mode: BenchMode,
    /// With --mode semaphore: each semaphore's permits, so on the hot key this many
    /// contenders hold one at once [default: 4].
    #[arg(long, value_name = "N", value_parser = parse_limit)]
    pub limit: Option<u32>,
    /// Print one JSON summary on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Instead of loading a broker, measure the memory the lease ledger (the live leases a
    /// broker remembers, to put back after a store loss) takes for this many leases, in this
    /// process, and how long its periodic sweep and a put-back snapshot take.
    #[arg(long, value_name = "LEASES")]
    pub ledger: Option<usize>,
    /// Instead of the phases: start the floor, a minimal HTTP lock proxy on the same Redis
    /// (`SET NX PX`, a compare-and-delete, nothing else), and run the uncontended cycle against
    /// the broker and the proxy in turn for --rounds rounds, printing cycles/s and the CPU per
    /// cycle of each server process and of Redis. Needs --redis-url (one server) and a broker
    /// on this machine.
    #[arg(long, requires = "redis_url")]
    pub floor: bool,
    /// With --floor: rounds of the broker and the proxy, each run --duration long.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// With --floor: the broker's process id, for its CPU time [default: the process listening
    /// on --url's port].
    #[arg(long, value_name = "PID")]
    pub broker_pid: Option<u32>,
    /// Instead of the phases (or after --floor): where Redis's time goes in an uncontended
    /// lock cycle, per step (acquire, release) and per command, scripts and the commands they
    /// call apart (INFO commandstats, INFO cpu); then what unique-key cycles leave in Redis's
    /// memory (INFO memory, DBSIZE). For the broker and for the floor proxy. Needs --redis-url
    /// (one server).
    #[arg(long, requires = "redis_url")]
    pub breakdown: bool,
    /// With --breakdown: locks taken and released for the per-command figures.
    #[arg(long, default_value_t = 20_000)]
    pub breakdown_locks: u64,
    /// With --breakdown: how long to run unique-key cycles for the memory they leave (0s:
    /// skip).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub leftover_duration: Duration,
}

/// The tools `lockbroker bench` runs as processes of their own.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchTool {
    /// The floor `--floor` measures the broker against: a minimal HTTP lock proxy on Redis.
    #[command(hide = true)]
    FloorProxy(floor_proxy::FloorProxyArgs),
}

/// The lease a bench cycle takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchMode {
    /// `POST /locks/{key}`: one holder at a time.
    Exclusive,
    /// `POST /locks/{key}?mode=shared`: every contender holds it at once.
    Shared,
    /// `POST /semaphores/{key}?limit=N`: N contenders hold a permit at once.
    Semaphore,
}

impl BenchMode {
    /// The mode as `--mode` writes it.
    fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "exclusive",
            Self::Shared => "shared",
            Self::Semaphore => "semaphore",
        }
    }
}

/// A semaphore's permits in `--mode semaphore` when `--limit` is not given.
pub const DEFAULT_BENCH_LIMIT: u32 = 4;

impl BenchArgs {
    /// The semaphore's permits in `--mode semaphore`.
    fn limit(&self) -> u32 {
        self.limit.unwrap_or(DEFAULT_BENCH_LIMIT)
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
#[derive(Debug, Serialize)]
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
    let progress = std::io::stderr().is_terminal() && !args.json;
    if args.floor || args.breakdown {
        return run_floor(&http, &base, &redis, &args, &run_id, progress).await;
    }

    let mut phases = Vec::new();
    let cost = RedisCost::start(&redis).await?;
    let mut uncontended = uncontended_http(&http, &base, &args, &run_id, progress).await;
    uncontended.set_redis_cost(cost.per(uncontended.cycles).await?);
    phases.push(uncontended);

    let cost = RedisCost::start(&redis).await?;
    let mut hot = hot_key_http(&http, &base, &args, &run_id, progress).await;
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
        crate::cli::out!("{}", serde_json::to_string_pretty(&summary)?);
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
