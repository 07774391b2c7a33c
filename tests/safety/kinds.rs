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

use lockbroker_test_support::app::{TestApp, spawn_app_with};
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
    let mut apps = Vec::new();
    for _ in 0..n {
        apps.push(spawn_app_with(Some(redis.url()), |_| {}).await);
    }
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
    let record = Arc::new(Mutex::new(Record::default()));
    let counter = Arc::new(Counter::default());
    let client = Client::builder()
        .timeout(Duration::from_millis(WAIT_MS + 5_000))
        .build()
        .unwrap();
    let stop_at = Instant::now() + RUN_FOR;
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
                let released = client
                    .delete(format!("{base}/{path}/hot"))
                    .header("Lock-Token", &grant.token)
                    .send()
                    .await
                    .map(|r| r.status());
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
    let mut by_start = sections.clone();
    by_start.sort_by_key(|s| s.start);
    // A section that ended before another began was granted first.
    let mut by_end = sections.clone();
    by_end.sort_by_key(|s| s.end);
    let mut max_fence_ended = 0u64;
    let mut j = 0;
    for s in &by_start {
        while j < by_end.len() && by_end[j].end < s.start {
            max_fence_ended = max_fence_ended.max(by_end[j].fence);
            j += 1;
        }
        assert!(
            s.fence > max_fence_ended,
            "fence {} began after a section with fence {} had ended",
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
        let (first, last) = r.seen.unwrap();
        assert_eq!(first, last, "a writer ran during a reader's section");
    }
    assert!(
        writers.len() >= 10,
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
    let redis = RedisServer::start().await;
    let apps = brokers_on_redis(&redis, 3).await;
    let urls = apps.iter().map(|a| a.address.clone()).collect();
    let (record, counter) = hammer(urls, "locks", "", mostly_readers).await;
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
    let redis = RedisServer::start().await;
    let apps = brokers_on_redis(&redis, 3).await;
    let urls = apps.iter().map(|a| a.address.clone()).collect();
    let (record, _) = hammer(urls, "semaphores", "&limit=3", permit).await;
    check_semaphore(&record, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_on_the_embedded_store_never_grants_more_than_its_limit() {
    let app = spawn_app_with(None, |_| {}).await;
    let (record, _) = hammer(vec![app.address.clone()], "semaphores", "&limit=3", permit).await;
    check_semaphore(&record, 3);
}
