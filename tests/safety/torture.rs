//! The torture check every fault test shares: many clients hammer one hot key through whichever
//! brokers are up, and each does a deliberately non-atomic read-modify-write of a shared counter
//! while it holds the lock. Every critical section is recorded (its interval on this process's
//! monotonic clock, its fence, the broker that granted it) together with every acquire call (when
//! it was sent and answered, and how).
//!
//! [`Report::check`] then asserts what a lock must give whatever the fault:
//! - no two critical sections overlap;
//! - no update of the counter is lost;
//! - fences rise in the order the sections ran (so in grant order);
//! - every acquire was answered within its bound, with a status the contract allows, and never
//!   `201` after the client's lease could already have ended.
//!
//! A client treats its lease as ending `ttl_ms` after it *sent* the acquire (the lease starts
//! later than that on the store's clock, so this is on the safe side), and ends its critical
//! section well before; a section that overran is reported, because mutual exclusion is only
//! promised while a lease is live.

use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rand::RngExt;
use reqwest::{Client, StatusCode};
use serde::Deserialize;
use tokio::time::Instant;

/// The brokers the clients use, by base URL. A fault test may swap one (a broker restarted on
/// another port) while the clients run.
#[derive(Clone)]
pub(crate) struct Brokers(Arc<RwLock<Vec<String>>>);

impl Brokers {
    pub(crate) fn new(urls: Vec<String>) -> Self {
        assert!(!urls.is_empty());
        Self(Arc::new(RwLock::new(urls)))
    }

    fn pick(&self, n: usize) -> String {
        let urls = self.0.read().unwrap();
        urls[n % urls.len()].clone()
    }
}

/// How the clients hammer the key.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub key: String,
    pub clients: usize,
    /// Critical sections each client goes for.
    pub rounds: usize,
    pub ttl_ms: u64,
    pub wait_ms: u64,
    /// How long a client holds the lock, in ms, drawn at random for each section.
    pub hold_ms: RangeInclusive<u64>,
    /// The run stops starting new attempts after this, done or not.
    pub limit: Duration,
    /// Every acquire must be answered within this (the contract's `wait_ms` + store timeout,
    /// plus scheduling slack).
    pub answer_bound: Duration,
    /// Whether a broker may vanish mid-run (connection refused or reset count as answers then).
    pub brokers_may_die: bool,
}

/// Slack on top of the contract's bound for an answer (`wait_ms` + the store timeout):
/// scheduling on a loaded two-core machine, the HTTP round trip.
const SLACK: Duration = Duration::from_millis(1500);

/// The bound every acquire of a run must be answered within: the contract's, `wait_ms` plus the
/// store timeout, with [`SLACK`].
pub(crate) fn answer_bound(wait_ms: u64, store_timeout_ms: u64) -> Duration {
    Duration::from_millis(wait_ms + store_timeout_ms) + SLACK
}

impl Plan {
    pub(crate) fn new(key: &str, clients: usize, rounds: usize) -> Self {
        Self {
            key: key.to_owned(),
            clients,
            rounds,
            ttl_ms: 5_000,
            wait_ms: 2_000,
            hold_ms: 0..=3,
            limit: Duration::from_secs(60),
            answer_bound: Duration::from_secs(5),
            brokers_may_die: false,
        }
    }

    /// This plan with acquires that wait up to `wait_ms` on brokers whose store timeout is
    /// `store_timeout_ms`, each answered within [`answer_bound`] of the two.
    pub(crate) fn waiting(self, wait_ms: u64, store_timeout_ms: u64) -> Self {
        Self {
            wait_ms,
            answer_bound: answer_bound(wait_ms, store_timeout_ms),
            ..self
        }
    }
}

/// One critical section, as its client saw it.
#[derive(Debug, Clone)]
pub(crate) struct Section {
    pub client: usize,
    pub broker: String,
    /// When the acquire that granted it was sent.
    pub sent: Instant,
    /// From the grant's arrival...
    pub start: Instant,
    /// ...to just before the release was sent.
    pub end: Instant,
    pub fence: u64,
    pub ttl_ms: u64,
    /// How the release was answered (`None`: no answer).
    pub released: Option<StatusCode>,
}

impl Section {
    /// What `client` held through `broker` under `grant`, from `start` to `end` (its acquire sent
    /// at `sent`), and how its release was answered.
    fn of(
        client: usize,
        broker: String,
        grant: &Grant,
        sent: Instant,
        (start, end): (Instant, Instant),
        released: Option<StatusCode>,
    ) -> Self {
        Self {
            client,
            broker,
            sent,
            start,
            end,
            fence: grant.fence,
            ttl_ms: grant.ttl_ms,
            released,
        }
    }
}

