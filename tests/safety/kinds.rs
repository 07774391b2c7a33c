//! Torture checks for shared locks and semaphores, with real concurrency: many clients through
//! several brokers on one Redis, and through one broker on the embedded store.
//!
//! Read-write: each client takes an exclusive lease (a writer) or a shared one (a reader) at
//! random on one hot key. A writer does a deliberately non-atomic read-modify-write of a counter;
//! a reader reads the counter at the start and at the end of its section. Checked: no exclusive
//! section overlaps any other section; no writer's update is lost; every reader saw the counter
//! stand still; readers did overlap each other (shared really is shared); writers were granted
//! (not starved by the readers); every grant has its own fence, and a section that ended before
//! another began has the lower fence.
//!
//! Semaphore: each client takes one of N permits on one hot key. Checked: at no instant more than
//! N sections overlap, N overlapped at some instant, and the fences as above.
//!
//! A client treats its lease as ending `TTL_MS` after it sent the acquire and holds for a few ms,
//! far less; a section that ran past its lease is reported.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::RngExt;
use reqwest::{Client, StatusCode};
use serde::Deserialize;
use tokio::time::Instant;

use lockbroker_test_support::app::{TestApp, spawn_app_with, spawn_apps};
use lockbroker_test_support::broker::wait_until_ready;
use lockbroker_test_support::http::metric;
use lockbroker_test_support::redis_server::RedisServer;

const TTL_MS: u64 = 5_000;
const WAIT_MS: u64 = 2_000;
const CLIENTS: usize = 12;
const RUN_FOR: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Writer,
    Reader,
    Permit,
}

#[derive(Debug, Clone)]
struct Section {
    kind: Kind,
    client: usize,
    sent: Instant,
    start: Instant,
    end: Instant,
    fence: u64,
    /// A reader: the counter at its start and at its end.
    seen: Option<(u64, u64)>,
}

#[derive(Deserialize)]
struct GrantBody {
    token: String,
    fence: u64,
}

#[derive(Default)]
struct Record {
    sections: Vec<Section>,
    /// Answers other than 201 and 409 locked (transport errors included), with what they were.
    odd: Vec<String>,
    /// `503` answers to acquires, while the store was lost.
    unavailable: usize,
}

/// The counter the writers update the hard way.
#[derive(Default)]
struct Counter(AtomicU64);

impl Counter {
    /// Read, yield, write: two overlapping writers lose an update.
    async fn bump(&self) {
        let seen = self.0.load(Ordering::SeqCst);
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        self.0.store(seen + 1, Ordering::SeqCst);
    }

