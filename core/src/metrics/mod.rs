//! The broker's Prometheus metrics, served on `GET /metrics`. Counted in the lock service, so
//! they describe locks, not HTTP: acquisitions by kind (exclusive, shared, semaphore) and result,
//! wait and hold times, renewals, releases and force releases by key space (locks, semaphores)
//! and result, takeovers of expired leases, store errors and latency, current waiters. And the
//! broker's store outage in progress, as the logs tell it (`outage.rs`).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::domain::{Kind, Space};

mod labels;
mod losses;
mod outage;

use self::labels::{
    ACQUIRE_RESULTS, AuthLabels, ByResult, FORCE_RESULTS, KindLabels, OpLabels, PassedOnLabels,
    QueueLabels, RELEASE_RESULTS, RENEW_RESULTS, SessionLabels, SpaceLabels, by_space, kind_label,
    space_label,
};
pub use self::labels::{AcquireResult, HolderResult, PassedOn, StoreOp};
use self::losses::Losses;
pub use self::outage::Outage;

fn seconds_histogram() -> Histogram {
    // 0.5 ms to about 65 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

/// Everything `/metrics` shows.
pub struct Metrics {
    registry: Registry,
    acquisitions: ByResult<KindLabels>,
    acquire_wait: Histogram,
    hold: Histogram,
    renewals: ByResult<SpaceLabels>,
    releases: ByResult<SpaceLabels>,
    force_releases: ByResult<SpaceLabels>,
    takeovers: Counter,
    /// Each primitive's error counter, made up front (by `StoreOp as usize`).
    store_errors_by_op: [Counter; StoreOp::ALL.len()],
    store_latency: Family<OpLabels, Histogram, fn() -> Histogram>,
    /// Each primitive's latency histogram once it has been called (by `StoreOp as usize`).
    store_latency_by_op: [OnceLock<Histogram>; StoreOp::ALL.len()],
    store_batch: Histogram,
    waiters: Gauge,
    watchers: Gauge,
    queued: Family<QueueLabels, Gauge>,
    handoffs: Family<QueueLabels, Counter>,
    passed_on: Family<PassedOnLabels, Counter>,
    direct_grants: Counter,
    resident_memory: Gauge,
    ledger: Gauge,
    losses: Losses,
    auth: Family<AuthLabels, Counter>,
    sessions: Family<SessionLabels, Counter>,
    /// Store outages as the logs tell them: shared here because the lock service, the HTTP
    /// layer and the store all count into the one in progress.
    outage: Arc<Outage>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let acquisitions = ByResult::register(
            &mut registry,
            "lockbroker_acquisitions",
            "Acquire requests by kind (exclusive, shared, semaphore) and result: granted, locked \
             (still held, or every permit taken, when the wait ran out), error, limit_mismatch \
             (semaphores: another limit than the holders')",
            ACQUIRE_RESULTS,
            [Kind::Exclusive, Kind::Shared, Kind::Semaphore { limit: 1 }]
                .into_iter()
                .flat_map(|kind| {
                    let results = match kind {
                        Kind::Semaphore { .. } => ACQUIRE_RESULTS,
                        _ => &ACQUIRE_RESULTS[..3],
                    };
                    results.iter().map(move |result| KindLabels {
                        kind: kind_label(kind),
                        result,
                    })
                }),
        );
        let acquire_wait = seconds_histogram();
        registry.register(
            "lockbroker_acquire_wait_seconds",
            "Time from an acquire's arrival to its grant",
            acquire_wait.clone(),
        );
        let hold = seconds_histogram();
        registry.register(
            "lockbroker_hold_seconds",
            "How long released leases had been held (grant to release, on the store's clock)",
            hold.clone(),
        );
        let renewals = ByResult::register(
            &mut registry,
            "lockbroker_renewals",
            "Renew requests by key space (locks, semaphores) and result",
            RENEW_RESULTS,
            by_space(RENEW_RESULTS),
        );
        let releases = ByResult::register(
            &mut registry,
            "lockbroker_releases",
            "Release requests by key space (locks, semaphores) and result",
            RELEASE_RESULTS,
            by_space(RELEASE_RESULTS),
        );
        let force_releases = ByResult::register(
            &mut registry,
            "lockbroker_force_releases",
            "Force releases (every lease on a key ended without its token) by key space and \
             result: released, not_held, error",
            FORCE_RESULTS,
            by_space(FORCE_RESULTS),
        );
        let takeovers = Counter::default();
        registry.register(
            "lockbroker_takeovers",
            "Expired leases taken over by a new holder",
            takeovers.clone(),
        );
        let store_errors = Family::<OpLabels, Counter>::default();
        // Every series from the start, so the first error is an increase Prometheus sees.
        let store_errors_by_op =
            StoreOp::ALL.map(|op| store_errors.get_or_create(&OpLabels { op }).clone());
        registry.register(
            "lockbroker_store_errors",
            "Store calls that failed or timed out, by primitive",
            store_errors.clone(),
        );
        let store_latency = Family::<OpLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            seconds_histogram,
        );
        registry.register(
            "lockbroker_store_call_seconds",
            "Latency of store calls, by primitive",
            store_latency.clone(),
        );
        let store_batch = Histogram::new(exponential_buckets(1.0, 2.0, 11));
        registry.register(
            "lockbroker_store_batch_size",
            "Operations per batched store call (group commit)",
            store_batch.clone(),
        );
        let waiters = Gauge::default();
        registry.register(
            "lockbroker_waiters",
            "Acquires waiting on this broker now",
            waiters.clone(),
        );
        let watchers = Gauge::default();
        registry.register(
            "lockbroker_watchers",
            "Watches (GET with watch) parked on this broker now, waiting for a key to change",
            watchers.clone(),
        );
        let queued = Family::<QueueLabels, Gauge>::default();
        let handoffs = Family::<QueueLabels, Counter>::default();
        for space in [Space::Locks, Space::Semaphores] {
            let labels = QueueLabels {
                space: space_label(space),
            };
            let _ = queued.get_or_create(&labels);
            let _ = handoffs.get_or_create(&labels);
        }
        registry.register(
            "lockbroker_queued",
            "This broker's acquires waiting in their keys' queues in the store now, by key space",
            queued.clone(),
        );
        registry.register(
            "lockbroker_handoffs",
            "Grants to this broker's waiters that came through the key's queue (an offer taken, \
             or a turn at the head), by key space",
            handoffs.clone(),
        );
        let passed_on = Family::<PassedOnLabels, Counter>::default();
        for reason in [PassedOn::Gone, PassedOn::Lapsed] {
            let _ = passed_on.get_or_create(&PassedOnLabels {
                reason: reason.label(),
            });
        }
        registry.register(
            "lockbroker_offers_passed_on",
            "Offers to this broker's waiters that passed on to the next in line: gone (the \
             waiter had left) or lapsed (not taken in time; the waiters joined again)",
            passed_on.clone(),
        );
        let direct_grants = Counter::default();
        registry.register(
            "lockbroker_direct_grants",
            "Keys this broker's releases granted straight to its own next waiter (no offer, no \
             second store call)",
            direct_grants.clone(),
        );
        let ledger = Gauge::default();
        registry.register(
            "lockbroker_ledger_leases",
            "Live leases this broker granted or renewed and would put back after a store loss",
            ledger.clone(),
        );
        let losses = Losses::register(&mut registry);
        let auth = Family::<AuthLabels, Counter>::default();
        registry.register(
            "lockbroker_auth_requests",
            "Requests the auth layer decided, by token name (empty when no known token was sent) \
             and result: allowed, unauthorized, forbidden",
            auth.clone(),
        );
        let sessions = Family::<SessionLabels, Counter>::default();
        registry.register(
            "lockbroker_sessions",
            "Session calls by what came of them: opened, kept (a keep-alive), closed, ended (a \
             call found the session ended or unknown), error (the store failed)",
            sessions.clone(),
        );
        let resident_memory = Gauge::default();
        registry.register(
            "process_resident_memory_bytes",
            "Resident memory of the broker process (Linux; 0 elsewhere)",
            resident_memory.clone(),
        );
        Self {
            store_batch,
            resident_memory,
            registry,
            acquisitions,
            acquire_wait,
            hold,
            renewals,
            releases,
            force_releases,
            takeovers,
            store_errors_by_op,
            store_latency,
            store_latency_by_op: Default::default(),
            waiters,
            watchers,
            queued,
            handoffs,
            passed_on,
            direct_grants,
            ledger,
            losses,
            auth,
            sessions,
            outage: Arc::default(),
        }
    }
}

