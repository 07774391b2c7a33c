//! The embedded store: the same primitives as Redis, in one process. Correct for a single
//! broker; brokers do not share it.

pub(crate) mod clock;
mod slot;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::mpsc;

use self::clock::{Clock, SystemClock};
use self::slot::Slot;
use super::{
    Bid, GrantAnswer, Hold, Holder, Join, Lease, ListQuery, Listed, Mode, Notice, Page, Permits,
    Pool, Released, Snapshot, Space, Store, StoreResult, WRITER_INTENT_MS,
};
use crate::domain::{Fence, LockKey, Token, Ttl};

/// The in-memory store.
#[derive(Clone)]
pub(crate) struct MemoryStore {
    /// A std Mutex, not a tokio one: nothing awaits while holding it, and every critical section
    /// is a few map operations.
    slots: Arc<Mutex<HashMap<(Space, LockKey), Slot>>>,
    clock: Arc<dyn Clock>,
    /// Where release notices go: the one broker's lock service.
    notices: Arc<OnceLock<mpsc::Sender<Notice>>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock::default()))
    }
}

impl MemoryStore {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            slots: Arc::default(),
            clock,
            notices: Arc::default(),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<(Space, LockKey), Slot>> {
        // A panic while holding the lock cannot leave a slot half-written (each write is one
        // assignment), so a poisoned map is still consistent.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the slot of `key` in `space`, made if missing (an empty slot is dropped by the
    /// next sweep, as Redis drops nothing it did not write).
    fn with_slot<T>(&self, space: Space, key: &LockKey, f: impl FnOnce(&mut Slot) -> T) -> T {
        let mut slots = self.slots();
        f(slots.entry((space, key.clone())).or_default())
    }

    /// Drops the slots whose keys Redis would have expired by now. Returns how many were dropped.
    pub(crate) fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        let mut slots = self.slots();
        let before = slots.len();
        slots.retain(|_, slot| slot.drop_at_ms > now);
        before - slots.len()
    }

    /// Deletes the lock `key` outright, as Redis does when the key's own expiry passes or
    /// someone runs DEL on it: the leases and the fence counter all go.
    #[cfg(test)]
    pub(crate) fn evict(&self, key: &LockKey) {
        self.slots().remove(&(Space::Locks, key.clone()));
    }

    /// Tells the waiters that `key` may be free earlier than they were told. Called after the
    /// slots' lock is released.
    fn notify(&self, space: Space, key: &LockKey) {
        if let Some(notices) = self.notices.get() {
            // A full channel drops the notice; waiters also wake on their own timers.
            let _ = notices.try_send(Notice::Released(space, key.clone()));
        }
    }

    /// Grants `bid` the exclusive lease in `slot` unless shared leases are live; otherwise
    /// records its intent if it waits.
    fn grant_exclusive(slot: &mut Slot, bid: &Bid, now_us: u64) -> GrantAnswer {
        let now_ms = now_us / 1000;
        slot.prune(now_ms);
        if !slot.holders.is_empty() {
            if bid.waits() {
                slot.intents.retain(|(t, _)| *t != bid.token);
                slot.intents
                    .push((bid.token.clone(), now_ms + WRITER_INTENT_MS));
                slot.keep_until(now_ms + WRITER_INTENT_MS);
            }
            return GrantAnswer::Refused;
        }
        slot.intents.retain(|(t, _)| *t != bid.token);
        let held = slot.lease_for(bid, now_us);
        let lease = held.lease.clone();
        slot.lease = Some(held);
        GrantAnswer::Granted(lease)
    }
}

fn sorted(mut holders: Vec<Lease>) -> Vec<Lease> {
    holders.sort_by_key(|l| l.fence);
    holders
}

