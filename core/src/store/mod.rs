//! The store: the few atomic primitives the lock algorithm is built from, implemented for
//! memory ([`MemoryStore`], the embedded default, here) and for Redis (`RedisStore`, in the
//! `lockbroker-redis` crate).
//!
//! The primitives are the steps of the classic SETNX/GETSET timestamp recipe — SETNX to claim,
//! GET to look, GETSET to take over an expired lease, a holder-checked DEL to release — each
//! made atomic where the recipe's version races, and each reading the time from the store's own clock, so that every broker sharing a
//! store measures leases on one clock whatever its host's clock says.

pub mod memory;
mod session;

use std::future::Future;

use tokio::sync::mpsc;

pub use memory::MemoryStore;
pub use session::{
    ENTRY_GRACE_MS, MAX_LOCK_DELAY_MS, SessionEntry, SessionOp, SessionRecord, SessionSpec,
};

pub use crate::domain::Lease;
use crate::domain::{Fence, Kind, LockKey, Mode, Owner, Pool, RequestId, Space, Token, Ttl};

/// What a contender asks for: its token, the lease length and the label for people.
#[derive(Debug, Clone)]
pub struct Bid {
    pub token: Token,
    pub ttl: Ttl,
    pub owner: Option<Owner>,
    pub request_id: Option<RequestId>,
    /// How long the bid may wait, in ms; 0: it does not wait.
    ///
    /// A bid that waits and cannot be granted now joins the key's queue in the same store call
    /// ([`GrantAnswer::Queued`], [`Join::Queued`]): one FIFO queue per key and space, shared by
    /// every broker on the store, with the bid's deadline on the store's clock (now + `wait_ms`).
    /// When the key frees, the store call that frees it offers it to the queue's head (see
    /// [`Notice::Offered`]); the bid takes the offer by asking again with the same token. A
    /// queued exclusive bid holds later shared ones back: nobody is granted ahead of the queue.
    pub wait_ms: u64,
    /// For a bid under a session: when the lease it gets must end, so that a grant after a wait
    /// ends with the session, not a whole session TTL after the grant. `ttl` is then the time
    /// left at `since`.
    pub ends: Option<tokio::time::Instant>,
}

impl Bid {
    /// Whether the bid waits (joins the key's queue when it cannot be granted now).
    pub fn waits(&self) -> bool {
        self.wait_ms > 0
    }

    /// The lease length a grant made now gives: `ttl`, or for a bid under a session the time
    /// left until the session's end as this broker measures it (at least 1 ms; a grant that
    /// ends too soon is extended to the session's end once the broker has it).
    pub fn lease_ttl(&self) -> Ttl {
        match self.ends {
            None => self.ttl,
            Some(ends) => {
                let left = ends.saturating_duration_since(tokio::time::Instant::now());
                Ttl::from_ms(u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1))
            }
        }
    }
}

/// How a renewal moves a lease's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// To `ttl` after now — a holder's renewal. A lease held under a session keeps its end (its
    /// session's keep-alive moves it).
    For(Ttl),
    /// To this time on the store's clock, or leaves it where it is if it ends later already: a
    /// session's keep-alive, which never shortens a lease.
    Until(u64),
}

/// The largest semaphore limit.
pub const MAX_SEMAPHORE_LIMIT: u32 = 10_000;

/// The answer to [`Store::join`]: one round trip, no separate look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Join {
    /// The bid holds a shared lease or a permit now — or, with a request id, the live lease an
    /// earlier acquire with that id produced, again.
    Granted(Lease),
    /// Not now, and the bid does not wait: an exclusive lease is live, or bids wait in the
    /// queue (shared), or every permit is taken (semaphore). Something may change in this many
    /// ms at the latest (the exclusive lease's end, the first permit's end).
    Busy { retry_after_ms: u64 },
    /// The bid waits in the key's queue (see [`GrantAnswer::Queued`]).
    Queued { retry_after_ms: u64 },
    /// The semaphore's live holders took their permits with another limit.
    LimitMismatch { limit: u32 },
    /// A store-wide hold is in force.
    OnHold(Hold),
}