    fn read(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

async fn brokers_on_redis(redis: &RedisServer, n: usize) -> Vec<TestApp> {
    let apps = spawn_apps(&redis.url(), n, |_| {}).await;
    redis.wait_until_listening(n as u64).await;
    apps
}

/// Runs the clients for [`RUN_FOR`]: `kind_for` picks each section's kind.
async fn hammer(
    urls: Vec<String>,
    path: &'static str,
    query: &'static str,
    kind_for: fn(usize, &mut rand::rngs::ThreadRng) -> Kind,
) -> (Record, u64) {
    hammer_for(urls, path, query, kind_for, RUN_FOR, false).await
}

/// As [`hammer`], through three brokers on one Redis of their own.
async fn hammer_three_brokers_on_one_redis(
    path: &'static str,
    query: &'static str,
    kind_for: fn(usize, &mut rand::rngs::ThreadRng) -> Kind,
) -> (Record, u64) {
    let redis = RedisServer::start().await;
    let apps = brokers_on_redis(&redis, 3).await;
    let urls = apps.iter().map(|a| a.address.clone()).collect();
    hammer(urls, path, query, kind_for).await
}

/// As [`hammer`], for `run_for`; with `store_trouble`, `503 store_unavailable` is an allowed
/// answer (the store is lost mid-run), and a release answered so is tried again.
async fn hammer_for(
    urls: Vec<String>,
    path: &'static str,
    query: &'static str,
    kind_for: fn(usize, &mut rand::rngs::ThreadRng) -> Kind,
    run_for: Duration,
    store_trouble: bool,
) -> (Record, u64) {
    let record = Arc::new(Mutex::new(Record::default()));
    let counter = Arc::new(Counter::default());
    let client = Client::builder()
        .timeout(Duration::from_millis(WAIT_MS + 5_000))
        .build()
        .unwrap();
    let stop_at = Instant::now() + run_for;
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (record, counter, client, urls) = (
            record.clone(),
            counter.clone(),
            client.clone(),
            urls.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut round = 0;
            while Instant::now() < stop_at {
                round += 1;
                let kind = kind_for(c, &mut rand::rng());
                let base = &urls[(c + round) % urls.len()];
                let mode = match kind {
                    Kind::Writer => "&mode=exclusive",
                    Kind::Reader => "&mode=shared",
                    Kind::Permit => "",
                };
                let sent = Instant::now();
                let answer = client
                    .post(format!(
                        "{base}/{path}/hot?ttl_ms={TTL_MS}&wait_ms={WAIT_MS}{query}{mode}"
                    ))
                    .send()
                    .await;
                let answer = match answer {
                    Ok(a) => a,
                    Err(e) => {
                        record.lock().unwrap().odd.push(format!("transport: {e}"));
                        continue;
                    }
                };
                match answer.status() {
                    StatusCode::CREATED => {}
                    StatusCode::CONFLICT => continue,
                    StatusCode::SERVICE_UNAVAILABLE if store_trouble => {
                        record.lock().unwrap().unavailable += 1;
                        continue;
                    }
                    other => {
                        let body = answer.text().await.unwrap_or_default();
                        record.lock().unwrap().odd.push(format!("{other}: {body}"));
                        continue;
                    }
                }
                let grant: GrantBody = answer.json().await.unwrap();
                let start = Instant::now();
                let hold = Duration::from_millis(rand::rng().random_range(0..=3));
                let seen = match kind {
                    Kind::Writer => {
                        counter.bump().await;
                        tokio::time::sleep(hold).await;
                        None
                    }
                    Kind::Reader => {
                        let first = counter.read();
                        tokio::time::sleep(hold + Duration::from_millis(1)).await;
                        Some((first, counter.read()))
                    }
                    Kind::Permit => {
                        tokio::time::sleep(hold + Duration::from_millis(1)).await;
                        None
                    }
                };
                let end = Instant::now();
                let give_up = Instant::now() + Duration::from_secs(3);
                let released = loop {
                    let released = client
                        .delete(format!("{base}/{path}/hot"))
                        .header("Lock-Token", &grant.token)
                        .send()
                        .await
                        .map(|r| r.status());
                    match released {
                        Ok(StatusCode::SERVICE_UNAVAILABLE)
                            if store_trouble && Instant::now() < give_up =>
                        {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        other => break other,
                    }
                };
                if !matches!(released, Ok(StatusCode::NO_CONTENT)) {
                    record
                        .lock()
                        .unwrap()
                        .odd
                        .push(format!("release answered {released:?}"));
                }
                record.lock().unwrap().sections.push(Section {
                    kind,
                    client: c,
                    sent,
                    start,
                    end,
                    fence: grant.fence,
                    seen,
                });
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let counter = counter.read();
    let record = Arc::try_unwrap(record).ok().unwrap().into_inner().unwrap();
    (record, counter)
}

fn overlaps(a: &Section, b: &Section) -> bool {
    a.start < b.end && b.start < a.end
}

/// The checks every kind shares: no odd answers, each section inside its lease, fences unique
/// and in the order of sections that did not overlap.
fn check_common(record: &Record) {
    assert!(
        record.odd.is_empty(),
        "answers other than 201/409/204: {:?}",
        &record.odd[..record.odd.len().min(10)]
    );
    let sections = &record.sections;
    for s in sections {
        assert!(
            s.end < s.sent + Duration::from_millis(TTL_MS),
            "client {} held past its lease",
            s.client
        );
    }
    let mut fences: Vec<u64> = sections.iter().map(|s| s.fence).collect();
    fences.sort_unstable();
    let before = fences.len();
    fences.dedup();
    assert_eq!(fences.len(), before, "a fence was granted twice");
    // A section that ended before another's acquire was sent was granted first. (Not "before
    // it began": two permits granted in one order may reach their clients in the other.)
    let mut by_sent = sections.clone();
    by_sent.sort_by_key(|s| s.sent);
    let mut by_end = sections.clone();
    by_end.sort_by_key(|s| s.end);
    let mut max_fence_ended = 0u64;
    let mut j = 0;
    for s in &by_sent {
        while j < by_end.len() && by_end[j].end < s.sent {
            max_fence_ended = max_fence_ended.max(by_end[j].fence);
            j += 1;
        }
        assert!(
            s.fence > max_fence_ended,
            "fence {} was asked for after a section with fence {} had ended",
            s.fence,
            max_fence_ended
        );
    }
}

/// The most sections live at one instant.
fn most_at_once(sections: &[Section]) -> usize {
    let mut events: Vec<(Instant, i32)> = sections
        .iter()
        .flat_map(|s| [(s.start, 1), (s.end, -1)])
        .collect();
    // An end at the same instant as a start comes first: the intervals are half-open.
    events.sort_by_key(|&(t, d)| (t, d));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    most as usize
}

fn check_read_write(record: &Record, counter: u64) {
    check_common(record);
    let sections = &record.sections;
    let writers: Vec<&Section> = sections.iter().filter(|s| s.kind == Kind::Writer).collect();
    let readers: Vec<&Section> = sections.iter().filter(|s| s.kind == Kind::Reader).collect();
    for w in &writers {
        for s in sections {
            assert!(
                std::ptr::eq(*w, s) || !overlaps(w, s),
                "a writer (fence {}) overlapped a {:?} (fence {})",
                w.fence,
                s.kind,
                s.fence
            );
        }
    }
    assert_eq!(counter, writers.len() as u64, "a writer's update was lost");
    for r in &readers {
        // (A reader outside the run's clients saw no counter; the overlap check covers it.)
        if let Some((first, last)) = r.seen {
            assert_eq!(first, last, "a writer ran during a reader's section");
        }
    }
    // A fifth of the sections were asked for as writers.
    assert!(
        writers.len() >= 10 && writers.len() * 10 >= sections.len(),
        "writers were starved: {} writer and {} reader sections",
        writers.len(),
        readers.len()
    );
    let owned: Vec<Section> = readers.iter().map(|r| (*r).clone()).collect();
    assert!(
        most_at_once(&owned) >= 2,
        "readers never held the lock together: shared is not shared"
    );
    eprintln!(
        "read-write: {} writer and {} reader sections, at most {} readers at once",
        writers.len(),
        readers.len(),
        most_at_once(&owned)
    );
}

fn check_semaphore(record: &Record, limit: usize) {
    check_common(record);
    let most = most_at_once(&record.sections);
    assert!(
        most <= limit,
        "{most} permits held at once; the limit is {limit}"
    );
    assert_eq!(most, limit, "the limit was never reached");
    eprintln!(
        "semaphore: {} sections, at most {most} at once (limit {limit})",
        record.sections.len()
    );
}

/// Mostly readers, a writer now and then: the mix where writers starve if nothing stops them.
fn mostly_readers(_client: usize, rng: &mut rand::rngs::ThreadRng) -> Kind {
    if rng.random_range(0..5) == 0 {
        Kind::Writer
    } else {
        Kind::Reader
    }
}

fn permit(_client: usize, _rng: &mut rand::rngs::ThreadRng) -> Kind {
    Kind::Permit
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_locks_across_three_brokers_on_one_redis_never_let_a_writer_overlap() {
    let (record, counter) = hammer_three_brokers_on_one_redis("locks", "", mostly_readers).await;
    check_read_write(&record, counter);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_locks_on_the_embedded_store_never_let_a_writer_overlap() {
    let app = spawn_app_with(None, |_| {}).await;
    let (record, counter) = hammer(vec![app.address.clone()], "locks", "", mostly_readers).await;
    check_read_write(&record, counter);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_across_three_brokers_on_one_redis_never_grants_more_than_its_limit() {
    let (record, _) = hammer_three_brokers_on_one_redis("semaphores", "&limit=3", permit).await;
    check_semaphore(&record, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_on_the_embedded_store_never_grants_more_than_its_limit() {
    let app = spawn_app_with(None, |_| {}).await;
    let (record, _) = hammer(vec![app.address.clone()], "semaphores", "&limit=3", permit).await;
    check_semaphore(&record, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_locks_and_a_semaphore_keep_their_promises_across_a_redis_flush_mid_run() {
    let redis = RedisServer::start().await;
    let mut apps = Vec::new();
    for _ in 0..3 {
        // A settle time, so that every broker puts its leases back before anything is granted
        // after the flush.
        apps.push(spawn_app_with(Some(redis.url()), |c| c.store_settle_ms = Some(1_500)).await);
    }
    redis.wait_until_listening(3).await;
    for app in &apps {
        wait_until_ready(&app.address, Duration::from_secs(5)).await;
    }
    let urls: Vec<String> = apps.iter().map(|a| a.address.clone()).collect();
    let run_for = Duration::from_secs(6);
    let started = Instant::now();
    let read_write = hammer_for(urls.clone(), "locks", "", mostly_readers, run_for, true);
    let semaphore = hammer_for(
        urls.clone(),
        "semaphores",
        "&limit=3",
        permit,
        run_for,
        true,
    );
    // A reader and a permit holder that hold across the flush and the hold after it, until
    // grants have long resumed: only a put-back keeps the run's writers (and a fourth permit)
    // away from them then.
    let (from, until) = (
        started + Duration::from_millis(1_000),
        started + Duration::from_millis(4_500),
    );
    let long_reader = hold_across(&urls[0], "locks", "&mode=shared", Kind::Reader, from, until);
    let long_permit = hold_across(
        &urls[1],
        "semaphores",
        "&limit=3",
        Kind::Permit,
        from,
        until,
    );
    let flush = async {
        tokio::time::sleep_until(started + Duration::from_millis(1_500)).await;
        redis.flushall().await;
    };
    let ((mut rw, counter), (mut sem, _), reader, permit, ()) =
        tokio::join!(read_write, semaphore, long_reader, long_permit, flush);
    rw.sections.push(reader);
    sem.sections.push(permit);
    check_read_write(&rw, counter);
    check_semaphore(&sem, 3);
    // The flush was seen, and leases of the run were put back (the live shared leases and
    // permits of that instant: a put-back of every kind took part in the checks above).
    let mut losses = 0.0;
    let mut put_back = 0.0;
    for app in &apps {
        losses += metric(&app.address, "lockbroker_store_losses_total").await;
        put_back += metric(&app.address, "lockbroker_leases_put_back_total").await;
    }
    assert!(losses >= 1.0, "no broker saw the flush");
    assert!(put_back >= 1.0, "no lease was put back after the flush");
    eprintln!(
        "across the flush: {put_back} leases put back; {} and {} acquires answered 503",
        rw.unavailable, sem.unavailable
    );
}

/// One lease of `kind` taken at `from` (waiting for it if need be) and released at `until`,
/// through `base`, as a section of its own (client number 99).
async fn hold_across(
    base: &str,
    path: &str,
    query: &str,
    kind: Kind,
    from: Instant,
    until: Instant,
) -> Section {
    let client = Client::new();
    tokio::time::sleep_until(from).await;
    let sent = Instant::now();
    let answer = client
        .post(format!(
            "{base}/{path}/hot?ttl_ms=10000&wait_ms=3000{query}"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        StatusCode::CREATED,
        "the long holder is granted"
    );
    let grant: GrantBody = answer.json().await.unwrap();
    let start = Instant::now();
    assert!(
        start < until,
        "the long holder was granted too late to hold across the flush"
    );
    tokio::time::sleep_until(until).await;
    let end = Instant::now();
    let released = client
        .delete(format!("{base}/{path}/hot"))
        .header("Lock-Token", &grant.token)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(
        released,
        StatusCode::NO_CONTENT,
        "the long holder's lease was put back and its token still works"
    );
    Section {
        kind,
        client: 99,
        sent,
        start,
        end,
        fence: grant.fence,
        seen: None,
    }
}
