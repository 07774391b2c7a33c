//! The store: the few atomic primitives the lock algorithm is built from, implemented for
//! Redis ([`RedisStore`]) and for memory ([`MemoryStore`], the embedded default).
//!
//! The primitives are the steps of the classic SETNX/GETSET timestamp recipe — SETNX to claim,
//! GET to look, GETSET to take over an expired lease, a holder-checked DEL to release — each
//! made atomic where the recipe's version races, and each reading the time from the store's own clock, so that every broker sharing a
//! store measures leases on one clock whatever its host's clock says.

pub mod ledger;
pub mod memory;
pub mod redis;

use std::future::Future;

use tokio::sync::mpsc;

pub use memory::MemoryStore;
pub use redis::RedisStore;

pub use crate::domain::Lease;
use crate::domain::{Fence, LockKey, Owner, RequestId, Token, Ttl};

/// What a contender asks for: its token, the lease length and the label for people.
#[derive(Debug, Clone)]
pub struct Bid {
    pub token: Token,
    pub ttl: Ttl,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
}

/// The answer to a call that may grant (SETNX, the safe GETSET): one word for "not granted" in
/// both, since the caller knows which it asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// The bid now holds the key — or, for SETNX, the key holds the live lease that an earlier
    /// acquire with the bid's request id produced, and this is that lease again.
    Granted(Lease),
    /// SETNX: the key holds a lease (live or expired). Takeover: another contender took it over
    /// or claimed it first, or its holder renewed it. Nothing was written either way.
    Refused,
    /// A store-wide hold is in force: no key is granted until it ends (see [`Hold`]).
    Held(Hold),
}

/// A store-wide hold: nothing is granted, store-wide, until it ends.
///
/// A store that restarted, was flushed or failed over may have lost leases whose holders still
/// believe they hold them. Until the brokers that granted those leases have put them back, no
/// key may be granted, or one lock could have two holders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub reason: HoldReason,
    /// How long until grants may resume, as far as the store knows now.
    pub retry_after_ms: u64,
}

/// Why a [`Hold`] is in force; each has its own words for clients and `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// The store has no record of earlier grants: it is new, or it was emptied while no broker
    /// that knew it was looking. Brokers that knew it get this long to put their leases back.
    Settling,
    /// A broker detected a loss (an emptied store, another server process, a promoted replica):
    /// brokers put their live leases back before anything is granted.
    Loss,
    /// This broker is putting its own live leases back right now.
    PuttingBack,
}

/// What GET saw: the lease in the key (expired or not), with the store's clock at that moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub now_ms: u64,
    pub lease: Option<Lease>,
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
    /// The key holds no live lease, but a store-wide hold is in force: the lease may be about to
    /// be put back, so "not held" would be a guess.
    Held(Hold),
}

/// What a store tells the lock service's waiters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The key's lease was released, or now ends sooner: its waiters should look again.
    Released(LockKey),
    /// Notices may have been missed (the notice connection was down): every waiter should look.
    Missed,
}

/// Room for notices not yet handed to waiters. A full channel drops a notice; waiters still wake
/// at the holder's expiry and on their fallback poll, so a burst costs latency, never a grant.
pub const NOTICE_BUFFER: usize = 4096;

/// What a store call answers.
pub type StoreResult<T> = Result<T, StoreError>;

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
    fn claim(&self, key: &LockKey, bid: &Bid) -> impl Future<Output = StoreResult<Grant>> + Send;

    /// GET: the lease in the key, with the store's clock.
    fn read(&self, key: &LockKey) -> impl Future<Output = StoreResult<Snapshot>> + Send;

    /// GETSET made safe: grants the bid if the key still holds the lease with fence `seen` and
    /// it has expired, or if the key has vanished; otherwise writes nothing.
    fn take_over(
        &self,
        key: &LockKey,
        seen: Fence,
        bid: &Bid,
    ) -> impl Future<Output = StoreResult<Grant>> + Send;

    /// Deletes the key if `token` holds its live lease.
    fn release(
        &self,
        key: &LockKey,
        token: &Token,
    ) -> impl Future<Output = StoreResult<Holder<Released>>> + Send;

    /// Moves the expiry of `token`'s live lease to `ttl` after now.
    fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Ttl,
    ) -> impl Future<Output = StoreResult<Holder<Lease>>> + Send;

    /// Whether a free key would be granted now (for `/readyz`): an error if the store does not
    /// answer, the hold in force if there is one.
    fn ready(&self) -> impl Future<Output = StoreResult<Option<Hold>>> + Send;

    /// Starts the store's background work, which ends when `notices` closes: from now on every
    /// release notice (a release, or a renew that shortens a lease), including those of other
    /// brokers sharing the store, goes to `notices`. Delivery is best effort: waiters also wake
    /// at the holder's expiry and on a slow fallback poll.
    fn start(&self, notices: mpsc::Sender<Notice>);

    /// How many live leases this broker remembers to put back after a store loss (0 for a store
    /// that cannot lose them).
    fn ledger_len(&self) -> usize {
        0
    }
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
    async fn claim(&self, key: &LockKey, bid: &Bid) -> StoreResult<Grant> {
        delegate!(self, s => s.claim(key, bid))
    }

    async fn read(&self, key: &LockKey) -> StoreResult<Snapshot> {
        delegate!(self, s => s.read(key))
    }

    async fn take_over(&self, key: &LockKey, seen: Fence, bid: &Bid) -> StoreResult<Grant> {
        delegate!(self, s => s.take_over(key, seen, bid))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> StoreResult<Holder<Released>> {
        delegate!(self, s => s.release(key, token))
    }

    async fn renew(&self, key: &LockKey, token: &Token, ttl: Ttl) -> StoreResult<Holder<Lease>> {
        delegate!(self, s => s.renew(key, token, ttl))
    }

    async fn ready(&self) -> StoreResult<Option<Hold>> {
        delegate!(self, s => s.ready())
    }

    fn start(&self, notices: mpsc::Sender<Notice>) {
        match self {
            AnyStore::Memory(s) => s.start(notices),
            AnyStore::Redis(s) => s.start(notices),
        }
    }

    fn ledger_len(&self) -> usize {
        match self {
            AnyStore::Memory(s) => s.ledger_len(),
            AnyStore::Redis(s) => s.ledger_len(),
        }
    }
}
