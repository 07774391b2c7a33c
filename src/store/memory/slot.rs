//! One key's state in the memory store: its exclusive lease, its shared leases or permits, the
//! waiting exclusive bids' intents and its fence counter, with what a grant, a release and a
//! renewal do to them.

use crate::domain::{Fence, Token, Ttl};
use crate::store::{Bid, EXPIRY_SLACK_MS, Holder, Lease, Released};

/// A lease with when it was granted (for the hold time reported on release).
#[derive(Debug, Clone)]
pub(super) struct StoredLease {
    pub(super) lease: Lease,
    pub(super) granted_at_ms: u64,
}

/// One key's state in one space: its leases and its fence counter.
#[derive(Debug, Default)]
pub(super) struct Slot {
    /// A lock's exclusive lease (live or expired).
    pub(super) lease: Option<StoredLease>,
    /// A lock's shared leases, or a semaphore's permits (expired ones dropped as they are met).
    pub(super) holders: Vec<StoredLease>,
    /// The limit a semaphore's holders took their permits with.
    pub(super) limit: Option<u32>,
    /// Waiting exclusive bids' intents: token and end (see [`Bid::waits`]).
    pub(super) intents: Vec<(Token, u64)>,
    /// The last fence granted for this key.
    pub(super) fence: Fence,
    /// When the slot may be dropped (the Redis store's key expiry): the fence counter goes with
    /// it and is seeded again from the clock, which keeps fences rising (see `next_fence`).
    pub(super) drop_at_ms: u64,
}

impl Slot {
    /// Drops the holders and intents that have ended by `now_ms`.
    pub(super) fn prune(&mut self, now_ms: u64) {
        self.holders.retain(|h| h.lease.is_live_at(now_ms));
        self.intents.retain(|(_, end)| *end > now_ms);
        if self.holders.is_empty() {
            self.limit = None;
        }
    }

    pub(super) fn live_exclusive(&self, now_ms: u64) -> Option<&StoredLease> {
        self.lease.as_ref().filter(|h| h.lease.is_live_at(now_ms))
    }

    /// Takes the next fence and makes the lease for `bid`, keeping the slot until it ends.
    pub(super) fn lease_for(&mut self, bid: &Bid, now_us: u64) -> StoredLease {
        let now_ms = now_us / 1000;
        self.fence = next_fence((self.fence > 0).then_some(self.fence), now_us);
        let lease = Lease {
            token: bid.token.clone(),
            fence: self.fence,
            expires_at_ms: now_ms + bid.ttl.as_ms(),
            ttl_ms: bid.ttl.as_ms(),
            owner: bid.owner.clone(),
            request_id: bid.request_id.clone(),
            limit: None,
        };
        self.keep_until(lease.expires_at_ms);
        StoredLease {
            lease,
            granted_at_ms: now_ms,
        }
    }

    pub(super) fn keep_until(&mut self, expires_at_ms: u64) {
        self.drop_at_ms = self.drop_at_ms.max(expires_at_ms + EXPIRY_SLACK_MS);
    }

    /// The ms until something may change for a refused bid: the earliest end among `ends`.
    pub(super) fn soonest(ends: impl Iterator<Item = u64>, now_ms: u64) -> u64 {
        ends.min().map_or(0, |end| end.saturating_sub(now_ms))
    }

    /// Ends `token`'s live lease (exclusive or among the holders).
    pub(super) fn release(&mut self, token: &Token, now_ms: u64) -> Holder<Released> {
        self.prune(now_ms);
        let held_ms = |h: &StoredLease| Released {
            held_ms: now_ms.saturating_sub(h.granted_at_ms),
        };
        if let Some(held) = self.live_exclusive(now_ms) {
            if held.lease.token != *token {
                return Holder::NotOwner;
            }
            let done = held_ms(held);
            self.lease = None;
            return Holder::Done(done);
        }
        match self.holders.iter().position(|h| h.lease.token == *token) {
            Some(i) => Holder::Done(held_ms(&self.holders.remove(i))),
            None if self.holders.is_empty() => Holder::NotHeld,
            None => Holder::NotOwner,
        }
    }

    /// Moves the end of `token`'s live lease; the outcome, and whether it now ends sooner.
    pub(super) fn renew(&mut self, token: &Token, ttl: Ttl, now_ms: u64) -> (Holder<Lease>, bool) {
        self.prune(now_ms);
        let exclusive = self
            .lease
            .as_ref()
            .is_some_and(|h| h.lease.is_live_at(now_ms));
        let held = if exclusive {
            self.lease.as_mut().filter(|h| h.lease.token == *token)
        } else {
            self.holders.iter_mut().find(|h| h.lease.token == *token)
        };
        let Some(held) = held else {
            let anyone = exclusive || !self.holders.is_empty();
            return (
                if anyone {
                    Holder::NotOwner
                } else {
                    Holder::NotHeld
                },
                false,
            );
        };
        let lease = &mut held.lease;
        let shortened = now_ms + ttl.as_ms() < lease.expires_at_ms;
        lease.expires_at_ms = now_ms + ttl.as_ms();
        lease.ttl_ms = ttl.as_ms();
        let renewed = lease.clone();
        self.keep_until(renewed.expires_at_ms);
        (Holder::Done(renewed), shortened)
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
