//! The embedded store: the same primitives as Redis, in one process. Correct for a single
//! broker; brokers do not share it.

pub mod clock;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::mpsc;

use self::clock::{Clock, SystemClock};
use super::{
    Bid, EXPIRY_SLACK_MS, Grant, Hold, Holder, Lease, Notice, Released, Snapshot, Store,
    StoreResult,
};
use crate::domain::{Fence, LockKey, Token, Ttl};

/// One key's state: its lease, if any, and its fence counter.
#[derive(Debug)]
struct Slot {
    lease: Option<Lease>,
    /// The last fence granted for this key.
    fence: Fence,
    /// When the current lease was granted (for the hold time reported on release).
    granted_at_ms: u64,
    /// When the slot may be dropped (the Redis store's key expiry): the fence counter goes with
    /// it and is seeded again from the clock, which keeps fences rising (see `next_fence`).
    drop_at_ms: u64,
}

/// The in-memory store.
#[derive(Clone)]
pub struct MemoryStore {
    /// A std Mutex, not a tokio one: nothing awaits while holding it, and every critical section
    /// is a few map operations.
    slots: Arc<Mutex<HashMap<LockKey, Slot>>>,
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
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            slots: Arc::default(),
            clock,
            notices: Arc::default(),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<LockKey, Slot>> {
        // A panic while holding the lock cannot leave a slot half-written (each write is one
        // assignment), so a poisoned map is still consistent.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the slots whose keys Redis would have expired by now. Returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        let mut slots = self.slots();
        let before = slots.len();
        slots.retain(|_, slot| slot.drop_at_ms > now);
        before - slots.len()
    }

    /// Deletes `key` outright, as Redis does when the key's own expiry passes or someone runs
    /// DEL on it: the lease and the fence counter both go.
    pub fn evict(&self, key: &LockKey) {
        self.slots().remove(key);
    }