/// One acquire call.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub broker: String,
    pub sent: Instant,
    pub answered: Instant,
    /// `None`: no HTTP answer (refused, reset, timed out).
    pub status: Option<StatusCode>,
    /// The `error` code of an error answer, or the transport error.
    pub code: String,
    pub retry_after: Option<u64>,
}

impl Call {
    pub(crate) fn took(&self) -> Duration {
        self.answered - self.sent
    }
}

/// What a run did.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub sections: Vec<Section>,
    pub acquires: Vec<Call>,
    pub counter: u64,
    pub took: Duration,
    /// Anything a client saw that the contract does not allow.
    pub problems: Vec<String>,
}

#[derive(Deserialize)]
struct Grant {
    fence: u64,
    token: String,
    ttl_ms: u64,
}

#[derive(Default)]
struct Shared {
    counter: AtomicU64,
    /// Set by [`Run::stop`]: no new attempts after it.
    stopped: AtomicBool,
    sections: Mutex<Vec<Section>>,
    acquires: Mutex<Vec<Call>>,
    problems: Mutex<Vec<String>>,
}

impl Shared {
    fn problem(&self, what: String) {
        self.problems.lock().unwrap().push(what);
    }
}

/// A client for the hammering: bounded by `bound` per request, never through a proxy.
fn client(bound: Duration) -> Client {
    Client::builder()
        .no_proxy()
        .timeout(bound + Duration::from_secs(5))
        .build()
        .expect("an HTTP client")
}

/// A torture run under way: faults can be injected while it runs, and extra clients can join.
pub(crate) struct Run {
    shared: Arc<Shared>,
    http: Client,
    plan: Plan,
    started: Instant,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Starts `plan` against `brokers`: the clients run until every one has its rounds or the
/// plan's limit is reached.
pub(crate) fn start(brokers: &Brokers, plan: &Plan) -> Run {
    let shared = Arc::new(Shared::default());
    let http = client(plan.answer_bound);
    let started = Instant::now();
    let deadline = started + plan.limit;
    let tasks = (0..plan.clients)
        .map(|i| {
            let (brokers, plan, shared, http) =
                (brokers.clone(), plan.clone(), shared.clone(), http.clone());
            tokio::spawn(async move { hammer(i, &brokers, &plan, &shared, &http, deadline).await })
        })
        .collect();
    Run {
        shared,
        http,
        plan: plan.clone(),
        started,
        tasks,
    }
}

/// Runs `plan` against `brokers` to its end.
pub(crate) async fn run(brokers: &Brokers, plan: &Plan) -> Report {
    start(brokers, plan).finish().await
}

impl Run {
    /// When the run started.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    /// Critical sections completed so far.
    pub(crate) fn sections_so_far(&self) -> usize {
        self.shared.sections.lock().unwrap().len()
    }

