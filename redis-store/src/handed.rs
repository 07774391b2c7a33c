//! Grants a release made straight to this broker's own queued bids.
//!
//! A contended key is handed on by the call that frees it. To another broker's bid it is
//! offered (a lease record for the offer window and a notice; that broker's waiter takes it with
//! a second call), so that a broker that died does not keep the key for a whole TTL. To a bid of
//! the releasing broker itself there is nobody to tell and nothing to lapse: RELEASE grants it
//! outright (`hand_on` in `lib/queue.lua`, kind `g`) and its reply carries the grant. The broker
//! records it in its ledger at once, as any grant's answer (a grant that raced a loss is put back
//! on its own, see [`EpochKeeper::remember`]), keeps it here, and tells the waiter as an offer is
//! told; the waiter's ask then takes the lease from here without a store call. A hot key held in
//! turn by one broker's clients so costs two script calls per acquisition, not three.
//!
//! A grant here whose waiter has gone (its notice found nobody, so the store is asked to
//! [`leave`](lockbroker_core::store::Store::leave)) is released, which hands the key on again.
//! A grant taken from here is answered only while the ledger still holds it (a force release or a
//! refused put-back in between ends it there), its lease has time left by this host's clock, and
//! it was handed on less than [`FRESH`] ago; otherwise the ask runs CLAIM as any other does. A
//! force release through another broker reaches the ledger by its notice: a grant answered from
//! here in between is, like any grant whose answer was on its way when the force came, a holder
//! whose lease was forced (its fence tells); `FRESH` bounds that window to what a slow answer
//! could take anyway.
//!
//! Not while replica acks are asked: a grant is answered only once its replicas have it, and a
//! release waits for none (the release then offers, as to any bid).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::epoch::EpochKeeper;
use super::scripts::Handed;
use lockbroker_core::domain::{Fence, Kind, Lease, LockKey, Space, Token};
use lockbroker_core::store::Notice;

/// How long a grant kept here may be answered from here: its waiter normally asks within
/// microseconds of being told; one that asks later is answered by CLAIM.
const FRESH: Duration = Duration::from_millis(100);

/// How many entries may be kept here before the ended ones are swept on the next one.
const SWEEP_ABOVE: usize = 1024;

/// What is kept for a bid's token on a key.
enum Slot {
    /// A grant its waiter has not taken yet, and its end by this host's clock.
    /// The instant last is when it was kept here.
    Waiting(Lease, Instant, Instant),
    /// The bid was answered its live lease (this fence) by CLAIM before the release that handed
    /// it the key answered here (its ask raced the release): that release's grant must neither be
    /// offered to a waiter again nor, its waiter being gone, released. Kept until then or its
    /// end; a grant of another lease to the same token (queued again later) is kept as any.
    Answered(Fence, Instant),
}

impl Slot {
    fn ends(&self) -> Instant {
        match self {
            Slot::Waiting(_, ends, _) | Slot::Answered(_, ends) => *ends,
        }
    }
}

/// The grants RELEASE made to this broker's own bids that their waiters have not taken yet.
pub(crate) struct HandedGrants {
    /// Whether releases ask for such grants (not while replica acks are asked).
    pub enabled: bool,
    slots: Mutex<HashMap<(LockKey, Token), Slot>>,
}

impl HandedGrants {
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            slots: Mutex::default(),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<(LockKey, Token), Slot>> {
        // Every critical section is a few map operations: a poisoned lock is consistent.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `token`'s grant on `key` out, if one waits here: the lease, its end by this host's
    /// clock, and when it was kept here.
    pub(crate) fn take(&self, key: &LockKey, token: &Token) -> Option<(Lease, Instant, Instant)> {
        let mut slots = self.slots();
        // Every claim and leave asks: with nothing kept (an uncontended broker), no key is built.
        if slots.is_empty() {
            return None;
        }
        let at = (key.clone(), token.clone());
        match slots.remove(&at)? {
            Slot::Waiting(lease, ends, kept) => Some((lease, ends, kept)),
            answered @ Slot::Answered(..) => {
                slots.insert(at, answered);
                None
            }
        }
    }

    /// A grant handed to `lease`'s token on `key`, to keep for its waiter: false when that bid
    /// was answered that lease already (nothing to keep, nobody to tell).
    fn put(&self, key: &LockKey, lease: Lease, ends: Instant) -> bool {
        let mut slots = self.slots();
        let at = (key.clone(), lease.token.clone());
        if let Some(Slot::Answered(fence, _)) = slots.get(&at)
            && *fence == lease.fence
        {
            slots.remove(&at);
            return false;
        }
        if slots.len() >= SWEEP_ABOVE {
            let now = Instant::now();
            slots.retain(|_, slot| slot.ends() > now);
        }
        slots.insert(at, Slot::Waiting(lease, ends, Instant::now()));
        true
    }

    /// CLAIM answered `token`'s bid on `key` the live lease it held already (`fence`, ending at
    /// `ends`): a grant handed to it here is taken that way; one still on its way here must not
    /// be.
    pub(crate) fn answered(&self, key: &LockKey, token: &Token, fence: Fence, ends: Instant) {
        let mut slots = self.slots();
        let at = (key.clone(), token.clone());
        if let Some(Slot::Waiting(..)) = slots.remove(&at) {
            return;
        }
        slots.insert(at, Slot::Answered(fence, ends));
    }
}

impl EpochKeeper {
    /// A grant RELEASE on `key` made to a bid of this broker in `epoch`, answered at `answered`:
    /// into the ledger, kept for its waiter, and its waiter told.
    pub(super) fn handed(
        self: &Arc<Self>,
        key: &LockKey,
        handed: Handed,
        answered: Instant,
        epoch: &str,
    ) {
        let Handed {
            granted,
            request_id,
            owner,
        } = handed;
        let Ok(token) = Token::parse(&granted.token) else {
            // Its waiter never hears of it; the lease ends at its TTL.
            tracing::error!(key = %key.as_str(), "Redis handed a lease on with a malformed token");
            return;
        };
        let remaining = Duration::from_millis(granted.expires_at_ms.saturating_sub(granted.now_ms));
        let ends = answered + remaining;
        let lease = Lease {
            token: token.clone(),
            fence: granted.fence,
            expires_at_ms: granted.expires_at_ms,
            ttl_ms: granted.ttl_ms,
            owner,
            request_id,
            limit: None,
        };
        self.remember(
            key,
            Kind::Exclusive,
            self.layout.slot(key),
            &lease,
            ends,
            epoch,
        );
        self.metrics.granted_directly();
        if !self.handed.put(key, lease, ends) {
            return;
        }
        let Some(notices) = self.notices.get() else {
            return;
        };
        let notice = Notice::Offered(Space::Locks, key.clone(), token);
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(notice)) = notices.try_send(notice)
        {
            // Not dropped: the lease would wait for the waiter's slow fallback ask.
            let notices = notices.clone();
            tokio::spawn(async move { notices.send(notice).await });
        }
    }

