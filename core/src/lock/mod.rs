//! The lock service: the classic SETNX/GETSET timestamp recipe over any [`Store`] — claim with
//! SETNX, look with GET, take over an expired lease with a safe GETSET, release and renew only as
//! the holder — plus waiting, fencing and the guarantees around a store that fails mid-call.
//! Shared leases on a lock and semaphore permits join a pool in one store call
//! ([`Store::join`]) and wait in the same loop. Knows nothing of HTTP.
//!
//! This file owns the service's types, its construction and the store-call helpers; the
//! operations are split by concern: `acquire.rs` (the recipe and waiting), `release.rs`
//! (release, renewal and force release: a holder's, or an admin's, calls on a lease) and
//! `inspect.rs` (reading holders and listing keys); the store's outages are told in the logs
//! through the metrics' `Outage`; `pending.rs` cleans up a grant whose answer was lost. Beside them, this broker's side of
//! waiting and watching: `waiters.rs` parks the acquires that wait in their keys' queues,
//! `watchers.rs` the watches by key, and `watching.rs` runs each watched key's keeper.

mod acquire;
mod inspect;
mod pending;
mod release;
mod sessions;
mod several;

pub use self::sessions::SessionLease;
pub use self::several::{Leases, MAX_KEYS};
mod waiters;
mod watchers;
mod watching;

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use self::waiters::{OnGone, Waiters};
use self::watchers::Watchers;
use crate::domain::{Kind, Mode, Owner, RequestId, Space, Token, Ttl, WaitFor};
use crate::metrics::{Metrics, Outage, PassedOn, StoreOp};
use crate::store::{AsHolder, Hold, Lease, NOTICE_BUFFER, Notice, Store, StoreError, StoreResult};

/// Limits and defaults the service applies; validated by the configuration.
#[derive(Debug, Clone)]
pub struct LockSettings {
    /// Bound on one store call; a waiting acquire ends by its wait plus this.
    pub store_timeout: Duration,
    /// Most acquires that may wait on this broker at once (an acquire that may wait counts from
    /// its first look); memory per waiter is small, but unbounded waiting is not.
    pub max_waiters: usize,
    /// Whether force release (every lease on a key ended without its token) is allowed. With an
    /// auth file it is (the auth layer lets only `admin` ask); without one, only if the broker
    /// was started with `allow_force_release`.
    pub allow_force_release: bool,
}

/// Why an operation did not do what was asked. The http layer maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("the lock is held by someone else")]
    Locked { retry_after_ms: u64 },
    /// The semaphore's live holders took their permits with another limit.
    #[error("the semaphore's holders use the limit {limit}")]
    LimitMismatch { limit: u32 },
    /// Force release is off on this broker (no auth file, no `allow_force_release`).
    #[error("force release is off on this broker")]
    ForceReleaseOff,
    /// A listing cursor the store did not give out.
    #[error("the listing cursor is not one this broker gave out")]
    BadCursor,
    #[error("nobody holds the lock")]
    NotHeld,
    #[error("someone else holds the lock")]
    NotOwner,
    #[error("{limit} requests already wait on this broker")]
    TooManyWaiters { limit: usize },
    #[error(transparent)]
    StoreUnavailable(StoreError),
    /// A several-keys acquire's wait ran out: these keys were busy (held by someone) then.
    #[error("{} of the keys are held by someone else", keys.len())]
    LockedKeys {
        keys: Vec<crate::domain::LockKey>,
        retry_after_ms: u64,
    },
    /// The session named on an acquire does not exist or has ended (or ended while it waited).
    #[error("the session does not exist or has ended")]
    NoSession,
    #[error("the broker is shutting down")]
    ShuttingDown,
    /// A store-wide hold is in force (the store is new or lost writes; see [`Hold`]).
    #[error("a store-wide hold is in force for {} ms", .0.retry_after_ms)]
    OnHold(Hold),
}

impl From<StoreError> for LockError {
    fn from(e: StoreError) -> Self {
        match e {
            // The client's mistake, not the store's.
            StoreError::BadCursor => Self::BadCursor,
            e => Self::StoreUnavailable(e),
        }
    }
}

/// An acquire as the client asked for it.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    pub kind: Kind,
    pub ttl: Ttl,
    pub wait: WaitFor,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
    /// The session to take the lease under (its id): the lease then lives as long as the
    /// session, and `ttl` is not used.
    pub session: Option<Token>,
}

/// The live leases on a lock or a semaphore, with the store's clock when they were read.
#[derive(Debug, Clone)]
pub struct HoldersView {
    pub now_ms: u64,
    /// A lock's mode (`None` for a semaphore).
    pub mode: Option<Mode>,
    /// A semaphore's limit (`None` for a lock).
    pub limit: Option<u32>,
    /// By fence; never empty. One for an exclusive lock.
    pub holders: Vec<Lease>,
}

/// The service one broker runs. Cheap to clone.
pub struct LockService<S> {
    store: Arc<S>,
    settings: LockSettings,
    waiters: Arc<Waiters>,
    watchers: Arc<Watchers>,
    shutdown: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
}

impl<S> Clone for LockService<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: self.settings.clone(),
            waiters: self.waiters.clone(),
            watchers: self.watchers.clone(),
            shutdown: self.shutdown.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

impl<S: Store> LockService<S> {
    /// `shutdown` turns true when the broker stops: waiting acquires then end with
    /// [`LockError::ShuttingDown`].
    ///
    /// Starts the store's background work, its release notices going to this service's waiters.
    #[cfg(test)]
    pub fn new(store: Arc<S>, settings: LockSettings, shutdown: watch::Receiver<bool>) -> Self {
        Self::with_metrics(store, settings, shutdown, Arc::default())
    }