    /// Polls until the run has completed `n` critical sections, for at most 10 s.
    pub(crate) async fn until_sections(&self, n: usize) {
        let started = Instant::now();
        while self.sections_so_far() < n {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "only {} critical sections after 10 s",
                self.sections_so_far()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One more client, outside the plan: acquires the key on `broker` with `ttl_ms` (waiting up
    /// to `wait_ms`), holds it for `hold` doing the same read-modify-write as the others, runs
    /// `during` meanwhile (a fault, say), and releases. Its section is checked with the others.
    /// Returns it, or `None` if it was not granted.
    pub(crate) async fn hold_once(
        &self,
        broker: &str,
        ttl_ms: u64,
        wait_ms: u64,
        hold: Duration,
        during: impl Future<Output = ()>,
    ) -> Option<Section> {
        let sent = Instant::now();
        let answer = self
            .http
            .post(format!(
                "{broker}/locks/{}?ttl_ms={ttl_ms}&wait_ms={wait_ms}",
                self.plan.key
            ))
            .send()
            .await
            .ok()?;
        if answer.status() != StatusCode::CREATED {
            return None;
        }
        let grant: Grant = answer.json().await.ok()?;
        let start = Instant::now();
        let seen = self.shared.counter.load(Ordering::SeqCst);
        let ((), ()) = tokio::join!(tokio::time::sleep(hold), during);
        self.shared.counter.store(seen + 1, Ordering::SeqCst);
        let end = Instant::now();
        if end >= sent + Duration::from_millis(grant.ttl_ms) {
            self.shared.problem(format!(
                "the extra client held fence {} for {:?}, past its lease (ttl {} ms)",
                grant.fence,
                end - start,
                grant.ttl_ms
            ));
        }
        let released = self
            .http
            .delete(format!("{broker}/locks/{}", self.plan.key))
            .header("Lock-Token", &grant.token)
            .send()
            .await
            .ok()
            .map(|r| r.status());
        let section = Section::of(
            EXTRA,
            broker.to_owned(),
            &grant,
            sent,
            (start, end),
            released,
        );
        self.shared.sections.lock().unwrap().push(section.clone());
        Some(section)
    }

    /// Stops the run before its limit: the clients start no new attempt.
    pub(crate) fn stop(&self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
    }

    /// Waits for every client to finish and returns what happened.
    pub(crate) async fn finish(self) -> Report {
        let bound = self.plan.limit + self.plan.answer_bound + Duration::from_secs(10);
        let left = (self.started + bound).saturating_duration_since(Instant::now());
        tokio::time::timeout(left, futures::future::join_all(self.tasks))
            .await
            .unwrap_or_else(|_| panic!("the clients did not stop within {bound:?}"))
            .into_iter()
            .for_each(|joined| joined.expect("a client panicked"));
        let shared = &self.shared;
        Report {
            sections: std::mem::take(&mut *shared.sections.lock().unwrap()),
            acquires: std::mem::take(&mut *shared.acquires.lock().unwrap()),
            counter: shared.counter.load(Ordering::SeqCst),
            took: self.started.elapsed(),
            problems: std::mem::take(&mut *shared.problems.lock().unwrap()),
        }
    }
}

/// One client: `plan.rounds` critical sections, retrying refusals, until the deadline.
async fn hammer(
    me: usize,
    brokers: &Brokers,
    plan: &Plan,
    shared: &Shared,
    http: &Client,
    deadline: Instant,
) {
    let mut done = 0;
    let mut attempt = me;
    let path = format!(
        "/locks/{}?ttl_ms={}&wait_ms={}",
        plan.key, plan.ttl_ms, plan.wait_ms
    );
    while done < plan.rounds && Instant::now() < deadline && !shared.stopped.load(Ordering::SeqCst)
    {
        attempt += 1;
        let broker = brokers.pick(attempt);
        let sent = Instant::now();
        let response = http.post(format!("{broker}{path}")).send().await;
        let (status, body, retry_after) = match response {
            Ok(r) => {
                let status = r.status();
                let retry_after = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok());
                match r.text().await {
                    Ok(body) => (Some(status), body, retry_after),
                    Err(e) => (None, format!("body lost: {e}"), None),
                }
            }
            Err(e) => (None, transport_error(&e), None),
        };
        let answered = Instant::now();
        let code = match status {
            Some(StatusCode::CREATED) | None => body.clone(),
            Some(_) => serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_owned))
                .unwrap_or_else(|| body.clone()),
        };
        shared.acquires.lock().unwrap().push(Call {
            broker: broker.clone(),
            sent,
            answered,
            status,
            code: code.clone(),
            retry_after,
        });
        if answered - sent > plan.answer_bound {
            shared.problem(format!(
                "an acquire on {broker} took {:?}, over its bound {:?} ({status:?} {code})",
                answered - sent,
                plan.answer_bound
            ));
        }
        match status {
            Some(StatusCode::CREATED) => {}
            Some(StatusCode::CONFLICT) if code == "locked" => continue,
            Some(StatusCode::SERVICE_UNAVAILABLE)
                if code == "store_unavailable" || code == "too_many_waiters" =>
            {
                // Come back soon, but do not spin while the store is away.
                let nap = rand::rng().random_range(20..=60);
                tokio::time::sleep(Duration::from_millis(nap)).await;
                continue;
            }
            None if plan.brokers_may_die => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            _ => {
                shared.problem(format!(
                    "an acquire on {broker} was answered {status:?}: {code}"
                ));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        }
        let grant: Grant = match serde_json::from_str(&body) {
            Ok(grant) => grant,
            Err(e) => {
                shared.problem(format!("a 201 that is not a grant ({e}): {body}"));
                continue;
            }
        };
        let start = Instant::now();
        let lease_end = sent + Duration::from_millis(grant.ttl_ms);
        // The critical section: read, give way for a while, write back. Two holders at once
        // would lose an update here.
        let seen = shared.counter.load(Ordering::SeqCst);
        let hold = rand::rng().random_range(plan.hold_ms.clone());
        if hold == 0 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_millis(hold)).await;
        }
        shared.counter.store(seen + 1, Ordering::SeqCst);
        let end = Instant::now();
        if end >= lease_end {
            shared.problem(format!(
                "client {me} held fence {} for {:?}, past its lease (ttl {} ms): the test is too \
                 slow for its TTL",
                grant.fence,
                end - start,
                grant.ttl_ms
            ));
        }
        let released = release(
            http,
            brokers,
            &broker,
            attempt,
            &plan.key,
            &grant.token,
            lease_end,
        )
        .await;
        let section = Section::of(me, broker, &grant, sent, (start, end), released);
        shared.sections.lock().unwrap().push(section);
        done += 1;
    }
}

