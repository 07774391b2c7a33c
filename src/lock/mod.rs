//! The lock service: the classic SETNX/GETSET timestamp recipe over any [`Store`] — claim with
//! SETNX, look with GET, take over an expired lease with a safe GETSET, release and renew only as
//! the holder — plus waiting, fencing and the guarantees around a store that fails mid-call.
//! Knows nothing of HTTP.

use std::sync::Arc;
use std::time::Duration;

use rand::RngExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::domain::{LockKey, Owner, RequestId, Token, Ttl, WaitFor, millis};
use crate::metrics::{AcquireResult, HolderResult, Metrics, StoreOp};
use crate::store::{
    Bid, Grant, Hold, Holder, Lease, NOTICE_BUFFER, Space, Store, StoreError, StoreResult,
};
use crate::waiters::Waiters;

/// Limits and defaults the service applies; validated by the configuration.
#[derive(Debug, Clone)]
pub struct LockSettings {
    /// Bound on one store call; a waiting acquire ends by its wait plus this.
    pub store_timeout: Duration,
    /// Most acquires that may wait on this broker at once (an acquire that may wait counts from
    /// its first look); memory per waiter is small, but unbounded waiting is not.
    pub max_waiters: usize,
}

/// Why an operation did not do what was asked. The http layer maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("the lock is held by someone else")]
    Locked { retry_after_ms: u64 },
    #[error("nobody holds the lock")]
    NotHeld,
    #[error("someone else holds the lock")]
    NotOwner,
    #[error("{limit} requests already wait on this broker")]
    TooManyWaiters { limit: usize },
    #[error(transparent)]
    StoreUnavailable(#[from] StoreError),
    #[error("the broker is shutting down")]
    ShuttingDown,
    /// A store-wide hold is in force (the store is new or lost writes; see [`Hold`]).
    #[error("a store-wide hold is in force for {} ms", .0.retry_after_ms)]
    Held(Hold),
}

/// An acquire as the client asked for it.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    pub ttl: Ttl,
    pub wait: WaitFor,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

/// A live lease with the store's clock when it was read.
#[derive(Debug, Clone)]
pub struct LeaseView {
    pub lease: Lease,
    pub now_ms: u64,
}

impl LeaseView {
    pub fn ttl_remaining_ms(&self) -> u64 {
        self.lease.expires_at_ms.saturating_sub(self.now_ms)
    }
}

/// The outcome of one pass of the lock recipe.
enum Attempt {
    Granted(Lease),
    /// Someone holds a live lease that ends in this many ms (store clock).
    Held {
        retry_after_ms: u64,
    },
    /// The state moved under us (GET returned nil, or a takeover was lost): try again at once.
    Again,
}

/// How many passes in a row may end in [`Attempt::Again`] before the acquire naps anyway,
/// so a key that churns very fast costs a bounded burst of store calls, not a spin.
const MAX_IMMEDIATE_RETRIES: u32 = 8;

/// The shortest nap of a waiting acquire between two looks at the lock without a notice.
const POLL_MIN: Duration = Duration::from_millis(5);

/// How soon a waiting acquire looks again after the store failed to answer.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// The head waiter's fallback poll, in case a release notice is lost: 1 s, doubling while it
/// waits, up to 30 s — so a long wait costs a handful of store calls, not one per interval.
/// Notices are the normal path; after a notice channel reconnects, every head is woken anyway.
const FALLBACK_POLL_MIN: Duration = Duration::from_secs(1);
const FALLBACK_POLL_MAX: Duration = Duration::from_secs(30);

/// The service one broker runs. Cheap to clone.
pub struct LockService<S> {
    store: Arc<S>,
    settings: LockSettings,
    waiters: Arc<Waiters>,
    shutdown: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
}

