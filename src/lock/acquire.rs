//! Acquiring: one pass of the lock recipe (claim, look, take over an expired lease) or one try
//! to join a pool, repeated until granted or the wait ends — napping until a release notice,
//! the holder's expiry or a fallback poll — with each granting store call guarded so that a
//! grant whose answer is lost does not block its key.

use std::time::Duration;

use rand::RngExt;
use tokio::time::Instant;

use super::pending::PendingGrant;
use super::{AcquireRequest, LockError, LockService};
use crate::domain::{LockKey, Token, millis};
use crate::metrics::{AcquireResult, StoreOp};
use crate::store::{
    Bid, GrantAnswer, Join, Kind, Lease, Pool, Space, Store, StoreError, StoreResult,
    WRITER_INTENT_MS,
};
use crate::waiters::Ticket;

/// The outcome of one pass of the lock recipe, or of one try to join a pool.
enum Attempt {
    Granted(Lease),
    /// Someone holds a live lease that ends in this many ms (store clock).
    Busy {
        retry_after_ms: u64,
        /// An exclusive bid refused because of shared holders: its intent lapses unless it
        /// looks again within [`WRITER_INTENT_MS`], so its nap is capped at half of that.
        behind_shared: bool,
    },
    /// The state moved under us (GET returned nil, or a takeover was lost): try again at once.
    Again,
}

/// How many passes in a row may end in [`Attempt::Again`] before the acquire naps anyway,
/// so a key that churns very fast costs a bounded burst of store calls, not a spin.
const MAX_IMMEDIATE_RETRIES: u32 = 8;

/// The shortest nap of a waiting acquire between two looks at the lock without a notice.
pub(super) const POLL_MIN: Duration = Duration::from_millis(5);

/// How soon a waiting acquire looks again after the store failed to answer.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// The longest nap of an exclusive acquire waiting behind shared holders: half its intent's life,
/// so that the intent it renews on each look never lapses while it waits.
const INTENT_REFRESH: Duration = Duration::from_millis(WRITER_INTENT_MS / 2);

/// The head waiter's fallback poll, in case a release notice is lost: 1 s, doubling while it
/// waits, up to 30 s — so a long wait costs a handful of store calls, not one per interval.
/// Notices are the normal path; after a notice channel reconnects, every head is woken anyway.
const FALLBACK_POLL_MIN: Duration = Duration::from_secs(1);
const FALLBACK_POLL_MAX: Duration = Duration::from_secs(30);

