//! The lease ledger: the live leases this broker granted or renewed, so that it can put them
//! back into a store that lost them (a restart without persistence, a flush, a failover to a
//! replica that missed the last writes).
//!
//! An entry is added on a grant or renew and dropped on release, on an answer that the lease is
//! gone, or once its end has passed. The ledger is bounded by the broker's live leases; an entry
//! is a key, a token, a fence, a few numbers and the owner label (see `bench ledger` for the
//! measured bytes per lease).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::domain::{Fence, Lease, LockKey, Owner, RequestId, Token};

/// One live lease as the granting broker remembers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub token: Token,
    pub fence: Fence,
    /// When the lease ends, on this host's monotonic clock: the moment its grant or renewal was
    /// answered plus its TTL. The store started the lease a little earlier than that answer, so
    /// this is never before the real end: a put-back errs towards keeping a key a few
    /// milliseconds longer, never towards ending a lease early.
    pub ends: Instant,
    pub ttl_ms: u64,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

impl Entry {
    /// What is left of the lease at `now`; zero once it has ended.
    pub fn remaining(&self, now: Instant) -> Duration {
        self.ends.saturating_duration_since(now)
    }
}

/// The broker's live leases, by key.
#[derive(Debug, Default)]
pub struct Ledger {
    /// A std Mutex: nothing awaits while holding it, and each critical section is one map
    /// operation (or one pass over the map, once a second, to drop ended leases).
    leases: Mutex<HashMap<LockKey, Entry>>,
}

impl Ledger {
    fn leases(&self) -> MutexGuard<'_, HashMap<LockKey, Entry>> {
        // Each write is one map operation, so a poisoned map is still consistent.
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers `lease` on `key`, answered at `answered`. A renewal keeps the request id the
    /// grant had (the store does not echo it).
    pub fn record(&self, key: &LockKey, lease: &Lease, answered: Instant) {
        let ends = answered + Duration::from_millis(lease.ttl_ms);
        let mut leases = self.leases();
        let request_id = match leases.get(key) {
            Some(old) if old.token == lease.token && lease.request_id.is_none() => {
                old.request_id.clone()
            }
            _ => lease.request_id.clone(),
        };
        leases.insert(
            key.clone(),
            Entry {
                token: lease.token.clone(),
                fence: lease.fence,
                ends,
                ttl_ms: lease.ttl_ms,
                owner: lease.owner.clone(),
                request_id,
            },
        );
    }

    /// Forgets `token`'s lease on `key` (released, or found gone). Another token's entry stays.
    pub fn forget(&self, key: &LockKey, token: &Token) {
        let mut leases = self.leases();
        if leases.get(key).is_some_and(|e| e.token == *token) {
            leases.remove(key);
        }
    }

    /// Whether `token`'s lease on `key` is still remembered.
    pub fn holds(&self, key: &LockKey, token: &Token) -> bool {
        self.leases().get(key).is_some_and(|e| e.token == *token)
    }

    /// The entry for `key`, if any.
    pub fn get(&self, key: &LockKey) -> Option<Entry> {
        self.leases().get(key).cloned()
    }

    /// Drops the leases that have ended by `now`; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let mut leases = self.leases();
        let before = leases.len();
        leases.retain(|_, e| e.ends > now);
        before - leases.len()
    }

    /// The leases still live at `now`, to put back.
    pub fn live(&self, now: Instant) -> Vec<(LockKey, Entry)> {
        self.leases()
            .iter()
            .filter(|(_, e)| e.ends > now)
            .map(|(k, e)| (k.clone(), e.clone()))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.leases().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(token: &Token, fence: Fence, ttl_ms: u64) -> Lease {
        Lease {
            token: token.clone(),
            fence,
            expires_at_ms: 0,
            ttl_ms,
            owner: None,
            request_id: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_is_kept_until_it_ends_or_its_holder_lets_go() {
        let ledger = Ledger::default();
        let (a, b) = (LockKey::parse("a").unwrap(), LockKey::parse("b").unwrap());
        let (ta, tb) = (Token::generate(), Token::generate());
        let start = Instant::now();
        ledger.record(&a, &lease(&ta, 1, 1_000), start);
        ledger.record(&b, &lease(&tb, 2, 5_000), start);
        // Someone else's token does not forget the entry.
        ledger.forget(&a, &tb);
        assert!(ledger.holds(&a, &ta));
        let live = ledger.live(start + Duration::from_millis(999));
        assert_eq!(live.len(), 2);
        assert_eq!(ledger.sweep(start + Duration::from_millis(1_000)), 1);
        assert!(!ledger.holds(&a, &ta));
        assert_eq!(
            ledger
                .get(&b)
                .unwrap()
                .remaining(start + Duration::from_millis(1_000)),
            Duration::from_millis(4_000)
        );
        ledger.forget(&b, &tb);
        assert!(ledger.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_moves_the_end_and_keeps_the_grants_request_id() {
        let ledger = Ledger::default();
        let key = LockKey::parse("k").unwrap();
        let token = Token::generate();
        let start = Instant::now();
        let mut granted = lease(&token, 7, 1_000);
        granted.request_id = Some(RequestId::parse("job-1").unwrap());
        ledger.record(&key, &granted, start);
        ledger.record(
            &key,
            &lease(&token, 7, 3_000),
            start + Duration::from_millis(500),
        );
        let entry = ledger.get(&key).unwrap();
        assert_eq!(entry.ends, start + Duration::from_millis(3_500));
        assert_eq!(entry.request_id.unwrap().as_str(), "job-1");
    }
}