    /// A service over `store`, counting into `metrics` (which the store may share). `shutdown`
    /// turns true when the broker stops: waiting acquires then end with
    /// [`LockError::ShuttingDown`].
    ///
    /// Starts the store's background work, its release notices going to this service's waiters.
    pub fn with_metrics(
        store: Arc<S>,
        settings: LockSettings,
        shutdown: watch::Receiver<bool>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let waiters = Waiters::new(settings.max_waiters);
        let watchers = Watchers::new(waiters.watching());
        let (notices, from_store) = mpsc::channel(NOTICE_BUFFER);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            // The watchers take the notices that concern them on the way to the waiters.
            let (to_waiters, received) = mpsc::channel(NOTICE_BUFFER);
            runtime.spawn(tee_notices(
                from_store,
                to_waiters,
                Arc::downgrade(&watchers),
            ));
            // An offer whose waiter has left (its wait ran out, its client went away) ends now,
            // so the key passes on to the next in line instead of when the offer lapses.
            let (gone_store, gone_metrics) = (store.clone(), metrics.clone());
            let gone_watchers = watchers.clone();
            let on_gone: OnGone = Box::new(move |space, key, token| {
                gone_metrics.offer_passed_on(PassedOn::Gone);
                let watchers = gone_watchers.clone();
                let store = gone_store.clone();
                tokio::spawn(async move {
                    match store.leave(space, &key, &token).await {
                        // The offer ended: the key passed on, or is free.
                        Ok(()) => watchers.changed(space, &key),
                        Err(e) => {
                            tracing::debug!(%key, error = %e, "could not end an offer to a waiter that left; it lapses");
                        }
                    }
                });
            });
            runtime.spawn(Waiters::hand_notices(
                Arc::downgrade(&waiters),
                received,
                on_gone,
                metrics.clone(),
            ));
        }
        store.start(notices);
        Self {
            store,
            settings,
            waiters,
            watchers,
            shutdown,
            metrics,
        }
    }

    /// Requests waiting on this broker now.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }
}

impl<S: Store> LockService<S> {
    /// The listing cursors the store takes (see [`Store::cursor_pattern`]).
    pub fn cursor_pattern(&self) -> Option<&'static str> {
        self.store.cursor_pattern()
    }

    /// Whether a free key would be granted now: the store answers and no store-wide hold is in
    /// force.
    pub async fn ready(&self) -> Result<(), LockError> {
        match self.timed(StoreOp::ping, self.store.ready()).await? {
            None => Ok(()),
            Some(hold) => Err(LockError::OnHold(hold)),
        }
    }

    /// Runs one store call, recording its latency and whether it failed.
    ///
    /// A combinator, not an `async fn`: an `async fn` taking the call's future by value keeps it
    /// twice in its own future (once as the argument, once as the awaited value), and the
    /// store's futures are the largest part of a request's.
    fn timed<'a, T: 'a>(
        &'a self,
        op: StoreOp,
        call: impl Future<Output = StoreResult<T>> + 'a,
    ) -> impl Future<Output = StoreResult<T>> + 'a {
        let started = Instant::now();
        call.map(move |result| {
            self.metrics
                .store_call(op, started.elapsed(), result.is_err());
            self.metrics.outage().observe(&result);
            result
        })
    }

    /// Whether the store answers, as this service's store calls found; the HTTP layer counts
    /// the requests it refuses meanwhile.
    pub fn outage(&self) -> &Arc<Outage> {
        self.metrics.outage()
    }

    /// The metrics, with the current number of waiters, in the OpenMetrics text format.
    pub fn render_metrics(&self) -> String {
        self.metrics.set_watchers(self.watchers.len());
        self.metrics.render(
            self.waiters.len(),
            [Space::Locks, Space::Semaphores].map(|space| self.waiters.len_in(space)),
            self.store.ledger_len(),
        )
    }
}

/// Hands the store's notices on: a change to the watchers of its key, missed notices (or a store
/// loss) to every watcher and every waiter, the rest to the waiters. Ends when the waiters'
/// side closes (the service is gone), which closes the store's side too.
async fn tee_notices(
    mut from_store: mpsc::Receiver<Notice>,
    to_waiters: mpsc::Sender<Notice>,
    watchers: std::sync::Weak<Watchers>,
) {
    loop {
        let notice = tokio::select! {
            notice = from_store.recv() => notice,
            () = to_waiters.closed() => return,
        };
        let Some(notice) = notice else { return };
        if let Some(watchers) = watchers.upgrade() {
            match &notice {
                Notice::Changed(space, key) => {
                    watchers.changed(*space, key);
                    continue;
                }
                Notice::Missed => watchers.all_changed(),
                _ => {}
            }
        }
        if to_waiters.send(notice).await.is_err() {
            return;
        }
    }
}

impl<T> AsHolder<T> {
    /// The value of a holder-checked operation that was done, or why it was not.
    fn into_result(self) -> Result<T, LockError> {
        match self {
            AsHolder::Done(v) => Ok(v),
            AsHolder::NotHeld => Err(LockError::NotHeld),
            AsHolder::NotOwner => Err(LockError::NotOwner),
            AsHolder::OnHold(hold) => Err(LockError::OnHold(hold)),
        }
    }
}

#[cfg(test)]
mod tests;
