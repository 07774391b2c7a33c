//! The lease ledger: the live leases this broker granted or renewed, so that it can put them
//! back into a store that lost them (a restart without persistence, a flush, a failover to a
//! replica that missed the last writes).
//!
//! An entry is added on a grant or renew and dropped on release, on an answer that the lease is
//! gone, or once its end has passed.
//!
//! An end (a release, a force release, seen here or told by another broker) can reach the ledger
//! before the answer of a renewal (or a grant) of the same lease that Redis ran *before* it: the
//! end comes on another connection, or from a call whose answer needed no wait for replicas. So
//! each end leaves a mark for [`Ledger::linger`]: a later [`Ledger::record`] of a lease that
//! mark ended does not bring it back (it would stay until its end, and a store loss meanwhile
//! would put a lease back that nobody holds). The ledger is bounded by the broker's live leases; an entry
//! is a key, a token, a fence, a few numbers and the owner label (see `lockbroker-bench --ledger`
//! for the measured bytes per lease).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use lockbroker_core::domain::{Fence, Kind, Lease, LockKey, Owner, RequestId, Space, Token};

mod kept_token;
mod marks;

use self::kept_token::KeptToken;
use self::marks::EndMarks;

/// One live lease as the granting broker remembers it (as handed out by [`Ledger::live`] and
/// [`Ledger::get`]; the ledger itself keeps a compact form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub kind: Kind,
    pub token: Token,
    pub fence: Fence,
    /// When the lease ends, on this host's monotonic clock: the moment its grant or renewal was
    /// answered plus its TTL, rounded up to the millisecond. The store started the lease a little
    /// earlier than that answer, so this is never before the real end: a put-back errs towards
    /// keeping a key a few milliseconds longer, never towards ending a lease early.
    pub ends: Instant,
    pub ttl_ms: u64,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

impl Entry {
    /// What is left of the lease at `now`; zero once it has ended.
    pub(crate) fn remaining(&self, now: Instant) -> Duration {
        self.ends.saturating_duration_since(now)
    }
}

/// An entry as the ledger keeps it: a broker may hold a hundred thousand live leases, so each
/// field is as small as it can be (about 200 bytes a lease in all; `lockbroker-bench --ledger`).
#[derive(Debug)]
struct Kept {
    token: KeptToken,
    fence: Fence,
    /// [`Entry::ends`] as milliseconds after the ledger's base instant.
    ends_ms: u64,
    /// At most a day (`max_ttl_ms`'s ceiling).
    ttl_ms: u32,
    owner: Option<Box<str>>,
    request_id: Option<Box<str>>,
}

/// The pool leases (shared leases, permits) this broker holds on one key.
#[derive(Debug)]
struct PoolLeases {
    /// The semaphore's limit (0 for a lock's shared leases).
    limit: u32,
    members: Vec<Kept>,
}

/// The broker's live leases, by key.
#[derive(Debug)]
pub(crate) struct Ledger {
    /// A std Mutex: nothing awaits while holding it, and each critical section is one map
    /// operation (or one pass over the map, once a second, to drop ended leases).
    leases: Mutex<HashMap<Box<str>, Kept>>,
    /// Shared leases and permits, by space and key; a few per key, usually.
    pools: Mutex<BySpace<PoolLeases>>,
    /// The ends seen lately, by space and key (see the module's docs).
    ended: Mutex<EndMarks>,
    /// How long an end's mark is kept: longer than a renewal's answer can take to be recorded
    /// after Redis ran it (the store's time bound for the call, and as much for the replicas).
    linger: Duration,
    /// What `Kept::ends_ms` counts from.
    base: Instant,
}

/// A map by space, then by key: one map per space, so that a key is looked up as the `&str` it
/// is, without building an owned key for every lookup.
#[derive(Debug)]
struct BySpace<T> {
    locks: HashMap<Box<str>, T>,
    semaphores: HashMap<Box<str>, T>,
}

impl<T> Default for BySpace<T> {
    fn default() -> Self {
        Self {
            locks: HashMap::new(),
            semaphores: HashMap::new(),
        }
    }
}

impl<T> BySpace<T> {
    fn of(&self, space: Space) -> &HashMap<Box<str>, T> {
        match space {
            Space::Locks => &self.locks,
            Space::Semaphores => &self.semaphores,
        }
    }

