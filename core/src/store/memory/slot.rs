//! One key's state in the memory store: its exclusive lease, its shared leases or permits (each
//! either taken or offered to a queued bid), its queue of waiting bids and its fence counter,
//! with what a release and a renewal do to them. What the queue does — joining, offering,
//! taking, leaving — is in `queue.rs`.

use std::collections::{BTreeMap, HashMap};

use crate::domain::{Fence, Kind, LockKey, Space, Token};
use crate::store::{AsHolder, Bid, EXPIRY_SLACK_MS, Lease, Released, Renewal};

/// A lease with when it was granted (for the hold time reported on release).
#[derive(Debug, Clone)]
pub(super) struct StoredLease {
    pub(super) lease: Lease,
    pub(super) granted_at_ms: u64,
    /// Offered to a queued bid and not taken yet: `lease.expires_at_ms` is the offer's end and
    /// `lease.ttl_ms` the bid's TTL. Live for everyone else (nobody is granted over it), but not
    /// a lease its token holds: only taking it (the bid asking again) or leaving ends the mark.
    pub(super) offered: bool,
}

impl StoredLease {
    pub(super) fn is_live_at(&self, now_ms: u64) -> bool {
        self.lease.is_live_at(now_ms)
    }

    /// A live lease `token` holds: taken, not merely offered to it.
    fn held_by(&self, token: &Token, now_ms: u64) -> bool {
        !self.offered && self.lease.token == *token && self.is_live_at(now_ms)
    }
}

/// A bid waiting in a key's queue.
#[derive(Debug, Clone)]
pub(super) struct QueuedBid {
    pub(super) bid: Bid,
    pub(super) kind: Kind,
    /// When it stops waiting, on the store's clock: now + `wait_ms` when it first joined. A
    /// head whose deadline passed is dropped, never offered.
    pub(super) deadline_ms: u64,
}

/// One key's state in one space: its leases, its queue and its fence counter.
#[derive(Debug, Default)]
pub(super) struct Slot {
    /// A lock's exclusive lease (live or expired; an offer that lapsed is dropped as it is met).
    pub(super) lease: Option<StoredLease>,
    /// A lock's shared leases, or a semaphore's permits (expired ones and lapsed offers dropped
    /// as they are met).
    pub(super) holders: Vec<StoredLease>,
    /// The limit a semaphore's holders took their permits with.
    pub(super) limit: Option<u32>,
    /// The waiting bids by arrival: a sequence number, never reused in the slot's life, orders
    /// them (a BTreeMap, not a VecDeque: leaving from the middle costs log n, not n).
    pub(super) queue: BTreeMap<u64, QueuedBid>,
    /// Where each queued token is in `queue`.
    pub(super) queued: HashMap<Token, u64>,
    /// The sequence number the next bid to join gets.
    pub(super) next_seq: u64,
    /// The last fence granted for this key.
    pub(super) fence: Fence,
    /// When the slot may be dropped (the Redis store's key expiry): the fence counter goes with
    /// it and is seeded again from the clock, which keeps fences rising (see `next_fence`).
    pub(super) drop_at_ms: u64,
}

impl Slot {
    /// Drops the holders that have ended by `now_ms` and the offers that lapsed (offered, not
    /// taken within the window: the key passes on, by the hand-on that follows). An expired
    /// exclusive lease that was taken stays, for the takeover recipe to find.
    pub(super) fn prune(&mut self, now_ms: u64) {
        self.holders.retain(|h| h.is_live_at(now_ms));
        if self.holders.is_empty() {
            self.limit = None;
        }
        self.lease.take_if(|h| h.offered && !h.is_live_at(now_ms));
    }

    /// The live exclusive lease, taken or offered.
    pub(super) fn live_exclusive(&self, now_ms: u64) -> Option<&StoredLease> {
        self.lease.as_ref().filter(|h| h.is_live_at(now_ms))
    }

    /// Takes the next fence and makes the lease for `bid`, keeping the slot until it ends. An
    /// offer ends after the offer window, with the bid's TTL kept for the take.
    pub(super) fn lease_for(
        &mut self,
        bid: &Bid,
        now_us: u64,
        offer_ms: Option<u64>,
    ) -> StoredLease {
        let now_ms = now_us / 1000;
        self.fence = next_fence((self.fence > 0).then_some(self.fence), now_us);
        let ttl_ms = bid.lease_ttl().as_ms();
        let lease = Lease {
            token: bid.token.clone(),
            fence: self.fence,
            expires_at_ms: now_ms + offer_ms.unwrap_or(ttl_ms),
            ttl_ms,
            owner: bid.owner.clone(),
            request_id: bid.request_id.clone(),
            limit: None,
        };
        self.keep_until(lease.expires_at_ms);
        StoredLease {
            lease,
            granted_at_ms: now_ms,
            offered: offer_ms.is_some(),
        }
    }

