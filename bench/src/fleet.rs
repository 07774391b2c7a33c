//! `lockbroker-bench --urls A,B,…`: one hot key through a fleet of brokers on one store. Each of
//! `--contenders` clients loops acquire (waiting up to `--wait-ms`) → hold `--hold` → release on
//! the same key, client `i` always through broker `i % B`; the run reports what an acquisition
//! costs Redis (script calls and CPU), how long clients wait, how fast a lease passes from one
//! holder to the next across brokers, and how evenly the grants are spread over the clients.
//!
//! Handoff is paired by fence, not by arrival: the grants of one key carry fences that rise in
//! grant order, so the lease granted after the one with fence `f` is the next fence up, and the
//! handoff is from the release of `f` answered (`204` received) to that next grant answered
//! (`201` received), both read on this process's monotonic clock ([`handoffs`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hyper::body::Bytes;
use hyper::{Method, StatusCode};
use serde::Serialize;

use super::http::wait_until_granting;
use super::lean::{Granted, LeanClient, plain_authority};
use super::redis_stats::{RedisCost, data_nodes};
use super::{BenchArgs, BenchMode, Latency};
use lockbroker::domain::Token;

/// One grant a client received.
#[derive(Debug, Clone, Copy)]
pub(super) struct Grant {
    /// The lease's fence: the order in which the store granted it.
    pub(super) fence: u64,
    /// When the `201` arrived.
    pub(super) granted: Instant,
    /// When the release's `204` arrived; `None` if the release failed.
    pub(super) released: Option<Instant>,
}

/// From each release answered to the next grant (by fence) answered. A grant whose `201`
/// arrived before the previous holder's `204` (the next holder heard first) counts as zero: the
/// lease had already passed on when the releaser learnt it was released.
pub(super) fn handoffs(mut grants: Vec<Grant>) -> Vec<Duration> {
    grants.sort_unstable_by_key(|g| g.fence);
    grants
        .windows(2)
        .filter_map(|pair| {
            let released = pair[0].released?;
            Some(pair[1].granted.saturating_duration_since(released))
        })
        .collect()
}

/// How evenly the acquisitions fell on the clients.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Spread {
    pub most: u64,
    pub fewest: u64,
    /// `most / fewest`; absent when some client got no acquisition at all.
    pub most_over_fewest: Option<f64>,
}

impl Spread {
    /// The spread of per-client acquisition counts; all zero for no clients.
    pub(super) fn of(counts: &[u64]) -> Self {
        let most = counts.iter().copied().max().unwrap_or(0);
        let fewest = counts.iter().copied().min().unwrap_or(0);
        Self {
            most,
            fewest,
            most_over_fewest: (fewest > 0).then(|| most as f64 / fewest as f64),
        }
    }
}

/// One fleet run's figures.
#[derive(Debug, Serialize)]
pub(crate) struct FleetSummary {
    pub brokers: usize,
    pub clients: usize,
    pub hold_ms: f64,
    pub wait_ms: u64,
    pub seconds: f64,
    pub acquisitions: u64,
    pub acquisitions_per_sec: f64,
    /// Acquires not answered `201`, releases not answered `204`, and failed connections.
    pub errors: u64,
    /// From an acquire being sent to its `201` arriving.
    pub wait: Latency,
    /// From a release's `204` arriving to the next grant's `201` arriving (next by fence).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handoff: Option<Latency>,
    /// Redis script calls (EVALSHA, EVAL, FCALL) per acquisition, with `--redis-url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub script_calls_per_acquisition: Option<f64>,
    /// Redis CPU time (user + system, every data node) per acquisition, in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_cpu_us_per_acquisition: Option<f64>,
    /// Of which in scripts (as Redis times them), µs per acquisition.
    pub script_us_per_acquisition: Option<f64>,
    pub spread: Spread,
    /// Acquisitions of each client, client `i` talking to broker `i % brokers`.
    pub per_client: Vec<u64>,
}

/// What one client did over the run.
#[derive(Default)]
struct ClientLog {
    grants: Vec<Grant>,
    waits: Vec<Duration>,
    errors: u64,
}

/// One client's connection to its broker: the lean HTTP/1.1 client on plain `http://`, the
/// general one (reqwest) otherwise.
enum Conn {
    Lean {
        client: LeanClient,
        authority: String,
        auth: Option<String>,
    },
    General {
        http: reqwest::Client,
        base: String,
    },
}

