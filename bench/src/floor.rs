//! `lockbroker-bench --floor`: the broker side by side with its floor, the minimal lock proxy of
//! `floor_proxy.rs`, on the same Redis. The bench starts the proxy as a child process, then runs
//! the same uncontended lock-cycle load (the uncontended phase, with the lean client) against
//! the broker and the proxy in turn, `--rounds` times, alternating which goes first. For each it
//! reads the cycles per second, the server's CPU time per cycle (user + system, from
//! `/proc/<pid>/stat` of the broker's process and of the proxy's), Redis's CPU time per cycle
//! (`INFO cpu`) and the bench's own; it prints each round, the medians and the ratios
//! broker / proxy.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::batches::{BatchFigures, BatchTotals};
use super::http::{HttpRun, uncontended_http};
use super::redis_stats::RedisCost;
use super::{BenchArgs, BenchMode, Summary, breakdown};
use lockbroker::store::redis::{ParsedUrl, Topology};
use redis::aio::MultiplexedConnection;

/// The proxy, running as a child of the bench; killed when dropped.
pub(super) struct ProxyProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub(super) base: String,
}

impl ProxyProcess {
    /// Starts `lockbroker-bench floor-proxy` (this same executable) on a free loopback port.
    pub(super) async fn start(redis_url: &str) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find the lockbroker-bench executable")?;
        let mut child = Command::new(exe)
            .args(["floor-proxy", "--listen", "127.0.0.1:0", "--redis-url"])
            .arg(redis_url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start the floor proxy")?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .context("the floor proxy did not say its address within 10 s")??
            .context("the floor proxy exited before listening")?;
        Ok(Self {
            child,
            base: format!("http://{}", addr.trim()),
        })
    }

    pub(super) fn pid(&self) -> anyhow::Result<u32> {
        self.child.id().context("the floor proxy has exited")
    }
}

/// CPU time (user + system, every thread) a process has used so far, in µs, from
/// `/proc/<pid>/stat`.
pub(super) fn process_cpu_us(pid: u32, ticks_per_sec: f64) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("cannot read /proc/{pid}/stat"))?;
    cpu_us_of_stat(&stat, ticks_per_sec).with_context(|| format!("/proc/{pid}/stat is unreadable"))
}

/// utime + stime of a `/proc/<pid>/stat` line, in µs. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted from its last `)`: utime and stime are fields
/// 14 and 15 of the line, the 12th and 13th after it.
fn cpu_us_of_stat(stat: &str, ticks_per_sec: f64) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 * 1e6 / ticks_per_sec)
}

/// The kernel's clock ticks per second, in which `/proc/<pid>/stat` counts CPU time.
pub(super) fn ticks_per_sec() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The process listening on `port` on this machine (TCP, IPv4 or IPv6), found as `ss -p` does:
/// the listening socket's inode in `/proc/net/tcp*`, then the process holding it among
/// `/proc/*/fd`.
pub(super) fn pid_listening_on(port: u16) -> anyhow::Result<u32> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        inodes.extend(listening_inodes(&text, port));
    }
    if inodes.is_empty() {
        bail!("nothing on this machine listens on port {port}: give --broker-pid");
    }
    let targets: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path())
                && targets.iter().any(|t| Path::new(t) == link)
            {
                return Ok(pid);
            }
        }
    }
    bail!("cannot tell which process listens on port {port} (another user's?): give --broker-pid")
}

/// Inodes of the sockets listening on `port` in a `/proc/net/tcp` table.
fn listening_inodes(table: &str, port: u16) -> Vec<u64> {
    const LISTEN: &str = "0A";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit(':').next()?;
            let listening = *fields.get(3)? == LISTEN;
            (listening && u16::from_str_radix(local_port, 16).ok()? == port)
                .then(|| fields.get(9)?.parse().ok())
                .flatten()
        })
        .collect()
}

/// One run of the load against one server.
#[derive(Debug, Clone, Serialize)]
pub struct FloorRun {
    pub cycles_per_sec: f64,
    pub errors: u64,
    /// The server process's CPU time per cycle, µs.
    pub server_cpu_us: f64,
    /// Redis's CPU time per cycle, µs.
    pub redis_cpu_us: f64,
    /// The bench's own CPU time per cycle (the load generator), µs.
    pub bench_cpu_us: f64,
    /// Redis script calls per cycle.
    pub redis_calls: f64,
    /// The broker's batched calls (group commit); none for the proxy.
    pub batches: Option<BatchFigures>,
}

