//! `--several`: what one acquisition of k keys at once costs — the HTTP round trip as a client
//! sees it, and Redis's script calls and CPU time per acquisition, with the keys all free (the
//! common case: on one Redis one script call for all of them) and with one key's lease expired
//! unreleased (then each key is taken through its own queue, one after another).

use std::time::{Duration, Instant};

use anyhow::bail;
use lockbroker_cli_support::out;
use redis::aio::MultiplexedConnection;
use serde_json::json;

use crate::args::BenchArgs;
use crate::redis_stats::RedisCost;
use crate::sessions::{COST_HEADER, Cost, send};

/// One row: k keys, free or with one expired lease among them; per acquisition.
struct Row {
    keys: usize,
    case: &'static str,
    cost: Cost,
}

/// Acquisitions of each of `args.several` keys at once, and a table.
pub(super) async fn acquisition_costs(
    http: &reqwest::Client,
    base: &str,
    redis: &[MultiplexedConnection],
    args: &BenchArgs,
    run_id: &str,
) -> anyhow::Result<()> {
    if args.acquisitions == 0 {
        bail!("--acquisitions must be at least 1");
    }
    let mut rows = Vec::new();
    for &k in &args.several {
        if !(1..=64).contains(&k) {
            bail!("--several takes 1 to 64 keys, not {k}");
        }
        for expired in [false, true] {
            let run = Run {
                http,
                base,
                redis,
                k,
                expired,
                n: args.acquisitions,
                run_id,
            };
            rows.push(run.measure().await?);
        }
    }
    out!(
        "acquisitions of k keys at once ({} each, one after another; each released before the next):",
        args.acquisitions
    );
    out!("{:>5} {:>20} {COST_HEADER}", "keys", "case");
    for row in rows {
        out!("{:>5} {:>20} {}", row.keys, row.case, row.cost);
    }
    Ok(())
}

struct Run<'a> {
    http: &'a reqwest::Client,
    base: &'a str,
    redis: &'a [MultiplexedConnection],
    k: usize,
    /// Whether one key of each set holds a lease that expired unreleased.
    expired: bool,
    n: u32,
    run_id: &'a str,
}

impl Run<'_> {
    /// The keys of the `i`-th acquisition: each set its own, so no acquisition finds another's
    /// leftovers.
    fn keys(&self, i: u32) -> Vec<String> {
        let (k, run_id, case) = (self.k, self.run_id, u8::from(self.expired));
        (0..k)
            .map(|j| format!("bench-several-{run_id}-{k}-{case}-{i}-{j}"))
            .collect()
    }

    async fn measure(&self) -> anyhow::Result<Row> {
        let (http, base) = (self.http, self.base);
        // Warm: every script cached, the connection up.
        for i in 0..3 {
            self.cycle(&format!("warm-{i}"), &self.keys(u32::MAX - i))
                .await?;
        }
        if self.expired {
            // One key of each set, with a lease that has ended by the time it is asked for.
            for i in 0..self.n {
                let key = &self.keys(i)[self.k / 2];
                send(http.post(format!("{base}/locks/{key}?ttl_ms=1"))).await?;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let cost = RedisCost::start(self.redis).await?;
        let mut took = Vec::with_capacity(self.n as usize);
        let mut held = Vec::with_capacity(self.n as usize);
        for i in 0..self.n {
            let keys = self.keys(i);
            let sent = Instant::now();
            let body = send(
                http.post(format!("{base}/locks"))
                    .json(&json!({"keys": keys})),
            )
            .await?;
            took.push(sent.elapsed());
            held.push((keys, body["token"].as_str().unwrap_or_default().to_owned()));
        }
        let redis = cost
            .per(u64::from(self.n))
            .await?
            .map(|per| (per.calls, per.cpu_us));
        for (keys, token) in held {
            release(http, base, &keys, &token).await?;
        }
        Ok(Row {
            keys: self.k,
            case: if self.expired {
                "one lease expired"
            } else {
                "all free"
            },
            cost: Cost::of(&mut took, redis),
        })
    }

    /// One acquisition and its release, not measured.
    async fn cycle(&self, tag: &str, keys: &[String]) -> anyhow::Result<()> {
        let keys: Vec<String> = keys.iter().map(|k| format!("{k}-{tag}")).collect();
        let (http, base) = (self.http, self.base);
        let body = send(
            http.post(format!("{base}/locks"))
                .json(&json!({"keys": keys})),
        )
        .await?;
        release(
            http,
            base,
            &keys,
            body["token"].as_str().unwrap_or_default(),
        )
        .await
    }
}

async fn release(
    http: &reqwest::Client,
    base: &str,
    keys: &[String],
    token: &str,
) -> anyhow::Result<()> {
    let url = format!("{base}/locks?keys={}", keys.join(","));
    send(http.delete(url).header("Lock-Token", token)).await?;
    Ok(())
}