/// Releases on the broker that granted, as a careful client does: an answer that says nothing
/// (503, or no answer at all) is retried, on the next broker if one is gone, until the lease would
/// have ended anyway. Returns the last answer's status.
async fn release(
    http: &Client,
    brokers: &Brokers,
    granted_by: &str,
    attempt: usize,
    key: &str,
    token: &str,
    lease_end: Instant,
) -> Option<StatusCode> {
    let mut last = None;
    for retry in 0..100 {
        let broker = if retry % 2 == 0 {
            granted_by.to_owned()
        } else {
            brokers.pick(attempt + retry)
        };
        let answer = http
            .delete(format!("{broker}/locks/{key}"))
            .header("Lock-Token", token)
            .send()
            .await;
        last = answer.ok().map(|a| a.status());
        if last.is_some_and(|s| s != StatusCode::SERVICE_UNAVAILABLE)
            || Instant::now() + RELEASE_RETRY >= lease_end
        {
            break;
        }
        tokio::time::sleep(RELEASE_RETRY).await;
    }
    last
}

/// Pause between two tries of a release that got no definite answer.
const RELEASE_RETRY: Duration = Duration::from_millis(50);

/// A client's name in a report: its number, or [`EXTRA`].
fn who(client: usize) -> String {
    if client == EXTRA {
        "the extra client".into()
    } else {
        format!("client {client}")
    }
}

/// The client number of [`Run::hold_once`]'s client.
pub(crate) const EXTRA: usize = usize::MAX;

fn transport_error(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "transport: timed out".into()
    } else if e.is_connect() {
        "transport: connection refused".into()
    } else {
        format!("transport: {e}")
    }
}

/// What [`Report::check`] found, for the test's log.
pub(crate) struct Summary {
    pub sections: usize,
    pub acquires: usize,
    pub unavailable: usize,
    pub first_fence: u64,
    pub last_fence: u64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} critical sections (fences {}..={}) from {} acquires, {} of them answered 503",
            self.sections, self.first_fence, self.last_fence, self.acquires, self.unavailable
        )
    }
}

impl Report {
    /// Asserts mutual exclusion, no lost update, fences rising in the order the sections ran,
    /// and that no client saw anything the contract does not allow. Panics with every violation
    /// found (the first few of each kind).
    pub(crate) fn check(&self) -> Summary {
        let mut violations: Vec<String> = self.problems.iter().take(10).cloned().collect();
        if self.problems.len() > 10 {
            violations.push(format!(
                "... and {} more problems",
                self.problems.len() - 10
            ));
        }
        let mut sections = self.sections.clone();
        sections.sort_by_key(|s| s.start);
        let mut overlaps = 0;
        let mut backwards = 0;
        for pair in sections.windows(2) {
            let (before, after) = (&pair[0], &pair[1]);
            if before.end > after.start {
                overlaps += 1;
                if overlaps <= 5 {
                    violations.push(format!(
                        "two clients held the lock at once for {:?}: fence {} ({}, via {}) and \
                         fence {} ({}, via {})",
                        before.end - after.start,
                        before.fence,
                        who(before.client),
                        before.broker,
                        after.fence,
                        who(after.client),
                        after.broker
                    ));
                }
            }
            if before.fence >= after.fence {
                backwards += 1;
                if backwards <= 5 {
                    violations.push(format!(
                        "fence {} ({}, via {}) was granted after fence {} ({}, via {})",
                        after.fence,
                        who(after.client),
                        after.broker,
                        before.fence,
                        who(before.client),
                        before.broker
                    ));
                }
            }
        }
        if overlaps > 0 {
            violations.push(format!("{overlaps} overlapping pairs of critical sections"));
        }
        if backwards > 0 {
            violations.push(format!("{backwards} fences out of grant order"));
        }
        let sections_n = u64::try_from(sections.len()).unwrap();
        if self.counter != sections_n {
            violations.push(format!(
                "lost updates: {} critical sections left the counter at {}",
                sections_n, self.counter
            ));
        }
        assert!(
            violations.is_empty(),
            "the lock did not hold ({} sections, {} acquires):\n  {}",
            sections.len(),
            self.acquires.len(),
            violations.join("\n  ")
        );
        Summary {
            sections: sections.len(),
            acquires: self.acquires.len(),
            unavailable: self
                .acquires
                .iter()
                .filter(|c| c.status == Some(StatusCode::SERVICE_UNAVAILABLE))
                .count(),
            first_fence: sections.first().map_or(0, |s| s.fence),
            last_fence: sections.last().map_or(0, |s| s.fence),
        }
    }

    /// Sections that started in `[from, to)`.
    pub(crate) fn sections_between(&self, from: Instant, to: Instant) -> Vec<&Section> {
        self.sections
            .iter()
            .filter(|s| s.start >= from && s.start < to)
            .collect()
    }
}