    /// The grant waiting here for `token`'s ask on `key`, if it is still this broker's: the
    /// ledger holds that lease (its fence) and it has time left — by the ledger's end too, which
    /// a renewal answered since may have brought nearer — and it was handed on no longer than
    /// [`FRESH`] ago. Older, the ask runs CLAIM, which answers what Redis holds: a force release
    /// through another broker reaches this ledger only by its notice, and a grant answered from
    /// here is, like any grant's answer still on its way, only as current as its age.
    pub(super) fn take_handed(&self, key: &LockKey, token: &Token) -> Option<Lease> {
        let (lease, ends, kept_at) = self.handed.take(key, token)?;
        let kept = self.ledger.get(key, Kind::Exclusive, token)?;
        let now = Instant::now();
        (now < ends && now < kept_at + FRESH && kept.fence == lease.fence && now < kept.ends)
            .then_some(lease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockbroker_core::domain::Lease;

    fn lease(token: &Token) -> Lease {
        Lease {
            token: token.clone(),
            fence: 7,
            expires_at_ms: 10_000,
            ttl_ms: 10_000,
            owner: None,
            request_id: None,
            limit: None,
        }
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn a_grant_kept_for_its_waiter_is_taken_once() {
        let handed = HandedGrants::new(true);
        let (key, token) = (LockKey::parse("k").unwrap(), Token::generate());
        assert!(handed.take(&key, &token).is_none());
        assert!(handed.put(&key, lease(&token), later()));
        assert!(
            handed.take(&key, &Token::generate()).is_none(),
            "another token's"
        );
        assert_eq!(handed.take(&key, &token).map(|(l, ..)| l.fence), Some(7));
        assert!(handed.take(&key, &token).is_none(), "taken already");
    }

    #[test]
    fn a_grant_its_bid_was_answered_by_claim_first_is_neither_kept_nor_taken() {
        let handed = HandedGrants::new(true);
        let (key, token) = (LockKey::parse("k").unwrap(), Token::generate());
        // The bid's ask ran after the release in Redis, and answered before the release did.
        handed.answered(&key, &token, 7, later());
        assert!(handed.take(&key, &token).is_none());
        assert!(!handed.put(&key, lease(&token), later()), "nobody to tell");
        assert!(
            handed.take(&key, &token).is_none(),
            "nothing to release on a leave"
        );
        // The other order: the release answered first, then the bid's ask reached Redis.
        assert!(handed.put(&key, lease(&token), later()));
        handed.answered(&key, &token, 7, later());
        assert!(handed.take(&key, &token).is_none());
        assert!(handed.slots().is_empty(), "nothing left behind");
    }

    #[test]
    fn a_mark_for_an_earlier_lease_does_not_swallow_a_later_grant() {
        let handed = HandedGrants::new(true);
        let (key, token) = (LockKey::parse("k").unwrap(), Token::generate());
        // The bid was answered a lease it held (fence 6); it is queued again later, and a
        // release hands it another (fence 7): that one waits for its ask.
        handed.answered(&key, &token, 6, later());
        assert!(handed.put(&key, lease(&token), later()));
        assert_eq!(handed.take(&key, &token).map(|(l, ..)| l.fence), Some(7));
    }

    #[test]
    fn ended_entries_are_swept_once_many_are_kept() {
        let handed = HandedGrants::new(true);
        let key = LockKey::parse("k").unwrap();
        let ended = Instant::now() - Duration::from_millis(1);
        for _ in 0..SWEEP_ABOVE {
            handed.answered(&key, &Token::generate(), 7, ended);
        }
        let token = Token::generate();
        assert!(handed.put(&key, lease(&token), later()));
        assert_eq!(handed.slots().len(), 1);
    }
}
