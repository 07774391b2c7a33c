//! Several keys at once on Redis: CLAIM_ALL (`scripts/claim_all.lua`) grants every key of a
//! several-keys acquire in one script call when all of them are free and share a slot (always on
//! one Redis or a Sentinel's master; on a cluster only when they hash to one slot). Then, as for
//! one grant (`grant.rs`): the epoch it ran in, the wait for replicas (once: one write), and
//! every lease in the ledger.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::RedisStore;
use super::grant::{lease_of, newer_layout};
use super::keys::RedisKeys;
use super::scripts::{ClaimAll, NoGrant};
use lockbroker_core::domain::{Kind, Lease, LockKey, Space};
use lockbroker_core::store::{Bid, StoreResult};

impl RedisStore {
    /// Every key of `keys` for `bid` in one script call if each one is free, with its lease's
    /// fence; `None` when some key is not, the keys do not share a slot, or a store-wide hold is in
    /// force — nothing written then.
    pub(super) async fn grant_all(
        &self,
        keys: &[LockKey],
        bid: &Bid,
    ) -> StoreResult<Option<Vec<Lease>>> {
        let Some(first) = keys.first() else {
            return Ok(Some(Vec::new()));
        };
        let slot = self.layout.slot(first);
        if keys[1..].iter().any(|key| self.layout.slot(key) != slot) {
            return Ok(None);
        }
        let names: Vec<RedisKeys> = keys
            .iter()
            .map(|key| self.layout.names(Space::Locks, key))
            .collect();
        let marker = self.layout.marker_for(first);
        let (names, marker) = (&names[..], &*marker);
        let caller = self.broker.caller();
        let broker = caller.id;
        // The connection the write went over: its replicas are asked on that one.
        let carried = AtomicU64::new(0);
        let carried_by = &carried;
        let run_in = |epoch: String| async move {
            let call = ClaimAll {
                keys: names,
                marker,
                bid,
                epoch: &epoch,
                broker,
            };
            let (reply, generation) = self.keeper.run_tracked(&call).await?;
            carried_by.store(generation, Ordering::Relaxed);
            Ok(reply)
        };
        let (granted, epoch) = match self.keeper.grant_in_epoch(slot, run_in).await? {
            Ok(granted) => granted,
            Err(NoGrant::NewerLayout { layout }) => return Err(newer_layout(layout)),
            Err(_) => return Ok(None),
        };
        let answered = Instant::now();
        let remaining = Duration::from_millis(granted.expires_at_ms.saturating_sub(granted.now_ms));
        let lease = lease_of(granted, bid, Kind::Exclusive)?;
        if self.replicas.asked() {
            // Boxed: see `Replicas::asked`.
            Box::pin(self.replicas.confirm_grants(
                self,
                keys,
                &lease,
                carried.load(Ordering::Relaxed),
            ))
            .await?;
        }
        for key in keys {
            self.keeper.remember(
                key,
                Kind::Exclusive,
                slot,
                &lease,
                answered + remaining,
                &epoch,
            );
        }
        Ok(Some(vec![lease; keys.len()]))
    }
}
