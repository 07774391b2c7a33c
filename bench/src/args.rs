//! The bench's command line: what to load and how, which phases run, and the floor proxy as a
//! subcommand of its own.

use std::time::Duration;

use clap::{Parser, ValueEnum};
use lockbroker_cli_support::{ConnectArgs, parse_limit};
use serde::Serialize;

use crate::{delay_link, floor_proxy};

/// Load a running broker and print throughput and latency (and, with --redis-url, the same lock
/// cycle done directly on Redis, for comparison).
// The bench's command line; `lockbroker-bench --help` is made from these doc comments.
#[derive(Debug, Clone, Parser)]
#[command(name = "lockbroker-bench", version)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// A tool the bench runs as a process of its own.
    #[command(subcommand)]
    pub tool: Option<BenchTool>,
    /// The broker to load.
    #[arg(long, env = lockbroker_client::URL_ENV, default_value = lockbroker_client::DEFAULT_URL)]
    pub url: String,
    #[command(flatten)]
    pub connect: ConnectArgs,
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
    /// Instead of the phases: what a session's keep-alive costs with this many leases under it
    /// (`1,10,100`): for each, a session with that many locks, then --keep-alives keep-alives
    /// one after another — their latency, and with --redis-url the Redis script calls and
    /// Redis CPU per keep-alive (on every data node of a cluster).
    #[arg(long, value_delimiter = ',', value_name = "LEASES,...")]
    pub sessions: Vec<usize>,
    /// With --sessions: keep-alives per session.
    #[arg(long, default_value_t = 500)]
    pub keep_alives: u32,
    /// Instead of the phases: what an acquisition of this many keys at once costs (`1,2,8`):
    /// for each, --acquisitions acquisitions one after another, with the keys all free and with
    /// one key's lease expired unreleased — their latency, and with --redis-url the Redis script
    /// calls and Redis CPU per acquisition (on every data node of a cluster).
    #[arg(long, value_delimiter = ',', value_name = "KEYS,...")]
    pub several: Vec<usize>,
    /// With --several: acquisitions per row.
    #[arg(long, default_value_t = 300)]
    pub acquisitions: u32,
}

/// The tools `lockbroker-bench` runs as processes of their own.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchTool {
    /// The floor `--floor` measures the broker against: a minimal HTTP lock proxy on Redis.
    #[command(hide = true)]
    FloorProxy(floor_proxy::FloorProxyArgs),
    /// A TCP link that delays every byte a fixed time each way (a replica another zone away).
    #[command(hide = true)]
    DelayLink(delay_link::DelayLinkArgs),
    /// Prints the function library the broker loads on Redis (`FUNCTION LOAD`'s text), for
    /// `scripts/redis-instructions.py --functions`.
    #[command(hide = true)]
    RedisLibrary,
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
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "exclusive",
            Self::Shared => "shared",
            Self::Semaphore => "semaphore",
        }
    }
}

/// A semaphore's permits in `--mode semaphore` when `--limit` is not given.
pub(crate) const DEFAULT_BENCH_LIMIT: u32 = 4;

impl BenchArgs {
    /// The semaphore's permits in `--mode semaphore`.
    pub(crate) fn limit(&self) -> u32 {
        self.limit.unwrap_or(DEFAULT_BENCH_LIMIT)
    }
}
