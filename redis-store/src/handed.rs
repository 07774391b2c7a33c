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
//! refused put-back in between ends it there) and its lease has time left by this host's clock;
//! otherwise the ask runs CLAIM as any other does.
//!
//! Not while replica acks are asked: a grant is answered only once its replicas have it, and a
//! release waits for none (the release then offers, as to any bid).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::epoch::EpochKeeper;
use super::scripts::Handed;
use lockbroker_core::domain::{Kind, Lease, LockKey, Space, Token};
use lockbroker_core::store::Notice;

/// How many grants may wait here before the ended ones are swept on the next one.
const SWEEP_ABOVE: usize = 1024;

/// The grants RELEASE made to this broker's own bids that their waiters have not taken yet.
pub(crate) struct HandedGrants {
    /// Whether releases ask for such grants (not while replica acks are asked).
    pub enabled: bool,
    waiting: Mutex<HashMap<(LockKey, Token), (Lease, Instant)>>,
}

impl HandedGrants {
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            waiting: Mutex::default(),
        }
    }

    fn waiting(&self) -> MutexGuard<'_, HashMap<(LockKey, Token), (Lease, Instant)>> {
        // Every critical section is one map operation: a poisoned lock is consistent.
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `token`'s grant on `key` out, if one waits here: the lease and its end by this
    /// host's clock.
    pub(crate) fn take(&self, key: &LockKey, token: &Token) -> Option<(Lease, Instant)> {
        self.waiting().remove(&(key.clone(), token.clone()))
    }

    fn put(&self, key: &LockKey, lease: Lease, ends: Instant) {
        let mut waiting = self.waiting();
        if waiting.len() >= SWEEP_ABOVE {
            let now = Instant::now();
            waiting.retain(|_, (_, ends)| *ends > now);
        }
        waiting.insert((key.clone(), lease.token.clone()), (lease, ends));
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
        self.handed.put(key, lease, ends);
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
    /// ledger holds it and it has time left.
    pub(super) fn take_handed(&self, key: &LockKey, token: &Token) -> Option<Lease> {
        let (lease, ends) = self.handed.take(key, token)?;
        (Instant::now() < ends && self.ledger.holds(key, Kind::Exclusive, token)).then_some(lease)
    }
}
