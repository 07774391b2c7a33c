//! The memory store's queue per key: the waiting bids in arrival order, strictly FIFO across
//! kinds, and the hand-on that offers what is free to the queue's head(s). The same rules as
//! the Redis store's scripts, for one broker: every offer's notice goes to the one broker, and
//! an offer that lapses ends and the key passes on to the next in line (with one broker, a lapse
//! means a waiter vanished between the notice and the take; its broker's other waiters are
//! alive, so they keep their places).

use super::Tell;
use super::slot::{QueuedBid, Slot, StoredLease};
use crate::domain::{Kind, Token};
use crate::store::{Bid, Lease};

/// How long an offer waits for its bid to take it (the Redis store uses its store timeout).
/// The broker that queued the bid is this process, so the take normally follows the notice at
/// once; the window only matters if the waiter vanished in between without leaving.
pub(crate) const OFFER_WINDOW_MS: u64 = 2_000;

impl Slot {
    /// The live lease the bid's token holds already (answered again), or the offer made to it,
    /// taken now: an ordinary lease from now on, for the bid's TTL from now, with the fence of
    /// the offer. Otherwise, the live lease an earlier acquire with the bid's request id
    /// produced (an offer never answers a request id: it is nobody's lease yet).
    pub(super) fn held_for(&mut self, kind: Kind, bid: &Bid, now_ms: u64) -> Option<Lease> {
        let leases = match kind {
            Kind::Exclusive => self.lease.as_mut_slice(),
            Kind::Shared | Kind::Semaphore { .. } => self.holders.as_mut_slice(),
        };
        let Some(held) = leases
            .iter_mut()
            .find(|h| h.lease.token == bid.token && h.is_live_at(now_ms))
        else {
            let id = bid.request_id.as_ref()?;
            return leases
                .iter()
                .find(|h| {
                    !h.offered && h.is_live_at(now_ms) && h.lease.request_id.as_ref() == Some(id)
                })
                .map(|h| h.lease.clone());
        };
        if !held.offered {
            return Some(held.lease.clone());
        }
        held.offered = false;
        held.granted_at_ms = now_ms;
        let ttl_ms = bid.lease_ttl().as_ms();
        held.lease.expires_at_ms = now_ms + ttl_ms;
        held.lease.ttl_ms = ttl_ms;
        let taken = held.lease.clone();
        self.keep_until(taken.expires_at_ms);
        Some(taken)
    }

    /// The semaphore limit in use: the live holders' (offers included), or else the queued
    /// bids'. A bid with another limit neither joins the holders nor the queue.
    pub(super) fn limit_in_use(&self) -> Option<u32> {
        self.limit.or_else(|| {
            self.queue.values().find_map(|e| match e.kind {
                Kind::Semaphore { limit } => Some(limit),
                Kind::Exclusive | Kind::Shared => None,
            })
        })
    }

    /// Whether a lease of `kind` could be granted now, queue aside: no live exclusive lease or
    /// offer (and, for an exclusive one, no live shared one), or a free permit. Expects the
    /// slot pruned at `now_ms`.
    pub(super) fn free_for(&self, kind: Kind, now_ms: u64) -> bool {
        match kind {
            Kind::Exclusive => self.live_exclusive(now_ms).is_none() && self.holders.is_empty(),
            Kind::Shared => self.live_exclusive(now_ms).is_none(),
            // The limit agrees with the holders' (checked when a bid joins); as the scripts do,
            // a permit never goes beside holders of another limit.
            Kind::Semaphore { limit } => {
                self.holders.len() < limit as usize && self.limit.is_none_or(|l| l == limit)
            }
        }
    }

    /// Writes a lease of `kind` for `bid`, offered (the offer window) or granted outright (its
    /// TTL), with the next fence. Expects `free_for(kind)`.
    pub(super) fn grant(&mut self, kind: Kind, bid: &Bid, now_us: u64, offer: bool) -> Lease {
        let now_ms = now_us / 1000;
        let mut held = self.lease_for(bid, now_us, offer.then_some(OFFER_WINDOW_MS));
        if let Kind::Semaphore { limit } = kind {
            held.lease.limit = Some(limit);
            self.limit = Some(limit);
        }
        let lease = held.lease.clone();
        match kind {
            // Over an expired lease, or none.
            Kind::Exclusive => self.lease = Some(held),
            Kind::Shared | Kind::Semaphore { .. } => {
                // An expired exclusive lease is no obstacle: shared holders replace it.
                self.lease.take_if(|h| !h.is_live_at(now_ms));
                self.holders.push(held);
            }
        }
        lease
    }

