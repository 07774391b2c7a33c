//! The store as one atomic actor: its state and `apply(call) -> (answer, notices)`, each
//! operation one Lua script of `redis-store/src/scripts/` (named after it), run whole.
//!
//! Pure and deterministic: the model checker (`crate::model`) and the differential test
//! (`tests/differential.rs`, against the real scripts on a real Redis) drive the same steps.
//!
//! Abstractions, each chosen so that what the scripts decide stays the same:
//! - Time has two clocks, as in Redis: `us` (TIME in µs, which fences are compared with) moves
//!   forward by [`US_STEP`] at every script — more than the fences any one script takes, the
//!   documented assumption "fewer than one grant per µs" — and the lease clock moves in whole
//!   ticks ([`Op::Tick`]). Ends are kept as ticks left (0: ended), so the state stays finite.
//! - Redis's own key expiry (`PEXPIRE` with 60 s of slack) is one operation, [`Op::Slack`]: a
//!   key with nothing live and nobody queued loses its records and its fence counter.
//! - Bids have no deadline in the store: a waiter that stops waiting calls LEAVE (the real
//!   broker does too); a dead broker's bids stay until the queue drops them (requeue).
//! - A session's record ([`SessionRec`]) is kept with its end as ticks left; the tick that ends
//!   it drops it (an ended record answers as a missing one). Of an owner label only the session
//!   mark is kept ([`Lease::session`]): a renewal by TTL keeps such a lease's end.
//! - Request ids, owners' labels, watches (`changed`) and the layout check are left out.

mod bugs;
mod epoch;
mod fast;
mod queue;
mod scripts;
mod session;

pub use bugs::Bug;

/// A fence; the checker renumbers them (order kept) so that states stay few.
pub type Fence = u64;
/// A broker's id (0..).
pub type Broker = u8;
/// A key's index.
pub type Key = u8;
/// How far `us` moves per script: more than the fences one script takes.
pub const US_STEP: Fence = 64;

/// A token: one acquire of one client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token {
    pub client: u8,
    pub attempt: u8,
}

/// A lease's kind: `x` exclusive, `s` shared, or a permit of a semaphore of that limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Exclusive,
    Shared,
    Permit(u8),
}

/// A lease or an offer (a lease in a queued bid's name that its broker has not taken yet).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lease {
    pub token: Token,
    pub fence: Fence,
    /// Ticks until its end; 0: ended (the record lingers until a script settles it).
    pub left: u8,
    pub offered: bool,
    /// The brokers that answer its holder (`by`), as a bit set.
    pub by: u8,
    /// Held under a session (its owner label carries the session mark): a renewal without
    /// `until` keeps its end.
    pub session: bool,
}

impl Lease {
    pub fn live(&self) -> bool {
        self.left > 0
    }
}

/// A queued bid (`<broker>|<deadline>|<kind>|<ttl>|...` in the bids hash).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bid {
    pub token: Token,
    pub broker: Broker,
    pub kind: Kind,
    pub ttl: u8,
    /// Under a session: the lease it gets carries the session mark.
    pub session: bool,
}

/// One key: the exclusive lease record, the pool (shared leases or permits), the queue and the
/// fence counter. A lock key may have both a lease record and a pool; a semaphore only a pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct KeyState {
    pub lock: Option<Lease>,
    /// By token.
    pub pool: Vec<Lease>,
    /// A semaphore pool's `#limit`.
    pub limit: Option<u8>,
    pub queue: Vec<Bid>,
    pub counter: Option<Fence>,
}

/// The epoch marker: its id, and the ticks left of the store-wide hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Marker {
    pub id: u8,
    pub hold: u8,
}

/// What a store tells a broker on its channel (`<prefix>b:<id>`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Notice {
    /// `o`: the key was offered to this token.
    Offered(Key, Token),
    /// `l`: look again in this many ticks.
    Look(Key, u8),
    /// `r`: this broker's bids on the key were dropped; its waiters join anew.
    Requeue(Key),
    /// `d` / `D`: a lease it remembers ended (`all`: every lease up to the fence).
    Ended(Key, Fence, bool),
}

