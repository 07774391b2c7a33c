//! The bench's summary as a table on the terminal (`--json` prints it as JSON instead).

use super::floor::{FloorRun, FloorSummary};
use super::{BenchMode, Latency, Summary};

/// Prints `summary`: one row per phase, then the ratios to the direct and raw Redis cycles.
pub(super) fn print_table(summary: &Summary) {
    match (summary.mode, summary.limit) {
        (Some(BenchMode::Semaphore), Some(limit)) => {
            lockbroker_cli_support::out!("mode: semaphore, {limit} permits on each key");
        }
        (Some(BenchMode::Shared), _) => lockbroker_cli_support::out!("mode: shared leases"),
        _ => {}
    }
    lockbroker_cli_support::out!(
        "{:<28} {:>7} {:>10} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>8} {:>6}",
        "phase",
        "clients",
        "cycles/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "max ms",
        "handoff50",
        "handoff99",
        "calls",
        "redis µs",
        "errors"
    );
    for p in &summary.phases {
        let handoff = |f: fn(&Latency) -> f64| {
            p.handoff
                .as_ref()
                .map_or("-".into(), |h| format!("{:.2}", f(h)))
        };
        lockbroker_cli_support::out!(
            "{:<28} {:>7} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>9} {:>9} {:>7} {:>8} {:>6}",
            p.name,
            p.clients,
            p.cycles_per_sec,
            p.cycle.p50_ms,
            p.cycle.p99_ms,
            p.cycle.p999_ms,
            p.cycle.max_ms,
            handoff(|h| h.p50_ms),
            handoff(|h| h.p99_ms),
            p.redis_calls_per_cycle
                .map_or("-".into(), |c| format!("{c:.2}")),
            p.redis_cpu_us_per_cycle
                .map_or("-".into(), |c| format!("{c:.1}")),
            p.errors,
        );
    }
    if let Some(ratio) = summary.broker_over_direct {
        lockbroker_cli_support::out!("broker / direct Redis (uncontended cycles/s): {ratio:.3}");
    }
    if let Some(ratio) = summary.broker_over_raw {
        lockbroker_cli_support::out!(
            "broker / raw Redis lock cycle (uncontended cycles/s): {ratio:.3}"
        );
    }
    lockbroker_cli_support::out!(
        "calls: Redis round trips per acquire+release cycle (script calls; raw Redis: its SET \
         and its script call); redis µs: Redis CPU time (user+system, every data node) per cycle"
    );
    if let Some(w) = &summary.waiters {
        lockbroker_cli_support::out!(
            "parked waiters: {} ({} failed); broker RSS {:.1} MiB -> {:.1} MiB, {:.0} bytes per waiter; drained {:.0} ms after their clients left",
            w.waiters,
            w.errors,
            w.rss_before_mib,
            w.rss_with_waiters_mib,
            w.bytes_per_waiter,
            w.drained_ms
        );
    }
}

/// Prints `--floor`'s rounds, medians and ratios.
pub(super) fn print_floor(summary: &FloorSummary) {
    lockbroker_cli_support::out!(
        "floor: uncontended acquire+release cycles, {} clients each on its own key, {:.0} s per run",
        summary.clients,
        summary.seconds_per_run
    );
    lockbroker_cli_support::out!(
        "{:<8} {:<7} {:>10} {:>10} {:>9} {:>9} {:>6} {:>7}  {}",
        "round",
        "server",
        "cycles/s",
        "server µs",
        "redis µs",
        "bench µs",
        "errors",
        "scripts",
        "batches: ops per call mean/p50/p99, share of ops batched"
    );
    let row = |round: &str, server: &str, r: &FloorRun| {
        let batches = r.batches.as_ref().map_or(String::new(), |b| {
            format!(
                "{:.1}/{:.0}/{:.0}, {:.0}%",
                b.mean,
                b.p50,
                b.p99,
                b.batched_share * 100.0
            )
        });
        lockbroker_cli_support::out!(
            "{:<8} {:<7} {:>10.0} {:>10.1} {:>9.1} {:>9.1} {:>6} {:>7.2}  {}",
            round,
            server,
            r.cycles_per_sec,
            r.server_cpu_us,
            r.redis_cpu_us,
            r.bench_cpu_us,
            r.errors,
            r.redis_calls,
            batches
        );
    };
    for (i, r) in summary.rounds.iter().enumerate() {
        let n = (i + 1).to_string();
        row(&n, "broker", &r.broker);
        row(&n, "proxy", &r.proxy);
    }
    row("median", "broker", &summary.broker);
    row("median", "proxy", &summary.proxy);
    lockbroker_cli_support::out!(
        "broker / proxy: cycles/s {:.3}, server CPU per cycle {:.2}, Redis CPU per cycle {:.2}",
        summary.cycles_ratio,
        summary.server_cpu_ratio,
        summary.redis_cpu_ratio
    );
    lockbroker_cli_support::out!(
        "µs: CPU time (user+system) per cycle of the server process (/proc/<pid>/stat), of Redis \
         (INFO cpu) and of this load generator; scripts: Redis script calls per cycle"
    );
}
