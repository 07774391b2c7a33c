//! The embedded store: the same primitives as Redis, in one process, with the same queue per
//! key (`queue.rs`): waiting bids queue in arrival order, and what a step frees is offered to
//! the queue's head, whose broker — the one broker, this process — gets [`Notice::Offered`]
//! and takes it by asking again. Correct for a single broker; brokers do not share it.
//!
//! With one broker there are no broker ids: an offer that lapses (its waiter vanished between
//! the notice and the take, without leaving) ends and the key passes on to the next in line,
//! whose waiters are this broker's and alive, so they keep their places ([`Notice::Requeue`]
//! is never sent), and no [`Notice::Look`] follows an offer (nobody is queued on another
//! broker). A renewal that shortens a lease sends `Look` when bids are queued on the key.

pub mod clock;
mod queue;
mod sessions;
mod slot;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::mpsc;

use self::clock::{Clock, SystemClock};
use self::slot::Slot;
use super::{
    AsHolder, Bid, GrantAnswer, Hold, Join, Kind, Lease, ListQuery, Listed, Mode, Notice, Page,
    Permits, Pool, Released, Renewal, SessionOp, SessionRecord, Snapshot, Space, Store,
    StoreResult,
};
use crate::domain::{Fence, LockKey, Token};

/// The in-memory store.
#[derive(Clone)]
pub struct MemoryStore {
    /// A std Mutex, not a tokio one: nothing awaits while holding it, and every critical section
    /// is a few map operations.
    slots: Arc<Mutex<HashMap<(Space, LockKey), Slot>>>,
    sessions: Arc<Mutex<sessions::Sessions>>,
    clock: Arc<dyn Clock>,
    /// Where the queue's notices go: the one broker's lock service.
    notices: Arc<OnceLock<mpsc::Sender<Notice>>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock::default()))
    }
}