impl Metrics {
    /// The broker's store outage in progress, if any (see [`Outage`]).
    pub fn outage(&self) -> &Arc<Outage> {
        &self.outage
    }

    pub fn acquired(&self, kind: Kind, result: AcquireResult, waited: Duration) {
        let acquisitions = &self.acquisitions;
        acquisitions.inc(&KindLabels {
            kind: kind_label(kind),
            result: acquisitions.results[result as usize],
        });
        if let AcquireResult::Granted = result {
            self.acquire_wait.observe(waited.as_secs_f64());
        }
    }

    pub fn released(&self, space: Space, result: HolderResult, held: Option<Duration>) {
        Self::count(&self.releases, space, result as usize);
        if let Some(held) = held {
            self.hold.observe(held.as_secs_f64());
        }
    }

    pub fn renewed(&self, space: Space, result: HolderResult) {
        Self::count(&self.renewals, space, result as usize);
    }

    /// A force release's outcome (a `NotOwner` cannot happen, and counts as an error).
    pub fn force_released(&self, space: Space, result: HolderResult) {
        let index = match result {
            HolderResult::Done => 0,
            HolderResult::NotHeld => 1,
            HolderResult::NotOwner | HolderResult::Error => 2,
        };
        Self::count(&self.force_releases, space, index);
    }

