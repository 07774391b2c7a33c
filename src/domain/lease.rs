//! The lease: the unit every layer shares. A grant of a lock is a lease with a token (proof of
//! holding), a fence (its place in the key's grant order) and an end on the store's clock.

use super::{Fence, Owner, RequestId, Token};

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