/// The store's fixed parameters, in ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Params {
    /// How long an offer stays open (`window`, the store timeout).
    pub window: u8,
    /// The hold of a new epoch (`store_settle_ms`).
    pub settle: u8,
    /// PUT_BACK's own hold (`PUT_BACK_HOLD_MS`).
    pub put_back_hold: u8,
    /// A known-bad variant, or none.
    pub bug: Option<Bug>,
}

/// The whole store.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Store {
    pub keys: Vec<KeyState>,
    pub marker: Option<Marker>,
    /// Redis's clock in µs (see the module's doc).
    pub us: Fence,
    /// The next epoch id a CHECK writes (epoch ids are never reused).
    pub next_epoch: u8,
    /// Session records by id (`<prefix>session:{<id>}`); `None`: none, or ended (an ended
    /// record answers as a missing one, so the tick that ends it drops it).
    pub sessions: Vec<Option<SessionRec>>,
}

/// A session's record (session.lua): its TTL, ticks until its end, its lock delay, and the
/// leases entered under it (by key and token).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SessionRec {
    pub ttl: u8,
    pub left: u8,
    pub delay: u8,
    pub entries: Vec<(Key, Token)>,
}

impl SessionRec {
    /// Ticks until its leases end (`leases_end_ms`): its end plus the lock delay.
    pub fn leases_left(&self) -> u8 {
        self.left + self.delay
    }
}

/// One SESSION call (`SessionOp`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SessionOp {
    Open {
        ttl: u8,
        delay: u8,
    },
    /// The keep-alive's record step: the end moves to its TTL from now.
    Renew,
    Read,
    Close,
    Enter(Key, Token),
    Drop(Key, Token),
}

/// A lease a broker puts back (one of PUT_BACK's seven-field groups).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Back {
    pub key: Key,
    pub kind: Kind,
    pub token: Token,
    pub fence: Fence,
    pub left: u8,
    pub session: bool,
}

/// One script call. `known`: the epoch the calling broker knows.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Claim {
        key: Key,
        bid: Bid,
        wait: bool,
    },
    TakeOver {
        key: Key,
        bid: Bid,
        seen: Fence,
    },
    Join {
        key: Key,
        bid: Bid,
        wait: bool,
    },
    /// CLAIM_ALL: an exclusive lease on every key of `keys` (distinct) for `bid` in this one
    /// step if each is free as the fast claim finds a key free, with the clock as every key's
    /// fence; nothing written otherwise (`Refused`).
    ClaimAll {
        keys: Vec<Key>,
        bid: Bid,
    },
    /// RELEASE; `direct` (context kind `g`, what the Redis store sends for a lock key without
    /// replica acks): the hand-on grants the key straight to the queue's head if it is an
    /// exclusive bid of the caller's own broker not under a session, instead of offering it.
    Release {
        key: Key,
        token: Token,
        direct: bool,
    },
    /// BATCH: claims and releases, each the common case of CLAIM's or RELEASE's fast path, with
    /// one clock and one `checked` for all; one answer each, in order ([`Answer::Slow`]: not the
    /// common case, nothing written).
    Batch {
        ops: Vec<BatchOp>,
    },
    /// RENEW: the end moves to `ttl` from now, or with `until` to that many ticks from now
    /// unless it ends later already (a lease under a session keeps its end without `until`).
    Renew {
        key: Key,
        token: Token,
        ttl: u8,
        until: Option<u8>,
    },
    /// SESSION: one call on session `id`'s record.
    Session {
        id: u8,
        op: SessionOp,
    },
    /// KEEP: RENEW's `until` form on each lease in turn (a session's keep-alive).
    Keep {
        until: u8,
        leases: Vec<(Key, Token)>,
    },
    Force {
        key: Key,
    },
    Leave {
        key: Key,
        token: Token,
    },
    /// READ: the lease record (expired or not).
    Read {
        key: Key,
    },
    PutBack {
        epoch: u8,
        leases: Vec<Back>,
    },
    Check,
    /// Time passes: one tick of the lease clock.
    Tick,
    /// FLUSHALL, or a restart without persistence: everything is gone.
    Flush,
    /// Redis's own expiry of a key's records long after their ends (the 60 s slack).
    Slack {
        key: Key,
    },
}

