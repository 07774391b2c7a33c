//! Acquiring: one pass of the lock recipe (claim, look, take over an expired lease) or one try
//! to join a pool, and for a request that may wait, a place in the key's queue in the store:
//! the store call that finds the key busy puts the bid in the queue, and the store call that
//! frees the key offers it to the queue's head, whose broker is told and takes it with one more
//! call. Each granting store call is guarded so that a grant whose answer is lost does not block
//! its key, and a bid that leaves the queue without a grant takes its entry out.

use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::Either;
use rand::RngExt;
use tokio::time::Instant;

use super::pending::{PendingGrant, Spot};
use super::waiters::{Ticket, Wake};
use super::{AcquireRequest, LockError, LockService};
use crate::domain::{Kind, LockKey, Pool, Space, Token, millis};
use crate::metrics::{AcquireResult, StoreOp};
use crate::store::{Bid, GrantAnswer, Join, Lease, Store, StoreError, StoreResult};

/// The outcome of one pass of the lock recipe, or of one try to join a pool.
enum PassOutcome {
    Granted(Lease),
    /// The bid waits in the key's queue; the lease (or offer) blocking it ends in this many ms
    /// at the latest (store clock).
    Queued {
        retry_after_ms: u64,
    },
    /// Not granted, and the bid is not queued (it does not wait): someone holds a live lease
    /// that ends in this many ms (store clock), or bids wait in the queue.
    Busy {
        retry_after_ms: u64,
    },
    /// The state moved under us (GET returned nil, or a takeover was lost): try again at once.
    Again,
}

/// How many passes in a row may end in [`PassOutcome::Again`] before the acquire naps anyway,
/// so a key that churns very fast costs a bounded burst of store calls, not a spin.
const MAX_IMMEDIATE_RETRIES: u32 = 8;

/// The shortest nap of a waiting acquire between two store calls without a notice.
pub(super) const POLL_MIN: Duration = Duration::from_millis(5);

/// How soon a waiting acquire looks again after the store failed to answer.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// The first waiter's fallback poll on a key, in case a notice is lost: 1 s, doubling while it
/// waits, up to 30 s — so a long wait costs a handful of store calls, not one per interval.
/// Offers are the normal path; an offer whose notice is lost lapses and passes on, and after a
/// notice channel reconnects every waiter asks again anyway.
const FALLBACK_POLL_MIN: Duration = Duration::from_secs(1);
const FALLBACK_POLL_MAX: Duration = Duration::from_secs(30);

