//! Putting leases back into a new epoch: every live lease of this broker's ledger (after a
//! loss, `check.rs`), the leases of one slot (after its marker was repaired), or one lease whose
//! answer raced a loss; and releasing again a lease released while it was being put back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;

use super::RedisStore;
use super::connection::Conn;
use super::epoch::{MARK_CONCURRENCY, PutBackReport, Shard};
use super::scripts::{LeaseBack, Placement, PutBack, PutBackReply};
use super::slots::slot_of;
use crate::ledger::Entry;
use lockbroker_core::domain::{Kind, LockKey, Space, Token, millis};
use lockbroker_core::store::{Holder, StoreError, StoreResult};

/// How many leases one put-back script call carries. Bounded so that one call stays short for
/// Redis (a script blocks the server while it runs).
pub(super) const PUT_BACK_BATCH: usize = 100;

impl RedisStore {
    /// Puts every live lease of the ledger on `shard` back into epoch `epoch`. `None` if the
    /// epoch moved meanwhile. On a cluster, one script call per slot (a script's keys must
    /// share a slot), several at once.
    pub(super) async fn put_back_all(
        &self,
        conn: &Conn,
        shard: &Shard,
        epoch: &str,
    ) -> StoreResult<Option<PutBackReport>> {
        let leases = self.ledger.live(Instant::now());
        let mut by_slot: BTreeMap<Option<u16>, Vec<(LockKey, Entry)>> = BTreeMap::new();
        for (key, entry) in leases {
            let slot = self
                .layout
                .cluster
                .then(|| slot_of(self.keys(&key)[0].as_bytes()));
            if slot.is_none_or(|slot| shard.holds(slot)) {
                by_slot.entry(slot).or_default().push((key, entry));
            }
        }
        let epoch: Arc<str> = epoch.into();
        let calls: Vec<_> = by_slot
            .into_iter()
            .flat_map(|(slot, leases)| {
                let marker = slot.map_or_else(|| self.layout.marker.clone(), |s| self.marker_of(s));
                leases
                    .chunks(PUT_BACK_BATCH)
                    .map(|batch| (marker.clone(), batch.to_vec()))
                    .collect::<Vec<_>>()
            })
            .map(|(marker, batch)| {
                let (store, mut conn, epoch) = (self.clone(), conn.clone(), epoch.clone());
                async move {
                    let mut report = PutBackReport::default();
                    let done = store
                        .put_back(&mut conn, &marker, &epoch, &batch, &mut report)
                        .await?;
                    Ok::<_, StoreError>(done.then_some(report))
                }
            })
            .collect();
        let mut calls =
            futures_util::stream::iter(calls).buffer_unordered(if self.layout.cluster {
                MARK_CONCURRENCY
            } else {
                1
            });
        let mut total = PutBackReport::default();
        while let Some(batch) = calls.next().await {
            let Some(report) = batch? else {
                return Ok(None);
            };
            total.add(&report);
        }
        Ok(Some(total))
    }

