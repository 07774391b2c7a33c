//! `lockbroker-bench --waiters N`: parks waiting acquires on a held key and reads the broker's
//! memory per waiter and drain time from its /metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::WaitersPhase;
use super::http::release;
use super::lean::Granted;

/// Reads one unlabelled sample from the broker's /metrics.
async fn scrape(http: &reqwest::Client, base: &str, name: &str) -> anyhow::Result<f64> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    text.lines()
        .find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .with_context(|| format!("/metrics has no {name}"))
}

pub(super) async fn park_waiters(
    base: &str,
    connect: &lockbroker_cli_support::ConnectArgs,
    n: usize,
    http2: bool,
    run_id: &str,
) -> anyhow::Result<WaitersPhase> {
    let client = || {
        let builder = connect
            .apply(reqwest::Client::builder().timeout(Duration::from_secs(120)))
            .map_err(anyhow::Error::msg)?;
        let client = if http2 {
            builder.http2_prior_knowledge().build()
        } else {
            builder.pool_max_idle_per_host(0).build()
        };
        Ok::<_, anyhow::Error>(client?)
    };
    let http = client()?;
    // HTTP/2: a client (one connection) per 150 waiters, under the server's 200 streams.
    let parkers = (0..n.div_ceil(150).max(1))
        .map(|_| client())
        .collect::<Result<Vec<_>, _>>()?;
    let url = format!("{base}/locks/bench-{run_id}-parked");
    let held: Granted = http
        .post(format!("{url}?ttl_ms=120000"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let rss_before = scrape(&http, base, "process_resident_memory_bytes").await?;
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let http = if http2 {
            parkers[i / 150].clone()
        } else {
            http.clone()
        };
        let (url, errors) = (url.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let answer = http.post(format!("{url}?wait_ms=60000")).send().await;
            if !matches!(answer, Ok(ref r) if r.status().is_success()) {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }));
        if i % 200 == 199 {
            // Let the broker accept what is queued: the listen backlog is finite.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peak = 0.0;
    while Instant::now() < deadline {
        peak = scrape(&http, base, "lockbroker_waiters").await?;
        if peak as u64 + errors.load(Ordering::Relaxed) >= n as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_with = scrape(&http, base, "process_resident_memory_bytes").await?;
    let left = Instant::now();
    for task in &tasks {
        task.abort();
    }
    while scrape(&http, base, "lockbroker_waiters").await? > 0.0 {
        if left.elapsed() > Duration::from_secs(60) {
            bail!("waiters whose clients left were still waiting after 60 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drained = left.elapsed();
    release(&http, &url, &held.token).await?;
    Ok(WaitersPhase {
        waiters: peak as u64,
        errors: errors.load(Ordering::Relaxed),
        rss_before_mib: mib(rss_before),
        rss_with_waiters_mib: mib(rss_with),
        bytes_per_waiter: if peak > 0.0 {
            (rss_with - rss_before) / peak
        } else {
            0.0
        },
        drained_ms: drained.as_secs_f64() * 1000.0,
    })
}