impl<S: Store> LockService<S> {
    /// Acquires `key`, waiting up to `req.wait` while someone else holds it.
    ///
    /// Ends by `req.wait` plus the store timeout. Dropping the returned future (the client went
    /// away) stops the wait; a store call it interrupts is cleaned up (see `PendingGrant`), and
    /// so is its place in the key's queue (see `Spot`).
    ///
    /// Not an `async fn`, and neither is `acquire_until`: an `async fn` keeps room for its
    /// arguments twice in its future (as they came, and as the body's own), and a parked
    /// waiter's future lives as long as it waits. Here the wait's future is timed by
    /// combinators, which keep it once.
    pub fn acquire<'a>(
        &'a self,
        key: &'a LockKey,
        mut req: AcquireRequest,
    ) -> impl Future<Output = Result<Lease, LockError>> + 'a {
        match req.session.take() {
            None => Either::Left(self.acquire_as(key, req, Token::generate(), None)),
            Some(session) => Either::Right(Box::pin(self.acquire_in_session(
                key,
                req,
                session,
                Token::generate(),
            ))),
        }
    }

    /// [`LockService::acquire`] with the bid's token, and for a bid under a session the time its
    /// lease must end by (see [`Bid::ends`]).
    pub(super) fn acquire_as<'a>(
        &'a self,
        key: &'a LockKey,
        req: AcquireRequest,
        token: Token,
        ends: Option<Instant>,
    ) -> impl Future<Output = Result<Lease, LockError>> + 'a {
        let kind = req.kind;
        let wait = req.wait.as_duration();
        let bid = Bid {
            token,
            ttl: req.ttl,
            owner: req.owner,
            request_id: req.request_id,
            wait_ms: millis(wait),
            ends,
        };
        let bound = wait + self.settings.store_timeout;
        let arrived = Instant::now();
        let until = self.acquire_until(kind, key, bid, arrived + wait);
        tokio::time::timeout(bound, until).map(move |result| {
            let result = match result {
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
            if result.is_ok() {
                self.watchers.changed(kind.space(), key);
            }
            result
        })
    }

    /// The acquire's passes and waits, until a grant, a refusal or `deadline`.
    // An `async` block, not an `async fn`: see `acquire`.
    #[allow(clippy::manual_async_fn)]
    fn acquire_until<'a>(
        &'a self,
        kind: Kind,
        key: &'a LockKey,
        mut bid: Bid,
        deadline: Instant,
    ) -> impl Future<Output = Result<Lease, LockError>> + 'a {
        // The arguments are the block's own: kept once (see `acquire`).
        async move {
            let space = kind.space();
            // This broker's record of the waiter, where the store's offer finds it by token.
            // Without one (the broker has `max_waiters` waiting) the bid may still be granted at
            // once, but it does not join the store's queue: a full broker is only an error if we
            // must wait.
            let ticket = if bid.waits() {
                self.waiters.enqueue(space, key, &bid.token)
            } else {
                None
            };
            // The bid's entry in the store's queue, taken out if the acquire ends without a grant.
            let mut spot: Option<Spot<S>> = None;
            let mut fallback = FALLBACK_POLL_MIN;
            let mut immediate = 0;
            let mut shutdown = self.shutdown.clone();
            // When the lease (or offer) blocking the bid ends, as the store last said.
            let mut until: Option<Instant> = None;
            let mut retry_after_ms = 0;
            // Why the last look could not tell who holds the key (a store-wide hold, a store that
            // did not answer), if it could not.
            let mut trouble: Option<LockError> = None;
            // Whether the next turn of the loop asks the store (or only parks again).
            let mut ask = true;
            // Whether the store has put the bid in the key's queue (a grant then is a handoff).
            let mut queued = false;
            loop {
                if ask {
                    let now = Instant::now();
                    // The store keeps the bid in the queue until about our deadline.
                    bid.wait_ms = match &ticket {
                        Some(_) => millis(deadline.saturating_duration_since(now)),
                        None => 0,
                    };
                    if bid.waits() && !spot.as_ref().is_some_and(|s| s.is_for(&bid.token)) {
                        // Armed before the call: a call that fails may have queued the bid.
                        spot = Some(Spot {
                            store: Some(self.store.clone()),
                            space,
                            key: key.clone(),
                            token: bid.token.clone(),
                        });
                    }
                    // Boxed: the store call's future lives on the heap only while the call runs,
                    // instead of its whole size being reserved in every parked waiter's future.
                    let outcome = match Box::pin(self.pass(kind, key, &bid)).await {
                        // A store-wide hold lasts a few seconds: a request that may still wait
                        // waits it out, as it would a holder.
                        Err(LockError::OnHold(hold)) if now < deadline => {
                            trouble = Some(LockError::OnHold(hold));
                            PassOutcome::Busy {
                                retry_after_ms: hold.retry_after_ms,
                            }
                        }
                        // So does a store that failed to answer (a restart, a failover): the
                        // request looks again shortly, with a new token — the failed call may
                        // have granted the old one, and its cleanup releases by that token (and
                        // takes it out of the queue: its spot is dropped with it).
                        Err(LockError::StoreUnavailable(e))
                            if Instant::now() + STORE_RETRY < deadline =>
                        {
                            trouble = Some(LockError::StoreUnavailable(e));
                            bid.token = Token::generate();
                            spot = None;
                            if let Some(ticket) = &ticket {
                                ticket.set_token(&bid.token);
                            }
                            // Boxed: a rare nap, whose timer and shutdown watch would otherwise
                            // take room in every waiter's future beside the parked ones.
                            let stopping = Box::pin(async {
                                tokio::select! {
                                    () = tokio::time::sleep(jittered(STORE_RETRY)) => false,
                                    _ = shutdown.wait_for(|stopping| *stopping) => true,
                                }
                            });
                            if stopping.await {
                                return Err(LockError::ShuttingDown);
                            }
                            continue;
                        }
                        outcome => {
                            trouble = None;
                            outcome?
                        }
                    };
                    let ends_in = match outcome {
                        PassOutcome::Granted(lease) => {
                            if let Some(mut spot) = spot.take() {
                                // Nothing of the bid waits any more.
                                spot.store = None;
                            }
                            if queued {
                                self.metrics.handed_off(space);
                            }
                            return Ok(lease);
                        }
                        PassOutcome::Again if immediate < MAX_IMMEDIATE_RETRIES => {
                            immediate += 1;
                            continue;
                        }
                        PassOutcome::Again => 0,
                        PassOutcome::Queued { retry_after_ms } => {
                            queued = true;
                            retry_after_ms
                        }
                        PassOutcome::Busy { retry_after_ms } => retry_after_ms,
                    };
                    immediate = 0;
                    retry_after_ms = ends_in;
                    // A lease ends *after* its last millisecond.
                    until = Some(Instant::now() + Duration::from_millis(ends_in.saturating_add(1)));
                }
                let now = Instant::now();
                if now >= deadline {
                    // The wait ran out: say why the last look did not grant.
                    return Err(trouble.unwrap_or(LockError::Locked { retry_after_ms }));
                }
                let Some(waiting) = &ticket else {
                    // The broker had no room for another waiter: if there is room now, the bid may
                    // wait; otherwise it cannot.
                    return Err(LockError::TooManyWaiters {
                        limit: self.waiters.limit(),
                    });
                };
                let wake_at = self.wake_at(waiting, until, &mut fallback, deadline);
                ask = tokio::select! {
                    wake = waiting.woken() => wake == Wake::Ask,
                    () = tokio::time::sleep_until(wake_at) => true,
                    _ = shutdown.wait_for(|stopping| *stopping) => {
                        return Err(LockError::ShuttingDown);
                    }
                };
            }
        }
    }

    /// When a parked waiter asks the store again by itself. The first of this broker's waiters
    /// on the key does at the blocking lease's end (+1 ms), at a `Look` notice's time, or at the
    /// fallback poll, whichever is first, never sooner than `POLL_MIN`; the others sleep until
    /// their offer, a requeue, their promotion or their deadline.
    fn wake_at(
        &self,
        waiting: &Ticket,
        until: Option<Instant>,
        fallback: &mut Duration,
        deadline: Instant,
    ) -> Instant {
        if !waiting.is_first() {
            return deadline;
        }
        let now = Instant::now();
        let mut at = now + jittered(*fallback);
        *fallback = (*fallback * 2).min(FALLBACK_POLL_MAX);
        if let Some(until) = until {
            at = at.min(until);
        }
        if let Some(look) = waiting.look_at() {
            at = at.min(look);
        }
        at.max(now + POLL_MIN).min(deadline)
    }

    /// One try of the acquire: a pass of the lock recipe, or a try to join a pool.
    async fn pass(&self, kind: Kind, key: &LockKey, bid: &Bid) -> Result<PassOutcome, LockError> {
        match kind.pool() {
            None => self.claim_or_take_over(key, bid).await,
            Some(pool) => self.join(key, pool, bid).await,
        }
    }

    /// One try to join a pool: a shared lease, or a permit. One store call.
    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> Result<PassOutcome, LockError> {
        let join = self.timed(StoreOp::join, self.store.join(key, pool, bid));
        match self.guarded(pool.space(), key, bid, join).await? {
            Join::Granted(lease) => Ok(PassOutcome::Granted(lease)),
            Join::Busy { retry_after_ms } => Ok(PassOutcome::Busy { retry_after_ms }),
            Join::Queued { retry_after_ms } => Ok(PassOutcome::Queued { retry_after_ms }),
            Join::LimitMismatch { limit } => Err(LockError::LimitMismatch { limit }),
            Join::OnHold(hold) => Err(LockError::OnHold(hold)),
        }
    }

    /// One pass of the lock recipe.
    async fn claim_or_take_over(&self, key: &LockKey, bid: &Bid) -> Result<PassOutcome, LockError> {
        // 1. SETNX: a free key is ours in one round trip.
        let claim = self.timed(StoreOp::claim, self.store.claim(key, bid));
        match self.guarded(Space::Locks, key, bid, claim).await? {
            GrantAnswer::Granted(lease) => return Ok(PassOutcome::Granted(lease)),
            GrantAnswer::OnHold(hold) => return Err(LockError::OnHold(hold)),
            // A bid that waits is in the key's queue now: the key will be offered to it.
            GrantAnswer::Queued { retry_after_ms } => {
                return Ok(PassOutcome::Queued { retry_after_ms });
            }
            GrantAnswer::Refused => {}
        }
        // 2. GET: who holds it, and until when on the store's clock.
        let snapshot = self.timed(StoreOp::read, self.store.read(key)).await?;
        let exclusive_live = snapshot
            .lease
            .as_ref()
            .is_some_and(|l| l.is_live_at(snapshot.now_ms));
        if !exclusive_live && !snapshot.shared.is_empty() {
            // Shared holders: the claim was refused for them. The key is free for an exclusive
            // lease when the last of them ends.
            let last = snapshot.shared.iter().map(|l| l.expires_at_ms).max();
            return Ok(PassOutcome::Busy {
                retry_after_ms: last.map_or(0, |end| end.saturating_sub(snapshot.now_ms)),
            });
        }
        let Some(current) = snapshot.lease else {
            // GET returned nil: the lock was released between our SETNX and GET. It is free,
            // not expired: go straight back to SETNX.
            return Ok(PassOutcome::Again);
        };
        if current.is_live_at(snapshot.now_ms) {
            return Ok(PassOutcome::Busy {
                retry_after_ms: current.expires_at_ms - snapshot.now_ms,
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
                Ok(PassOutcome::Granted(lease))
            }
            // Another contender won it (or its holder renewed it, or bids wait in the queue,
            // which the key went to): look again.
            GrantAnswer::Refused => Ok(PassOutcome::Again),
            GrantAnswer::Queued { retry_after_ms } => Ok(PassOutcome::Queued { retry_after_ms }),
            GrantAnswer::OnHold(hold) => Err(LockError::OnHold(hold)),
        }
    }

    /// Runs a store call that may grant `bid`, so that a lease nobody knows the token of does not
    /// outlive the call's failure or the client's departure (see [`PendingGrant`]). A
    /// combinator, as [`LockService::timed`] is: the call's future is kept once.
    fn guarded<'a, T: 'a>(
        &'a self,
        space: Space,
        key: &'a LockKey,
        bid: &'a Bid,
        call: impl Future<Output = StoreResult<T>> + 'a,
    ) -> impl Future<Output = StoreResult<T>> + 'a {
        let pending = PendingGrant {
            // With a request id the client can get this grant back by repeating its acquire,
            // so a lease whose answer was lost is left to be claimed (or to end at its TTL);
            // releasing it could pull it from under that repeat's 201.
            store: bid.request_id.is_none().then_some(&self.store),
            space,
            key,
            token: &bid.token,
            ttl: bid.ttl,
            outage: self.metrics.outage(),
        };
        // Dropped with the future if the call never ends (the client went away): armed.
        call.map(move |result| {
            pending.settle(&result);
            result
        })
    }
}

/// `d` give or take a quarter, at random, so waiters on many brokers do not poll in step.
fn jittered(d: Duration) -> Duration {
    let ms = millis(d);
    Duration::from_millis(rand::rng().random_range(ms - ms / 4..=ms + ms / 4))
}
