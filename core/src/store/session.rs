//! Sessions in the store: one record per session — its end on the store's clock, its TTL, label
//! and lock delay, and the leases taken under it — kept by one keep-alive for all of them.
//!
//! The record is one store key of its own (on Redis Cluster, a slot of its own), and a lease
//! under a session is an ordinary lease in its key's record whose end is the session's (plus
//! the lock delay) and whose label says "under a session" ([`Owner::for_session`]). So every
//! script that grants, hands on, expires or lists a lease works on session leases unchanged,
//! and a session call never touches a lease's key: the lock service keeps them in step — an
//! acquire under a session enters its lease in the record before the grant and confirms it
//! after; a keep-alive moves the record's end and then every entered lease's end to it
//! ([`Renewal::Until`](super::Renewal::Until), which never shortens one); a close ends the
//! record and then releases every entered lease.
//!
//! [`Owner::for_session`]: crate::domain::Owner::for_session

use crate::domain::{LockKey, Owner, RequestId, Space, Token, Ttl};

/// What `POST /sessions` asks for.
#[derive(Debug, Clone)]
pub struct SessionSpec {
    pub ttl: Ttl,
    pub owner: Option<Owner>,
    /// How long the keys of a session that ended by expiry stay held after its end.
    pub lock_delay_ms: u64,
    /// Opening again with the same id while the session it opened lives answers that session.
    pub request_id: Option<RequestId>,
}

/// The longest lock delay.
pub const MAX_LOCK_DELAY_MS: u64 = 60_000;

/// A lease entered in a session's record: where it is, and its token (kept in the store, as
/// every lease's token is; never shown). Entries are the same entry when they name the same
/// lease, whenever they were entered.
#[derive(Debug, Clone)]
pub struct SessionEntry {
    pub space: Space,
    pub key: LockKey,
    pub token: Token,
    /// When it was last entered, on the store's clock (set by the store; 0 in a call).
    pub entered_ms: u64,
}

impl PartialEq for SessionEntry {
    fn eq(&self, other: &Self) -> bool {
        (self.space, &self.key, &self.token) == (other.space, &other.key, &other.token)
    }
}

impl Eq for SessionEntry {}

/// How long an entry whose lease is not found stays in its session's record after it was last
/// entered: an acquire in flight (its grant not yet confirmed, or still waiting — a waiting
/// acquire enters its lease again every couple of seconds) must stay there, so that a close
/// finds its lease if its broker dies between the grant and the confirmation. Older entries of
/// leases gone (released by token, force-released, never granted) leave at a keep-alive.
pub const ENTRY_GRACE_MS: u64 = 30_000;

/// A live session as the store has it, with the store's clock.
#[derive(Debug, Clone)]
pub struct SessionRecord {
    pub id: Token,
    pub now_ms: u64,
    pub ttl_ms: u64,
    /// On the store's clock.
    pub expires_at_ms: u64,
    pub owner: Option<Owner>,
    pub lock_delay_ms: u64,
    /// The leases entered under it, in no particular order. An entry whose lease has ended
    /// (released by its token, force-released, or a grant that never came) stays until a
    /// keep-alive finds it gone, [`ENTRY_GRACE_MS`] after it was last entered.
    pub entries: Vec<SessionEntry>,
}

impl SessionRecord {
    /// When the leases under the session end on the store's clock: the session's end plus its
    /// lock delay (a close or a release ends them sooner, without the delay).
    pub fn leases_end_ms(&self) -> u64 {
        self.expires_at_ms + self.lock_delay_ms
    }
}

/// One call on a session's record. Every call but `Open` answers `None` when the session does
/// not exist or has ended (its end passed on the store's clock), and writes nothing then.
#[derive(Debug, Clone, Copy)]
pub enum SessionOp<'a> {
    /// Makes the session with the call's id — or, when the spec's request id opened a session
    /// that still lives, answers that one (with its own id).
    Open(&'a SessionSpec),
    /// Moves the session's end to its TTL (or this one, which becomes its TTL) from now.
    Renew(Option<Ttl>),
    Read,
    /// Ends the session now; answers the record as it was, entries and all.
    Close,
    /// Enters a lease under the session, or again (its entry's time moves to now).
    Enter(&'a SessionEntry),
    /// Takes an entry out.
    Drop(&'a SessionEntry),
}