    /// Puts `bid` at the queue's tail, unless its token is queued already (then it keeps its
    /// place and its first deadline).
    pub(super) fn enqueue(&mut self, kind: Kind, bid: &Bid, now_ms: u64) {
        if self.queued.contains_key(&bid.token) {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let deadline_ms = now_ms.saturating_add(bid.wait_ms);
        self.queued.insert(bid.token.clone(), seq);
        self.queue.insert(
            seq,
            QueuedBid {
                bid: bid.clone(),
                kind,
                deadline_ms,
            },
        );
        self.keep_until(deadline_ms);
    }

    /// Drops the heads whose deadline has passed; after it, the queue is empty or its head
    /// still waits. Entries further back are dropped when they come to the head.
    pub(super) fn drop_dead_heads(&mut self, now_ms: u64) {
        while let Some(head) = self.queue.first_entry() {
            if head.get().deadline_ms > now_ms {
                break;
            }
            let entry = head.remove();
            self.queued.remove(&entry.bid.token);
        }
    }

    /// Hands what is free on to the queue's head(s), in order: an exclusive head gets the key
    /// when nothing live is in it; consecutive shared heads get shared leases while no
    /// exclusive lease or offer is live; semaphore heads get permits while there is room. The
    /// walk stops at the first head that cannot be served, so nobody goes ahead of it.
    ///
    /// Each head is *offered* its lease (its token is pushed to `offered`, for the notice),
    /// except `caller`'s own entry: the bid asking now is granted outright (no notice round),
    /// and that lease is returned. Expects the slot pruned at `now_us`.
    pub(super) fn hand_on(
        &mut self,
        now_us: u64,
        caller: Option<&Bid>,
        offered: &mut Vec<Token>,
    ) -> Option<Lease> {
        let now_ms = now_us / 1000;
        let mut granted = None;
        loop {
            self.drop_dead_heads(now_ms);
            match self.queue.values().next() {
                Some(head) if self.free_for(head.kind, now_ms) => {}
                _ => break,
            }
            let Some((_, head)) = self.queue.pop_first() else {
                break;
            };
            self.queued.remove(&head.bid.token);
            match caller.filter(|c| c.token == head.bid.token) {
                Some(bid) => granted = Some(self.grant(head.kind, bid, now_us, false)),
                None => {
                    self.grant(head.kind, &head.bid, now_us, true);
                    offered.push(head.bid.token);
                }
            }
        }
        granted
    }

    /// For a bid that does not wait: hands what is free on to the queued bids, and says
    /// whether none is left waiting (only then may the bid be granted).
    pub(super) fn queue_cleared(&mut self, now_us: u64, offered: &mut Vec<Token>) -> bool {
        if !self.queue.is_empty() {
            self.hand_on(now_us, None, offered);
        }
        self.queue.is_empty()
    }

    /// `token` stops waiting: its queue entry goes, and an offer made to it and not taken
    /// ends. A lease it took is left alone. Whether anything changed.
    pub(super) fn leave(&mut self, token: &Token) -> bool {
        let mut changed = false;
        if let Some(seq) = self.queued.remove(token) {
            self.queue.remove(&seq);
            changed = true;
        }
        let offered_to = |h: &StoredLease| h.offered && h.lease.token == *token;
        if self.lease.take_if(|h| offered_to(h)).is_some() {
            changed = true;
        }
        let before = self.holders.len();
        self.holders.retain(|h| !offered_to(h));
        if self.holders.len() < before {
            changed = true;
            if self.holders.is_empty() {
                self.limit = None;
            }
        }
        changed
    }

    /// How long a bid of `kind` that was not granted may wait before something changes: until
    /// the live exclusive lease (or offer) ends; for an exclusive or shared bid behind shared
    /// holders, until the last of them ends; for a permit, until the first permit ends. At
    /// least 1.
    pub(super) fn retry_after(&self, kind: Kind, now_ms: u64) -> u64 {
        let ends = self.holders.iter().map(|h| h.lease.expires_at_ms);
        let end = match kind {
            Kind::Exclusive | Kind::Shared => self
                .live_exclusive(now_ms)
                .map(|h| h.lease.expires_at_ms)
                .or_else(|| ends.max()),
            Kind::Semaphore { .. } => ends.min(),
        };
        end.map_or(1, |end| end.saturating_sub(now_ms).max(1))
    }
}

#[cfg(test)]
mod tests;

/// `lease`, which answers `bid`: its own, or the one an earlier acquire with its request
/// id produced — then the bid, answered, leaves the queue if it was in it, so that nothing
/// is offered to a token nobody waits on.
pub(super) fn answered(
    slot: &mut Slot,
    bid: &Bid,
    lease: Lease,
    now_us: u64,
    tell: &mut Tell,
) -> Lease {
    if lease.token != bid.token && slot.leave(&bid.token) {
        slot.hand_on(now_us, None, &mut tell.offered);
    }
    lease
}

/// A claim or a join, once the slot is pruned: a waiting bid is granted if it is the
/// queue's head (or the queue is empty) and the key is free for it, else it joins the
/// queue (or keeps its place) and is answered `Err(retry_after_ms)`. A bid that does not
/// wait never goes ahead of the queue: what is free is handed on to the queued bids first,
/// and while some still wait it is refused (`Err`); otherwise it is granted if `free`.
pub(super) fn grant_or_queue(
    slot: &mut Slot,
    kind: Kind,
    bid: &Bid,
    now_us: u64,
    free: impl FnOnce(&Slot) -> bool,
    tell: &mut Tell,
) -> Result<Lease, u64> {
    let now_ms = now_us / 1000;
    if bid.waits() {
        slot.enqueue(kind, bid, now_ms);
        return slot
            .hand_on(now_us, Some(bid), &mut tell.offered)
            .ok_or_else(|| slot.retry_after(kind, now_ms));
    }
    if !slot.queue_cleared(now_us, &mut tell.offered) || !free(slot) {
        return Err(slot.retry_after(kind, now_ms));
    }
    Ok(slot.grant(kind, bid, now_us, false))
}
