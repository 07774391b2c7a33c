//! Several keys at once on Redis: CLAIM_ALL (`scripts/claim_all.lua`) grants every key of a
//! several-keys acquire in one script call when all of them are free and share a slot — always
//! on one Redis or a Sentinel's master. Then, as for one grant (`grant.rs`): the epoch it ran in,
//! the wait for replicas (once: one write), and every lease in the ledger. On a cluster, one
//! CLAIM_ALL per slot among the keys, all sent at once (one round trip); when some slot's keys
//! are not all free, the slots granted are released and the keys are taken one by one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use super::RedisStore;
use super::grant::{lease_of, newer_layout};
use super::keys::RedisKeys;
use super::scripts::{ClaimAll, NoGrant};
use lockbroker_core::domain::{Kind, Lease, LockKey, Space};
use lockbroker_core::store::{Bid, Store, StoreResult};

impl RedisStore {
    /// Every key of `keys` for `bid` if each one is free, with its lease's fence, in one script
    /// call per slot among them; `None` when some key is not or a store-wide hold is in force —
    /// nothing left written then.
    pub(super) async fn grant_all(
        &self,
        keys: &[LockKey],
        bid: &Bid,
    ) -> StoreResult<Option<Vec<Lease>>> {
        let mut slots: BTreeMap<Option<u16>, Vec<usize>> = BTreeMap::new();
        for (i, key) in keys.iter().enumerate() {
            slots.entry(self.layout.slot(key)).or_default().push(i);
        }
        if slots.len() <= 1 {
            return self.grant_in_slot(keys, bid).await;
        }
        let groups: Vec<Vec<LockKey>> = slots
            .values()
            .map(|at| at.iter().map(|&i| keys[i].clone()).collect())
            .collect();
        let answers = join_all(groups.iter().map(|group| self.grant_in_slot(group, bid))).await;
        let mut granted = Vec::with_capacity(groups.len());
        let mut refused = false;
        for answer in answers {
            match answer? {
                Some(leases) => granted.push(Some(leases)),
                None => {
                    refused = true;
                    granted.push(None);
                }
            }
        }
        if refused {
            // Some slot's keys were not all free: what the others granted goes back at once.
            let taken = groups.iter().zip(&granted).filter(|(_, g)| g.is_some());
            let releases = taken
                .flat_map(|(group, _)| group)
                .map(|key| self.release(Space::Locks, key, &bid.token));
            join_all(releases).await;
            return Ok(None);
        }
        let mut leases: Vec<Option<Lease>> = vec![None; keys.len()];
        for (at, group) in slots.values().zip(granted.into_iter().flatten()) {
            for (&i, lease) in at.iter().zip(group) {
                leases[i] = Some(lease);
            }
        }
        Ok(leases.into_iter().collect())
    }

    /// [`RedisStore::grant_all`] for keys that share a slot: one CLAIM_ALL.
    async fn grant_in_slot(&self, keys: &[LockKey], bid: &Bid) -> StoreResult<Option<Vec<Lease>>> {
        let Some(first) = keys.first() else {
            return Ok(Some(Vec::new()));
        };
        let slot = self.layout.slot(first);
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
            let link = self.replicas.link_for(self, first);
            let (reply, generation) = self.keeper.run_acked(&call, link).await?;
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
