//! Store outages as the logs tell them: one WARN line when the store stops answering, one when
//! it answers again (how long it was out, how many requests were refused and how many cleanups
//! of unanswered grants failed meanwhile), instead of one line per refused request or failed
//! cleanup: those are logged at DEBUG and counted here. An outage is an expected event (a Redis
//! restart, a failover), not a bug: nothing here logs at ERROR.
//!
//! One [`Outage`] per broker, shared through [`Metrics`](super::Metrics) by the lock
//! service (which notes its store calls' results), the HTTP layer (which counts the requests it
//! refuses) and the store (which counts the cleanups it could not finish).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{StoreError, StoreResult};

/// How long the store must go without a failed call before an outage counts as over. A store
/// that is only partly out (one master of a cluster) answers some calls and fails others: the
/// outage lasts as long as failures keep coming, rather than ending and beginning again with
/// every request.
const QUIET: Duration = Duration::from_secs(1);

/// Whether the store is answering, from the results of the store calls the service makes.
#[derive(Debug, Default)]
pub struct Outage {
    /// A fast path for the usual case, a store that answers: no lock taken per call.
    down: AtomicBool,
    /// The current outage; `None` while the store answers.
    state: Mutex<Option<Down>>,
    /// Requests answered `503 store_unavailable` during the current outage.
    refused: AtomicU64,
    /// Cleanups that gave up during the current outage: a grant whose answer was lost, or a
    /// write the replicas did not acknowledge, that could not be undone (it ends at its TTL).
    cleanups_failed: AtomicU64,
}

#[derive(Debug)]
struct Down {
    began: Instant,
    last_failure: Instant,
    /// The first call answered since the last failure.
    answered_since: Option<Instant>,
}

impl Outage {
    /// Notes the result of one store call: the first failure begins an outage; it ends at the
    /// first answer once no call has failed for `QUIET`. A call refused for the client's own
    /// mistake (a bad cursor) says nothing about the store.
    pub fn observe<T>(&self, result: &StoreResult<T>) {
        match result {
            Ok(_) => {
                if self.down.load(Ordering::Relaxed) {
                    self.answered();
                }
            }
            Err(StoreError::BadCursor) => {}
            Err(error) => self.failed(error),
        }
    }

    /// Counts one request answered `503 store_unavailable` because the store did not answer.
    pub fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one cleanup that gave up because the store did not answer (`error`, its last
    /// failure): a lease nobody was told of that now ends at its TTL. A failed store call
    /// itself, so it begins an outage if none is in progress.
    pub fn cleanup_failed(&self, error: &StoreError) {
        self.failed(error);
        self.cleanups_failed.fetch_add(1, Ordering::Relaxed);
    }

    fn failed(&self, error: &StoreError) {
        let now = Instant::now();
        let mut state = self
            .state
            .lock()
            .expect("the outage lock is never poisoned");
        if let Some(down) = state.as_mut() {
            down.last_failure = now;
            down.answered_since = None;
            return;
        }
        *state = Some(Down {
            began: now,
            last_failure: now,
            answered_since: None,
        });
        self.refused.store(0, Ordering::Relaxed);
        self.cleanups_failed.store(0, Ordering::Relaxed);
        self.down.store(true, Ordering::Relaxed);
        tracing::warn!(
            %error,
            "the lock store stopped answering: requests that need it are answered 503 \
             store_unavailable until it answers again"
        );
    }

    fn answered(&self) {
        let now = Instant::now();
        let mut state = self
            .state
            .lock()
            .expect("the outage lock is never poisoned");
        let Some(down) = state.as_mut() else {
            return;
        };
        let back = *down.answered_since.get_or_insert(now);
        if now.duration_since(down.last_failure) < QUIET {
            return;
        }
        let lasted_ms =
            u64::try_from(back.duration_since(down.began).as_millis()).unwrap_or(u64::MAX);
        *state = None;
        self.down.store(false, Ordering::Relaxed);
        let refused = self.refused.swap(0, Ordering::Relaxed);
        let cleanups_failed = self.cleanups_failed.swap(0, Ordering::Relaxed);
        tracing::warn!(
            lasted_ms,
            refused,
            cleanups_failed,
            "the lock store answers again after {lasted_ms} ms out; {refused} requests were \
             answered 503 store_unavailable meanwhile; {cleanups_failed} cleanups of grants \
             whose answer was lost could not be done (those leases end at their TTL)"
        );
    }

    /// Whether an outage is in progress.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_outage_begins_at_the_first_failure_and_ends_once_failures_stop() {
        let outage = Outage::default();
        outage.observe(&Ok(()));
        assert!(!outage.is_down());
        outage.observe::<()>(&Err(StoreError::BadCursor));
        assert!(!outage.is_down(), "a bad cursor is the client's mistake");
        outage.observe::<()>(&Err(StoreError::Timeout(5)));
        assert!(outage.is_down());
        outage.refused();
        outage.observe::<()>(&Err(StoreError::Failed("refused".into())));
        outage.refused();
        assert_eq!(outage.refused.load(Ordering::Relaxed), 2);
        outage.cleanup_failed(&StoreError::Timeout(5));
        assert_eq!(outage.cleanups_failed.load(Ordering::Relaxed), 1);
        // An answer right after a failure: the store may be only partly back.
        outage.observe(&Ok(()));
        assert!(outage.is_down());
        tokio::time::advance(QUIET).await;
        outage.observe(&Ok(()));
        assert!(!outage.is_down());
        assert_eq!(outage.refused.load(Ordering::Relaxed), 0);
        assert_eq!(outage.cleanups_failed.load(Ordering::Relaxed), 0);
        assert!(outage.state.lock().unwrap().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_cleanup_begins_an_outage_and_counts_into_it() {
        let outage = Outage::default();
        outage.cleanup_failed(&StoreError::Failed("refused".into()));
        assert!(
            outage.is_down(),
            "a cleanup that gave up is a failed store call"
        );
        assert_eq!(outage.cleanups_failed.load(Ordering::Relaxed), 1);
        outage.cleanup_failed(&StoreError::Failed("refused".into()));
        assert_eq!(outage.cleanups_failed.load(Ordering::Relaxed), 2);
        tokio::time::advance(QUIET).await;
        outage.observe(&Ok(()));
        assert!(!outage.is_down());
        assert_eq!(outage.cleanups_failed.load(Ordering::Relaxed), 0);
    }
}
