//! The phases over the broker's HTTP API (uncontended and hot key), and the machinery every
//! phase runs on: [`drive`] and its [`Tally`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;

use super::lean::{Granted, LeanClient, plain_authority};
use super::{BenchArgs, BenchMode, Latency, Phase};
use lockbroker::domain::Token;

/// Shared by the workers of one phase: counts, samples and the stop flag.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) stop: AtomicBool,
    pub(super) cycles: AtomicU64,
    pub(super) errors: AtomicU64,
    samples: Mutex<Vec<Duration>>,
    handoffs: Mutex<Vec<Duration>>,
    /// When the last release on the hot key was sent.
    released_at: Mutex<Option<Instant>>,
}

impl Tally {
    pub(super) fn record(&self, local: Vec<Duration>) {
        self.samples.lock().unwrap().extend(local);
    }

    /// Counts one cycle begun at `started`: its time goes in `local` if it succeeded; if not,
    /// it is an error.
    pub(super) fn count(&self, ok: bool, started: Instant, local: &mut Vec<Duration>) {
        if ok {
            self.cycles.fetch_add(1, Ordering::Relaxed);
            local.push(started.elapsed());
        } else {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
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
            redis_cpu_us_per_cycle: None,
        }
    }
}

/// Runs `workers` until the duration is over, printing progress once a second if asked.
pub(super) async fn drive<F, Fut>(
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

/// Where a phase's cycles take their lease, for the bench's `--mode`: the lease's URL (the
/// release goes there too) and the acquire's own query parameters.
struct Target {
    url: String,
    /// `url` without the broker's base: what the lean client sends.
    path: String,
    /// Empty, `mode=shared&` or `limit=N&`: an exclusive acquire is sent exactly as before
    /// there were other modes.
    params: String,
}

impl Target {
    fn new(base: &str, args: &BenchArgs, key: &str) -> Self {
        let (space, params) = match args.mode {
            BenchMode::Exclusive => ("locks", String::new()),
            BenchMode::Shared => ("locks", "mode=shared&".to_owned()),
            BenchMode::Semaphore => ("semaphores", format!("limit={}&", args.limit())),
        };
        let path = format!("/{space}/{key}");
        Self {
            url: format!("{base}{path}"),
            path,
            params,
        }
    }

    fn acquire_url(&self, wait_ms: u64) -> String {
        format!("{}{}", self.url, self.acquire_query(wait_ms))
    }

    fn acquire_path(&self, wait_ms: u64) -> String {
        format!("{}{}", self.path, self.acquire_query(wait_ms))
    }

    fn acquire_query(&self, wait_ms: u64) -> String {
        format!("?{}ttl_ms=10000&wait_ms={wait_ms}", self.params)
    }
}

/// What every HTTP phase runs with: the client, the broker's base URL, the flags, this run's id
/// (in the phase's keys) and whether progress is shown.
#[derive(Clone, Copy)]
pub(super) struct HttpRun<'a> {
    pub(super) http: &'a reqwest::Client,
    pub(super) base: &'a str,
    pub(super) args: &'a BenchArgs,
    pub(super) run_id: &'a str,
    pub(super) progress: bool,
}

pub(super) async fn uncontended_http(run: HttpRun<'_>) -> Phase {
    let (http, base, args, run_id) = (run.http, run.base, run.args, run.run_id);
    let name = match args.mode {
        BenchMode::Exclusive => "uncontended (HTTP)",
        BenchMode::Shared => "uncontended shared (HTTP)",
        BenchMode::Semaphore => "uncontended semaphore (HTTP)",
    };
    // A plain http:// broker gets the lean client (`lean.rs`); HTTPS the general one.
    let lean = plain_authority(base).map(|a| (a.to_owned(), args.connect.auth_token.clone()));
    drive(name, args.clients, args, run.progress, |i, tally| {
        let http = http.clone();
        let target = Target::new(base, args, &format!("bench-{run_id}-u{i}"));
        let lean = lean.clone();
        async move {
            let mut local = Vec::new();
            if let Some((authority, auth)) = lean {
                let acquire = target.acquire_path(0);
                let mut client = match LeanClient::connect(&authority, auth.as_deref()).await {
                    Ok(client) => client,
                    Err(_) => {
                        tally.errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                };
                while !tally.stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let ok = client.cycle(&target.path, &acquire).await.is_ok();
                    tally.count(ok, started, &mut local);
                    if !ok {
                        // The connection may be gone: a new one, or this client stops.
                        match LeanClient::connect(&authority, auth.as_deref()).await {
                            Ok(fresh) => client = fresh,
                            Err(_) => break,
                        }
                    }
                }
                tally.record(local);
                return;
            }
            while !tally.stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let ok = http_cycle(&http, &target, 0).await.is_ok();
                tally.count(ok, started, &mut local);
            }
            tally.record(local);
        }
    })
    .await
}