/// One operation of a BATCH call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BatchOp {
    /// `c`: an exclusive claim, granted only if the key is free as the fast claim finds it.
    Claim { key: Key, bid: Bid },
    /// `r`: the release of the token's exclusive lease, only as the fast release does it.
    Release { key: Key, token: Token },
}

/// A call: who runs it and in which epoch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Call {
    pub broker: Broker,
    pub known: Option<u8>,
    pub op: Op,
}

/// What a PUT_BACK answers for one lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackCode {
    AlreadyThere,
    Written,
    OtherKept,
    OtherReplaced,
}

/// A script's reply, by its codes in `lib/prelude.lua`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    Granted {
        token: Token,
        fence: Fence,
        left: u8,
    },
    Refused,
    Queued {
        retry: u8,
    },
    OnHold {
        left: u8,
    },
    OtherEpoch,
    NoRoom,
    /// RELEASE/RENEW of the token's lease (its fence).
    Held {
        fence: Fence,
    },
    /// RELEASE (`direct`) of the token's lease (its fence) that granted the key straight to a
    /// queued bid of the caller's own broker: that grant (its token, fence, ticks left).
    Handed {
        fence: Fence,
        token: Token,
        granted: Fence,
        left: u8,
    },
    NotHeld,
    NotOwner,
    HoldInForce,
    /// FORCE: the fences of the live leases it ended.
    Forced(Vec<Fence>),
    /// LEAVE: whether an offer ended.
    Left(bool),
    PutBack(Vec<BackCode>),
    EpochMoved,
    /// CHECK: the current epoch.
    Epoch(u8),
    /// READ: the lease record's fence and whether it is live.
    Record(Option<(Token, Fence, bool)>),
    /// SESSION: the record as the call left it (close: as it was), or none (missing, ended).
    Session(Option<SessionRec>),
    /// KEEP: one RENEW answer per lease.
    Kept(Vec<Answer>),
    /// BATCH: one answer per operation, in order.
    Batch(Vec<Answer>),
    /// A BATCH operation that is not the common case: nothing written; its broker runs it alone.
    Slow,
    /// TICK, FLUSH, SLACK.
    Done,
}

/// What one script did, for the checker's properties.
#[derive(Clone, Debug, Default)]
pub struct Effects {
    pub notices: Vec<(Broker, Notice)>,
    /// Every fence taken by a grant or an offer (key, fence), in order.
    pub fences: Vec<(Key, Fence)>,
    /// Keys on which a lease or offer ended in this step and whose queue could be handed on.
    pub freed: Vec<Key>,
}

impl Store {
    /// A store in epoch 0 with `keys` keys, nothing held.
    pub fn new(keys: usize) -> Self {
        Store {
            keys: vec![KeyState::default(); keys],
            marker: Some(Marker { id: 0, hold: 0 }),
            us: US_STEP,
            next_epoch: 1,
            sessions: Vec::new(),
        }
    }

    /// Runs one script atomically.
    pub fn apply(&mut self, p: &Params, call: &Call) -> (Answer, Effects) {
        let mut fx = Effects::default();
        if !matches!(call.op, Op::Tick | Op::Flush | Op::Slack { .. }) {
            self.us += US_STEP;
        }
        let answer = scripts::run(self, p, call, &mut fx);
        (answer, fx)
    }

    /// Whether the epoch `known` may hand keys on (`holder_context`'s `c.hand`).
    pub fn hand(&self, known: Option<u8>) -> bool {
        matches!(self.marker, Some(m) if Some(m.id) == known && m.hold == 0)
    }
}
