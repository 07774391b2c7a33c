//! The lease: the unit every layer shares. A grant of a lock is a lease with a token (proof of
//! holding), a fence (its place in the key's grant order) and an end on the store's clock; its
//! vocabulary (the key space, the kind and mode of a lease, the pool it joins) is here too.

use super::{Fence, LockKey, Owner, RequestId, Token};

/// A lease as a broker grants it, the store keeps it and the API shows it.
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
    /// A semaphore permit: the limit it was taken with (`None` for a lock's leases, and where a
    /// store read does not say).
    pub limit: Option<u32>,
}

impl Lease {
    /// "A lease that has expired is not held, whatever the store still contains."
    pub fn is_live_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms
    }
}

/// The key spaces: a lock and a semaphore of the same name are unrelated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Space {
    Locks,
    Semaphores,
}

/// A key in its space (a lock and a semaphore of one name are two places): what a queue is for,
/// and what a watch is on.
pub type Place = (Space, LockKey);

/// What a lease on a lock key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One holder, alone.
    Exclusive,
    /// Any number of shared holders, never with an exclusive one.
    Shared,
}

/// A set of holders a bid may join: the shared holders of a lock, or a semaphore's permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// A shared lease on a lock key: granted while no exclusive lease is live (or offered) on the
    /// key and no exclusive bid waits in the key's queue ahead of it.
    Shared,
    /// One of `limit` permits of a semaphore (1 ..= `MAX_SEMAPHORE_LIMIT`).
    Semaphore { limit: u32 },
}

impl Pool {
    pub fn space(self) -> Space {
        match self {
            Pool::Shared => Space::Locks,
            Pool::Semaphore { .. } => Space::Semaphores,
        }
    }
}

/// What kind of lease an acquire asks for, and a broker remembers in its ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The lock alone: the SETNX/GETSET recipe.
    Exclusive,
    /// A shared lease on the lock, beside any other shared ones.
    Shared,
    /// One of `limit` permits of a semaphore.
    Semaphore { limit: u32 },
}

impl Kind {
    /// The key space the lease is in.
    pub fn space(self) -> Space {
        match self {
            Kind::Exclusive | Kind::Shared => Space::Locks,
            Kind::Semaphore { .. } => Space::Semaphores,
        }
    }

    /// The pool a shared lease or a permit joins; `None` for the lock alone.
    pub fn pool(self) -> Option<Pool> {
        match self {
            Kind::Exclusive => None,
            Kind::Shared => Some(Pool::Shared),
            Kind::Semaphore { limit } => Some(Pool::Semaphore { limit }),
        }
    }
}