/// The answer to a call that may grant (SETNX, the safe GETSET): one word for "not granted" in
/// both, since the caller knows which it asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrantAnswer {
    /// The bid now holds the key — or, for SETNX, the key holds the live lease that an earlier
    /// acquire with the bid's request id produced, and this is that lease again.
    Granted(Lease),
    /// SETNX: the key holds a lease (live or expired). Takeover: another contender took it over
    /// or claimed it first, or its holder renewed it. Nothing was written either way.
    Refused,
    /// A store-wide hold is in force: no key is granted until it ends (see [`Hold`]).
    OnHold(Hold),
    /// The bid waits (see [`Bid::wait_ms`]) and is in the key's queue now: it joined it, or it
    /// was there already and kept its place. The key will be offered to it when its turn comes
    /// ([`Notice::Offered`]). `retry_after_ms`: when the lease (or offer) now in the key ends at
    /// the latest, on the store's clock — when a broker with bids queued on the key asks again
    /// if no notice came (an offer to a broker that died must pass on).
    Queued { retry_after_ms: u64 },
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

/// What GET saw: the lease in the key (expired or not), with the store's clock at that moment,
/// and the key's live shared holders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub now_ms: u64,
    pub lease: Option<Lease>,
    /// The live shared leases, by fence (none while an exclusive lease is live).
    pub shared: Vec<Lease>,
}

/// A semaphore's live holders, with the store's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permits {
    pub now_ms: u64,
    /// The limit the holders took their permits with; `None` when nobody holds one.
    pub limit: Option<u32>,
    /// By fence.
    pub holders: Vec<Lease>,
}

/// One key with live leases, as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: LockKey,
    /// `None` for a semaphore.
    pub mode: Option<Mode>,
    /// A semaphore's limit.
    pub limit: Option<u32>,
    /// The live leases, by fence (one for an exclusive lock).
    pub holders: Vec<Lease>,
}

/// A page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub now_ms: u64,
    pub entries: Vec<Listed>,
    /// Where the next page starts; `None` on the last page. Opaque to clients.
    pub next_cursor: Option<String>,
}

/// What a listing asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    pub space: Space,
    /// Keys starting with this ('' for all).
    pub prefix: String,
    /// At most this many entries (1 ..= `MAX_LIST_LIMIT`).
    pub limit: usize,
    /// A `next_cursor` an earlier page gave, or `None` for the first page.
    pub cursor: Option<String>,
}

/// The most entries one listing page holds.
pub const MAX_LIST_LIMIT: usize = 1_000;

/// A release done: how long the lease had been held, on the store's clock (renewals included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    pub held_ms: u64,
}

/// The answer to a holder-checked operation (release, renew).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsHolder<T> {
    /// The token holds a live lease, and the operation was done.
    Done(T),
    /// Nobody holds the key: it is absent or its lease expired.
    NotHeld,
    /// Someone else's live lease is in the key.
    NotOwner,
    /// The key holds no live lease, but a store-wide hold is in force: the lease may be about to
    /// be put back, so "not held" would be a guess.
    OnHold(Hold),
}

/// What a store tells the lock service's waiters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The key was offered to this broker's queued bid with this token: the bid takes it by
    /// asking again (claim or join, with the same bid) before the offer lapses, which is within
    /// the store's offer window (about the store timeout). A broker with no waiter of that
    /// token (it left) calls [`Store::leave`] so that the key passes on at once.
    Offered(Space, LockKey, Token),
    /// This broker has a bid in the key's queue that may come next, behind an offer to another
    /// broker: if nothing else wakes it, its first waiter on the key asks again in this many
    /// ms, when that offer lapses if it was not taken (its broker may have died), so that the
    /// key passes on.
    Look(Space, LockKey, u64),
    /// This broker's queued bids on the key were dropped from the queue (an offer to one of
    /// them lapsed): each of its waiters on the key asks again, joining the queue anew.
    Requeue(Space, LockKey),
    /// The holders of the key changed through another broker (a grant, a release, a takeover, a
    /// force release): this broker's watchers of the key read it again (one read per key, for
    /// all of them). Changes made through this broker wake its watchers without a notice.
    Changed(Space, LockKey),
    /// Notices may have been missed (the notice connection was down), or the store lost its
    /// queues (a loss): every waiter asks again, which puts it back in its key's queue.
    Missed,
}

