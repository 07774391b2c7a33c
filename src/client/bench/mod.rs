//! `lockbroker bench`: a load generator for a running broker, and the same lock cycle run
//! directly against Redis in the same run, so the broker's cost is measured side by side with
//! the fastest thing a client could do instead.
//!
//! Phases: (a) uncontended acquire+release cycles, each client on its own key; (b) one hot key
//! with several contenders and zero hold time, measuring handoff (from a release being sent to
//! the next grant arriving); (c) with `--redis-url`, phase (a)'s cycle done by this process
//! straight on Redis with the broker's own scripts (one EVALSHA to claim, one to release).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;

use crate::domain::{LockKey, Token, Ttl};
use crate::store::redis::RedisSettings;
use crate::store::{Bid, Grant, Holder, RedisStore, Store};

/// `lockbroker bench` flags.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The broker to load.
    #[arg(long, env = "LOCKBROKER_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
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
    /// Print one JSON summary on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Instead of loading a broker, measure the memory the lease ledger (the live leases a
    /// broker remembers, to put back after a store loss) takes for this many leases, in this
    /// process, and how long its periodic sweep and a put-back snapshot take.
    #[arg(long, value_name = "LEASES")]
    pub ledger: Option<usize>,
}

/// What `--ledger` measured.
#[derive(Debug, Serialize)]
pub struct LedgerCost {
    pub leases: usize,
    /// Growth of this process's resident memory while the ledger was filled, per lease: what the
    /// allocator really handed out, map slack and string headers included.
    pub bytes_per_lease: f64,
    /// One pass of the once-a-second sweep over the full ledger (nothing ended).
    pub sweep_ms: f64,
    /// Copying out every live lease, as a put-back does first.
    pub snapshot_ms: f64,
}

/// Fills a ledger with `leases` leases shaped like real ones (a 20-character key, a generated
/// token, an owner label) and measures it.
pub fn ledger_cost(leases: usize) -> LedgerCost {
    use crate::domain::{Lease, Owner};
    use crate::store::ledger::Ledger;
    let ledger = Ledger::default();
    let owner = Owner::parse("web-7 pid 4242").expect("a valid owner");
    let now = tokio::time::Instant::now();
    // Keys and tokens made before the measurement would be counted with it; made inside it, as
    // a broker makes them, only what stays allocated is.
    let before = crate::metrics::resident_memory_bytes();
    for i in 0..leases {
        let key = LockKey::parse(&format!("orders:invoice-{i:06}")).expect("a valid key");
        let lease = Lease {
            token: Token::generate(),
            fence: 1_795_000_000_000_000 + i as u64,
            expires_at_ms: 0,
            ttl_ms: 30_000,
            owner: Some(owner.clone()),
            request_id: None,
        };
        ledger.record(&key, &lease, now);
    }
    let after = crate::metrics::resident_memory_bytes();
    let started = Instant::now();
    ledger.sweep(now);
    let sweep_ms = started.elapsed().as_secs_f64() * 1000.0;
    let started = Instant::now();
    let live = ledger.live(now).len();
    let snapshot_ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(live, leases, "every lease is live");
    LedgerCost {
        leases,
        bytes_per_lease: after.saturating_sub(before) as f64 / leases.max(1) as f64,
        sweep_ms,
        snapshot_ms,
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
}

/// The whole run.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub phases: Vec<Phase>,
    /// Uncontended broker cycles/s over direct-Redis cycles/s, measured in this run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_over_direct: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiters: Option<WaitersPhase>,
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
    let base = args.url.trim_end_matches('/').to_owned();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.clients.max(args.contenders) * 2)
        .timeout(Duration::from_secs(30))
        .build()?;
    http.get(format!("{base}/readyz"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("the broker at {base} is not ready"))?;
    wait_until_granting(&http, &base).await?;
    let redis = match &args.redis_url {
        None => None,
        Some(url) => Some(
            redis::Client::open(url.as_str())?
                .get_multiplexed_async_connection()
                .await
                .with_context(|| format!("cannot connect to Redis at {url}"))?,
        ),
    };
    let run_id = Token::generate().as_str()[..8].to_owned();
    let progress = std::io::stderr().is_terminal() && !args.json;

    let mut phases = Vec::new();
    let calls = ScriptCalls::start(redis.clone()).await?;
    let mut uncontended = uncontended_http(&http, &base, &args, &run_id, progress).await;
    uncontended.redis_calls_per_cycle = calls.per(uncontended.cycles).await?;
    phases.push(uncontended);

    let calls = ScriptCalls::start(redis.clone()).await?;
    let mut hot = hot_key_http(&http, &base, &args, &run_id, progress).await;
    hot.redis_calls_per_cycle = calls.per(hot.cycles).await?;
    phases.push(hot);

    let mut broker_over_direct = None;
    if let Some(url) = &args.redis_url {
        let store = RedisStore::connect(
            &RedisSettings {
                url: url.clone(),
                key_prefix: args.key_prefix.clone(),
                timeout: Duration::from_secs(2),
                store_loss_delay: Duration::ZERO,
                store_settle: Duration::from_secs(3),
            },
            Arc::default(),
        )?;
        let calls = ScriptCalls::start(redis.clone()).await?;
        let mut direct = uncontended_direct(Arc::new(store), &args, &run_id, progress).await;
        direct.redis_calls_per_cycle = calls.per(direct.cycles).await?;
        if direct.cycles_per_sec > 0.0 {
            broker_over_direct = Some(phases[0].cycles_per_sec / direct.cycles_per_sec);
        }
        phases.push(direct);
    }
    let waiters = if args.waiters > 0 {
        Some(park_waiters(&base, args.waiters, args.http2, &run_id).await?)
    } else {
        None
    };
    let summary = Summary {
        phases,
        broker_over_direct,
        waiters,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_table(&summary);
    }
    Ok(summary)
}