    fn of_mut(&mut self, space: Space) -> &mut HashMap<Box<str>, T> {
        match space {
            Space::Locks => &mut self.locks,
            Space::Semaphores => &mut self.semaphores,
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(&mut T) -> bool) {
        self.locks.retain(|_, v| keep(v));
        self.semaphores.retain(|_, v| keep(v));
    }

    fn iter(&self) -> impl Iterator<Item = (Space, &str, &T)> {
        let locks = self.locks.iter().map(|(key, v)| (Space::Locks, &**key, v));
        let semaphores = (self.semaphores.iter()).map(|(key, v)| (Space::Semaphores, &**key, v));
        locks.chain(semaphores)
    }

    fn values(&self) -> impl Iterator<Item = &T> {
        self.locks.values().chain(self.semaphores.values())
    }
}

/// [`Ledger::linger`] when nothing else is said.
const DEFAULT_LINGER: Duration = Duration::from_secs(10);

impl Default for Ledger {
    fn default() -> Self {
        Self::with_linger(DEFAULT_LINGER)
    }
}

impl Ledger {
    /// A ledger whose end marks are kept for `linger`.
    pub(crate) fn with_linger(linger: Duration) -> Self {
        Self {
            leases: Mutex::default(),
            pools: Mutex::default(),
            ended: Mutex::default(),
            linger,
            base: Instant::now(),
        }
    }

    fn ended(&self) -> MutexGuard<'_, EndMarks> {
        self.ended.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn leases(&self) -> MutexGuard<'_, HashMap<Box<str>, Kept>> {
        // Each write is one map operation, so a poisoned map is still consistent.
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Milliseconds after the base, rounded up: never before `at`.
    fn ms_after_base(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.base);
        u64::try_from(since.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }

    fn pools(&self) -> MutexGuard<'_, BySpace<PoolLeases>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn expand(&self, key: &str, kind: Kind, kept: &Kept) -> (LockKey, Entry) {
        let entry = Entry {
            kind,
            token: kept.token.token(),
            fence: kept.fence,
            ends: self.base + Duration::from_millis(kept.ends_ms),
            ttl_ms: u64::from(kept.ttl_ms),
            owner: kept
                .owner
                .as_deref()
                .and_then(|o| Owner::from_stored(o).ok()),
            request_id: kept
                .request_id
                .as_deref()
                .and_then(|r| RequestId::parse(r).ok()),
        };
        (
            LockKey::parse(key).expect("a key the ledger kept was valid when it came"),
            entry,
        )
    }

    /// Remembers `lease` of `kind` on `key`, ending at `ends` (the moment its grant or renewal
    /// was answered plus what the store said remained of it). A renewal keeps the request id the
    /// grant had (the store does not echo it). Returns `false`, remembering nothing, when an end
    /// seen lately already ended that lease (the renewal's answer came after the end's).
    pub(crate) fn record(&self, key: &LockKey, kind: Kind, lease: &Lease, ends: Instant) -> bool {
        // The marks stay locked until the lease is in: an end handled meanwhile on another
        // thread either left its mark before the check, or finds the lease to drop after it.
        let ended = self.ended();
        let now_ms = self.ms_after_base(Instant::now());
        if ended.ended(key.as_str(), kind, lease.fence, now_ms) {
            return false;
        }
        let ends_ms = self.ms_after_base(ends);
        let token = KeptToken::of(&lease.token);
        let kept = |request_id| Kept {
            token: KeptToken::of(&lease.token),
            fence: lease.fence,
            ends_ms,
            ttl_ms: u32::try_from(lease.ttl_ms).unwrap_or(u32::MAX),
            owner: lease.owner.as_ref().map(|o| o.as_str().into()),
            request_id,
        };
        if kind != Kind::Exclusive {
            let limit = match kind {
                Kind::Semaphore { limit } => limit,
                _ => 0,
            };
            let mut pools = self.pools();
            let pool = pools
                .of_mut(kind.space())
                .entry(key.as_str().into())
                .or_insert(PoolLeases {
                    limit,
                    members: Vec::new(),
                });
            // The live permits of a semaphore share one limit: the newest grant's.
            pool.limit = limit;
            match pool.members.iter_mut().find(|m| m.token == token) {
                Some(old) => {
                    let request_id = lease
                        .request_id
                        .as_ref()
                        .map(|id| id.as_str().into())
                        .or(old.request_id.take());
                    *old = kept(request_id);
                }
                None => pool
                    .members
                    .push(kept(lease.request_id.as_ref().map(|id| id.as_str().into()))),
            }
            return true;
        }
        let mut leases = self.leases();
        let request_id = match (leases.get(key.as_str()), &lease.request_id) {
            (_, Some(id)) => Some(id.as_str().into()),
            (Some(old), None) if old.token == token => old.request_id.clone(),
            _ => None,
        };
        leases.insert(key.as_str().into(), kept(request_id));
        true
    }

    /// Forgets `token`'s pool lease on `key` in `space` (released, or found gone).
    pub(crate) fn forget_pooled(&self, space: Space, key: &LockKey, token: &Token) {
        let token = KeptToken::of(token);
        let mut pools = self.pools();
        let by_key = pools.of_mut(space);
        if let Some(pool) = by_key.get_mut(key.as_str()) {
            pool.members.retain(|m| m.token != token);
            if pool.members.is_empty() {
                by_key.remove(key.as_str());
            }
        }
    }