/// How long a [`Store::mark_watched`] mark lasts; a broker with watches on the key renews it
/// well before it ends.
pub const WATCH_MARK: std::time::Duration = std::time::Duration::from_secs(60);

/// Room for notices not yet handed to waiters. A full channel drops a notice; waiters still wake
/// at the holder's expiry and on their fallback poll, and an offer not taken lapses and passes
/// on, so a burst costs latency, never a grant.
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
    /// A listing cursor this store did not give out (or from another store): the client's
    /// mistake, not the store's.
    #[error("the cursor is not one this broker gave out")]
    BadCursor,
}

/// Slack added to a lease's logical expiry for the store's own expiry of the key (Redis
/// PEXPIRE): a safety net so abandoned keys do not pile up, far enough past the logical expiry
/// that the logical timestamp stays the truth even if the store's clock is stepped.
pub const EXPIRY_SLACK_MS: u64 = 60_000;

/// The primitives the algorithm needs. Each call is one atomic step on the store.
pub trait Store: Send + Sync + 'static {
    /// SETNX: grants the bid if the key holds nothing and nobody waits in its queue, taking the
    /// next fence in the same step.
    ///
    /// A bid that does not wait: a key whose lease expired is *not* free here; the algorithm
    /// reads it and takes it over, so that exactly one contender wins it. A bid that waits
    /// ([`Bid::waits`]) never gets `Refused`: in the same step it takes an offer made to its
    /// token (the key is then its for its whole TTL from now), is granted a key that holds
    /// nothing live with nobody ahead of it in the queue (an expired lease or a lapsed offer is
    /// ended then, and the queue's head is offered the key first if it is not this bid), or
    /// joins the queue (keeping its place if it is in it) and answers `Queued`.
    fn claim(
        &self,
        key: &LockKey,
        bid: &Bid,
    ) -> impl Future<Output = StoreResult<GrantAnswer>> + Send;

    /// Several keys in one step, when every one is free: grants `bid` an exclusive lease on each
    /// key of `keys` (distinct) if each holds no lease (live or expired) and nobody queues for it
    /// or shares it — a fence per key, as [`Store::claim`] takes it — and writes nothing
    /// otherwise. `Ok(None)`: not granted (some key is not free, a store-wide hold is in force),
    /// or the store does not do it in one step for these keys; the caller then takes the keys
    /// one by one through their queues, which also finds a request id's earlier grant. The bid
    /// does not wait here, and is not under a session.
    fn claim_all(
        &self,
        _keys: &[LockKey],
        _bid: &Bid,
    ) -> impl Future<Output = StoreResult<Option<Vec<Lease>>>> + Send {
        std::future::ready(Ok(None))
    }

    /// GET: the lease in the key, with the store's clock.
    fn read(&self, key: &LockKey) -> impl Future<Output = StoreResult<Snapshot>> + Send;

    /// GETSET made safe: grants the bid if the key still holds the lease with fence `seen` and
    /// it has expired, or if the key has vanished; otherwise writes nothing. With bids waiting in
    /// the key's queue, the key goes to the queue's head instead (offered in this step) and the
    /// bid is refused: a bid that does not wait never goes ahead of the queue.
    fn take_over(
        &self,
        key: &LockKey,
        seen: Fence,
        bid: &Bid,
    ) -> impl Future<Output = StoreResult<GrantAnswer>> + Send;

    /// Ends `token`'s live lease on `key` in `space`: the exclusive lease or a shared one on a
    /// lock, a permit of a semaphore. "Not owner" when another lease on the key is live. What
    /// the release frees is offered to the queue's head in the same step.
    fn release(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> impl Future<Output = StoreResult<AsHolder<Released>>> + Send;

    /// Moves the expiry of `token`'s live lease on `key` in `space` as `how` says.
    fn renew(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
        how: Renewal,
    ) -> impl Future<Output = StoreResult<AsHolder<Lease>>> + Send;

    /// Grants the bid a shared lease on a lock, or a semaphore permit, if the pool has room and
    /// nobody waits ahead of it in the queue: one atomic step, expired holders dropped on the way,
    /// the fence taken in the same step. A bid that waits takes an offer made to its token, or
    /// joins the queue, as [`Store::claim`] says; consecutive shared bids at the queue's head are
    /// offered the key together, and permits go to the head's bids while there is room.
    fn join(
        &self,
        key: &LockKey,
        pool: Pool,
        bid: &Bid,
    ) -> impl Future<Output = StoreResult<Join>> + Send;

    /// A semaphore's live holders.
    fn permits(&self, key: &LockKey) -> impl Future<Output = StoreResult<Permits>> + Send;

    /// The queued bid with `token` stops waiting (its wait ran out, its client went away, or
    /// the broker shuts down): its queue entry goes, and an offer made to it and not taken yet
    /// ends, the key passing on to the next in line in the same step. A lease the token holds
    /// (a taken offer, a grant) is left alone: that is [`Store::release`]'s job.
    fn leave(
        &self,
        space: Space,
        key: &LockKey,
        token: &Token,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Ends every live lease on `key` in `space`, without their tokens. `Done` with the ended
    /// leases' fences (never empty), `NotHeld` when there was none. The key is offered to the
    /// queue's head in the same step (a lease offered and not taken yet is ended too).
    fn force_release(
        &self,
        space: Space,
        key: &LockKey,
    ) -> impl Future<Output = StoreResult<AsHolder<Vec<Fence>>>> + Send;

    /// A page of the keys in `query.space` that have live leases and start with the prefix.
    fn list(&self, query: &ListQuery) -> impl Future<Output = StoreResult<Page>> + Send;

    /// The cursors `list` takes, as a regular expression for the API's document: every string
    /// it matches is taken (none is refused as [`StoreError::BadCursor`]), and every cursor
    /// the store gives out matches it. `None`: not said.
    fn cursor_pattern(&self) -> Option<&'static str> {
        None
    }

    /// Whether a free key would be granted now (for `/readyz`): an error if the store does not
    /// answer, the hold in force if there is one.
    fn ready(&self) -> impl Future<Output = StoreResult<Option<Hold>>> + Send;

    /// Starts the store's background work, which ends when `notices` closes: from now on every
    /// release notice (a release, or a renew that shortens a lease), including those of other
    /// brokers sharing the store, goes to `notices`. Delivery is best effort: waiters also wake
    /// at the holder's expiry and on a slow fallback poll.
    fn start(&self, notices: mpsc::Sender<Notice>);

    /// Whether every change to a key's holders reaches this broker: made through it, or announced
    /// by [`Notice::Changed`] (expiries aside, which a watcher times itself). When not (several
    /// brokers share a store that does not announce changes), watchers also read their key again
    /// on a slow fallback timer.
    fn sees_every_change(&self) -> bool {
        false
    }

    /// Marks `key` in `space` watched for [`WATCH_MARK`]: until then, the store announces every
    /// change to its holders made through any broker ([`Notice::Changed`]). `true` if it does;
    /// `false` for a store that never announces them (its watchers keep their fallback read).
    /// The mark is made before the read that follows it, so no change after that read goes
    /// unannounced.
    fn mark_watched(
        &self,
        _space: Space,
        _key: &LockKey,
    ) -> impl Future<Output = StoreResult<bool>> + Send {
        std::future::ready(Ok(self.sees_every_change()))
    }

    /// One call on the session `id`'s record (see [`SessionOp`]): the record after it, or
    /// `None` when the session does not exist or has ended.
    fn session(
        &self,
        id: &Token,
        op: SessionOp<'_>,
    ) -> impl Future<Output = StoreResult<Option<SessionRecord>>> + Send;

    /// A session's keep-alive on its leases: each entry's lease moved to end at `until_ms`
    /// unless it ends later already ([`Renewal::Until`]), answered entry by entry, in order.
    /// Here one [`Store::renew`] per lease, all at once; a store may do them in fewer calls
    /// (Redis: one script call for all of them on one server).
    fn renew_all(
        &self,
        entries: &[SessionEntry],
        until_ms: u64,
    ) -> impl Future<Output = Vec<StoreResult<AsHolder<Lease>>>> + Send {
        let until = Renewal::Until(until_ms);
        futures_util::future::join_all(
            entries
                .iter()
                .map(move |e| self.renew(e.space, &e.key, &e.token, until)),
        )
    }

    /// How many live leases this broker remembers to put back after a store loss (0 for a store
    /// that cannot lose them).
    fn ledger_len(&self) -> usize {
        0
    }
}