    fn count(counters: &ByResult<SpaceLabels>, space: Space, result: usize) {
        counters.inc(&SpaceLabels {
            space: space_label(space),
            result: counters.results[result],
        });
    }

    /// A grant to a waiter that came through the key's queue.
    pub fn handed_off(&self, space: Space) {
        self.handoffs
            .get_or_create(&QueueLabels {
                space: space_label(space),
            })
            .inc();
    }

    /// An offer to one of this broker's waiters that passed on.
    pub fn offer_passed_on(&self, why: PassedOn) {
        self.passed_on
            .get_or_create(&PassedOnLabels {
                reason: why.label(),
            })
            .inc();
    }

    /// A release of this broker's that granted the key straight to one of its waiters.
    pub fn granted_directly(&self) {
        self.direct_grants.inc();
    }

    pub fn took_over(&self) {
        self.takeovers.inc();
    }

    pub fn store_call(&self, op: StoreOp, took: Duration, failed: bool) {
        // A primitive's histogram is in the family from its first call on (so /metrics shows
        // the primitives this broker used), and kept at hand after that.
        let latency = self.store_latency_by_op[op as usize]
            .get_or_init(|| self.store_latency.get_or_create(&OpLabels { op }).clone());
        latency.observe(took.as_secs_f64());
        if failed {
            self.store_errors_by_op[op as usize].inc();
        }
    }

    /// A batched store call (group commit) carrying `size` operations.
    pub fn store_batch(&self, size: usize) {
        self.store_batch.observe(size as f64);
    }

    /// A loss this broker detected and caught up with.
    pub fn store_loss(&self, put_back: usize, double_claims: usize, hold_ms: u64) {
        self.losses.caught_up(put_back, double_claims, hold_ms);
    }

    /// A decision of the auth layer about a request from the token named `token`.
    pub fn authorized(&self, token: &str, result: &'static str) {
        self.auth
            .get_or_create(&AuthLabels {
                token: token.to_owned(),
                result,
            })
            .inc();
    }

    /// A session call's outcome (`event`: opened, kept, closed, ended, error).
    pub fn session(&self, event: &'static str) {
        self.sessions.get_or_create(&SessionLabels { event }).inc();
    }

    pub fn leases_put_back(&self, n: usize) {
        self.losses.put_back.inc_by(n as u64);
    }

    /// A lease whose answer raced a store loss, put back on its own (started, not yet done).
    pub fn late_put_back(&self) {
        self.losses.late_put_backs.inc();
    }

    /// The OpenMetrics text exposition, with the current number of waiters (in all, and queued
    /// in the store by key space: locks, semaphores).
    /// Sets the number of parked watches, shown by the next [`Metrics::render`].
    pub fn set_watchers(&self, watchers: usize) {
        self.watchers
            .set(i64::try_from(watchers).unwrap_or(i64::MAX));
    }

    pub fn render(&self, waiters: usize, queued: [usize; 2], ledger: usize) -> String {
        self.waiters.set(i64::try_from(waiters).unwrap_or(i64::MAX));
        for (space, n) in [Space::Locks, Space::Semaphores].into_iter().zip(queued) {
            self.queued
                .get_or_create(&QueueLabels {
                    space: space_label(space),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        self.ledger.set(i64::try_from(ledger).unwrap_or(i64::MAX));
        self.resident_memory
            .set(i64::try_from(resident_memory_bytes()).unwrap_or(i64::MAX));
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// The process's resident set size, from `/proc/self/statm` (pages × 4 KiB, the page size of
/// every Linux platform the broker is built for); 0 where that file does not exist.
pub fn resident_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// The content type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests;