impl Store for MemoryStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<GrantAnswer> {
        let now_us = self.clock.now_us();
        Ok(self.with_slot(Space::Locks, key, |slot| {
            if let Some(current) = &slot.lease {
                let repeated = bid.request_id.is_some()
                    && current.lease.request_id == bid.request_id
                    && current.lease.is_live_at(now_us / 1000);
                return if repeated {
                    GrantAnswer::Granted(current.lease.clone())
                } else {
                    GrantAnswer::Refused
                };
            }
            Self::grant_exclusive(slot, bid, now_us)
        }))
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
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
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<GrantAnswer> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        Ok(self.with_slot(Space::Locks, key, |slot| {
            match &slot.lease {
                // The key vanished since it was read (the recipe's "GETSET returned nil"): it is
                // free.
                None => {}
                Some(current)
                    if current.lease.fence == seen && !current.lease.is_live_at(now_ms) => {}
                // Someone else took it over or claimed it, or the holder renewed it.
                Some(_) => return GrantAnswer::Refused,
            }
            Self::grant_exclusive(slot, bid, now_us)
        }))
    }

    async fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> StoreResult<Holder<Released>> {
        let now_ms = self.clock.now_ms();
        let outcome = self.with_slot(space, key, |slot| slot.release(token, now_ms));
        if matches!(outcome, Holder::Done(_)) {
            self.notify(space, key);
        }
        Ok(outcome)
    }

    async fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        ttl: Ttl,
    ) -> StoreResult<Holder<Lease>> {
        let now_ms = self.clock.now_ms();
        let (outcome, shortened) =
            self.with_slot(space, key, |slot| slot.renew(token, ttl, now_ms));
        if shortened {
            self.notify(space, key);
        }
        Ok(outcome)
    }

    async fn join(&self, key: &LockKey, pool: Pool, bid: &Bid) -> StoreResult<Join> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        Ok(self.with_slot(pool.space(), key, |slot| {
            slot.prune(now_ms);
            if let Pool::Semaphore { limit } = pool
                && let Some(used) = slot.limit
                && used != limit
            {
                return Join::LimitMismatch { limit: used };
            }
            if let Some(id) = &bid.request_id
                && let Some(again) = slot
                    .holders
                    .iter()
                    .find(|h| h.lease.request_id.as_ref() == Some(id))
            {
                return Join::Granted(again.lease.clone());
            }
            match pool {
                Pool::Shared => {
                    if let Some(held) = slot.live_exclusive(now_ms) {
                        return Join::Busy {
                            retry_after_ms: held.lease.expires_at_ms - now_ms,
                        };
                    }
                    if !slot.intents.is_empty() {
                        return Join::Busy {
                            retry_after_ms: Slot::soonest(
                                slot.intents.iter().map(|(_, end)| *end),
                                now_ms,
                            ),
                        };
                    }
                    // An expired exclusive lease is no obstacle: shared holders replace it.
                    slot.lease = None;
                }
                Pool::Semaphore { limit } => {
                    if slot.holders.len() >= limit as usize {
                        return Join::Busy {
                            retry_after_ms: Slot::soonest(
                                slot.holders.iter().map(|h| h.lease.expires_at_ms),
                                now_ms,
                            ),
                        };
                    }
                    slot.limit = Some(limit);
                }
            }
            let mut held = slot.lease_for(bid, now_us);
            if let Pool::Semaphore { limit } = pool {
                held.lease.limit = Some(limit);
            }
            let lease = held.lease.clone();
            slot.holders.push(held);
            Join::Granted(lease)
        }))
    }

    async fn leave(&self, _space: Space, _key: &LockKey, _token: &Token) -> StoreResult<()> {
        // Transitional, until the queue lands: nothing is queued in the store yet.
        Ok(())
    }

    async fn permits(&self, key: &LockKey) -> StoreResult<Permits> {
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
    }

    async fn force_release(&self, space: Space, key: &LockKey) -> StoreResult<Holder<Vec<Fence>>> {
        let now_ms = self.clock.now_ms();
        let ended = self.with_slot(space, key, |slot| {
            slot.prune(now_ms);
            let mut ended: Vec<Fence> = slot.holders.drain(..).map(|h| h.lease.fence).collect();
            if let Some(held) = slot.lease.take_if(|h| h.lease.is_live_at(now_ms)) {
                ended.push(held.lease.fence);
            }
            slot.limit = None;
            ended
        });
        if ended.is_empty() {
            return Ok(Holder::NotHeld);
        }
        self.notify(space, key);
        Ok(Holder::Done(ended))
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
}

#[cfg(test)]
mod tests;
