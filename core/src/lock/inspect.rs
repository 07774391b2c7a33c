//! Reading without changing: who holds a lock or a semaphore's permits, and which keys have
//! live leases.

use super::{HoldersView, LockError, LockService};
use crate::domain::{LockKey, Mode};
use crate::metrics::StoreOp;
use crate::store::{ListQuery, Page, Store};

impl<S: Store> LockService<S> {
    /// The live leases on the lock `key`: the exclusive one, or the shared ones.
    pub async fn inspect(&self, key: &LockKey) -> Result<HoldersView, LockError> {
        let snapshot = self.timed(StoreOp::read, self.store.read(key)).await?;
        let now_ms = snapshot.now_ms;
        let (mode, holders) = match snapshot.lease {
            Some(lease) if lease.is_live_at(now_ms) => (Mode::Exclusive, vec![lease]),
            _ if !snapshot.shared.is_empty() => (Mode::Shared, snapshot.shared),
            _ => return Err(LockError::NotHeld),
        };
        Ok(HoldersView {
            now_ms,
            mode: Some(mode),
            limit: None,
            holders,
        })
    }

    /// The live permits of the semaphore `key`, with the limit they were taken with.
    pub async fn permits(&self, key: &LockKey) -> Result<HoldersView, LockError> {
        let permits = self.timed(StoreOp::read, self.store.permits(key)).await?;
        match permits.limit {
            Some(limit) if !permits.holders.is_empty() => Ok(HoldersView {
                now_ms: permits.now_ms,
                mode: None,
                limit: Some(limit),
                holders: permits.holders,
            }),
            _ => Err(LockError::NotHeld),
        }
    }

    /// A page of the keys in `query.space` with live leases.
    pub async fn list(&self, query: &ListQuery) -> Result<Page, LockError> {
        Ok(self.timed(StoreOp::list, self.store.list(query)).await?)
    }
}