    pub(super) fn keep_until(&mut self, expires_at_ms: u64) {
        self.drop_at_ms = self
            .drop_at_ms
            .max(expires_at_ms.saturating_add(EXPIRY_SLACK_MS));
    }

    /// Ends `token`'s live lease (exclusive or among the holders). An offer its token has not
    /// taken is not its lease: "not owner", as for anyone else's (only `leave` ends it).
    pub(super) fn release(&mut self, token: &Token, now_ms: u64) -> AsHolder<Released> {
        let held_ms = |h: &StoredLease| Released {
            held_ms: now_ms.saturating_sub(h.granted_at_ms),
        };
        if let Some(held) = self.live_exclusive(now_ms) {
            if !held.held_by(token, now_ms) {
                return AsHolder::NotOwner;
            }
            let done = held_ms(held);
            self.lease = None;
            return AsHolder::Done(done);
        }
        match self.holders.iter().position(|h| h.held_by(token, now_ms)) {
            Some(i) => AsHolder::Done(held_ms(&self.holders.remove(i))),
            None if self.holders.is_empty() => AsHolder::NotHeld,
            None => AsHolder::NotOwner,
        }
    }

    /// Moves the end of `token`'s live lease; the outcome, and whether it now ends sooner.
    pub(super) fn renew(
        &mut self,
        token: &Token,
        how: Renewal,
        now_ms: u64,
    ) -> (AsHolder<Lease>, bool) {
        let exclusive = self.live_exclusive(now_ms).is_some();
        let held = if exclusive {
            self.lease.as_mut().filter(|h| h.held_by(token, now_ms))
        } else {
            self.holders.iter_mut().find(|h| h.held_by(token, now_ms))
        };
        let Some(held) = held else {
            let anyone = exclusive || !self.holders.is_empty();
            return (
                if anyone {
                    AsHolder::NotOwner
                } else {
                    AsHolder::NotHeld
                },
                false,
            );
        };
        let lease = &mut held.lease;
        let under_session = lease
            .owner
            .as_ref()
            .is_some_and(|o| o.session_delay_ms().is_some());
        let ends = match how {
            // A lease under a session ends with its session: a renewal by token leaves it.
            Renewal::For(_) if under_session => lease.expires_at_ms,
            Renewal::For(ttl) => now_ms + ttl.as_ms(),
            Renewal::Until(ends) => ends.max(lease.expires_at_ms),
        };
        let shortened = ends < lease.expires_at_ms;
        if ends != lease.expires_at_ms || !under_session {
            lease.ttl_ms = ends - now_ms;
        }
        lease.expires_at_ms = ends;
        let renewed = lease.clone();
        self.keep_until(renewed.expires_at_ms);
        (AsHolder::Done(renewed), shortened)
    }

    /// Ends every live lease, offers included; their fences.
    pub(super) fn end_all(&mut self, now_ms: u64) -> Vec<Fence> {
        let mut ended: Vec<Fence> = self.holders.drain(..).map(|h| h.lease.fence).collect();
        if let Some(held) = self.lease.take_if(|h| h.is_live_at(now_ms)) {
            ended.push(held.lease.fence);
        }
        self.limit = None;
        ended
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

/// Several keys in one step (`Store::claim_all`): an exclusive lease on every key of `keys` for
/// `bid` if each is free as Redis's CLAIM_ALL finds a key free — no lease (live or expired),
/// nobody sharing it or queued for it — else nothing.
pub(super) fn grant_all(
    slots: &mut HashMap<(Space, LockKey), Slot>,
    keys: &[LockKey],
    bid: &Bid,
    now_us: u64,
) -> Option<Vec<Lease>> {
    let now_ms = now_us / 1000;
    let free = |slot: &Slot| {
        slot.lease.is_none()
            && slot.queue.is_empty()
            && !slot.holders.iter().any(|h| h.is_live_at(now_ms))
    };
    let all_free = keys
        .iter()
        .all(|key| slots.get(&(Space::Locks, key.clone())).is_none_or(free));
    if !all_free {
        return None;
    }
    let leases = keys.iter().map(|key| {
        let slot = slots.entry((Space::Locks, key.clone())).or_default();
        slot.prune(now_ms);
        slot.grant(Kind::Exclusive, bid, now_us, false)
    });
    Some(leases.collect())
}