impl Conn {
    async fn open(base: &str, http: &reqwest::Client, auth: Option<&str>) -> anyhow::Result<Self> {
        Ok(match plain_authority(base) {
            Some(authority) => Self::Lean {
                client: LeanClient::connect(authority, auth).await?,
                authority: authority.to_owned(),
                auth: auth.map(str::to_owned),
            },
            None => Self::General {
                http: http.clone(),
                base: base.to_owned(),
            },
        })
    }

    async fn send(
        &mut self,
        method: Method,
        path: &str,
        token: Option<&str>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        match self {
            Self::Lean { client, .. } => client.send(method, path, token).await,
            Self::General { http, base } => {
                let mut request = http.request(method, format!("{base}{path}"));
                if let Some(token) = token {
                    request = request.header("lock-token", token);
                }
                let response = request.send().await?;
                let status = response.status();
                Ok((status, response.bytes().await?))
            }
        }
    }

    /// After a failed request the connection may be gone: a fresh one.
    async fn reopen(&mut self) -> anyhow::Result<()> {
        if let Self::Lean {
            client,
            authority,
            auth,
        } = self
        {
            *client = LeanClient::connect(authority, auth.as_deref()).await?;
        }
        Ok(())
    }
}

/// A client's pause after a failed acquire.
const ERROR_PAUSE: Duration = Duration::from_millis(10);

/// Runs one client until `stop`: acquire, hold, release.
async fn client_loop(
    mut conn: Conn,
    path: Arc<str>,
    acquire: Arc<str>,
    hold: Duration,
    limit: Duration,
    stop: Arc<AtomicBool>,
) -> ClientLog {
    let mut log = ClientLog::default();
    while !stop.load(Ordering::Relaxed) {
        let sent = Instant::now();
        let granted = match tokio::time::timeout(limit, conn.send(Method::POST, &acquire, None))
            .await
        {
            Ok(Ok((StatusCode::CREATED, body))) => serde_json::from_slice::<Granted>(&body).ok(),
            _ => None,
        };
        // A grant without a fence is not the broker's: an error too.
        let Some((token, fence)) = granted.and_then(|g| Some((g.token, g.fence?))) else {
            log.errors += 1;
            // A broker that refuses must not be hammered by a tight loop.
            tokio::time::sleep(ERROR_PAUSE).await;
            if conn.reopen().await.is_err() {
                break;
            }
            continue;
        };
        let at = Instant::now();
        log.waits.push(at - sent);
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        let released =
            match tokio::time::timeout(limit, conn.send(Method::DELETE, &path, Some(&token))).await
            {
                Ok(Ok((StatusCode::NO_CONTENT, _))) => Some(Instant::now()),
                _ => None,
            };
        log.grants.push(Grant {
            fence,
            granted: at,
            released,
        });
        if released.is_none() {
            log.errors += 1;
            if conn.reopen().await.is_err() {
                break;
            }
        }
    }
    log
}