/// One round: the broker's run and the proxy's.
#[derive(Debug, Serialize)]
pub struct FloorRound {
    pub broker: FloorRun,
    pub proxy: FloorRun,
}

/// `--floor`'s figures.
#[derive(Debug, Serialize)]
pub struct FloorSummary {
    pub clients: usize,
    pub seconds_per_run: f64,
    pub rounds: Vec<FloorRound>,
    /// Medians over the rounds.
    pub broker: FloorRun,
    pub proxy: FloorRun,
    /// Broker over proxy, of the medians.
    pub cycles_ratio: f64,
    pub server_cpu_ratio: f64,
    pub redis_cpu_ratio: f64,
}

/// Loads one server with the uncontended cycle for `--duration`, measuring its process's CPU.
async fn run_once(
    http: &reqwest::Client,
    (base, pid, broker): (&str, u32, bool),
    redis: &[MultiplexedConnection],
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
    ticks: f64,
) -> anyhow::Result<FloorRun> {
    let cost = RedisCost::start(redis).await?;
    let batched_before = match broker {
        true => Some(BatchTotals::read(http, base).await?),
        false => None,
    };
    let server_before = process_cpu_us(pid, ticks)?;
    let bench_before = process_cpu_us(std::process::id(), ticks)?;
    let phase = uncontended_http(HttpRun {
        http,
        base,
        args,
        run_id,
        progress,
    })
    .await;
    let server_after = process_cpu_us(pid, ticks)?;
    let bench_after = process_cpu_us(std::process::id(), ticks)?;
    let redis_cost = cost.per(phase.cycles).await?;
    let cycles = phase.cycles.max(1) as f64;
    let batches = match batched_before {
        Some(before) => Some(
            BatchTotals::read(http, base)
                .await?
                .since(&before, 2.0 * cycles),
        ),
        None => None,
    };
    Ok(FloorRun {
        cycles_per_sec: phase.cycles_per_sec,
        errors: phase.errors,
        server_cpu_us: (server_after - server_before) / cycles,
        redis_cpu_us: redis_cost.as_ref().map_or(0.0, |c| c.cpu_us),
        bench_cpu_us: (bench_after - bench_before) / cycles,
        redis_calls: redis_cost.map_or(0.0, |c| c.calls),
        batches,
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn medians(runs: &[&FloorRun]) -> FloorRun {
    let of = |f: fn(&FloorRun) -> f64| median(runs.iter().map(|r| f(r)).collect());
    FloorRun {
        cycles_per_sec: of(|r| r.cycles_per_sec),
        errors: runs.iter().map(|r| r.errors).sum(),
        server_cpu_us: of(|r| r.server_cpu_us),
        redis_cpu_us: of(|r| r.redis_cpu_us),
        bench_cpu_us: of(|r| r.bench_cpu_us),
        redis_calls: of(|r| r.redis_calls),
        batches: runs
            .iter()
            .find_map(|r| r.batches.clone())
            .map(|_| BatchFigures {
                batches: of(|r| r.batches.as_ref().map_or(0.0, |b| b.batches)),
                mean: of(|r| r.batches.as_ref().map_or(0.0, |b| b.mean)),
                p50: of(|r| r.batches.as_ref().map_or(0.0, |b| b.p50)),
                p99: of(|r| r.batches.as_ref().map_or(0.0, |b| b.p99)),
                batched_share: of(|r| r.batches.as_ref().map_or(0.0, |b| b.batched_share)),
            }),
    }
}

/// Runs `--rounds` rounds of the broker and the proxy, alternating which goes first.
#[allow(clippy::too_many_arguments)] // The bench's shared context, passed as the phases take it.
pub(super) async fn compare(
    http: &reqwest::Client,
    base: &str,
    broker_pid: u32,
    proxy: &ProxyProcess,
    redis: &[MultiplexedConnection],
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
) -> anyhow::Result<FloorSummary> {
    let ticks = ticks_per_sec();
    let proxy_pid = proxy.pid()?;
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let targets = [
            (base, broker_pid, true),
            (proxy.base.as_str(), proxy_pid, false),
        ];
        let mut runs = Vec::with_capacity(2);
        // Odd rounds start with the proxy: neither always runs on a machine just warmed (or
        // just loaded) by the other.
        for i in 0..2 {
            let target = targets[(i + round as usize) % 2];
            runs.push(run_once(http, target, redis, args, run_id, progress, ticks).await?);
        }
        if round % 2 == 1 {
            runs.reverse();
        }
        let proxy = runs.pop().expect("two runs");
        let broker = runs.pop().expect("two runs");
        rounds.push(FloorRound { broker, proxy });
    }
    let broker = medians(&rounds.iter().map(|r| &r.broker).collect::<Vec<_>>());
    let proxy = medians(&rounds.iter().map(|r| &r.proxy).collect::<Vec<_>>());
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Ok(FloorSummary {
        clients: args.clients,
        seconds_per_run: args.duration.as_secs_f64(),
        cycles_ratio: ratio(broker.cycles_per_sec, proxy.cycles_per_sec),
        server_cpu_ratio: ratio(broker.server_cpu_us, proxy.server_cpu_us),
        redis_cpu_ratio: ratio(broker.redis_cpu_us, proxy.redis_cpu_us),
        rounds,
        broker,
        proxy,
    })
}

/// `--floor` and `--breakdown`: the broker and the minimal proxy side by side.
pub(super) async fn run_floor(
    http: &reqwest::Client,
    base: &str,
    redis: &[redis::aio::MultiplexedConnection],
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
) -> anyhow::Result<Summary> {
    let url = args
        .redis_url
        .as_deref()
        .expect("--floor requires --redis-url");
    if ParsedUrl::parse(url)?.topology != Topology::Single {
        bail!(
            "--floor needs one Redis server: the proxy neither routes keys nor follows sentinels"
        );
    }
    if args.mode != BenchMode::Exclusive {
        bail!("--floor measures exclusive locks: the proxy has no shared leases or semaphores");
    }
    let proxy = ProxyProcess::start(url).await?;
    let mut summary = Summary {
        mode: None,
        limit: None,
        phases: Vec::new(),
        broker_over_direct: None,
        broker_over_raw: None,
        waiters: None,
        floor: None,
        breakdown: Vec::new(),
        leftover: Vec::new(),
    };
    if args.floor {
        let broker_pid = match args.broker_pid {
            Some(pid) => pid,
            None => {
                let port = reqwest::Url::parse(base)?
                    .port_or_known_default()
                    .context("--url has no port")?;
                pid_listening_on(port)?
            }
        };
        let floor = compare(
            http, base, broker_pid, &proxy, redis, args, run_id, progress,
        )
        .await?;
        if !args.json {
            super::table::print_floor(&floor);
        }
        summary.floor = Some(floor);
    }
    if args.breakdown {
        let node = &redis[0];
        for (server, url) in [("broker", base), ("proxy", proxy.base.as_str())] {
            let b = breakdown::per_command(server, url, node, args, run_id, args.breakdown_locks)
                .await?;
            if !args.json {
                breakdown::print_breakdown(&b);
            }
            summary.breakdown.push(b);
        }
        if !args.leftover_duration.is_zero() {
            for (server, url) in [("broker", base), ("proxy", proxy.base.as_str())] {
                let l = breakdown::leftover(
                    server,
                    url,
                    node,
                    args,
                    args.leftover_duration,
                    run_id,
                    progress,
                )
                .await?;
                if !args.json {
                    breakdown::print_leftover(&l);
                }
                summary.leftover.push(l);
            }
        }
    }
    if args.json {
        lockbroker_cli_support::out!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_cpu_is_read_after_the_command_name() {
        // A command name with a space and a parenthesis, as a thread may be named.
        let stat = "4242 (tokio (rt) w) S 1 4242 4242 0 -1 4194560 1200 0 0 0 250 50 0 0 20 0 9 0 1000 \
                    100000 500 18446744073709551615";
        assert_eq!(cpu_us_of_stat(stat, 100.0), Some(3_000_000.0));
        assert_eq!(cpu_us_of_stat("garbage", 100.0), None);
    }

    #[test]
    fn listening_sockets_are_found_by_port() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 12345 1\n\
   1: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000  1000        0 23456 1\n\
   2: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 34567 1\n";
        assert_eq!(listening_inodes(table, 8080), vec![12345]);
        assert_eq!(listening_inodes(table, 8081), vec![34567]);
        assert!(listening_inodes(table, 80).is_empty());
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
