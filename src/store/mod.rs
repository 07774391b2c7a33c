//! The store: the few atomic primitives the lock algorithm is built from, implemented for
//! Redis ([`RedisStore`]) and for memory ([`MemoryStore`], the embedded default).
//!
//! The primitives are the seeds' steps — SETNX to claim, GET to look, GETSET to take over an
//! expired lease, a holder-checked DEL to release — each made atomic where the seeds' version
//! races, and each reading the time from the store's own clock, so that every broker sharing a
//! store measures leases on one clock whatever its host's clock says.

pub mod memory;
pub mod redis;

use std::future::Future;
use std::sync::Arc;

pub use memory::MemoryStore;
pub use redis::RedisStore;

use crate::domain::{Fence, LockKey, Owner, RequestId, Token, Ttl};
use crate::waiters::Waiters;

/// A lease as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub token: Token,
    pub fence: Fence,
    /// On the store's clock, in Unix epoch milliseconds.
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
    pub owner: Option<Owner>,
    /// The id of the acquire that produced the lease, if it gave one.
    pub request_id: Option<RequestId>,
}

impl Lease {
    /// "A lease that has expired is not held, whatever the store still contains."
    pub fn is_live_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms
    }
}

/// What a contender asks for: its token, the lease length and the label for people.
#[derive(Debug, Clone)]
pub struct Bid {
    pub token: Token,
    pub ttl: Ttl,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

/// The answer to SETNX: the lease if the key was free, or the plain fact that it was not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key was free and the bid now holds it — or the key holds the live lease that an
    /// earlier acquire with the bid's request id produced, and this is that lease again.
    Granted(Lease),
    Taken,
    /// The store lost its data recently; no key is granted until then (see [`HeldBack`]).
    HeldBack(HeldBack),
}

/// The store restarted empty (or lost its data otherwise) while leases may still have been live:
/// their holders still believe they hold them. Until every such lease has ended, the store
/// grants nothing, so one lock is never held twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldBack {
    /// When grants resume, on the store's clock.
    pub until_ms: u64,
    pub now_ms: u64,
}

/// What GET saw: the lease in the key (expired or not), with the store's clock at that moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub now_ms: u64,
    pub lease: Option<Lease>,
}

/// The answer to a takeover of a lease seen expired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TakeOver {
    /// The seen lease was still there and expired (or the key had vanished: the seeds' "GETSET
    /// returned nil"), and the bid now holds the key.
    Granted(Lease),
    /// Another contender took it over or claimed it first, or its holder renewed it; nothing was
    /// written.
    Lost,
    HeldBack(HeldBack),
}

/// A release done: how long the lease had been held, on the store's clock (renewals included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    pub held_ms: u64,
}

/// The answer to a holder-checked operation (release, renew).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder<T> {
    /// The token holds a live lease, and the operation was done.
    Done(T),
    /// Nobody holds the key: it is absent or its lease expired.
    NotHeld,
    /// Someone else's live lease is in the key.
    NotOwner,
}

/// Why the store did not answer. Never mistaken for "someone holds the lock".
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("the store did not answer within {0} ms")]
    Timeout(u64),
    #[error("the store failed: {0}")]
    Failed(String),
}

/// Slack added to a lease's logical expiry for the store's own expiry of the key (Redis
/// PEXPIRE): a safety net so abandoned keys do not pile up, far enough past the logical expiry
/// that the logical timestamp stays the truth even if the store's clock is stepped.
pub const EXPIRY_SLACK_MS: u64 = 60_000;

/// The primitives the algorithm needs. Each call is one atomic step on the store.
pub trait Store: Send + Sync + 'static {
    /// SETNX: grants the bid if the key holds nothing, taking the next fence in the same step.
    ///
    /// A key whose lease expired is *not* free here; the algorithm reads it and takes it over,
    /// so that exactly one contender wins it.
    fn claim(
        &self,
        key: &LockKey,
        bid: &Bid,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// GET: the lease in the key, with the store's clock.
    fn read(&self, key: &LockKey) -> impl Future<Output = Result<Snapshot, StoreError>> + Send;

    /// GETSET made safe: grants the bid if the key still holds the lease with fence `seen` and
    /// it has expired, or if the key has vanished; otherwise writes nothing.
    fn take_over(
        &self,
        key: &LockKey,
        seen: Fence,
        bid: &Bid,
    ) -> impl Future<Output = Result<TakeOver, StoreError>> + Send;

    /// Deletes the key if `token` holds its live lease.
    fn release(
        &self,
        key: &LockKey,
        token: &Token,
    ) -> impl Future<Output = Result<Holder<Released>, StoreError>> + Send;

    /// Moves the expiry of `token`'s live lease to `ttl` after now.
    fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Ttl,
    ) -> impl Future<Output = Result<Holder<Lease>, StoreError>> + Send;

    /// Proves the store answers (for `/readyz`).
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// From now on, delivers every release notice (a release, or a renew that shortens a lease)
    /// to `waiters`, including those of other brokers sharing the store. Delivery is best
    /// effort: waiters also wake at the holder's expiry and on a slow fallback poll.
    fn start_notices(&self, waiters: &Arc<Waiters>);
}

/// The store a running broker uses: chosen at start from the configuration.
// One value per broker, behind an Arc: the size difference costs nothing, a Box an indirection.
#[allow(clippy::large_enum_variant)]
pub enum AnyStore {
    Memory(MemoryStore),
    Redis(RedisStore),
}

macro_rules! delegate {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            AnyStore::Memory($s) => $call.await,
            AnyStore::Redis($s) => $call.await,
        }
    };
}

impl Store for AnyStore {
    async fn claim(&self, key: &LockKey, bid: &Bid) -> Result<Claim, StoreError> {
        delegate!(self, s => s.claim(key, bid))
    }

    async fn read(&self, key: &LockKey) -> Result<Snapshot, StoreError> {
        delegate!(self, s => s.read(key))
    }

    async fn take_over(
        &self,
        key: &LockKey,
        seen: Fence,
        bid: &Bid,
    ) -> Result<TakeOver, StoreError> {
        delegate!(self, s => s.take_over(key, seen, bid))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Holder<Released>, StoreError> {
        delegate!(self, s => s.release(key, token))
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Ttl,
    ) -> Result<Holder<Lease>, StoreError> {
        delegate!(self, s => s.renew(key, token, ttl))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        delegate!(self, s => s.ping())
    }

    fn start_notices(&self, waiters: &Arc<Waiters>) {
        match self {
            AnyStore::Memory(s) => s.start_notices(waiters),
            AnyStore::Redis(s) => s.start_notices(waiters),
        }
    }
}