    /// How many keys the store keeps (live, expired or only a fence counter).
    pub fn len(&self) -> usize {
        self.slots().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells the waiters that `key` may be free earlier than they were told. Called after the
    /// slots' lock is released.
    fn notify(&self, key: &LockKey) {
        if let Some(notices) = self.notices.get() {
            // A full channel drops the notice; waiters also wake on their own timers.
            let _ = notices.try_send(Notice::Released(key.clone()));
        }
    }

    /// Writes the bid into `slot` as its new lease, with the next fence.
    fn grant(&self, slot: Option<&mut Slot>, bid: &Bid, now_us: u64) -> (Slot, Lease) {
        let now_ms = now_us / 1000;
        let fence = next_fence(slot.as_ref().map(|s| s.fence), now_us);
        let lease = Lease {
            token: bid.token.clone(),
            fence,
            expires_at_ms: now_ms + bid.ttl.as_ms(),
            ttl_ms: bid.ttl.as_ms(),
            owner: bid.owner.clone(),
            request_id: bid.request_id.clone(),
        };
        let new = Slot {
            lease: Some(lease.clone()),
            fence,
            granted_at_ms: now_ms,
            drop_at_ms: lease.expires_at_ms + EXPIRY_SLACK_MS,
        };
        (new, lease)
    }
}

/// The fence after `last`, never below the clock in microseconds: a key with no counter (new,
/// or dropped after its leases ended) starts from the clock, which is above any fence the key
/// had before as long as it never saw more than one grant per microsecond on average — the
/// Redis store does the same, so fences keep rising across a broker restart (here) or a store
/// that lost or rolled back its data (there).
fn next_fence(last: Option<Fence>, now_us: u64) -> Fence {
    last.map_or(1, |l| l + 1).max(now_us)
}

impl Store for MemoryStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<Grant> {
        let now_us = self.clock.now_us();
        let mut slots = self.slots();
        let slot = slots.get_mut(key);
        if let Some(current) = slot.as_ref().and_then(|s| s.lease.as_ref()) {
            let repeated = bid.request_id.is_some()
                && current.request_id == bid.request_id
                && current.is_live_at(now_us / 1000);
            return Ok(if repeated {
                Grant::Granted(current.clone())
            } else {
                Grant::Refused
            });
        }
        let (new, lease) = self.grant(slot, bid, now_us);
        slots.insert(key.clone(), new);
        Ok(Grant::Granted(lease))
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        let now_ms = self.clock.now_ms();
        let slots = self.slots();
        Ok(Snapshot {
            now_ms,
            lease: slots.get(key).and_then(|s| s.lease.clone()),
        })
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<Grant> {
        let now_us = self.clock.now_us();
        let now_ms = now_us / 1000;
        let mut slots = self.slots();
        let slot = slots.get_mut(key);
        match slot.as_ref().and_then(|s| s.lease.as_ref()) {
            // The key vanished since it was read (the recipe's "GETSET returned nil"): it is free.
            None => {}
            Some(current) if current.fence == seen && !current.is_live_at(now_ms) => {}
            // Someone else took it over or claimed it, or the holder renewed it.
            Some(_) => return Ok(Grant::Refused),
        }
        let (new, lease) = self.grant(slot, bid, now_us);
        slots.insert(key.clone(), new);
        Ok(Grant::Granted(lease))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> StoreResult<Holder<Released>> {
        let outcome = self.release_now(key, token);
        if matches!(outcome, Holder::Done(_)) {
            self.notify(key);
        }
        Ok(outcome)
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Ttl) -> StoreResult<Holder<Lease>> {
        let (outcome, shortened) = self.renew_now(key, token, ttl);
        if shortened {
            self.notify(key);
        }
        Ok(outcome)
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

impl MemoryStore {
    fn release_now(&self, key: &LockKey, token: &Token) -> Holder<Released> {
        let now_ms = self.clock.now_ms();
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(key) else {
            return Holder::NotHeld;
        };
        match &slot.lease {
            None => Holder::NotHeld,
            Some(lease) if !lease.is_live_at(now_ms) => Holder::NotHeld,
            Some(lease) if lease.token != *token => Holder::NotOwner,
            Some(_) => {
                slot.lease = None;
                Holder::Done(Released {
                    held_ms: now_ms.saturating_sub(slot.granted_at_ms),
                })
            }
        }
    }

    /// The outcome, and whether the lease now ends sooner than it did.
    fn renew_now(&self, key: &LockKey, token: &Token, ttl: Ttl) -> (Holder<Lease>, bool) {
        let now_ms = self.clock.now_ms();
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(key) else {
            return (Holder::NotHeld, false);
        };
        match &mut slot.lease {
            None => (Holder::NotHeld, false),
            Some(lease) if !lease.is_live_at(now_ms) => (Holder::NotHeld, false),
            Some(lease) if lease.token != *token => (Holder::NotOwner, false),
            Some(lease) => {
                let shortened = now_ms + ttl.as_ms() < lease.expires_at_ms;
                lease.expires_at_ms = now_ms + ttl.as_ms();
                lease.ttl_ms = ttl.as_ms();
                slot.drop_at_ms = lease.expires_at_ms + EXPIRY_SLACK_MS;
                (Holder::Done(lease.clone()), shortened)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::clock::ManualClock;
    use super::*;

    fn bid(ttl: u64) -> Bid {
        Bid {
            token: Token::generate(),
            ttl: Ttl::from_ms(ttl),
            owner: None,
            request_id: None,
        }
    }

    #[tokio::test]
    async fn sweep_drops_keys_only_after_the_expiry_slack() {
        let clock = ManualClock::starting_at_ms(1_000_000);
        let store = MemoryStore::new(Arc::new(clock.clone()));
        let key = LockKey::parse("k").unwrap();
        let Grant::Granted(first) = store.claim(&key, &bid(100)).await.unwrap() else {
            panic!("a free key must be granted");
        };
        clock.advance_ms(100 + EXPIRY_SLACK_MS - 1);
        assert_eq!(store.sweep(), 0);
        clock.advance_ms(1);
        assert_eq!(store.sweep(), 1);
        assert!(store.is_empty());
        // The counter went with the slot; the next fence is seeded from the clock, still above.
        let Grant::Granted(second) = store.claim(&key, &bid(100)).await.unwrap() else {
            panic!("a swept key must be free");
        };
        assert!(second.fence > first.fence);
    }
}