/// Acquires and releases `target`'s lease; returns when the grant arrived.
async fn http_cycle(
    http: &reqwest::Client,
    target: &Target,
    wait_ms: u64,
) -> anyhow::Result<Instant> {
    let granted: Granted = http
        .post(target.acquire_url(wait_ms))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let at = Instant::now();
    release(http, &target.url, &granted.token).await?;
    Ok(at)
}

pub(super) async fn release(http: &reqwest::Client, url: &str, token: &str) -> anyhow::Result<()> {
    http.delete(url)
        .header("lock-token", token)
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

pub(super) async fn hot_key_http(run: HttpRun<'_>) -> Phase {
    let (http, base, args, run_id) = (run.http, run.base, run.args, run.run_id);
    let target = Arc::new(Target::new(base, args, &format!("bench-{run_id}-hot")));
    let name = match args.mode {
        BenchMode::Exclusive => "hot key (HTTP)",
        BenchMode::Shared => "hot key shared (HTTP)",
        BenchMode::Semaphore => "hot semaphore (HTTP)",
    };
    // Handoff, from one release to the next grant, means something only while one holder
    // follows another.
    let handoff = args.mode == BenchMode::Exclusive;
    drive(name, args.contenders, args, run.progress, |_, tally| {
        let (http, target) = (http.clone(), target.clone());
        async move {
            let mut local = Vec::new();
            let mut handoffs = Vec::new();
            while !tally.stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let granted = http
                    .post(target.acquire_url(10_000))
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
                if handoff {
                    if let Some(released) = tally.released_at.lock().unwrap().take() {
                        handoffs.push(released.elapsed());
                    }
                    *tally.released_at.lock().unwrap() = Some(Instant::now());
                }
                match release(&http, &target.url, &granted.token).await {
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
    })
    .await
}

/// Waits until the broker grants a lock: on a Redis it has never seen, a broker grants nothing
/// for its first `store_settle_ms`, and a measurement must not start inside that.
pub(super) async fn wait_until_granting(http: &reqwest::Client, base: &str) -> anyhow::Result<()> {
    // Several keys: on a Redis Cluster each master settles on its own, and a broker is ready
    // as soon as one of them grants.
    let run = Token::generate();
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in 0..PROBES {
        let url = format!("{base}/locks/bench-probe-{}-{i}", &run.as_str()[..8]);
        loop {
            let answer = http.post(format!("{url}?ttl_ms=1000")).send().await?;
            if answer.status() == reqwest::StatusCode::CREATED {
                let granted: Granted = answer.json().await?;
                release(http, &url, &granted.token).await?;
                break;
            }
            // Refused, not settling: waiting would not help.
            if matches!(
                answer.status(),
                reqwest::StatusCode::UNAUTHORIZED | reqwest::StatusCode::FORBIDDEN
            ) {
                bail!(
                    "the broker at {base} answered {} to the bench's first acquire: with an \
                     auth file, give --auth-token with the lock permission on keys starting \
                     \"bench-\"",
                    answer.status()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the broker at {base} did not grant every probe key for 60 s (last answer {})",
                    answer.status()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(())
}

/// Takes and releases one lease of the bench's `--mode`, so that a broker that does not grant
/// it (one from before shared leases and semaphores, say) stops the run with its answer instead
/// of filling every phase with errors.
pub(super) async fn check_mode(
    http: &reqwest::Client,
    base: &str,
    args: &BenchArgs,
    run_id: &str,
) -> anyhow::Result<()> {
    let target = Target::new(base, args, &format!("bench-{run_id}-mode"));
    let answer = http.post(target.acquire_url(0)).send().await?;
    let status = answer.status();
    if status != reqwest::StatusCode::CREATED {
        let body = answer.text().await.unwrap_or_default();
        bail!(
            "the broker at {base} does not grant a {} lease: it answered {status} {}",
            args.mode.as_str(),
            body.trim()
        );
    }
    let granted: Granted = answer.json().await?;
    release(http, &target.url, &granted.token).await
}

/// Keys [`wait_until_granting`] asks for: enough to land on every master of a small cluster.
const PROBES: usize = 32;