impl<S> Clone for LockService<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: self.settings.clone(),
            waiters: self.waiters.clone(),
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
    pub fn new(store: Arc<S>, settings: LockSettings, shutdown: watch::Receiver<bool>) -> Self {
        Self::with_metrics(store, settings, shutdown, Arc::default())
    }

    /// As [`LockService::new`], counting into `metrics` (which the store may share).
    pub fn with_metrics(
        store: Arc<S>,
        settings: LockSettings,
        shutdown: watch::Receiver<bool>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let waiters = Waiters::new(settings.max_waiters);
        let (notices, received) = mpsc::channel(NOTICE_BUFFER);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(Waiters::hand_notices(Arc::downgrade(&waiters), received));
        }
        store.start(notices);
        Self {
            store,
            settings,
            waiters,
            shutdown,
            metrics,
        }
    }

    /// Requests waiting on this broker now.
    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// Acquires `key`, waiting up to `req.wait` while someone else holds it.
    ///
    /// Ends by `req.wait` plus the store timeout. Dropping the returned future (the client went
    /// away) stops the wait; a store call it interrupts is cleaned up (see [`PendingGrant`]).
    pub async fn acquire(&self, key: &LockKey, req: AcquireRequest) -> Result<Lease, LockError> {
        let bid = Bid {
            token: Token::generate(),
            ttl: req.ttl,
            owner: req.owner,
            request_id: req.request_id,
            waits: !req.wait.as_duration().is_zero(),
        };
        let wait = req.wait.as_duration();
        let bound = wait + self.settings.store_timeout;
        let arrived = Instant::now();
        let result = match tokio::time::timeout(
            bound,
            self.acquire_until(key, &bid, arrived + wait),
        )
        .await
        {
            Ok(result) => result,
            // Only a store call can be running when this fires: the loop stops napping at
            // the deadline, and a nap is shorter than the store timeout.
            Err(_) => Err(StoreError::Timeout(millis(self.settings.store_timeout)).into()),
        };
        let outcome = match &result {
            Ok(_) => AcquireResult::Granted,
            Err(LockError::Locked { .. }) => AcquireResult::Locked,
            Err(_) => AcquireResult::Error,
        };
        self.metrics.acquired(outcome, arrived.elapsed());
        result
    }

    async fn acquire_until(
        &self,
        key: &LockKey,
        bid: &Bid,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        // Join the queue before the first look, so that a release landing between that look and
        // the wait still wakes us. A full queue is only an error if we do have to wait.
        let mut ticket = if Instant::now() < deadline {
            self.waiters.enqueue(key)
        } else {
            None
        };
        let mut fallback = FALLBACK_POLL_MIN;
        let mut immediate = 0;
        let mut shutdown = self.shutdown.clone();
        // Handed over by the waiter ahead of us when it was granted: the lock is held for this
        // long, so the next look can wait.
        let mut held_for_ms: Option<u64> = None;
        // Why the last look could not tell who holds the key (a store-wide hold, a store that
        // did not answer), if it could not.
        let mut trouble: Option<LockError> = None;
        // The bid with a fresh token, once a store call failed.
        let mut retry_bid: Option<Bid> = None;
        loop {
            let bid = retry_bid.as_ref().unwrap_or(bid);
            let attempt = match held_for_ms.take() {
                Some(retry_after_ms) => Attempt::Held { retry_after_ms },
                // Boxed: the store call's future lives on the heap only while the call runs,
                // instead of its whole size being reserved in every parked waiter's future.
                None => match Box::pin(self.attempt(key, bid)).await {
                    // A store-wide hold lasts a few seconds: a request that may still wait waits
                    // it out, as it would a holder.
                    Err(LockError::Held(hold)) if Instant::now() < deadline => {
                        trouble = Some(LockError::Held(hold));
                        Attempt::Held {
                            retry_after_ms: hold.retry_after_ms,
                        }
                    }
                    // So does a store that failed to answer (a restart, a failover): the
                    // request looks again shortly, with a new token — the failed call may have
                    // granted the old one, and its cleanup releases by that token.
                    Err(LockError::StoreUnavailable(e))
                        if Instant::now() + STORE_RETRY < deadline =>
                    {
                        trouble = Some(LockError::StoreUnavailable(e));
                        retry_bid = Some(Bid {
                            token: Token::generate(),
                            ..bid.clone()
                        });
                        tokio::select! {
                            () = tokio::time::sleep(jittered(STORE_RETRY)) => {}
                            _ = shutdown.wait_for(|stopping| *stopping) => return Err(LockError::ShuttingDown),
                        }
                        continue;
                    }
                    attempt => {
                        trouble = None;
                        attempt?
                    }
                },
            };
            let retry_after_ms = match attempt {
                Attempt::Granted(lease) => {
                    // A new lease runs its whole TTL; one handed back again by request id may
                    // have less left, so the next in line looks for itself then.
                    if let Some(ticket) = ticket.take()
                        && lease.token == bid.token
                    {
                        ticket.leave_as_holder(lease.ttl_ms);
                    }
                    return Ok(lease);
                }
                Attempt::Again if immediate < MAX_IMMEDIATE_RETRIES => {
                    immediate += 1;
                    continue;
                }
                Attempt::Again => 0,
                Attempt::Held { retry_after_ms } => retry_after_ms,
            };
            immediate = 0;
            let now = Instant::now();
            if now >= deadline {
                // The wait ran out: say why the last look did not grant.
                return Err(trouble.unwrap_or(LockError::Locked { retry_after_ms }));
            }
            let Some(waiting) = &ticket else {
                // The queue was full when we came; if there is room now, join and look again
                // (a release may have come before we joined).
                ticket = Some(self.waiters.enqueue(key).ok_or(LockError::TooManyWaiters {
                    limit: self.waiters.limit(),
                })?);
                continue;
            };
            // The head wakes at the holder's expiry (+1 ms: a lease ends *after* its last
            // millisecond) or at the fallback poll, whichever is first, never sooner than
            // POLL_MIN; the others sleep until a notice, their promotion or their deadline.
            let wake_at = if waiting.is_head() {
                let nap = Duration::from_millis(retry_after_ms.saturating_add(1))
                    .min(jittered(fallback))
                    .max(POLL_MIN);
                fallback = (fallback * 2).min(FALLBACK_POLL_MAX);
                (now + nap).min(deadline)
            } else {
                deadline
            };
            tokio::select! {
                () = waiting.woken() => held_for_ms = waiting.take_hint(),
                () = tokio::time::sleep_until(wake_at) => {}
                _ = shutdown.wait_for(|stopping| *stopping) => return Err(LockError::ShuttingDown),
            }
        }
    }

    /// One pass of the lock recipe.
    async fn attempt(&self, key: &LockKey, bid: &Bid) -> Result<Attempt, LockError> {
        // 1. SETNX: a free key is ours in one round trip.
        let claim = self.timed(StoreOp::claim, self.store.claim(key, bid));
        match self.guarded(key, bid, claim).await? {
            Grant::Granted(lease) => return Ok(Attempt::Granted(lease)),
            Grant::Held(hold) => return Err(LockError::Held(hold)),
            Grant::Refused => {}
        }
        // 2. GET: who holds it, and until when on the store's clock.
        let snapshot = self.timed(StoreOp::read, self.store.read(key)).await?;
        let Some(current) = snapshot.lease else {
            // GET returned nil: the lock was released between our SETNX and GET. It is free,
            // not expired: go straight back to SETNX.
            return Ok(Attempt::Again);
        };
        if current.is_live_at(snapshot.now_ms) {
            return Ok(Attempt::Held {
                retry_after_ms: current.expires_at_ms - snapshot.now_ms,
            });
        }
        // 3. Expired: take it over, so that exactly one contender wins it.
        let take_over = self.timed(
            StoreOp::take_over,
            self.store.take_over(key, current.fence, bid),
        );
        match self.guarded(key, bid, take_over).await? {
            Grant::Granted(lease) => {
                self.metrics.took_over();
                Ok(Attempt::Granted(lease))
            }
            // Another contender won it (or its holder renewed it): look again.
            Grant::Refused => Ok(Attempt::Again),
            Grant::Held(hold) => Err(LockError::Held(hold)),
        }
    }

    /// Runs a store call that may grant `bid`, so that a lease nobody knows the token of does not
    /// outlive the call's failure or the client's departure (see [`PendingGrant`]).
    async fn guarded<T>(
        &self,
        key: &LockKey,
        bid: &Bid,
        call: impl Future<Output = StoreResult<T>>,
    ) -> StoreResult<T> {
        let mut pending = PendingGrant {
            // With a request id the client can get this grant back by repeating its acquire,
            // so a lease whose answer was lost is left to be claimed (or to end at its TTL);
            // releasing it could pull it from under that repeat's 201.
            store: bid.request_id.is_none().then(|| self.store.clone()),
            key: key.clone(),
            token: bid.token.clone(),
            ttl: bid.ttl,
        };
        let result = call.await;
        if result.is_ok() {
            // A definite answer: a grant goes back to the client (one that has left by now was
            // granted at that instant, and its lease ends at its TTL).
            pending.store = None;
        }
        result
    }

    /// Releases `key` if `token` holds its live lease.
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<(), LockError> {
        let outcome = self
            .timed(
                StoreOp::release,
                self.store.release(Space::Locks, key, token),
            )
            .await;
        let (result, held) = match &outcome {
            Ok(Holder::Done(released)) => (
                HolderResult::Done,
                Some(Duration::from_millis(released.held_ms)),
            ),
            Ok(Holder::NotHeld) => (HolderResult::NotHeld, None),
            Ok(Holder::NotOwner) => (HolderResult::NotOwner, None),
            Ok(Holder::Held(_)) | Err(_) => (HolderResult::Error, None),
        };
        self.metrics.released(result, held);
        outcome?.into_result().map(drop)
    }

    /// Moves the end of `token`'s live lease to `ttl` from now. Same token, same fence.
    pub async fn renew(&self, key: &LockKey, token: &Token, ttl: Ttl) -> Result<Lease, LockError> {
        let outcome = self
            .timed(
                StoreOp::renew,
                self.store.renew(Space::Locks, key, token, ttl),
            )
            .await;
        self.metrics.renewed(match &outcome {
            Ok(Holder::Done(_)) => HolderResult::Done,
            Ok(Holder::NotHeld) => HolderResult::NotHeld,
            Ok(Holder::NotOwner) => HolderResult::NotOwner,
            Ok(Holder::Held(_)) | Err(_) => HolderResult::Error,
        });
        outcome?.into_result()
    }

    /// The live lease on `key`, if any.
    pub async fn inspect(&self, key: &LockKey) -> Result<LeaseView, LockError> {
        let snapshot = self.timed(StoreOp::read, self.store.read(key)).await?;
        match snapshot.lease {
            Some(lease) if lease.is_live_at(snapshot.now_ms) => Ok(LeaseView {
                lease,
                now_ms: snapshot.now_ms,
            }),
            _ => Err(LockError::NotHeld),
        }
    }

    /// Whether a free key would be granted now: the store answers and no store-wide hold is in
    /// force.
    pub async fn ready(&self) -> Result<(), LockError> {
        match self.timed(StoreOp::ping, self.store.ready()).await? {
            None => Ok(()),
            Some(hold) => Err(LockError::Held(hold)),
        }
    }

    /// Runs one store call, recording its latency and whether it failed.
    async fn timed<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = StoreResult<T>>,
    ) -> StoreResult<T> {
        let started = Instant::now();
        let result = call.await;
        self.metrics
            .store_call(op, started.elapsed(), result.is_err());
        result
    }

    /// The metrics, with the current number of waiters, in the OpenMetrics text format.
    pub fn render_metrics(&self) -> String {
        self.metrics
            .render(self.waiters.len(), self.store.ledger_len())
    }
}

impl<T> Holder<T> {
    /// The value of a holder-checked operation that was done, or why it was not.
    fn into_result(self) -> Result<T, LockError> {
        match self {
            Holder::Done(v) => Ok(v),
            Holder::NotHeld => Err(LockError::NotHeld),
            Holder::NotOwner => Err(LockError::NotOwner),
            Holder::Held(hold) => Err(LockError::Held(hold)),
        }
    }
}

/// `d` give or take a quarter, at random, so waiters on many brokers do not poll in step.
fn jittered(d: Duration) -> Duration {
    let ms = millis(d);
    Duration::from_millis(rand::rng().random_range(ms - ms / 4..=ms + ms / 4))
}

mod pending;

use pending::PendingGrant;

#[cfg(test)]
mod tests;