/// Shared by the workers of one phase: counts, samples and the stop flag.
#[derive(Default)]
struct Tally {
    stop: AtomicBool,
    cycles: AtomicU64,
    errors: AtomicU64,
    samples: Mutex<Vec<Duration>>,
    handoffs: Mutex<Vec<Duration>>,
    /// When the last release on the hot key was sent.
    released_at: Mutex<Option<Instant>>,
}

impl Tally {
    fn record(&self, local: Vec<Duration>) {
        self.samples.lock().unwrap().extend(local);
    }

    fn into_phase(self, name: &'static str, clients: usize, elapsed: Duration) -> Phase {
        let cycles = self.cycles.load(Ordering::Relaxed);
        let handoffs = self.handoffs.into_inner().unwrap();
        Phase {
            name,
            clients,
            seconds: elapsed.as_secs_f64(),
            cycles,
            cycles_per_sec: cycles as f64 / elapsed.as_secs_f64(),
            errors: self.errors.load(Ordering::Relaxed),
            cycle: Latency::of(self.samples.into_inner().unwrap()),
            handoff: (!handoffs.is_empty()).then(|| Latency::of(handoffs)),
            redis_calls_per_cycle: None,
        }
    }
}

/// Runs `workers` until the duration is over, printing progress once a second if asked.
async fn drive<F, Fut>(
    name: &'static str,
    clients: usize,
    args: &BenchArgs,
    progress: bool,
    worker: F,
) -> Phase
where
    F: Fn(usize, Arc<Tally>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| tokio::spawn(worker(i, tally.clone())))
        .collect();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    while started.elapsed() < args.duration {
        tokio::select! {
            _ = tick.tick() => {
                if progress {
                    eprint!("\r{name}: {:>5.1}s {:>9} cycles", started.elapsed().as_secs_f64(), tally.cycles.load(Ordering::Relaxed));
                }
            }
            () = tokio::time::sleep(args.duration.saturating_sub(started.elapsed())) => {}
        }
    }
    tally.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    let elapsed = started.elapsed();
    if progress {
        eprintln!("\r{name}: done in {:.1}s{:30}", elapsed.as_secs_f64(), "");
    }
    Arc::into_inner(tally)
        .expect("every worker has finished")
        .into_phase(name, clients, elapsed)
}

