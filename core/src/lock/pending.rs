//! The cleanup of a grant whose answer never reached the client (see [`PendingGrant`]), and of a
//! waiting bid's entry in its key's queue when the acquire ends without a grant (see [`Spot`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::domain::{LockKey, Space, Token, Ttl};
use crate::metrics::Outage;
use crate::store::{AsHolder, Store, StoreResult};

/// A store call that may be granting a lease and has not given a definite answer yet.
///
/// If it is dropped still armed — the call failed or timed out (Redis may have applied the
/// script before the answer was lost), or the client went away mid-call and the request future
/// was dropped — nobody will ever learn the token, and the lease would block the key for its
/// whole TTL. So it spawns a cleanup: a holder-checked release by that token, retried until the
/// store gives any definite answer (a store-wide hold is waited out) or the TTL has passed (by
/// then the lease has ended by itself). A cleanup that gives up is a DEBUG line and a count in
/// the store outage it belongs to (see [`Outage`]), not a line of its own above DEBUG: an outage
/// refuses many requests, and each may leave one.
/// A release by a token that holds nothing changes nothing, so a call that never applied costs
/// one extra store call. Not armed for a bid with a request id: its client can get the grant
/// back by repeating the acquire, and a cleanup could release it from under that repeat. If the
/// store stays unreachable, the lease ends at its TTL like any other.
///
/// It borrows the key and the token: they are copied only for a cleanup, not for every call.
pub(super) struct PendingGrant<'a, S: Store> {
    /// `None` once disarmed.
    pub store: Option<&'a Arc<S>>,
    /// The space the lease would be in: a lock's (exclusive or shared lease), or a semaphore's.
    pub space: Space,
    pub key: &'a LockKey,
    pub token: &'a Token,
    pub ttl: Ttl,
    /// Where the cleanup's store calls and a cleanup that gives up are counted.
    pub outage: &'a Arc<Outage>,
}

impl<S: Store> PendingGrant<'_, S> {
    /// Ends the guard with the call's answer: a definite one disarms it (a grant goes back to
    /// the client; one that has left by now was granted at that instant, and its lease ends at
    /// its TTL); a failure leaves it armed, so dropping it cleans up.
    pub(super) fn settle<T>(mut self, answer: &StoreResult<T>) {
        if answer.is_ok() {
            self.store = None;
        }
    }
}

impl<S: Store> Drop for PendingGrant<'_, S> {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, outage) = (store.clone(), self.outage.clone());
        let (space, key, token) = (self.space, self.key.clone(), self.token.clone());
        let give_up = Instant::now() + Duration::from_millis(self.ttl.as_ms());
        runtime.spawn(async move {
            let mut pause = Duration::from_millis(50);
            loop {
                let result = store.release(space, &key, &token).await;
                outage.observe(&result);
                let retry = Instant::now() + pause < give_up;
                match result {
                    // DEBUG too: a frozen store's outage leaves one per refused acquire.
                    Ok(AsHolder::Done(_)) => {
                        tracing::debug!(%key, "released a lease granted to a request that failed or went away");
                        return;
                    }
                    // A store-wide hold refuses releases too, for a few seconds: wait it out.
                    Ok(AsHolder::OnHold(_)) if retry => {}
                    Ok(_) => return,
                    Err(e) if retry => {
                        tracing::debug!(%key, error = %e, "cleanup of an unanswered grant failed; retrying");
                    }
                    Err(e) => {
                        tracing::debug!(%key, error = %e, "could not clean up an unanswered grant; it ends at its TTL");
                        outage.cleanup_failed(&e);
                        return;
                    }
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        });
    }
}

/// A waiting bid's entry in its key's queue in the store.
///
/// While armed, dropping it — the acquire ends without a grant (its wait ran out, its client
/// went away, the broker stops) or goes on with a new token after a failed store call — takes
/// the entry out of the queue with [`Store::leave`], which also ends an offer made to it and not
/// taken, so the key passes on at once rather than when the offer lapses. Best effort: if the
/// store does not answer, the entry ends at its deadline and an offer to it lapses.
pub(super) struct Spot<S: Store> {
    /// `None` once disarmed (the bid was granted: nothing of it waits any more).
    pub store: Option<Arc<S>>,
    pub space: Space,
    pub key: LockKey,
    pub token: Token,
}

impl<S: Store> Spot<S> {
    /// Whether this is the spot of the bid with `token`.
    pub(super) fn is_for(&self, token: &Token) -> bool {
        self.token == *token
    }
}

impl<S: Store> Drop for Spot<S> {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (space, key, token) = (self.space, self.key.clone(), self.token.clone());
        runtime.spawn(async move {
            for pause in [Duration::from_millis(100), Duration::from_millis(500)] {
                match store.leave(space, &key, &token).await {
                    Ok(()) => return,
                    Err(e) => {
                        tracing::debug!(%key, error = %e, "leaving the queue failed; retrying");
                        tokio::time::sleep(pause).await;
                    }
                }
            }
            tracing::debug!(%key, "could not leave the queue; the entry ends at its deadline");
        });
    }
}