    /// Puts `batch` back; `false` if the store is no longer in `epoch`.
    async fn put_back(
        &self,
        conn: &mut Conn,
        marker: &str,
        epoch: &str,
        batch: &[(LockKey, Entry)],
        report: &mut PutBackReport,
    ) -> StoreResult<bool> {
        let now = Instant::now();
        let put_back = PutBack {
            marker,
            epoch,
            broker: &self.broker.id,
            leases: batch
                .iter()
                .map(|(key, entry)| LeaseBack {
                    keys: self.names(entry.kind.space(), key),
                    entry,
                    remaining_ms: millis(entry.remaining(now)).max(1),
                })
                .collect(),
        };
        // Inside the check: a NOSCRIPT here needs no other check first.
        let placed = match self.run_unchecked(conn, &put_back).await? {
            PutBackReply::OtherEpoch => return Ok(false),
            PutBackReply::Placed(placed) if placed.len() == batch.len() => placed,
            PutBackReply::Placed(_) => {
                return Err(StoreError::Failed(
                    "Redis answered the put_back script with a reply per lease for another \
                     number of leases"
                        .into(),
                ));
            }
        };
        for ((key, entry), placed) in batch.iter().zip(placed) {
            report.counters_raised += usize::from(placed.counter_raised);
            let kept = !matches!(placed.outcome, Placement::OtherKept { .. });
            match placed.outcome {
                Placement::Written => report.written += 1,
                Placement::AlreadyThere => report.already_there += 1,
                Placement::OtherKept { fence: other } => {
                    report.double_claims += 1;
                    tracing::error!(
                        %key, kept_fence = other, dropped_fence = entry.fence,
                        "a lock had two holders after a store loss; the lease with the higher \
                         fence stays, the other holder's next renew answers not_owner"
                    );
                    self.ledger
                        .forget_any(entry.kind.space(), key, &entry.token);
                }
                Placement::OtherReplaced { fence: other } => {
                    report.double_claims += 1;
                    report.written += 1;
                    tracing::error!(
                        %key, kept_fence = entry.fence, dropped_fence = other,
                        "a lock had two holders after a store loss; the lease with the higher \
                         fence stays, the other holder's next renew answers not_owner"
                    );
                }
            }
            if kept && !self.ledger.holds(key, entry.kind, &entry.token) {
                // Released while the put-back ran: release it again, or it would block its key
                // until it ends.
                self.release_again(
                    entry.kind.space(),
                    key.clone(),
                    entry.token.clone(),
                    entry.remaining(now),
                );
            }
        }
        Ok(true)
    }

    /// Cluster: puts this broker's live leases on `slot` back (after a repair of its marker).
    pub(super) async fn put_back_slot(&self, slot: u16) -> StoreResult<()> {
        let _one = self.epoch.catching_up.lock().await;
        let Ok(epoch) = self.epoch.for_grant(Some(slot)) else {
            return Ok(());
        };
        let Some(link) = self.connection.current() else {
            return Ok(());
        };
        let mut conn = link.conn.clone();
        let marker = self.marker_of(slot);
        let leases: Vec<(LockKey, Entry)> = self
            .ledger
            .live(Instant::now())
            .into_iter()
            .filter(|(key, _)| self.slot(key) == Some(slot))
            .collect();
        let mut report = PutBackReport::default();
        for batch in leases.chunks(PUT_BACK_BATCH) {
            self.put_back(&mut conn, &marker, &epoch, batch, &mut report)
                .await?;
        }
        if report.written > 0 {
            tracing::warn!(
                slot,
                put_back = report.written,
                "put leases back on a repaired slot"
            );
            self.metrics.leases_put_back(report.written);
        }
        Ok(())
    }

    /// Releases a lease put back after its holder had released it, retrying (the store may still
    /// be on its way back, or the hold in force) until a definite answer or the lease's end.
    fn release_again(&self, space: Space, key: LockKey, token: Token, remaining: Duration) {
        let store = self.clone();
        tokio::spawn(async move {
            let give_up = Instant::now() + remaining;
            let mut pause = Duration::from_millis(50);
            loop {
                match lockbroker_core::store::Store::release(&store, space, &key, &token).await {
                    Ok(Holder::OnHold(_)) | Err(_) if Instant::now() + pause < give_up => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(1));
                    }
                    _ => return,
                }
            }
        });
    }

    /// A lease recorded under an epoch older than the newest one seen may have missed the
    /// put-back (its answer raced the loss): put it back on its own.
    pub(super) fn put_back_late(&self, key: LockKey, kind: Kind, token: Token) {
        let store = self.clone();
        tokio::spawn(async move {
            let Some(link) = store.connection.current() else {
                // The next connection's check puts every lease back.
                return;
            };
            let mut conn = link.conn.clone();
            let _one = store.epoch.catching_up.lock().await;
            let slot = store.slot(&key);
            let Ok(epoch) = store.epoch.for_grant(slot) else {
                return;
            };
            let Some(entry) = store.ledger.get(&key, kind, &token) else {
                return;
            };
            let mut report = PutBackReport::default();
            let marker = store.marker_for(&key);
            match store
                .put_back(&mut conn, &marker, &epoch, &[(key, entry)], &mut report)
                .await
            {
                Ok(true) => store.metrics.leases_put_back(report.written),
                // The epoch moved (or the call failed): a full check catches up.
                _ => store.epoch.wake.notify_one(),
            }
        });
    }
}