#[derive(serde::Deserialize)]
struct Granted {
    token: String,
}

async fn uncontended_http(
    http: &reqwest::Client,
    base: &str,
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
) -> Phase {
    drive(
        "uncontended (HTTP)",
        args.clients,
        args,
        progress,
        |i, tally| {
            let (http, base) = (http.clone(), base.to_owned());
            let url = format!("{base}/locks/bench-{run_id}-u{i}");
            async move {
                let mut local = Vec::new();
                while !tally.stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    match http_cycle(&http, &url, 0).await {
                        Ok(_) => {
                            tally.cycles.fetch_add(1, Ordering::Relaxed);
                            local.push(started.elapsed());
                        }
                        Err(_) => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                tally.record(local);
            }
        },
    )
    .await
}

/// Acquires and releases `url`'s lock; returns when the grant arrived.
async fn http_cycle(http: &reqwest::Client, url: &str, wait_ms: u64) -> anyhow::Result<Instant> {
    let granted: Granted = http
        .post(format!("{url}?ttl_ms=10000&wait_ms={wait_ms}"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let at = Instant::now();
    release(http, url, &granted.token).await?;
    Ok(at)
}

async fn release(http: &reqwest::Client, url: &str, token: &str) -> anyhow::Result<()> {
    http.delete(url)
        .header("lock-token", token)
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

async fn hot_key_http(
    http: &reqwest::Client,
    base: &str,
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
) -> Phase {
    let url = format!("{base}/locks/bench-{run_id}-hot");
    drive(
        "hot key (HTTP)",
        args.contenders,
        args,
        progress,
        |_, tally| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let mut local = Vec::new();
                let mut handoffs = Vec::new();
                while !tally.stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let granted = http
                        .post(format!("{url}?ttl_ms=10000&wait_ms=10000"))
                        .send()
                        .await
                        .and_then(reqwest::Response::error_for_status);
                    let granted: Granted = match granted {
                        Ok(response) => match response.json().await {
                            Ok(g) => g,
                            Err(_) => {
                                tally.errors.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                        },
                        Err(_) => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                    };
                    if let Some(released) = tally.released_at.lock().unwrap().take() {
                        handoffs.push(released.elapsed());
                    }
                    *tally.released_at.lock().unwrap() = Some(Instant::now());
                    match release(&http, &url, &granted.token).await {
                        Ok(()) => {
                            tally.cycles.fetch_add(1, Ordering::Relaxed);
                            local.push(started.elapsed());
                        }
                        Err(_) => {
                            tally.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                tally.record(local);
                tally.handoffs.lock().unwrap().extend(handoffs);
            }
        },
    )
    .await
}

async fn uncontended_direct(
    store: Arc<RedisStore>,
    args: &BenchArgs,
    run_id: &str,
    progress: bool,
) -> Phase {
    drive(
        "uncontended (direct Redis)",
        args.clients,
        args,
        progress,
        |i, tally| {
            let store = store.clone();
            let key = LockKey::parse(&format!("bench-{run_id}-d{i}")).expect("a valid key");
            async move {
                let mut local = Vec::new();
                while !tally.stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let bid = Bid {
                        token: Token::generate(),
                        ttl: Ttl::from_ms(10_000),
                        owner: None,
                        request_id: None,
                    };
                    let ok = match store.claim(&key, &bid).await {
                        Ok(Grant::Granted(_)) => {
                            matches!(store.release(&key, &bid.token).await, Ok(Holder::Done(_)))
                        }
                        _ => false,
                    };
                    if ok {
                        tally.cycles.fetch_add(1, Ordering::Relaxed);
                        local.push(started.elapsed());
                    } else {
                        tally.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tally.record(local);
            }
        },
    )
    .await
}

/// Counts Redis script calls over one phase, from INFO commandstats (a count, not a timing).
struct ScriptCalls {
    conn: Option<redis::aio::MultiplexedConnection>,
    before: u64,
}

impl ScriptCalls {
    async fn start(conn: Option<redis::aio::MultiplexedConnection>) -> anyhow::Result<Self> {
        let before = match &conn {
            Some(c) => script_calls(&mut c.clone()).await?,
            None => 0,
        };
        Ok(Self { conn, before })
    }

    async fn per(self, cycles: u64) -> anyhow::Result<Option<f64>> {
        let Some(mut conn) = self.conn else {
            return Ok(None);
        };
        let after = script_calls(&mut conn).await?;
        Ok((cycles > 0).then(|| (after - self.before) as f64 / cycles as f64))
    }
}

/// EVALSHA + EVAL calls Redis has served (scripts' inner commands are counted apart by Redis).
pub async fn script_calls(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    Ok(["evalsha", "eval"]
        .iter()
        .map(|name| command_calls(&info, name))
        .sum())
}

/// `calls=` of `cmdstat_<name>` in an INFO commandstats reply.
pub fn command_calls(info: &str, name: &str) -> u64 {
    let prefix = format!("cmdstat_{name}:");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').find_map(|f| f.strip_prefix("calls=")))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits until the broker grants a lock: on a Redis it has never seen, a broker grants nothing
/// for its first `store_settle_ms`, and a measurement must not start inside that.
async fn wait_until_granting(http: &reqwest::Client, base: &str) -> anyhow::Result<()> {
    let url = format!(
        "{base}/locks/bench-probe-{}",
        &Token::generate().as_str()[..8]
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = http.post(format!("{url}?ttl_ms=1000")).send().await?;
        if answer.status() == reqwest::StatusCode::CREATED {
            let granted: Granted = answer.json().await?;
            return release(http, &url, &granted.token).await;
        }
        if Instant::now() > deadline {
            bail!(
                "the broker at {base} granted nothing for 60 s (last answer {})",
                answer.status()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

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

async fn park_waiters(
    base: &str,
    n: usize,
    http2: bool,
    run_id: &str,
) -> anyhow::Result<WaitersPhase> {
    let client = || {
        let builder = reqwest::Client::builder().timeout(Duration::from_secs(120));
        if http2 {
            builder.http2_prior_knowledge().build()
        } else {
            builder.pool_max_idle_per_host(0).build()
        }
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

fn print_table(summary: &Summary) {
    println!(
        "{:<28} {:>7} {:>10} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>6}",
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
        "errors"
    );
    for p in &summary.phases {
        let handoff = |f: fn(&Latency) -> f64| {
            p.handoff
                .as_ref()
                .map_or("-".into(), |h| format!("{:.2}", f(h)))
        };
        println!(
            "{:<28} {:>7} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>9} {:>9} {:>7} {:>6}",
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
            p.errors,
        );
    }
    if let Some(ratio) = summary.broker_over_direct {
        println!("broker / direct Redis (uncontended cycles/s): {ratio:.3}");
    }
    println!("calls: Redis script calls (EVALSHA/EVAL) per acquire+release cycle");
    if let Some(w) = &summary.waiters {
        println!(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_calls_are_read_by_exact_command_name() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=3,usec_per_call=0.25,rejected_calls=0,failed_calls=0\r\ncmdstat_eval:calls=2,usec=1\r\n";
        assert_eq!(command_calls(info, "evalsha"), 12);
        assert_eq!(command_calls(info, "eval"), 2);
        assert_eq!(command_calls(info, "get"), 0);
    }

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