impl<S: Store> LockService<S> {
    /// Acquires `key`, waiting up to `req.wait` while someone else holds it.
    ///
    /// Ends by `req.wait` plus the store timeout. Dropping the returned future (the client went
    /// away) stops the wait; a store call it interrupts is cleaned up (see `PendingGrant`).
    pub(crate) async fn acquire(
        &self,
        key: &LockKey,
        req: AcquireRequest,
    ) -> Result<Lease, LockError> {
        let kind = req.kind;
        let bid = Bid {
            token: Token::generate(),
            ttl: req.ttl,
            owner: req.owner,
            request_id: req.request_id,
            wait_ms: crate::domain::millis(req.wait.as_duration()),
        };
        let wait = req.wait.as_duration();
        let bound = wait + self.settings.store_timeout;
        let arrived = Instant::now();
        let result =
            match tokio::time::timeout(bound, self.acquire_until(kind, key, &bid, arrived + wait))
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
            Err(LockError::LimitMismatch { .. }) => AcquireResult::LimitMismatch,
            Err(_) => AcquireResult::Error,
        };
        self.metrics.acquired(kind, outcome, arrived.elapsed());
        result
    }

    async fn acquire_until(
        &self,
        kind: Kind,
        key: &LockKey,
        bid: &Bid,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let space = kind.space();
        let exclusive = kind == Kind::Exclusive;
        // Join the queue before the first look, so that a release landing between that look and
        // the wait still wakes us. A full queue is only an error if we do have to wait.
        let mut ticket = if Instant::now() < deadline {
            self.waiters.enqueue(space, key, exclusive)
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
                Some(retry_after_ms) => Attempt::Busy {
                    retry_after_ms,
                    behind_shared: false,
                },
                // Boxed: the store call's future lives on the heap only while the call runs,
                // instead of its whole size being reserved in every parked waiter's future.
                None => match Box::pin(self.attempt(kind, key, bid, ticket.as_ref())).await {
                    // A store-wide hold lasts a few seconds: a request that may still wait waits
                    // it out, as it would a holder.
                    Err(LockError::OnHold(hold)) if Instant::now() < deadline => {
                        trouble = Some(LockError::OnHold(hold));
                        Attempt::Busy {
                            retry_after_ms: hold.retry_after_ms,
                            behind_shared: false,
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
            let (retry_after_ms, behind_shared) = match attempt {
                Attempt::Granted(lease) => {
                    // A new exclusive lease runs its whole TTL; one handed back again by request
                    // id may have less left, so the next in line looks for itself then. After a
                    // shared lease or a permit the next in line may be granted too: dropping the
                    // ticket wakes it to look.
                    if let Some(ticket) = ticket.take()
                        && exclusive
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
                Attempt::Again => (0, false),
                Attempt::Busy {
                    retry_after_ms,
                    behind_shared,
                } => (retry_after_ms, behind_shared),
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
                ticket = Some(self.waiters.enqueue(space, key, exclusive).ok_or(
                    LockError::TooManyWaiters {
                        limit: self.waiters.limit(),
                    },
                )?);
                continue;
            };
            // The head wakes at the holder's expiry (+1 ms: a lease ends *after* its last
            // millisecond) or at the fallback poll, whichever is first, never sooner than
            // POLL_MIN; the others sleep until a notice, their promotion or their deadline. An
            // exclusive head behind shared holders looks again within half the intent's life, so
            // that its intent keeps holding new shared leases back.
            let wake_at = if waiting.is_head() {
                let mut nap = Duration::from_millis(retry_after_ms.saturating_add(1))
                    .min(jittered(fallback))
                    .max(POLL_MIN);
                if behind_shared {
                    nap = nap.min(INTENT_REFRESH);
                }
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

    /// One try of the acquire: a pass of the lock recipe, or a try to join a pool.
    async fn attempt(
        &self,
        kind: Kind,
        key: &LockKey,
        bid: &Bid,
        ticket: Option<&Ticket>,
    ) -> Result<Attempt, LockError> {
        match kind.pool() {
            None => self.claim_or_take_over(key, bid).await,
            // Fairness on this broker: a shared acquire does not try while an exclusive acquire
            // that came before it waits here; it only looks, to know how long the lock is busy.
            Some(Pool::Shared)
                if ticket.map_or_else(
                    || self.waiters.exclusive_waiting(Space::Locks, key),
                    Ticket::exclusive_ahead,
                ) =>
            {
                self.look_behind_exclusive(key).await
            }
            Some(pool) => self.join(key, pool, bid).await,
        }
    }

    /// One try to join a pool: a shared lease, or a permit. One store call.
    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> Result<Attempt, LockError> {
        let join = self.timed(StoreOp::join, self.store.join(key, pool, bid));
        match self.guarded(pool.space(), key, bid, join).await? {
            Join::Granted(lease) => Ok(Attempt::Granted(lease)),
            Join::Busy { retry_after_ms } | Join::Queued { retry_after_ms } => Ok(Attempt::Busy {
                retry_after_ms,
                behind_shared: false,
            }),
            Join::LimitMismatch { limit } => Err(LockError::LimitMismatch { limit }),
            Join::OnHold(hold) => Err(LockError::OnHold(hold)),
        }
    }

    /// How long a lock stays busy for a shared acquire queued behind an exclusive one: until the
    /// exclusive lease ends, or the shared leases the exclusive acquire waits for do.
    async fn look_behind_exclusive(&self, key: &LockKey) -> Result<Attempt, LockError> {
        let snapshot = self.timed(StoreOp::read, self.store.read(key)).await?;
        let ends = snapshot
            .lease
            .iter()
            .chain(&snapshot.shared)
            .filter(|l| l.is_live_at(snapshot.now_ms))
            .map(|l| l.expires_at_ms - snapshot.now_ms);
        Ok(Attempt::Busy {
            // At least 1 ms: a free lock is about to go to the exclusive acquire ahead.
            retry_after_ms: ends.max().unwrap_or(0).max(1),
            behind_shared: false,
        })
    }

    /// One pass of the lock recipe.
    async fn claim_or_take_over(&self, key: &LockKey, bid: &Bid) -> Result<Attempt, LockError> {
        // 1. SETNX: a free key is ours in one round trip.
        let claim = self.timed(StoreOp::claim, self.store.claim(key, bid));
        match self.guarded(Space::Locks, key, bid, claim).await? {
            GrantAnswer::Granted(lease) => return Ok(Attempt::Granted(lease)),
            GrantAnswer::OnHold(hold) => return Err(LockError::OnHold(hold)),
            GrantAnswer::Refused | GrantAnswer::Queued { .. } => {}
        }
        // 2. GET: who holds it, and until when on the store's clock.
        let snapshot = self.timed(StoreOp::read, self.store.read(key)).await?;
        let exclusive_live = snapshot
            .lease
            .as_ref()
            .is_some_and(|l| l.is_live_at(snapshot.now_ms));
        if !exclusive_live && !snapshot.shared.is_empty() {
            // Shared holders: the claim was refused for them (and recorded this bid's intent if
            // it waits). The key is free for an exclusive lease when the last of them ends.
            let last = snapshot.shared.iter().map(|l| l.expires_at_ms).max();
            return Ok(Attempt::Busy {
                retry_after_ms: last.map_or(0, |end| end.saturating_sub(snapshot.now_ms)),
                behind_shared: true,
            });
        }
        let Some(current) = snapshot.lease else {
            // GET returned nil: the lock was released between our SETNX and GET. It is free,
            // not expired: go straight back to SETNX.
            return Ok(Attempt::Again);
        };
        if current.is_live_at(snapshot.now_ms) {
            return Ok(Attempt::Busy {
                retry_after_ms: current.expires_at_ms - snapshot.now_ms,
                behind_shared: false,
            });
        }
        // 3. Expired: take it over, so that exactly one contender wins it.
        let take_over = self.timed(
            StoreOp::take_over,
            self.store.take_over(key, current.fence, bid),
        );
        match self.guarded(Space::Locks, key, bid, take_over).await? {
            GrantAnswer::Granted(lease) => {
                self.metrics.took_over();
                Ok(Attempt::Granted(lease))
            }
            // Another contender won it (or its holder renewed it): look again.
            GrantAnswer::Refused | GrantAnswer::Queued { .. } => Ok(Attempt::Again),
            GrantAnswer::OnHold(hold) => Err(LockError::OnHold(hold)),
        }
    }

    /// Runs a store call that may grant `bid`, so that a lease nobody knows the token of does not
    /// outlive the call's failure or the client's departure (see [`PendingGrant`]).
    async fn guarded<T>(
        &self,
        space: Space,
        key: &LockKey,
        bid: &Bid,
        call: impl Future<Output = StoreResult<T>>,
    ) -> StoreResult<T> {
        let mut pending = PendingGrant {
            // With a request id the client can get this grant back by repeating its acquire,
            // so a lease whose answer was lost is left to be claimed (or to end at its TTL);
            // releasing it could pull it from under that repeat's 201.
            store: bid.request_id.is_none().then(|| self.store.clone()),
            space,
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
}

/// `d` give or take a quarter, at random, so waiters on many brokers do not poll in step.
fn jittered(d: Duration) -> Duration {
    let ms = millis(d);
    Duration::from_millis(rand::rng().random_range(ms - ms / 4..=ms + ms / 4))
}