/// Runs the fleet bench against `args.urls` and prints its figures.
pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<FleetSummary> {
    if args.contenders == 0 {
        bail!("--contenders must be at least 1");
    }
    if args.mode != BenchMode::Exclusive || args.waiters > 0 {
        bail!("--urls runs the hot key on exclusive leases only: drop --mode and --waiters");
    }
    let bases: Vec<String> = args
        .urls
        .iter()
        .map(|u| u.trim().trim_end_matches('/').to_owned())
        .collect();
    if bases.iter().any(String::is_empty) {
        bail!("--urls has an empty URL in it");
    }
    let http = args
        .connect
        .apply(
            reqwest::Client::builder()
                .timeout(Duration::from_millis(args.wait_ms) + Duration::from_secs(30)),
        )
        .map_err(anyhow::Error::msg)?
        .build()?;
    for base in &bases {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("the broker at {base} is not ready"))?;
        wait_until_granting(&http, base).await?;
    }
    let redis = match &args.redis_url {
        None => Vec::new(),
        Some(url) => data_nodes(url).await?,
    };
    let path: Arc<str> = format!("/locks/bench-{}-fleet", &Token::generate().as_str()[..8]).into();
    let acquire: Arc<str> = format!("{path}?ttl_ms=10000&wait_ms={}", args.wait_ms).into();
    // Past this an acquire or release has hung (the broker answers a wait by wait_ms).
    let limit = Duration::from_millis(args.wait_ms) + Duration::from_secs(30);
    let mut conns = Vec::with_capacity(args.contenders);
    for i in 0..args.contenders {
        let base = &bases[i % bases.len()];
        conns.push(Conn::open(base, &http, args.connect.auth_token.as_deref()).await?);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let cost = RedisCost::start(&redis).await?;
    let started = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|conn| {
            tokio::spawn(client_loop(
                conn,
                path.clone(),
                acquire.clone(),
                args.hold,
                limit,
                stop.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(args.duration).await;
    // Each client finishes the cycle it is in (the waiters behind a stopped client are granted
    // in turn): the Redis figures and the elapsed time run until the last release, so every
    // acquisition counted is paid for in them.
    stop.store(true, Ordering::Relaxed);
    let mut logs = Vec::with_capacity(tasks.len());
    for task in tasks {
        logs.push(task.await.context("a bench client panicked")?);
    }
    let elapsed = started.elapsed();
    let per_client: Vec<u64> = logs.iter().map(|l| l.grants.len() as u64).collect();
    let acquisitions = per_client.iter().sum();
    let cost = cost.per(acquisitions).await?;
    let errors = logs.iter().map(|l| l.errors).sum();
    let mut waits = Vec::new();
    let mut grants = Vec::new();
    for log in logs {
        waits.extend(log.waits);
        grants.extend(log.grants);
    }
    let handoff = handoffs(grants);
    let summary = FleetSummary {
        brokers: bases.len(),
        clients: args.contenders,
        hold_ms: args.hold.as_secs_f64() * 1000.0,
        wait_ms: args.wait_ms,
        seconds: elapsed.as_secs_f64(),
        acquisitions,
        acquisitions_per_sec: acquisitions as f64 / elapsed.as_secs_f64(),
        errors,
        wait: Latency::of(waits),
        handoff: (!handoff.is_empty()).then(|| Latency::of(handoff)),
        script_calls_per_acquisition: cost.as_ref().map(|c| c.calls),
        redis_cpu_us_per_acquisition: cost.as_ref().map(|c| c.cpu_us),
        script_us_per_acquisition: cost.map(|c| c.script_us),
        spread: Spread::of(&per_client),
        per_client,
    };
    if args.json {
        lockbroker_cli_support::out!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_table(&summary);
    }
    Ok(summary)
}

/// The header and the run's row; `scripts/bench-fleet.sh` prints the header once and a row per
/// fleet size.
fn print_table(s: &FleetSummary) {
    lockbroker_cli_support::out!(
        "{:>7} {:>7} {:>8} {:>7} {:>11} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>11} {:>12} {:>6}",
        "brokers",
        "clients",
        "acquired",
        "acq/s",
        "evalsha/acq",
        "redis µs",
        "script µs",
        "wait p50",
        "wait p99",
        "handoff50",
        "handoff99",
        "most/fewest",
        "fewest..most",
        "errors"
    );
    let opt = |v: Option<f64>, digits: usize| v.map_or("-".into(), |v| format!("{v:.digits$}"));
    lockbroker_cli_support::out!(
        "{:>7} {:>7} {:>8} {:>7.0} {:>11} {:>9} {:>9} {:>9.2} {:>9.2} {:>10} {:>10} {:>11} {:>12} {:>6}",
        s.brokers,
        s.clients,
        s.acquisitions,
        s.acquisitions_per_sec,
        opt(s.script_calls_per_acquisition, 2),
        opt(s.redis_cpu_us_per_acquisition, 1),
        opt(s.script_us_per_acquisition, 1),
        s.wait.p50_ms,
        s.wait.p99_ms,
        opt(s.handoff.as_ref().map(|h| h.p50_ms), 2),
        opt(s.handoff.as_ref().map(|h| h.p99_ms), 2),
        s.spread
            .most_over_fewest
            .map_or("inf".into(), |r| format!("{r:.2}")),
        format!("{}..{}", s.spread.fewest, s.spread.most),
        s.errors,
    );
}

#[cfg(test)]
mod tests;
