//! `--sessions`: what one keep-alive costs with N leases under the session — the HTTP
//! round trip as a client sees it, and Redis's script calls and CPU time per keep-alive.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lockbroker_cli_support::out;
use redis::aio::MultiplexedConnection;
use serde_json::Value;

use crate::args::BenchArgs;
use crate::redis_stats::RedisCost;

/// One session's figures, per keep-alive.
struct Row {
    leases: usize,
    cost: Cost,
}

/// Runs a session for each of `args.sessions` and prints a table.
pub(super) async fn keep_alive_costs(
    http: &reqwest::Client,
    base: &str,
    redis: &[MultiplexedConnection],
    args: &BenchArgs,
    run_id: &str,
) -> anyhow::Result<()> {
    if args.keep_alives == 0 {
        bail!("--keep-alives must be at least 1");
    }
    let mut rows = Vec::new();
    for &leases in &args.sessions {
        rows.push(one_session(http, base, redis, leases, args.keep_alives, run_id).await?);
    }
    out!(
        "keep-alives of a session with N leases ({} each, one after another):",
        args.keep_alives
    );
    out!("{:>8} {COST_HEADER}", "leases");
    for row in rows {
        out!("{:>8} {}", row.leases, row.cost);
    }
    Ok(())
}

/// The columns every cost table ends with: [`Cost`]'s.
pub(super) const COST_HEADER: &str =
    "   mean µs     p50 µs     p99 µs    Redis calls     Redis CPU µs";

/// A row's latency (µs) and, with Redis's statistics, its script calls and CPU µs per request.
pub(super) struct Cost {
    pub(super) mean_us: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    pub(super) redis: Option<(f64, f64)>,
}

impl Cost {
    /// The latency of `took` (sorted here) and Redis's cost per request.
    pub(super) fn of(took: &mut [Duration], redis: Option<(f64, f64)>) -> Self {
        took.sort();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let n = took.len();
        Self {
            mean_us: took.iter().map(|d| us(*d)).sum::<f64>() / n as f64,
            p50_us: us(took[n / 2]),
            p99_us: us(took[(n * 99 / 100).min(n - 1)]),
            redis,
        }
    }
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (calls, cpu) = match self.redis {
            Some((calls, cpu)) => (format!("{calls:.2}"), format!("{cpu:.1}")),
            None => ("-".into(), "-".into()),
        };
        write!(
            f,
            "{:>10.0} {:>10.0} {:>10.0} {:>14} {:>16}",
            self.mean_us, self.p50_us, self.p99_us, calls, cpu
        )
    }
}

async fn post(http: &reqwest::Client, url: String) -> anyhow::Result<Value> {
    send(http.post(url)).await
}

/// Sends a request: its JSON body (null for none), or an error naming what it was and what came
/// back when it did not succeed.
pub(super) async fn send(request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
    let answer = request.send().await?;
    let (status, url) = (answer.status(), answer.url().clone());
    let body: Value = answer.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        bail!("{url}: {status} {body}");
    }
    Ok(body)
}

async fn one_session(
    http: &reqwest::Client,
    base: &str,
    redis: &[MultiplexedConnection],
    leases: usize,
    keep_alives: u32,
    run_id: &str,
) -> anyhow::Result<Row> {
    let opened = post(http, format!("{base}/sessions?ttl_ms=60000")).await?;
    let id = opened["session"]
        .as_str()
        .context("no session id")?
        .to_owned();
    for i in 0..leases {
        post(
            http,
            format!("{base}/locks/bench-session-{run_id}-{leases}-{i}?session={id}"),
        )
        .await?;
    }
    let keep = format!("{base}/sessions/{id}/renew");
    // Warm: every script cached, the connection up.
    for _ in 0..3 {
        post(http, keep.clone()).await?;
    }
    let cost = RedisCost::start(redis).await?;
    let mut took = Vec::with_capacity(keep_alives as usize);
    for _ in 0..keep_alives {
        let sent = Instant::now();
        post(http, keep.clone()).await?;
        took.push(sent.elapsed());
    }
    let redis = cost
        .per(u64::from(keep_alives))
        .await?
        .map(|per| (per.calls, per.cpu_us));
    http.delete(format!("{base}/sessions/{id}")).send().await?;
    Ok(Row {
        leases,
        cost: Cost::of(&mut took, redis),
    })
}