    /// Forgets `token`'s lease on `key` in `space`, whatever its kind.
    pub(crate) fn forget_any(&self, space: Space, key: &LockKey, token: &Token) {
        if space == Space::Locks {
            self.forget(key, token);
        }
        self.forget_pooled(space, key, token);
    }

    /// A release notice from any broker: the lease on `key` in `space` with that fence is over
    /// — and, with `all`, every lease on the key up to that fence (a force release). An
    /// exclusive lease with a lower fence is over too: the released one came after it.
    /// The end leaves its mark (see the module's docs).
    pub(crate) fn forget_ended(&self, space: Space, key: &str, fence: Fence, all: bool) {
        // Held until the lease is dropped: see `record`.
        let mut ended = self.ended();
        let until_ms = self.ms_after_base(Instant::now() + self.linger);
        ended.mark(space, key, fence, all, until_ms);
        if space == Space::Locks {
            self.forget_released(key, fence);
        }
        let mut pools = self.pools();
        let by_key = pools.of_mut(space);
        if let Some(pool) = by_key.get_mut(key) {
            pool.members.retain(|m| {
                if all {
                    m.fence > fence
                } else {
                    m.fence != fence
                }
            });
            if pool.members.is_empty() {
                by_key.remove(key);
            }
        }
    }

    /// Forgets `token`'s lease on `key` (released, or found gone). Another token's entry stays.
    pub(crate) fn forget(&self, key: &LockKey, token: &Token) {
        let mut leases = self.leases();
        if leases
            .get(key.as_str())
            .is_some_and(|e| e.token == KeptToken::of(token))
        {
            leases.remove(key.as_str());
        }
    }

    /// Forgets the lease on `key` if its fence is at most `fence`: a release notice from any
    /// broker says the lease with that fence is over, and so is any older one.
    pub(crate) fn forget_released(&self, key: &str, fence: Fence) {
        let mut leases = self.leases();
        if leases.get(key).is_some_and(|e| e.fence <= fence) {
            leases.remove(key);
        }
    }

    /// Whether `token`'s lease of `kind` on `key` is still remembered.
    pub(crate) fn holds(&self, key: &LockKey, kind: Kind, token: &Token) -> bool {
        self.get(key, kind, token).is_some()
    }

    /// The entry for `token`'s lease of `kind` on `key`, if any.
    pub(crate) fn get(&self, key: &LockKey, kind: Kind, token: &Token) -> Option<Entry> {
        let token = KeptToken::of(token);
        if kind == Kind::Exclusive {
            return self
                .leases()
                .get(key.as_str())
                .filter(|kept| kept.token == token)
                .map(|kept| self.expand(key.as_str(), kind, kept).1);
        }
        self.pools()
            .of(kind.space())
            .get(key.as_str())
            .and_then(|pool| pool.members.iter().find(|m| m.token == token))
            .map(|kept| self.expand(key.as_str(), kind, kept).1)
    }

    /// Drops the leases that have ended by `now`, and the end marks kept long enough; returns
    /// how many leases.
    pub(crate) fn sweep(&self, now: Instant) -> usize {
        let now_ms = self.ms_after_base(now);
        self.ended().sweep(now_ms);
        let mut dropped = {
            let mut leases = self.leases();
            let before = leases.len();
            leases.retain(|_, e| e.ends_ms > now_ms);
            before - leases.len()
        };
        self.pools().retain(|pool| {
            let before = pool.members.len();
            pool.members.retain(|m| m.ends_ms > now_ms);
            dropped += before - pool.members.len();
            !pool.members.is_empty()
        });
        dropped
    }

    /// The leases still live at `now`, to put back.
    pub(crate) fn live(&self, now: Instant) -> Vec<(LockKey, Entry)> {
        let now_ms = self.ms_after_base(now);
        let mut live: Vec<(LockKey, Entry)> = self
            .leases()
            .iter()
            .filter(|(_, e)| e.ends_ms > now_ms)
            .map(|(k, e)| self.expand(k, Kind::Exclusive, e))
            .collect();
        for (space, key, pool) in self.pools().iter() {
            let kind = match space {
                Space::Locks => Kind::Shared,
                Space::Semaphores => Kind::Semaphore { limit: pool.limit },
            };
            live.extend(
                pool.members
                    .iter()
                    .filter(|m| m.ends_ms > now_ms)
                    .map(|m| self.expand(key, kind, m)),
            );
        }
        live
    }

    pub(crate) fn len(&self) -> usize {
        self.leases().len()
            + self
                .pools()
                .values()
                .map(|p| p.members.len())
                .sum::<usize>()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