impl MemoryStore {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            slots: Arc::default(),
            sessions: Arc::default(),
            clock,
            notices: Arc::default(),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<(Space, LockKey), Slot>> {
        // A panic while holding the lock cannot leave a slot half-written (each write is one
        // assignment), so a poisoned map is still consistent.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sessions(&self) -> MutexGuard<'_, sessions::Sessions> {
        // As for `slots`: every write is one assignment.
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the slot of `key` in `space`, made if missing (an empty slot is dropped by the
    /// next sweep, as Redis drops nothing it did not write).
    fn with_slot<T>(&self, space: Space, key: &LockKey, f: impl FnOnce(&mut Slot) -> T) -> T {
        let mut slots = self.slots();
        f(slots.entry((space, key.clone())).or_default())
    }

    /// Drops the slots whose keys Redis would have expired by now. Returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        let mut slots = self.slots();
        let before = slots.len();
        slots.retain(|_, slot| slot.drop_at_ms > now);
        let sessions = self.sessions().sweep(now);
        before - slots.len() + sessions
    }

    /// Deletes the lock `key` outright, as Redis does when the key's own expiry passes or
    /// someone runs DEL on it: the leases and the fence counter all go.
    #[cfg(test)]
    pub fn evict(&self, key: &LockKey) {
        self.slots().remove(&(Space::Locks, key.clone()));
    }

    /// Runs one atomic step on the slot of `key` in `space`, then tells the broker's waiters
    /// what it did (after the slots' lock is released).
    fn step<T>(
        &self,
        op: &'static str,
        space: Space,
        key: &LockKey,
        f: impl FnOnce(&mut Slot, &mut Tell) -> T,
    ) -> T {
        traced(op, space, key, || {
            let mut tell = Tell::default();
            let answer = self.with_slot(space, key, |slot| f(slot, &mut tell));
            self.send(space, key, tell);
            answer
        })
    }

    fn send(&self, space: Space, key: &LockKey, tell: Tell) {
        let Some(notices) = self.notices.get() else {
            return;
        };
        // A full channel drops a notice: an offer not taken lapses and passes on, and waiters
        // also ask again on their own timers.
        for token in tell.offered {
            let _ = notices.try_send(Notice::Offered(space, key.clone(), token));
        }
        if let Some(ms) = tell.look_ms {
            let _ = notices.try_send(Notice::Look(space, key.clone(), ms));
        }
    }
}

/// What a step tells the broker's waiters.
#[derive(Default)]
struct Tell {
    /// The tokens of the queued bids offered a lease ([`Notice::Offered`]).
    offered: Vec<Token>,
    /// A lease now ends sooner than the queue's waiters were told: in this many ms
    /// ([`Notice::Look`]).
    look_ms: Option<u64>,
}

/// Runs one store operation, `op` on `key` in `space`; at TRACE, logs it and how long it took
/// (measured only then), as the Redis store logs its script calls. Never a token.
fn traced<T>(op: &'static str, space: Space, key: &LockKey, run: impl FnOnce() -> T) -> T {
    if !tracing::enabled!(tracing::Level::TRACE) {
        return run();
    }
    let started = std::time::Instant::now();
    let answer = run();
    let took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    tracing::trace!(
        op,
        ?space,
        %key,
        took_us,
        "store call: {op} on {key} took {took_us} us"
    );
    answer
}

fn sorted(mut holders: Vec<Lease>) -> Vec<Lease> {
    holders.sort_by_key(|l| l.fence);
    holders
}

fn kind_of(pool: Pool) -> Kind {
    match pool {
        Pool::Shared => Kind::Shared,
        Pool::Semaphore { limit } => Kind::Semaphore { limit },
    }
}

impl Store for MemoryStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<GrantAnswer> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        Ok(self.step("claim", Space::Locks, key, |slot, tell| {
            slot.prune(now_ms);
            if let Some(lease) = slot.held_for(Kind::Exclusive, bid, now_ms) {
                return GrantAnswer::Granted(queue::answered(slot, bid, lease, now_us, tell));
            }
            // SETNX: a key holding an expired lease is not free for a bid that does not wait
            // (the recipe takes it over, so that one contender wins it).
            let free = |s: &Slot| s.lease.is_none() && s.free_for(Kind::Exclusive, now_ms);
            match queue::grant_or_queue(slot, Kind::Exclusive, bid, now_us, free, tell) {
                Ok(lease) => GrantAnswer::Granted(lease),
                Err(retry_after_ms) if bid.waits() => GrantAnswer::Queued { retry_after_ms },
                Err(_) => GrantAnswer::Refused,
            }
        }))
    }

    async fn claim_all(&self, keys: &[LockKey], bid: &Bid) -> StoreResult<Option<Vec<Lease>>> {
        Ok(slot::grant_all(
            &mut self.slots(),
            keys,
            bid,
            self.clock.now_us(),
        ))
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        traced("read", Space::Locks, key, || {
            let now_ms = self.clock.now_ms();
            let slots = self.slots();
            let slot = slots.get(&(Space::Locks, key.clone()));
            Ok(Snapshot {
                now_ms,
                lease: slot.and_then(|s| s.lease.as_ref()).map(|h| h.lease.clone()),
                shared: sorted(
                    slot.iter()
                        .flat_map(|s| &s.holders)
                        .filter(|h| h.lease.is_live_at(now_ms))
                        .map(|h| h.lease.clone())
                        .collect(),
                ),
            })
        })
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<GrantAnswer> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        Ok(self.step("take_over", Space::Locks, key, |slot, tell| {
            // A lapsed offer ends here: for the recipe, the key vanished.
            slot.prune(now_ms);
            // Nobody goes ahead of the queue: with bids queued, the key goes to them.
            if !slot.queue_cleared(now_us, &mut tell.offered) {
                return GrantAnswer::Refused;
            }
            let free = match &slot.lease {
                // The key vanished since it was read (the recipe's "GETSET returned nil"): it is
                // free.
                None => true,
                Some(current) => current.lease.fence == seen && !current.is_live_at(now_ms),
            };
            // Otherwise someone else took it over or claimed it, or the holder renewed it.
            if !free || !slot.free_for(Kind::Exclusive, now_ms) {
                return GrantAnswer::Refused;
            }
            GrantAnswer::Granted(slot.grant(Kind::Exclusive, bid, now_us, false))
        }))
    }

    async fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<AsHolder<Released>> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        Ok(self.step("release", space, key, |slot, tell| {
            slot.prune(now_ms);
            let outcome = slot.release(token, now_ms);
            slot.hand_on(now_us, None, &mut tell.offered);
            outcome
        }))
    }

    async fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        how: Renewal,
    ) -> StoreResult<AsHolder<Lease>> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        Ok(self.step("renew", space, key, |slot, tell| {
            slot.prune(now_ms);
            let (outcome, shortened) = slot.renew(token, how, now_ms);
            // A renewal frees nothing, but the prune may have ended a lapsed offer.
            slot.hand_on(now_us, None, &mut tell.offered);
            if shortened && !slot.queue.is_empty() {
                // The queue's waiters were told the old end: they ask again at the new one.
                if let AsHolder::Done(lease) = &outcome {
                    tell.look_ms = Some(lease.ttl_ms);
                }
            }
            outcome
        }))
    }

    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> StoreResult<Join> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        let kind = kind_of(pool);
        Ok(self.step("join", pool.space(), key, |slot, tell| {
            slot.prune(now_ms);
            if let Pool::Semaphore { limit } = pool
                && let Some(used) = slot.limit_in_use()
                && used != limit
            {
                return Join::LimitMismatch { limit: used };
            }
            if let Some(lease) = slot.held_for(kind, bid, now_ms) {
                return Join::Granted(queue::answered(slot, bid, lease, now_us, tell));
            }
            let free = |s: &Slot| s.free_for(kind, now_ms);
            match queue::grant_or_queue(slot, kind, bid, now_us, free, tell) {
                Ok(lease) => Join::Granted(lease),
                Err(retry_after_ms) if bid.waits() => Join::Queued { retry_after_ms },
                Err(retry_after_ms) => Join::Busy { retry_after_ms },
            }
        }))
    }

    async fn leave(&self, space: Space, key: &LockKey, token: &Token) -> StoreResult<()> {
        traced("leave", space, key, || {
            let now_us = self.clock.now_us();
            let mut tell = Tell::default();
            {
                let mut slots = self.slots();
                // Cheap when nothing matches: no slot is made for a key that has none.
                if let Some(slot) = slots.get_mut(&(space, key.clone()))
                    && slot.leave(token)
                {
                    slot.prune(now_us / 1000);
                    slot.hand_on(now_us, None, &mut tell.offered);
                }
            }
            self.send(space, key, tell);
            Ok(())
        })
    }

    async fn permits(&self, key: &LockKey) -> StoreResult<Permits> {
        traced("permits", Space::Semaphores, key, || {
            let now_ms = self.clock.now_ms();
            let slots = self.slots();
            let slot = slots.get(&(Space::Semaphores, key.clone()));
            let holders: Vec<Lease> = slot
                .iter()
                .flat_map(|s| &s.holders)
                .filter(|h| h.lease.is_live_at(now_ms))
                .map(|h| h.lease.clone())
                .collect();
            Ok(Permits {
                now_ms,
                limit: slot.and_then(|s| s.limit).filter(|_| !holders.is_empty()),
                holders: sorted(holders),
            })
        })
    }

    async fn force_release(
        &self,
        space: Space,
        key: &LockKey,
    ) -> StoreResult<AsHolder<Vec<Fence>>> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        let ended = self.step("force", space, key, |slot, tell| {
            slot.prune(now_ms);
            // Offers too: they are live holders for everyone but the queue's own bids.
            let ended = slot.end_all(now_ms);
            slot.hand_on(now_us, None, &mut tell.offered);
            ended
        });
        if ended.is_empty() {
            return Ok(AsHolder::NotHeld);
        }
        Ok(AsHolder::Done(ended))
    }

    /// A cursor is the last key of the page before.
    fn cursor_pattern(&self) -> Option<&'static str> {
        Some(r"^[A-Za-z0-9._:-]{1,200}$")
    }

    async fn list(&self, query: &ListQuery) -> StoreResult<Page> {
        let now_ms = self.clock.now_ms();
        // The cursor is the last key of the page before: keys are listed in order.
        let after = match &query.cursor {
            None => None,
            Some(c) => Some(LockKey::parse(c).map_err(|_| super::StoreError::BadCursor)?),
        };
        let slots = self.slots();
        let mut found: Vec<Listed> = slots
            .iter()
            .filter(|((space, key), _)| {
                *space == query.space
                    && key.as_str().starts_with(&query.prefix)
                    && after.as_ref().is_none_or(|a| key > a)
            })
            .filter_map(|((space, key), slot)| {
                let mut holders: Vec<Lease> = slot
                    .holders
                    .iter()
                    .chain(&slot.lease)
                    .filter(|h| h.lease.is_live_at(now_ms))
                    .map(|h| h.lease.clone())
                    .collect();
                if holders.is_empty() {
                    return None;
                }
                holders.sort_by_key(|l| l.fence);
                let exclusive = slot.live_exclusive(now_ms).is_some();
                Some(Listed {
                    key: key.clone(),
                    mode: (*space == Space::Locks).then_some(if exclusive {
                        Mode::Exclusive
                    } else {
                        Mode::Shared
                    }),
                    limit: (*space == Space::Semaphores)
                        .then_some(slot.limit)
                        .flatten(),
                    holders,
                })
            })
            .collect();
        found.sort_by(|a, b| a.key.cmp(&b.key));
        let more = found.len() > query.limit;
        found.truncate(query.limit);
        Ok(Page {
            now_ms,
            next_cursor: more
                .then(|| found.last().map(|l| l.key.to_string()))
                .flatten(),
            entries: found,
        })
    }

    /// Never held: this store is the process's own memory, so it cannot lose leases while the
    /// broker runs.
    async fn ready(&self) -> StoreResult<Option<Hold>> {
        Ok(None)
    }

    fn start(&self, notices: mpsc::Sender<Notice>) {
        let _ = self.notices.set(notices);
    }

    async fn session(&self, id: &Token, op: SessionOp<'_>) -> StoreResult<Option<SessionRecord>> {
        Ok(self.sessions().call(id, op, self.clock.now_ms()))
    }
}

// The lock service's tests take their bids from here too.
#[cfg(test)]
pub(crate) mod tests;
